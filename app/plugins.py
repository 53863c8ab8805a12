"""One loader for every extension point: a built-in name, or `pkg.module:Name` imported from the working
directory (PYTHONPATH). Adding a reward, a loss, a batch source, an environment, a transport or an agent is one
new file of the user's own, selected by its dotted path; nothing in app/ changes.

    config key             built-ins (registry)                          what the object is
    reward.fn / .fns       app/rewards BUILTINS (+ `auto`)               fn(response, answer) -> float | dict, or
                                                                         verl's / TRL's (app/rewards/styles.py)
    algorithm.correction   app/trainer/losses.py LOSSES                  fn(LossInputs, algorithm_cfg) -> LossOutputs
    algorithm.mode         app/trainer/sources SOURCES                   a RolloutSource class: cls(cfg, actors)
    env.name               app/envs ENVIRONMENTS                         a factory: fn(cfg, offload) -> EnvFactory,
                                                                         or an EnvKind (app/envs/base.py)
    sync.transport         app/weights/transport.py TRANSPORTS           a WeightTransport class
    env.agent              (none: a dotted path only)                    async fn(base_url, row) -> reward

Imports nothing heavy (no torch, Ray or vLLM).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from typing import Any

from app.errors import UserError

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def import_module(hint: str, module_name: str) -> Any:
    """Import `module_name` (a user's module may register built-ins as it loads, e.g. a transport's
    decorator); PluginError after `hint` when it cannot be imported, the import's own error as its cause."""
    try:
        return importlib.import_module(module_name)
    except Exception as e:
        raise PluginError(hint, f"cannot import module {module_name!r}: {type(e).__name__}: {e}") from e


class PluginError(UserError, ValueError):
    """A config value names no built-in and no importable object; the message names the key and the fix
    (`hint`), then why (`reason`), which callers with their own hint use alone."""

    def __init__(self, hint: str, reason: str) -> None:
        super().__init__(f"{hint}; {reason}")
        self.reason = reason


def is_dotted(spec: str) -> bool:
    """`pkg.module:Name`: the form that names an object outside the built-ins."""
    return ":" in spec


def resolve(key: str, spec: str, builtins: Mapping[str, Any] | None = None) -> Any:
    """The object `spec` names for config key `key`: `builtins[spec]`, or the attribute `Name` (dots allowed:
    `Outer.inner`) of module `pkg.module` for `pkg.module:Name`. Raises PluginError naming the key, the value
    and what would be valid."""
    spec = (spec or "").strip()
    builtins = builtins or {}
    if spec in builtins:
        return builtins[spec]
    choices = f"a built-in ({', '.join(map(repr, builtins))}) or " if builtins else ""
    hint = f"{key}={spec!r}: expected {choices}a dotted path 'pkg.module:Name' importable from the working directory"
    module_name, _, attr = spec.partition(":")
    if not is_dotted(spec) or not _IDENT.match(module_name) or not _IDENT.match(attr):
        raise PluginError(hint, f"{spec!r} is not of that form")
    obj: Any = import_module(hint, module_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(hint, f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
