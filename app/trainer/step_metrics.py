"""The metrics of one training step: a pure function of what the step produced (unit tested)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from app.records import Batch
from app.trainer.batch_metrics import batch_metrics, staleness
from app.weights.records import PushStats


@dataclass(kw_only=True)
class StepTimings:
    """Seconds spent in one step's phases."""

    wait_s: float  # waiting for the batch
    overlap_wait_s: float  # after training, waiting for the overlapped generation before the push
    train_s: float
    step_s: float  # the whole step: wait, train, push


# Metrics that mean something only in some runs, by family: `overlap` where generation overlaps training
# (one_step_off, fully_async), `partial` where a push can land mid-generation (fully_async: staleness varies
# within a batch and groups span versions), `filtered` with dynamic sampling (algorithm.filter_groups).
# A mode declares its families (`BatchSource.metric_families`); a sync run logs none of them (all zero there).
FAMILIES: dict[str, tuple[str, ...]] = {
    "overlap": ("async/trainer_idle_ratio",),
    "partial": ("staleness/len_decile_", "async/partial_ratio", "async/max_version_span"),
    "filtered": ("async/filtered_groups",),
}

# metric -> Prometheus gauge (the dashboard's view of the last step)
PROMETHEUS = {
    "rollout/replicas": "relay_rollout_replicas",
    "weight/version": "relay_weight_version",
    "staleness/mean": "relay_staleness_mean",
    "staleness/max": "relay_staleness_max",
    "sync/time_s": "relay_sync_seconds",
    "reward/mean": "relay_reward_mean",
    "perf/gen_tokens_per_s": "relay_gen_tokens_per_s",
    "perf/train_tokens_per_s": "relay_train_tokens_per_s",
    "async/queue_depth": "relay_queue_depth",
}


def step_metrics(
    stats: dict[str, float],
    batch: Batch,
    t: StepTimings,
    push: PushStats | None,
    version: int,
    pushed: int,
    step: int,
    between: Sequence[PushStats] = (),
    families: Collection[str] | None = None,
) -> dict[str, float]:
    """Metrics of step `step` (1-based) that trained `batch` into weights `version` (`pushed`: the replicas').

    Staleness is counted against `version - 1`, the weights the batch was trained with. `between`: the pushes
    made while the step waited for its batch (to a replica that joined): their join times count here too.
    `families`: the optional metric families (FAMILIES) this run logs; None: all of them.
    """
    idle = t.wait_s + t.overlap_wait_s
    m: dict[str, Any] = {**stats, **batch_metrics(batch), **staleness(batch, version - 1), **batch.extra}
    m.update(
        {
            "timing/generate_s": batch.generate_s,
            "timing/wait_rollout_s": idle,
            "timing/train_s": t.train_s,
            "timing/step_s": t.step_s,
            "async/trainer_idle_ratio": idle / max(t.step_s, 1e-9),
            "perf/gen_tokens_per_s": batch.num_tokens / max(batch.generate_s, 1e-9),
            "perf/train_tokens_per_s": stats["train/tokens"] / max(t.train_s, 1e-9),
            "weight/version": version,
            "weight/pushed_version": pushed,
        }
    )
    if push is not None:
        m.update(push_metrics(push, step))
    joins = [x["join_s"] for p in between for x in p.extra.values() if "join_s" in x]
    if joins and step > 1:
        m["rollout/join_s"] = max([*joins, m.get("rollout/join_s", 0.0)])
    if families is not None:
        off = tuple(p for name, prefixes in FAMILIES.items() if name not in families for p in prefixes)
        m = {k: v for k, v in m.items() if not k.startswith(off)} if off else m
    return m


def push_metrics(push: PushStats, step: int) -> dict[str, float]:
    """The push as the trainer saw it (`sync/time_s`, the whole call) and its phases: the trainer's (group,
    announce, gather, transfer, ack) and the slowest replica's (`sync/replica/<phase>`: wake-up after the
    announcement, the staged receive, drain, pause call, the workers' receive with its transfer and load,
    version, resume); `sync/pause_s` is how long generation was held on the slowest replica."""
    extra = list(push.extra.values())
    m = {
        "sync/time_s": push.wall_s_or_sum,
        "sync/group_s": push.group_s,
        "sync/announce_s": push.announce_s,
        "sync/gather_s": push.gather_s,
        "sync/transfer_s": push.transfer_s,
        "sync/ack_s": push.ack_s,
        "sync/pause_s": max((x.get("held_s", 0.0) for x in extra), default=0.0),
        "sync/bytes": float(push.nbytes),
        "sync/retries": float(len(push.failures)),
        "rollout/replicas": float(len(extra)),
    }
    m.update({f"sync/replica/{p}": v for p, v in push.replica_phases().items()})
    on_old = [x["on_old"] for x in extra if "on_old" in x]
    if on_old:  # LoRA, finish_on_old: requests in flight that went on with an older adapter through the push
        m["sync/requests_on_old"] = float(sum(on_old))
    joins = [x["join_s"] for x in extra if "join_s" in x]
    if joins and step > 1:  # a replica admitted mid-run (the initial ones join at version 0)
        m["rollout/join_s"] = max(joins)
    return m
