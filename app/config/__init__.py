"""One typed config tree for a Relay run.

Built from dataclasses as an OmegaConf structured config, so an unknown key, a value of the wrong type or a
choice outside its `Literal` fails at load; each section's `check()` then verifies its ranges (declared next
to its fields in `_RANGES`) and cross-field rules with messages that name the key, the value, what is valid
and the fix. `load_config` returns the validated DictConfig; `typed(cfg)` turns it into the dataclasses.

    base.py       ConfigError, the choice types, ranges, the checks every section shares
    model.py      model.*                 data.py       data.*            rollout.py   rollout.*
    train.py      train.*, ref.*          algorithm.py  algorithm.*       weights.py   sync.*
    reward.py     reward.*                env.py        env.*             run.py       resources.*, tracking.*,
                                                                                       eval.*, ray.*
    tree.py       RelayConfig, the root, and the rules that span sections
    keys.py       every dotted key, what it accepts, and the messages for a wrong key or value
    load.py       YAML presets and files, `key=value` overrides, `validate`, `typed`
    docs.py       the reference docs/config.md (`python -m app config --write`)

The package is the ground floor: it imports nothing of app/ but app/infra/ and app/errors.py, and neither
torch, Ray nor vLLM. What only the roles know (registry keys, built-in tasks and models, reward functions,
environments, plugins) is checked by app/preflight.py, which the command line runs after `load_config` and
the driver before Ray starts.

Precedence: dataclass defaults < `--config FILE.yaml` (or a preset name from `configs/`) < `key=value`.
"""

from __future__ import annotations

from app.config.algorithm import AlgorithmConfig
from app.config.base import (
    BACKENDS,
    DTYPES,
    KL_KINDS,
    LOG_LEVELS,
    LOSS_AGG,
    OVER_BOUND,
    PARTIAL,
    SCALING,
    TRUNCATION,
    Backend,
    BehaviourLogprobs,
    ConfigError,
    Dtype,
    KlKind,
    LogLevel,
    LossAgg,
    OverBound,
    Partial,
    Range,
    Scaling,
    Truncation,
    rng,
)
from app.config.data import DataConfig, data_files
from app.config.docs import REFERENCE_PATH, describe, reference_markdown
from app.config.env import EnvConfig
from app.config.keys import ALL_KEYS, choices, constraint
from app.config.load import (
    CONFIG_DIR,
    ConfigFiles,
    config_files,
    flatten,
    load_config,
    to_container,
    typed,
    validate,
)
from app.config.model import ModelConfig
from app.config.reward import RewardConfig
from app.config.rollout import RolloutConfig, parse_lengths
from app.config.run import EvalConfig, RayConfig, ResourcesConfig, TrackingConfig
from app.config.train import RefConfig, TrainConfig
from app.config.tree import RelayConfig
from app.config.weights import SyncConfig

__all__ = [
    "ALL_KEYS",
    "BACKENDS",
    "CONFIG_DIR",
    "DTYPES",
    "KL_KINDS",
    "LOG_LEVELS",
    "LOSS_AGG",
    "OVER_BOUND",
    "PARTIAL",
    "REFERENCE_PATH",
    "SCALING",
    "TRUNCATION",
    "AlgorithmConfig",
    "Backend",
    "BehaviourLogprobs",
    "ConfigError",
    "ConfigFiles",
    "DataConfig",
    "Dtype",
    "EnvConfig",
    "EvalConfig",
    "KlKind",
    "LogLevel",
    "LossAgg",
    "ModelConfig",
    "OverBound",
    "Partial",
    "Range",
    "RayConfig",
    "RefConfig",
    "RelayConfig",
    "ResourcesConfig",
    "RewardConfig",
    "RolloutConfig",
    "Scaling",
    "SyncConfig",
    "TrackingConfig",
    "TrainConfig",
    "Truncation",
    "choices",
    "config_files",
    "constraint",
    "data_files",
    "describe",
    "flatten",
    "load_config",
    "parse_lengths",
    "reference_markdown",
    "rng",
    "to_container",
    "typed",
    "validate",
]
