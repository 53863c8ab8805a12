"""Typed records that cross role boundaries. Every generated token carries the policy version that sampled it.

All records are keyword-only dataclasses: a record is built by naming its fields, never by position.
Records that are written to a checkpoint have `to_dict` / `from_dict` (plain JSON-able dictionaries).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(kw_only=True)
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
    reward_scores: dict[str, float] = field(default_factory=dict)  # each function's, by name (reward.fns)
    replica: str = ""
    ref_logprobs: list[float] | None = None  # reference policy's, when computed off the trainer
    # multi-turn trajectories (app/envs): 1 = a model token (trained), 0 = an environment token (never in the
    # loss; its log-prob is 0 and its version that of the model token before it). None: every token is 1.
    loss_mask: list[int] | None = None
    turns: int = 0  # model turns of an environment episode (0: a single-turn sample)
    tool_calls: int = 0
    env_s: float = 0.0  # seconds spent in the environment's steps

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"a sample needs one log-prob and one version per token: {n} tokens, "
                f"{len(self.logprobs)} log-probs, {len(self.versions)} versions"
            )
        if self.loss_mask is not None and len(self.loss_mask) != n:
            raise ValueError(
                f"a sample's loss mask needs one entry per token: {n} tokens, {len(self.loss_mask)}"
            )

    @property
    def model_tokens(self) -> int:
        """Tokens the model sampled (the trained ones)."""
        return len(self.token_ids) if self.loss_mask is None else sum(self.loss_mask)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        return cls(**_known(cls, d))


@dataclass(kw_only=True)
class Prompt:
    """One prompt taken from the stream: what the rollouter generates a group for.

    `prompt_ids` are token ids (a plain `list[int]` end to end). `partial` holds the samples generated so far
    when a clean stop froze this prompt's generation (a partial rollout that a resumed run continues).
    `prompt_text` is the prompt as the data has it: its text, or its chat messages as JSON (`chat`);
    `extra_info` is the row's verl `extra_info`; `truth` the answer as the data gives it when that is not a
    string (None: `answer` is it); `columns` the row's other columns by name (reward functions see them all,
    app/rewards/styles.py).
    """

    uid: str
    prompt_ids: list[int]
    answer: str
    data_source: str = ""
    prompt_text: str = ""
    chat: bool = False
    extra_info: dict[str, Any] = field(default_factory=dict)
    truth: Any = None
    columns: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0
    index: int = 0
    partial: list[Sample] = field(default_factory=list)

    @property
    def key(self) -> str:
        return group_key(self.epoch, self.uid)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Prompt:
        d = _known(cls, d)
        d["prompt_ids"] = [int(t) for t in d["prompt_ids"]]
        d["partial"] = [Sample.from_dict(s) for s in d.get("partial", [])]
        return cls(**d)


@dataclass(kw_only=True)
class Group:
    """All `rollout.n` samples of one prompt: the unit GRPO normalises over and the trainer consumes."""

    uid: str
    prompt_ids: list[int]
    answer: str
    samples: list[Sample]
    epoch: int = 0
    prompt_text: str = ""
    data_source: str = ""
    chat: bool = False
    extra_info: dict[str, Any] = field(default_factory=dict)
    truth: Any = None  # as Prompt's: the reward's view of the row
    columns: dict[str, Any] = field(default_factory=dict)

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

    def prompt(self) -> Prompt:
        """The prompt this group answers (to generate it again)."""
        return Prompt(
            uid=self.uid,
            prompt_ids=list(self.prompt_ids),
            answer=self.answer,
            data_source=self.data_source,
            prompt_text=self.prompt_text,
            chat=self.chat,
            extra_info=dict(self.extra_info),
            truth=self.truth,
            columns=dict(self.columns),
            epoch=self.epoch,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Group:
        d = _known(cls, d)
        return cls(**{**d, "samples": [Sample.from_dict(s) for s in d["samples"]]})


def group_key(epoch: int, uid: str) -> str:
    return f"{epoch}:{uid}"


@dataclass(kw_only=True)
class Filtered:
    """A group dynamic sampling dropped (`algorithm.filter_groups`): every sample had the same reward. It
    leaves the checkpoint state with the batch that replaced it, so each prompt is trained or filtered once."""

    uid: str
    epoch: int
    reward: float

    @property
    def key(self) -> str:
        return group_key(self.epoch, self.uid)


@dataclass(kw_only=True)
class Batch:
    """What the trainer trains on at one step, with the bookkeeping the metrics need."""

    groups: list[Group]
    generate_s: float = 0.0
    dropped_overlong: int = 0
    reward_errors: dict[str, int] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)  # stream metrics (fully_async)
    filtered: list[Filtered] = field(default_factory=list)  # dropped by dynamic sampling: not trained

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for g in self.groups for s in g.samples)


@dataclass(kw_only=True)
class GenerateRequest:
    """One generation request to a rollout replica: token ids in, `n` samples out."""

    prompt_ids: list[int]
    max_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop: list[str] = field(default_factory=list)  # strings that end a response (its tokens are kept)
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: bool = True
    """Return each sampled token's behaviour log-prob; false: 0.0 each (`rollout.behaviour_logprobs=trainer`)."""
    adapter: int | None = None
    """LoRA: the adapter version to generate with; None: the newest the replica holds when it admits the
    request (every token then carries that version)."""


@dataclass(kw_only=True)
class GenerateResponse:
    """A replica's answer: its samples (token ids, behaviour log-probs, per-token versions, finish reason),
    unscored, and which replica at which weight version produced them."""

    samples: list[Sample]
    replica: str = ""
    version: int = -1


@dataclass(kw_only=True)
class ValResult:
    """One validation pass: mean reward over the samples of `n` prompts, the newest policy version that
    answered, a table of sample answers (uid, prompt, response, answer, reward, version) for the tracker, and
    mean@n / pass@k per data source."""

    reward: float
    n: int
    seconds: float
    version_max: int
    version_min: int = -1
    table: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)  # e.g. multi-turn episodes' tool-call rate
    # mean@n and pass@k per data source and over all (app/evaluation/scores.py `score`)
    scores: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(kw_only=True)
class PipelineSnapshot:
    """The rollout pipeline's state at a trainer step boundary (a checkpoint's `pipeline.json`).

    `epoch`/`epoch_seen` are the stream position (prompt ids of the current epoch already taken); `ready` the
    finished groups not yet trained; `pending` every other prompt taken from the stream and not yet trained,
    with its partial samples where a freeze ended its generation. Restoring it trains each prompt of an epoch
    exactly once.
    """

    epoch: int = 0
    epoch_seen: list[str] = field(default_factory=list)
    cursor: int = 0
    taken: int = 0
    version: int = 0
    dropped_overlong: int = 0
    ready: list[Group] = field(default_factory=list)
    pending: list[Prompt] = field(default_factory=list)

    @property
    def partial_groups(self) -> int:
        return sum(1 for p in self.pending if p.partial)

    @property
    def partial_tokens(self) -> int:
        return sum(len(s.token_ids) for p in self.pending for s in p.partial)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["partial_groups"], d["partial_tokens"] = self.partial_groups, self.partial_tokens
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PipelineSnapshot:
        d = _known(cls, d)
        d["ready"] = [Group.from_dict(g) for g in d.get("ready", [])]
        d["pending"] = [Prompt.from_dict(p) for p in d.get("pending", [])]
        return cls(**d)


def _known(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    """The entries of `d` that are fields of `cls` (a checkpoint may hold derived or older keys)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}
