"""Code with feedback (`env.name=code_feedback`) without Ray: a scripted model (the true boundary:
generation) whose first program fails in the real sandbox and whose second, written after reading the
feedback, passes; masks, the reward of the last attempt, the limit of turns, and a sandbox that raises or
hangs (a fake at the sandbox boundary) scoring reward.on_error, counted as env/errors_*."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from app.config import EnvConfig, RewardConfig, RolloutConfig
from app.envs import ENVIRONMENTS, make_factory
from app.envs.code_feedback import CodeFeedbackEnv, factory, observation
from app.records import GenerateRequest, GenerateResponse, Prompt, Sample
from app.rewards import RewardResult
from app.rewards.sandbox import SandboxError
from app.rollout import GroupGenerator
from app.tasks.code import make_code_problems
from app.tasks.tiny import ASCII_CHARS, build_tokenizer, model_config


def _code_tokenizer():
    """builtin:tiny-code's tokenizer as vLLM and the trainer load it (beside a Qwen2 config: byte-level)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as d:
        build_tokenizer(ASCII_CHARS, 1024).save_pretrained(d)
        model_config(len(ASCII_CHARS) + 3, 1024).save_pretrained(d)
        return AutoTokenizer.from_pretrained(d)


TOK = _code_tokenizer()
EOS = TOK.eos_token_id
PROBLEM = make_code_problems(1, seed=0)[0]  # count the letter 'o' in a word
PROMPT = Prompt(
    uid="c0", prompt_ids=TOK.encode(PROBLEM.prompt, add_special_tokens=False), answer=PROBLEM.answer()
)
WRONG = "```python\nprint(int(input()) + 1)\n```"  # crashes on a word: ValueError
RIGHT = f"```python\n{PROBLEM.solution}```"


def enc(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def dec(ids: list[int]) -> str:
    return TOK.decode(ids, skip_special_tokens=True)


class Model:
    """Plays the model: `policy(context text) -> reply`, each token at log-prob -0.5 and version 0."""

    def __init__(self, policy) -> None:
        self.policy, self.calls = policy, []

    async def __call__(self, req: GenerateRequest) -> GenerateResponse:
        text = dec(req.prompt_ids)
        self.calls.append(text)
        ids = [*enc(self.policy(text)), EOS][: req.max_tokens]
        s = Sample(token_ids=ids, logprobs=[-0.5] * len(ids), versions=[0] * len(ids), finish_reason="stop")
        return GenerateResponse(samples=[s], replica="r0", version=0)


def learner(text: str) -> str:
    """Fails first; fixes the program once the feedback says how the test failed."""
    return RIGHT if "ValueError" in text else WRONG


async def _unused_score(*_a) -> RewardResult:
    raise AssertionError("an episode's reward comes from its environment")


def _gen(model, env=CodeFeedbackEnv, turns: int = 3, timeout_s: float = 30.0, n: int = 1) -> GroupGenerator:
    return GroupGenerator(
        model,
        dec,
        _unused_score,
        RolloutConfig(n=n, max_tokens=96),
        reward=RewardConfig(on_error=-1.0),
        seed=0,
        stats=Counter(),
        env=env,
        encode=enc,
        limits=EnvConfig(max_turns=turns, max_total_tokens=600, step_timeout_s=timeout_s),
    )


def test_failed_attempt_gets_the_sandbox_output_and_the_retry_passes():
    model = Model(learner)
    gen = _gen(model)
    s = asyncio.run(gen.group(PROMPT, seed=1)).samples[0]
    first, second = [*enc(WRONG), EOS], [*enc(RIGHT), EOS]
    obs = s.token_ids[len(first) : len(s.token_ids) - len(second)]
    report = dec(obs)
    assert "Test 1 of 3 failed: error." in report and "ValueError: invalid literal for int()" in report
    assert report == observation(report.strip().split("\nFix")[0])
    assert PROBLEM.tests[0][1] not in report.split("Input:")[-1]  # never the expected output
    assert s.token_ids == first + obs + second
    assert s.loss_mask == [1] * len(first) + [0] * len(obs) + [1] * len(second)
    assert s.logprobs == [-0.5] * len(first) + [0.0] * len(obs) + [-0.5] * len(second)
    assert s.reward == 1.0 and s.reward_error is None and s.reward_extras == {"passed": 3.0, "total": 3.0}
    assert (s.turns, s.finish_reason) == (2, "stop")
    assert model.calls[1] == PROBLEM.prompt + WRONG + report  # the retry sees its program and the report
    assert gen.stats["env/steps"] == 3 and not any(k.startswith("env/errors") for k in gen.stats)


def test_reward_is_the_last_attempts_partial_score():
    # always the same program, right on 1 of 3 tests: cut at max_turns, scored 1/3; a wrong answer's
    # report shows the input and the program's output
    ones = "```python\nprint(4)\n```"  # the second hidden test's answer
    s = asyncio.run(_gen(Model(lambda t: ones), turns=2).group(PROMPT, seed=1)).samples[0]
    assert (s.turns, s.finish_reason) == (2, "length")
    assert s.reward == pytest.approx(1 / 3) and s.reward_extras["wrong_answer"] == 1.0
    assert "Test 1 of 3 failed: wrong answer.\nInput: loteceabecao\nYour output: 4" in s.text


def test_failing_sandbox_scores_on_error_and_is_counted():
    def raising(response: str, answer: str, budget_s: float) -> tuple[dict, str]:
        raise SandboxError("sandbox failed: no isolation setup can start the interpreter")

    def hanging(response: str, answer: str, budget_s: float) -> tuple[dict, str]:
        time.sleep(1.0)  # a stuck sandbox (the thread is left to finish; the episode does not wait)
        return {"score": 1.0}, ""

    for check, kind, timeout_s in ((raising, "exception", 5.0), (hanging, "timeout", 0.2)):
        gen = _gen(Model(learner), lambda c=check: CodeFeedbackEnv(check=c), timeout_s=timeout_s, n=2)
        for s in asyncio.run(gen.group(PROMPT, seed=1)).samples:
            assert s.reward == -1.0 and s.reward_error == f"env_{kind}" and s.turns == 1
            assert s.loss_mask == [1] * len(s.token_ids)  # the model's program is kept, nothing after it
        assert gen.stats[f"env/errors_{kind}"] == 2


def test_registry_and_budget_within_the_step_deadline():
    assert "code_feedback" in ENVIRONMENTS
    env = make_factory("code_feedback", SimpleNamespace(env=SimpleNamespace(step_timeout_s=5.0)))()
    assert env.budget_s == 4.0
    assert (
        make_factory("code_feedback", SimpleNamespace(env=SimpleNamespace(step_timeout_s=30.0)))().budget_s
        == 8.0
    )
    with pytest.raises(ValueError, match="env.step_timeout_s=1.5.*at least 9"):
        factory(SimpleNamespace(env=SimpleNamespace(step_timeout_s=1.5)))
    with pytest.raises(ValueError, match="needs the row's tests"):
        asyncio.run(CodeFeedbackEnv().reset(Prompt(uid="x", prompt_ids=[1], answer="")))


def test_preset():
    from app.config import load_config

    cfg = load_config("code_feedback", [])
    assert (cfg.env.name, cfg.model.path, cfg.data.train) == (
        "code_feedback",
        "builtin:tiny-code",
        "builtin:code",
    )
    assert cfg.reward.workers == 1  # the sandboxed attempts run on a reward worker, beside generation
    assert make_factory(cfg.env.name, cfg)().budget_s == 8.0


def test_sandbox_runs_through_the_runs_offload():
    """The environment's blocking step goes through the `Offload` it was built with (the rollouter passes
    its reward pool's: the reward workers when there are any); the episode is the same either way."""
    calls: list[tuple[str, float]] = []

    async def offload(fn, *args):
        calls.append((getattr(fn, "__name__", "?"), args[2]))
        return await asyncio.to_thread(fn, *args)

    cfg = SimpleNamespace(env=SimpleNamespace(step_timeout_s=5.0))
    gen = _gen(Model(learner), make_factory("code_feedback", cfg, offload))
    (s,) = asyncio.run(gen.group(PROMPT, seed=1)).samples
    assert (s.reward, s.turns) == (1.0, 2)
    assert calls == [("_check", 4.0), ("_check", 4.0)]  # both attempts, with the budget fitting the deadline
