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


def _byte_level_ascii() -> list[str]:
    """Printable ASCII, newline and tab as byte-level characters (space is 'Ġ', newline 'Ċ'): transformers
    loads a Qwen2-typed checkpoint's tokenizer as Qwen2Tokenizer (byte-level pre-tokenizer and decoder, a BPE
    without merges over our vocabulary), so the vocabulary must be in that alphabet to round-trip."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, map(chr, cs), strict=False))
    return [table[b] for b in [9, 10, *range(32, 127)]]


ASCII_CHARS = _byte_level_ascii()  # the code variant's alphabet


def build_tokenizer(chars: list[str] | None = None, max_len: int = 256):
    """A character-level WordLevel tokenizer wrapped for transformers (and vLLM)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for c in chars or CHARS:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK, model_max_length=max_len
    )


def model_config(vocab_size: int, max_positions: int = 256):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32: the smallest vLLM's CPU attention supports
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
        torch_dtype="float32",
    )


def _sft_step(model, opt, seqs: list[list[int]], starts: list[int], pad_id: int):
    """One supervised step on right-padded sequences, the loss on tokens from `starts` on; returns it."""
    import torch

    width = max(map(len, seqs))
    x = torch.full((len(seqs), width), pad_id)
    labels = torch.full((len(seqs), width), -100)
    for i, (sq, st) in enumerate(zip(seqs, starts, strict=True)):
        x[i, : len(sq)] = torch.tensor(sq)
        labels[i, st : len(sq)] = torch.tensor(sq[st:])
    loss = model(input_ids=x, labels=labels).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


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
        _sft_step(model, opt, seqs, prompt_lens, tok.pad_token_id)
    model.eval()


def greedy_accuracy(model, tok, problems: list[Problem]) -> float:
    """Exact-match accuracy of greedy one-token answers (used to check the warm-up)."""
    import torch

    ids = [tok.encode(p.prompt, add_special_tokens=False) for p in problems]
    x = torch.tensor(ids)  # all prompts of the task have the same length
    with torch.no_grad():
        pred = model(input_ids=x).logits[:, -1].argmax(-1).tolist()
    return sum(tok.decode([t]) == p.answer for t, p in zip(pred, problems, strict=True)) / len(problems)


def save_built(root: Path, model, tok, info: dict) -> None:
    """Save a built model and its tokenizer as `root/model` (whole or not at all: written to a temporary
    folder, then renamed), then the marker `root/build.json` with `info` that says the build is done."""
    tmp = root / "model.tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(root / "model")
    (root / "build.json").write_text(json.dumps(info))


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
    save_built(root, model, tok, {"version": BUILD_VERSION, "seed": seed, "warmup_val_accuracy": acc})
    log.info("embedded model ready: warm-up validation accuracy %.3f", acc)
    return root


CODE_BUILD_VERSION = 1
CODE_MAX_POSITIONS = 1024


def ensure_builtin_code(cache_dir: str | Path, seed: int = 0, warmup_steps: int = 60) -> Path:
    """Build (once) `builtin:tiny-code`: the tiny architecture with a printable-ASCII character tokenizer
    and 1024 positions, so that `builtin:code` prompts and Python programs are expressible. A short
    supervised warm-up on the task's reference solutions teaches it the reply format (a ```python block);
    its programs are mostly wrong, which is the point: the code-reward path (sandbox, error kinds) runs end
    to end on CPU. Returns the folder holding `model/`."""
    root = Path(cache_dir) / f"builtin-code-v{CODE_BUILD_VERSION}-seed{seed}"
    marker = root / "build.json"
    if marker.exists():
        return root
    import torch
    from transformers import Qwen2ForCausalLM

    from app.tasks.code import make_code_problems

    log.info("building the embedded tiny code model under %s", root)
    root.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    tmp = root / "model.tmp"
    built = build_tokenizer(ASCII_CHARS, CODE_MAX_POSITIONS)
    built.save_pretrained(tmp)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(model_config(len(built), CODE_MAX_POSITIONS))
    model.config.save_pretrained(tmp)
    tok = AutoTokenizer.from_pretrained(tmp)  # as vLLM and the trainer load it (next to config.json)
    probe = "```python\nn = int(input())\n\tprint(n * 2)\n```"
    if tok.decode(tok.encode(probe, add_special_tokens=False)) != probe:
        raise RuntimeError(f"the tiny code tokenizer does not round-trip {probe!r}")
    problems = make_code_problems(512, seed + 7, prefix="warmup")  # not the task's own prompts
    g = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(warmup_steps):
        seqs, starts = [], []
        for p in g.sample(problems, 8):
            ids = tok.encode(p.prompt, add_special_tokens=False)
            reply = tok.encode(f"```python\n{p.solution.strip()}\n```", add_special_tokens=False)
            seqs.append([*ids, *reply, tok.eos_token_id][:CODE_MAX_POSITIONS])
            starts.append(len(ids))
        loss = _sft_step(model, opt, seqs, starts, tok.pad_token_id)
    model.eval()
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(root / "model")
    final = float(loss.detach())
    marker.write_text(json.dumps({"version": CODE_BUILD_VERSION, "seed": seed, "final_loss": final}))
    log.info("embedded code model ready: warm-up loss %.3f", final)
    return root
