"""Per-request seeds on vLLM's CPU worker: a seeded request's sampling generator that can undo a draw.

vLLM gives a request with `SamplingParams.seed` a `torch.Generator` of its own. When the token sampled for a
request is thrown away (a prompt prefilled in chunks, a preempted request recomputed), the model runner undoes
that step's draw with `gen.set_offset(gen.get_offset() - 4)` (`GPUModelRunner._bookkeeping_sync`, which the CPU
runner inherits). Only CUDA's Philox generator has an offset: on CPU that call raises "CPU Generator does not
use offset" and kills the engine core. So Relay used to drop per-request seeds on CPU, and CPU runs did not
reproduce (the engine's one generator is shared by whichever requests a step batches).

`install()` (in the engine-core process, where the worker runs) gives every seeded CPU request an
`UndoableGenerator`: the runner's `_sample` snapshots each one's state before the step's draws, and
`set_offset` restores that snapshot, undoing exactly that step's draw as the CUDA offset arithmetic does.
Every private name of vLLM this touches is here.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)
_INSTALLED = False


class UndoableGenerator(torch.Generator):
    """A CPU generator whose `set_offset` restores the state saved by `mark` (the start of a sampling step);
    `get_offset` is a dummy the runner only subtracts from before handing it back."""

    def __new__(cls, source: torch.Generator) -> UndoableGenerator:
        return super().__new__(cls, device="cpu")

    def __init__(self, source: torch.Generator) -> None:
        self.set_state(source.get_state())
        self._mark = self.get_state()

    def mark(self) -> None:
        self._mark = self.get_state()

    def get_offset(self) -> int:  # type: ignore[override]
        return 0

    def set_offset(self, offset: int) -> None:  # type: ignore[override]
        self.set_state(self._mark)


def _undoable(runner: Any) -> None:
    """Swap each plain CPU generator of the runner's requests (and its batch rows) for an UndoableGenerator;
    called right after requests were added, before any draw from their generators."""
    swapped: dict[int, UndoableGenerator] = {}
    for state in runner.requests.values():
        gen = getattr(state, "generator", None)
        if gen is not None and type(gen) is torch.Generator and gen.device.type == "cpu":
            new = UndoableGenerator(gen)
            swapped[id(gen)] = new
            state.generator = new
    if swapped:
        batch = runner.input_batch.generators
        for idx, gen in list(batch.items()):
            if id(gen) in swapped:
                batch[idx] = swapped[id(gen)]


def _cpu_runner() -> Any:
    """vLLM's CPU model runner class, or None where this vLLM has none with the methods `install` patches."""
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except Exception as e:  # not a CPU build: CUDA generators have offsets
        log.debug("no CPU model runner to patch: %r", e)
        return None
    if not all(hasattr(CPUModelRunner, m) for m in ("_update_states", "_sample", "_bookkeeping_sync")):
        return None
    return CPUModelRunner


def patchable() -> bool:
    """Whether `install` can patch this vLLM (checked where the engine is driven, to pass seeds on CPU)."""
    return _cpu_runner() is not None


def install() -> bool:
    """Patch the CPU model runner (once per process). Returns whether per-request seeds are now safe on CPU."""
    global _INSTALLED
    if _INSTALLED:
        return True
    cls = _cpu_runner()
    if cls is None:
        return False
    update, sample = cls._update_states, cls._sample

    @functools.wraps(update)
    def _update_states(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = update(self, *args, **kwargs)
        _undoable(self)
        return out

    @functools.wraps(sample)
    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        for gen in self.input_batch.generators.values():
            if isinstance(gen, UndoableGenerator):
                gen.mark()
        return sample(self, *args, **kwargs)

    cls._update_states, cls._sample = _update_states, _sample
    _INSTALLED = True
    return True
