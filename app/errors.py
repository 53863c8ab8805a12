"""User errors: a problem with what the user gave (a config value, a data file, a model path, a checkpoint, the
cluster's size) whose message already names the problem and the fix.

The command line prints such an error as one line (`python -m app ...`: the traceback only at
`log_level=DEBUG`), where any other exception is a crash and keeps its traceback. Each module raises its own
error class (`ConfigError`, `DataError`, `ResourceError`, ...), which also derives from `UserError`; this
module imports nothing of app/, so any module can use it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator


class UserError(Exception):
    """Marks an error class as the user's to fix: its message names the problem and the fix."""


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what it wraps, each once: a Ray task error's `cause` first, else `__cause__`, else
    `__context__`."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__


def raised_as(exc: BaseException, names: set[str] | frozenset[str]) -> bool:
    """Whether `exc` or anything in its chain is of a class named in `names` (by name: the classes need not be
    importable here, e.g. vLLM's EngineDeadError in a process without vLLM)."""
    return any(c.__name__ in names for e in exception_chain(exc) for c in type(e).__mro__)


def user_error(exc: BaseException) -> UserError | None:
    """The UserError behind `exc`: itself, or one it wraps (a Ray task error's `cause`, an exception's
    `__cause__` or `__context__`), else None."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, UserError):
            return e
        cause = getattr(e, "cause", None)  # ray.exceptions.RayTaskError: what the task raised
        if isinstance(cause, UserError):
            return cause
        if (found := _raised_in_creation(e)) is not None:
            return found
        e = e.__cause__ or e.__context__
    return None


def _subclasses(cls: type) -> set[type]:
    out = set(cls.__subclasses__())
    for sub in list(out):
        out |= _subclasses(sub)
    return out


def _raised_in_creation(e: BaseException) -> UserError | None:
    """A Ray actor that died of a user error in its constructor (a bad row the rollouter found): Ray keeps
    only the text of what `__init__` raised, its last line `DataError: <message>`; that message, as a
    UserError of its own (None where the text holds no user error)."""
    text = str(e)
    if "raised in its creation task" not in text:
        return None
    names = "|".join(sorted(c.__name__ for c in _subclasses(UserError)))
    found = re.findall(rf"^\s*(?:[\w.]+\.)?(?:{names}): (.+)$", text, flags=re.MULTILINE) if names else []
    return UserError(found[-1]) if found else None
