"""Several reward functions with weights: `reward.fns` and `reward.weights`.

A sample's reward is the weighted sum of its functions' scores, `sum(w_i * score_i)`; each function's score
is kept by name in `RewardResult.scores` (and so in the trajectory record, `Sample.reward_scores`, and the
per-step metric `reward/<name>`). A function that fails (raises, times out, returns a non-number) scores
`reward.on_error` in that sum; the sample's `error` is the first failure's kind and its `detail` names the
function. With one function (`reward.fn`) the result is that function's (its detail naming it).

A function's name is the built-in's (`gsm8k`, `auto`) or the attribute a dotted path names (`compute_score`
for `my.rewards:compute_score`); names must differ and must not be one of the batch metrics' own
(`reward/mean`, `reward/std`, ...). Imports nothing heavy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import PurePath

from app.plugins import PICKLED, is_file_spec
from app.rewards import RewardResult

RESERVED = ("mean", "std", "sub")
RESERVED_PREFIXES = ("errors_", "output_dropped")


class SpecError(ValueError):
    """`reward.fn` / `reward.fns` / `reward.weights` do not fit together; `key` is the one to fix."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True, kw_only=True)
class RewardSpec:
    """One configured reward function: the spec that resolves it, its name (metrics) and its weight."""

    spec: str
    name: str
    weight: float = 1.0


def spec_name(spec: str) -> str:
    """The name a function is reported under: `gsm8k` -> gsm8k, `pkg.mod:compute_score` -> compute_score,
    `pkg.mod:Scorer.call` -> Scorer.call, `pkg.mod.fn` (the older dotted form) -> fn, `dir/reward.py:fn` ->
    fn, `dir/reward.py` -> compute_score (verl's default), `pickle:dir/name.pkl` -> name."""
    spec = spec.strip()
    if spec.startswith(PICKLED):
        return PurePath(spec.removeprefix(PICKLED)).stem
    if is_file_spec(spec):
        return spec.rpartition(":")[2] if ":" in spec else "compute_score"
    if ":" in spec:
        return spec.partition(":")[2]
    return spec.rpartition(".")[2] if "." in spec else spec


def qualified_name(spec: str, depth: int = 1) -> str:
    """`spec_name` after the last `depth` names of its module or file, to tell same-named functions apart
    (verl names every reward `compute_score`): `a/math_rm.py:compute_score` -> math_rm.compute_score (depth
    2: a.math_rm.compute_score), `pkg.judge:score` -> judge.score (depth 2: pkg.judge.score)."""
    spec = spec.strip()
    if spec.startswith(PICKLED):
        return spec_name(spec)
    if is_file_spec(spec):
        path = PurePath(spec.rpartition(":")[0] if ":" in spec else spec)
        parts = [*path.parent.parts, path.stem]
    else:
        parts = (spec.partition(":")[0] if ":" in spec else spec.rpartition(".")[0]).split(".")
    where = ".".join(p for p in parts[-depth:] if p not in ("", "/"))
    return f"{where}.{spec_name(spec)}" if where else spec_name(spec)


def _names(specs: Sequence[str]) -> list[str]:
    """Each function's reported name: its own, or as many of its module's or file's names as it takes to
    tell it from the others of the same name."""
    plain = names = [spec_name(s) for s in specs]
    for depth in (1, 2, 3):
        dup = {n for n in names if names.count(n) > 1}
        if not dup:
            return names
        names = [qualified_name(s, depth) if n in dup else n for s, n in zip(specs, names, strict=True)]
    return names if len(set(names)) == len(names) else plain  # the same function twice: named plainly


def reward_specs(fn: str, fns: Sequence[str], weights: Sequence[float]) -> list[RewardSpec]:
    """The functions `reward.fn` / `reward.fns` with `reward.weights` configure; SpecError naming the key and
    the fix when they do not fit together (both set, weights of another length, a name twice or reserved)."""
    fns = [str(f) for f in fns]
    if fns and fn.strip() not in ("", "auto"):
        raise SpecError(
            "reward.fns",
            f"{fns} with reward.fn={fn!r}: set one; reward.fn for one function, reward.fns for several",
        )
    specs = fns or [fn]
    ws = [float(w) for w in weights] if weights else [1.0] * len(specs)
    if len(ws) != len(specs):
        raise SpecError(
            "reward.weights",
            f"{ws}: {len(ws)} weights for {len(specs)} reward functions {specs}; give one weight per "
            "function (or none: all 1.0)",
        )
    names = _names(specs)
    out: list[RewardSpec] = []
    for i, (s, w, name) in enumerate(zip(specs, ws, names, strict=True)):
        if not math.isfinite(w):
            raise SpecError(f"reward.weights[{i}]", f"{w}: a weight must be a finite number")
        if name in RESERVED or name.startswith(RESERVED_PREFIXES):
            raise SpecError(
                "reward.fns" if fns else "reward.fn",
                f"{s!r}: its name {name!r} is a batch metric's own (reward/{name}); give the function "
                "another name",
            )
        if any(o.name == name for o in out):
            first = next(o.spec for o in out if o.name == name)
            raise SpecError(
                "reward.fns",
                f"two functions are named {name!r} ({first!r} and {s!r}), also after their module's or "
                "file's name; sub-scores are reported by name: import one under another name",
            )
        out.append(RewardSpec(spec=s, name=name, weight=w))
    return out


def combine(parts: Sequence[tuple[RewardSpec, RewardResult]], named: bool) -> RewardResult:
    """One sample's reward from its functions' results: the weighted sum of their scores (a failed function's
    is `on_error`, as its result says), the first failure's kind, the details of every failure (each naming
    its function), the extras of all (prefixed with the function's name when `named`), each function's score
    by name when `named`, and the output dropped in total."""
    if len(parts) == 1 and not named:
        spec, res = parts[0]
        return replace(res, detail=f"{spec.spec}: {res.detail}") if res.error else res
    total = sum(spec.weight * res.score for spec, res in parts)
    errors = [(spec, res) for spec, res in parts if res.error]
    extras: dict[str, float] = {}
    for spec, res in parts:
        extras.update({f"{spec.name}/{k}" if named else k: v for k, v in res.extras.items()})
    return RewardResult(
        score=total,
        error=errors[0][1].error if errors else None,
        detail="; ".join(f"{spec.spec}: {res.detail}" for spec, res in errors),
        extras=extras,
        output_dropped=sum(res.output_dropped for _, res in parts),
        scores={spec.name: res.score for spec, res in parts} if named else {},
    )
