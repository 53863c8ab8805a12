"""What `--resume` checks before Ray starts: the new run against the run its checkpoint was saved from.

Every run writes its identity into its folder (`run_identity.json`): the resolved config, the model (its
`model.path`, folder, `model.dtype` and the shapes of its config.json) and each prompt file (its path, size
and sha256). Every checkpoint keeps a copy (`config.json`). On `--resume`:

    model changed        refused, naming both values: the saved weights only fit the model they came from
    data.train changed   refused unless `--resume-with-new-data`: the checkpoint's queue (stream position,
                         queued groups, prompts in flight) belongs to the old file; with the flag the trainer
                         drops it (logged and counted as ckpt/dropped_*) and the new file starts its first epoch
    anything else        listed in one warning (lr, steps, data.val, ...)

A checkpoint written before `config.json` existed is compared with its run folder's config.yaml (model.path
and the data specs only).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.config import flatten
from app.config.aliases import rename_old_keys
from app.errors import UserError
from app.trainer.checkpoint import CONFIG, sha256

log = logging.getLogger(__name__)

IDENTITY = "run_identity.json"  # in the run folder; every checkpoint keeps a copy as config.json
# the model's config.json entries that fix the parameters' shapes (a text_config's, for multimodal configs)
SHAPE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)
# where and how a run is hosted: a resume may change them without a word
IGNORED = (
    "train.resume",
    "run_dir",
    "ray.address",
    "ray.name",
    "tracking.run_name",
    "model.cache_dir",
    "log_level",
)
FULL_HASH_MAX = 256 << 20  # larger prompt files: their size, first and last 16 MiB


class ResumeMismatch(UserError, ValueError):
    """The run differs from its checkpoint in a way a resume cannot carry over; the message names both values
    and the fix."""


@dataclass
class Comparison:
    """What changed between a checkpoint's run and this one."""

    model: list[str] = field(default_factory=list)  # refused
    data: list[str] = field(default_factory=list)  # refused unless --resume-with-new-data
    other: list[str] = field(default_factory=list)  # one warning


# ------------------------------------------------------------------ identity


def _fingerprint(path: Path) -> str:
    size = path.stat().st_size
    if size <= FULL_HASH_MAX:
        return sha256(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(16 << 20))
        f.seek(size - (16 << 20))
        h.update(f.read())
    return "sampled:" + h.hexdigest()


def file_identity(spec: str, resolved: str) -> dict[str, Any]:
    """A prompt file: its spec (`data.train`), resolved path, size and sha256."""
    p = Path(resolved)
    out: dict[str, Any] = {"spec": spec, "path": resolved}
    if p.is_file():
        out.update(size=p.stat().st_size, sha256=_fingerprint(p))
    return out


def model_identity(spec: str, resolved: str, dtype: str) -> dict[str, Any]:
    """The model: `model.path` (a built-in name, else the resolved folder), `model.dtype`, and the shapes its
    config.json gives."""
    out: dict[str, Any] = {
        "spec": spec,
        "path": spec if spec.startswith("builtin:") else resolved,
        "dtype": dtype,
    }
    try:
        hf = json.loads(Path(resolved, "config.json").read_text())
    except (OSError, ValueError):
        return out
    hf = {**hf, **hf.get("text_config", {})} if isinstance(hf.get("text_config"), dict) else hf
    out["shape"] = {k: hf[k] for k in SHAPE_KEYS if k in hf}
    return out


def files_identity(spec: Any, resolved: str | list[str]) -> dict[str, Any]:
    """A split's prompt files: one file as `file_identity`; several as their specs, paths, total size and
    one digest over every file's (any file's change changes it)."""
    paths = [resolved] if isinstance(resolved, str) else list(resolved)
    if len(paths) == 1:
        return file_identity(spec if isinstance(spec, str) else spec[0], paths[0])
    each = [file_identity(s, p) for s, p in zip(spec, paths, strict=True)]
    out: dict[str, Any] = {"spec": list(spec), "path": paths}
    if all("sha256" in f for f in each):
        digest = hashlib.sha256("".join(f["sha256"] for f in each).encode()).hexdigest()
        out.update(size=sum(f["size"] for f in each), sha256=digest)
    return out


def identity(
    cfg: dict[str, Any], model_path: str, train: str | list[str], val: str | list[str]
) -> dict[str, Any]:
    """This run's identity (see the module docstring); `cfg` is the resolved config as a container."""
    return {
        "config": cfg,
        "model": model_identity(cfg["model"]["path"], model_path, cfg["model"]["dtype"]),
        "data": {
            "train": files_identity(cfg["data"]["train"], train),
            "val": files_identity(cfg["data"]["val"], val),
        },
    }


def saved_identity(ckpt: Path) -> dict[str, Any] | None:
    """The identity a checkpoint was saved with: its config.json, else (a checkpoint written before it) its
    run folder's config.yaml (`<run>/ray_train/<run>/step_...`), else None."""
    if (ckpt / CONFIG).exists():
        return json.loads((ckpt / CONFIG).read_text())
    for folder in ckpt.parents[:3]:
        if (folder / "config.yaml").exists():
            from omegaconf import OmegaConf

            cfg = OmegaConf.to_container(OmegaConf.load(folder / "config.yaml"), resolve=True)
            assert isinstance(cfg, dict)
            m, d = cfg.get("model", {}), cfg.get("data", {})
            return {
                "config": cfg,
                "model": {"spec": m.get("path"), "dtype": m.get("dtype")},
                "data": {"train": {"spec": d.get("train")}, "val": {"spec": d.get("val")}},
            }
    return None


# ------------------------------------------------------------------ comparison


def _same(a: dict[str, Any], b: dict[str, Any], keys: tuple[str, ...]) -> bool:
    """Equal on the first of `keys` that both have (the most precise evidence they share)."""
    for k in keys:
        if k in a and k in b:
            return a[k] == b[k]
    return True


def _show(x: dict[str, Any]) -> str:
    path = f" ({x['path']})" if x.get("path") not in (None, x.get("spec")) else ""
    digest = f", sha256 {x['sha256'][:12]}..., {x['size']} bytes" if "sha256" in x else ""
    return f"{x.get('spec')!r}{path}{digest}"


def _compare_model(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = []
    if not _same(old, new, ("path", "spec")):
        out.append(f"model.path: the checkpoint was saved from {_show(old)}, this run gives {_show(new)}")
    if old.get("dtype") and new.get("dtype") and old["dtype"] != new["dtype"]:
        out.append(f"model.dtype: the checkpoint was saved as {old['dtype']}, this run gives {new['dtype']}")
    shape_old, shape_new = old.get("shape", {}), new.get("shape", {})
    for k in SHAPE_KEYS:
        if k in shape_old and k in shape_new and shape_old[k] != shape_new[k]:
            out.append(
                f"the model's {k}: {shape_old[k]} in the checkpoint, {shape_new[k]} in this run's model"
            )
    return out


def _compare_lora(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """LoRA's rank and targets (`old`, `new`: the configs' `model.lora`) shape what a checkpoint holds (the
    adapters and their optimizer state)."""
    out = []
    for key in ("rank", "targets"):
        if key in old and old.get(key) != new.get(key, old[key]):
            out.append(
                f"model.lora.{key}: the checkpoint was saved with {old[key]!r}, this run gives {new.get(key)!r}"
            )
    return out


def compare(saved: dict[str, Any], now: dict[str, Any]) -> Comparison:
    """What changed from the checkpoint's identity `saved` to this run's `now` (see `identity`). A config saved
    under Relay's old key names (`model.lora_rank`) is compared under the present ones."""
    saved = {**saved, "config": rename_old_keys(saved.get("config", {}))}
    c = Comparison(model=_compare_model(saved.get("model", {}), now.get("model", {})))
    lora_old = saved["config"].get("model", {}).get("lora", {})
    c.model += _compare_lora(lora_old, now.get("config", {}).get("model", {}).get("lora", {}))
    old_train, new_train = saved.get("data", {}).get("train", {}), now.get("data", {}).get("train", {})
    if not _same(old_train, new_train, ("sha256", "path", "spec")):
        c.data.append(
            f"data.train: the checkpoint's prompts are {_show(old_train)}, this run gives {_show(new_train)}"
        )
    old_val, new_val = saved.get("data", {}).get("val", {}), now.get("data", {}).get("val", {})
    if not _same(old_val, new_val, ("sha256", "path", "spec")):
        c.other.append(
            f"data.val: {_show(old_val)} -> {_show(new_val)} (validation rewards before and after differ)"
        )
    handled = ("model.path", "model.dtype", "data.train", "data.val", "data.train_weights")
    handled += ("model.lora.rank", "model.lora.targets")
    a, b = flatten(saved.get("config", {})), flatten(now.get("config", {}))
    w_old, w_new = a.get("data.train_weights") or [], b.get("data.train_weights") or []
    if list(w_old) != list(w_new):  # another mixture: another sequence of epochs
        c.data.append(f"data.train_weights: the checkpoint's are {list(w_old)}, this run gives {list(w_new)}")
    for k in sorted(set(a) | set(b)):
        if k in handled or k.startswith(IGNORED) or a.get(k, "<unset>") == b.get(k, "<unset>"):
            continue
        c.other.append(f"{k}: {a.get(k, '<unset>')!r} -> {b.get(k, '<unset>')!r}")
    return c


def check(ckpt: Path, now: dict[str, Any], new_data_ok: bool) -> bool:
    """Compare this run (`now`) with the checkpoint at `ckpt` before Ray starts. Raises ResumeMismatch on a
    model change, and on a data.train change unless `new_data_ok`; logs the other changes in one warning.
    Returns whether data.train changed (the trainer then drops the checkpoint's queue)."""
    saved = saved_identity(ckpt)
    if saved is None:
        log.warning(
            "checkpoint %s keeps no config (written before config.json, and no config.yaml in its run folder): "
            "the model and data of this run cannot be checked against it",
            ckpt,
        )
        return False
    c = compare(saved, now)
    if c.model:
        raise ResumeMismatch(
            f"--resume {ckpt}: this run's model differs from the checkpoint's: {'; '.join(c.model)}. The saved "
            "weights and optimizer only fit the model they were trained from: resume with the checkpoint's "
            "model.path (and model.dtype), or start a new run without --resume"
        )
    if c.data and not new_data_ok:
        raise ResumeMismatch(
            f"--resume {ckpt}: this run's training data differs from the checkpoint's: {'; '.join(c.data)}. "
            "The checkpoint's prompt queue (stream position, queued groups, prompts in flight) belongs to the "
            "old data: resume with the checkpoint's data.train, or pass --resume-with-new-data to drop that "
            "queue and start the new data's first epoch"
        )
    if c.data:
        log.warning(
            "resuming with new data (--resume-with-new-data): %s; the checkpoint's queue is dropped",
            c.data[0],
        )
    if c.other:
        log.warning("resuming %s with %d config changes: %s", ckpt, len(c.other), "; ".join(c.other))
    return bool(c.data)


def data_changed(ckpt: Path, run_dir: Path) -> bool:
    """Whether the run in `run_dir` (its run_identity.json) trains other data than the checkpoint at `ckpt`
    (the driver allowed it only with --resume-with-new-data). False where either identity is unknown."""
    saved, mine = saved_identity(ckpt), run_dir / IDENTITY
    if saved is None or not mine.exists():
        return False
    return bool(compare(saved, json.loads(mine.read_text())).data)
