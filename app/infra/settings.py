"""A role's settings read from its config sections by field name: no role copies config fields by hand.

A role's settings dataclass names its fields after the config keys it reads (`GenSettings.top_p` is
`rollout.top_p`), and `from_sections(GenSettings, cfg.rollout, cfg.reward, seed=cfg.seed)` fills each field
from the one section that has a key of that name. Keywords give the fields whose value is computed or comes
from a key of another name; `own` names the fields no config key sets (they keep their defaults). A field
found in no section, or in more than one, is an error: a renamed config key cannot silently leave a role on
a default, and two sections cannot both claim a field.

Sections are the typed dataclasses of app/config.py or their DictConfig form (what a Ray actor receives).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def _has(section: Any, name: str) -> bool:
    if isinstance(section, Mapping):  # a DictConfig: its keys (its methods are attributes too)
        return name in section
    return is_dataclass(section) and name in {f.name for f in fields(section)}


def from_sections(cls: type[T], *sections: Any, own: tuple[str, ...] = (), **given: Any) -> T:
    """An instance of the dataclass `cls`, each field read by name from the one of `sections` that has it,
    unless `given` as a keyword or listed in `own` (no config key: the field's default).

    Raises TypeError naming the field that no section, or more than one, holds.
    """
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    unknown = sorted((set(given) | set(own)) - set(names))
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {', '.join(unknown)}")
    values = dict(given)
    for name in names:
        if name in given or name in own:
            continue
        holders = [s for s in sections if _has(s, name)]
        if len(holders) != 1:
            where = "none" if not holders else f"{len(holders)}"
            raise TypeError(
                f"{cls.__name__}.{name}: {where} of the config sections given hold a key '{name}'; "
                "give its value as a keyword, or name it in `own` if no config key sets it"
            )
        values[name] = holders[0][name] if isinstance(holders[0], Mapping) else getattr(holders[0], name)
    return cls(**values)
