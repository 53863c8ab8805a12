"""`model.path` as a local HF checkpoint folder: a folder (`~` expanded), or a Hugging Face hub id.

A hub id (`Qwen/Qwen2.5-0.5B-Instruct`: `Org/Name`, not a local folder) is looked up in the local HF cache
first, in huggingface_hub's layout (`<cache>/models--Org--Name/snapshots/<rev>/`, `<rev>` read from
`refs/main`, else the newest snapshot holding a config.json), where `<cache>` is `HF_HUB_CACHE`, else
`$HF_HOME/hub`, else `~/.cache/huggingface/hub`. Not cached: it is downloaded into that cache
(huggingface_hub's `snapshot_download`) unless `HF_HUB_OFFLINE` is set; a download that fails (no network,
a private or misspelled repo) raises ModelPathError naming the cache and the fix. Every vLLM replica and
trainer worker loads the resolved folder: on a cluster of several nodes that folder must be on storage every
node mounts (or in the same cache on each node).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from app.errors import UserError

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TRUE = ("1", "true", "yes", "on")


class ModelPathError(UserError, ValueError):
    """`model.path` names no usable checkpoint; the message says where it looked and the fix."""


def hf_cache_dir() -> Path:
    """The HF hub cache this process uses: HF_HUB_CACHE (or its old name), else $HF_HOME/hub."""
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if hub:
        return Path(hub).expanduser()
    return Path(os.environ.get("HF_HOME") or "~/.cache/huggingface").expanduser() / "hub"


def is_hub_id(spec: str) -> bool:
    """`Org/Name` (one slash, no leading `.`, `/` or `~`): a hub repository id, when no such folder exists."""
    return bool(_HUB_ID.match(spec)) and not Path(spec).exists()


def cached_snapshot(repo_id: str, cache: Path | None = None) -> Path | None:
    """The folder of `repo_id`'s cached snapshot (refs/main, else the newest with a config.json), or None."""
    root = (cache or hf_cache_dir()) / f"models--{repo_id.replace('/', '--')}"
    ref = root / "refs" / "main"
    if ref.is_file():
        snap = root / "snapshots" / ref.read_text().strip()
        if (snap / "config.json").is_file():
            return snap
    snaps = [s for s in (root / "snapshots").glob("*") if (s / "config.json").is_file()]
    return max(snaps, key=lambda s: s.stat().st_mtime) if snaps else None


def _download(repo_id: str, cache: Path) -> Path:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE:
        raise ModelPathError(
            f"model.path={repo_id!r} is a hub id that is not in the local HF cache ({cache}) and HF_HUB_OFFLINE "
            f"is set: download it where the network allows (`hf download {repo_id}` with the same HF_HOME / "
            "HF_HUB_CACHE), or point model.path at a local checkpoint folder"
        )
    from huggingface_hub import snapshot_download

    log.info("model.path=%s is not in the HF cache %s: downloading it", repo_id, cache)
    try:
        return Path(snapshot_download(repo_id, cache_dir=str(cache)))
    except Exception as e:
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise ModelPathError(
            f"model.path={repo_id!r} is not in the local HF cache ({cache}) and downloading it failed "
            f"({reason:.300}): check the id, download it where the network allows (`hf download {repo_id}` "
            "with the same HF_HOME / HF_HUB_CACHE; a gated model needs `hf auth login`), or point model.path "
            "at a local checkpoint folder"
        ) from e


def resolve_model_path(spec: str) -> str:
    """The local checkpoint folder `model.path` names (a built-in name is the caller's): see the module
    docstring. Raises ModelPathError naming what was looked for and the fix."""
    folder = Path(spec).expanduser()
    if (folder / "config.json").is_file():
        return str(folder.resolve())
    if is_hub_id(spec):
        cache = hf_cache_dir()
        snap = cached_snapshot(spec, cache) or _download(spec, cache)
        if not (snap / "config.json").is_file():
            raise ModelPathError(f"model.path={spec!r}: the hub snapshot {snap} has no config.json")
        log.info("model.path=%s resolved to %s", spec, snap)
        return str(snap)
    what = "has no config.json" if folder.is_dir() else "does not exist"
    raise ModelPathError(
        f"model.path={spec!r} is not an HF checkpoint folder ({folder} {what}) nor a hub id (Org/Name); point "
        "it at a folder holding config.json, the weights and the tokenizer (relative to the working dir), a "
        "hub id such as Qwen/Qwen2.5-0.5B-Instruct, or builtin:tiny"
    )
