"""Bucket planning, packing and checksums, and the trainer's walk over a plan's buckets (`walk_buckets`,
every transport's sending side): torch alone, the same on every trainer rank and every receiver."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import torch

from app.weights.records import Bucket, PushPlan, PushStats, SyncError, TensorSpec, dtype_of
from app.weights.transport import Gather, Load

_dtype = dtype_of


def plan_buckets(
    specs: Iterable[tuple[str, tuple[int, ...], torch.dtype | str]], bucket_bytes: int, version: int
) -> PushPlan:
    """Pack tensors, in the given order, into flat buckets of one dtype and at most `bucket_bytes` each.

    A tensor larger than `bucket_bytes` gets a bucket of its own. The order is kept so that every trainer
    rank can gather in the same sequence.
    """
    buckets: list[Bucket] = []
    cur: list[TensorSpec] = []
    cur_dtype: str | None = None
    cur_numel = 0

    def close() -> None:
        nonlocal cur, cur_numel
        if cur:
            buckets.append(
                Bucket(index=len(buckets), dtype=cur_dtype or "float32", numel=cur_numel, tensors=tuple(cur))
            )
        cur, cur_numel = [], 0

    for name, shape, dtype in specs:
        dname = str(dtype).replace("torch.", "")
        spec = TensorSpec(name=name, shape=tuple(int(s) for s in shape), dtype=dname)
        itemsize = _dtype(dname).itemsize
        if cur and (dname != cur_dtype or (cur_numel + spec.numel) * itemsize > bucket_bytes):
            close()
        cur_dtype = dname
        cur.append(TensorSpec(name=name, shape=spec.shape, dtype=dname, offset=cur_numel))
        cur_numel += spec.numel
    close()
    return PushPlan(version=version, buckets=tuple(buckets))


_CK_COLS = 4096
_CK_MIX = 0x9E3779B97F4A7C15
_U64 = 0xFFFFFFFFFFFFFFFF


def checksum(flat: torch.Tensor) -> str:
    """Bit-level, position-sensitive checksum of a flat buffer, computed on its device.

    The buffer's bytes are read in place as int64 words (its last 0-7 bytes as extra small words), laid out
    as rows of 4096 words. Three int64 sums with wrap-around are kept: the plain sum, the sum weighted by row
    and the sum weighted by column (so a moved word changes one of them). Wrap-around addition is
    associative, so CPU and GPU reductions in any order agree bit for bit. Cost: two reads of the buffer
    (row and column sums), a few small kernels and one device sync; no int64 copy of the buffer is made.
    """
    return _ck_format(_checksum_sums(flat).tolist())


def _checksum_sums(flat: torch.Tensor) -> torch.Tensor:
    """`checksum`'s three sums as an int64 tensor on the buffer's device, without a device sync."""
    raw = flat.detach().contiguous().view(-1).view(torch.uint8)
    n8 = raw.numel() // 8
    head = raw[: n8 * 8]
    if head.storage_offset() % 8:  # an int64 view needs 8-byte alignment; the values do not depend on it
        head = head.clone()
    words = head.view(torch.int64)
    rows = n8 // _CK_COLS
    grid = words[: rows * _CK_COLS].view(rows, _CK_COLS)
    row_sums, col_sums = grid.sum(dim=1), grid.sum(dim=0)
    sums = torch.stack(
        [
            col_sums.sum(),
            (row_sums * _ramp(rows, raw.device)).sum(),
            (col_sums * _ramp(_CK_COLS, raw.device)).sum(),
        ]
    )
    if rows * _CK_COLS < n8 or n8 * 8 < raw.numel():  # a tail: words after the last full row, then bytes
        tail = torch.cat([words[rows * _CK_COLS :], raw[n8 * 8 :].to(torch.int64)])
        t = tail.sum()
        sums = sums + torch.stack([t, t * (rows + 1), (tail * _ramp(tail.numel(), raw.device)).sum()])
    return sums


@functools.lru_cache(maxsize=64)
def _ramp(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(1, n + 1, device=device, dtype=torch.int64)


def _ck_format(sums: list[int]) -> str:
    a, b, c = sums
    return f"{a & _U64:016x}{(b + c * _CK_MIX) & _U64:016x}"


def _ck_strings(sums: list[torch.Tensor]) -> list[str]:
    """Format the per-bucket sums of a whole push with one device sync."""
    return [_ck_format(v) for v in torch.stack(sums).tolist()] if sums else []


def unpack(bucket: Bucket, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of each tensor of `bucket` inside its received flat buffer."""
    return [(t.name, flat[t.offset : t.offset + t.numel].view(t.shape)) for t in bucket.tensors]


def device_ordered(load: Callable[..., None]) -> Callable[..., None]:
    """Mark a loader whose work is only queued on the current device stream (no host sync, no reference kept
    to what it is handed): a receiver may then hand it a bucket before the bucket has arrived, ordered after
    the bucket's broadcast on the device (`queues_on_device`)."""
    load.queues_on_device = True  # type: ignore[attr-defined]
    return load


def queues_on_device(load: Load) -> bool:
    """Whether `load` was marked `device_ordered` (a class attribute or a decorated function or method)."""
    return bool(getattr(load, "queues_on_device", False))


def load_bucket(load: Load, bucket: Bucket, flat: torch.Tensor) -> None:
    """Hand one received bucket to `load`: its flat buffer where the loader takes one (`load.flat`, see
    app/vllm/fast_load.py `SlotLoader`), else views of its tensors (`unpack`)."""
    fast = getattr(load, "flat", None)
    if fast is None or not fast(bucket, flat):
        load(unpack(bucket, flat))


def pack_into(bucket: Bucket, tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy `tensors` (any float dtype: cast on the way) into the bucket's flat buffer `out` with one batched
    copy where `out` is exactly the bucket (the tensors lie back to back), else one copy per tensor.

    The batched copy is `torch.cat` where no tensor needs a cast, else `torch._foreach_copy_` into `out`'s
    slices: with a cast (the trainer's fp32 master weights into a bf16 push) CUDA's `cat` falls back to one
    narrow and one copy per tensor (about 28 launches per 256 MiB bucket at 1.5B, more CPU time than the
    bucket's time on the link), where `_foreach_copy_` casts them all in a few multi-tensor launches."""
    if len(tensors) != len(bucket.tensors):
        raise ValueError(f"bucket {bucket.index} holds {len(bucket.tensors)} tensors, {len(tensors)} given")
    whole = sum(t.numel for t in bucket.tensors) == bucket.numel == out.numel()
    if whole and out.dim() == 1 and out.is_contiguous():
        flat = [t.reshape(-1) for t in tensors]
        if all(t.dtype == out.dtype for t in flat):
            torch.cat(flat, out=out)
        else:
            torch._foreach_copy_(list(out.split([t.numel() for t in flat])), flat)
        return out
    for spec, t in zip(bucket.tensors, tensors, strict=True):
        out[spec.offset : spec.offset + spec.numel].copy_(t.reshape(-1), non_blocking=True)
    return out


def iter_named_full(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for plain tensors and DTensors alike; gathering is a collective for DTensors."""
    for name, t in named:
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        yield name, full.detach()


class BucketSender(Protocol):
    """Rank 0's side of one transport's walk: how one gathered bucket travels."""

    def send(self, bucket: Bucket, tensors: list[torch.Tensor], stats: PushStats) -> torch.Tensor:
        """Pack and send one bucket (adding to `stats.pack_s`, `stats.transfer_s`); return its checksum sums
        (`_checksum_sums`). Raising stops the sending, never the walk's gathers."""
        ...

    def finish(self, stats: PushStats) -> None:
        """After the last bucket (also after a failure): wait for what is still in flight; raise its failure."""
        ...


def walk_buckets(plan: PushPlan, gather: Gather, sender: BucketSender | None, transport: str) -> PushStats:
    """Walk the plan's buckets on every trainer rank; the rank holding a `sender` (rank 0) sends each.

    `gather(names)` returns the full tensors of those names; on FSDP2 it is a collective, so every rank
    calls it for every bucket in the same order. Ranks without a sender discard what they gathered. The first
    failure of the sender stops the sending and is raised (as SyncError naming `transport`) only after the
    walk, so the other ranks are never left in a gather.
    """
    stats = PushStats(version=plan.version, nbytes=plan.nbytes, buckets=len(plan.buckets))
    t_start = time.perf_counter()
    error: BaseException | None = None
    sums: list[torch.Tensor] = []
    for bucket in plan.buckets:
        t0 = time.perf_counter()
        tensors = gather([t.name for t in bucket.tensors])
        stats.gather_s += time.perf_counter() - t0
        if sender is None or error is not None:
            continue
        try:
            sums.append(sender.send(bucket, tensors, stats))
        except Exception as e:  # keep walking: the other ranks are waiting in the gathers
            error = e
    if sender is not None:
        try:
            sender.finish(stats)
        except Exception as e:
            error = error or e
    stats.checksums = _ck_strings(sums) if error is None else []
    stats.total_s = time.perf_counter() - t_start
    if error is not None:
        raise SyncError(f"weight push v{plan.version} failed in the {transport}: {error}") from error
    return stats
