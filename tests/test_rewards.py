"""Tests for app.rewards: built-in rewards, reward.fn resolution and the guarded score()."""

from __future__ import annotations

import math
import threading
import time

import pytest

from app.rewards import (
    RewardResult,
    exact_match,
    extract_gsm8k,
    gsm8k_reward,
    resolve_reward_fn,
    score,
)


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
    with pytest.raises(ValueError, match=r"must accept \(response, answer\)"):
        resolve_reward_fn(f"{user_module}:one_arg")


def test_resolve_module_that_fails_on_import(tmp_path, monkeypatch):
    (tmp_path / "broken_relay_rewards.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="RuntimeError: boom at import"):
        resolve_reward_fn("broken_relay_rewards:fn")


def test_score_numbers():
    assert score(exact_match, "8", "8", 1.0, -1.0) == RewardResult(1.0)
    assert score(lambda r, a: True, "", "", 1.0, 0.0).score == 1.0
    assert score(lambda r, a: 3, "", "", 1.0, 0.0).score == 3.0


def test_score_dict_returns(user_module):
    fn = resolve_reward_fn(f"{user_module}:reward")
    res = score(fn, "ab", "ab", 1.0, 0.0)
    assert res == RewardResult(1.0, None, "", {"length": 2.0})
    res = score(lambda r, a: {"score": 0.5, "note": "text", "nan": math.nan, "ok": 1}, "", "", 1.0, 0.0)
    assert res.score == 0.5 and res.error is None and res.extras == {"ok": 1.0}
    res = score(lambda r, a: {"acc": 1.0}, "", "", 1.0, -1.0)
    assert (res.score, res.error) == (-1.0, "invalid")
    assert "'score'" in res.detail


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "1.0", None, [1.0], {"score": math.nan}])
def test_score_invalid(value):
    res = score(lambda r, a: value, "", "", 1.0, -1.0)
    assert (res.score, res.error) == (-1.0, "invalid")
    assert res.detail


def test_score_exception(caplog):
    def boom(response, answer):
        raise KeyError("missing field")

    res = score(boom, "", "", 1.0, -0.5)
    assert (res.score, res.error) == (-0.5, "exception")
    assert "KeyError" in res.detail and "missing field" in res.detail
    assert any("missing field" in r.getMessage() for r in caplog.records)


def test_score_timeout_error_raised_by_fn_is_an_exception():
    def fn(response, answer):
        raise TimeoutError("inner")

    assert score(fn, "", "", 1.0, 0.0).error == "exception"


def test_score_hanging_function_is_abandoned():
    release = threading.Event()

    def hang(response, answer):
        release.wait(30)
        return 1.0

    start = time.monotonic()
    res = score(hang, "", "", 0.2, -1.0)
    elapsed = time.monotonic() - start
    release.set()
    assert (res.score, res.error) == (-1.0, "timeout")
    assert "0.2" in res.detail
    assert elapsed < 1.0


def test_score_no_deadline():
    assert score(lambda r, a: 1.0, "", "", 0, 0.0).score == 1.0
    assert score(lambda r, a: 1.0, "", "", math.inf, 0.0).score == 1.0


def test_auto_reward_routes_code_rows_to_the_sandbox():
    from app.rewards import resolve_reward_fn
    from app.sandbox import code_reward

    assert resolve_reward_fn("auto", "code") is code_reward
    assert resolve_reward_fn("code", "anything") is code_reward
