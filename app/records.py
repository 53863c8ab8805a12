"""Typed records that cross role boundaries. Every generated token carries the policy version that sampled it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Sample:
    """One response of a group: tokens, behaviour log-probs and per-token policy versions."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    text: str = ""
    reward: float = 0.0
    reward_error: str | None = None
    reward_extras: dict[str, float] = field(default_factory=dict)
    replica: str = ""
    ref_logprobs: list[float] | None = None  # reference policy's, when computed off the trainer


@dataclass
class Group:
    """All `rollout.n` samples of one prompt: the unit GRPO normalises over and the trainer consumes."""

    uid: str
    prompt_ids: list[int]
    answer: str
    samples: list[Sample]
    epoch: int = 0
    prompt_text: str = ""
    data_source: str = ""

    @property
    def min_version(self) -> int:
        return min((v for s in self.samples for v in s.versions), default=-1)

    @property
    def max_version(self) -> int:
        return max((v for s in self.samples for v in s.versions), default=-1)

    @property
    def key(self) -> str:
        """Identity of this group in the prompt stream: one per prompt per epoch (exactly-once accounting)."""
        return group_key(self.epoch, self.uid)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Group:
        return cls(**{**d, "samples": [Sample(**s) for s in d["samples"]]})


def group_key(epoch: int, uid: str) -> str:
    return f"{epoch}:{uid}"


@dataclass
class Batch:
    """What the trainer trains on at one step, with the bookkeeping the metrics need."""

    groups: list[Group]
    generate_s: float = 0.0
    dropped_overlong: int = 0
    reward_errors: dict[str, int] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)  # stream metrics (fully_async)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for g in self.groups for s in g.samples)
