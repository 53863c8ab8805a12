"""`rollouts.jsonl`: a sample of each step's training rollouts, as text, in the run folder (trainer rank 0).

Each step, `tracking.rollouts_per_step` samples of the trained batch are drawn (seeded by the run's seed and the
step: the same run writes the same lines) and written one JSON line each: the step, the prompt and the
response as text, the reward with its error and named sub-scores, why generation stopped, and the policy
versions that sampled the response's tokens (`versions`: [version, first token, end] spans, so a response
a push landed in shows two). The folder's copy is logged to MLflow at the end of the run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from app.records import Batch, Group, Sample
from app.trainer import checkpoint

NAME = "rollouts.jsonl"


def version_spans(versions: list[int]) -> list[list[int]]:
    """Per-token versions as [version, start, end) spans: [3, 3, 4] -> [[3, 0, 2], [4, 2, 3]]."""
    spans: list[list[int]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1][0] == v:
            spans[-1][2] = i + 1
        else:
            spans.append([v, i, i + 1])
    return spans


def record(step: int, trained_at: int, g: Group, s: Sample) -> dict[str, Any]:
    """One sample's JSON line."""
    return {
        "step": step,
        "trained_at": trained_at,
        "uid": g.uid,
        "data_source": g.data_source,
        "prompt": g.prompt_text,
        "response": s.text,
        "answer": g.answer,
        "reward": s.reward,
        "reward_error": s.reward_error,
        "sub_scores": {
            **s.reward_extras,
            **s.reward_scores,
        },  # the reward function's extras, reward.fns' scores
        "finish_reason": s.finish_reason,
        "tokens": len(s.token_ids),
        "versions": version_spans(list(s.versions)),
        "replica": s.replica,
        "turns": s.turns,
    }


class RolloutLog:
    """`rollouts.jsonl` of a run folder: `per_step` samples a step (0: none, no file)."""

    def __init__(self, run_dir: Path, per_step: int, seed: int = 0) -> None:
        self.path = Path(run_dir) / NAME
        self.per_step, self.seed = per_step, seed

    def append(self, step: int, trained_at: int, batch: Batch) -> int:
        """Write `per_step` samples of `batch` (all of them if it has fewer), trained at `step` by weights of
        version `trained_at`; returns how many."""
        pairs = [(g, s) for g in batch.groups for s in g.samples]
        if self.per_step <= 0 or not pairs:
            return 0
        rng = random.Random(self.seed * 1_000_003 + step)
        picked = sorted(rng.sample(range(len(pairs)), min(self.per_step, len(pairs))))
        with open(self.path, "a") as f:
            for i in picked:
                f.write(json.dumps(record(step, trained_at, *pairs[i])) + "\n")
        return len(picked)

    def truncate(self, step: int) -> int:
        """Forget the lines of steps after `step` (a restore discarded that work); returns how many."""
        return checkpoint.truncate_log(self.path, step)
