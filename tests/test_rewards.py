"""Tests for app.rewards (built-in rewards, reward.fn resolution, evaluate()) and app.rewards.pool's
killable scoring processes."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import sys
import time
import uuid
from pathlib import Path

import pytest

from app.config import ConfigError, load_config
from app.rewards import (
    RewardResult,
    evaluate,
    exact_match,
    extract_gsm8k,
    gsm8k_reward,
    overlong_penalty,
    resolve_reward_fn,
)
from app.rewards.pool import OUTPUT_CAP_BYTES, RewardPool, RewardProcesses
from app.rewards.styles import RewardInput


def sample(response: str, answer: str, data_source: str = "x") -> RewardInput:
    """One sample to score (a row with only a data source)."""
    return RewardInput(response=response, answer=answer, data_source=data_source)


def test_overlong_penalty_hand_values():
    # DAPO: max 20 tokens, buffer 4 -> none up to 16, then -(excess / 4) x factor, -factor at 20 and beyond
    assert overlong_penalty(10, 20, 4) == 0.0 and overlong_penalty(16, 20, 4) == 0.0
    assert overlong_penalty(17, 20, 4) == -0.25 and overlong_penalty(18, 20, 4, factor=2.0) == -1.0
    assert overlong_penalty(20, 20, 4) == -1.0 and overlong_penalty(25, 20, 4) == -1.0
    assert overlong_penalty(20, 20, 0) == 0.0  # buffer 0: off


def test_exact_match_is_strict_after_strip():
    assert exact_match("  8\n", "8") == 1.0
    assert exact_match("8 ", " 8") == 1.0
    assert exact_match("8.", "8") == 0.0
    assert exact_match("", "8") == 0.0
    assert exact_match("", "  ") == 1.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", None),
        ("####", None),
        ("#### abc", None),
        ("the answer is 5", None),
        ("#### 1,234.", "1234"),
        ("#### $1,234.50", "1234.50"),
        ("#### -7", "-7"),
        ("####72", "72"),
        ("#### 5 apples", "5"),
        ("#### 3\nlater #### 4", "4"),
        ("#### 4 then #### nothing", None),
        ("Ответ: 12 → #### 42 ✓", "42"),
        ("#### ٤٢", None),  # non-ASCII digits are not numbers here
        ("#### .", None),
    ],
)
def test_extract_gsm8k_strict(text, expected):
    assert extract_gsm8k(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("the answer is 5", "5"),
        ("first 3, then 1,234.", "1234"),
        ("costs $12.5 total", "12.5"),
        ("range 3-5", "5"),
        ("went down by -4", "-4"),
        ("no digits here", None),
        ("", None),
        ("#### abc but 5 later", None),  # a #### without a number is not rescued
    ],
)
def test_extract_gsm8k_flexible(text, expected):
    assert extract_gsm8k(text, flexible=True) == expected


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("so #### 72", "Natalia sold 48/2 = 24 ... #### 72", 1.0),
        ("#### 72.0", "72", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("#### $1,234.", "#### 1,234", 1.0),
        ("#### 71", "72", 0.0),
        ("the answer is 72", "72", 0.0),  # strict: needs ####
        ("", "72", 0.0),
        ("#### 72", "", 0.0),
        ("#### abc", "#### abc", 0.0),
    ],
)
def test_gsm8k_reward(response, answer, expected):
    assert gsm8k_reward(response, answer) == expected


def test_gsm8k_reward_flexible():
    assert gsm8k_reward("the answer is 72", "72", flexible=True) == 1.0


def test_resolve_builtins_and_auto():
    assert resolve_reward_fn("exact_match") is exact_match
    assert resolve_reward_fn("gsm8k") is gsm8k_reward
    assert resolve_reward_fn("auto", "openai/gsm8k") is gsm8k_reward
    assert resolve_reward_fn("auto", "arith") is exact_match
    assert resolve_reward_fn("auto") is exact_match


def test_resolve_dotted_paths():
    assert resolve_reward_fn("app.rewards:exact_match") is exact_match
    assert resolve_reward_fn("app.rewards.gsm8k_reward") is gsm8k_reward


USER_MODULE = """
def reward(response, answer, **kwargs):
    return {"score": float(response == answer), "length": len(response)}

class Scorer:
    @staticmethod
    def call(response, answer):
        return 0.5

NOT_CALLABLE = 3

def one_arg(response):
    return 1.0
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_relay_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_relay_rewards"


def test_resolve_user_function(user_module):
    fn = resolve_reward_fn(f"{user_module}:reward")
    assert fn("a", "a") == {"score": 1.0, "length": 1}
    assert resolve_reward_fn(f"{user_module}.reward") is fn
    assert resolve_reward_fn(f"{user_module}:Scorer.call")("x", "y") == 0.5


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("", "is not of that form"),
        ("exact", "is not of that form"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("app.rewards:nope", "has no attribute 'nope'"),
        ("app.rewards:log.nope", "has no attribute 'log.nope'"),
        ("bad spec!:fn", "is not of that form"),
    ],
)
def test_resolve_bad_specs(spec, fragment):
    with pytest.raises(ValueError) as exc:
        resolve_reward_fn(spec)
    msg = str(exc.value)
    assert fragment in msg
    assert f"reward.fn={spec!r}" in msg
    assert "pkg.module:function" in msg  # the fix


def test_resolve_user_bad_attributes(user_module):
    with pytest.raises(ValueError, match="not a function"):
        resolve_reward_fn(f"{user_module}:NOT_CALLABLE")
    with pytest.raises(ValueError, match=r"cannot call .*one_arg.* as \(response, answer\).*three styles"):
        resolve_reward_fn(f"{user_module}:one_arg")


def test_resolve_module_that_fails_on_import(tmp_path, monkeypatch):
    (tmp_path / "broken_relay_rewards.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="RuntimeError: boom at import"):
        resolve_reward_fn("broken_relay_rewards:fn")


def test_evaluate_numbers():
    assert evaluate(exact_match, sample("8", "8"), -1.0) == RewardResult(1.0)
    assert evaluate(lambda r, a: True, sample("", ""), 0.0).score == 1.0
    assert evaluate(lambda r, a: 3, sample("", ""), 0.0).score == 3.0


def test_evaluate_dict_returns(user_module):
    fn = resolve_reward_fn(f"{user_module}:reward")
    res = evaluate(fn, sample("ab", "ab"), 0.0)
    assert res == RewardResult(1.0, None, "", {"length": 2.0})
    res = evaluate(lambda r, a: {"score": 0.5, "note": "text", "nan": math.nan, "ok": 1}, sample("", ""), 0.0)
    assert res.score == 0.5 and res.error is None and res.extras == {"ok": 1.0}
    res = evaluate(lambda r, a: {"acc": 1.0}, sample("", ""), -1.0)
    assert (res.score, res.error) == (-1.0, "invalid")
    assert "'score'" in res.detail


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "1.0", None, [1.0], {"score": math.nan}])
def test_evaluate_invalid(value):
    res = evaluate(lambda r, a: value, sample("", ""), -1.0)
    assert (res.score, res.error) == (-1.0, "invalid")
    assert res.detail


def test_evaluate_exception(caplog):
    def boom(response, answer):
        raise KeyError("missing field")

    res = evaluate(boom, sample("", ""), -0.5)
    assert (res.score, res.error) == (-0.5, "exception")
    assert "KeyError" in res.detail and "missing field" in res.detail
    assert any("missing field" in r.getMessage() for r in caplog.records)


def test_evaluate_timeout_error_raised_by_fn_is_an_exception():
    def fn(response, answer):
        raise TimeoutError("inner")

    assert evaluate(fn, sample("", ""), 0.0).error == "exception"


# ----------------------------------------------------------------------------------------------------
# Scoring processes: reward functions the tests below run in a subprocess (importable by dotted path)


def hostile(response: str, answer: str) -> float:
    """Sleeps, or computes a big-integer power: minutes of C code that never release the GIL (like
    sympy's 9^9^9^9), or scores 1.0."""
    if response == "sleep":
        time.sleep(60)
    if response == "gil":
        return float(10 ** (10**9) > 0)
    return 1.0


def chatty(response: str, answer: str) -> float:
    print("a reward that prints must not corrupt the protocol")
    os.write(1, b"\x00\x00\x00\x05junk")
    return float(response == answer)


def dies(response: str, answer: str) -> float:
    os._exit(3)


def loud(response: str, answer: str) -> float:
    """Prints 10 MB (to stdout, and a line to stderr through the file descriptor, as C code would)."""
    os.write(2, b"from C\n")
    sys.stdout.write("x" * 10_000_000)
    return 1.0


def hog(response: str, answer: str) -> float:
    """Allocates `answer` MiB (and touches it)."""
    block = bytearray(int(answer) * 2**20)
    block[::4096] = b"\x01" * len(block[::4096])
    return 1.0


async def async_judge(response: str, answer: str) -> dict:
    await asyncio.sleep(0.01)
    return {"score": float(response == answer), "judge": 0.25}


def slow(response: str, answer: str) -> float:
    time.sleep(0.2)
    return float(response == answer)


def slow_span(response: str, answer: str) -> dict:
    """`slow`, with when it ran (wall clock, seconds)."""
    start = time.time()
    time.sleep(0.2)
    return {"score": float(response == answer), "start": start, "end": time.time()}


def boom(response: str, answer: str) -> float:
    raise RuntimeError("reward crashed")


def pid_or_hang(response: str, answer: str) -> dict:
    """1.0 and the scoring process's pid; "hang" never returns, "die" ends the process."""
    while response == "hang":
        time.sleep(1)
    if response == "die":
        os._exit(3)
    return {"score": 1.0, "pid": float(os.getpid())}


def subscores(response: str, answer: str) -> dict:
    return {"score": 1.0, "format": 0.5, "length": float(len(response))}


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live process, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def warm_pids(procs: RewardProcesses) -> set[int]:
    """The idle processes' pids once the spare (and any replacement) under way is up."""
    deadline = time.monotonic() + 120
    while True:
        with procs.lock:
            if procs.spares_pending == 0:
                return {p.proc.pid for p in procs.idle}
        assert time.monotonic() < deadline, "the spare scoring process did not start"
        time.sleep(0.02)


def test_processes_score_sub_scores_async_and_printing_rewards(user_module):
    procs = RewardProcesses(f"{user_module}:reward", 5.0, -1.0)
    try:
        assert procs.score(sample("ab", "ab", "x")) == RewardResult(1.0, None, "", {"length": 2.0})
        warm = warm_pids(procs)  # the one that scored, and a spare
        assert len(warm) == 2
        assert procs.score(sample("ab", "cd", "x")).score == 0.0 and warm_pids(procs) == warm  # reused
    finally:
        procs.close()
    for spec, want in [
        ("tests.test_rewards:async_judge", {"judge": 0.25}),
        ("tests.test_rewards:chatty", {}),
    ]:
        procs = RewardProcesses(spec, 5.0, -1.0)
        try:
            assert procs.score(sample("7", "7", "x")) == RewardResult(1.0, None, "", want)
            assert procs.score(sample("7", "8", "x")).score == 0.0
        finally:
            procs.close()


@pytest.mark.parametrize("how", ["sleep", "gil"])
def test_a_hanging_reward_is_killed_at_its_deadline(how):
    """Sleeping or holding the GIL: the reward scores on_error at the deadline, and its process is gone
    (no CPU burnt afterwards); the next reward gets a fresh process."""
    procs = RewardProcesses("tests.test_rewards:hostile", 0.5, -1.0)
    try:
        assert procs.score(sample("ok", "", "x")).score == 1.0  # process started, function resolved: warm
        warm = warm_pids(procs)
        t0 = time.monotonic()
        res = procs.score(sample(how, "", "x"))
        elapsed = time.monotonic() - t0
        assert (res.score, res.error) == (-1.0, "timeout"), res
        # killed at its deadline, not run to the end (a wide margin for a loaded machine)
        assert elapsed < 0.5 + 10
        (pid,) = procs.killed
        assert pid in warm and cpu_seconds(pid) is None  # killed and reaped: it burns nothing
        assert procs.score(sample("ok", "", "x")).score == 1.0  # a replacement scores the next one
    finally:
        procs.close()


def test_a_reward_that_kills_its_process_is_a_crash_and_the_next_one_scores():
    procs = RewardProcesses("tests.test_rewards:dies", 5.0, -1.0)
    try:
        res = procs.score(sample("", "", "x"))
        assert (res.score, res.error) == (-1.0, "crash"), res
        assert all(p.proc.poll() is None for p in procs.idle)  # the dead one is not kept (a spare may be)
        assert procs.score(sample("", "", "x")).error == "crash"  # a fresh process each time, no hang
    finally:
        procs.close()


def test_what_a_reward_prints_is_capped_and_the_rest_counted(caplog):
    """A reward printing 10 MB: a few kB of it reach the log, the rest is dropped and counted; the reward
    still scores and its process is kept."""
    caplog.set_level(logging.INFO, logger="app.rewards.pool")
    procs = RewardProcesses("tests.test_rewards:loud", 10.0, -1.0)
    try:
        res = procs.score(sample("", "", "x"))
        assert (res.score, res.error) == (1.0, None), res
        assert res.output_dropped == 10_000_007 - OUTPUT_CAP_BYTES
        assert (procs.output_dropped, procs.output_capped) == (res.output_dropped, 1)
        logged = "".join(r.getMessage() for r in caplog.records)
        assert "from C" in logged and "xxxx" in logged and len(logged) < 2 * OUTPUT_CAP_BYTES
        assert len(warm_pids(procs)) == 2  # kept, beside the spare
        assert procs.score(sample("", "", "x")).output_dropped == res.output_dropped  # counted per reward
        assert (procs.output_dropped, procs.output_capped) == (2 * res.output_dropped, 2)
    finally:
        procs.close()


def test_a_reward_over_its_memory_limit_scores_on_error_as_oom():
    """An allocation past reward.max_memory_mb fails in the scoring process (RLIMIT_DATA): the reward scores
    on_error, counted as `oom`; its process is replaced and the next reward scores."""
    procs = RewardProcesses("tests.test_rewards:hog", 10.0, -1.0, max_memory_mb=256)
    try:
        assert procs.score(sample("", "64", "x")).score == 1.0  # under the limit
        warm = warm_pids(procs)
        res = procs.score(sample("", "1024", "x"))
        assert (res.score, res.error) == (-1.0, "oom"), res
        assert "MemoryError" in res.detail and "reward.max_memory_mb" in res.detail
        assert len([p for p in warm if cpu_seconds(p) is None]) == 1  # the one that ran it: killed, reaped
        assert procs.score(sample("", "64", "x")).score == 1.0  # a replacement scores the next one
    finally:
        procs.close()


def test_reward_max_memory_mb_is_a_validated_key_the_pool_applies():
    with pytest.raises(ConfigError, match="reward.max_memory_mb"):
        load_config(None, ["reward.max_memory_mb=64"])
    assert load_config(None, []).reward.max_memory_mb == 4096
    cfg = load_config(
        None, ["reward.fn=tests.test_rewards:hog", "reward.max_memory_mb=256", "reward.on_error=-1"]
    )
    pool = RewardPool(cfg.reward, "t")
    try:
        res = asyncio.run(pool.score(sample("", "1024", "x")))
        assert (res.score, res.error) == (-1.0, "oom"), res
    finally:
        pool.close()


def test_auto_reward_routes_code_rows_to_the_sandbox():
    from app.rewards import resolve_reward_fn
    from app.rewards.code import code_reward

    assert resolve_reward_fn("auto", "code") is code_reward
    assert resolve_reward_fn("code", "anything") is code_reward


def test_sandboxed_programs_die_with_a_killed_code_reward():
    """A code reward killed at its deadline takes its sandboxed program with it (parent-death signals):
    nothing of the abandoned evaluation keeps running."""
    marker = f"relay-orphan-{uuid.uuid4().hex}"
    body = "import time\ntime.sleep(60)\n"
    program = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-I', '-S', '-c', {body!r}, {marker!r}])\n"
    answer = json.dumps({"tests": [{"input": "", "output": "1"}]})
    procs = RewardProcesses("code", 1.5, -1.0)
    try:
        assert procs.score(sample("print(1)", answer, "code")).score == 1.0  # warm: the sandbox is probed
        assert _marked(marker) == []
        res = procs.score(sample(program, answer, "code"))
        assert res.error == "timeout", res
        time.sleep(0.5)
        assert _marked(marker) == []
    finally:
        procs.close()


def _marked(marker: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and marker.encode() in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except OSError:
            pass
    return out
