"""Records of the weight plane: push plans, group epochs, statistics, hub instructions, acknowledgements.

All are keyword-only dataclasses (built by naming their fields). They cross process boundaries pickled by Ray,
and the plan and the group cross into vLLM workers as JSON (`plan_to_json`, `group_to_json`): tensors never
travel in these records, only through a transport (see app/weights/transport.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch


class SyncError(RuntimeError):
    """A push or a join failed; the message names the replicas and what they did (or did not) do."""


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype named `name` ("float32" or "torch.float32")."""
    return getattr(torch, name.replace("torch.", ""))


# ---------------------------------------------------------------- the plan of one push


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int = 0  # element offset inside its bucket

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, kw_only=True)
class Bucket:
    index: int
    dtype: str
    numel: int
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_of(self.dtype).itemsize


@dataclass(frozen=True, kw_only=True)
class PushPlan:
    version: int
    buckets: tuple[Bucket, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def names(self) -> list[str]:
        return [t.name for b in self.buckets for t in b.tensors]

    def __reduce__(self) -> tuple[Any, tuple[int, str]]:
        # pickled (Ray) as the version and the layout's text: see `layout_text`
        return _plan_from_layout, (self.version, layout_text(self.buckets))


@dataclass(frozen=True, kw_only=True)
class GroupInfo:
    """What a receiver needs to join epoch `epoch` of the weight group."""

    epoch: int
    host: str
    port: int
    world: int
    backend: str
    timeout_s: float
    ranks: dict[str, int]  # replica id -> first rank of its workers
    transport: str = "broadcast"  # registry name (app/weights/transport.py): both ends build the same one
    # trainer ranks in the group (ranks 0..senders-1); the receivers' ranks follow. One (rank 0 sends) but
    # where every trainer rank sends to the replicas on its own GPU (the colocated CUDA-IPC layout)
    senders: int = 1
    # NCCL: the group's broadcasts on a high-priority stream (sync.broadcast.nccl_high_priority)
    high_priority: bool = False


@dataclass(kw_only=True)
class PushStats:
    """What one push cost, phase by phase, as the trainer saw it (rank 0 logs it as `sync/*`)."""

    version: int = 0
    nbytes: int = 0
    buckets: int = 0
    gather_s: float = 0.0
    pack_s: float = 0.0
    transfer_s: float = 0.0
    ack_s: float = 0.0
    total_s: float = 0.0  # the walk over the buckets (gather, pack, transfer)
    group_s: float = 0.0  # rank 0: checking (and, after a membership change, forming) the weight group
    announce_s: float = 0.0  # rank 0: the announcement's round trip to the hub
    wall_s: float = 0.0  # the whole push as the trainer sees it: group, announce, walk, acknowledgements
    failures: list[str] = field(default_factory=list)  # why each earlier try of this push failed (retried)
    checksums: list[str] = field(default_factory=list)
    extra: dict[str, dict[str, Any]] = field(default_factory=dict)  # replica id -> its acknowledgement
    acked_via: str = ""  # where the acknowledgements came from: the weight group's store, or the hub

    # a replica's phases, in its acknowledgement (app/sync.py): wake-up after the announcement, the staged
    # receive (sync.staged_receive: while generating), drain, pause call, the workers' receive (the RPC's round
    # trip; worker: inside the worker, transfer and load inside that), version, resume
    REPLICA_PHASES: ClassVar[tuple[str, ...]] = (
        "wake_s", "stage_s", "drain_s", "pause_s", "receive_s", "worker_s", "transfer_s", "load_s", "version_s",
        "resume_s", "held_s",
    )  # fmt: skip

    @property
    def wall_s_or_sum(self) -> float:
        """The whole push (`wall_s`), or walk + acknowledgements where only those were measured."""
        return self.wall_s or (self.total_s + self.ack_s)

    def replica_phases(self) -> dict[str, float]:
        """Each replica phase's seconds on the slowest replica for that phase."""
        out = {}
        for phase in self.REPLICA_PHASES:
            vals = [float(x[phase]) for x in self.extra.values() if phase in x]
            if vals:
                out[phase] = max(vals)
        return out

    def record(self) -> dict[str, Any]:
        """The push as a plain dict for reports and benches: version, bytes, buckets, the whole time, each
        phase (trainer's, then the slowest replica's as `replica_<phase>`), failed tries, replicas."""
        return {
            "version": self.version,
            "nbytes": self.nbytes,
            "buckets": self.buckets,
            "wall_s": self.wall_s_or_sum,
            "phases": {
                "group_s": self.group_s,
                "announce_s": self.announce_s,
                "gather_s": self.gather_s,
                "pack_s": self.pack_s,
                "transfer_s": self.transfer_s,
                "ack_s": self.ack_s,
                **{f"replica_{k}": v for k, v in self.replica_phases().items()},
            },
            "failures": list(self.failures),
            "acked_via": self.acked_via,
            "replicas": sorted(self.extra),
            "summary": self.summary(),
        }

    def summary(self) -> str:
        """One log line: the push in milliseconds, the trainer's phases, then the slowest replica's."""
        trainer = {
            "group": self.group_s,
            "announce": self.announce_s,
            "gather": self.gather_s,
            "transfer": self.transfer_s,
            "ack": self.ack_s,
        }
        replica = {p[:-2]: v for p, v in self.replica_phases().items()}
        fmt = lambda d: " ".join(f"{k}={1000 * v:.1f}" for k, v in d.items()) or "-"  # noqa: E731
        return (
            f"push v{self.version}: {1000 * self.wall_s_or_sum:.1f} ms, {self.nbytes / 2**20:.1f} MiB in "
            f"{self.buckets} bucket(s) [trainer {fmt(trainer)}{' via ' + self.acked_via if self.acked_via else ''}] "
            f"[replica {fmt(replica)}]"
        )


# A plan's bucket layout (every tensor's name, shape, dtype and offset) is the same push after push; only the
# version changes. It crosses each process boundary (trainer -> hub -> replica -> vLLM worker) as one JSON text,
# and each process parses a given text once: a 1.5B plan (338 tensors) costs about 2 ms to unpickle as
# dataclasses and 0.4 ms to parse, against some microseconds for a dictionary hit. Both caches are bounded.
_LAYOUT_TEXTS: dict[int, tuple[tuple[Bucket, ...], str]] = {}  # id(buckets) -> (buckets, text), buckets held
_LAYOUTS: dict[str, tuple[Bucket, ...]] = {}  # text -> buckets
_LAYOUT_CACHE = 8
_PLAN_JSON = re.compile(r'\{"version": (-?\d+), "buckets": (.*)\}', re.DOTALL)


def _remember(cache: dict, key: Any, value: Any) -> None:
    if len(cache) >= _LAYOUT_CACHE:
        cache.pop(next(iter(cache)))
    cache[key] = value


def layout_text(buckets: tuple[Bucket, ...]) -> str:
    """The JSON text of a plan's buckets, made once per buckets tuple."""
    hit = _LAYOUT_TEXTS.get(id(buckets))
    if hit is not None and hit[0] is buckets:
        return hit[1]
    text = json.dumps(
        [
            {
                "index": b.index,
                "dtype": b.dtype,
                "numel": b.numel,
                "tensors": [[t.name, list(t.shape), t.dtype, t.offset] for t in b.tensors],
            }
            for b in buckets
        ]
    )
    _remember(_LAYOUT_TEXTS, id(buckets), (buckets, text))
    _remember(_LAYOUTS, text, buckets)
    return text


def layout_from_text(text: str) -> tuple[Bucket, ...]:
    """The buckets of a layout text (`layout_text`), parsed once per distinct text."""
    hit = _LAYOUTS.get(text)
    if hit is not None:
        return hit
    buckets = tuple(
        Bucket(
            index=b["index"],
            dtype=b["dtype"],
            numel=b["numel"],
            tensors=tuple(
                TensorSpec(name=n, shape=tuple(shape), dtype=dt, offset=off)
                for n, shape, dt, off in b["tensors"]
            ),
        )
        for b in json.loads(text)
    )
    _remember(_LAYOUTS, text, buckets)
    _remember(_LAYOUT_TEXTS, id(buckets), (buckets, text))
    return buckets


def _plan_from_layout(version: int, text: str) -> PushPlan:
    return PushPlan(version=version, buckets=layout_from_text(text))


def plan_to_json(plan: PushPlan) -> str:
    return f'{{"version": {int(plan.version)}, "buckets": {layout_text(plan.buckets)}}}'


def plan_from_json(s: str) -> PushPlan:
    m = _PLAN_JSON.fullmatch(s)
    if m is not None:
        return _plan_from_layout(int(m.group(1)), m.group(2))
    d = json.loads(s)  # written by hand (a test, an operator): parsed in full
    return _plan_from_layout(d["version"], json.dumps(d["buckets"]))


def group_to_json(g: GroupInfo) -> str:
    return json.dumps(asdict(g))


def group_from_json(s: str) -> GroupInfo:
    return GroupInfo(**json.loads(s))


# ---------------------------------------------------------------- hub -> replica instructions (a tagged union)


@dataclass(frozen=True, kw_only=True)
class Join:
    """Build epoch `group.epoch` of the weight group as ranks `rank`.. (one per worker of the replica)."""

    kind: ClassVar[str] = "join"
    group: GroupInfo
    rank: int


@dataclass(frozen=True, kw_only=True)
class Push:
    """Receive, load and acknowledge version `plan.version` through the current epoch's transport."""

    kind: ClassVar[str] = "push"
    plan: PushPlan
    announced_at: float = 0.0  # the hub's wall clock at the announcement (the replica's wake-up latency)


@dataclass(frozen=True)
class Signal:
    """A data-free instruction: its class is the whole message, and `kind` is the class's name in lower case."""

    kind: ClassVar[str] = "signal"

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.kind = cls.__name__.lower()


class Leave(Signal):
    """The replica left (downscaling) and got every push announced to it: its sync loop ends."""


class Unknown(Signal):
    """The hub does not know this replica (dropped after a failure, or the hub restarted): register again."""


class Idle(Signal):
    """Nothing to do within the long-poll's wait: ask again."""


@dataclass(frozen=True, kw_only=True)
class Abort:
    """(Run control) end every in-flight generation now; acknowledge request `seq`."""

    kind: ClassVar[str] = "abort"
    seq: int


Instruction = Join | Push | Leave | Unknown | Idle  # Leave, Unknown and Idle are data-free `Signal`s
ControlInstruction = Abort | Idle


# ---------------------------------------------------------------- acknowledgements


@dataclass(frozen=True, kw_only=True)
class Ack:
    """A replica's answer to a join (key: epoch), a push (key: version) or an abort (key: request seq)."""

    ok: bool
    error: str | None = None
    checksums: list[str] | None = None  # of every bucket loaded (pushes)
    detail: dict[str, Any] = field(default_factory=dict)  # timings, worker ranks, join_s

    def as_dict(self) -> dict[str, Any]:
        """Flat form for metrics and reports: ok, error and checksums (when set) and the detail's keys."""
        out: dict[str, Any] = {"ok": self.ok, **self.detail}
        if self.error is not None:
            out["error"] = self.error
        if self.checksums is not None:
            out["checksums"] = self.checksums
        return out


@dataclass(kw_only=True)
class Acks:
    """Every answer to one (kind, key) request, and who did not answer within the deadline."""

    kind: str
    key: int
    got: dict[str, Ack] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # expected members with no answer

    @property
    def failed(self) -> list[str]:
        return sorted(rid for rid, a in self.got.items() if not a.ok)

    @property
    def complete(self) -> bool:
        return not self.missing and not self.failed

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "key": self.key,
            "missing": list(self.missing),
            "acks": {rid: a.as_dict() for rid, a in self.got.items()},
        }
