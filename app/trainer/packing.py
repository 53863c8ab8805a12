"""Padding-free micro-batches: sequences packed end to end into one row, attention kept inside each sequence.

`plan_micro_batches` splits a step's rows over FSDP ranks and into token-budget micro-batches
(`train.micro_batch_tokens`); `collate_packed` lays one micro-batch out as a single row of concatenated
sequences, with position ids restarting at every sequence and the cumulative sequence lengths that the
attention needs.

Attention boundaries. Transformers' own packed-sequence detection (restarting `position_ids`, no
`attention_mask`) builds a `[T, T]` mask per forward, costs a host synchronisation, and on transformers 5.19
with sdpa/eager on CPU did not keep sequences apart (a later sequence's logits differed by 0.46 from its
own forward). So the packed forward passes no mask of its own: `attention_mask` is `no_mask()`, an empty 4-D
tensor, which transformers' mask builders (`create_causal_mask`, `create_sliding_window_causal_mask`) take
for a prepared mask and return unchanged before they read `position_ids` (so no mask is built and no
host synchronisation happens), in every model that builds its masks through them, whether it keeps one mask
(Llama, Mistral) or a mapping per layer type (Qwen2, Qwen3). A `PackedSeqs` record reaches our attention
function, registered with transformers' `AttentionInterface` as ``relay_packed``, which ignores the mask on
packed calls:

* ``varlen``: `torch.nn.attention.varlen.varlen_attn` (FlashAttention's varlen kernel: one call over
  every sequence, causal inside each), on CUDA in bf16/fp16;
* ``per_seq``: causal `scaled_dot_product_attention` inside each sequence, the sequences of one length
  batched into one call (gathered by one index_select, put back by another: `LengthGroups`); exact on any
  device and dtype; the CPU path, and the GPU fallback where varlen is missing. A packed row of a step's
  short answers holds a few lengths, so a few calls, not one a sequence (whose slices' backward would each
  zero-fill the whole row).

``auto`` takes varlen where it applies, else per_seq. A layer's sliding window (Mistral, Qwen2/Qwen3 sliding
layers) applies inside each sequence. Calls without a `PackedSeqs` (padded batches: the reference forward,
`Learner.logprobs_of`) go to transformers' sdpa attention with its usual mask.

Which models. Packing is exact only where attention is the one place tokens mix and every attention layer
goes through the attention interface with the model's rotary positions from `position_ids`: a model with a
convolution, a recurrent or linear-attention layer, or a mask builder of its own would mix the packed
sequences silently. So the packed path serves the model types in `PACKED_MODEL_TYPES` (each checked against
the padded step in tests/test_packed_step.py); `packing_enabled` sends any other model to padded
micro-batches, with one warning.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

ATTN_NAME = "relay_packed"
PACKED_ATTENTION = ("auto", "varlen", "per_seq")
# config.json `model_type`s whose packed step equals the padded one (tests/test_packed_step.py)
PACKED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


@dataclass
class PackedSeqs:
    """Sequence boundaries of a packed row: `cu` on the device (int32), `cu_host` the same on the host."""

    cu: torch.Tensor
    cu_host: list[int]
    max_len: int
    mode: str = "auto"
    _groups: dict[torch.device, LengthGroups] = field(default_factory=dict, repr=False, compare=False)

    def groups(self, device: torch.device) -> LengthGroups:
        """The row's sequences by length (built once a row, for every layer's attention)."""
        if device not in self._groups:
            self._groups[device] = LengthGroups.of(self.cu_host, device)
        return self._groups[device]


@dataclass
class LengthGroups:
    """A packed row's sequences grouped by length: `sizes` (length, count) in the order of `perm`, the row's
    token positions laid out group after group (each group's sequences one after the other); `inv` puts them
    back. Both None where that order is the row's own (every length once, in order)."""

    sizes: list[tuple[int, int]]
    perm: torch.Tensor | None
    inv: torch.Tensor | None

    @classmethod
    def of(cls, cu_host: list[int], device: torch.device) -> LengthGroups:
        starts: dict[int, list[int]] = {}
        for a, b in itertools.pairwise(cu_host):
            starts.setdefault(b - a, []).append(a)
        order = [i for n, group in starts.items() for a in group for i in range(a, a + n)]
        sizes = [(n, len(group)) for n, group in starts.items()]
        if order == list(range(len(order))):
            return cls(sizes, None, None)
        perm = torch.tensor(order, dtype=torch.long)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(len(order))
        return cls(sizes, perm.to(device), inv.to(device))


# ---------------------------------------------------------------- which models


def packable(model_type: str) -> bool:
    """Whether packed micro-batches serve a model of this config.json `model_type` (one of
    `PACKED_MODEL_TYPES`); pure, so the driver can ask before anything starts."""
    return model_type in PACKED_MODEL_TYPES


def packing_enabled(micro_batch_tokens: int, model_type: str, announce: bool = True) -> bool:
    """Whether a trainer packs its micro-batches: `train.micro_batch_tokens > 0` on a `packable` model type.

    A model type the packed path does not serve trains on padded micro-batches (as with
    `train.micro_batch_tokens=0`) rather than fail at the first step; with `announce`, one warning names the
    model type and the setting (pass it on one rank only, for one line per run).
    """
    if micro_batch_tokens <= 0:
        return False
    if packable(model_type):
        return True
    if announce:
        log.warning(
            "train.micro_batch_tokens=%d: packed micro-batches do not serve model type %r (they serve %s); "
            "training on padded micro-batches, as with train.micro_batch_tokens=0",
            micro_batch_tokens,
            model_type,
            ", ".join(sorted(PACKED_MODEL_TYPES)),
        )
    return False


# ---------------------------------------------------------------- planning


def plan_micro_batches(
    lengths: list[int], world: int, budget: int, max_rows: int = 0
) -> list[list[list[int]]]:
    """Row indices per rank, per micro-batch: ``plan[rank][k]`` is rank ``rank``'s k-th micro-batch.

    Rows go to ranks longest first, each to the rank with the fewest tokens so far (balanced work), then
    each rank's rows are packed first-fit (longest first) into micro-batches of at most ``budget`` tokens
    and, with ``max_rows > 0``, at most ``max_rows`` rows (`train.micro_batch_size`); a row longer than the
    budget gets a micro-batch of its own. Deterministic: every rank computes the same plan from the same
    lengths, so the ranks agree on how many passes each runs.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    per_rank: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in order:
        r = min(range(world), key=lambda k: (load[k], k))
        per_rank[r].append(i)
        load[r] += lengths[i]
    plan: list[list[list[int]]] = []
    for mine in per_rank:
        bins: list[list[int]] = []
        room: list[int] = []
        for i in mine:
            k = next(
                (
                    b
                    for b, free in enumerate(room)
                    if free >= lengths[i] and (max_rows <= 0 or len(bins[b]) < max_rows)
                ),
                None,
            )
            if k is None:
                bins.append([i])
                room.append(budget - lengths[i])
            else:
                bins[k].append(i)
                room[k] -= lengths[i]
        plan.append([sorted(b) for b in bins])
    return plan


# ---------------------------------------------------------------- layout


def collate_packed(rows: list[Any], device: torch.device, mode: str = "auto") -> dict[str, Any]:
    """One packed micro-batch of `Row`s (app/trainer/batch_tensors.py): model inputs and response-aligned grids.

    Model inputs: `input_ids` and `position_ids` ``[1, T]`` (T = total tokens), `packed` (`PackedSeqs`).
    Scoring: `score_idx` ``[R]`` (positions in the packed row whose next token is a response token),
    `score_targets` ``[R]``, `grid_idx` ``[R]`` (where each lands in the grid). Grids ``[S, L]`` (S rows, L
    the longest response): `mask`, `old`, `adv`, and `ref` when every row has reference log-probs. Response
    token j of row i sits at grid ``[i, j]``, so the loss and its aggregation see the same per-sequence
    tokens as with padding.
    """
    s = len(rows)
    width = max(len(r.response_ids) for r in rows)
    ids, pos, cu = [], [], [0]
    score_idx, targets, grid_idx = [], [], []
    mask = torch.zeros((s, width), dtype=torch.float32)
    old, adv, ref = torch.zeros_like(mask), torch.zeros_like(mask), torch.zeros_like(mask)
    has_ref = all(r.ref_logprobs is not None for r in rows)
    for i, r in enumerate(rows):
        seq = list(r.prompt_ids) + list(r.response_ids)
        p, n, off = len(r.prompt_ids), len(r.response_ids), cu[-1]
        ids += seq
        pos += range(len(seq))
        cu.append(off + len(seq))
        score_idx += range(off + p - 1, off + p - 1 + n)
        targets += r.response_ids
        grid_idx += range(i * width, i * width + n)
        mask[i, :n] = r.mask()
        old[i, :n] = torch.tensor(r.behaviour_logprobs, dtype=torch.float32)
        adv[i, :n] = r.advantage
        if has_ref:
            ref[i, :n] = torch.tensor(r.ref_logprobs, dtype=torch.float32)
    out = {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "position_ids": torch.tensor([pos], dtype=torch.long),
        "cu": torch.tensor(cu, dtype=torch.int32),
        "score_idx": torch.tensor(score_idx, dtype=torch.long),
        "score_targets": torch.tensor(targets, dtype=torch.long),
        "grid_idx": torch.tensor(grid_idx, dtype=torch.long),
        "mask": mask,
        "old": old,
        "adv": adv,
    }
    if has_ref:
        out["ref"] = ref
    out = to_device(out, device)
    max_len = max(b - a for a, b in itertools.pairwise(cu))
    out["packed"] = PackedSeqs(cu=out.pop("cu"), cu_host=cu, max_len=max_len, mode=mode)
    return out


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Host tensors to `device` without a host synchronisation (pinned, asynchronous copies on CUDA)."""
    if device.type != "cuda":
        return {k: v.to(device) for k, v in tensors.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in tensors.items()}


# ---------------------------------------------------------------- attention


@functools.cache
def _varlen_fn() -> Any | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _varlen_kwargs(fn: Any) -> dict[str, Any]:
    """Causal masking is `window_size=(-1, 0)` in newer torch and `is_causal=True` in older releases."""
    params = inspect.signature(fn).parameters
    if "window_size" in params:
        kw: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        kw = {"is_causal": True}
    else:
        raise RuntimeError("torch.nn.attention.varlen.varlen_attn takes neither window_size nor is_causal")
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    return kw


def _use_varlen(query: torch.Tensor, mode: str, window: int | None) -> bool:
    fn = _varlen_fn()
    ok = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and fn is not None
    # a sliding window needs `window_size` (older releases' varlen_attn is causal only)
    ok = ok and (window is None or "window_size" in _varlen_kwargs(fn))
    if mode == "varlen" and not ok:
        raise RuntimeError(
            "train.packed_attention=varlen needs CUDA, bf16/fp16 compute and torch.nn.attention.varlen "
            "(with window_size for a sliding-window model); use auto or per_seq"
        )
    return ok and mode in ("auto", "varlen")


def _varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    p: PackedSeqs,
    scale: Any,
    window: int | None,
) -> torch.Tensor:
    fn = _varlen_fn()
    kw = _varlen_kwargs(fn)
    if window is not None:  # FlashAttention's left window counts the keys before the query: w - 1
        kw = {**kw, "window_size": (window - 1, 0)}
    # [1, heads, T, dim] -> [T, heads, dim]
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    out = fn(q, k, v, p.cu, p.cu, p.max_len, p.max_len, scale=scale, **kw)
    return out.unsqueeze(0)


def _band(n: int, window: int, device: torch.device) -> torch.Tensor:
    """``[n, n]`` boolean mask of one sequence: query i sees keys i - window < j <= i (transformers'
    sliding-window rule)."""
    i = torch.arange(n, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


def _per_seq(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    p: PackedSeqs,
    scale: Any,
    window: int | None,
) -> torch.Tensor:
    """Attention inside each sequence of `[1, heads, T, dim]` inputs: one causal sdpa call a sequence length,
    on that length's sequences stacked as a batch (`LengthGroups`). Returns `[1, T, heads, dim]`."""
    g = p.groups(query.device)
    q, k, v = (x if g.perm is None else x.index_select(2, g.perm) for x in (query, key, value))
    outs, at = [], 0
    for n, count in g.sizes:

        def part(x: torch.Tensor, at: int = at, n: int = n, count: int = count) -> torch.Tensor:
            # [1, heads, count * n, dim] -> [count, heads, n, dim]
            return x[0, :, at : at + n * count].unflatten(1, (count, n)).transpose(0, 1)

        # only a sequence longer than the window needs a mask (its own [n, n], never the row's [T, T])
        band = _band(n, window, query.device) if window is not None and n > window else None
        o = torch.nn.functional.scaled_dot_product_attention(
            part(q), part(k), part(v), attn_mask=band, is_causal=band is None, scale=scale, enable_gqa=True
        )
        outs.append(o.transpose(0, 1).flatten(1, 2))  # [heads, count * n, dim]
        at += n * count
    out = torch.cat(outs, dim=1).unsqueeze(0)  # [1, heads, T, dim] in the groups' order
    if g.inv is not None:
        out = out.index_select(2, g.inv)
    return out.transpose(1, 2)  # [1, T, heads, dim]


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers attention function: packed rows (a `relay_packed` kwarg) attend within each sequence,
    causally and inside the layer's `sliding_window` if any, and ignore `attention_mask` (`no_mask`); anything
    else is transformers' sdpa attention. Returns ``[1, T, heads, dim]`` like sdpa."""
    p = kwargs.pop("relay_packed", None)
    if p is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if dropout:
        raise NotImplementedError("packed micro-batches with attention dropout")
    window = kwargs.get("sliding_window")
    if window is not None and window >= p.max_len:  # no sequence reaches past it: plain causal attention
        window = None
    fn = _varlen if _use_varlen(query, p.mode, window) else _per_seq
    return fn(query, key, value, p, scaling, window).contiguous(), None


def enable_packed_attention(model: torch.nn.Module) -> None:
    """Route `model`'s attention through `packed_attention` (padded calls keep sdpa and its masks).

    An attention layer that reads its sliding window from the config at each call (Mistral's) also gets it
    as `sliding_window`, where Qwen2/Qwen3 layers keep theirs: app/trainer/compiled.py's packed forward
    passes `module.sliding_window` on.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, packed_attention)
    AttentionMaskInterface.register(ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(ATTN_NAME)
    window = getattr(model.config, "sliding_window", None)
    if getattr(model.config, "layer_types", None) is None and window is not None:
        for m in model.modules():
            if type(m).__name__.endswith("Attention") and not hasattr(m, "sliding_window"):
                m.sliding_window = window


def no_mask(device: torch.device) -> torch.Tensor:
    """The packed forward's `attention_mask` on `device`: an empty ``[1, 1, 0, 0]`` boolean tensor.

    Transformers' mask builders return a 4-D `attention_mask` unchanged as a prepared mask, ahead of any
    look at `position_ids` or the attention implementation, so the packed forward builds no ``[T, T]`` mask
    and costs no host synchronisation (an empty tensor takes no memory and no copy). Only `packed_attention`
    receives it, and it ignores it on packed calls; any other consumer (sdpa, eager) fails on its shape
    rather than attending across sequences. Boolean, so that FSDP2's mixed precision leaves it alone.
    """
    return torch.empty((1, 1, 0, 0), dtype=torch.bool, device=device)


def packed_model_kwargs(mb: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of the base model's forward for a packed micro-batch: the restarting position ids,
    `no_mask` as `attention_mask` (no mask is built) and the boundaries, which travel to `packed_attention`."""
    ids = mb["input_ids"]
    return {
        "position_ids": mb["position_ids"],
        "attention_mask": no_mask(ids.device),
        "relay_packed": mb["packed"],
    }
