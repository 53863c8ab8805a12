"""What `python -m app eval` evaluates: the weights behind a path a user gives, as an HF folder vLLM loads.

    an HF model folder          as it is (config.json and weight files: a run's `final/` export, or any model)
    a run directory             its newest weights: the `final/` export, or a checkpoint of a later step (a
                                resumed run that crashed)
    a checkpoint of a run       (`<run>/ray_train/<run>/step_...`, or any folder above it: the newest complete
                                one, as `--resume` picks it) its sharded model, exported to an HF folder with the
                                run's model config and tokenizer

`run_config` finds the settings of the run that wrote the weights (its `config.yaml`, or the copy a
checkpoint keeps), so an evaluation scores with the run's reward function and lengths by default.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.trainer import checkpoint as ckpt
from app.trainer.resume_check import saved_identity

log = logging.getLogger(__name__)

FINAL = "final"  # the run's HF export (app/train_loop.py)
WEIGHTS = ("*.safetensors", "pytorch_model*.bin")


@dataclass(frozen=True)
class Weights:
    """The weights to evaluate: an HF folder (`hf`), or a sharded checkpoint to export first."""

    path: Path
    hf: bool
    what: str  # for logs and the RESULT line: "HF folder", "final export", "checkpoint of step 4"


def is_hf_folder(p: Path) -> bool:
    """An HF model folder: config.json beside weight files (a sharded checkpoint's config.json is not one)."""
    return (p / "config.json").is_file() and any(any(p.glob(w)) for w in WEIGHTS)


def locate(spec: str) -> Weights:
    """The weights `spec` names (see the module docstring); raises FileNotFoundError naming what to give."""
    p = Path(spec).expanduser().resolve()
    if not p.exists():
        raise FileNotFoundError(f"eval.checkpoint={spec!r}: no such file or directory ({p})")
    if is_hf_folder(p):
        return Weights(p, True, "final export" if p.name == FINAL else "HF folder")
    final = p / FINAL if is_hf_folder(p / FINAL) else None
    sel = ckpt.newest(p) if ckpt.checkpoints(p) else None  # damaged ones skipped with a warning
    if sel is not None and (final is None or _newer(sel, final)):
        if final is not None:
            log.info(
                "%s: checkpoint %s is newer than its %s/ export: evaluating the checkpoint",
                p,
                sel.path,
                FINAL,
            )
        return Weights(sel.path, False, f"checkpoint of step {sel.step}")
    if final is not None:
        return Weights(final, True, "final export")
    raise FileNotFoundError(
        f"eval.checkpoint={spec!r}: neither an HF model folder (config.json and *.safetensors) nor a run "
        f"directory with a {FINAL}/ export or a complete checkpoint; give a model folder, a run directory "
        "(<run_dir>/<run name>) or one of its checkpoints"
    )


def _newer(sel: ckpt.Selection, final: Path) -> bool:
    """The checkpoint holds later weights than the run's final/ export: a step after the one the export was
    saved at (summary.json, written with it at the end of a run; the checkpoint saved then has its step), or,
    without a summary, written later."""
    try:
        return sel.step > int(json.loads((final.parent / "summary.json").read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return sel.path.stat().st_mtime > (final / "config.json").stat().st_mtime


def run_config(spec: str) -> tuple[dict[str, Any], Path] | None:
    """The resolved config of the run that wrote the weights `spec` names, and where it was read; None for a
    folder that no Relay run wrote."""
    p = Path(spec).expanduser().resolve()
    for folder in (p, p.parent):  # a run directory, or its final/ export
        if (folder / "config.yaml").is_file() and (folder / "run_identity.json").is_file():
            from omegaconf import OmegaConf

            cfg = OmegaConf.to_container(OmegaConf.load(folder / "config.yaml"), resolve=True)
            return (cfg, folder / "config.yaml") if isinstance(cfg, dict) else None
    found = ckpt.checkpoints(p) if p.is_dir() else []
    if found:
        ident = saved_identity(found[0])
        if ident and isinstance(ident.get("config"), dict):
            return ident["config"], found[0]
    return None


def export_hf(checkpoint: Path, base_model: str, out: Path, dtype: str) -> Path:
    """The model of a sharded checkpoint (torch.distributed.checkpoint, any trainer layout) as an HF folder
    at `out` in `dtype`, with `base_model`'s config and tokenizer (the model the run trained). One process,
    no process group; returns `out`."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    sd = model.state_dict()
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": sd}, checkpoint_id=str(checkpoint / "model"))
    except (Exception, CheckpointException) as e:  # (a BaseException: shapes or names that do not match)
        why = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
        raise ValueError(
            f"checkpoint {checkpoint} does not hold the weights of {base_model} ({why}); evaluate it with the "
            "run's own model.path (its --config, or its run directory)"
        ) from None
    model.load_state_dict(sd)
    model.to(getattr(torch, dtype)).save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(base_model).save_pretrained(str(out))
    (out / "relay_source.json").write_text(json.dumps({"checkpoint": str(checkpoint), "base": base_model}))
    log.info("exported checkpoint %s to the HF folder %s (%s)", checkpoint, out, dtype)
    return out
