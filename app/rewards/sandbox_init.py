"""The sandbox's wrapper: pid 1 inside the namespaces, trusted; it starts the untrusted program as pid 2.

This file is a script, not a library: app/rewards/sandbox.py reads its text and runs it as
`python -I -S -B -c TEXT CONFIG` (CONFIG: the hex of a marshalled dict, see `_wrapper_config` there). It
prepares the mounts (a minimal root, or the fallback's masks) and the work directory, forks the program with
its rlimits and without privileges, reaps every process of the namespace until the program exits, and
reports `exit N CPU`, `signal N CPU` or `error MESSAGE` on the status descriptor. It imports only os, sys,
resource and marshal (and ctypes): importing app/rewards/sandbox.py here would cost tens of milliseconds per
run. Stdlib builtins only. app/rewards/sandbox.py also imports `minimal_env` from it (the same environment
for the wrapper and the program).
"""

from __future__ import annotations

import marshal
import os
import resource
import sys

_PATH = "/usr/local/bin:/usr/bin:/bin"
_DEVICES = ("null", "zero", "full", "random", "urandom")
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


def minimal_env(work: str) -> dict[str, str]:
    """The environment of the wrapper and of the program: no variable of the caller's."""
    return {
        "PATH": _PATH,
        "HOME": work,
        "TMPDIR": work,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _exec_program(cfg: dict) -> None:
    """The forked child: never returns (it execs the program, or reports why not and exits)."""
    try:
        os.chdir(cfg["work"])
        _restrict(cfg)
        interp = cfg["interpreter"]
        os.execve(interp, [interp, "-I", "-S", "-B", "-X", "utf8", "prog.py"], minimal_env(cfg["work"]))
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


if __name__ == "__main__":
    sys.exit(_wrapper_main(marshal.loads(bytes.fromhex(sys.argv[1]))))
