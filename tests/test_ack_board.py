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
