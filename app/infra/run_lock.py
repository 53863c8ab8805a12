"""One run at a time per run folder, and file locks for what concurrent runs share.

A run holds an exclusive `flock` on `<run folder>/.relay-run.lock` from its start to its end; the file records
the holder's pid, host, start time and command line, for the message a second run with the same name gets.
The kernel (on NFS, the lock manager) releases the lock when the holder's process ends, however it ends, so a
crashed run never blocks the next one: the liveness check is the lock itself. Where the file system has no
locks, the recorded pid is checked instead (on this host; a holder on another host is taken as alive).

The file is never deleted (deleting a locked file lets two processes lock two different files); a run that
ends empties it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from app.errors import UserError

log = logging.getLogger(__name__)

LOCK_FILE = ".relay-run.lock"
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunInUseError(UserError, RuntimeError):
    """Another live run holds this run folder; the message names it and the fix."""


def new_run_name() -> str:
    """`relay-<date>-<time>-<6 hex>`: unique also for runs started in the same second."""
    return f"relay-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def _try_lock(fd: int) -> bool | None:
    """True: locked; False: another process holds it; None: this file system has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in _NO_LOCKS:
            return None
        raise


def _read(fd: int) -> dict[str, Any]:
    try:
        got = json.loads(os.pread(fd, 65536, 0) or b"{}")
        return got if isinstance(got, dict) else {}
    except (OSError, ValueError):
        return {}


def _alive(holder: dict[str, Any]) -> bool:
    """Whether the recorded holder may still run (a holder on another host cannot be checked: yes)."""
    if holder.get("host") != socket.gethostname():
        return True
    try:
        pid = int(holder.get("pid", 0))
        if pid <= 0:
            return False
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, OverflowError):
        return True
    return True


def _in_use(run_dir: Path, path: Path, holder: dict[str, Any], locked: bool) -> RunInUseError:
    who = (
        f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"
        f" (`{holder.get('argv', '?')}`)"
        if holder
        else "a process that has not written its record yet"
    )
    msg = (
        f"run folder {run_dir} is in use by another run: {who}. Wait for that run to end (or stop it), or "
        "give this run another tracking.run_name (or run_dir); `--resume` it once it has ended"
    )
    if locked and holder and not _alive(holder):
        msg += f". That process has ended, but a process it started still holds the lock on {path}: stop it"
    elif not locked:
        msg += f". This file system has no file locks: if that run has ended, delete {path}"
    return RunInUseError(msg)


class RunLock:
    """The lock one run holds on its run folder (`acquire` at start, `release` at the end)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        """Lock `run_dir` for this process; raises RunInUseError naming the live run that holds it."""
        run_dir = Path(run_dir)
        path = run_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            got = _try_lock(fd)
            holder = _read(fd)
            if got is False or (got is None and holder and _alive(holder)):
                raise _in_use(run_dir, path, holder, locked=got is False)
            if got is None:
                log.warning(
                    "%s: this file system has no file locks; a second run is refused by pid only", path
                )
            me = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "argv": " ".join(sys.argv)[:300],
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def release(self) -> None:
        """Empty the record and unlock (idempotent; never raises)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as e:
            log.warning("releasing %s: %s", self.path, e)
        finally:
            os.close(fd)

    def __del__(self) -> None:  # a run that failed before its `finally` still frees the folder
        with contextlib.suppress(Exception):
            self.release()


@contextlib.contextmanager
def file_lock(path: Path, timeout_s: float) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing), waiting at most `timeout_s` for another process
    to release it; raises TimeoutError naming the file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while (got := _try_lock(fd)) is False:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{path} stayed locked by another process for {timeout_s:.0f} s (another run creating or "
                    "migrating the same store?); retry once it is done, or stop the process holding it"
                )
            time.sleep(0.1)
        if got is None:
            log.warning("%s: this file system has no file locks; going on without one", path)
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
