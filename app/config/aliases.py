"""Other systems' names for Relay's keys: TRL's `GRPOConfig` arguments and verl's most used Hydra keys.

A `key=value` override under one of these names is taken as the Relay key, with one warning naming it
(`learning_rate=1e-6` -> `train.lr=1e-6`). Only names whose meaning is the same are aliases; `FOREIGN_HINTS`
holds names whose meaning differs, which are refused with the Relay way of saying the same. The README's
migration table lists both ("Coming from TRL or verl"); a unit test keeps it equal to these tables.

`OLD_NAMES` holds Relay's own former names (the flat `model.lora_*` keys, now `model.lora.*`; the flat
`sync.bucket_mb`, `sync.ipc_bucket_mb` and `sync.nccl_high_priority`, now in their transport's section
`sync.broadcast.*` or `sync.ipc.*`), kept apart from the other systems' names: an override under one is taken
as the new key, a YAML file's mapping is renamed key by key (`rename_old_keys`), each with one warning, and a
saved run's config is renamed silently so that the run still resumes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from app.config.base import ConfigError

log = logging.getLogger(__name__)

# foreign name -> (Relay key, whose name it is)
ALIASES: dict[str, tuple[str, str]] = {
    # TRL GRPOConfig
    "learning_rate": ("train.lr", "TRL"),
    "num_generations": ("rollout.n", "TRL"),
    "max_completion_length": ("rollout.max_tokens", "TRL"),
    "max_prompt_length": ("data.max_prompt_tokens", "TRL"),
    "beta": ("algorithm.kl_coef", "TRL"),
    "epsilon": ("algorithm.clip_low", "TRL"),
    "epsilon_high": ("algorithm.clip_high", "TRL"),
    "temperature": ("rollout.temperature", "TRL"),
    "top_p": ("rollout.top_p", "TRL"),
    "top_k": ("rollout.top_k", "TRL"),
    "max_steps": ("train.steps", "TRL"),
    "num_train_epochs": ("data.epochs", "TRL"),
    "save_steps": ("train.save_every", "TRL"),
    "eval_steps": ("algorithm.val_every", "TRL"),
    "max_grad_norm": ("train.grad_clip", "TRL"),
    "weight_decay": ("train.weight_decay", "TRL"),
    "warmup_steps": ("train.warmup_steps", "TRL"),
    "num_iterations": ("algorithm.ppo_epochs", "TRL"),
    "run_name": ("tracking.run_name", "TRL"),
    # verl (Hydra keys)
    "data.train_files": ("data.train", "verl"),
    "data.val_files": ("data.val", "verl"),
    "data.train_batch_size": ("train.batch_groups", "verl"),
    "data.max_prompt_length": ("data.max_prompt_tokens", "verl"),
    "data.max_response_length": ("rollout.max_tokens", "verl"),
    "actor_rollout_ref.model.path": ("model.path", "verl"),
    "actor_rollout_ref.actor.optim.lr": ("train.lr", "verl"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": ("algorithm.ppo_mini_batch_size", "verl"),
    "actor_rollout_ref.actor.ppo_epochs": ("algorithm.ppo_epochs", "verl"),
    "actor_rollout_ref.actor.kl_loss_coef": ("algorithm.kl_coef", "verl"),
    "actor_rollout_ref.actor.entropy_coeff": ("algorithm.entropy_coef", "verl"),
    "actor_rollout_ref.actor.clip_ratio_low": ("algorithm.clip_low", "verl"),
    "actor_rollout_ref.actor.clip_ratio_high": ("algorithm.clip_high", "verl"),
    "actor_rollout_ref.actor.clip_ratio_c": ("algorithm.clip_ratio_c", "verl"),
    "actor_rollout_ref.actor.grad_clip": ("train.grad_clip", "verl"),
    "actor_rollout_ref.rollout.n": ("rollout.n", "verl"),
    "actor_rollout_ref.rollout.temperature": ("rollout.temperature", "verl"),
    "actor_rollout_ref.rollout.top_p": ("rollout.top_p", "verl"),
    "actor_rollout_ref.rollout.top_k": ("rollout.top_k", "verl"),
    "trainer.total_training_steps": ("train.steps", "verl"),
    "trainer.total_epochs": ("data.epochs", "verl"),
    "trainer.save_freq": ("train.save_every", "verl"),
    "trainer.test_freq": ("algorithm.val_every", "verl"),
    "trainer.project_name": ("tracking.experiment", "verl"),
    "trainer.experiment_name": ("tracking.run_name", "verl"),
    "custom_reward_function.path": ("reward.fn", "verl"),
}

# Relay's old name -> its present key
OLD_NAMES: dict[str, str] = {
    "model.lora_rank": "model.lora.rank",
    "model.lora_alpha": "model.lora.alpha",
    "model.lora_dropout": "model.lora.dropout",
    "model.lora_targets": "model.lora.targets",
    "model.lora_merge": "model.lora.merge",
    "sync.bucket_mb": "sync.broadcast.bucket_mb",
    "sync.nccl_high_priority": "sync.broadcast.nccl_high_priority",
    "sync.ipc_bucket_mb": "sync.ipc.bucket_mb",
}

# foreign names that mean something else here: refused with what to set instead
FOREIGN_HINTS: dict[str, str] = {
    "per_device_train_batch_size": (
        "TRL's per-device batch counts completions; Relay's step is train.batch_groups prompts x rollout.n "
        "samples, split into micro-batches by train.micro_batch_tokens"
    ),
    "gradient_accumulation_steps": (
        "Relay accumulates over the micro-batches of a step by itself: set train.batch_groups (prompts a "
        "step) and train.micro_batch_tokens"
    ),
    "loss_type": "set algorithm.loss_agg: token_mean (TRL's dapo/bnpo) or seq_mean (TRL's grpo)",
    "actor_rollout_ref.actor.loss_agg_mode": "set algorithm.loss_agg: token_mean or seq_mean",
    "use_vllm": "Relay always generates with vLLM (rollout.* keys; Serve replicas)",
    "report_to": "Relay tracks in MLflow (tracking.uri) and writes metrics.jsonl in the run folder",
    "custom_reward_function.name": "give the function with the file: reward.fn=path/to/reward.py:NAME",
    "algorithm.adv_estimator": "Relay's advantage is GRPO's (group-normalised); see algorithm.* keys",
    "actor_rollout_ref.rollout.name": "Relay always generates with vLLM",
}


def translate(key: str, value: str) -> str:
    """The Relay key for `key`: itself, or the key it is an alias or an old name of (with one warning naming
    both)."""
    if key in OLD_NAMES:
        _warn_old(key, value, "")
        return OLD_NAMES[key]
    found = ALIASES.get(key)
    if found is None:
        return key
    relay_key, whose = found
    log.warning("%s is %s's name for %s: taken as %s=%s", key, whose, relay_key, relay_key, value)
    return relay_key


def rename_old_keys(data: Mapping[str, Any], source: str | None = None) -> dict[str, Any]:
    """`data`, a config mapping (a YAML file's, a saved run's), with Relay's old names (`OLD_NAMES`) renamed:
    flattened to dotted keys, renamed, rebuilt. `source` (where it was read) is named in one warning per old
    name; None renames silently (a saved run's config, which the user does not edit). A mapping without an old
    name comes back unchanged. Raises ConfigError where one mapping sets a key under both names."""
    flat = _flat(data)
    old = [k for k in flat if k in OLD_NAMES]
    if not old:
        return dict(data)
    for key in old:
        if OLD_NAMES[key] in flat:
            raise ConfigError(
                f"{source or 'the config'} sets both {key} and {OLD_NAMES[key]}: {key} is the old name of "
                f"{OLD_NAMES[key]}; keep {OLD_NAMES[key]} alone"
            )
        if source is not None:
            _warn_old(key, flat[key], f" (in {source})")
    return _nested({OLD_NAMES.get(k, k): v for k, v in flat.items()})


def _warn_old(key: str, value: Any, where: str) -> None:
    new = OLD_NAMES[key]
    log.warning(
        "%s is the old name of %s; taken as %s=%s%s. Rename it: the old names are accepted for one release",
        key,
        new,
        new,
        value,
        where,
    )


def _flat(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every leaf of `data` as `dotted.key: value` (an empty mapping is a leaf: it survives `_nested`)."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, Mapping) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    """`_flat`'s inverse: `{"model.lora.rank": 8}` -> `{"model": {"lora": {"rank": 8}}}`."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *path, name = key.split(".")
        node = out
        for part in path:
            if not isinstance(node.get(part), dict):  # absent, or a null the file gave the section
                node[part] = {}
            node = node[part]
        node[name] = value
    return out
