"""The trainer's warm-up (app/trainer/warm_up.py): it compiles what the first step would, and changes nothing
that is trained: the weights, the optimizer's state and the schedule stay as they were, and the step after it
equals a step without it."""

import pytest
import torch

from app.config import load_config
from app.trainer.learner import Learner
from app.trainer.warm_up import PROMPT, wants_warm_up, warm_up, warm_up_lengths, warm_up_rows
from tests.test_packed_step import VARIANTS, VOCAB, _batch, _model_dir


@pytest.mark.parametrize(("chunk", "budget", "max_response"), [(0, 64, 8), (3, 20, 8), (1024, 16384, 1024)])
def test_warm_up_lengths_fill_a_pass_and_end_in_both_kinds_of_chunk(chunk, budget, max_response):
    lengths = warm_up_lengths(chunk, budget, max_response)
    assert len(lengths) == 2 and all(0 < n <= max_response for mb in lengths for n in mb)
    totals = [sum(mb) for mb in lengths]
    assert totals[0] != totals[1]  # two lengths: the compiled graphs turn dynamic here, not in a real step
    used = [n + PROMPT * len(mb) for n, mb in zip(totals, lengths, strict=True)]
    assert used[0] <= budget and used[0] > budget - chunk - PROMPT * 2 - max_response  # about a full pass
    if chunk:  # a full chunk, then a last chunk of 2 rows in one, of 1 row in the other
        assert [n % chunk for n in totals] == [2, 1] and min(totals) > chunk
    if chunk == 1024:
        assert totals == [15 * 1024 + 2, 7 * 1024 + 1]


def test_warm_up_rows_in_vocabulary_with_reference_logprobs():
    mbs = warm_up_rows(VOCAB, [[5, 3], [4]])
    assert [[len(r.response_ids) for r in rows] for rows in mbs] == [[5, 3], [4]]
    for rows in mbs:
        for r in rows:
            ids = r.prompt_ids + r.response_ids
            assert len(r.prompt_ids) == PROMPT and min(ids) >= 2 and max(ids) < VOCAB
            assert r.advantage == 0.0 and r.ref_logprobs == r.behaviour_logprobs
            assert len(r.behaviour_logprobs) == len(r.response_ids)
    with pytest.raises(ValueError, match="too small"):
        warm_up_rows(2, [[1]])


def _state(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters()}


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["stats"].values())


def test_warm_up_compiles_first_and_changes_nothing(tmp_path):
    path = _model_dir(tmp_path)
    keys = ["train.lr=0.01", "algorithm.kl_coef=0.1", "train.compile=on", *VARIANTS["packed_chunked"]]
    torch._dynamo.reset()
    torch.manual_seed(0)
    warmed = Learner(load_config(None, keys), path, torch.device("cpu"))
    assert wants_warm_up(warmed, "auto") and not wants_warm_up(warmed, "off")
    before, compiled = _state(warmed), _graphs()
    assert warm_up(warmed, "auto") > 0
    assert _graphs() > compiled  # it compiled
    for n, p in warmed.model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.grad is None, n
    assert not warmed.opt.state and warmed.sched.last_epoch == 0
    compiled = _graphs()
    m_warm = warmed.step(_batch())
    assert _graphs() == compiled  # the first real step compiled nothing more

    torch.manual_seed(0)
    cold = Learner(load_config(None, keys), path, torch.device("cpu"))
    m_cold = cold.step(_batch())
    assert m_warm.keys() == m_cold.keys()
    for k, v in m_cold.items():
        assert m_warm[k] == pytest.approx(v, abs=1e-6), k
    after = _state(cold)
    for n, p in warmed.model.named_parameters():
        torch.testing.assert_close(p.detach(), after[n], atol=1e-6, rtol=0)


def test_warm_up_auto_skips_an_eager_trainer(tmp_path):
    learner = Learner(
        load_config(None, VARIANTS["packed_chunked"]), _model_dir(tmp_path), torch.device("cpu")
    )
    assert not wants_warm_up(learner, "auto") and wants_warm_up(learner, "on")
    assert warm_up(learner, "auto") == 0.0
