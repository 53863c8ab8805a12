"""The undoable CPU generator behind per-request seeds on vLLM's CPU worker (app/vllm/seeded_cpu.py); the
engine itself runs in tests/integration/test_seeded_sampling.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from app.vllm.seeded_cpu import UndoableGenerator, _undoable


def _seeded(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_set_offset_undoes_the_draws_since_the_mark_as_the_runner_asks():
    plain, undo = _seeded(7), UndoableGenerator(_seeded(7))
    assert torch.equal(torch.rand(3, generator=plain), torch.rand(3, generator=undo))  # the same stream
    undo.mark()  # a sampling step starts
    discarded = torch.empty(5).exponential_(generator=undo)
    undo.set_offset(undo.get_offset() - 4)  # the runner throws that step's token away
    again = torch.empty(5).exponential_(generator=undo)
    assert torch.equal(discarded, again)  # the next step draws what the discarded one drew
    assert torch.equal(again, torch.empty(5).exponential_(generator=plain))  # as if it never happened
    assert isinstance(undo, torch.Generator) and undo.device.type == "cpu"


def test_runner_generators_are_swapped_in_the_requests_and_their_batch_rows():
    g1, g2 = _seeded(1), _seeded(2)
    runner = SimpleNamespace(
        requests={
            "a": SimpleNamespace(generator=g1),
            "b": SimpleNamespace(generator=None),
            "c": SimpleNamespace(generator=g2),
        },
        input_batch=SimpleNamespace(generators={0: g1, 2: g2}),
    )
    _undoable(runner)
    a, c = runner.requests["a"].generator, runner.requests["c"].generator
    assert isinstance(a, UndoableGenerator) and isinstance(c, UndoableGenerator)
    assert runner.input_batch.generators == {0: a, 2: c} and runner.requests["b"].generator is None
    assert torch.equal(torch.rand(2, generator=a), torch.rand(2, generator=_seeded(1)))  # state carried over
    _undoable(runner)  # already swapped: left alone
    assert runner.requests["a"].generator is a
