"""The root of the config tree, `RelayConfig`: one section per role, the run-wide keys, and the rules that
span sections (lengths against the context, LoRA's partial mode and reference, where behaviour log-probs
come from, validation samples, mini-batches). The rules that need the roles (built-in tasks and models, a
real model's settings, registries, reward functions, environments) are app/preflight.py's."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

from app.config.algorithm import AlgorithmConfig
from app.config.base import _SEED, LogLevel, Range, _Section, require
from app.config.data import DataConfig
from app.config.env import EnvConfig
from app.config.model import ModelConfig
from app.config.reward import RewardConfig
from app.config.rollout import RolloutConfig
from app.config.run import EvalConfig, RayConfig, ResourcesConfig, TrackingConfig
from app.config.train import RefConfig, TrainConfig
from app.config.weights import SyncConfig


@dataclass
class RelayConfig(_Section):
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    run_dir: str = "~/relay-runs"
    """Where run outputs go (run folder, checkpoints, the default MLflow store): an absolute path that outlives
    a Ray job (a relative one inside a job's working-directory copy is refused: app/infra/storage.py); on several
    nodes, a path on storage every node mounts."""
    seed: int = 0
    """Global seed (model build, sampling seeds). Every sample has a seed of its own derived from it, on GPU and
    on CPU alike, so two runs with the same seed, config and world size train the same samples in the
    synchronous mode; where generation overlaps training, which weights sample a token depends on timing."""
    log_level: LogLevel = "INFO"
    """Python log level of the driver and the roles (Ray workers get it as RELAY_LOG_LEVEL; roles apply it
    with app/infra/log_filters.py `configure_logging()`). vLLM's own level is VLLM_LOGGING_LEVEL (WARNING)."""

    _RANGES: ClassVar[dict[str, Range]] = {"seed": _SEED}

    def check(self, prefix: str = "") -> None:
        """Check every section, then the rules that span sections."""
        super().check(prefix)
        for f in fields(self):
            section = getattr(self, f.name)
            if isinstance(section, _Section):
                section.check(f"{prefix}{f.name}.")
        self._check_lora(prefix)
        self._check_behaviour_logprobs(prefix)
        budget = self.data.max_prompt_tokens + self.rollout.max_tokens
        require(
            f"{prefix}rollout.max_model_len",
            self.rollout.max_model_len >= budget,
            f"{self.rollout.max_model_len} < data.max_prompt_tokens + rollout.max_tokens "
            f"({self.data.max_prompt_tokens} + {self.rollout.max_tokens}); raise it or lower those",
        )
        require(
            f"{prefix}reward.overlong_buffer",
            self.reward.overlong_buffer < self.rollout.max_tokens,
            f"{self.reward.overlong_buffer} >= rollout.max_tokens ({self.rollout.max_tokens}): every response "
            "would be punished; the buffer is the last stretch before max_tokens (DAPO: 4k of 20k)",
        )
        budget = self.data.max_prompt_tokens + self.env.max_total_tokens
        require(
            f"{prefix}env.max_total_tokens",
            not self.env.name or self.rollout.max_model_len >= budget,
            f"{self.env.max_total_tokens}: data.max_prompt_tokens + this ({budget}) exceeds "
            f"rollout.max_model_len ({self.rollout.max_model_len}); lower it or raise max_model_len",
        )
        require(
            f"{prefix}eval.val_n",
            self.eval.val_n == 1 or self.algorithm.val_temperature > 0,
            f"{self.eval.val_n} samples per validation prompt with algorithm.val_temperature=0 (greedy): they "
            "would all be the same; set algorithm.val_temperature=1.0 (or eval.val_n=1)",
        )

        require(
            f"{prefix}algorithm.ppo_mini_batch_size",
            self.algorithm.ppo_mini_batch_size <= self.train.batch_groups,
            f"{self.algorithm.ppo_mini_batch_size} > train.batch_groups ({self.train.batch_groups}): a mini-batch "
            "is part of a batch; lower it, or 0 for one optimizer step per batch",
        )

    def _check_behaviour_logprobs(self, prefix: str) -> None:
        """`rollout.behaviour_logprobs=trainer` makes the behaviour policy the trainer's at the step's start:
        an importance weight against it is always 1, and a stale batch would go uncorrected."""
        if self.rollout.behaviour_logprobs != "trainer":
            return
        a = self.algorithm
        require(
            f"{prefix}rollout.behaviour_logprobs",
            a.correction == "none",
            f"'trainer' with algorithm.correction={a.correction!r}: the correction weighs each token by the "
            "trainer's policy over the sampler's, and with the trainer's log-probs standing in for the sampler's "
            "that weight is always 1; use algorithm.correction=none, or rollout.behaviour_logprobs=engine",
        )
        require(
            f"{prefix}rollout.behaviour_logprobs",
            a.mode != "fully_async",
            "'trainer' with algorithm.mode=fully_async: its batches are up to algorithm.max_staleness versions "
            "old and only the sampler's own log-probs can correct that; use rollout.behaviour_logprobs=engine",
        )

    def _check_lora(self, prefix: str) -> None:
        """LoRA's cross-section rules: adapters are pushed beside the old ones (finish_on_old), and the KL
        reference is the trainer's base with the adapters off."""
        lora, partial = self.model.lora.rank > 0, self.rollout.partial
        require(
            f"{prefix}rollout.partial",
            not lora or partial == "finish_on_old",
            f"{partial!r} with model.lora.rank={self.model.lora.rank}: a LoRA push loads the new adapter beside "
            "the old ones and requests in flight finish on theirs; use rollout.partial=finish_on_old (the "
            "default with LoRA)",
        )
        require(
            f"{prefix}rollout.partial",
            lora or partial != "finish_on_old",
            "finish_on_old needs LoRA (model.lora.rank > 0): full weights are loaded in place, so requests in "
            "flight cannot finish on the old ones; use keep, resubmit or off, or set model.lora.rank",
        )
        require(
            f"{prefix}ref.workers",
            not lora or self.ref.workers == 0,
            f"{self.ref.workers} with model.lora.rank={self.model.lora.rank}: with LoRA the KL reference is the "
            "trainer's base model with the adapters off (no copy, no reference workers); set ref.workers=0",
        )
