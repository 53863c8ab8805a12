"""One typed config tree for a Relay run.

Built from dataclasses as an OmegaConf structured config, so an unknown key or a value of the wrong type
fails at load; `validate()` then checks ranges and choices with messages that name the key and the fix.
Importing this module imports neither torch, Ray nor vLLM.

Precedence: dataclass defaults < `--config FILE.yaml` (or a preset name from `configs/`) < `key=value`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ConfigTypeError, ValidationError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

MODES = ("sync", "one_step_off", "fully_async")
PARTIAL = ("off", "keep", "resubmit")
CORRECTIONS = ("none", "tis", "decoupled")
OVER_BOUND = ("train", "regenerate")
LOSS_AGG = ("token_mean", "seq_mean")
KL_KINDS = ("k1", "k3", "low_var_kl")
TRUNCATION = ("drop", "error")
BACKENDS = ("auto", "gloo", "nccl")
SCALING = ("auto", "external")
DTYPES = ("float32", "bfloat16")


@dataclass
class ModelConfig:
    path: str = "builtin:tiny"
    """A local HF checkpoint folder, or `builtin:tiny` to build (once, cached) the embedded tiny model
    (`builtin:tiny-code`: the same with an ASCII tokenizer, for `builtin:code`)."""
    dtype: str = "float32"
    """Parameter dtype of trainer and replicas: float32 on CPU, bfloat16 on GPU."""
    cache_dir: str = ".cache/relay"
    """Where the embedded model and task are built and cached."""


@dataclass
class DataConfig:
    train: str = "builtin:arith"
    """`builtin:arith`, `builtin:code` (small programs with tests, scored in the sandbox), or a .parquet
    (verl layout) / .jsonl (`{"prompt", "answer"}`) file."""
    val: str = "builtin:arith"
    """Validation split: `builtin:arith` (its held-out split) or a file like `train`."""
    max_prompt_tokens: int = 64
    """Prompts longer than this are handled per `truncation`."""
    truncation: str = "drop"
    """`drop`: skip overlong prompts and count them; `error`: fail on the first one, naming its row."""
    val_size: int = 64
    """Number of validation prompts used at each validation."""
    shuffle: bool = True
    """Shuffle the training prompts at every epoch (seeded by `data.seed` + epoch)."""
    seed: int = 0
    """Seed of the per-epoch shuffle."""
    epochs: int = 0
    """Passes over the training prompts; 0: unlimited (`train.steps` ends the run). With a limit the run ends
    when the data is exhausted: the last groups drain and are trained (a smaller last batch)."""


@dataclass
class RolloutConfig:
    n: int = 8
    """Samples per prompt (the GRPO group)."""
    max_tokens: int = 8
    """Maximum response tokens."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts (behaviour log-probs are taken after it)."""
    top_p: float = 1.0
    """Nucleus sampling of training rollouts."""
    min_replicas: int = 1
    """Minimum (and initial) number of vLLM replicas in the Serve deployment."""
    max_replicas: int = 1
    """Maximum replicas; above `min_replicas` Serve autoscales on ongoing requests."""
    target_ongoing_requests: float = 16.0
    """Serve autoscaling target per replica (only used when max_replicas > min_replicas)."""
    scaling: str = "auto"
    """auto: Serve autoscales between min_replicas and max_replicas on ongoing requests; external: start
    min_replicas and let an operator scale through Serve's REST API (POST
    /api/v1/applications/<ray.name>-rollout/deployments/rollout/scale)."""
    ignore_eos: bool = False
    """Always generate `max_tokens` tokens (benchmarks, and tests of long generations with a tiny model)."""
    lengths: str = "fixed"
    """Benchmarks: `fixed`, or `pareto:ALPHA:MIN` to give each prompt group a long-tailed response length
    min(max_tokens, MIN x Pareto(ALPHA)) (seeded by prompt id; needs `ignore_eos` so lengths are exact)."""
    max_inflight: int = 32
    """fully_async: prompt groups generating at once (admission control may hold fewer)."""
    partial: str = "keep"
    """What a push does to generations in flight: `keep` freezes them and continues under the new weights
    (KV cache recomputed), `resubmit` aborts them and resubmits prompt + partial response, `off` lets them
    finish under the old weights before loading. Tokens always keep the version that produced them."""
    join_timeout_s: float = 600.0
    """Deadline for a replica started mid-run to receive the current weights before it may serve."""
    replica_cpus: float = 1.0
    """Logical CPUs (or GPUs on a GPU cluster, see `replica_gpus`) per vLLM replica."""
    replica_gpus: float = 0.0
    """GPUs per replica (0 runs vLLM on CPU)."""
    max_model_len: int = 128
    """vLLM context length; must hold `data.max_prompt_tokens + rollout.max_tokens`."""
    kv_cache_gib: float = 1.0
    """KV-cache size per replica on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory a GPU replica may take (weights + KV cache)."""
    max_num_seqs: int = 256
    """Maximum sequences a replica batches at once."""
    request_timeout_s: float = 120.0
    """Deadline for one generation request."""


@dataclass
class TrainConfig:
    steps: int = 60
    """Optimizer steps (= weight versions) of the run."""
    workers: int = 2
    """Ray Train workers (FSDP2 ranks)."""
    worker_cpus: float = 1.0
    """Logical CPUs per Ray Train worker."""
    use_gpu: bool = False
    """Train on GPUs (one per worker, NCCL) instead of CPU (gloo)."""
    batch_groups: int = 16
    """Prompt groups per optimizer step (each of `rollout.n` samples)."""
    micro_batch_size: int = 64
    """Sequences per forward/backward on one worker."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas."""
    grad_clip: float = 1.0
    """Gradient-norm clipping threshold."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps (0: none)."""
    backend: str = "auto"
    """Default process group of the trainer: gloo on CPU, nccl on GPU."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    seed: int = 0
    """Seed of the trainer's torch RNG."""
    timeout_s: float = 300.0
    """Timeout of the trainer's collectives and of each wait for a rollout batch."""
    save_every: int = 0
    """Save a checkpoint of the whole pipeline (sharded model and optimizer, RNG, version, prompt stream,
    queued groups, partial rollouts) every this many steps (0: only when the run ends or stops cleanly)."""
    keep_checkpoints: int = 2
    """Checkpoints kept under `<run_dir>/<run>/ray_train` (older ones are deleted)."""
    resume: str = ""
    """Continue from a checkpoint: its directory, or a run directory (its newest checkpoint). Also
    `python -m app train --resume PATH`."""
    max_failures: int = 0
    """Trainer-worker failures Ray Train recovers from by restarting the workers from the last checkpoint."""
    stall_timeout_s: float = 900.0
    """Watchdog: if no training step completes for this long, the run fails with a report of what every
    role was waiting for (written to `<run_dir>/<run>/stall_report.json`)."""
    max_skipped_steps: int = 3
    """Steps with a non-finite loss or gradient are skipped (`train/skipped_steps`); past this many the run
    fails, with the prompt ids of each such batch saved under `<run_dir>/<run>/nonfinite/`."""


@dataclass
class AlgorithmConfig:
    mode: str = "sync"
    """`sync` (generate with version t, train, push), `one_step_off` (generation of t+1 overlaps training) or
    `fully_async` (groups stream into a bounded queue; staleness bounded by `max_staleness`)."""
    max_staleness: float = 1.0
    """fully_async: bound on trained-token staleness in versions (fractions allowed). Admission control
    keeps started groups <= (max_staleness + replica version + 1) x train.batch_groups (AReaL's rule);
    0 behaves as sync, 1 as one_step_off."""
    sync_every: int = 1
    """fully_async: push weights every this many optimizer steps (needs max_staleness >= sync_every - 1)."""
    over_bound: str = "train"
    """A group that still exceeds max_staleness when taken (a straggler): `train` it (with `correction`) or
    `regenerate` its prompt. Either way it is counted (`async/over_bound`); nothing is dropped."""
    correction: str = "none"
    """Off-policy correction: `none` (PPO ratio against the behaviour log-probs), `tis` (clip against the
    trainer's policy, weight by min(pi_prox/pi_behav, is_cap)), `decoupled` (AReaL: same, uncapped)."""
    is_cap: float = 2.0
    """Cap of the truncated importance weight (`correction=tis`)."""
    clip_low: float = 0.2
    """PPO ratio clip below: ratios under 1 - clip_low are clipped."""
    clip_high: float = 0.28
    """PPO ratio clip above (DAPO's clip-higher): ratios over 1 + clip_high are clipped."""
    loss_agg: str = "token_mean"
    """`token_mean` (every token of the batch weighs the same) or `seq_mean` (every sequence does)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the initial policy (0 disables it and the reference model)."""
    kl_kind: str = "low_var_kl"
    """KL estimator: `k1`, `k3` or `low_var_kl` (k3 clamped, as verl)."""
    normalize_adv_std: bool = True
    """Divide group-centred rewards by the group's standard deviation (GRPO); off gives Dr. GRPO."""
    max_log_ratio: float = 20.0
    """Log-ratios are clamped to +-this before exp()."""
    val_every: int = 5
    """Validate every this many versions (and at the first and last)."""
    val_temperature: float = 0.0
    """Sampling temperature at validation (0: greedy)."""


@dataclass
class SyncConfig:
    bucket_mb: float = 256.0
    """Weights are packed into flat buckets of at most this many MiB per broadcast."""
    timeout_s: float = 60.0
    """Deadline of one push: transfer, load and every replica's acknowledgement."""
    backend: str = "auto"
    """Transport of the weight group: gloo on CPU, nccl on GPU."""
    verify: bool = True
    """Compare every replica's checksum of what it loaded with the trainer's."""


@dataclass
class RewardConfig:
    fn: str = "auto"
    """`auto` (per data source), `exact_match`, `gsm8k`, `math` (answer equivalence with math-verify), `code`
    (sandboxed tests), or a dotted path `pkg.module:function`/`pkg.module.function`."""
    timeout_s: float = 10.0
    """Deadline for one reward computation; a timeout scores `on_error`."""
    on_error: float = 0.0
    """Score given to a sample whose reward function raised, hung or returned a non-number."""
    workers: int = 0
    """CPU reward workers (Ray actors); 0 scores in the rollouter's own threads."""
    worker_cpus: float = 0.5
    """Logical CPUs per reward worker."""
    max_concurrency: int = 8
    """Rewards one worker (or, with no workers, the rollouter) computes at once."""
    overlap: bool = True
    """Score each trajectory the moment it finishes, while the rest generate; false scores a batch after
    all of it is generated (sync and one_step_off; the baseline of bench/reward_overlap.py)."""


@dataclass
class RefConfig:
    workers: int = 0
    """With algorithm.kl_coef > 0: Ray actors holding the frozen initial policy that compute reference
    log-probs of finished trajectories in the pipeline, before they reach the trainer; 0 keeps a frozen
    copy in the trainer instead."""
    worker_cpus: float = 0.5
    """Logical CPUs per reference worker."""
    worker_gpus: float = 0.0
    """GPUs per reference worker (0: CPU)."""


@dataclass
class ResourcesConfig:
    """Shares of the cluster by role. Each value is a count (>= 1) or a fraction of the cluster's total
    (< 1); 0 leaves the role's own per-worker settings as they are. Resolved against the Ray cluster at
    start (app/resources.py), which refuses a plan that does not fit."""

    rollout_gpus: float = 0.0
    """GPUs of the rollout role, split evenly over rollout.max_replicas (sets rollout.replica_gpus)."""
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


@dataclass
class TrackingConfig:
    uri: str = ""
    """MLflow tracking URI; empty means a local store under `run_dir`/mlruns."""
    experiment: str = "relay"
    """MLflow experiment name."""
    run_name: str = ""
    """Run name (default: relay-<timestamp>); also names the run folder."""
    log_samples: int = 8
    """Sample generations logged as a table at each validation."""
    register_model: str = ""
    """If set, register the final checkpoint in the MLflow model registry under this name (a new version)."""


@dataclass
class RayConfig:
    address: str = ""
    """Ray address; empty starts (or joins) a local cluster."""
    num_cpus: int = 16
    """Logical CPUs of a local cluster (more than cores: requests are fractional)."""
    name: str = "relay"
    """Prefix of this run's Serve application and named actors, so several runs can share a cluster."""


@dataclass
class RelayConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    run_dir: str = "runs"
    """Where run outputs go (MLflow store, resolved config, final checkpoint)."""
    seed: int = 0
    """Global seed (model build, sampling seeds)."""


class ConfigError(ValueError):
    """A config key or value is wrong; the message names the key and what would be valid."""


def _keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in fields(cls):
        name = f"{prefix}{f.name}"
        out.append(name)
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            out.extend(_keys(type(default), name + "."))
    return out


ALL_KEYS = _keys(RelayConfig)


def _explain(exc: Exception, key: str | None = None) -> ConfigError:
    key = key or getattr(exc, "full_key", None) or "?"
    msg = str(exc).split("\n")[0]
    if isinstance(exc, ConfigKeyError) or "not in struct" in msg or ("Key '" in msg and "not" in msg):
        close = difflib.get_close_matches(key, ALL_KEYS, n=3, cutoff=0.5)
        section = key.rsplit(".", 1)[0] if "." in key else ""
        valid = [k for k in ALL_KEYS if k.rsplit(".", 1)[0] == section and k.count(".") == key.count(".")]
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        return ConfigError(f"unknown config key '{key}'.{hint} Valid keys here: {', '.join(valid)}")
    return ConfigError(f"invalid value for '{key}': {msg}")


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"invalid value for '{key}': {value!r}; choose one of {', '.join(choices)}")


def _check(key: str, ok: bool, what: str) -> None:
    if not ok:
        raise ConfigError(f"invalid value for '{key}': {what}")


def validate(cfg: RelayConfig | DictConfig) -> None:
    """Range and choice checks that types alone cannot express."""
    _check_choice("algorithm.mode", cfg.algorithm.mode, MODES)
    _check_choice("algorithm.correction", cfg.algorithm.correction, CORRECTIONS)
    _check_choice("algorithm.over_bound", cfg.algorithm.over_bound, OVER_BOUND)
    _check_choice("rollout.partial", cfg.rollout.partial, PARTIAL)
    _check("algorithm.max_staleness", cfg.algorithm.max_staleness >= 0, "must be >= 0")
    _check("algorithm.sync_every", cfg.algorithm.sync_every >= 1, "must be >= 1")
    _check(
        "algorithm.max_staleness",
        cfg.algorithm.mode != "fully_async" or cfg.algorithm.max_staleness >= cfg.algorithm.sync_every - 1,
        f"{cfg.algorithm.max_staleness} < algorithm.sync_every - 1 = {cfg.algorithm.sync_every - 1}: between "
        "pushes the replicas lag the trainer by up to sync_every - 1 versions; raise max_staleness or push "
        "more often",
    )
    _check("algorithm.is_cap", cfg.algorithm.is_cap >= 1, "must be >= 1")
    try:
        parse_lengths(cfg.rollout.lengths)
    except ValueError as e:
        raise ConfigError(f"invalid value for 'rollout.lengths': {e}") from None
    _check(
        "rollout.lengths",
        cfg.rollout.lengths == "fixed" or cfg.rollout.ignore_eos,
        "a length distribution needs rollout.ignore_eos=true (else EOS ends responses early)",
    )
    _check("rollout.max_inflight", cfg.rollout.max_inflight >= 1, "must be >= 1")
    _check("data.epochs", cfg.data.epochs >= 0, "must be >= 0 (0: unlimited)")
    _check(
        "data.train",
        not (cfg.model.path == "builtin:tiny" and "builtin:code" in (cfg.data.train, cfg.data.val)),
        "builtin:code needs a tokenizer that can write programs: model.path=builtin:tiny-code (the tiny "
        "model with an ASCII tokenizer; `--config code` sets it up) or a real instruction-tuned model; "
        "the arithmetic tiny model's tokenizer only knows digits and a few letters",
    )
    _check_choice("algorithm.loss_agg", cfg.algorithm.loss_agg, LOSS_AGG)
    _check_choice("algorithm.kl_kind", cfg.algorithm.kl_kind, KL_KINDS)
    _check_choice("data.truncation", cfg.data.truncation, TRUNCATION)
    _check_choice("train.backend", cfg.train.backend, BACKENDS)
    _check_choice("sync.backend", cfg.sync.backend, BACKENDS)
    _check_choice("model.dtype", cfg.model.dtype, DTYPES)
    _check("train.steps", cfg.train.steps >= 1, f"{cfg.train.steps}; must be >= 1")
    _check("train.workers", cfg.train.workers >= 1, f"{cfg.train.workers}; must be >= 1")
    _check("train.batch_groups", cfg.train.batch_groups >= 1, f"{cfg.train.batch_groups}; must be >= 1")
    _check("train.micro_batch_size", cfg.train.micro_batch_size >= 1, "must be >= 1")
    _check("train.lr", cfg.train.lr > 0, f"{cfg.train.lr}; must be > 0")
    _check("train.save_every", cfg.train.save_every >= 0, "must be >= 0 (0: only at the end)")
    _check("train.keep_checkpoints", cfg.train.keep_checkpoints >= 1, "must be >= 1")
    _check("train.max_failures", cfg.train.max_failures >= -1, "must be >= 0 (or -1: unlimited)")
    _check("train.stall_timeout_s", cfg.train.stall_timeout_s > 0, "must be > 0")
    _check("train.max_skipped_steps", cfg.train.max_skipped_steps >= 0, "must be >= 0")
    _check("train.betas", len(cfg.train.betas) == 2, "must be two numbers, e.g. [0.9,0.99]")
    _check("rollout.n", cfg.rollout.n >= 2, f"{cfg.rollout.n}; GRPO needs at least 2 samples per prompt")
    _check("rollout.max_tokens", cfg.rollout.max_tokens >= 1, "must be >= 1")
    _check("rollout.temperature", cfg.rollout.temperature > 0, "must be > 0 for training rollouts")
    _check("rollout.top_p", 0 < cfg.rollout.top_p <= 1, "must be in (0, 1]")
    _check("rollout.min_replicas", cfg.rollout.min_replicas >= 1, "must be >= 1")
    _check_choice("rollout.scaling", cfg.rollout.scaling, SCALING)
    _check("rollout.join_timeout_s", cfg.rollout.join_timeout_s > 0, "must be > 0")
    _check(
        "rollout.max_replicas",
        cfg.rollout.max_replicas >= cfg.rollout.min_replicas,
        f"{cfg.rollout.max_replicas} is below rollout.min_replicas={cfg.rollout.min_replicas}",
    )
    _check(
        "rollout.max_model_len",
        cfg.rollout.max_model_len >= cfg.data.max_prompt_tokens + cfg.rollout.max_tokens,
        f"{cfg.rollout.max_model_len} < data.max_prompt_tokens + rollout.max_tokens "
        f"({cfg.data.max_prompt_tokens} + {cfg.rollout.max_tokens}); raise it or lower those",
    )
    _check("algorithm.clip_low", 0 <= cfg.algorithm.clip_low < 1, "must be in [0, 1)")
    _check("algorithm.clip_high", cfg.algorithm.clip_high >= 0, "must be >= 0")
    _check("algorithm.kl_coef", cfg.algorithm.kl_coef >= 0, "must be >= 0")
    _check("algorithm.val_every", cfg.algorithm.val_every >= 1, "must be >= 1")
    _check("sync.bucket_mb", cfg.sync.bucket_mb > 0, "must be > 0")
    _check("sync.timeout_s", cfg.sync.timeout_s > 0, "must be > 0")
    _check("reward.timeout_s", cfg.reward.timeout_s > 0, "must be > 0")
    _check("reward.workers", cfg.reward.workers >= 0, "must be >= 0 (0: score in the rollouter)")
    _check("reward.max_concurrency", cfg.reward.max_concurrency >= 1, "must be >= 1")
    _check("ref.workers", cfg.ref.workers >= 0, "must be >= 0 (0: the trainer keeps the reference)")
    for f in fields(ResourcesConfig):
        _check(
            f"resources.{f.name}",
            getattr(cfg.resources, f.name) >= 0,
            "must be >= 0 (a count or a share < 1)",
        )
    _check("data.max_prompt_tokens", cfg.data.max_prompt_tokens >= 1, "must be >= 1")
    _check("data.val_size", cfg.data.val_size >= 1, "must be >= 1")


def parse_lengths(spec: str) -> tuple[float, int] | None:
    """`fixed` -> None; `pareto:ALPHA:MIN` -> (ALPHA, MIN). Raises ValueError naming the valid forms."""
    if spec == "fixed":
        return None
    parts = spec.split(":")
    try:
        if parts[0] != "pareto" or len(parts) != 3:
            raise ValueError
        alpha, low = float(parts[1]), int(parts[2])
    except ValueError:
        raise ValueError(f"{spec!r}; use `fixed` or `pareto:ALPHA:MIN` (e.g. pareto:1.2:4)") from None
    if alpha <= 0 or low < 1:
        raise ValueError(f"{spec!r}: ALPHA must be > 0 and MIN >= 1")
    return alpha, low


def _resolve_config_file(name: str) -> Path:
    p = Path(name)
    if p.exists():
        return p
    for cand in (CONFIG_DIR / name, CONFIG_DIR / f"{name}.yaml"):
        if cand.exists():
            return cand
    presets = sorted(x.stem for x in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.exists() else []
    raise ConfigError(
        f"config file '{name}' not found; give a path or one of the presets: {', '.join(presets)}"
    )


def load_config(config_file: str | None = None, overrides: list[str] | None = None) -> DictConfig:
    """Defaults < config file < `key=value` overrides, validated. Raises ConfigError with a helpful message."""
    cfg = OmegaConf.structured(RelayConfig)
    layers: list[tuple[str, Any]] = []
    if config_file:
        path = _resolve_config_file(config_file)
        try:
            layers.append((str(path), OmegaConf.load(path)))
        except Exception as e:  # a YAML syntax error
            raise ConfigError(f"cannot parse config file {path}: {e}") from e
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. train.steps=20)")
        key = item.split("=", 1)[0]
        if key not in ALL_KEYS:
            raise _explain(ConfigKeyError(f"Key '{key}' not in struct"), key)
        try:
            layers.append((item, OmegaConf.from_dotlist([item])))
        except Exception as e:
            raise ConfigError(f"cannot parse override '{item}': {e}") from e
    for source, layer in layers:
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except (ConfigKeyError, ValidationError, ConfigTypeError) as e:
            err = _explain(e)
            raise ConfigError(f"{err} (from {source})") from e
    if cfg.rollout.partial in ("False", "false"):  # YAML reads a bare `off` as false
        cfg.rollout.partial = "off"
    validate(cfg)
    return cfg


def to_container(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def flatten(cfg: DictConfig | dict, prefix: str = "") -> dict[str, Any]:
    d = to_container(cfg) if isinstance(cfg, DictConfig) else cfg
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def describe() -> list[tuple[str, Any, str]]:
    """(key, default, doc) for every leaf key, read from the dataclass field docstrings in this file."""
    import ast
    import inspect

    docs: dict[tuple[str, str], str] = {}
    tree = ast.parse(inspect.getsource(__import__(__name__, fromlist=["x"])))
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            body = node.body
            for i, stmt in enumerate(body):
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and i + 1 < len(body)
                ):
                    nxt = body[i + 1]
                    if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                        docs[(node.name, stmt.target.id)] = " ".join(str(nxt.value.value).split())

    out: list[tuple[str, Any, str]] = []

    def walk(cls: type, prefix: str) -> None:
        for f in fields(cls):
            default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
            if is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")
            else:
                out.append((f"{prefix}{f.name}", default, docs.get((cls.__name__, f.name), "")))

    walk(RelayConfig, "")
    return out
