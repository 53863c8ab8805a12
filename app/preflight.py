"""Pre-flight: the checks of a run's config that need the roles, run before Ray starts.

app/config/ checks what a config says by itself (types, choices, ranges, rules across sections) and imports
no role; what only the roles know is checked here, on a config that passed those:

    built-ins   `builtin:NAME` in model.path, data.train and data.val is an entry of app/tasks whose task
                can run with that model and env.name; a model that is not built in refuses the embedded
                default's toy settings
    registries  algorithm.mode, algorithm.correction and env.name are keys of the roles' registries
                (app/trainer/sources, app/trainer/losses, app/envs), or a `pkg.module:Name` that imports
                (app/plugins.py, the loader the run uses)
    rewards     reward.fn / reward.fns resolve and fit reward.weights (a dotted path is imported and its
                signature checked against the styles a reward may have)
    env         the keys the environment's kind needs (env.agent for openai_agent)

`load_config` is a run's config: app/config's `load_config`, then `check`. The command line (`train`,
`eval`) loads through it, and `app.driver.run` checks its config again, so every run is refused before Ray
starts, with a ConfigError that names the key and the fix. Importing this module imports neither torch, Ray
nor vLLM; `check` imports the registries' modules (torch, never Ray or vLLM).
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Mapping

from omegaconf import DictConfig

from app import config
from app import tasks as builtin_tasks
from app.config import ConfigError, RelayConfig, data_files, typed
from app.config.base import check_choice, did_you_mean, require
from app.config.keys import default_of
from app.plugins import PluginError, is_dotted, resolve

# Registries owned by other modules whose keys are the valid choices of a config key (a new loss or rollout
# mode is one file plus one registry line there, and selectable here with no edit): `check` imports the
# registry module to check the value (torch, never Ray or vLLM), so importing this module stays light.
REGISTRIES: dict[str, tuple[str, str]] = {
    "algorithm.correction": ("app.trainer.losses", "LOSSES"),
    "algorithm.mode": ("app.trainer.sources", "SOURCES"),
    "env.name": ("app.envs", "ENVIRONMENTS"),
}


def load_config(config_file: config.ConfigFiles = None, overrides: list[str] | None = None) -> DictConfig:
    """A run's config: defaults < config file < `key=value` overrides, validated (app/config), then checked
    against the roles (`check`). Raises ConfigError with a helpful message."""
    cfg = config.load_config(config_file, overrides)
    check(cfg)
    return cfg


def check(cfg: RelayConfig | DictConfig) -> None:
    """The checks of a validated config that need the roles, in the order of the sections they concern;
    raises ConfigError naming the key and the fix."""
    t = cfg if isinstance(cfg, RelayConfig) else typed(cfg)
    _check_builtins(t)
    for name in ("mode", "correction"):
        _check_registry(f"algorithm.{name}", getattr(t.algorithm, name))
    _check_rewards(t)
    _check_env(t)
    specs = [*data_files(t.data.train), *data_files(t.data.val, "data.val")]
    for key, problem in builtin_tasks.task_problems(t.model.path, t.env.name, specs):
        require(key, False, problem)  # a built-in task's model and environment (app/tasks)
    _check_real_model(t)


def _check_builtins(cfg: RelayConfig) -> None:
    """`builtin:NAME` in model.path, data.train and data.val names an entry of app/tasks."""
    if cfg.model.path.startswith("builtin:"):
        where = " (or a checkpoint folder, or a hub id Org/Name)"
        check_choice("model.path", cfg.model.path, tuple(builtin_tasks.MODELS), where)
    for split in ("train", "val"):
        for spec in data_files(getattr(cfg.data, split), f"data.{split}"):
            if spec.startswith("builtin:"):
                check_choice(
                    f"data.{split}", spec, tuple(builtin_tasks.TASKS), " (or a .parquet / .jsonl file)"
                )


def _check_rewards(cfg: RelayConfig) -> None:
    """reward.fn / reward.fns / reward.weights fit together, and every function resolves."""
    from app.rewards.combine import SpecError, reward_specs

    r = cfg.reward
    try:
        reward_specs(r.fn, r.fns, r.weights)
    except SpecError as e:
        raise ConfigError(f"invalid value for 'reward.{e.key.removeprefix('reward.')}': {e}") from None
    for i, spec in enumerate(r.fns):
        _check_reward_fn(f"reward.fns[{i}]", spec)
    if not r.fns:
        _check_reward_fn("reward.fn", r.fn)


def _check_env(cfg: RelayConfig) -> None:
    """env.name is a registered environment, and the config has the keys its kind needs."""
    if not cfg.env.name:
        return
    _check_registry("env.name", cfg.env.name, '; "" for none')
    from app.envs import env_kind
    from app.envs.base import EnvKeyError

    try:
        env_kind(cfg.env.name).check(cfg.env)  # the keys its kind needs (env.agent for openai_agent)
    except EnvKeyError as e:
        raise ConfigError(f"invalid value for 'env.{e.key}': {e}") from None


def _check_registry(key: str, value: str, none: str = "") -> None:
    """`value` is a key of `key`'s registry (REGISTRIES), or a `pkg.module:Name` that imports (app/plugins.py:
    the same loader the run uses), so a typo fails here, before Ray starts."""
    if isinstance(value, str) and is_dotted(value):
        try:
            resolve(key, value)
        except PluginError as e:
            raise ConfigError(f"invalid value for {e}") from None
        return
    keys = _registry_keys(*REGISTRIES[key])
    if keys is not None:
        where = f" (the keys of {'.'.join(REGISTRIES[key])}{none}; or pkg.module:Name)"
        check_choice(key, value, keys, where)


def _registry_keys(module: str, attr: str) -> tuple[str, ...] | None:
    """Keys of the registry `module.attr` (imported on first use: torch, never Ray or vLLM).

    None only where the module cannot be imported at all; its users then report that themselves.
    """
    try:
        mod = sys.modules.get(module) or importlib.import_module(module)
    except ImportError:
        return None
    keys = getattr(mod, attr, None)
    return tuple(keys) if isinstance(keys, Mapping) else None


def _check_reward_fn(key: str, spec: str) -> None:
    """Resolve `reward.fn` now, so a typo fails before Ray and vLLM start (a dotted path is imported, its
    signature checked against the styles a reward may have)."""
    from app import rewards
    from app.rewards.styles import SignatureError

    try:
        rewards.resolve_reward_fn(spec)
    except SignatureError as e:  # the function exists: no near-miss names to suggest
        raise ConfigError(f"invalid value for '{key}': {e}") from None
    except ValueError as e:
        names = ["auto", *getattr(rewards, "BUILTINS", {})]
        hint = did_you_mean(spec, names)
        module, sep, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
        if not hint and sep and module in sys.modules:  # a near miss of a function in an importable module
            hint = did_you_mean(attr, [n for n in dir(sys.modules[module]) if not n.startswith("_")])
            hint = hint.replace("did you mean ", f"did you mean {module}{sep}")
        raise ConfigError(f"invalid value for '{key}': {e}{hint}") from None


def _toy_settings(cfg: RelayConfig) -> list[str]:
    """The embedded default's toy settings still in `cfg`, each with the value a real run would set. The
    dtype and a CPU placement count only beside a toy dataset, length or lr: with real ones they are a real
    run on a machine without a GPU (`--config laptop`)."""
    d, r, t, res = cfg.data, cfg.rollout, cfg.train, cfg.resources
    found = [
        f"data.{split}={spec} (the tiny model's toy task; give your .parquet / .jsonl, e.g. from "
        "scripts/prepare_data.py)"
        for split, spec in (("train", d.train), ("val", d.val))
        if isinstance(spec, str) and builtin_tasks.is_toy_task(spec)
    ]
    toy = {
        "data.max_prompt_tokens": (d.max_prompt_tokens == 64, "512"),
        "rollout.max_tokens": (r.max_tokens == 8, "1024"),
        "train.lr": (math.isclose(t.lr, 1e-3), "1e-6"),
    }
    found += [f"{key}={default_of(key)} (e.g. {key}={fix})" for key, (hit, fix) in toy.items() if hit]
    if not found:  # real data, lengths and lr: float32 on CPU cores is a real run on a machine without a GPU
        return found
    if cfg.model.dtype == "float32":
        found.append("model.dtype=float32 (e.g. model.dtype=bfloat16)")
    on_gpus = res.colocate or (
        (r.replica_gpus > 0 or res.rollout_gpus > 0) and (t.use_gpu or res.train_gpus > 0)
    )  # resources.colocate puts both on every GPU
    if not on_gpus:
        found.append(
            "vLLM or the trainer on CPU (e.g. resources.rollout_gpus=0.5 resources.train_gpus=0.5: half of the "
            "cluster's GPUs each; resources.colocate=true: both on every GPU; or rollout.replica_gpus and train.use_gpu)"
        )
    return found


def _check_real_model(cfg: RelayConfig) -> None:
    """A model that is not built in must not run with the toy default's data, limits, lr, dtype or CPUs."""
    if builtin_tasks.is_toy_model(cfg.model.path) or cfg.model.allow_toy_settings:
        return
    found = _toy_settings(cfg)
    if found:
        raise ConfigError(
            f"model.path={cfg.model.path!r} is not the built-in tiny model, but the config keeps the embedded "
            f"default's toy settings: {'; '.join(found)}. Start from a preset for real work (`--config gsm8k` "
            "or `--config math` on GPUs, `--config laptop` on a machine without one; then set model.path and "
            "data.train / data.val), or set those keys; model.allow_toy_settings=true keeps them on purpose "
            "(a benchmark of model shapes on the toy task)"
        )
