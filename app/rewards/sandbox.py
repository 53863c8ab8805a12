"""Run untrusted, model-written Python programs against test cases (Linux only).

Each `run_program` call starts this chain, in its own session and process group:

    unshare [--user --map-root-user] --net --pid --fork --kill-child --mount-proc   (when available)
      python -I -S -B -c WRAPPER CONFIG             the wrapper: pid 1 of the new pid namespace, trusted
        python -I -S -B -X utf8 prog.py            the program: pid 2, limits set, privileges dropped

This module runs a program and classifies its outcome; the setups it chooses from are in
app/rewards/sandbox_isolation.py, the wrapper (WRAPPER, a script) is app/rewards/sandbox_init.py, and the
code-task reward that runs a response's program on its tests is app/rewards/code.py.

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
  user of its own: as root, a uid (= gid) claimed from a pool of unused ids (a lock file per id, so that
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
import logging
import marshal
import math
import os
import platform
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from app.rewards.sandbox_init import minimal_env
from app.rewards.sandbox_isolation import (
    PIVOT_ROOT_NR,
    Isolation,
    candidates,
    interpreter,
    runtime_binds,
    warn_missing,
)

log = logging.getLogger(__name__)

STATUSES = ("ok", "error", "timeout", "memory", "killed", "output_limit", "sandbox_error")
_MASKED = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # world-writable: private tmpfs in the sandbox
_WORK_IN_NS = "/tmp/work"  # cwd/HOME of the program inside the mount namespace (a private tmpfs)
_UID_BASE, _UID_COUNT = 1_500_000_000, 4096  # claimed sandbox uids (= gids): owned by no account


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


def _choose_isolation() -> Isolation:
    """The first candidate that runs a test program correctly; logs what is missing, once."""
    failures = []
    probe_limits = SandboxLimits(wall_s=20.0)
    for cand in candidates():
        try:
            res = _run(cand, "print(6 * 7)", "", probe_limits)
        except SandboxError as e:
            failures.append(f"{cand.describe()}: {e}")
            continue
        if res.status == "ok" and res.stdout.strip() == "42":
            warn_missing(cand, failures)
            return cand
        failures.append(f"{cand.describe()}: {res.status} {res.detail} {res.stderr[-300:]!r}")
    raise SandboxError("no sandbox setup can run the interpreter: " + "; ".join(failures))


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
    interp = interpreter()
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
        "binds": [list(b) for b in runtime_binds()] if plan.rootfs else [],
        "proc": plan.pidns,
        "pivot_nr": PIVOT_ROOT_NR.get(platform.machine(), -1),
        "tmpfs_kb": max(4096, 4 * fsize // 1024),
        "cpu_s": max(1, math.ceil(limits.cpu_s)),
        "as_bytes": limits.memory_mb * 2**20,
        "fsize": fsize,
        "nproc": limits.max_procs,
        "status_fd": status_fd,
    }


@contextlib.contextmanager
def _claimed_ids(plan: Isolation) -> Iterator[tuple[int, int] | None]:
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
        with _claimed_ids(plan) as ids:
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
                    env=minimal_env(cfg["work"]),
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


@functools.cache
def _wrapper_source() -> str:
    """The wrapper script (app/rewards/sandbox_init.py), run as pid 1 with `python -c`."""
    return Path(__file__).with_name("sandbox_init.py").read_text(encoding="utf-8")
