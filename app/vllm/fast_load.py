"""A direct weight load for unsharded, unquantized engines: every pushed tensor copied straight into its place.

vLLM's `model.load_weights` walks the pushed tensors one by one through each parameter's `weight_loader`
(name matching, packing q/k/v into `qkv_proj`, gate/up into `gate_up_proj`): about 20 ms of Python for a
1.5B model, most of a push on one GPU. Where the engine keeps each parameter whole (tensor parallel size 1,
no quantization), a packed parameter is exactly its parts stacked along the first dimension in the order of
the model's `packed_modules_mapping`. `plan_slots` works out, once per set of pushed names, where every
tensor lands; `copy_into` then loads a bucket with one batched copy. Anything it cannot place (a padded
vocabulary, a sharded or repacked parameter, an unknown name) makes `plan_slots` return None, and the caller
loads through `load_weights` as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Slot:
    """Rows `start:start + rows` of engine parameter `param` (dimension 0)."""

    param: str
    start: int
    rows: int


def _packed_place(
    name: str,
    shapes: Mapping[str, tuple[int, ...]],
    params: Mapping[str, tuple[int, ...]],
    packed: Mapping[str, Sequence[str]],
) -> Slot | None:
    """The slot of `name` inside a packed parameter, or None when it is not a part of one."""
    parts = name.split(".")
    for packed_name, subs in packed.items():
        for i, sub in enumerate(subs):
            if sub not in parts[:-1]:
                continue
            at = parts.index(sub)

            def renamed(new: str, at: int = at) -> str:
                return ".".join([*parts[:at], new, *parts[at + 1 :]])

            target = renamed(packed_name)
            siblings = [renamed(s) for s in subs]
            if target not in params or any(s not in shapes for s in siblings):
                return None
            rows = [shapes[s][0] for s in siblings]
            whole = params[target]
            if sum(rows) != whole[0] or any(tuple(shapes[s][1:]) != tuple(whole[1:]) for s in siblings):
                return None  # sharded, padded or repacked: not a plain stack of its parts
            return Slot(target, sum(rows[:i]), rows[i])
    return None


def plan_slots(
    shapes: Mapping[str, tuple[int, ...]],
    params: Mapping[str, tuple[int, ...]],
    packed: Mapping[str, Sequence[str]],
    skip: Sequence[str] = (),
) -> dict[str, Slot | None] | None:
    """Where each pushed tensor (`shapes`: name -> shape) lands among the engine's `params` (name -> shape).

    A name the engine has with the same shape goes there whole; a part of a packed parameter goes to its
    rows; a name starting with one of `skip` is not loaded (None: e.g. `lm_head.` under tied embeddings).
    Returns None when any tensor has no place, or when some engine parameter would be left unloaded."""
    slots: dict[str, Slot | None] = {}
    for name, shape in shapes.items():
        if any(name.startswith(p) for p in skip):
            slots[name] = None
        elif tuple(params.get(name, ())) == tuple(shape) and shape:
            slots[name] = Slot(name, 0, shape[0])
        else:
            slot = _packed_place(name, shapes, params, packed)
            if slot is None:
                return None
            slots[name] = slot
    covered: dict[str, int] = {}
    for s in slots.values():
        if s is not None:
            covered[s.param] = covered.get(s.param, 0) + s.rows
    if any(covered.get(p, 0) != shape[0] for p, shape in params.items() if shape):
        return None  # a parameter the push does not fill: let load_weights decide what that means
    return slots


def copy_into(
    params: Mapping[str, torch.Tensor],
    slots: Mapping[str, Slot | None],
    items: Sequence[tuple[str, torch.Tensor]],
) -> None:
    """Copy one bucket's tensors into their slots (one batched copy per dtype pair)."""
    dsts, srcs = [], []
    for name, t in items:
        slot = slots[name]
        if slot is None:
            continue
        dst = params[slot.param].data.narrow(0, slot.start, slot.rows)
        dsts.append(dst)
        srcs.append(t if t.dtype == dst.dtype else t.to(dst.dtype))
    if dsts:
        torch._foreach_copy_(dsts, srcs)


class SlotLoader:
    """`copy_into` for one engine's parameters, with each bucket's copy worked out on its first load: later
    loads of that bucket are one split of the received flat buffer and one batched copy (`flat`), where the
    per-tensor way costs two view ops per tensor in Python (about a third of the receiver's time per bucket at
    1.5B, more than the bucket's time on the link). Called with (name, tensor) items it is `copy_into`."""

    queues_on_device = True  # copies only (app/weights/buckets.py `device_ordered`): a receiver need not wait

    def __init__(self, params: Mapping[str, torch.Tensor], slots: Mapping[str, Slot | None]) -> None:
        self.params, self.slots = params, slots
        # id(bucket) -> (bucket, split sizes, indices of the loaded parts, their flat destinations, and each
        # destination parameter with its storage address when worked out); sizes None where the bucket cannot
        # load that way (a dtype cast, tensors not back to back)
        self._buckets: dict[int, Any] = {}

    def __call__(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        copy_into(self.params, self.slots, items)

    def flat(self, bucket: Any, flat: torch.Tensor) -> bool:
        """Load bucket `bucket` (app/weights/records.py `Bucket`) from its received flat buffer; False where it
        must go through (name, tensor) items instead."""
        hit = self._buckets.get(id(bucket))
        if hit is None or hit[0] is not bucket or _moved(hit[4]):  # a parameter's storage was replaced
            hit = self._buckets[id(bucket)] = self._plan(bucket, flat.dtype)
        _, sizes, keep, dsts, _ = hit
        if sizes is None:
            return False
        if dsts:  # (a bucket of skipped tensors alone, a tied lm_head, loads nothing)
            parts = (flat if flat.numel() == bucket.numel else flat[: bucket.numel]).split(sizes)
            torch._foreach_copy_(dsts, [parts[i] for i in keep])
        return True

    def _plan(self, bucket: Any, dtype: torch.dtype) -> Any:
        sizes, keep, dsts, held, at = [], [], [], {}, 0
        for i, t in enumerate(bucket.tensors):
            if t.offset != at:
                return bucket, None, None, None, []
            at += t.numel
            sizes.append(t.numel)
            slot = self.slots[t.name]
            if slot is None:
                continue
            param = self.params[slot.param]
            held[slot.param] = (param, param.data_ptr())
            dst = param.data.narrow(0, slot.start, slot.rows)
            if dst.dtype != dtype or not dst.is_contiguous() or dst.numel() != t.numel:
                return bucket, None, None, None, []
            keep.append(i)
            dsts.append(dst.view(-1))
        if at != bucket.numel:
            sizes.append(bucket.numel - at)  # padding after the last tensor: split off, never copied
        return bucket, sizes, keep, dsts, list(held.values())


def _moved(held: list[tuple[torch.Tensor, int]]) -> bool:
    """Whether any parameter's storage moved since its destinations were worked out (`param.data` replaced)."""
    return any(p.data_ptr() != ptr for p, ptr in held)
