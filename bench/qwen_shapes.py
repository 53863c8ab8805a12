"""Qwen2.5-shaped models for the benches: random bf16 weights in an HF folder, with a synthetic tokenizer over
the full vocabulary (no hub here: nothing is downloaded).

    from bench.qwen_shapes import build_model_dir
    path = build_model_dir("1.5B", "/tmp/models")      # config.json, model.safetensors, tokenizer files

The weights are N(0, 0.02) (norms 1), drawn on the GPU when there is one: the values only need to be finite
(pushes, throughput); the model says nothing sensible. The tokenizer is the embedded model's character tokenizer
padded with filler tokens to the full vocabulary: any text tokenizes, and every id of the embedding is a token,
as in the real model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings (Qwen2.5 configs)
QWEN2_SHAPES: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "tiny": (128, 384, 2, 4, 2, 1024, False),
    "0.5B": (896, 4864, 24, 14, 2, 151936, True),
    "1.5B": (1536, 8960, 28, 12, 2, 151936, True),
    "3B": (2048, 11008, 36, 16, 2, 151936, True),
    "7B": (3584, 18944, 28, 28, 4, 152064, False),
}


def shape_name(shape: str) -> str:
    """`1.5b` -> `1.5B` (the keys of QWEN2_SHAPES); unknown shapes raise naming the known ones."""
    for k in QWEN2_SHAPES:
        if k.lower() == shape.lower():
            return k
    raise ValueError(f"unknown shape {shape!r}: one of {', '.join(QWEN2_SHAPES)}")


def qwen2_config(shape: str, max_positions: int = 4096):
    from transformers import Qwen2Config

    h, inter, layers, heads, kv, vocab, tied = QWEN2_SHAPES[shape_name(shape)]
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        bos_token_id=None,
        eos_token_id=1,  # the tokenizer's (app/tasks/tiny.py): <pad> 0, <eos> 1, <unk> 2
        pad_token_id=0,
        torch_dtype="bfloat16",
        architectures=["Qwen2ForCausalLM"],
    )


def synthetic_tokenizer(vocab: int, max_len: int = 4096):
    """The embedded model's character tokenizer (app/tasks/tiny.py: any text tokenizes, one id a character) padded
    with filler tokens `<w...>` to exactly `vocab` ids, so that every row of the embedding is a token."""
    from app.tasks.tiny import CHARS, build_tokenizer

    base = len(build_tokenizer().get_vocab())
    fillers = [f"<w{i}>" for i in range(base, vocab)]
    return build_tokenizer(list(CHARS) + fillers, max_len=max_len)


def build_model_dir(shape: str, root: str | Path, seed: int = 0, max_positions: int = 4096) -> str:
    """An HF folder of a Qwen2.5-shaped model with random bf16 weights (cached: built once per root)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    shape = shape_name(shape)
    path = Path(root) / f"qwen2.5-{shape}-random"
    if (path / "relay_built.json").exists():
        return str(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = qwen2_config(shape, max_positions)
    with torch.device("meta"):
        names = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_config(cfg).named_parameters()}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    state = {}
    for n, s in names.items():
        if n.endswith("norm.weight"):
            state[n] = torch.ones(s, dtype=torch.bfloat16)
        else:
            state[n] = (torch.randn(s, generator=g, device=dev) * 0.02).to(torch.bfloat16).cpu()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(path)
    synthetic_tokenizer(cfg.vocab_size, max_positions).save_pretrained(path)
    (path / "relay_built.json").write_text(json.dumps({"shape": shape, "seed": seed, "tensors": len(state)}))
    return str(path)
