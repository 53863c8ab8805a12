"""The keys of the config tree (`ALL_KEYS`), what each accepts (`choices`, `constraint`), its default, and
the messages for a key or value OmegaConf refuses: the closest known keys, the section's valid keys, what a
key's type expects with an example."""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import fields, is_dataclass
from typing import Any, Literal, get_args, get_origin

from omegaconf.errors import ConfigKeyError

from app.config.base import ConfigError, _hints, choice_message
from app.config.tree import RelayConfig


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


def _leaf(key: str) -> tuple[type, str] | None:
    """(section class, field name) of a dotted leaf key, or None if there is no such key."""
    cls: type = RelayConfig
    *path, name = key.split(".")
    for part in path:
        hint = _hints(cls).get(part)
        if not (isinstance(hint, type) and is_dataclass(hint)):
            return None
        cls = hint
    return (cls, name) if name in _hints(cls) else None


def choices(key: str) -> tuple[Any, ...]:
    """The Literal choices of `key` (empty if it is not a choice)."""
    leaf = _leaf(key)
    hint = _hints(leaf[0])[leaf[1]] if leaf else None
    return get_args(hint) if get_origin(hint) is Literal else ()


def constraint(key: str) -> str:
    """What `key` accepts, in words (for the reference): its choices, its range, or ''."""
    leaf = _leaf(key)
    if leaf is None:
        return ""
    if choices(key):
        return ", ".join(f"`{c}`" for c in choices(key))
    rule = getattr(leaf[0], "_RANGES", {}).get(leaf[1])
    if rule is not None:
        return rule.text()
    return "true, false" if _hints(leaf[0])[leaf[1]] is bool else ""


def _section_of(name: str) -> type | None:
    """The section class a dotted name ("" for the root) refers to, or None if it is not a section."""
    cls: type = RelayConfig
    for part in filter(None, name.split(".")):
        hint = _hints(cls).get(part)
        if not (isinstance(hint, type) and is_dataclass(hint)):
            return None
        cls = hint
    return cls


def _keys_of(section: str) -> list[str]:
    """The keys directly under `section` ("" : the sections and the top-level keys)."""
    return [k for k in ALL_KEYS if (k.rsplit(".", 1)[0] if "." in k else "") == section]


def _unknown_key(key: str) -> ConfigError:
    """An unknown dotted key: the closest known keys, and the valid keys of the deepest section that exists
    (the valid sections where the first part is already wrong: `trian.steps`)."""
    from app.config.aliases import FOREIGN_HINTS

    if key in FOREIGN_HINTS:
        return ConfigError(f"unknown config key '{key}': {FOREIGN_HINTS[key]}")
    parts = key.split(".")
    section = ""
    for i in range(1, len(parts)):
        if _section_of(".".join(parts[:i])) is None:
            break
        section = ".".join(parts[:i])
    close = difflib.get_close_matches(key, ALL_KEYS, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    if not section and len(parts) > 1:
        sections = [k for k in _keys_of("") if _section_of(k) is not None]
        return ConfigError(
            f"unknown config key '{key}': there is no section '{parts[0]}'.{hint} Valid sections: "
            f"{', '.join(sections)}"
        )
    where = f"in section '{section}'" if section else "at the top level"
    return ConfigError(
        f"unknown config key '{key}'.{hint} Valid keys {where}: {', '.join(_keys_of(section))}"
    )


def default_of(key: str) -> Any:
    """The default value of the dotted key `key` (a section's default is its dataclass)."""
    node: Any = RelayConfig()
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _expects(key: str) -> str:
    """What a key's type accepts, in words, with an example: for messages about a value of the wrong type."""
    leaf = _leaf(key)
    if leaf is None:
        return ""
    hint = _hints(leaf[0])[leaf[1]]
    origin, args = get_origin(hint), get_args(hint)
    default = default_of(key)
    shown = default if isinstance(default, str) else json.dumps(default, separators=(",", ":"))
    example, note = shown or '""', "the default"
    if origin is list:
        what = f"a list in brackets of {_PLURAL.get(args[0], 'values')}"
    elif origin is dict:
        what = f"a mapping in braces of names to {_PLURAL.get(args[1], 'values')}"
        example, note = (example, note) if default else ("{NAME:1}", f"default {shown}")
    elif type(None) in args:
        what = f"{_TYPE_WORDS.get(next(a for a in args if a is not type(None)), 'a value')}, or null"
    else:
        what = _TYPE_WORDS.get(hint, f"a value of type {getattr(hint, '__name__', hint)}")
    return f"expected {what}, e.g. {key}={example} ({note})"


_TYPE_WORDS: dict[Any, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_PLURAL: dict[Any, str] = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def explain(exc: Exception, key: str | None = None) -> ConfigError:
    """OmegaConf's refusal of a key or value (`key`: the override's, else the exception's) in our words."""
    key = re.sub(r"\[\d+\]$", "", key or getattr(exc, "full_key", None) or "?")  # `train.betas[0]`: the list
    msg = str(exc).split("\n")[0]
    if isinstance(exc, ConfigKeyError) or "not in struct" in msg or ("Key '" in msg and "not" in msg):
        return _unknown_key(key)
    if (
        "Cannot convert 'ListConfig'" in msg and f"{key}s" in ALL_KEYS
    ):  # reward.fn=[a,b]: reward.fns takes a list
        return ConfigError(
            f"invalid value for '{key}': it takes one value; for several, use '{key}s' (a list)"
        )
    got = re.match(r"Invalid value '(.*)', expected one of", msg)
    if got and choices(key):  # OmegaConf's Literal check: name the choices our way
        value = got[1]
        return ConfigError(choice_message(key, value, choices(key)))
    if _section_of(key) is not None and key != "?":  # `train=3`
        return ConfigError(
            f"invalid value for '{key}': it is a section, not a value; set its keys (e.g. "
            f"{_keys_of(key)[0]}=...). Valid keys in section '{key}': {', '.join(_keys_of(key))}"
        )
    expects = _expects(key)
    if expects:  # OmegaConf's own words ("AnyNode is not a ListConfig") name its internals, not the fix
        return ConfigError(f"invalid value for '{key}': {expects}")
    return ConfigError(f"invalid value for '{key}': {msg}")
