"""Run untrusted, model-written Python programs against test cases (Linux only).

Each `run_program` call starts this chain, in its own session and process group:

    unshare [--user --map-root-user] --net --pid --fork --kill-child --mount-proc   (when available)
      python -I -S -B -c WRAPPER CONFIG             the wrapper: pid 1 of the new pid namespace, trusted
        python -I -S -B -X utf8 prog.py            the program: pid 2, limits set, privileges dropped

What is protected, and how (`isolation()` says which layers this machine supports; it probes once per
process by running a tiny program through each candidate setup and keeps the strongest that works):

- Network: a new network namespace (only a downed loopback). Unavailable -> ONE warning, runs anyway.
- The caller's processes: the program's parent is the wrapper, never the caller. In a pid namespace the
  caller's pids are invisible and the wrapper, as the namespace's init, ignores signals from inside it.
  As root the program also runs as uid `nobody`, so it may not signal anything of ours.
- Leftover processes: the wrapper is pid 1 of the namespace; when it exits (after the program) the kernel
  kills everything left in it, including processes that escaped the process group with setsid().
  Afterwards the whole process group is SIGKILLed in any case, also on timeout and on errors.
- Fork bombs: RLIMIT_NPROC, set after the uid drop. RLIMIT_NPROC counts per user, so each run gets a
  user of its own: as root, a uid (= gid) leased from a pool of unused ids (a lock file per id, so that
  concurrent runs, also in other processes, never share one) and a fork bomb in one sandbox cannot use
  up the budget of another; without root, the user namespace's own count. Fallbacks, with a warning:
  the shared `nobody` (concurrent runs share `max_procs`), or no cap at all (root without a uid drop).
- Dying callers: `setpriv --pdeathsig KILL` in front of `unshare` kills the sandbox when the thread that
  started it dies (a reward process killed at its deadline), and `--kill-child` then its namespace.
- CPU, memory, files, core dumps: RLIMIT_CPU, RLIMIT_AS (per process: a fork bomb may hold up to
  `max_procs` x `memory_mb`), RLIMIT_FSIZE, RLIMIT_CORE=0; output goes to files capped by RLIMIT_FSIZE
  and at most `output_bytes` of each stream are read back, so gigabytes of output cost no memory here.
- The filesystem: a minimal root (with a mount namespace; pivot_root into a tmpfs, the host's tree
  detached): the interpreter binary, its standard library without site-packages, the shared libraries
  they load (as `ldd` finds them) and /etc/ld.so.cache, all read-only; /dev/{null,zero,full,random,
  urandom}; the pid namespace's own /proc (hidepid=2: the program does not see its parent); a small
  private /tmp holding the work directory (cwd and HOME). Nothing else of the host or the project exists
  there: no /etc/passwd, datasets, hidden tests, checkpoints or repositories.
  Fallback, with a loud warning (no pivot_root): /tmp, /var/tmp, /dev/shm and /run/lock are replaced by
  small private tmpfs mounts and every world-readable file of the host stays readable; without a mount
  namespace the work directory is on the host's disk and world-writable directories are writable.
- Environment: a minimal one (PATH, HOME, TMPDIR, LANG, PYTHONDONTWRITEBYTECODE), `-I -S` (no user site,
  no site-packages: only the standard library is importable, no PYTHON* variables), no inherited file
  descriptors but stdin/stdout/stderr.

Statuses of a `RunResult`: ok, error (nonzero exit / exception), timeout (wall or cpu), memory, killed
(another signal), output_limit (stdout or stderr over `output_bytes`, or a file over `file_mb`),
sandbox_error (the sandbox itself failed: not the program's fault).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import inspect
import json
import logging
import marshal
import math
import os
import platform
import random
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

log = logging.getLogger(__name__)

STATUSES = ("ok", "error", "timeout", "memory", "killed", "output_limit", "sandbox_error")
_MASKED = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # world-writable: private tmpfs in the sandbox
_WORK_IN_NS = "/tmp/work"  # cwd/HOME of the program inside the mount namespace (a private tmpfs)
_PATH = "/usr/local/bin:/usr/bin:/bin"
_PIVOT_ROOT_NR = {"x86_64": 155, "aarch64": 41}  # glibc has no pivot_root(); the raw syscall's number
_UID_BASE, _UID_COUNT = 1_500_000_000, 4096  # leased sandbox uids (= gids): owned by no account
_DEVICES = ("null", "zero", "full", "random", "urandom")
_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
_PYTHON_TAGS = ("python", "python3", "py")


class SandboxError(RuntimeError):
    """The sandbox itself cannot run programs (no interpreter, no working isolation setup)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits.

    cpu_s, memory_mb (address space) and file_mb are rlimits of each process (cpu_s rounded up to whole
    seconds); max_procs caps the processes of the sandbox uid; wall_s is the whole run, sandbox start
    included (tens of milliseconds); output_bytes is what is kept of stdout and of stderr.
    """

    cpu_s: float = 2.0
    wall_s: float = 5.0
    memory_mb: int = 256
    file_mb: int = 1
    max_procs: int = 32
    output_bytes: int = 65536

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "file_mb", "max_procs", "output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name}={getattr(self, name)!r}: must be > 0")
        if self.memory_mb < 32:
            raise ValueError(f"SandboxLimits.memory_mb={self.memory_mb}: the interpreter needs >= 32")


@dataclass
class RunResult:
    """Outcome of one run; `status` is one of STATUSES, `returncode` is -signal when killed by one."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    detail: str


@dataclass(frozen=True)
class Isolation:
    """The isolation layers in use on this machine (see the module docstring)."""

    prefix: tuple[str, ...]  # the unshare command line, or () without namespaces
    netns: bool
    pidns: bool
    mountns: bool
    userns: bool
    uid: int | None  # the unprivileged uid the program runs as (root only), else None
    gid: int | None
    rootfs: bool = False  # a minimal root: only the interpreter's runtime, /dev nodes, a private /tmp
    uid_pool: bool = False  # root: each run leases its own uid (its own RLIMIT_NPROC budget), not `uid`

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


# ----------------------------------------------------------------------------------------------------
# The caller's side


def run_program(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> RunResult:
    """Run `code` with `stdin` under `limits` in the strongest available isolation; never raises for
    anything the program does. Raises SandboxError when no isolation setup can start the interpreter."""
    return _run(isolation(), code, stdin, limits)


_plan_lock = threading.Lock()
_plan: Isolation | None = None


def isolation() -> Isolation:
    """The isolation setup of this process (probed on first use, then cached); raises SandboxError."""
    global _plan
    with _plan_lock:
        if _plan is None:
            _plan = _choose_isolation()
        return _plan


def _interpreter() -> str:
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


def _candidates() -> list[Isolation]:
    """Isolation setups from the strongest to the weakest."""
    root = os.geteuid() == 0
    ids = _drop_ids()
    # root: a leased uid per run first, then the shared `nobody`, then no drop at all
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
        roots = [True, False] if pid_mount and _PIVOT_ROOT_NR.get(platform.machine()) else [False]
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


def _choose_isolation() -> Isolation:
    """The first candidate that runs a test program correctly; logs what is missing, once."""
    failures = []
    probe_limits = SandboxLimits(wall_s=20.0)
    for cand in _candidates():
        try:
            res = _run(cand, "print(6 * 7)", "", probe_limits)
        except SandboxError as e:
            failures.append(f"{cand.describe()}: {e}")
            continue
        if res.status == "ok" and res.stdout.strip() == "42":
            _warn_missing(cand, failures)
            return cand
        failures.append(f"{cand.describe()}: {res.status} {res.detail} {res.stderr[-300:]!r}")
    raise SandboxError("no sandbox setup can run the interpreter: " + "; ".join(failures))


def _warn_missing(plan: Isolation, failures: list[str]) -> None:
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


def _hidden_ancestor(path: str) -> str | None:
    """The topmost ancestor directory of `path` that others cannot traverse (e.g. /root), else None."""
    parts = Path(path).parts
    for i in range(2, len(parts) + 1):
        p = os.path.join(*parts[:i])
        if not os.stat(p).st_mode & 0o001:
            return p
    return None


def _wrapper_config(
    plan: Isolation, tmp: str, status_fd: int, limits: SandboxLimits, ids: tuple[int, int] | None
) -> dict:
    interp = _interpreter()
    masks: list[tuple[str, int]] = []
    expose = None
    if plan.mountns and not plan.rootfs:  # the fallback: hide what is writable, all else stays readable
        masks = [(m, 0o1777) for m in _MASKED if os.path.isdir(m) and not os.path.islink(m)]
        home = os.path.expanduser("~")
        if plan.userns and home not in ("/", "") and os.path.isdir(home):
            masks.append((home, 0o755))  # our own files, writable by the program in a user namespace
        prefix = os.path.realpath(sys.base_prefix)
        hidden = _hidden_ancestor(prefix) if plan.uid is not None else None
        if hidden:
            masks.append((hidden, 0o755))
        if any(prefix == m or prefix.startswith(m + "/") for m, _ in masks):
            expose = prefix  # bound back, read-only, under the mask so the interpreter stays reachable
    fsize = max(limits.file_mb * 2**20, limits.output_bytes + 1)
    return {
        "program": os.path.join(tmp, "program.py"),
        "work": _WORK_IN_NS if plan.mountns else os.path.join(tmp, "work"),
        "interpreter": interp,
        "uid": ids[0] if ids else None,
        "gid": ids[1] if ids else None,
        "drop_caps": plan.userns,
        "masks": [list(m) for m in masks],
        "expose": expose,
        "root": os.path.join(tmp, "root") if plan.rootfs else None,
        "binds": [list(b) for b in _runtime_binds()] if plan.rootfs else [],
        "proc": plan.pidns,
        "pivot_nr": _PIVOT_ROOT_NR.get(platform.machine(), -1),
        "tmpfs_kb": max(4096, 4 * fsize // 1024),
        "cpu_s": max(1, math.ceil(limits.cpu_s)),
        "as_bytes": limits.memory_mb * 2**20,
        "fsize": fsize,
        "nproc": limits.max_procs,
        "status_fd": status_fd,
    }


@functools.cache
def _runtime_binds() -> tuple[tuple[str, str, str], ...]:
    """What the minimal root shows, as (kind, path, link target): "bind" (read-only, from the host), "link"
    (a symlink as on the host, so that paths the loader and the interpreter use resolve) or "hide" (an
    empty directory over it). Only the interpreter, its standard library (minus site-packages), the
    shared libraries they load and the loader's cache."""
    interp = _interpreter()
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


@contextlib.contextmanager
def _leased_ids(plan: Isolation) -> Iterator[tuple[int, int] | None]:
    """The (uid, gid) the program runs as: with a uid pool, one no other run holds (a lock file per uid,
    so across processes too), so that RLIMIT_NPROC is this run's own budget; else the plan's."""
    if not plan.uid_pool:
        yield (plan.uid, plan.gid) if plan.uid is not None and plan.gid is not None else None
        return
    lock_dir = os.path.join(tempfile.gettempdir(), "relay-sandbox-uids")
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    st = os.stat(lock_dir)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise SandboxError(f"{lock_dir} must be ours and not writable by others")
    start = random.randrange(_UID_COUNT)
    for i in range(_UID_COUNT):
        uid = _UID_BASE + (start + i) % _UID_COUNT
        fd = os.open(os.path.join(lock_dir, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield uid, uid
        finally:
            os.close(fd)  # after the run: its pid namespace (or process group) is gone
        return
    raise SandboxError(f"all {_UID_COUNT} sandbox uids are in use")


def _minimal_env(work: str) -> dict[str, str]:
    return {
        "PATH": _PATH,
        "HOME": work,
        "TMPDIR": work,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _run(plan: Isolation, code: str, stdin: str, limits: SandboxLimits) -> RunResult:
    source = code.encode("utf-8", errors="replace")
    if len(source) > limits.file_mb * 2**20:
        return RunResult("error", None, "", "", 0.0, f"program larger than file_mb={limits.file_mb}")
    tmp = tempfile.mkdtemp(prefix="relay-sandbox-")
    try:
        os.chmod(tmp, 0o711)  # the work dir inside may belong to the sandbox uid (without mount ns)
        Path(tmp, "program.py").write_bytes(source)
        Path(tmp, "stdin.txt").write_bytes(stdin.encode("utf-8", errors="replace"))
        if plan.rootfs:
            os.mkdir(os.path.join(tmp, "root"))  # the mount point of the minimal root
        with _leased_ids(plan) as ids:
            return _run_in(plan, tmp, limits, ids)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_in(plan: Isolation, tmp: str, limits: SandboxLimits, ids: tuple[int, int] | None) -> RunResult:
    r_fd, w_fd = os.pipe()
    cfg = _wrapper_config(plan, tmp, w_fd, limits, ids)
    wrapper = [cfg["interpreter"], "-I", "-S", "-B", "-c", _wrapper_source(), marshal.dumps(cfg).hex()]
    argv = [*plan.prefix, *wrapper]
    out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    t0 = time.monotonic()
    try:
        with (
            open(os.path.join(tmp, "stdin.txt"), "rb") as fin,
            open(out_path, "wb") as fout,
            open(err_path, "wb") as ferr,
        ):
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=fin,
                    stdout=fout,
                    stderr=ferr,
                    cwd=tmp,
                    env=_minimal_env(cfg["work"]),
                    close_fds=True,
                    pass_fds=(w_fd,),
                    start_new_session=True,  # own process group: killpg below reaches every descendant
                )
            except OSError as e:
                raise SandboxError(f"cannot start {argv[0]}: {e}") from e
        os.close(w_fd)
        w_fd = -1
        timed_out = _wait_then_kill(proc, limits.wall_s)
        wall = time.monotonic() - t0
        status = _read_status(r_fd)
    finally:
        os.close(r_fd)
        if w_fd >= 0:
            os.close(w_fd)
    stdout, out_over = _read_capped(out_path, limits.output_bytes)
    stderr, err_over = _read_capped(err_path, limits.output_bytes)
    kind, rc, detail = _classify(timed_out, status, proc.returncode, out_over or err_over, stderr, limits)
    return RunResult(kind, rc, stdout, stderr, wall, detail)


def _wait_then_kill(proc: subprocess.Popen, wall_s: float) -> bool:
    """Wait up to `wall_s` for the process to exit, SIGKILL its whole group, reap it; True on timeout.

    The group is killed while its leader is still an unreaped zombie, so its pgid cannot have been
    reused by an unrelated process.
    """
    timed_out = False
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        if pidfd is not None:  # readable once the process exits; poll() has no FD_SETSIZE limit
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            timed_out = not poller.poll(wall_s * 1000)
        else:
            try:
                proc.wait(timeout=wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already empty
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if pidfd is not None:
            os.close(pidfd)
    return timed_out


def _read_status(fd: int) -> str:
    """The wrapper's report ('exit N CPU', 'signal N CPU' or 'error MESSAGE'); '' if it reported none."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    return b"".join(chunks).decode("utf-8", errors="replace")


def _read_capped(path: str, limit: int) -> tuple[str, bool]:
    """At most `limit` bytes of the file, decoded, and whether the file was longer."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError:
        return "", False
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit


def _classify(
    timed_out: bool, status: str, wrapper_rc: int | None, over: bool, stderr: str, limits: SandboxLimits
) -> tuple[str, int | None, str]:
    """(status, returncode, detail) of a finished run."""
    if timed_out:
        return "timeout", None, f"wall-clock limit {limits.wall_s}s exceeded"
    errors = [line[6:] for line in status.splitlines() if line.startswith("error ")]
    if errors:
        return "sandbox_error", None, "; ".join(errors)
    m = re.search(r"^(exit|signal) (-?\d+) ([0-9.]+)$", status, re.MULTILINE)
    if m is None:  # the wrapper died before reporting: killed from inside (only possible without pid ns)
        if wrapper_rc is not None and wrapper_rc < 0:
            return "killed", wrapper_rc, f"sandbox wrapper killed by signal {-wrapper_rc}"
        return "sandbox_error", wrapper_rc, f"sandbox wrapper exited {wrapper_rc} without a report"
    how, num, cpu = m.group(1), int(m.group(2)), float(m.group(3))
    memory = "MemoryError" in stderr or "Cannot allocate memory" in stderr
    if how == "signal":
        name = _signal_name(num)
        if num == signal.SIGXCPU or (num == signal.SIGKILL and cpu >= math.ceil(limits.cpu_s)):
            return "timeout", -num, f"cpu limit {limits.cpu_s}s exceeded ({name})"
        if num == signal.SIGXFSZ or over:
            return "output_limit", -num, f"output or file size limit exceeded ({name})"
        if memory:
            return "memory", -num, f"memory limit {limits.memory_mb} MB exceeded ({name})"
        return "killed", -num, f"killed by {name}"
    if over:
        return "output_limit", num, f"output over {limits.output_bytes} bytes (exit {num})"
    if num == 0:
        return "ok", 0, ""
    if memory:
        return "memory", num, f"memory limit {limits.memory_mb} MB exceeded (exit {num})"
    return "error", num, f"exit status {num}"


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


# ----------------------------------------------------------------------------------------------------
# Code rewards


def extract_program(response: str) -> str:
    """The last ```python fenced block of a response, else its last untagged ``` block, else the whole
    text. Fences must start a line; an unclosed fence is no block."""
    blocks = _FENCE.findall(response)
    python = [body for tag, body in blocks if tag.lower() in _PYTHON_TAGS]
    untagged = [body for tag, body in blocks if not tag]
    return (python or untagged or [response])[-1]


def _normalize(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _parse_tests(answer: str) -> list[dict[str, str]]:
    """The tests of an answer string; raises ValueError (a dataset bug, not the model's) when malformed."""
    try:
        spec = json.loads(answer)
        tests = spec["tests"]
        parsed = [{"input": str(t["input"]), "output": str(t["output"])} for t in tests]
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(
            f'code answer must be JSON {{"tests": [{{"input": ..., "output": ...}}]}}, got {answer!r:.200}'
        ) from e
    if not parsed:
        raise ValueError(f"code answer has no tests: {answer!r:.200}")
    return parsed


CODE_LIMITS = SandboxLimits(cpu_s=1.0, wall_s=4.0)
"""Limits of one test run of `code_reward`: 1 s of CPU stops busy loops; the wall limit leaves room for
a loaded machine (sandbox start included) and only bites programs that sleep or block."""
CODE_BUDGET_S = 8.0
"""Wall-clock budget of one `code_reward` call, below the default reward.timeout_s of 10 s."""

TEST_PARALLEL = 4
"""Most tests of one response that run at once (each in its own sandbox): a response's reward waits for its
slowest test, not for the sum of them, so a trajectory is scored soon after it finishes."""


def _check_test(
    program: str, test: dict[str, str], limits: SandboxLimits, deadline: float
) -> tuple[str, RunResult | None]:
    """("pass" or why the test failed: a run status or "wrong_answer"; the run's result, None when the
    budget was spent before it ran). Raises SandboxError when the sandbox itself fails."""
    left = deadline - time.monotonic()
    if left < 0.5:  # the budget is spent: fails as a timeout without running
        return "timeout", None
    res = run_program(program, test["input"], replace(limits, wall_s=min(limits.wall_s, left)))
    if res.status == "sandbox_error":
        raise SandboxError(f"sandbox failed: {res.detail}")
    if res.status != "ok":
        return res.status, res
    return ("pass" if _normalize(res.stdout) == _normalize(test["output"]) else "wrong_answer"), res


def run_tests(
    program: str,
    tests: list[dict[str, str]],
    limits: SandboxLimits = CODE_LIMITS,
    deadline: float | None = None,
    parallel: int = TEST_PARALLEL,
) -> list[tuple[str, RunResult | None]]:
    """`_check_test` for each test (in order), up to `parallel` of them at once, each in its own sandbox;
    tests not started when `deadline` (monotonic; default: `CODE_BUDGET_S` from now) is near fail as
    timeouts. Raises SandboxError when the sandbox itself fails."""
    deadline = time.monotonic() + CODE_BUDGET_S if deadline is None else deadline
    if parallel <= 1 or len(tests) <= 1:
        return [_check_test(program, t, limits, deadline) for t in tests]
    from concurrent.futures import ThreadPoolExecutor

    # each run's thread waits for its sandbox to exit (the sandbox dies with that thread: pdeathsig)
    with ThreadPoolExecutor(min(parallel, len(tests)), thread_name_prefix="sandbox-test") as pool:
        return list(pool.map(lambda t: _check_test(program, t, limits, deadline), tests))


def code_reward(
    response: str, answer: str, limits: SandboxLimits = CODE_LIMITS, budget_s: float = CODE_BUDGET_S
) -> dict:
    """Score a response's program on the tests in `answer` (`{"tests": [{"input", "output"}, ...]}`).

    Each test runs the program once with its input on stdin; it passes when the stripped stdout equals
    the stripped expected output (trailing spaces of lines ignored). Tests still to run when `budget_s`
    is spent fail as timeouts. Returns `{"score": passed/total, "passed": n, "total": m}` plus
    `{KIND: 1.0}` for the first failing test, KIND being the run status (error, timeout, memory, killed,
    output_limit) or "wrong_answer". Never raises for what the program does; raises SandboxError when the
    sandbox itself fails and ValueError for a malformed `answer`.
    """
    return code_feedback(response, answer, limits, budget_s)[0]


FEEDBACK_CHARS = 400
"""Most characters of test output `code_feedback` reports (each quoted stream is also cut to a line)."""


def code_feedback(
    response: str,
    answer: str,
    limits: SandboxLimits = CODE_LIMITS,
    budget_s: float = CODE_BUDGET_S,
    max_chars: int = FEEDBACK_CHARS,
) -> tuple[dict, str]:
    """`code_reward`'s score and a short report of the first failing test ("" when all pass), for a model
    to fix its program: which test failed and how, with the last line of the program's stderr (the
    exception) for a crash, or the test's input and the program's output for a wrong answer. The expected
    output is never shown (a model could print it back). At most `max_chars` characters. Same deadlines
    and errors as `code_reward`."""
    tests = _parse_tests(answer)
    checked = run_tests(extract_program(response), tests, limits, time.monotonic() + budget_s)
    outcomes = [o for o, _ in checked]
    passed = outcomes.count("pass")
    out: dict = {"score": passed / len(tests), "passed": passed, "total": len(tests)}
    failed = next((i for i, o in enumerate(outcomes) if o != "pass"), None)
    if failed is None:
        return out, ""
    out[outcomes[failed]] = 1.0
    report = _failure_report(failed, len(tests), outcomes[failed], tests[failed], checked[failed][1])
    return out, report[:max_chars]


def _last_line(text: str, limit: int = 160) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:limit] if lines else ""


def _failure_report(i: int, total: int, kind: str, test: dict[str, str], res: RunResult | None) -> str:
    head = f"Test {i + 1} of {total} failed: {kind.replace('_', ' ')}."
    if res is None:
        return f"{head} (out of time before it ran)"
    if kind == "wrong_answer":
        got = _last_line(res.stdout) if res.stdout.strip() else "(nothing)"
        return f"{head}\nInput: {_last_line(test['input'])}\nYour output: {got}"
    err = _last_line(res.stderr) or res.detail
    return f"{head}\n{err}" if err else head


# ----------------------------------------------------------------------------------------------------
# The wrapper: pid 1 inside the namespaces. Its functions are shipped as source to `python -I -S -B -c`
# (see _wrapper_source), so that it starts importing only os, sys, resource and marshal (and ctypes):
# importing this whole module there would cost tens of milliseconds per run. Stdlib builtins only.

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC = 1, 2, 4, 32, 4096, 16384
_MS_NOEXEC, _MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME, _MNT_DETACH = 8, 1024, 2048, 1 << 21, 2
_PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_SET_NO_NEW_PRIVS = 24, 28, 38
_SECBIT_NOROOT_LOCKED = 0x3  # SECBIT_NOROOT | SECBIT_NOROOT_LOCKED: uid 0 gains no capabilities on exec


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    import ctypes

    def enc(s: str | None) -> bytes | None:
        return s.encode() if s is not None else None

    if _libc().mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _prepare_mounts(cfg: dict) -> None:
    """Private tmpfs over the masked directories; the interpreter's prefix bound back read-only."""
    expose_fd = os.open(cfg["expose"], os.O_RDONLY | os.O_DIRECTORY) if cfg["expose"] else None
    for path, mode in cfg["masks"]:
        opts = f"size={cfg['tmpfs_kb']}k,nr_inodes=4096,mode={mode:o}"
        _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, opts)
    if expose_fd is not None:  # the directory was opened before its ancestor got masked
        os.makedirs(cfg["expose"], exist_ok=True)
        _mount(f"/proc/self/fd/{expose_fd}", cfg["expose"], None, _MS_BIND | _MS_REC, None)
        try:  # noqa: SIM105 (no contextlib import in the wrapper)
            _mount(None, cfg["expose"], None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY, None)
        except OSError:
            pass  # read-only is a nicety: the dropped uid cannot write there anyway
        os.close(expose_fd)


def _bind_ro(src: str, dst: str) -> None:
    """Bind `src` on `dst` read-only, nosuid, nodev; keeps the flags the source mount has (in a user
    namespace its noexec/atime flags are locked: a remount that dropped them would fail)."""
    _mount(src, dst, None, _MS_BIND, None)
    f = os.statvfs(src).f_flag
    keep = (f & (_MS_NOEXEC | _MS_NOATIME | _MS_NODIRATIME)) | (_MS_RELATIME if f & 4096 else 0)
    _mount(None, dst, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | keep, None)


def _build_root(cfg: dict) -> None:
    """A minimal root in a tmpfs: the runtime read-only, a few /dev nodes, a private /tmp, the namespace's
    own /proc; then pivot_root into it and detach the host's tree, read-only from then on."""
    root = cfg["root"]
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1024k,nr_inodes=4096,mode=755")
    for kind, path, target in cfg["binds"]:
        dst = root + path
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if kind == "link":
            os.symlink(target, dst)
        elif kind == "hide":
            _mount("tmpfs", dst, "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV, "size=4k,nr_inodes=8,mode=755")
        else:
            if os.path.isdir(path):
                os.makedirs(dst, exist_ok=True)
            else:
                open(dst, "a").close()
            _bind_ro(path, dst)
    os.makedirs(root + "/dev", exist_ok=True)
    for dev in _DEVICES:  # device nodes work through a bind of the node, not on the nodev tmpfs
        open(f"{root}/dev/{dev}", "a").close()
        _mount(f"/dev/{dev}", f"{root}/dev/{dev}", None, _MS_BIND, None)
    os.makedirs(root + "/tmp")
    opts = f"size={cfg['tmpfs_kb']}k,nr_inodes=4096,mode=1777"
    _mount("tmpfs", root + "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, opts)
    if cfg["proc"]:  # the pid namespace's own; hidepid: the program does not see its root-owned parent
        os.makedirs(root + "/proc")
        try:
            _mount("proc", root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "hidepid=2")
        except OSError:
            _mount("proc", root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)
    import ctypes

    libc = _libc()
    os.chdir(root)
    if libc.syscall(cfg["pivot_nr"], b".", b".") != 0:  # the old root ends up stacked under the new
        raise OSError(ctypes.get_errno(), "pivot_root failed")
    if libc.umount2(b".", _MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), "cannot detach the host's root")
    os.chdir("/")
    _mount(None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV, None)


def _setup_workdir(cfg: dict, source: bytes) -> None:
    work = cfg["work"]
    os.makedirs(work, mode=0o700, exist_ok=True)
    with open(os.path.join(work, "prog.py"), "wb") as f:
        f.write(source)
    if cfg["uid"] is not None:
        os.chown(work, cfg["uid"], cfg["gid"])


def _report(fd: int, line: str) -> None:
    os.write(fd, (line.replace("\n", " ") + "\n").encode("utf-8", errors="replace"))


def _restrict(cfg: dict) -> None:
    """In the program's process, before exec: rlimits, the uid drop, no way to regain privileges."""
    cpu = cfg["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_AS, (cfg["as_bytes"], cfg["as_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["fsize"], cfg["fsize"]))
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
    # after setuid, so that it counts the sandbox uid's processes (or the user namespace's), not ours
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))
    libc = _libc()
    if cfg["drop_caps"]:  # root of a user namespace: drop every capability, also across exec
        for cap in range(64):
            libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # fails (harmlessly) past the last capability
        if libc.prctl(_PR_SET_SECUREBITS, _SECBIT_NOROOT_LOCKED, 0, 0, 0) != 0:
            raise OSError("cannot set SECBIT_NOROOT")
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # setuid binaries give nothing back
        raise OSError("cannot set no_new_privs")


def _exec_program(cfg: dict) -> None:
    """The forked child: never returns (it execs the program, or reports why not and exits)."""
    try:
        os.chdir(cfg["work"])
        _restrict(cfg)
        interp = cfg["interpreter"]
        os.execve(interp, [interp, "-I", "-S", "-B", "-X", "utf8", "prog.py"], _minimal_env(cfg["work"]))
    except BaseException as e:
        _report(cfg["status_fd"], f"error starting the program: {type(e).__name__}: {e}")
    finally:
        os._exit(71)


def _wrapper_main(cfg: dict) -> int:
    """Prepare mounts and work dir, run the program, reap, report `exit N CPU` / `signal N CPU`."""
    fd = cfg["status_fd"]
    os.set_inheritable(fd, False)  # the program must not be able to forge the report
    try:
        with open(cfg["program"], "rb") as f:  # read before /tmp is masked
            source = f.read()
        if cfg["root"]:
            _build_root(cfg)
        elif cfg["masks"]:
            _prepare_mounts(cfg)
        _setup_workdir(cfg, source)
        child = os.fork()
    except Exception as e:
        _report(fd, f"error preparing the sandbox: {type(e).__name__}: {e}")
        return 70
    if child == 0:
        _exec_program(cfg)
    while True:  # as pid 1 we also reap orphans; stop when the program itself exits
        try:
            pid, st, usage = os.wait4(-1, 0)
        except ChildProcessError:
            _report(fd, "error lost track of the program")
            return 70
        if pid == child:
            break
    cpu = usage.ru_utime + usage.ru_stime
    if os.WIFSIGNALED(st):
        _report(fd, f"signal {os.WTERMSIG(st)} {cpu:.3f}")
    else:
        _report(fd, f"exit {os.waitstatus_to_exitcode(st)} {cpu:.3f}")
    return 0  # as pid 1, our exit kills whatever is left in the namespace


_WRAPPER_FUNCS = (_libc, _mount, _prepare_mounts, _bind_ro, _build_root, _setup_workdir, _report, _restrict)
_WRAPPER_FUNCS += (_minimal_env,)
_WRAPPER_FUNCS += (_exec_program, _wrapper_main)


@functools.cache
def _wrapper_source() -> str:
    """The wrapper script: its constants and functions, then a call of _wrapper_main on argv[1]."""
    head = [
        "from __future__ import annotations",
        "import marshal, os, resource, sys",
        f"_PATH = {_PATH!r}",
        f"_MS_RDONLY, _MS_NOSUID, _MS_NODEV = {_MS_RDONLY}, {_MS_NOSUID}, {_MS_NODEV}",
        f"_MS_REMOUNT, _MS_BIND, _MS_REC = {_MS_REMOUNT}, {_MS_BIND}, {_MS_REC}",
        f"_MS_NOEXEC, _MS_NOATIME, _MS_NODIRATIME = {_MS_NOEXEC}, {_MS_NOATIME}, {_MS_NODIRATIME}",
        f"_MS_RELATIME, _MNT_DETACH, _DEVICES = {_MS_RELATIME}, {_MNT_DETACH}, {_DEVICES!r}",
        f"_PR_CAPBSET_DROP, _PR_SET_SECUREBITS = {_PR_CAPBSET_DROP}, {_PR_SET_SECUREBITS}",
        f"_PR_SET_NO_NEW_PRIVS, _SECBIT_NOROOT_LOCKED = {_PR_SET_NO_NEW_PRIVS}, {_SECBIT_NOROOT_LOCKED}",
    ]
    body = [inspect.getsource(fn) for fn in _WRAPPER_FUNCS]
    tail = "sys.exit(_wrapper_main(marshal.loads(bytes.fromhex(sys.argv[1]))))\n"
    return "\n".join(head) + "\n\n" + "\n".join(body) + "\n" + tail
