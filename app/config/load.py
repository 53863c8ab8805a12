"""Loading a config: defaults < `--config FILE.yaml` (or a preset name from `configs/`; several merge left to
right) < `key=value`, each
layer merged by OmegaConf and explained in our words where it refuses one, then `validate` (every section's
checks and the cross-section rules). `typed(cfg)` turns the DictConfig into the dataclasses.

YAML (files and `key=value` values) is read with only `true`/`false` as booleans: YAML 1.1 would read
`off`/`no`/`yes`/`on` as booleans, so `rollout.partial=off` would arrive as false and `no` would pass for it."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ConfigTypeError, ValidationError

from app.config import aliases
from app.config.base import ConfigError
from app.config.keys import ALL_KEYS, explain
from app.config.tree import RelayConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
log = logging.getLogger(__name__)


def _lora_defaults(cfg: DictConfig, layers: list[tuple[str, str | None, DictConfig]]) -> None:
    """`rollout.partial` defaults to `finish_on_old` with LoRA (`model.lora.rank > 0`) unless a layer set it."""
    if int(cfg.model.lora.rank) <= 0:
        return
    if not any(OmegaConf.select(layer, "rollout.partial") is not None for _, _, layer in layers):
        cfg.rollout.partial = "finish_on_old"


def validate(cfg: RelayConfig | DictConfig) -> None:
    """Every section's checks (choices, ranges, cross-field rules); raises ConfigError naming key and fix.
    What needs the roles (registries, built-ins, reward functions) is app/preflight.py's `check`."""
    (cfg if isinstance(cfg, RelayConfig) else typed(cfg)).check()


def typed(cfg: DictConfig | Mapping[str, Any]) -> RelayConfig:
    """The config as real dataclasses (`cfg.train` a TrainConfig, choices typed as Literals).

    Takes `load_config`'s DictConfig, or a plain dict such as `to_container(cfg)` (what roles receive), which
    is merged over the defaults. Does not validate: `load_config` already did.
    """
    if not (isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is RelayConfig):
        cfg = OmegaConf.merge(OmegaConf.structured(RelayConfig), cfg)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


class _YamlLoader(yaml.SafeLoader):
    """YAML with YAML 1.2's booleans (only true/false), floats without a dot (1e-3), no timestamps, and
    duplicate keys refused.

    YAML 1.1 reads `off`, `no`, `on`, `yes` as booleans: `rollout.partial: off` arrived as false, and a
    fix-up that read false back as "off" let `partial: no` pass too. Bool fields still accept those words
    (OmegaConf converts the strings), so only strings change: they stay exactly as written.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_BOOL, _FLOAT, _TIME = ("tag:yaml.org,2002:" + t for t in ("bool", "float", "timestamp"))
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL, _TIME)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_YamlLoader.add_implicit_resolver(
    _FLOAT, re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)  # a SafeLoader subclass: no arbitrary objects


def _resolve_config_file(name: str) -> Path:
    p = Path(name)
    if p.is_file():
        return p
    for cand in (CONFIG_DIR / name, CONFIG_DIR / f"{name}.yaml"):
        if cand.is_file():
            return cand
    presets = sorted(x.stem for x in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.exists() else []
    what = "is a directory, not a file" if p.is_dir() else "not found"
    raise ConfigError(f"config file '{name}' {what}; give a path or one of the presets: {', '.join(presets)}")


ConfigFiles = str | Sequence[str] | None
"""`--config`: one YAML file or preset, several (merged left to right: `--config gsm8k --config lora`), or
none."""


def config_files(config_file: ConfigFiles) -> list[str]:
    """`config_file` as a list of names (a single string is one file)."""
    if not config_file:
        return []
    return [config_file] if isinstance(config_file, str) else [str(c) for c in config_file]


def _layers(config_file: ConfigFiles, overrides: list[str]) -> list[tuple[str, str | None, DictConfig]]:
    """Each config file, then each `key=value`, as OmegaConf layers read with `_YamlLoader`: (source, the
    override's key or None for a file, layer). Relay's old names (files and overrides) and other systems' names
    (overrides) are taken as the present keys, one warning each (app/config/aliases.py)."""
    layers: list[tuple[str, str | None, DictConfig]] = []
    for name in config_files(config_file):
        path = _resolve_config_file(name)
        try:
            data = _yaml(path.read_text(encoding="utf-8")) or {}
        except Exception as e:  # a YAML syntax error, a duplicate key
            raise ConfigError(f"cannot parse config file {path}: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(
                f"config file {path} must be a mapping of sections (e.g. `train:`), not {data!r:.80}"
            )
        # Relay's old names (`model.lora_rank`): renamed, one warning each
        data = aliases.rename_old_keys(data, str(path))
        layers.append((str(path), None, OmegaConf.create(data)))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. train.steps=20)")
        key, raw = item.split("=", 1)
        key = aliases.translate(key, raw)
        if key not in ALL_KEYS:
            raise explain(ConfigKeyError(f"Key '{key}' not in struct"), key)
        try:
            layer = OmegaConf.create()
            OmegaConf.update(layer, key, _yaml(raw) if raw.strip() else raw)  # `key=` is the empty string
        except Exception as e:
            raise ConfigError(f"cannot parse override '{item}': {e}") from e
        layers.append((item, key, layer))
    return layers


def _note_overridden_presets(layers: list[tuple[str, str | None, DictConfig]]) -> None:
    """Log, for each config file after the first, the keys it takes over from the files before it."""
    seen: dict[str, str] = {}
    for source, key, layer in layers:
        if key is not None:
            continue
        keys = set(flatten(layer))
        taken = sorted(k for k in keys if k in seen)
        if taken:
            log.info(
                "--config %s sets %s over %s",
                Path(source).stem,
                ", ".join(taken),
                ", ".join(sorted({Path(seen[k]).stem for k in taken})),
            )
        seen.update(dict.fromkeys(keys, source))


def load_config(config_file: ConfigFiles = None, overrides: list[str] | None = None) -> DictConfig:
    """Defaults < config files (left to right) < `key=value` overrides, validated. Raises ConfigError with a helpful message.
    A run loads through app/preflight.py's `load_config`, which then checks the config against the roles."""
    cfg = OmegaConf.structured(RelayConfig)
    layers = _layers(config_file, list(overrides or []))
    _note_overridden_presets(layers)
    for source, key, layer in layers:
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except (ConfigKeyError, ValidationError, ConfigTypeError) as e:
            err = explain(e, key)
            raise ConfigError(f"{err} (from {source})") from e
    _lora_defaults(cfg, layers)
    validate(cfg)
    return cfg  # type: ignore[return-value]


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain dicts and lists (what a Ray actor receives)."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def flatten(cfg: DictConfig | dict, prefix: str = "") -> dict[str, Any]:
    """Every leaf as `dotted.key: value` (the tracker's params)."""
    d = to_container(cfg) if isinstance(cfg, DictConfig) else cfg
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
