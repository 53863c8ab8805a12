"""The embedded default: a tiny Qwen2 model with a character tokenizer, and a verifiable task.

The task ("arith"): the prompt shows an operation and four digits, e.g. `max:3815=`, and the answer is
one digit (`8`). Operations are max and min. Splits are disjoint in their digit strings, so validation
measures generalisation, not memory.

The model is built once and cached. Like a real base model it already knows the format: a short
supervised warm-up teaches it to answer with one of the digits shown (chosen at random, not by the rule),
so it starts near chance (about 0.3) and GRPO has to discover max vs min from rewards alone.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BUILD_VERSION = 3  # bump when the recipe changes: invalidates the cache
OPS = ("max",)
CHARS = list("0123456789") + list("maxin:=, ")
EOS = "<eos>"
PAD = "<pad>"
UNK = "<unk>"


@dataclass(frozen=True)
class Problem:
    uid: str
    prompt: str
    answer: str


def _solve(op: str, digits: str) -> str:
    return max(digits) if op == "max" else min(digits)


def make_problems(
    seed: int = 0, n_train: int = 4096, n_val: int = 256
) -> tuple[list[Problem], list[Problem]]:
    """Disjoint train/val problem lists (by digit string), deterministic in `seed`."""
    rng = random.Random(seed)
    strings = [f"{i:04d}" for i in range(10_000)]
    rng.shuffle(strings)
    val_strings, train_strings = strings[:n_val], strings[n_val:]
    train = []
    for i in range(n_train):
        d = train_strings[i % len(train_strings)]
        op = OPS[rng.randrange(len(OPS))]
        train.append(Problem(f"arith-train-{i}", f"{op}:{d}=", _solve(op, d)))
    val = []
    for i, d in enumerate(val_strings):
        op = OPS[i % len(OPS)]
        val.append(Problem(f"arith-val-{i}", f"{op}:{d}=", _solve(op, d)))
    return train, val


def build_tokenizer():
    """A character-level WordLevel tokenizer wrapped for transformers (and vLLM)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for c in CHARS:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK, model_max_length=256
    )


def model_config(vocab_size: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32: the smallest vLLM's CPU attention supports
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
        torch_dtype="float32",
    )


def _warmup(model, tok, train: list[Problem], steps: int, seed: int) -> None:
    """Supervised format warm-up: answer with a random digit of the prompt, then EOS."""
    import torch

    g = random.Random(seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    eos = tok.eos_token_id
    model.train()
    for _ in range(steps):
        batch = g.sample(train, 64)
        seqs, prompt_lens = [], []
        for p in batch:
            digits = p.prompt.split(":")[1].rstrip("=")
            ids = tok.encode(p.prompt, add_special_tokens=False)
            prompt_lens.append(len(ids))
            seqs.append([*ids, *tok.encode(g.choice(digits), add_special_tokens=False), eos])
        width = max(map(len, seqs))
        x = torch.full((len(seqs), width), tok.pad_token_id)
        labels = torch.full((len(seqs), width), -100)
        for i, (s, pl) in enumerate(zip(seqs, prompt_lens, strict=True)):
            x[i, : len(s)] = torch.tensor(s)
            labels[i, pl : len(s)] = torch.tensor(s[pl:])
        loss = model(input_ids=x, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def greedy_accuracy(model, tok, problems: list[Problem]) -> float:
    """Exact-match accuracy of greedy one-token answers (used to check the warm-up)."""
    import torch

    ids = [tok.encode(p.prompt, add_special_tokens=False) for p in problems]
    x = torch.tensor(ids)  # all prompts of the task have the same length
    with torch.no_grad():
        pred = model(input_ids=x).logits[:, -1].argmax(-1).tolist()
    return sum(tok.decode([t]) == p.answer for t, p in zip(pred, problems, strict=True)) / len(problems)


def ensure_builtin(cache_dir: str | Path, seed: int = 0, warmup_steps: int = 150) -> Path:
    """Build (once) the tiny model, its tokenizer and the task files; return the folder.

    Layout: `model/` (HF checkpoint + tokenizer), `train.jsonl`, `val.jsonl`, `build.json`.
    """
    root = Path(cache_dir) / f"builtin-v{BUILD_VERSION}-seed{seed}"
    marker = root / "build.json"
    if marker.exists():
        return root
    import torch
    from transformers import Qwen2ForCausalLM

    log.info("building the embedded tiny model and task under %s", root)
    root.mkdir(parents=True, exist_ok=True)
    train, val = make_problems(seed)
    for name, rows in (("train", train), ("val", val)):
        with open(root / f"{name}.jsonl", "w") as f:
            for p in rows:
                f.write(
                    json.dumps({"id": p.uid, "prompt": p.prompt, "answer": p.answer, "data_source": "arith"})
                )
                f.write("\n")
    tok = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(model_config(len(tok)))
    _warmup(model, tok, train, warmup_steps, seed)
    acc = greedy_accuracy(model, tok, val)
    tmp = root / "model.tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(root / "model")
    marker.write_text(json.dumps({"version": BUILD_VERSION, "seed": seed, "warmup_val_accuracy": acc}))
    log.info("embedded model ready: warm-up validation accuracy %.3f", acc)
    return root
