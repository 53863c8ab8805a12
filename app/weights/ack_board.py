"""Push acknowledgements through the weight group's own store: the replicas' short way back to the trainer.

A push is acknowledged twice: first into the TCPStore that trainer rank 0 hosts for the epoch (the weight
group's, `StatelessGroup.store`), then by the replica to the hub, which keeps membership and versions. The
trainer waits on the store, one round trip after the last key is set, where the hub's answer costs two Ray
actor calls more (replica -> hub -> trainer: about 2 ms on a 2-core machine, `bench/hub_roundtrip.py`).

Into the store, where every worker of every replica reached it at the join (`worker_key`), each vLLM worker
posts its own answer as soon as its last bucket is loaded and checksummed, through the client its weight group
already holds: the reply of the workers' call to their engine, the version and the resume then follow off the
trainer's path (they took about 3 ms of a 1.5B push on an H200). Generation resumes only after the version is
set, so every token sampled after the acknowledgement still carries the new version. `replica_acks` makes
each replica's answer of its workers'. Elsewhere (LoRA: the engine adds the adapter after the workers wrote
it) the replica posts its answer itself (`AckPoster`, `ack_key`).

The hub stays the authority: the trainer waits on the store in short slices and, between them, takes the hub's
answer as soon as there is one (a replica dropped because its engine died is not waited for there), and at the
deadline the hub's answer decides. A replica that cannot reach the store acknowledges to the hub alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from app.weights.records import Ack, GroupInfo

log = logging.getLogger("app.sync")

SLICE_S = 2.0  # how long one wait on the store lasts before the hub is asked whether it already answered
POSTER_CONNECT_S = 2.0  # a replica's connection to the epoch's store for its acknowledgements, at most


def ack_key(epoch: int, version: int, replica_id: str) -> str:
    return f"relay-acks/{epoch}/{version}/{replica_id}"


def worker_key(epoch: int, version: int, rank: int) -> str:
    """The key of the answer of the worker at weight-group rank `rank` to push `version` of `epoch`."""
    return f"relay-acks/{epoch}/{version}/rank{rank}"


def post_worker_answer(store: Any, epoch: int, version: int, rank: int, answer: dict[str, Any]) -> None:
    """A vLLM worker's answer to one push into the epoch's store: {"ok", "checksums" or "error", its
    "transfer_s", "load_s" and "receive_s"}."""
    store.set(worker_key(epoch, version, rank), pickle.dumps(answer))


def loaded_answer(result: dict[str, Any]) -> dict[str, Any]:
    """A worker's answer to a load that came back (`relay_receive`'s result): its checksums and timings."""
    return {"ok": True, "checksums": result["checksums"], **{k: result.get(k, 0.0) for k in TIMINGS}}


TIMINGS = ("transfer_s", "load_s", "receive_s")


def answered(
    store: Any, rank: int, epoch: int, version: int, receive: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """A vLLM worker's load of push `version` (`receive`), its answer posted into the epoch's `store` under
    its weight-group `rank` the moment it is known, before the call's reply travels back through the engine:
    {"ok", "checksums" or "error", timings}. Returns `receive`'s result with "posted": whether the answer is in
    the store (a failed post is logged; the replica then posts it). A load that raises posts its error, then
    raises it."""
    try:
        res = receive()
    except Exception as e:
        with contextlib.suppress(Exception):  # the error itself is what the caller sees
            post_worker_answer(store, epoch, version, rank, {"ok": False, "error": f"{e}"})
        raise
    answer = loaded_answer(res)
    try:
        post_worker_answer(store, epoch, version, rank, answer)
    except Exception as e:
        log.warning("worker rank %d: answering v%d into the store failed: %r", rank, version, e)
        return {**res, "posted": False}
    return {**res, "posted": True}


def slowest_worker(results: list[dict[str, Any]]) -> dict[str, float]:
    """A replica's worker phases from its workers' load results: the slowest worker's transfer, load and
    whole receive (`worker_s`)."""
    return {
        "transfer_s": max(float(r["transfer_s"]) for r in results),
        "load_s": max(float(r["load_s"]) for r in results),
        "worker_s": max(float(r["receive_s"]) for r in results),
    }


def agreed_checksums(results: list[dict[str, Any]], replica_id: str, version: int) -> list[str]:
    """The per-bucket checksums every worker of a replica received (tensor-parallel workers each receive the
    whole push); a worker that received other bytes fails the push, naming it and the buckets."""
    first = list(results[0]["checksums"])
    for rank, r in enumerate(results[1:], start=1):
        got = list(r["checksums"])
        if got != first:
            bad = [i for i in range(max(len(got), len(first))) if got[i : i + 1] != first[i : i + 1]]
            raise RuntimeError(
                f"replica {replica_id}: worker {rank} received other bytes than worker 0 for version {version} "
                f"(buckets {bad[:4]})"
            )
    return first


def replica_acks(
    workers: dict[str, list[int]], answers: dict[int, dict[str, Any]], version: int
) -> dict[str, Ack]:
    """Each replica's answer to push `version` made of its workers' (`workers`: replica id -> the weight-group
    ranks of its workers; `answers`: rank -> that worker's answer): failed where a worker failed or the
    workers received different bytes; the detail holds the slowest worker's transfer, load and receive."""
    out = {}
    for rid, ranks in workers.items():
        mine = [answers[r] for r in ranks]
        failed = [
            f"worker rank {r}: {a.get('error')}" for r, a in zip(ranks, mine, strict=True) if not a["ok"]
        ]
        if failed:
            out[rid] = Ack(ok=False, error=f"receive of version {version} failed: {'; '.join(failed)}")
            continue
        try:
            checksums = agreed_checksums(mine, rid, version)
        except RuntimeError as e:
            out[rid] = Ack(ok=False, error=str(e))
            continue
        detail = {"store": True, "by": "workers", **slowest_worker(mine)}
        out[rid] = Ack(ok=True, checksums=checksums, detail=detail)
    return out


class AckPoster:
    """A replica's client of the epoch's store (host, port of `GroupInfo`); `post` writes one push's answer."""

    def __init__(self, host: str, port: int, epoch: int, timeout_s: float) -> None:
        import torch.distributed as dist

        self.epoch = epoch
        self.store = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )

    def post(self, version: int, replica_id: str, ack: Ack) -> None:
        self.store.set(ack_key(self.epoch, version, replica_id), pickle.dumps(ack))

    def post_workers(
        self, version: int, ranks: list[int], ack: Ack, results: list[dict[str, Any]] | None
    ) -> None:
        """The answers of a replica's workers (at `ranks`) that they did not post themselves: each one's
        result where the load came back (`results`, in rank order), else the replica's failure `ack`."""
        for i, rank in enumerate(ranks):
            r = results[i] if results is not None and ack.ok else None
            if r is not None and r.get("posted"):
                continue
            answer = (
                loaded_answer(r)
                if r is not None
                else {"ok": False, "error": ack.error or "no answer from the worker"}
            )
            post_worker_answer(self.store, self.epoch, version, rank, answer)

    @classmethod
    async def connect(cls, g: GroupInfo, replica_id: str) -> AckPoster | None:
        """A client of epoch `g`'s store for replica `replica_id`'s acknowledgements; None (the hub alone) where
        the trainer's store cannot be reached from here within `POSTER_CONNECT_S` (the workers have just joined
        through it, so a healthy connection takes milliseconds; the weights loop must not wait longer)."""
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(cls, g.host, g.port, g.epoch, g.timeout_s), timeout=POSTER_CONNECT_S
            )
        except Exception as e:
            log.warning(
                "replica %s: the weight group's store at %s:%d is unreachable (%s); acknowledging through the hub "
                "alone",
                replica_id,
                g.host,
                g.port,
                f"no connection within {POSTER_CONNECT_S:.0f}s"
                if isinstance(e, asyncio.TimeoutError)
                else repr(e),
            )
            return None

    async def answer(
        self,
        version: int,
        replica_id: str,
        ack: Ack,
        worker_ranks: list[int],
        results: list[dict[str, Any]] | None,
        timeout_s: float,
    ) -> bool:
        """Replica `replica_id`'s answer `ack` to push `version`, within `timeout_s`: where its workers (at
        `worker_ranks`) answer themselves, only what they did not post (every worker's failure where the load
        failed before their answers, a post that failed). False where the post failed (logged)."""
        post: Any = functools.partial(self.post, version, replica_id, ack)
        if worker_ranks:
            if results is not None and all(r.get("posted") for r in results):
                return True  # the trainer has every answer already
            post = functools.partial(self.post_workers, version, worker_ranks, ack, results)
        try:
            await asyncio.wait_for(asyncio.to_thread(post), timeout=timeout_s)
        except Exception as e:
            log.warning("replica %s: acknowledging v%d into the store failed: %r", replica_id, version, e)
            return False
        return True


def collect(
    store: Any,
    epoch: int,
    version: int,
    replicas: list[str],
    deadline: float,
    hub_answered: Callable[[], bool],
) -> dict[str, Ack] | None:
    """Every replica's answer to push `version` of `epoch` from `store`, or None where the hub answered first
    or `deadline` (time.monotonic) passed without every answer: then the caller takes the hub's."""
    keys = {rid: ack_key(epoch, version, rid) for rid in replicas}
    return collect_keys(store, keys, version, deadline, hub_answered)


def collect_keys(
    store: Any, keys: dict[Any, str], version: int, deadline: float, hub_answered: Callable[[], bool]
) -> dict[Any, Any] | None:
    """The answers under `keys` (label -> store key) of push `version`, by label, each read once and removed;
    None where the hub answered first or `deadline` (time.monotonic) passed without every answer.

    Waits in slices of `SLICE_S` (no polling: each slice returns as soon as the last key is set) and asks
    `hub_answered()` between them."""
    labels, names = list(keys), list(keys.values())
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            store.wait(names, timedelta(seconds=min(SLICE_S, left)))
            break
        except Exception as e:  # a slice ran out (DistStoreError "wait timeout"), or the store is gone
            if "timeout" not in str(e).lower():
                log.warning(
                    "weight group store: acknowledgements of v%d unreadable (%s); asking the hub", version, e
                )
                return None
        if hub_answered():  # asked only after a slice ran out: the common case pays nothing for it
            return None
    got = {}
    for label, key in zip(labels, names, strict=True):
        got[label] = pickle.loads(store.get(key))
        store.delete_key(key)
    return got
