"""TRL's and verl's names (app/config/aliases.py): each alias in the README's migration table resolves to the
Relay key it names, and a name that means something else here is refused with what to set instead. Relay's
own old names (`model.lora_rank`, `sync.bucket_mb`) are taken as the present keys, in overrides and YAML files,
one warning each, and in a saved run's config without one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.config import ALL_KEYS, ConfigError, load_config
from app.config.aliases import ALIASES, FOREIGN_HINTS, OLD_NAMES

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


def test_old_names_are_a_table_of_their_own():
    assert all(new in ALL_KEYS and old not in ALL_KEYS for old, new in OLD_NAMES.items())
    assert not set(OLD_NAMES) & set(ALIASES)  # not in the README's migration table
    moved = ("model.lora.", "sync.broadcast.", "sync.ipc.")  # the sections that took over flat keys
    assert {k for k in ALL_KEYS if k.startswith(moved)} == set(OLD_NAMES.values())


def _old_name_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is the old name of" in r.getMessage()]


def test_old_names_as_overrides_set_the_new_keys_with_one_warning_each(caplog):
    old = [
        "model.lora_rank=8",
        "model.lora_alpha=4",
        "model.lora_dropout=0.1",
        "model.lora_targets=q_proj,v_proj",
        "model.lora_merge=true",
    ]
    cfg = load_config(None, old)
    assert cfg == load_config(None, [o.replace("lora_", "lora.") for o in old])
    lora = cfg.model.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.targets) == (
        8,
        4.0,
        0.1,
        "q_proj,v_proj",
    ) and lora.merge
    assert cfg.rollout.partial == "finish_on_old"  # LoRA's default follows the old name too
    warned = _old_name_warnings(caplog)
    assert len(warned) == len(old)  # one for each old name, none for the new names
    assert warned[0].startswith(
        "model.lora_rank is the old name of model.lora.rank; taken as model.lora.rank=8."
    )


def test_old_names_in_a_yaml_file_load_as_the_new_keys(tmp_path, caplog):
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  lora_rank: 16\n  lora_alpha: 32\n  lora_targets: q_proj,k_proj\n")
    new = tmp_path / "new.yaml"
    new.write_text("model:\n  lora:\n    rank: 16\n    alpha: 32\n    targets: q_proj,k_proj\n")
    assert load_config(str(new)) is not None and not _old_name_warnings(caplog)
    cfg = load_config(str(old))
    assert cfg == load_config(str(new))
    assert (
        cfg.model.lora.rank == 16 and cfg.model.lora.alpha == 32 and cfg.model.lora.targets == "q_proj,k_proj"
    )
    warned = _old_name_warnings(caplog)
    assert len(warned) == 3 and all(f"(in {old})" in w for w in warned)
    assert "model.lora_alpha is the old name of model.lora.alpha; taken as model.lora.alpha=32" in warned[1]


def test_a_yaml_file_with_both_names_of_a_key_is_refused(tmp_path):
    both = tmp_path / "both.yaml"
    both.write_text("model:\n  lora_rank: 16\n  lora:\n    rank: 8\n")
    with pytest.raises(ConfigError, match=r"sets both model.lora_rank and model.lora.rank"):
        load_config(str(both))


SYNC_OLD = ["sync.bucket_mb=64", "sync.ipc_bucket_mb=512", "sync.nccl_high_priority=true"]
SYNC_NEW = ["sync.broadcast.bucket_mb=64", "sync.ipc.bucket_mb=512", "sync.broadcast.nccl_high_priority=true"]


def test_the_flat_sync_keys_as_overrides_set_their_transports_keys_with_one_warning_each(caplog):
    cfg = load_config(None, SYNC_OLD)
    assert cfg == load_config(None, SYNC_NEW) != load_config(None, [])
    assert (cfg.sync.broadcast.bucket_mb, cfg.sync.ipc.bucket_mb, cfg.sync.broadcast.nccl_high_priority) == (
        64,
        512,
        True,
    )
    warned = _old_name_warnings(caplog)
    assert len(warned) == 3
    assert warned[1].startswith("sync.ipc_bucket_mb is the old name of sync.ipc.bucket_mb; taken as")


def test_the_flat_sync_keys_in_a_yaml_file_load_as_their_transports_keys(tmp_path, caplog):
    old = tmp_path / "old.yaml"
    old.write_text(
        "sync:\n  transport: auto\n  bucket_mb: 64\n  ipc_bucket_mb: 512\n  nccl_high_priority: true\n"
    )
    new = tmp_path / "new.yaml"
    new.write_text(
        "sync:\n  transport: auto\n  broadcast:\n    bucket_mb: 64\n    nccl_high_priority: true\n"
        "  ipc:\n    bucket_mb: 512\n"
    )
    assert load_config(str(new)) == load_config(None, SYNC_NEW) and not _old_name_warnings(caplog)
    assert load_config(str(old)) == load_config(str(new))
    warned = _old_name_warnings(caplog)
    assert len(warned) == 3 and all(f"(in {old})" in w for w in warned)
    assert "sync.bucket_mb is the old name of sync.broadcast.bucket_mb; taken as" in warned[0]
    both = tmp_path / "both.yaml"
    both.write_text("sync:\n  ipc_bucket_mb: 512\n  ipc:\n    bucket_mb: 256\n")
    with pytest.raises(ConfigError, match=r"sets both sync.ipc_bucket_mb and sync.ipc.bucket_mb"):
        load_config(str(both))


def test_a_run_saved_with_the_flat_sync_keys_compares_under_the_new_ones(caplog):
    """A saved run's config (a checkpoint's identity) with the flat keys: the same settings are no change and
    no warning (the user did not write it); another bucket size is listed under the present key."""
    from app.config import to_container
    from app.trainer.resume_check import compare

    saved = to_container(load_config(None, SYNC_NEW))
    sync = saved["sync"]
    broadcast, ipc = sync.pop("broadcast"), sync.pop("ipc")
    sync.update(bucket_mb=broadcast["bucket_mb"], nccl_high_priority=True, ipc_bucket_mb=ipc["bucket_mb"])
    now = to_container(load_config(None, SYNC_NEW))
    c = compare({"config": saved}, {"config": now})
    assert (c.model, c.data, c.other) == ([], [], []) and not caplog.records
    now["sync"]["ipc"]["bucket_mb"] = 1024.0
    assert compare({"config": saved}, {"config": now}).other == ["sync.ipc.bucket_mb: 512.0 -> 1024.0"]
