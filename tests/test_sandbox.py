"""Tests for app.rewards.sandbox: hostile programs are stopped within their deadline and the host stays fine.

Every test asserts its deadline (wall < limits.wall_s + 3 s). Tests of a protection the machine cannot
provide (no network namespace, no pid namespace, ...) are skipped with the reason.
"""

from __future__ import annotations

import json
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from app.rewards import sandbox
from app.rewards.code import CODE_BUDGET_S, CODE_LIMITS, code_reward, extract_program, run_tests
from app.rewards.sandbox import RunResult, SandboxLimits, run_program
from app.rewards.sandbox_isolation import Isolation

FAST = SandboxLimits(cpu_s=1.0, wall_s=5.0)  # busy loops stop at 1 s of CPU; wall: room for load
# programs that must finish ("ok") however loaded the machine: beside the integration suite an interpreter
# has taken over 5 s to start
ROOMY = replace(FAST, wall_s=30.0)
SLACK_S = 10.0

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux only")


def run(code: str, stdin: str = "", limits: SandboxLimits = FAST) -> RunResult:
    """run_program, asserting that it returned within its deadline."""
    t0 = time.monotonic()
    res = run_program(code, stdin, limits)
    elapsed = time.monotonic() - t0
    assert res.status in sandbox.STATUSES
    assert res.wall_s < limits.wall_s + SLACK_S, res
    assert elapsed < limits.wall_s + SLACK_S, (elapsed, res)
    return res


def plan() -> Isolation:
    return sandbox.isolation()


def marked_pids(marker: str) -> list[int]:
    """Pids of live processes whose command line contains `marker`."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if marker.encode() in (d / "cmdline").read_bytes():
                found.append(int(d.name))
        except OSError:
            pass  # exited meanwhile, or not ours to read
    return found


def host_can_fork() -> bool:
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 7 and subprocess.run(["true"], check=False).returncode == 0


def reexec_with_marker(marker: str, body: str) -> str:
    """A program that re-executes itself as `python -c BODY MARKER`, so that every process it (and its
    children) runs carries the marker in its command line."""
    return f"import os, sys\nos.execv(sys.executable, [sys.executable, '-I', '-S', '-c', {body!r}, {marker!r}])\n"


# ----------------------------------------------------------------------------------------------------
# Ordinary programs


def test_isolation_is_probed_and_described():
    iso = plan()
    assert "netns=" in iso.describe() and "rootfs=" in iso.describe() and "procs=" in iso.describe()
    if os.geteuid() == 0:
        assert iso.uid is not None or not iso.prefix  # root always drops to an unprivileged uid
        assert iso.uid_pool and iso.process_budget() == "per-run"  # root can always claim uids
        if iso.mountns:
            assert iso.rootfs, iso.describe()  # root with a mount namespace can always pivot_root
    assert plan() is iso  # probed once, cached


def test_correct_program_reads_stdin_and_passes():
    res = run("s = input()\nprint(s[::-1])\n", "hello\n")
    assert (res.status, res.returncode, res.stdout, res.detail) == ("ok", 0, "olleh\n", "")


def test_unicode_roundtrip():
    res = run("print(input().upper())", "grüße ✓\n")
    assert res.status == "ok" and res.stdout == "GRÜSSE ✓\n"


def test_syntax_error_is_an_error():
    res = run("def f(:\n  pass\n")
    assert res.status == "error" and res.returncode == 1
    assert "SyntaxError" in res.stderr


def test_exception_and_exit_code_are_errors():
    assert run("raise ValueError('boom')").status == "error"
    res = run("import sys; sys.exit(3)")
    assert (res.status, res.returncode) == ("error", 3)


def test_environment_is_minimal_and_cwd_is_private():
    code = (
        "import json, os, sys\n"
        "open('scratch.txt', 'w').write('x')\n"
        "print(json.dumps({'env': dict(os.environ), 'cwd': os.getcwd(), 'files': os.listdir('.'),"
        " 'isolated': sys.flags.isolated, 'no_site': sys.flags.no_site,"
        " 'fds': sorted(int(f) for f in os.listdir('/proc/self/fd'))}))\n"
    )
    before = {p.name for p in Path(tempfile.gettempdir()).glob("relay-sandbox-*")}
    res = run(code)
    assert res.status == "ok", res
    info = json.loads(res.stdout)
    assert set(info["env"]) <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONDONTWRITEBYTECODE", "LC_CTYPE"}
    assert "PYTHONPATH" not in info["env"]
    assert info["env"]["HOME"] == info["cwd"]
    assert sorted(info["files"]) == ["prog.py", "scratch.txt"]
    assert info["isolated"] == 1 and info["no_site"] == 1
    assert info["fds"][:3] == [0, 1, 2] and len(info["fds"]) <= 4  # +1: the listdir's own fd
    after = {p.name for p in Path(tempfile.gettempdir()).glob("relay-sandbox-*")}
    assert after <= before  # the temporary directory is gone


# ----------------------------------------------------------------------------------------------------
# Hostile programs


def test_infinite_loop_hits_the_cpu_limit():
    res = run("while True:\n    pass\n")
    assert res.status == "timeout", res
    assert res.wall_s < FAST.wall_s + SLACK_S


def test_sleeping_program_hits_the_wall_clock_limit():
    limits = SandboxLimits(cpu_s=5.0, wall_s=1.0)
    res = run("import time\ntime.sleep(60)\n", limits=limits)
    assert res.status == "timeout" and "wall" in res.detail, res
    assert 1.0 <= res.wall_s < 1.0 + SLACK_S


def test_memory_hog_hits_the_memory_limit():
    res = run("x = bytearray(2 * 1024**3)\n")
    assert res.status == "memory", res
    res = run("chunks = []\nwhile True:\n    chunks.append(bytearray(10 * 1024**2))\n")
    assert res.status == "memory", res


def test_gigantic_output_is_capped_without_memory_growth():
    rss_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    res = run("import sys\nblock = 'x' * 10**6\nwhile True:\n    sys.stdout.write(block)\n")
    assert res.status == "output_limit", res
    assert len(res.stdout) == FAST.output_bytes
    res = run("import os\nwhile True:\n    os.write(2, b'y' * 10**6)\n")
    assert res.status == "output_limit", res
    assert len(res.stderr) == FAST.output_bytes
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kb) / 1024
    assert grown_mb < 64


def test_big_file_in_the_work_dir_is_capped():
    res = run("with open('big', 'wb') as f:\n    while True:\n        f.write(b'z' * 10**6)\n")
    assert res.status in ("error", "output_limit"), res
    assert "File too large" in res.stderr or res.status == "output_limit"


def test_fork_bomb_is_contained_and_leaves_nothing_behind():
    marker = f"relay-bomb-{uuid.uuid4().hex}"
    body = "import os\nwhile True:\n    os.fork()\n"
    res = run(reexec_with_marker(marker, body))
    assert res.status != "ok", res
    time.sleep(0.2)
    assert marked_pids(marker) == []
    assert host_can_fork()


def test_fork_bomb_is_capped_by_max_procs():
    iso = plan()
    if iso.uid is None and not iso.userns:
        pytest.skip(f"no process cap without a uid drop or user namespace ({iso.describe()})")
    code = (
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(30)\n            os._exit(0)\n        n += 1\n"
        "except OSError as e:\n    print(n, e.errno)\n"
    )
    res = run(code, limits=ROOMY)
    assert res.status == "ok", res
    forked, errno = map(int, res.stdout.split())
    assert forked < FAST.max_procs and errno == 11  # EAGAIN from RLIMIT_NPROC
    assert host_can_fork()


def test_processes_escaping_the_group_are_killed():
    if not plan().pidns:
        pytest.skip(f"setsid() escapees are only contained in a pid namespace ({plan().describe()})")
    marker = f"relay-escape-{uuid.uuid4().hex}"
    body = "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(60)\n"
    res = run(reexec_with_marker(marker, body), limits=ROOMY)
    assert res.status == "ok", res
    time.sleep(0.2)
    assert marked_pids(marker) == []


@pytest.mark.parametrize(
    "attack",
    [
        "os.kill(os.getppid(), signal.SIGKILL)",
        "os.killpg(0, signal.SIGKILL)",
        "os.kill(-1, signal.SIGKILL)",
        "os.kill(1, signal.SIGKILL)",
    ],
)
def test_killing_parents_does_not_reach_the_caller(attack):
    if "-1" in attack and not plan().pidns:
        pytest.skip("kill(-1) would reach other processes of the same uid without a pid namespace")
    res = run(f"import os, signal\ntry:\n    {attack}\nexcept OSError as e:\n    print('denied', e)\n")
    assert res.status in ("ok", "error", "killed"), res
    assert host_can_fork()  # we are alive (else this would not run) and still working


def test_writing_outside_the_work_dir_fails(tmp_path):
    iso = plan()
    if iso.uid is None and not iso.mountns:
        pytest.skip(f"no write protection without a uid drop or mount namespace ({iso.describe()})")
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    victim.chmod(0o666)  # even a world-writable file of ours must stay out of reach
    etc_probe = Path("/etc") / f"relay-sandbox-probe-{uuid.uuid4().hex}"
    code = (
        "import sys\nfor path in sys.stdin.read().split():\n    try:\n"
        "        with open(path, 'w') as f:\n            f.write('pwned')\n        print('wrote', path)\n"
        "    except OSError as e:\n        print('denied', path, type(e).__name__)\n"
    )
    try:
        res = run(code, f"{victim}\n{etc_probe}\n")
        assert res.status == "ok", res
        assert "wrote" not in res.stdout, res.stdout
        assert victim.read_text() == "original"
        assert not etc_probe.exists()
    finally:
        etc_probe.unlink(missing_ok=True)


def test_host_tmp_is_invisible_and_bounded():
    if not plan().mountns:
        pytest.skip(f"no private /tmp without a mount namespace ({plan().describe()})")
    code = "import os\nprint(sorted(os.listdir('/tmp')))\n"
    assert run(code).stdout.strip() == "['work']"
    res = run("i = 0\nwhile True:\n    open(f'/tmp/f{i}', 'wb').write(b'x' * 500_000)\n    i += 1\n")
    assert res.status == "error" and "No space left" in res.stderr, res


SECRET = "relay-secret-answer-42"


def test_program_sees_nothing_of_the_host_or_the_project(tmp_path):
    """Not /etc/passwd, not a dataset with answers, not the hidden tests of its own problem (in the
    repository's working directory and in /tmp), not the sandbox's own files, not its parent."""
    if not plan().rootfs:
        if os.geteuid() == 0:
            pytest.fail(f"root without a minimal root filesystem ({plan().describe()})")
        pytest.skip(f"no minimal root filesystem on this machine ({plan().describe()})")
    repo_dir = Path(__file__).resolve().parents[1]
    dataset = tmp_path / "train.jsonl"
    dataset.write_text(json.dumps({"prompt": "p", "answer": SECRET}) + "\n")
    hidden = repo_dir / f".relay-hidden-tests-{uuid.uuid4().hex}.json"
    hidden.write_text(cases_json(("1 2\n", SECRET)))
    targets = [
        "/etc/passwd",
        "/etc/hostname",
        str(dataset),
        str(hidden),
        str(repo_dir / "app" / "rewards" / "sandbox.py"),
    ]
    targets += ["/proc/1/cmdline", "/proc/1/environ", os.path.expanduser("~/.bashrc")]
    code = (
        "import glob, os, sys\nfor path in sys.stdin.read().split() + glob.glob('/tmp/relay-sandbox-*/*'):\n"
        "    try:\n        data = open(path, 'rb').read()\n        print('READ', path, len(data))\n"
        "    except OSError as e:\n        print('denied', path, type(e).__name__)\n"
        "print('root', *sorted(os.listdir('/')))\nprint('proc', sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
    )
    try:
        res = run(code, "\n".join(targets) + "\n")
    finally:
        hidden.unlink()
    assert res.status == "ok", res
    assert "READ" not in res.stdout and SECRET not in res.stdout, res.stdout
    assert res.stdout.count("denied") == len(targets), res.stdout
    listing = re.search(r"^root (.*)$", res.stdout, re.MULTILINE).group(1).split()
    assert not {"work", "home", "var", "opt", "srv", "mnt", "boot"} & set(listing), listing
    assert re.search(r"^proc \['2'\]$", res.stdout, re.MULTILINE), res.stdout  # only itself, not pid 1


def test_a_fork_bomb_does_not_starve_a_concurrent_sandbox():
    """RLIMIT_NPROC counts per uid: each run gets its own uid (or user namespace), so a fork bomb that
    holds its whole process budget does not make a correct program in another sandbox fail."""
    if plan().process_budget() != "per-run":
        pytest.skip(f"no per-run process budget on this machine ({plan().describe()})")
    bomb = (
        "import os, sys, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(20)\n            os._exit(0)\n        n += 1\nexcept OSError:\n"
        "    print(n, flush=True)\n    time.sleep(20)\n"
    )
    # the competitive-programming idiom: solve on one thread with a bigger stack (a thread is a process
    # to RLIMIT_NPROC)
    correct = (
        "```python\nimport threading\n\ndef main():\n    a, b = map(int, input().split())\n    print(a + b)\n\n"
        "threading.stack_size(2**24)\nt = threading.Thread(target=main)\nt.start()\nt.join()\n```"
    )
    limits = replace(CODE_LIMITS, cpu_s=2.0, wall_s=6.0)  # the same process budget as code_reward
    with ThreadPoolExecutor(2) as pool:
        bombing = pool.submit(run_program, bomb, "", limits)
        time.sleep(1.5)  # the bomb holds all its processes by now
        scores = [code_reward(correct, ADD) for _ in range(2)]
        bombed = bombing.result()
    assert bombed.status == "timeout", bombed
    assert bombed.stdout.strip() and int(bombed.stdout.split()[0]) < limits.max_procs, bombed
    assert scores == [{"score": 1.0, "passed": 3, "total": 3}] * 2, scores


def test_network_is_unreachable():
    if not plan().netns:
        pytest.skip(f"network isolation is unavailable on this machine ({plan().describe()})")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        port = server.getsockname()[1]
        code = (
            "import socket\ns = socket.socket()\ns.settimeout(1.0)\ntry:\n"
            f"    s.connect(('127.0.0.1', {port}))\n    print('connected')\n"
            "except OSError as e:\n    print('blocked', e)\n"
        )
        res = run(code)
        assert res.status == "ok", res
        assert res.stdout.startswith("blocked"), res.stdout
        with pytest.raises(BlockingIOError):
            server.accept()


def test_fallback_without_namespaces_still_shields_the_caller(monkeypatch):
    """Without any namespace or uid drop the wrapper still stands between the program and us."""
    bare = Isolation(prefix=(), netns=False, pidns=False, mountns=False, userns=False, uid=None, gid=None)
    monkeypatch.setattr(sandbox, "_plan", bare)
    assert run("print(1 + 1)").stdout == "2\n"
    res = run("import os\nos.kill(os.getppid(), 9)\nimport time\ntime.sleep(0.2)\nprint('alive')\n")
    assert res.status == "killed" and "wrapper" in res.detail, res
    assert host_can_fork()


def test_limits_are_validated():
    with pytest.raises(ValueError, match="wall_s"):
        SandboxLimits(wall_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=8)


def test_oversized_program_is_rejected_without_running():
    res = run_program("#" * (2 * 2**20), "", FAST)
    assert res.status == "error" and "larger" in res.detail


# ----------------------------------------------------------------------------------------------------
# code_reward


def cases_json(*pairs: tuple[str, str]) -> str:
    return json.dumps({"tests": [{"input": i, "output": o} for i, o in pairs]})


ADD = cases_json(("1 2\n", "3"), ("10 -4\n", "6"), ("0 0\n", "0"))


def test_extract_program_prefers_python_fences():
    assert extract_program("print(1)") == "print(1)"
    assert extract_program("Here:\n```python\nprint(2)\n```\ndone") == "print(2)\n"
    assert extract_program("```\nprint(3)\n```") == "print(3)\n"
    assert extract_program("```python\nprint(6)\n") == "```python\nprint(6)\n"  # unclosed: no block
    assert extract_program("x = '```'\nprint(7)") == "x = '```'\nprint(7)"
    assert extract_program("```text\nx\n```\n```py\nprint(4)\n```\n```python\nprint(5)\n```") == "print(5)\n"


def test_code_reward_full_pass():
    response = "Sure!\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"
    assert code_reward(response, ADD) == {"score": 1.0, "passed": 3, "total": 3}


def test_code_reward_partial_pass_is_a_fraction():
    response = "a, b = map(int, input().split())\nprint(abs(a + b))"  # wrong for the negative sum
    out = code_reward(response, cases_json(("1 2\n", "3"), ("-5 1\n", "-4"), ("0 0\n", "0")))
    assert out["passed"] == 2 and out["total"] == 3
    assert out["score"] == pytest.approx(2 / 3)
    assert out["wrong_answer"] == 1.0


@pytest.mark.parametrize(
    ("response", "kind"),
    [
        ("def broken(:\n", "error"),
        ("while True:\n    pass\n", "timeout"),
        ("x = bytearray(2 * 1024**3)\n", "memory"),
        ("print('x' * 10**6)\n", "output_limit"),
        ("print(42)\n", "wrong_answer"),
        ("", "wrong_answer"),
    ],
)
def test_code_reward_names_the_first_failure(response, kind):
    """Each failure is named by its kind. Only the endless loop meets the code task's limits (its CPU limit,
    1 s, or the wall clock); the others get the wall-clock headroom a loaded machine needs to start the
    sandbox's interpreter (make test runs these beside the integration tests on 2 cores, where a 2 GiB
    allocation once reached the 4 s wall clock and was named a timeout)."""
    limits, budget = CODE_LIMITS, CODE_BUDGET_S
    if kind != "timeout":
        limits, budget = replace(limits, wall_s=60.0), 60.0
    t0 = time.monotonic()
    out = code_reward(response, cases_json(("1 2\n", "3")), limits, budget)
    assert time.monotonic() - t0 < limits.wall_s + SLACK_S
    assert out == {"score": 0.0, "passed": 0, "total": 1, kind: 1.0}


def test_code_reward_stops_at_its_budget():
    t0 = time.monotonic()
    out = code_reward("import time\ntime.sleep(60)", ADD, budget_s=1.5)
    assert time.monotonic() - t0 < 1.5 + SLACK_S
    assert out == {"score": 0.0, "passed": 0, "total": 3, "timeout": 1.0}


def test_a_responses_tests_run_at_once_and_keep_their_order(monkeypatch):
    """`run_tests` starts up to `parallel` sandboxes together: each run first waits at a barrier of all four
    (it breaks, failing the test, if they ran one after another), then runs for real; outcomes stay in the
    tests' order."""
    barrier = threading.Barrier(4, timeout=60)
    real = sandbox.run_program

    def together(code, stdin="", limits=CODE_LIMITS):
        barrier.wait()
        return real(code, stdin, limits)

    monkeypatch.setattr("app.rewards.code.run_program", together)
    program = "n = int(input())\nprint(1 // n if n != 7 else 'seven')"
    tests = [{"input": "1\n", "output": "1"}, {"input": "0\n", "output": "0"}]
    tests += [{"input": "7\n", "output": "7"}, {"input": "2\n", "output": "0"}]
    checked = run_tests(program, tests, parallel=4)
    assert [outcome for outcome, _ in checked] == ["pass", "error", "wrong_answer", "pass"]
    assert "ZeroDivisionError" in checked[1][1].stderr


def test_code_reward_never_raises_for_garbage_output():
    one = cases_json(("1 2\n", "3"))
    for response in ["\x00\x01", "```python\n", "import os; os._exit(0)", "raise SystemExit(9)", "💥" * 1000]:
        out = code_reward(response, one)
        assert 0.0 <= out["score"] <= 1.0


def test_code_reward_rejects_a_malformed_answer():
    for answer in ["not json", json.dumps({"cases": []}), json.dumps({"tests": []}), json.dumps([1])]:
        with pytest.raises(ValueError, match="code answer"):
            code_reward("print(1)", answer)


def test_no_marked_processes_are_left_over():
    """After all of the above: no process of the hostile tests is still running."""
    time.sleep(0.2)
    assert marked_pids("relay-bomb-") == [] and marked_pids("relay-escape-") == []
