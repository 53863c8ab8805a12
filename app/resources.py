"""What each role asks of the cluster, checked against what the Ray cluster has before anything starts.

Roles and their settings:

    rollout    rollout.max_replicas x (rollout.replica_cpus CPU, rollout.replica_gpus GPU)
    train      train.workers x (train.worker_cpus CPU, 1 GPU if train.use_gpu)
    reward     reward.workers x reward.worker_cpus CPU
    reference  ref.workers x (ref.worker_cpus CPU, ref.worker_gpus GPU)   (only with algorithm.kl_coef > 0)
    data       0.25 CPU for the Ray Data tokenizer

`resources.*` sets these per-role values from shares or counts of the cluster (`resolve`). Ray places every
role by these logical requests; a plan that does not fit would leave some role pending
forever (Ray waits for resources without a deadline), so the driver refuses it up front with a table of
what each role asks and what the cluster has.
"""

from __future__ import annotations

from typing import Any


class ResourceError(RuntimeError):
    """The roles ask for more than the cluster has; the message names each role's share and the fix."""


def _total(value: float, have: float) -> float:
    return value if value >= 1 else value * have


def resolve(cfg: Any, cluster: dict[str, float]) -> dict[str, Any]:
    """The per-role settings that `resources.*` shares amount to on this cluster, as dotted overrides.

    A count (>= 1) is taken as is, a fraction (< 1) of the cluster's total; each role's total is split
    evenly over its replicas or workers. Raises ResourceError for a trainer share that is not a whole
    number of GPUs (one per worker) and for a share that leaves a role nothing."""
    r = cfg.resources
    gpus, cpus = float(cluster.get("GPU", 0.0)), float(cluster.get("CPU", 0.0))
    out: dict[str, Any] = {}
    split = {
        "rollout_gpus": ("rollout.replica_gpus", cfg.rollout.max_replicas, gpus),
        "ref_gpus": ("ref.worker_gpus", max(1, cfg.ref.workers), gpus),
        "rollout_cpus": ("rollout.replica_cpus", cfg.rollout.max_replicas, cpus),
        "train_cpus": ("train.worker_cpus", cfg.train.workers, cpus),
        "reward_cpus": ("reward.worker_cpus", max(1, cfg.reward.workers), cpus),
        "ref_cpus": ("ref.worker_cpus", max(1, cfg.ref.workers), cpus),
    }
    for name, (key, units, have) in split.items():
        value = getattr(r, name)
        if value:
            total = _total(value, have)
            if total <= 0:
                raise ResourceError(
                    f"resources.{name}={value:g} is a share of {have:g}: nothing for the role"
                )
            out[key] = total / units
    if r.train_gpus:
        total = _total(r.train_gpus, gpus)
        if total < 1 or abs(total - round(total)) > 1e-9:
            raise ResourceError(
                f"resources.train_gpus={r.train_gpus:g} gives {total:g} GPUs on this cluster ({gpus:g}); the "
                "trainer takes whole GPUs, one per worker: give a count or a share that is a whole number"
            )
        out["train.use_gpu"] = True
        out["train.workers"] = round(total)
        if r.train_cpus:
            out["train.worker_cpus"] = _total(r.train_cpus, cpus) / round(total)
    return out


def demands(cfg: Any) -> dict[str, dict[str, float]]:
    """Logical CPUs and GPUs each role asks for (the most it may ask, at rollout.max_replicas)."""
    r, t = cfg.rollout, cfg.train
    out = {
        "rollout": {"CPU": r.max_replicas * r.replica_cpus, "GPU": r.max_replicas * r.replica_gpus},
        "train": {"CPU": t.workers * t.worker_cpus, "GPU": float(t.workers) if t.use_gpu else 0.0},
        "reward": {"CPU": cfg.reward.workers * cfg.reward.worker_cpus, "GPU": 0.0},
        "data": {"CPU": 0.25, "GPU": 0.0},
    }
    if cfg.algorithm.kl_coef > 0 and cfg.ref.workers > 0:
        out["reference"] = {
            "CPU": cfg.ref.workers * cfg.ref.worker_cpus,
            "GPU": cfg.ref.workers * cfg.ref.worker_gpus,
        }
    return out


def check(cfg: Any, cluster: dict[str, float]) -> dict[str, dict[str, float]]:
    """Raise ResourceError if the roles' total exceeds the cluster's CPUs or GPUs; returns the demands."""
    need = demands(cfg)
    problems = []
    for kind in ("CPU", "GPU"):
        total = sum(d[kind] for d in need.values())
        have = float(cluster.get(kind, 0.0))
        if total > have + 1e-9:
            shares = ", ".join(f"{role} {d[kind]:g}" for role, d in need.items() if d[kind])
            problems.append(f"{total:g} {kind} asked ({shares}) but the cluster has {have:g}")
    if problems:
        raise ResourceError(
            "the roles do not fit on this Ray cluster: "
            + "; ".join(problems)
            + ". Lower rollout.max_replicas / train.workers / reward.workers / ref.workers or their "
            "*_cpus / *_gpus, or add nodes (a local cluster's size is ray.num_cpus)"
        )
    return need
