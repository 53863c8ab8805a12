"""Pre-flight check of a model folder's architecture: its config.json names a `model_type` the installed
transformers knows, and `AutoConfig` loads it.

An architecture transformers does not know (a newer model than the installed release, a typo, a model that
needs remote code) otherwise fails inside every trainer worker and vLLM replica, after Ray and the engines
have started; here it fails before, in one line that names `model.path`. Imports transformers only when
called.

A folder whose config.json passed once with the installed transformers release passes again without
importing it (`remember`: a folder of marks named by the file's hash and the release), which saves the
driver a few seconds of CPU at every start.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

from app.errors import UserError


class ModelTypeError(UserError, ValueError):
    """`model.path`'s config.json names no architecture the installed transformers can load."""


def check_model_type(folder: str, spec: str | None = None, remember: Path | None = None) -> None:
    """Raise ModelTypeError unless `folder`/config.json has a `model_type` transformers knows and
    `AutoConfig.from_pretrained(folder)` loads it; returns None otherwise. `spec` is what the user wrote as
    `model.path` (a hub id, `~/...`), named in the message; `folder` stands for it when not given. The
    message is one line: the problem and the fix. With `remember`, a config.json that passed there before
    with this transformers release passes at once, and a pass is marked there."""
    mark = _mark(folder, remember) if remember is not None else None
    if mark is not None and mark.exists():
        return
    _check(folder, spec)
    if mark is not None:
        try:
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.touch()
        except OSError:
            pass  # not writable: the check runs again next time


def _mark(folder: str, remember: Path) -> Path | None:
    """The mark of a pass of `folder`/config.json with the installed transformers (None: unreadable)."""
    try:
        data = (Path(folder) / "config.json").read_bytes()
        release = importlib.metadata.version("transformers")
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    return remember / f"{hashlib.sha256(data).hexdigest()[:32]}-transformers-{release}"


def _check(folder: str, spec: str | None) -> None:
    import transformers
    from transformers import CONFIG_MAPPING, AutoConfig

    where = f"model.path={spec or folder!r}"
    cfg_file = Path(folder) / "config.json"
    try:
        hf = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelTypeError(
            f"{where}: {cfg_file} is not a readable JSON file ({type(e).__name__}); point model.path at an "
            "HF checkpoint folder"
        ) from e
    model_type = hf.get("model_type") if isinstance(hf, dict) else None
    if not isinstance(model_type, str) or not model_type:
        raise ModelTypeError(
            f"{where}: {cfg_file} has no model_type; an HF checkpoint's config.json names its architecture"
        )
    version = transformers.__version__
    if model_type not in CONFIG_MAPPING:
        raise ModelTypeError(
            f"{where}: model_type {model_type!r} ({cfg_file}) is not an architecture transformers {version} "
            "knows; use a model transformers supports, or a transformers release that has it"
        )
    try:
        AutoConfig.from_pretrained(folder)
    except Exception as e:  # whatever the config class refuses: its first line is the reason
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelTypeError(
            f"{where}: transformers {version} cannot load {cfg_file} as model_type {model_type!r} "
            f"({type(e).__name__}: {reason:.300})"
        ) from e
