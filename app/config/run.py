"""The run's surroundings: `resources.*` (shares of the cluster by role), `tracking.*` (MLflow), `eval.*`
(`python -m app eval`) and `ray.*` (the cluster)."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from app.config.base import _SHARE, _TIMEOUT, Range, _Section, require, rng

EvalEngine = Literal["auto", "local", "cluster"]
LogModel = Literal["auto", "copy", "reference", "off"]
SINKS = ("mlflow", "tensorboard", "wandb")


@dataclass
class ResourcesConfig(_Section):
    """Shares of the cluster by role. Each value is a count (>= 1) or a fraction of the cluster's total
    (< 1); 0 leaves the role's own per-worker settings as they are. Resolved against the Ray cluster at
    start (app/infra/resources.py), which refuses a plan that does not fit."""

    rollout_gpus: float = 0.0
    """GPUs of the rollout role, split evenly over rollout.max_replicas (sets rollout.replica_gpus); with
    `gpus_per_replica`, as many replicas as fit."""
    gpus_per_replica: float = 0.0
    """With rollout_gpus: GPUs of one vLLM replica; the rollout share then runs as many replicas as fit (sets
    rollout.min_replicas = max_replicas; a share under one replica's GPUs runs one replica on the share, as on
    a single GPU shared with the trainer). 0: the share is split over rollout.max_replicas."""
    train_gpus: float = 0.0
    """GPUs of the trainer: one per Ray Train worker (sets train.use_gpu and train.workers)."""
    ref_gpus: float = 0.0
    """GPUs of the reference workers, split over ref.workers (sets ref.worker_gpus)."""
    rollout_cpus: float = 0.0
    """CPUs of the rollout role, split over rollout.max_replicas (sets rollout.replica_cpus)."""
    train_cpus: float = 0.0
    """CPUs of the trainer, split over train.workers (sets train.worker_cpus)."""
    reward_cpus: float = 0.0
    """CPUs of the reward workers, split over reward.workers (sets reward.worker_cpus)."""
    ref_cpus: float = 0.0
    """CPUs of the reference workers, split over ref.workers (sets ref.worker_cpus)."""
    colocate: bool = False
    """Every GPU of the cluster holds one trainer rank and one vLLM replica (verl's hybrid layout): N GPUs give
    N Ray Train workers and N replicas, and each rank pushes to the replica on its own GPU by CUDA IPC
    (sync.transport=auto). On several GPUs a replica takes 0.55 of its GPU in Ray's accounting and a worker 0.4,
    so no two replicas and no two workers can share a GPU (the replicas start first); its vLLM memory share is
    rollout.gpu_memory_utilization. Leave rollout_gpus and train_gpus at 0."""
    rollout_custom: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each vLLM replica asks for besides its CPUs/GPUs, e.g. `{rollout: 1}`: replicas
    then run only on nodes that have them (cluster.yaml's rollout nodes: `resources: {rollout: 8}`, or
    `ray start --resources='{"rollout": 8}'`). Counted in the start-up check, per node."""
    train_custom: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each Ray Train worker asks for besides its CPUs/GPUs, e.g. `{train: 1}`: the
    trainer then runs only on nodes that have them. Counted in the start-up check, per node."""

    _RANGES: ClassVar[dict[str, Range]] = {
        name: _SHARE
        for name in (
            "rollout_gpus",
            "gpus_per_replica",
            "train_gpus",
            "ref_gpus",
            "rollout_cpus",
            "train_cpus",
            "reward_cpus",
            "ref_cpus",
        )
    }

    def check(self, prefix: str) -> None:
        super().check(prefix)
        for name in ("rollout_custom", "train_custom"):
            for res, amount in getattr(self, name).items():
                require(
                    f"{prefix}{name}",
                    res not in ("CPU", "GPU", "memory", "object_store_memory"),
                    f"{res!r} is not a custom resource: set CPUs and GPUs with rollout.replica_cpus/"
                    "replica_gpus, train.worker_cpus/worker_gpus or the resources.*_cpus/*_gpus shares",
                )
                require(
                    f"{prefix}{name}",
                    math.isfinite(amount) and amount > 0,
                    f"{res}={amount!r}; each amount must be a positive number (e.g. {{{res}: 1}}, or 0.01 "
                    "to pin many replicas or workers to one node holding 1)",
                )


@dataclass
class TrackingConfig(_Section):
    uri: str = ""
    """MLflow tracking URI; empty means a local SQLite store, `run_dir`/mlflow.db."""
    experiment: str = "relay"
    """MLflow experiment name."""
    artifact_uri: str = ""
    """Where MLflow keeps the artifacts (final model, samples, plots) of the experiment's runs: a path or an
    artifact URI (`s3://...`). Empty: `<run_dir>/mlartifacts` with a local store, the server's default with
    an HTTP `uri`. MLflow fixes it when the experiment is created: an existing experiment keeps its own."""
    run_name: str = ""
    """Run name (default: relay-<timestamp>); also names the run folder."""
    log_samples: int = 8
    """Sample generations logged as a table at each validation."""
    rollouts_per_step: int = 4
    """Training rollouts written as text each step to `<run_dir>/<run>/rollouts.jsonl` (prompt, response,
    reward and sub-scores, finish reason, the versions that sampled it), drawn at random (seeded); logged to
    MLflow at the end. 0: none."""
    register_model: str = ""
    """If set, register the final model (`<run folder>/final`) in the MLflow model registry under this name (a
    new version): the copy in the run's artifacts, or with log_model=reference the folder itself (a local store
    only: a tracking server registers models from its artifacts)."""
    log_model: LogModel = "auto"
    """What the MLflow run keeps of the final model `<run folder>/final`: `copy` (into the run's artifacts: a
    second full copy, ~15 GB for a 7B model), `reference` (nothing copied: the folder's path in the run's tag
    `relay.final_model`), `auto` (a copy under log_model_max_mb, else a reference; a copy where register_model
    registers it on a tracking server) or `off`."""
    log_model_max_mb: float = 1024.0
    """With log_model=auto: the largest final model (MB on disk) copied into MLflow's artifacts."""
    sinks: list[str] = field(default_factory=lambda: ["mlflow"])
    """Where the metrics go besides `<run folder>/metrics.jsonl`: `mlflow` (always), `tensorboard` (event files
    in `<run folder>/tensorboard`; `pip install tensorboard`), `wandb` (a W&B run in project `experiment`,
    named after the run folder, continued by `--resume`; `pip install wandb`, then `wandb login` or
    WANDB_MODE=offline). E.g. `tracking.sinks=[mlflow,tensorboard]`."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "log_samples": rng(">= 0", "0: no sample table"),
        "rollouts_per_step": rng(">= 0", "0: no rollouts.jsonl"),
        "log_model_max_mb": rng(">= 0", "0: auto never copies"),
    }

    def check(self, prefix: str) -> None:
        super().check(prefix)
        sinks = list(self.sinks)
        require(
            f"{prefix}sinks",
            "mlflow" in sinks and all(s in SINKS for s in sinks) and len(set(sinks)) == len(sinks),
            f"{sinks}; give each of {', '.join(SINKS)} at most once, mlflow among them (the run's record: "
            f"checkpoints' lineage, the registry), e.g. {prefix}sinks=[mlflow,tensorboard]",
        )
        for sink in sinks:
            require(
                f"{prefix}sinks",
                sink == "mlflow" or importlib.util.find_spec(sink) is not None,
                f"{sinks}: the {sink} package is not installed: pip install {sink} (or pip install "
                f"'relay-rl[{sink}]'), or drop {sink}",
            )
        if self.register_model:
            require(
                f"{prefix}log_model",
                self.log_model != "off",
                f"off with {prefix}register_model={self.register_model!r}: there is no model to register; set "
                f"{prefix}log_model=auto (or copy, reference), or leave {prefix}register_model empty",
            )
            server = self.uri.split("://", 1)[0] in ("http", "https", "databricks")
            require(
                f"{prefix}log_model",
                not (server and self.log_model == "reference"),
                f"reference with {prefix}register_model on the tracking server {self.uri}: a server registers "
                f"only models in its artifacts; set {prefix}log_model=copy (or auto), or register by hand",
            )


@dataclass
class EvalConfig(_Section):
    """`python -m app eval` (app/evaluation/command.py), and the samples per prompt of validation in training."""

    checkpoint: str = ""
    """What `python -m app eval` evaluates (also `--checkpoint`): an HF model folder, a run directory (its newest
    weights: the `final/` export, or a newer checkpoint), or one of its checkpoints."""
    data: str = ""
    """The prompt file to evaluate (also `--data`), in the formats training reads; "": `data.val`."""
    n: int = 4
    """Samples per prompt of `python -m app eval`."""
    k: list[int] = field(default_factory=lambda: [1])
    """pass@k is reported for each k here (each at most the samples per prompt), with mean@n."""
    temperature: float = 1.0
    """Sampling temperature of `python -m app eval` (top_p: `rollout.top_p`)."""
    pass_threshold: float = 1.0
    """A sample passes (for pass@k) when its reward is at least this."""
    timeout_s: float = 3600.0
    """Deadline of the generation of `python -m app eval` (all prompts, once the engine or replicas serve)."""
    engine: EvalEngine = "auto"
    """Where `python -m app eval` generates. `local`: one vLLM engine in the eval process, no Ray (the rollout
    replica's engine settings and seeds, the rewards scored in local processes: `reward.workers` is not
    used); `cluster`: the rollout deployment and rollouter of training on Ray (`rollout.*` replicas, several
    in parallel); `auto`: `local` unless `ray.address` or RAY_ADDRESS names a cluster, or `env.name` needs
    Serve (the OpenAI endpoint of `openai_agent`)."""
    val_n: int = 1
    """Samples per prompt at each validation in training; above 1 (with algorithm.val_temperature > 0),
    mean@n and pass@k of `k` are logged per data source (`val/<source>/pass_at_1`, ...)."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "n": rng(">= 1"),
        "temperature": rng(">= 0", "0: greedy"),
        "pass_threshold": rng("finite"),
        "timeout_s": _TIMEOUT,
        "val_n": rng(">= 1"),
    }

    def check(self, prefix: str) -> None:
        super().check(prefix)
        ks = list(self.k)
        require(
            f"{prefix}k",
            bool(ks) and all(isinstance(k, int) and 1 <= k <= self.n for k in ks),
            f"{ks}; each k must be an integer in [1, {prefix}n={self.n}] (pass@k draws k of the n samples per "
            f"prompt), e.g. {prefix}k=[1,{self.n}]",
        )
        require(
            f"{prefix}temperature",
            self.n == 1 or self.temperature > 0,
            f"0 (greedy) with {prefix}n={self.n}: every sample of a prompt would be the same; set "
            f"{prefix}temperature=1.0 or {prefix}n=1",
        )


@dataclass
class RayConfig(_Section):
    address: str = ""
    """Ray address; empty starts (or joins) a local cluster."""
    num_cpus: int = 16
    """Logical CPUs of a local cluster (more than cores: requests are fractional)."""
    name: str = "relay"
    """Prefix of this run's Serve application and named actors, so several runs can share a cluster."""

    _RANGES: ClassVar[dict[str, Range]] = {"num_cpus": rng(">= 1", "a cluster without CPUs runs nothing")}
