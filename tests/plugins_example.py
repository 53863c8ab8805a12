"""A user's extensions, outside app/: one of each kind, selected by dotted path (tests/test_plugins.py).
Nothing in app/ names this module."""

from __future__ import annotations

from typing import Any

from app.envs.base import EnvKeyError, EnvKind
from app.envs.calculator import CalculatorEnv
from app.trainer.sources.sync import SyncSource
from app.weights.broadcast import BroadcastTransport
from tests.toy_loss import reinforce


def length_reward(response: str, answer: str) -> float:
    """A reward: 1 for a response as long as the answer."""
    return float(len(response.strip()) == len(answer.strip()))


loss = reinforce  # a policy loss: (LossInputs, algorithm_cfg) -> LossOutputs


class LoggedSyncSource(SyncSource):
    """A batch source: the synchronous mode, counting its batches."""

    def __init__(self, cfg: Any, actors: Any) -> None:
        super().__init__(cfg, actors)
        self.batches = 0


def calculator_env(cfg: Any, offload: Any) -> type:
    """An environment factory: (cfg, offload) -> a class whose instances run one episode each."""
    return CalculatorEnv


class TwoTurnCalculator(EnvKind):
    """A kind of environment with a key of its own checked at load (and no service to deploy)."""

    def __call__(self, cfg: Any, offload: Any) -> type:
        return CalculatorEnv

    def check(self, env: Any) -> None:
        if env.max_turns < 2:
            raise EnvKeyError(
                "max_turns", f"{env.max_turns}: the calculator needs a turn to call, one to answer"
            )


two_turn_calculator = TwoTurnCalculator()


class CountingTransport(BroadcastTransport):
    """A weight transport: the broadcast one, under its own name."""
