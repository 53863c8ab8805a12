"""Where a run keeps its results (`run_dir`): the run folder, checkpoints and the default MLflow store.

They must outlive the job that wrote them. The default is `~/relay-runs` (like Ray's `~/ray_results`): an
absolute path, so a job started with `ray job submit --working-dir .` does not write into Ray's temporary
copy of its working directory, which Ray deletes with the job. A `run_dir` that resolves inside such a copy is
refused with the fix. On a cluster of several nodes the trainer's rank 0 writes the run folder and every
trainer worker writes its checkpoint shards: `run_dir` must then be on storage every node mounts (NFS, EFS,
a shared disk) at the same path.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from app.errors import UserError

DEFAULT_RUN_DIR = "~/relay-runs"


class RunDirError(UserError, ValueError):
    """`run_dir` names a place whose contents would not outlive the run; the message names the fix."""


def _in_ray_copy(path: Path) -> bool:
    """Inside a runtime_env package Ray unpacked for a job (working_dir, py_modules): deleted with it."""
    parts = path.parts
    return any(p.startswith("_ray_pkg_") for p in parts) or any(
        a == "runtime_resources" and b.endswith("_files") for a, b in itertools.pairwise(parts)
    )


def resolve_run_dir(spec: str) -> Path:
    """`run_dir` as an absolute path (`~` expanded); raises RunDirError where results would be lost."""
    if "://" in spec:
        raise RunDirError(
            f"run_dir={spec!r}: a URI is not supported (the run folder and MLflow's default SQLite store are "
            "local files); give a path on storage every node mounts, and set tracking.uri for a tracking server"
        )
    path = Path(spec).expanduser().resolve()
    if _in_ray_copy(path):
        raise RunDirError(
            f"run_dir={spec!r} resolves to {path}, inside Ray's temporary copy of this job's working directory, "
            "which Ray deletes with the job (the run's checkpoints and MLflow store would be lost): give an "
            f"absolute path that outlives the job, e.g. run_dir={DEFAULT_RUN_DIR} (the default) or a path on "
            "shared storage"
        )
    return path
