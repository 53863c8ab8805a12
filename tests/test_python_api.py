"""The Python API's inputs (relay/__init__.py): in-memory datasets and callables become files and config
keys that the CLI's own loaders take; a pickled lambda scores in a real scoring process. No Ray, no vLLM
(the run itself: tests/integration/test_python_api.py)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

import relay
from app.preflight import load_config
from app.rewards import resolve_reward_fn
from app.rewards.combine import reward_specs
from app.rewards.pool import RewardProcesses
from app.rewards.styles import RewardInput

ROWS = [{"prompt": "2+3=", "answer": "5", "level": 1}, {"prompt": "1+1=", "answer": "2", "level": 2}]


def test_rows_and_a_lambda_become_files_the_config_names(tmp_path):
    pd = pytest.importorskip("pandas")
    extra = relay.inputs_overrides(
        str(tmp_path),
        train_dataset=ROWS,
        val_dataset=pd.DataFrame(ROWS[:1]),
        reward_funcs=lambda response, answer: float(response.strip() == answer),
    )
    cfg = load_config("quick", extra)
    train = [json.loads(x) for x in Path(cfg.data.train).read_text().splitlines()]
    assert train == ROWS and cfg.data.train.startswith(str(tmp_path / "inputs"))
    assert [json.loads(x) for x in Path(cfg.data.val).read_text().splitlines()] == ROWS[:1]
    assert cfg.reward.fn.startswith("pickle:") and cfg.reward.fn.endswith("reward_0.pkl")
    # the same rows again: the same file (a resume finds the data it started with)
    assert relay.inputs_overrides(str(tmp_path), train_dataset=ROWS)[0] == f"data.train={cfg.data.train}"
    fn = resolve_reward_fn(cfg.reward.fn)
    assert fn("5 ", "5") == 1.0 and fn("4", "5") == 0.0


def test_a_pickled_closure_scores_in_a_scoring_process(tmp_path):
    wanted = {"5", "2"}  # captured by value: the scoring process has no such module-level name

    def in_set(response: str, answer: str) -> float:
        return float(response in wanted and response == answer)

    (spec,) = [o.partition("=")[2] for o in relay.inputs_overrides(str(tmp_path), reward_funcs=[in_set])]
    procs = RewardProcesses(spec, timeout_s=60.0, on_error=-1.0)
    try:
        inp = RewardInput(response="5", answer="5", data_source="x")
        assert procs.score(inp).score == 1.0
    finally:
        procs.close()


def test_several_functions_and_weights(tmp_path):
    extra = relay.inputs_overrides(
        str(tmp_path), reward_funcs=["gsm8k", lambda response, answer: 0.5], reward_weights=[1, 0.5]
    )
    cfg = load_config(None, extra)
    specs = reward_specs(cfg.reward.fn, cfg.reward.fns, cfg.reward.weights)
    assert [s.name for s in specs] == ["gsm8k", "reward_1"] and [s.weight for s in specs] == [1.0, 0.5]


def test_bad_inputs_name_the_argument(tmp_path):
    with pytest.raises(TypeError, match="train_dataset: row 1 is a str"):
        relay.inputs_overrides(str(tmp_path), train_dataset=[{"prompt": "a", "answer": "b"}, "x"])
    with pytest.raises(ValueError, match="val_dataset: no rows"):
        relay.inputs_overrides(str(tmp_path), val_dataset=[])
    with pytest.raises(TypeError, match="reward_funcs\\[0\\]: expected a callable or a name"):
        relay.inputs_overrides(str(tmp_path), reward_funcs=[3])


def test_verl_reward_files_by_path_and_same_named_functions_combine(tmp_path):
    for name, score in (("math_rm", 1.0), ("format_rm", 0.25)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "reward.py").write_text(
            textwrap.dedent(
                f"""
                def compute_score(data_source, solution_str, ground_truth, extra_info=None):
                    return {score} if solution_str == ground_truth else 0.0
                """
            )
        )
    a, b = str(tmp_path / "math_rm" / "reward.py"), str(tmp_path / "format_rm" / "reward.py")
    assert resolve_reward_fn(a)(data_source="x", solution_str="1", ground_truth="1") == 1.0  # compute_score
    assert (
        resolve_reward_fn(f"{b}:compute_score")(data_source="x", solution_str="1", ground_truth="1") == 0.25
    )
    cfg = load_config(None, [f'reward.fns=["{a}", "{b}:compute_score"]'])
    names = [s.name for s in reward_specs(cfg.reward.fn, cfg.reward.fns, cfg.reward.weights)]
    assert names == ["math_rm.reward.compute_score", "format_rm.reward.compute_score"]
    with pytest.raises(ValueError, match="no such file"):
        resolve_reward_fn(str(tmp_path / "missing.py") + ":compute_score")
