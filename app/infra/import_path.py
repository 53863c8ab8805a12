"""Relay's own package first on the import path of every process a run starts.

Relay's code is the package `app`, so a user's own `app` (a folder or a module) in the working directory
could be imported in its place. Ray 2.60 starts every worker of a job with the driver's paths first on
`sys.path`: the job config holds the driver's script folder (where it is on the driver's own path) and its
working directory, and a worker inserts each at index 0, in that order, before its first task runs (so the
working directory ends up first). Every Serve replica, Ray Train worker, Ray Data task and rollouter, and
every process they spawn with their `sys.path` (vLLM's engine core), would import the user's `app`.

`worker_paths` orders those driver paths so that, where one of them holds an `app` of its own, Relay's root
is inserted last: first on every worker's path (the driver passes it to `ray.init` through
`ray_compat.job_config`). `check_worker_paths` refuses, in one line, a job whose driver paths Relay did not
order (Ray already started by the caller). `python_c` starts a `python -c` child (which puts its working
directory first) with Relay's root ahead of it. The driver itself: relay/__init__.py, app/__main__.py.
"""

from __future__ import annotations

import importlib.machinery
import sys
from collections.abc import Sequence
from pathlib import Path

from app.errors import UserError

ROOT = str(Path(__file__).resolve().parents[2])
"""The folder that holds Relay's package `app` (a source checkout, or site-packages)."""


class ShadowedError(UserError, ImportError):
    """A folder first on an import path holds an `app` of its own that Relay cannot put its own ahead of."""


def foreign_app(folder: str) -> str | None:
    """Where `folder` holds a module or package `app` that is not Relay's (a namespace folder too: with an
    editable install it wins over Relay's): its location, else None."""
    if not folder or Path(folder).resolve() == Path(ROOT):
        return None
    spec = importlib.machinery.PathFinder.find_spec("app", [folder])
    if spec is None:
        return None
    return spec.origin or str(next(iter(spec.submodule_search_locations or [folder])))


def worker_paths(paths: Sequence[str]) -> list[str]:
    """The driver paths a job gives its workers, in the order Ray inserts them at the front of `sys.path`
    (the last one ends up first): unchanged where none holds a foreign `app`, else with Relay's root last."""
    if not any(foreign_app(p) for p in paths):
        return list(paths)
    return [p for p in paths if Path(p).resolve() != Path(ROOT)] + [ROOT]


def check_worker_paths(paths: Sequence[str]) -> None:
    """Raise `ShadowedError` where a worker of a job with these driver paths would find a foreign `app` ahead
    of Relay's (the first path a worker tries is the last one here)."""
    for p in reversed(paths):
        if Path(p).resolve() == Path(ROOT):
            return
        if where := foreign_app(p):
            raise ShadowedError(
                f"Ray's workers of this job look in {p} first, whose package 'app' ({where}) would be imported "
                f"in place of Relay's ({ROOT}/app): call relay.train before ray.init (Relay then puts its own "
                "first), or run from a folder without an 'app'"
            )


def python_c(code: str) -> list[str]:
    """The command `python -c code` with Relay's root first on the child's path (ahead of its working
    directory, which `-c` puts first)."""
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); {code}"]
