"""Reward functions: built-ins, resolution of `reward.fn`, and a guarded `evaluate()` that never raises.

A reward function is called in one of three styles, detected from its parameters when it is resolved
(app/rewards/styles.py): `(response, answer)`, verl's `compute_score(data_source, solution_str, ground_truth,
extra_info)` or TRL's batched `(prompts, completions, **kwargs)`. It returns a number (float/int/bool) or a
dict of named sub-scores with a required `"score"` key; the other entries are reported as extras.

`evaluate()` runs a function in-process without a deadline and never raises (`evaluate_group()`: a TRL-style
function on a whole group of samples in one call). Deadlines are enforced one
level up, by app.rewards.pool.RewardProcesses: a reward runs in a long-lived scoring subprocess that is
killed (SIGKILL) when it misses its deadline, because a thread cannot be stopped (a big-integer power in
sympy holds the GIL, so even the thread that waits on the deadline would not wake).

The reward stage, in this package:

    __init__.py  the reward functions (`BUILTINS`), `resolve_reward_fn`, `evaluate` (this module)
    styles.py    how a function is called: `RewardInput` (one sample and its row), `RewardCall` (the style)
    combine.py   several functions with weights (`reward.fns`, `reward.weights`): the total and sub-scores
    guard.py     stops a run whose rewards fail on every one of its first samples
    check.py     one real call of each user function on the data's first row, before Ray starts
    pool.py      the scoring processes: killable, with deadlines; on reward workers when there are any
    code.py      the code-task reward: a response's program on its hidden tests (`code_reward`)
    sandbox.py   the code sandbox that runs untrusted programs (with sandbox_isolation.py, sandbox_init.py)
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from app.rewards.code import code_reward
from app.rewards.humaneval import humaneval_reward
from app.rewards.styles import InvalidReturn, RewardCall, RewardInput, SignatureError

log = logging.getLogger(__name__)

RewardFn = Callable[..., Any]
"""A reward function in one of the styles of app/rewards/styles.py; the built-ins take (response, answer)."""

_NUMBER = re.compile(r"(?:(?<![\w.])-)?\$?\s*[0-9][0-9,]*(?:\.[0-9]+)?")
_AFTER_HASHES = re.compile(r"\s*([-+]?\$?\s*[0-9][0-9,]*(?:\.[0-9]+)?)")


def exact_match(response: str, answer: str) -> float:
    """1.0 when `response` equals `answer` after stripping surrounding whitespace, else 0.0 (strict)."""
    return 1.0 if response.strip() == answer.strip() else 0.0


def overlong_penalty(length: int, max_tokens: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment (<= 0) of a `length`-token response: none up to max_tokens - buffer,
    then linear in the excess, -factor at max_tokens (and beyond); `buffer` 0 turns it off."""
    if buffer <= 0:
        return 0.0
    excess = length - (max_tokens - buffer)
    return -factor * min(1.0, excess / buffer) if excess > 0 else 0.0


def _normalize_number(raw: str) -> str | None:
    """`"$1,234."` -> `"1234"`; None when nothing numeric is left."""
    s = re.sub(r"[\s,$]", "", raw).rstrip(".").lstrip("+")
    return s if re.fullmatch(r"-?[0-9]+(?:\.[0-9]+)?", s) else None


def extract_gsm8k(text: str, flexible: bool = False) -> str | None:
    """The GSM8K final answer: the number right after the last `####`, normalized.

    Commas, `$` and a trailing period are removed (`"#### $1,234."` -> `"1234"`). Returns None when there
    is no `####` or no number directly follows it. With `flexible=True` and no `####` in the text, the
    last number anywhere in the text is taken instead (`"the answer is 5"` -> `"5"`).
    """
    if "####" in text:
        m = _AFTER_HASHES.match(text.rsplit("####", 1)[1])
        return _normalize_number(m.group(1)) if m else None
    if flexible:
        found = _NUMBER.findall(text)
        return _normalize_number(found[-1]) if found else None
    return None


def _as_decimal(s: str | None) -> Decimal | None:
    if s is None:
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def gsm8k_reward(response: str, answer: str, flexible: bool = False) -> float:
    """1.0 when the response's `#### N` equals the truth numerically (`72.0` == `72`, `1,234` == `1234`).

    The ground truth may be a full GSM8K solution (`"... #### 72"`) or the plain number (`"72"`). With
    `flexible=True` a response without `####` is scored on its last number.
    """
    truth = _as_decimal(extract_gsm8k(answer, flexible=True))
    pred = _as_decimal(extract_gsm8k(response, flexible=flexible))
    return 1.0 if truth is not None and pred is not None and truth == pred else 0.0


def shaped_score(strict: bool, flexible: bool, formatted: bool) -> dict[str, float]:
    """The shaped rewards' ladder: 1.0 for the strict match, 0.8 for the flexible one, 0.1 for the format
    alone, else 0.0; with the three outcomes as 0/1 extras."""
    score = 1.0 if strict else 0.8 if flexible else 0.1 if formatted else 0.0
    return {
        "score": score,
        "strict": float(strict),
        "flexible": float(flexible),
        "formatted": float(formatted),
    }


def gsm8k_shaped_reward(response: str, answer: str) -> dict[str, float]:
    """GSM8K with partial credit, for models that rarely write the strict form at first (verl's gsm8k reward
    has the flexible match and the format score; this combines them):

    * 1.0: the answer after the last `#### ` is right (the strict match);
    * 0.8: no right `#### N`, but the response's last number is right (the flexible match);
    * 0.1: a `#### N` that is wrong (the format alone);
    * 0.0: otherwise.

    Extras `strict`, `flexible` and `formatted` (0/1) are logged per step and at validation beside the score.
    """
    truth = _as_decimal(extract_gsm8k(answer, flexible=True))
    strict_pred = _as_decimal(extract_gsm8k(response))
    numbers = _NUMBER.findall(response)
    last = _as_decimal(_normalize_number(numbers[-1])) if numbers else None
    strict = truth is not None and strict_pred == truth
    flexible = truth is not None and (strict or last == truth)
    formatted = strict_pred is not None
    return shaped_score(strict, flexible, formatted)


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer is mathematically equivalent to `answer` (math-verify: LaTeX or
    plain expressions, `\\boxed{}` preferred; 1/2 == 0.5 == \\frac{1}{2}, (x+1)^2 == x^2+2x+1), else 0.0.
    math-verify's own signal-based timeouts are off: the scoring process's deadline bounds the call instead
    (e.g. `\\boxed{9^{9^{9^{9}}}}`, which sympy would compute for ever)."""
    return 1.0 if _equivalent(_parsed_gold(answer), response) else 0.0


def _parsed_gold(answer: str) -> list:
    """The reference answer as math-verify parses it (a bare `7` or `1/2` read as LaTeX); raises ValueError
    when it cannot be parsed."""
    from math_verify import parse

    gold = parse(answer if ("$" in answer or "\\" in answer) else f"${answer}$", parsing_timeout=None)
    if not gold:
        raise ValueError(f"math reward: cannot parse the reference answer {answer!r}")
    return gold


def _equivalent(gold: list, text: str) -> bool:
    """`text`'s final answer (as math-verify reads it) is equivalent to the parsed reference `gold`."""
    from math_verify import parse, verify

    pred = parse(text, parsing_timeout=None)
    return bool(pred) and verify(gold, pred, timeout_seconds=None)


def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` in `text` (braces matched), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def math_shaped_reward(response: str, answer: str) -> dict[str, float]:
    """The math reward with partial credit, for models that rarely box their answer at first (as
    `gsm8k_shaped` does for `#### N`):

    * 1.0: the last `\\boxed{}` holds an answer equivalent to `answer` (the strict match);
    * 0.8: no right boxed answer, but math-verify's reading of the whole response is right (the flexible
      match);
    * 0.1: a `\\boxed{}` that is wrong (the format alone);
    * 0.0: otherwise.

    Extras `strict`, `flexible` and `formatted` (0/1) are logged per step and at validation beside the score.
    """
    gold = _parsed_gold(answer)  # once, for both readings
    boxed = last_boxed(response)
    strict = boxed is not None and _equivalent(gold, f"$\\boxed{{{boxed}}}$")
    flexible = strict or _equivalent(gold, response)
    formatted = boxed is not None
    return shaped_score(strict, flexible, formatted)


BUILTINS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "gsm8k": gsm8k_reward,
    "gsm8k_shaped": gsm8k_shaped_reward,
    "math": math_reward,
    "math_shaped": math_shaped_reward,
    "code": code_reward,
    "humaneval": humaneval_reward,
}


def resolve_reward_fn(spec: str, data_source: str | None = None) -> RewardFn:
    """The reward function named by `spec` (the `reward.fn` setting).

    `exact_match`, `gsm8k`, `math`, `auto` (gsm8k when `data_source` contains "gsm8k", math for math-like
    sources (math, aime, amc, olympiad), the sandbox for `code` and `humaneval`, else exact_match), a
    dotted path `pkg.module:function` / `pkg.module.function`, a file `path/reward.py:function` (bare
    `path/reward.py`: its `compute_score`, as verl) or `pickle:path` (app/plugins.py) to a user function in
    one of the styles of app/rewards/styles.py. Raises ValueError naming the spec and the fix when it cannot
    be resolved, and SignatureError (a ValueError) naming the supported styles when its parameters fit none
    of them.
    """
    spec = (spec or "").strip()
    if spec == "auto":
        source = (data_source or "").lower()
        if source == "code":  # app.tasks.code's rows: run the program on the row's tests in the sandbox
            return code_reward
        if source == "humaneval":  # app.tasks.humaneval's rows: the problem's tests in the sandbox
            return humaneval_reward
        if "gsm8k" in source:
            return gsm8k_reward
        if any(k in source for k in ("math", "aime", "amc", "olympiad")):
            return math_reward
        return exact_match
    if spec in BUILTINS:
        return BUILTINS[spec]
    hint = (
        f"reward.fn={spec!r}: expected 'auto', 'exact_match', 'gsm8k', 'gsm8k_shaped', 'math', "
        "'math_shaped', 'code', 'humaneval', a dotted path 'pkg.module:function' to a function importable "
        "from the working directory (PYTHONPATH), or a file 'path/to/reward.py:function' (verl's "
        "custom_reward_function)"
    )
    from app.plugins import PICKLED, PluginError, is_file_spec, resolve

    if spec.startswith(PICKLED):
        module_name, attr = "", spec
    elif is_file_spec(spec):  # verl's custom_reward_function.path, its function `compute_score` by default
        module_name, _, attr = spec.rpartition(":") if ":" in spec else (spec, ":", "compute_score")
    elif ":" in spec:
        module_name, _, attr = spec.partition(":")
    else:  # `pkg.module.function`, the older form: the last dot
        module_name, _, attr = spec.rpartition(".")
    try:
        obj: Any = resolve("reward.fn", f"{module_name}:{attr}" if module_name and attr else spec)
    except PluginError as e:
        raise ValueError(f"{hint}; {e.reason}") from e
    if not callable(obj):
        raise ValueError(f"{hint}; {attr!r} in {module_name!r} is a {type(obj).__name__}, not a function")
    try:
        RewardCall.of(obj, spec)
    except SignatureError as e:
        raise SignatureError(f"reward {spec!r}: {e}") from None
    return obj


DETAIL_CHARS = 1000
"""Most characters of an error's detail kept (an exception's message may be megabytes)."""


@dataclass
class RewardResult:
    """Outcome of one guarded reward computation.

    `error` is None on success, else "exception", "timeout", "invalid", "oom" (a MemoryError: over the
    scoring process's memory limit, `reward.max_memory_mb`) or "crash" (the scoring process or worker
    died) (and `score` is `on_error`);
    `detail` explains the error (at most DETAIL_CHARS); `extras` holds the numeric sub-scores of a dict
    return; `output_dropped` counts the bytes of what the reward printed beyond the scoring process's cap;
    `scores` holds each function's score by name when several are combined (`reward.fns`: combine.py).
    """

    score: float
    error: str | None = None
    detail: str = ""
    extras: dict[str, float] = field(default_factory=dict)
    output_dropped: int = 0
    scores: dict[str, float] = field(default_factory=dict)


def _finite(v: Any) -> float | None:
    if isinstance(v, numbers.Real):
        f = float(v)
        return f if math.isfinite(f) else None
    return None


def _interpret(value: Any, on_error: float) -> RewardResult:
    extras: dict[str, float] = {}
    raw = value
    if isinstance(value, dict):
        if "score" not in value:
            keys = sorted(map(str, value))
            return RewardResult(on_error, "invalid", f"dict return without a 'score' key (keys: {keys})")
        raw = value["score"]
        for k, v in value.items():
            if k != "score" and (f := _finite(v)) is not None:
                extras[str(k)] = f
            elif k != "score":
                log.debug("reward extra %r dropped: %r is not a finite number", k, v)
    s = _finite(raw)
    if s is None:
        return RewardResult(on_error, "invalid", f"score must be a finite number, got {raw!r:.200}")
    return RewardResult(s, None, "", extras)


async def _awaited(aw: Any) -> Any:
    return await aw


def evaluate(fn: RewardFn | RewardCall, inp: RewardInput, on_error: float) -> RewardResult:
    """Score `inp` with `fn` (any style; an async function is awaited on a fresh event loop) here and now;
    never raises. No deadline: this runs inside a scoring process (app.rewards.pool.RewardProcesses), which
    its parent kills at the deadline. Exceptions score `on_error` with error="exception" (logged as a
    warning), a MemoryError (the process's memory limit) with error="oom"; NaN/inf, a non-numeric result or
    a TRL-style return that is not a list of one gives error="invalid"."""
    call = fn if isinstance(fn, RewardCall) else RewardCall.of(fn)
    return _guarded(call, lambda: call(inp), 1, on_error)[0]


def evaluate_group(fn: RewardFn | RewardCall, inps: list[RewardInput], on_error: float) -> list[RewardResult]:
    """Score the samples `inps` of one row, a result each, as `evaluate` does (never raises): a TRL-style
    function in one call on the whole group (lists of len(inps)), which fails or not as a whole (a return
    that is not a list of len(inps) is "invalid" for each); any other style sample by sample."""
    call = fn if isinstance(fn, RewardCall) else RewardCall.of(fn)
    if call.style != "trl":
        return [evaluate(call, inp, on_error) for inp in inps]
    return _guarded(call, lambda: call.group(inps), len(inps), on_error)


_TRACEBACK_SHOWN: set[str] = set()


def raised_at(e: BaseException, fn: Any) -> str:
    """` (at file:line in function)`: where in the user's reward `e` was raised (the deepest frame in `fn`'s
    own file, else the deepest frame), so a message names the user's line, not Relay's wrapper."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return ""
    code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
    own = [f for f in frames if code is not None and f.filename == code.co_filename]
    f = (own or frames)[-1]
    return f" (at {f.filename}:{f.lineno} in {f.name})"


def _guarded(call: RewardCall, run: Callable[[], Any], n: int, on_error: float) -> list[RewardResult]:
    """`run()`'s value for `n` samples, interpreted (see `evaluate`); never raises."""
    name = getattr(call.fn, "__name__", type(call.fn).__name__)
    try:
        value = run()
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
    except MemoryError as e:  # over the scoring process's limit (reward.max_memory_mb), or truly out
        log.warning("reward function %s ran out of memory; scoring %s", name, on_error)
        detail = f"MemoryError: {e}"[:DETAIL_CHARS]
        detail += "; over reward.max_memory_mb? raise it if the reward needs that much"
        return [RewardResult(on_error, "oom", detail) for _ in range(n)]
    except Exception as e:  # the reward's own bug or a bad input: scored, never raised
        detail = f"{type(e).__name__}: {e}"[:DETAIL_CHARS] + raised_at(e, call.fn)
        first = name not in _TRACEBACK_SHOWN  # the whole traceback once per function and process
        _TRACEBACK_SHOWN.add(name)
        log.warning(
            "reward function %s raised %s; scoring %s", name, detail, on_error, exc_info=e if first else None
        )
        return [RewardResult(on_error, "exception", detail) for _ in range(n)]
    try:
        return [_interpret(v, on_error) for v in call.entries(value, n)]
    except InvalidReturn as e:
        return [RewardResult(on_error, "invalid", str(e)[:DETAIL_CHARS]) for _ in range(n)]
    except Exception as e:  # a pathological return value (e.g. a dict subclass that raises)
        detail = f"{type(e).__name__}: {e}"[:DETAIL_CHARS]
        return [RewardResult(on_error, "invalid", detail) for _ in range(n)]


def warm_up(fn: RewardFn) -> None:
    """Do what `fn` does once, lazily (import math-verify and sympy, and score one answer: the first parse
    and comparison build sympy's caches, 25x the cost of the next; probe the code sandbox), so that the
    first reward's deadline does not pay for it."""
    if fn is math_reward:
        math_reward("\\boxed{1}", "1")
    if fn is code_reward or fn is humaneval_reward:
        from app.rewards.sandbox import isolation

        isolation()
