"""What every config section shares: the error type, the choice types, the declared numeric ranges, and the
checks that name the key, the value, what is valid and the fix.

Choices are Literal types: OmegaConf (>= 2.4) refuses any other value at load, `typed()` hands out fields
typed with them, and each section's check() repeats the membership test for dataclasses built in code.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, get_args, get_origin, get_type_hints

from app.errors import UserError

Partial = Literal["off", "keep", "resubmit", "finish_on_old"]
BehaviourLogprobs = Literal["engine", "trainer"]
OverBound = Literal["train", "regenerate"]
LossAgg = Literal["token_mean", "seq_mean"]
KlKind = Literal["k1", "k3", "low_var_kl"]
Truncation = Literal["drop", "error"]
Backend = Literal["auto", "gloo", "nccl"]
Scaling = Literal["auto", "external"]
Dtype = Literal["float32", "bfloat16"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]

PARTIAL: tuple[str, ...] = get_args(Partial)
OVER_BOUND: tuple[str, ...] = get_args(OverBound)
LOSS_AGG: tuple[str, ...] = get_args(LossAgg)
KL_KINDS: tuple[str, ...] = get_args(KlKind)
TRUNCATION: tuple[str, ...] = get_args(Truncation)
BACKENDS: tuple[str, ...] = get_args(Backend)
SCALING: tuple[str, ...] = get_args(Scaling)
DTYPES: tuple[str, ...] = get_args(Dtype)
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)


class ConfigError(UserError, ValueError):
    """A config key or value is wrong; the message names the key and what would be valid."""


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric key; every float must also be finite (no nan, no inf)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""

    def holds(self, v: float) -> bool:
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def text(self) -> str:
        if self.lo is None and self.hi is None:
            return "finite"
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


def rng(spec: str, why: str = "") -> Range:
    """`> 0`, `>= 1`, `[0, 1)`, `(0, 1]`, ... or `finite`; `why` says what a value outside would do."""
    s = spec.replace(" ", "")
    if s == "finite":
        return Range(why=why)
    if s.startswith(">"):
        return Range(lo=float(s.lstrip(">=")), lo_open=not s.startswith(">="), why=why)
    m = re.fullmatch(r"([\[(])([-+0-9.e]+),([-+0-9.e]+)([\])])", s)
    if not m:
        raise ValueError(f"bad range spec {spec!r}")
    return Range(float(m[2]), float(m[3]), m[1] == "(", m[4] == ")", why)


_TIMEOUT = rng("> 0", "a deadline must be a positive number of seconds")
_SHARE = rng(">= 0", "a count or a share of the cluster cannot be negative")
_SEED = rng(">= 0", "seeds are non-negative integers")


class _Section:
    """Checks shared by every config section: Literal choices and the declared `_RANGES`."""

    _RANGES: ClassVar[dict[str, Range]] = {}

    def check(self, prefix: str) -> None:
        """Raise ConfigError for the first value of this section (keys named `prefix` + field) that is invalid."""
        hints = _hints(type(self))
        for f in fields(self):  # type: ignore[arg-type]
            key, value = f"{prefix}{f.name}", getattr(self, f.name)
            if get_origin(hints[f.name]) is Literal:
                check_choice(key, value, get_args(hints[f.name]))
            rule = self._RANGES.get(f.name)
            if rule is not None and value is not None and not rule.holds(value):  # None: an optional key off
                default = getattr(type(self)(), f.name)
                why = f" ({rule.why})" if rule.why else ""
                raise ConfigError(
                    f"invalid value for '{key}': {value!r}; must be {rule.text()}{why}. "
                    f"Set it in that range, e.g. {key}={json.dumps(default)} (the default)"
                )


def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def did_you_mean(word: str, options: Any) -> str:
    """`; did you mean X or Y?` for the options closest to `word` (case aside), or '' for none."""
    by_lower = {str(o).lower(): str(o) for o in options}  # `info` is a near miss of `INFO`
    close = difflib.get_close_matches(str(word).lower(), list(by_lower), n=3, cutoff=0.6)
    close = [by_lower[c] for c in close]
    return f"; did you mean {' or '.join(close)}?" if close else ""


def choice_message(key: str, value: Any, valid: tuple[Any, ...], where: str = "") -> str:
    """The message for a value of `key` that is none of `valid`, with the near misses."""
    return (
        f"invalid value for '{key}': {value!r}; choose exactly one of {', '.join(map(str, valid))}{where}"
        f"{did_you_mean(value, valid)}"
    )


def check_choice(key: str, value: Any, valid: tuple[Any, ...], where: str = "") -> None:
    """Raise ConfigError unless `value` is exactly one of `valid` (`where`: more on what is valid)."""
    # exact membership: YAML's `no`/`false` must not pass for `off`, nor 1 for "1"
    if not any(type(value) is type(c) and value == c for c in valid):
        raise ConfigError(choice_message(key, value, valid, where))


def require(key: str, ok: bool, what: str) -> None:
    """Raise ConfigError `invalid value for 'key': what` unless `ok`."""
    if not ok:
        raise ConfigError(f"invalid value for '{key}': {what}")
