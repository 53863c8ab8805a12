"""Rewards as users bring them (app/rewards/styles.py, combine.py, guard.py, check.py): verl's and TRL's
signatures scored through the real path (a data row read as the run reads it, the group generator, the
reward pool's scoring processes), the signature check at load, weighted functions and their sub-scores, the
stop when every first sample fails, and the call on the data's first row before Ray starts. No Ray, no vLLM:
the generation is a fake replica; everything from the row to the reward is the run's own code."""

from __future__ import annotations

import asyncio
import json

import pytest

from app.config import AlgorithmConfig, ConfigError, RewardConfig, RolloutConfig
from app.preflight import load_config
from app.records import Batch, GenerateRequest, GenerateResponse, Prompt, Sample
from app.rewards import RewardResult
from app.rewards.check import RewardCheckError, check_on_first_row
from app.rewards.combine import RewardSpec, combine
from app.rewards.guard import RewardsFailed
from app.rewards.pool import RewardPool
from app.rewards.styles import RewardCall, RewardInput
from app.rollout import AsyncProducer, GroupGenerator, PromptStream
from app.rollout.dataset import plain_row, to_prompt
from app.rollout.prompt_files import normalize_row
from tests import reward_styles_example as ex

EX = "tests.reward_styles_example"
VERL_ROW = {
    "prompt": [
        {"role": "system", "content": "Answer after ####."},
        {"role": "user", "content": "2+3?"},
    ],
    "reward_model": {"ground_truth": "5"},
    "data_source": "openai/gsm8k",
    "extra_info": {"index": 7, "bonus": 0.25},
}
PLAIN_ROW = {"prompt": "2+3=", "answer": "5"}


def _prompt(rec: dict, path: str = "data/train.jsonl") -> Prompt:
    """A data file's record as the run reads it: checked row -> Ray Data columns -> Prompt."""
    return to_prompt({**plain_row(normalize_row(rec, path, 0)), "prompt_ids": [1, 2]})


class Replica:
    """A fake generation: sample i of a group (seed + i) answers `texts[i % len(texts)]`."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    async def __call__(self, req: GenerateRequest) -> GenerateResponse:
        ids = [ord(c) for c in self.texts[(req.seed or 0) % len(self.texts)]]
        smp = Sample(token_ids=ids, logprobs=[0.0] * len(ids), versions=[0] * len(ids), finish_reason="stop")
        return GenerateResponse(samples=[smp], replica="r0")


def _decode(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def _generator(pool: RewardPool, texts: list[str], n: int = 2) -> GroupGenerator:
    # Replica answers one sample a request, its texts in turn
    return GroupGenerator(
        Replica(texts),
        _decode,
        pool,  # as the rollouter gives it: a TRL-style reward scores each group in one call
        RolloutConfig(n=n, max_tokens=16, group_requests=False),
        reward=RewardConfig(),
        seed=0,
    )


def _scored(overrides: list[str], rec: dict, texts: list[str]):
    """One group of len(texts) samples of `rec`'s prompt, scored by the reward the overrides configure."""
    pool = RewardPool(load_config(None, overrides).reward, "t")
    try:
        return asyncio.run(_generator(pool, texts, n=len(texts)).group(_prompt(rec), seed=0))
    finally:
        pool.close()


def test_styles_are_detected_from_parameter_names():
    assert RewardCall.of(ex.compute_score).style == "verl"
    assert RewardCall.of(ex.compute_score).keywords == (
        "data_source",
        "solution_str",
        "ground_truth",
        "extra_info",
    )
    assert RewardCall.of(ex.accuracy_reward).style == "trl"  # **kwargs: it gets every keyword Relay offers
    assert "extra_info" in RewardCall.of(ex.accuracy_reward).keywords
    assert RewardCall.of(ex.trl_not_applicable).style == "trl"
    assert RewardCall.of(ex.plain_with_row).keywords == ("prompt", "data_source", "extra_info")
    assert RewardCall.of(ex.length_bonus) == RewardCall(ex.length_bonus, "plain", ())


def test_a_verl_compute_score_scores_with_the_rows_data_source_and_extra_info():
    """verl's compute_score(data_source, solution_str, ground_truth, extra_info) on a verl-layout row: the
    ground truth, the data source and extra_info (its `bonus`) reach it from the data file."""
    g = _scored([f"reward.fn={EX}:compute_score"], VERL_ROW, ["so #### 5", "#### 4"])
    assert [s.reward for s in g.samples] == [1.25, 0.25]
    assert all(s.reward_error is None and s.reward_extras == {"gsm8k_source": 1.0} for s in g.samples)


def test_a_trl_batched_reward_scores_chat_and_text_prompts():
    """TRL's (prompts, completions, **kwargs) -> list: with a chat row the prompt arrives as its messages and
    each completion as [{"role": "assistant", "content": ...}] (its system turn adds 0.5 here); with a text
    row both are strings."""
    fn = f"reward.fn={EX}:accuracy_reward"
    assert [s.reward for s in _scored([fn], VERL_ROW, ["5", "4"]).samples] == [1.5, 0.5]
    g = _scored([fn], PLAIN_ROW, ["5", "4"])
    assert [s.reward for s in g.samples] == [1.0, 0.0] and all(s.reward_error is None for s in g.samples)


def test_a_plain_reward_sees_the_rows_prompt_data_source_and_extra_info():
    g = _scored([f"reward.fn={EX}:plain_with_row"], VERL_ROW, ["5"])
    assert g.samples[0].reward == 1.0
    assert g.samples[0].reward_extras == {"chat": 1.0, "index": 7.0, "source_len": len("openai/gsm8k")}


def test_trl_returns_of_the_wrong_shape_are_invalid_and_none_scores_zero():
    inp = RewardInput(response="5", answer="5")
    from app.rewards import evaluate

    res = evaluate(ex.trl_scalar, inp, -1.0)
    assert (res.score, res.error) == (-1.0, "invalid") and "returns a list" in res.detail
    assert evaluate(ex.trl_not_applicable, inp, -1.0) == RewardResult(0.0)


@pytest.mark.parametrize(
    ("fn", "fragment"),
    [
        ("three_unknown", "as (response, answer)"),
        ("verl_extra_required", "does not pass its parameter 'tokenizer'"),
    ],
)
def test_the_signature_check_refuses_an_incompatible_function_at_load_naming_the_styles(fn, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"reward.fn={EX}:{fn}"])
    msg = str(e.value)
    assert fragment in msg and fn in msg
    assert "three styles" in msg and "compute_score(data_source, solution_str" in msg
    assert "(prompts, completions, **kwargs)" in msg
    assert "did you mean" not in msg  # the function exists: no near miss to suggest (it suggested itself)


def test_verl_and_trl_functions_load():
    for fn in ("compute_score", "accuracy_reward"):
        assert load_config(None, [f"reward.fn={EX}:{fn}"]).reward.fn == f"{EX}:{fn}"


def test_two_weighted_rewards_give_the_weighted_total_and_sub_scores():
    """reward.fns with reward.weights: total = 1.0 x exact_match + 0.5 x length; each function's score is
    kept on the sample and logged as reward/<name>."""
    from app.trainer.batch_metrics import batch_metrics

    overrides = [f"reward.fns=[exact_match,{EX}:length_bonus]", "reward.weights=[1.0,0.5]"]
    g = _scored(overrides, PLAIN_ROW, ["5", "44"])
    assert [s.reward for s in g.samples] == [1.0 + 0.5 * 1, 0.0 + 0.5 * 2]
    assert [s.reward_scores for s in g.samples] == [
        {"exact_match": 1.0, "length_bonus": 1.0},
        {"exact_match": 0.0, "length_bonus": 2.0},
    ]
    m = batch_metrics(Batch(groups=[g]))
    assert (m["reward/mean"], m["reward/exact_match"], m["reward/length_bonus"]) == (1.25, 0.5, 1.5)
    one = _scored(["reward.fn=exact_match"], PLAIN_ROW, ["5"])  # one function: no sub-scores to log
    assert one.samples[0].reward_scores == {} and "reward/exact_match" not in batch_metrics(
        Batch(groups=[one])
    )


def test_combine_golden_values_with_a_failed_function():
    a, b = (
        RewardSpec(spec="exact_match", name="exact_match"),
        RewardSpec(spec="m:judge", name="judge", weight=2.0),
    )
    res = combine(
        [(a, RewardResult(1.0, extras={"x": 3.0})), (b, RewardResult(-1.0, "timeout", "over 10s"))], True
    )
    assert res == RewardResult(
        score=1.0 - 2.0,
        error="timeout",
        detail="m:judge: over 10s",
        extras={"exact_match/x": 3.0},
        scores={"exact_match": 1.0, "judge": -1.0},
    )
    assert combine([(a, RewardResult(0.5))], False) == RewardResult(0.5)  # reward.fn: unchanged


def test_a_list_for_reward_fn_points_to_reward_fns():
    with pytest.raises(ConfigError, match=r"'reward.fn': it takes one value; for several, use 'reward.fns'"):
        load_config(None, ["reward.fn=[gsm8k,math]"])
    with pytest.raises(ConfigError, match=r"reward.weights.*2 weights for 1 reward functions"):
        load_config(None, ["reward.fn=gsm8k", "reward.weights=[1,2]"])
    with pytest.raises(ConfigError, match=r"reward.fns.*set one"):
        load_config(None, ["reward.fn=gsm8k", "reward.fns=[math]"])
    with pytest.raises(ConfigError, match=r"two functions are named 'length_bonus'"):
        load_config(None, [f"reward.fns=[{EX}:length_bonus,{EX}.length_bonus]"])


def test_an_all_failing_reward_stops_within_n_samples_naming_the_first_error():
    """Every sample's reward raises: the 4th failure (reward.fail_fast_samples=4, groups of 2) stops the
    run with an error naming the function, its exception and the row, instead of training on on_error."""
    cfg = load_config(
        None, [f"reward.fn={EX}:always_raises", "reward.fail_fast_samples=4", "reward.on_error=-1"]
    ).reward
    pool = RewardPool(cfg, "t")
    gen = _generator(pool, ["4", "5"])
    groups = []

    async def run() -> None:
        for _ in range(5):
            groups.append(await gen.group(_prompt(VERL_ROW), seed=0))

    try:
        with pytest.raises(RewardsFailed) as e:
            asyncio.run(run())
    finally:
        pool.close()
    assert len(groups) == 1 and pool.guard.failed == 4  # the first group trained nothing; the second stopped
    msg = str(e.value)
    for part in (f"{EX}:always_raises", "KeyError", "reference_solution", "row '7'", "openai/gsm8k", "=4"):
        assert part in msg, part


def test_a_reward_that_scores_once_is_never_stopped():
    cfg = load_config(None, [f"reward.fn={EX}:sometimes_raises", "reward.fail_fast_samples=3"]).reward
    pool = RewardPool(cfg, "t")
    gen = _generator(pool, ["x1", "x0", "x1"], n=3)  # fails, scores, fails: 2 failures < 3 before a pass

    async def run() -> list:
        return [await gen.group(_prompt(PLAIN_ROW), seed=0) for _ in range(3)]

    try:
        groups = asyncio.run(run())
    finally:
        pool.close()
    assert [s.reward_error for s in groups[-1].samples] == ["exception", None, "exception"]
    assert gen.stats["reward/errors_exception"] == 6


def test_fully_async_stops_at_once_when_the_rewards_all_fail():
    """A group that failed with RewardsFailed fails the stream at its first try (no retry can help)."""
    prompts = [Prompt(uid=f"p{i}", prompt_ids=[1], answer="a") for i in range(4)]
    stream = PromptStream(lambda epoch: iter(prompts), epochs=1)

    async def run_group(prompt: Prompt, seed: int):
        raise RewardsFailed("the reward failed on all of the first 1 samples")

    prod = AsyncProducer(stream, run_group, AlgorithmConfig(), batch_groups=1, max_inflight=1, seed=0)

    async def run() -> None:
        await prod.start()
        try:
            await prod.get_batch(1, 0, 10.0)
        finally:
            prod.stop()

    with pytest.raises(RuntimeError, match="failed on all of the first 1 samples"):
        asyncio.run(run())
    assert sum(prod.attempts.values()) == 0  # not sent back for a retry


def test_a_user_reward_is_called_on_the_first_row_before_the_run(tmp_path, caplog):
    """The first row of the training file, in a scoring process: a function that binds but fails on real
    data (a KeyError on extra_info) is refused naming it, its style, the row and the error; a good one logs
    its score; built-ins read nothing."""
    caplog.set_level("INFO", logger="app.rewards.check")
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(VERL_ROW) + "\n" + json.dumps(PLAIN_ROW) + "\n")
    bad = load_config(None, [f"reward.fn={EX}:needs_split"]).reward
    with pytest.raises(RewardCheckError) as e:
        check_on_first_row(bad, str(path))
    msg = str(e.value)
    for part in (f"{EX}:needs_split", "(plain style)", str(path), "KeyError: 'split'", "row '7'"):
        assert part in msg, part
    good = load_config(None, [f"reward.fns=[gsm8k,{EX}:compute_score]"]).reward
    check_on_first_row(good, str(path))
    assert f"reward {EX}:compute_score (verl style) scored 1.25" in caplog.text  # right, + the bonus
    check_on_first_row(load_config(None, ["reward.fn=gsm8k"]).reward, str(tmp_path / "missing.jsonl"))


def test_the_first_row_of_a_parquet_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(
        pa.Table.from_pylist([VERL_ROW, {**VERL_ROW, "extra_info": {"index": 8, "bonus": 0.0}}]), path
    )
    with pytest.raises(RewardCheckError, match="KeyError: 'split'"):
        check_on_first_row(load_config(None, [f"reward.fn={EX}:needs_split"]).reward, str(path))
    check_on_first_row(load_config(None, [f"reward.fn={EX}:accuracy_reward"]).reward, str(path))


def test_the_cli_refuses_a_failing_reward_before_ray_starts(tmp_path, capsys):
    """`python -m app train` with such a reward: one error and a RESULT line, before Ray or MLflow start."""
    from app.__main__ import main

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 4096}))
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(VERL_ROW) + "\n")
    args = [f"model.path={model}", f"data.train={data}", f"data.val={data}", f"reward.fn={EX}:needs_split"]
    args.append("model.allow_toy_settings=true")  # a stand-in model folder: the toy limits are not the point
    assert main(["train", *args, f"run_dir={tmp_path / 'runs'}"]) == 2  # an input error
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert out.startswith("RESULT ") and "KeyError: 'split'" in json.loads(out[7:])["error"]
    assert not (tmp_path / "runs").exists()  # refused before the run folder, Ray and MLflow


def test_a_raising_reward_names_its_own_file_and_line_and_logs_its_traceback_once(caplog):
    """The error names where in the user's function it was raised (not Relay's wrapper); the scoring process
    logs the whole traceback the first time only."""
    import logging

    from app.rewards import _TRACEBACK_SHOWN, evaluate

    _TRACEBACK_SHOWN.discard("needs_split")
    line = ex.needs_split.__code__.co_firstlineno + 2  # its `return` line
    inp = RewardInput(response="5", answer="5", data_source="x", extra_info={})
    with caplog.at_level(logging.WARNING, logger="app.rewards"):
        first, second = (evaluate(ex.needs_split, inp, -1.0) for _ in range(2))
    assert first.error == "exception" and first.detail.startswith("KeyError: 'split'")
    assert f"reward_styles_example.py:{line} in needs_split" in first.detail and second.detail == first.detail
    records = [r for r in caplog.records if "needs_split raised" in r.getMessage()]
    assert len(records) == 2 and records[0].exc_info is not None and records[1].exc_info is None
