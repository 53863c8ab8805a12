"""The isolation layers of the code sandbox: which setups a machine may support and what each one lacks.

`candidates()` lists the setups from the strongest to the weakest (namespaces by `unshare`, a minimal root by
pivot_root, a uid drop: one claimed uid per run, the shared `nobody` or none); app/rewards/sandbox.py probes them
in that order and keeps the first that runs a program, then `warn_missing()` says what that one lacks.
`runtime_binds()` is what the minimal root shows of the host. app/rewards/sandbox.py describes the layers.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PIVOT_ROOT_NR = {"x86_64": 155, "aarch64": 41}  # glibc has no pivot_root(); the raw syscall's number


@dataclass(frozen=True)
class Isolation:
    """The isolation layers in use on this machine (app/rewards/sandbox.py describes each)."""

    prefix: tuple[str, ...]  # the unshare command line, or () without namespaces
    netns: bool
    pidns: bool
    mountns: bool
    userns: bool
    uid: int | None  # the unprivileged uid the program runs as (root only), else None
    gid: int | None
    rootfs: bool = False  # a minimal root: only the interpreter's runtime, /dev nodes, a private /tmp
    uid_pool: bool = False  # root: each run claims its own uid (its own RLIMIT_NPROC budget), not `uid`

    def describe(self) -> str:
        parts = [
            f"rootfs={'yes' if self.rootfs else 'NO'}",
            f"netns={'yes' if self.netns else 'NO'}",
            f"pidns={'yes' if self.pidns else 'no'}",
            f"mountns={'yes' if self.mountns else 'no'}",
            f"userns={'yes' if self.userns else 'no'}",
            f"uid={'per-run' if self.uid_pool else self.uid if self.uid is not None else os.geteuid()}",
            f"procs={self.process_budget()}",
        ]
        return " ".join(parts)

    def process_budget(self) -> str:
        """How fork bombs are capped: per run (own uid or user namespace), shared by all runs, or not."""
        if self.uid_pool or (self.userns and self.uid is None):
            return "per-run"
        return "shared" if self.uid is not None else "NONE"


def interpreter() -> str:
    """The real interpreter binary (not a venv link: `-S` ignores site-packages anyway)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _drop_ids() -> tuple[int, int] | None:
    """(uid, gid) of `nobody` when we are root (65534 if there is no such account), else None."""
    if os.geteuid() != 0:
        return None
    try:
        import pwd

        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except (KeyError, ImportError):
        return 65534, 65534


def candidates() -> list[Isolation]:
    """Isolation setups from the strongest to the weakest."""
    root = os.geteuid() == 0
    ids = _drop_ids()
    # root: a claimed uid per run first, then the shared `nobody`, then no drop at all
    drops: list[tuple[int, int, bool] | None] = [(*ids, True), (*ids, False), None] if ids else [None]
    unshare = shutil.which("unshare")
    ns_options: list[tuple[bool, bool]] = [(True, True), (False, True), (True, False)] if unshare else []
    guard = _death_guard()
    out = []
    for net, pid_mount in [*ns_options, (False, False)]:
        prefix: list[str] = list(guard)
        if net or pid_mount:
            prefix += [unshare or "unshare", *([] if root else ["--user", "--map-root-user"])]
            prefix += ["--net"] if net else []
            prefix += ["--pid", "--fork", "--kill-child", "--mount-proc"] if pid_mount else []
        roots = [True, False] if pid_mount and PIVOT_ROOT_NR.get(platform.machine()) else [False]
        for rootfs in roots:
            for drop in drops:
                out.append(
                    Isolation(
                        prefix=tuple(prefix),
                        netns=net,
                        pidns=pid_mount,
                        mountns=pid_mount,
                        userns=(net or pid_mount) and not root,
                        uid=drop[0] if drop else None,
                        gid=drop[1] if drop else None,
                        rootfs=rootfs,
                        uid_pool=bool(drop and drop[2]),
                    )
                )
    return out


@functools.cache
def _death_guard() -> tuple[str, ...]:
    """`setpriv --pdeathsig KILL`, when available: the sandbox dies with the thread that started it (e.g.
    a reward process killed at its deadline), and with it, through `unshare --kill-child`, its pid
    namespace. Without it a program of a killed caller runs on until its own cpu/wall limits."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return ()
    try:
        ok = subprocess.run([setpriv, "--pdeathsig", "KILL", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return (setpriv, "--pdeathsig", "KILL") if ok.returncode == 0 else ()


def warn_missing(plan: Isolation, failures: list[str]) -> None:
    for f in failures:
        log.debug("sandbox setup rejected: %s", f)
    log.info("code sandbox isolation: %s", plan.describe())
    if not plan.rootfs:
        log.warning(
            "code sandbox: NO minimal root filesystem (needs a mount namespace and pivot_root): sandboxed "
            "programs can read every world-readable file of this machine: datasets with their answers, "
            "hidden tests, checkpoints, the repository"
        )
    if plan.process_budget() == "shared":
        log.warning(
            "code sandbox: concurrent sandboxes share one process budget (uid %s): a fork bomb in one "
            "makes the others fail",
            plan.uid,
        )
    if not plan.netns:
        log.warning(
            "code sandbox: network isolation is unavailable (no usable `unshare --net`); "
            "sandboxed programs can open network connections"
        )
    if not plan.pidns:
        log.warning("code sandbox: no pid namespace; processes that leave the process group may survive")
    if os.geteuid() == 0 and plan.uid is None:
        log.warning("code sandbox: running as root without a uid drop: no fork-bomb cap, no write protection")
    if os.geteuid() != 0 and not plan.userns:
        log.warning(
            "code sandbox: no user namespace: no fork-bomb cap (RLIMIT_NPROC counts all our processes)"
        )


@functools.cache
def runtime_binds() -> tuple[tuple[str, str, str], ...]:
    """What the minimal root shows, as (kind, path, link target): "bind" (read-only, from the host), "link"
    (a symlink as on the host, so that paths the loader and the interpreter use resolve) or "hide" (an
    empty directory over it). Only the interpreter, its standard library (minus site-packages), the
    shared libraries they load and the loader's cache."""
    interp = interpreter()
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    dynload = [str(p) for p in sorted(Path(stdlib, "lib-dynload").glob("*.so"))]
    paths = [interp, stdlib, *_shared_libs([interp, *dynload])]
    paths += [p for p in ("/etc/ld.so.cache",) if os.path.exists(p)]
    ops: dict[str, tuple[str, str]] = {}
    for path in paths:
        _record_path(path, ops)
    dirs = [p for p, (kind, _) in ops.items() if kind == "bind" and os.path.isdir(p)]
    out = [(k, p, t) for p, (k, t) in ops.items() if not any(p.startswith(d + "/") for d in dirs)]
    out += [("hide", os.path.join(stdlib, d), "") for d in ("site-packages", "dist-packages")]
    return tuple(o for o in out if o[0] != "hide" or os.path.isdir(o[1]))


def _record_path(path: str, ops: dict[str, tuple[str, str]], depth: int = 0) -> None:
    """Record the symlinks on the way to `path` and a bind of where it really is."""
    parts = Path(os.path.abspath(path)).parts[1:]
    cur = "/"
    for i, part in enumerate(parts):
        nxt = os.path.join(cur, part)
        if os.path.islink(nxt) and depth < 32:
            target = os.readlink(nxt)
            ops.setdefault(nxt, ("link", target))
            base = target if os.path.isabs(target) else os.path.join(cur, target)
            _record_path(os.path.normpath(os.path.join(base, *parts[i + 1 :])), ops, depth + 1)
            return
        cur = nxt
    if os.path.exists(cur):
        ops.setdefault(cur, ("bind", ""))


def _shared_libs(objects: list[str]) -> list[str]:
    """The shared libraries (and the loader) that `objects` load, as `ldd` resolves them."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return []
    try:
        out = subprocess.run([ldd, *objects], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = re.findall(r"^\s+(?:\S+\s+=>\s+)?(/\S+)\s+\(0x", out, re.MULTILINE)
    return sorted(set(found))
