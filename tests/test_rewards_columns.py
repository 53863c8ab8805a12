"""Rewards in TRL's and verl's own terms (app/rewards/styles.py): every column of a row reaches a reward under
its own name (TRL's `accuracy_reward(completions, solution, **kwargs)` with `data.answer_key=solution`), a
TRL-style reward scores a whole group in one call when its last sample finishes, and a list ground truth
reaches verl's compute_score as the data gives it. Through the real path: a data file read as the run reads
it, the group generator, the reward pool's scoring processes. No Ray, no vLLM: generation is a fake."""

from __future__ import annotations

import asyncio
import json

import pytest

from app.config import RewardConfig, RolloutConfig
from app.preflight import load_config
from app.records import GenerateRequest, GenerateResponse, Group, Prompt, Sample
from app.rewards import evaluate_group
from app.rewards.check import RewardCheckError, check_on_first_row
from app.rewards.pool import RewardPool
from app.rewards.styles import RewardCall, RewardInput
from app.rollout import GroupGenerator
from app.rollout.dataset import plain_row, to_prompt
from app.rollout.prompt_files import Columns, load_rows
from tests import reward_trl_example as ex

EX = "tests.reward_trl_example"
CHAT = [{"role": "user", "content": "2+3?"}]
TRL_ROWS = [  # TRL's layout: `prompt`, `solution`, and a column of its own
    {"prompt": CHAT, "solution": "5", "points": 2.0},
    {"prompt": CHAT, "solution": "", "points": 1.0},
]


class Replica:
    """A fake generation: sample i of a group (seed + i) answers `texts[i % len(texts)]`; `requests`
    counts the requests it served."""

    def __init__(self, texts: list[str]) -> None:
        self.texts, self.requests = texts, 0

    async def __call__(self, req: GenerateRequest) -> GenerateResponse:
        self.requests += 1
        ids = [ord(c) for c in self.texts[(req.seed or 0) % len(self.texts)]]
        smp = Sample(token_ids=ids, logprobs=[0.0] * len(ids), versions=[0] * len(ids), finish_reason="stop")
        return GenerateResponse(samples=[smp], replica="r0")


def _prompts(path: str, columns: Columns) -> list[Prompt]:
    """A data file's rows as the run reads them: checked rows -> Ray Data columns -> Prompts."""
    return [to_prompt({**plain_row(r), "prompt_ids": [1, 2]}) for r in load_rows(path, columns)]


def _groups(
    overrides: list[str], prompts: list[Prompt], texts: list[str], overlap: bool = True
) -> list[Group]:
    """Each prompt's group of len(texts) samples, scored by the reward the overrides configure (the pool,
    a GroupScore, given to the generator as the rollouter gives it)."""
    pool = RewardPool(load_config(None, overrides).reward, "t")
    gen = GroupGenerator(
        Replica(texts),
        lambda ids: "".join(map(chr, ids)),
        pool,
        RolloutConfig(n=len(texts), max_tokens=16, group_requests=False),
        reward=RewardConfig(),
        seed=0,
    )

    async def run() -> list[Group]:
        if overlap:
            return [await gen.group(p, seed=0) for p in prompts]
        return [await gen.score_group(await gen.group(p, seed=0, score_now=False)) for p in prompts]

    try:
        return asyncio.run(run())
    finally:
        pool.close()


def test_trls_accuracy_reward_gets_the_solution_column_and_the_others_by_name(tmp_path):
    """TRL's `accuracy_reward(completions, solution, **kwargs)` loads (its `solution` is the data's column)
    and, with data.answer_key=solution on a TRL-layout file, scores with `solution` and `points` (another
    column, read by name); a None (no gold answer) scores 0. The first-row check passes it before Ray starts."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRL_ROWS))
    overrides = [f"reward.fn={EX}:accuracy_reward", "data.answer_key=solution"]
    cfg = load_config(None, overrides)
    columns = Columns.from_cfg(cfg.data)
    prompts = _prompts(str(path), columns)
    assert prompts[0].answer == "5" and prompts[0].columns == {"solution": "5", "points": 2.0}
    groups = _groups(overrides, prompts, ["5", "4"])
    assert [s.reward for s in groups[0].samples] == [2.0, 0.0]
    assert [s.reward for s in groups[1].samples] == [0.0, 0.0]
    assert all(s.reward_error is None for g in groups for s in g.samples)
    check_on_first_row(cfg.reward, str(path), columns)


def test_a_column_the_data_lacks_is_named_before_the_run(tmp_path):
    """A TRL-style parameter names a column; a data file without it fails the first-row check, naming it."""
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(TRL_ROWS[0]) + "\n")
    cfg = load_config(None, [f"reward.fn={EX}:needs_tests", "data.answer_key=solution"])
    with pytest.raises(RewardCheckError) as e:
        check_on_first_row(cfg.reward, str(path), Columns.from_cfg(cfg.data))
    msg = str(e.value)
    assert "MissingColumn" in msg and "'tests'" in msg and "['points', 'solution']" in msg


def test_a_group_aware_trl_reward_sees_all_n_completions_in_one_call():
    """A reward ranking a group's completions gets the group's 4 completions at once (10 x 4 + its rank),
    whether scored as the group finishes or after the batch (reward.overlap=false); beside a plain
    function (reward.fns) that one is still scored sample by sample and the totals combine."""
    prompt = Prompt(uid="p", prompt_ids=[1], answer="bb", prompt_text="q")
    texts = ["ccc", "a", "dddd", "bb"]
    for overlap in (True, False):
        (g,) = _groups([f"reward.fn={EX}:rank_by_length"], [prompt], texts, overlap)
        assert [s.reward for s in g.samples] == [42.0, 40.0, 43.0, 41.0]
    overrides = [f"reward.fns=[exact_match,{EX}:rank_by_length]", "reward.weights=[1.0,0.5]"]
    (g,) = _groups(overrides, [prompt], texts)
    assert [s.reward_scores["exact_match"] for s in g.samples] == [0.0, 0.0, 0.0, 1.0]
    assert [s.reward for s in g.samples] == [21.0, 20.0, 21.5, 1.0 + 20.5]


def test_a_trl_return_of_the_wrong_length_is_invalid_for_the_whole_group():
    inps = [RewardInput(response=t, answer="x") for t in ("a", "b", "c")]
    one = RewardCall.of(lambda completions, **kw: [1.0])
    assert [r.error for r in evaluate_group(one, inps, -1.0)] == ["invalid"] * 3
    assert "got 3 completions and returned 1 scores" in evaluate_group(one, inps, -1.0)[0].detail


def test_a_list_ground_truth_reaches_verls_compute_score_unchanged(tmp_path):
    """verl's `reward_model.ground_truth` as a list: compute_score gets the list (not its text); the
    built-in rewards still get the answer as text (its JSON)."""
    path = tmp_path / "train.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = {"prompt": CHAT, "reward_model": {"ground_truth": ["5", "five"]}, "data_source": "d"}
    pq.write_table(pa.Table.from_pylist([row]), path)
    (prompt,) = _prompts(str(path), Columns())
    assert (prompt.answer, prompt.truth) == ('["5", "five"]', ["5", "five"])
    assert Prompt.from_dict(json.loads(json.dumps(prompt.to_dict()))) == prompt  # a checkpoint keeps them
    (g,) = _groups([f"reward.fn={EX}:verl_any_of"], [prompt], ["five", "4"])
    assert [s.reward for s in g.samples] == [1.0, 0.0]
    assert g.samples[0].reward_extras == {"is_list": 1.0, "answers": 2.0}
    assert g.prompt().truth == ["5", "five"] and g.prompt().columns == prompt.columns  # scored again later
    assert _groups(["reward.fn=exact_match"], [prompt], ['["5", "five"]'])[0].samples[0].reward == 1.0


def test_plain_and_verl_functions_get_the_columns_they_name_or_all_with_kwargs():
    inp = RewardInput(response="5", answer="5", columns={"solution": "5", "points": 3.0})
    call = RewardCall.of(ex.plain_with_columns)
    assert call.style == "plain" and call(inp) == {"score": 1.0, "points": 3.0}  # `solution` not passed twice

    def verl(data_source, solution_str, ground_truth, extra_info=None, points=0.0):
        return points

    assert RewardCall.of(verl)(inp) == 3.0
    assert RewardCall.of(lambda response, answer: 1.0)(inp) == 1.0  # names none: gets none
