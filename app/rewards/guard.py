"""Stop a run whose rewards fail on every one of its first samples, instead of training on `on_error`.

A reward function with a bug (a KeyError on every row, a signature that binds but fails on real input, a
dependency missing in the scoring process) scores `reward.on_error` on every sample, and GRPO on constant
rewards learns nothing while the run looks healthy. `FailFast` watches the first `reward.fail_fast_samples`
samples scored: once one scores cleanly it is done for good; if every one of them failed, the run stops with
`RewardsFailed` naming the first failure (the function, its error, the row and the response).
"""

from __future__ import annotations

import threading

from app.errors import UserError
from app.rewards import RewardResult
from app.rewards.styles import RewardInput


class RewardsFailed(UserError, RuntimeError):
    """Every one of a run's first `reward.fail_fast_samples` samples failed to score; ends the run."""


class FailFast:
    """Watches scored samples (`observe`) until the first that scored cleanly; thread-safe. `limit` 0: off."""

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.failed = 0
        self.passed = self.limit <= 0
        self.first: tuple[RewardInput, RewardResult] | None = None
        self.error: RewardsFailed | None = None
        self.lock = threading.Lock()

    def observe(self, inp: RewardInput, res: RewardResult) -> None:
        """Count one scored sample; raises RewardsFailed once `limit` samples failed and none passed (and for
        every sample after, so the samples still in flight stop too)."""
        with self.lock:
            if self.error is not None:
                raise self.error
            if self.passed:
                return
            if res.error is None:
                self.passed = True
                return
            self.failed += 1
            self.first = self.first or (inp, res)
            if self.failed < self.limit:
                return
            first_inp, first_res = self.first
            self.error = RewardsFailed(
                f"the reward failed on all of the first {self.failed} samples scored "
                f"(reward.fail_fast_samples={self.limit}), so the run stopped instead of training on "
                f"reward.on_error. The first failure ({first_res.error}): {first_res.detail}; on "
                f"{first_inp.where()}. Fix the reward function (try it on that row), or set "
                "reward.fail_fast_samples=0 to train anyway"
            )
            raise self.error
