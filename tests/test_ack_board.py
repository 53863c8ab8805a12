"""Acknowledgements through the weight group's store (app/weights/ack_board.py), on a real TCPStore: the
trainer hosts it, each replica posts with its own client, and the hub's answer takes over where the store
has not every answer."""

from __future__ import annotations

import gc
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from app.weights import ack_board
from app.weights.ack_board import AckPoster, ack_key, collect
from app.weights.group import free_port
from app.weights.records import Ack


@pytest.fixture
def store():
    port = free_port()
    master = dist.TCPStore(
        "127.0.0.1", port, world_size=2, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False
    )
    yield master, port


def test_every_replicas_answer_comes_back_whole_and_leaves_no_key(store):
    master, port = store
    acks = {
        "r0": Ack(ok=True, checksums=["ab" * 16], detail={"held_s": 0.01, "join_s": 2.5}),
        "r1": Ack(ok=False, error="receive of version 3 failed: peer gone"),
    }
    for rid, ack in acks.items():  # each replica with its own client, as each replica process has
        AckPoster("127.0.0.1", port, epoch=4, timeout_s=10).post(3, rid, ack)
    got = collect(master, 4, 3, ["r0", "r1"], time.monotonic() + 10, lambda: pytest.fail("hub asked"))
    assert got == acks
    assert not master.check([ack_key(4, 3, "r0")]) and not master.check([ack_key(4, 3, "r1")])


def test_the_wait_ends_when_the_last_answer_lands_not_at_a_slice(store, monkeypatch):
    master, port = store
    monkeypatch.setattr(ack_board, "SLICE_S", 5.0)
    poster = AckPoster("127.0.0.1", port, epoch=1, timeout_s=10)
    timer = threading.Timer(0.3, poster.post, args=(7, "r0", Ack(ok=True, checksums=[])))
    timer.start()
    t0 = time.monotonic()
    got = collect(master, 1, 7, ["r0"], time.monotonic() + 10, lambda: False)
    took = time.monotonic() - t0
    timer.join()
    assert got is not None and got["r0"].ok and 0.25 < took < 4.0


def test_an_answer_of_another_epoch_or_version_does_not_count(store, monkeypatch):
    master, port = store
    monkeypatch.setattr(ack_board, "SLICE_S", 0.2)
    AckPoster("127.0.0.1", port, epoch=1, timeout_s=10).post(7, "r0", Ack(ok=True))  # the old epoch
    AckPoster("127.0.0.1", port, epoch=2, timeout_s=10).post(6, "r0", Ack(ok=True))  # the last version
    assert collect(master, 2, 7, ["r0"], time.monotonic() + 0.5, lambda: False) is None


def test_the_hubs_answer_takes_over_after_a_slice_where_a_replica_is_silent(store, monkeypatch):
    master, port = store
    monkeypatch.setattr(ack_board, "SLICE_S", 0.2)
    AckPoster("127.0.0.1", port, epoch=1, timeout_s=10).post(5, "r0", Ack(ok=True))
    asked = []
    t0 = time.monotonic()
    got = collect(master, 1, 5, ["r0", "dead"], time.monotonic() + 30, lambda: asked.append(1) or True)
    assert got is None and asked == [1] and time.monotonic() - t0 < 5  # one slice, not the deadline
    assert master.check([ack_key(1, 5, "r0")])  # left for nobody: the epoch's store goes with the epoch


def test_a_store_that_is_gone_hands_over_to_the_hub():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=5), wait_for_workers=False)
    client = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False
    )
    del master  # the trainer's end closes: its server goes with it
    gc.collect()
    t0 = time.monotonic()
    assert collect(client, 1, 1, ["r0"], time.monotonic() + 10, lambda: False) is None
    assert time.monotonic() - t0 < 5


def _answer(checksums: list[str], receive_s: float = 0.01) -> dict:
    return {"ok": True, "checksums": checksums, "transfer_s": 0.004, "load_s": 0.002, "receive_s": receive_s}


def test_each_workers_answer_comes_back_under_its_rank_and_makes_its_replicas(store):
    """Workers answer under their weight-group rank; the trainer makes each replica's answer of its workers'
    (two tensor-parallel workers for r0, one for r1) and removes every key."""
    master, port = store
    client = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False
    )
    for rank, answer in {1: _answer(["aa"], 0.02), 2: _answer(["aa"]), 3: _answer(["bb"])}.items():
        ack_board.post_worker_answer(client, 5, 9, rank, answer)
    keys = {r: ack_board.worker_key(5, 9, r) for r in (1, 2, 3)}
    answers = ack_board.collect_keys(master, keys, 9, time.monotonic() + 10, lambda: pytest.fail("hub"))
    acks = ack_board.replica_acks({"r0": [1, 2], "r1": [3]}, answers, 9)
    assert acks["r0"].ok and acks["r0"].checksums == ["aa"] and acks["r1"].checksums == ["bb"]
    assert acks["r0"].detail == {
        "store": True,
        "by": "workers",
        "transfer_s": 0.004,
        "load_s": 0.002,
        "worker_s": 0.02,  # the slowest worker's
    }
    assert not any(master.check([k]) for k in keys.values())


def test_a_replica_fails_where_a_worker_failed_or_its_workers_received_other_bytes():
    acks = ack_board.replica_acks(
        {"r0": [1, 2], "r1": [3, 4]},
        {
            1: _answer(["aa"]),
            2: {"ok": False, "error": "NCCL timeout"},
            3: _answer(["aa"]),
            4: _answer(["ab"]),
        },
        7,
    )
    assert not acks["r0"].ok and "worker rank 2: NCCL timeout" in acks["r0"].error
    assert not acks["r1"].ok and "worker 1 received other bytes" in acks["r1"].error


def test_the_replica_posts_what_its_workers_did_not(store):
    """A worker whose post failed: the replica posts its result for it; a load that failed before the
    workers answered: the replica posts the failure for every worker, so the trainer need not wait for the hub."""
    master, port = store
    poster = AckPoster("127.0.0.1", port, epoch=2, timeout_s=10)
    ok = Ack(ok=True, checksums=["cc"])
    poster.post_workers(
        4, [1, 2], ok, [{**_answer(["cc"]), "posted": True}, {**_answer(["cc"]), "posted": False}]
    )
    assert not master.check([ack_board.worker_key(2, 4, 1)])  # posted by the worker itself: left alone
    keys = {2: ack_board.worker_key(2, 4, 2)}
    got = ack_board.collect_keys(master, keys, 4, time.monotonic() + 5, lambda: False)
    assert got[2]["ok"] and got[2]["checksums"] == ["cc"]
    poster.post_workers(5, [1, 2], Ack(ok=False, error="pause failed: engine dead"), None)
    keys = {r: ack_board.worker_key(2, 5, r) for r in (1, 2)}
    got = ack_board.collect_keys(master, keys, 5, time.monotonic() + 5, lambda: False)
    acks = ack_board.replica_acks({"r0": [1, 2]}, got, 5)
    assert not acks["r0"].ok and "pause failed: engine dead" in acks["r0"].error


def test_a_vllm_worker_answers_into_its_groups_store_before_returning(store):
    """`answered` (a vLLM worker's load) on a real store client: the answer of a load is in the store before
    the call returns; a load that raises posts its error, then raises it."""
    master, port = store
    client = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False
    )
    seen = []

    def load() -> dict:
        seen.append(master.check([ack_board.worker_key(6, 2, 3)]))  # not before the load is done
        return {**_answer(["dd"]), "load": "slots"}

    res = ack_board.answered(client, 3, 6, 2, load)
    assert res["posted"] and res["load"] == "slots" and seen == [False]
    got = ack_board.collect_keys(master, {3: ack_board.worker_key(6, 2, 3)}, 2, time.monotonic() + 5, bool)
    assert got[3] == _answer(["dd"])

    def broken() -> dict:
        raise RuntimeError("bucket 3 never arrived")

    with pytest.raises(RuntimeError, match="never arrived"):
        ack_board.answered(client, 3, 6, 3, broken)
    got = ack_board.collect_keys(master, {3: ack_board.worker_key(6, 3, 3)}, 3, time.monotonic() + 5, bool)
    assert got[3] == {"ok": False, "error": "bucket 3 never arrived"}


def test_a_worker_whose_post_fails_keeps_its_load():
    """A store that refuses the write (a TCPStore's set to a dead server can even look fine, so the refusal is
    made here): the load's result stands, marked not posted, and the replica then posts it."""

    class Refusing:
        def set(self, key: str, value: bytes) -> None:
            raise ConnectionResetError("store gone")

    res = ack_board.answered(Refusing(), 1, 1, 1, lambda: _answer(["ee"]))
    assert res["posted"] is False and res["checksums"] == ["ee"]
