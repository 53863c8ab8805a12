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

Two more forms name an object outside a package (`resolve` takes them wherever it takes a dotted path):
- `path/to/file.py:Name` (verl's `custom_reward_function.path` + `.name`): the file is imported as a module of
  its own, named after its absolute path, so two files' same-named functions stay apart;
- `pickle:path/to/object.pkl`: an object written with cloudpickle (the Python API `relay.train` ships a
  callable it was handed this way, by value: a lambda or a notebook's function works in scoring processes).

Imports nothing heavy (no torch, Ray or vLLM).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Mapping
from pathlib import Path
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


PICKLED = "pickle:"


def is_dotted(spec: str) -> bool:
    """`pkg.module:Name` (or `file.py:Name`, `pickle:file`): the forms that name an object outside the
    built-ins."""
    return ":" in spec


def is_file_spec(spec: str) -> bool:
    """`path/to/file.py:Name` or `path/to/file.py`."""
    return spec.partition(":")[0].endswith(".py")


def import_file(hint: str, path: str) -> Any:
    """The module of the Python file `path`, imported once under a name made from its absolute path (so
    that two `reward.py` of two folders are two modules); PluginError after `hint` when it cannot be."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise PluginError(hint, f"no such file {str(file)!r}")
    name = f"relay_user_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise PluginError(hint, f"cannot import {str(file)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: a dataclass or pickle in it looks itself up there
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise PluginError(hint, f"importing {str(file)!r} failed: {type(e).__name__}: {e}") from e
    return module


def _unpickle(hint: str, path: str) -> Any:
    import cloudpickle

    try:
        with open(Path(path).expanduser(), "rb") as f:
            return cloudpickle.load(f)
    except Exception as e:
        raise PluginError(hint, f"cannot load the pickled object {path!r}: {type(e).__name__}: {e}") from e


def resolve(key: str, spec: str, builtins: Mapping[str, Any] | None = None) -> Any:
    """The object `spec` names for config key `key`: `builtins[spec]`, or the attribute `Name` (dots allowed:
    `Outer.inner`) of module `pkg.module` for `pkg.module:Name`. Raises PluginError naming the key, the value
    and what would be valid."""
    spec = (spec or "").strip()
    builtins = builtins or {}
    if spec in builtins:
        return builtins[spec]
    choices = f"a built-in ({', '.join(map(repr, builtins))}) or " if builtins else ""
    hint = (
        f"{key}={spec!r}: expected {choices}a dotted path 'pkg.module:Name' importable from the working "
        "directory, or 'path/to/file.py:Name'"
    )
    if spec.startswith(PICKLED):
        return _unpickle(hint, spec[len(PICKLED) :])
    module_name, _, attr = spec.rpartition(":") if is_file_spec(spec) else spec.partition(":")
    if is_file_spec(spec) and _IDENT.match(attr):
        obj: Any = import_file(hint, module_name)
    elif not is_dotted(spec) or not _IDENT.match(module_name) or not _IDENT.match(attr):
        raise PluginError(hint, f"{spec!r} is not of that form")
    else:
        obj = import_module(hint, module_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(hint, f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
