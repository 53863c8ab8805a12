"""TRL's and verl's names (app/config/aliases.py): each alias in the README's migration table resolves to the
Relay key it names, and a name that means something else here is refused with what to set instead."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.config import ALL_KEYS, ConfigError, load_config
from app.config.aliases import ALIASES, FOREIGN_HINTS

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_table() -> dict[str, str]:
    """foreign name -> Relay key, read from the README's "Coming from TRL or verl" table."""
    section = README.read_text().split("## Coming from TRL or verl", 1)[1].split("\n## ", 1)[0]
    out: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        for name in re.findall(r"`([^`]+)`", cells[1] + " " + cells[2]):
            out[name] = cells[0].strip("`")
    return out


def test_the_readme_table_is_the_alias_table():
    assert readme_table() == {name: key for name, (key, _) in ALIASES.items()}
    assert all(key in ALL_KEYS for key, _ in ALIASES.values())
    assert not set(ALIASES) & set(ALL_KEYS)  # an alias never hides a key of ours


@pytest.mark.parametrize(
    "override, key, value",
    [
        ("learning_rate=1e-6", "train.lr", 1e-6),
        ("num_generations=4", "rollout.n", 4),
        ("beta=0.04", "algorithm.kl_coef", 0.04),
        ("data.train_batch_size=8", "train.batch_groups", 8),
        ("actor_rollout_ref.actor.optim.lr=3e-6", "train.lr", 3e-6),
        ("trainer.total_training_steps=9", "train.steps", 9),
    ],
)
def test_an_alias_sets_the_key_it_names(override, key, value, caplog):
    cfg = load_config(None, [override])
    section, name = key.split(".")
    assert cfg[section][name] == value
    assert any(f"taken as {key}=" in r.getMessage() for r in caplog.records)


def test_names_that_mean_something_else_are_refused_with_the_fix():
    for name, hint in FOREIGN_HINTS.items():
        with pytest.raises(ConfigError, match=re.escape(hint)):
            load_config(None, [f"{name}=1"])
