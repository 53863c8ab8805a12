"""app/vllm/start_lock.py: one engine start per GPU at a time, across processes, with a deadline naming the
holder; released by the kernel when the holder dies."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from app.vllm.start_lock import engine_start_lock, lock_path

DEVICES = f"test-{os.getpid()}"


def _hold(devices: str, held, release) -> None:
    with engine_start_lock(30.0, devices):
        held.set()
        release.wait(60)


def test_a_second_start_waits_for_the_first_then_names_it_past_its_deadline():
    ctx = mp.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(DEVICES, held, release), daemon=True)
    holder.start()
    try:
        assert held.wait(60)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=f"pid {holder.pid}"), engine_start_lock(0.5, DEVICES):
            pass
        assert 0.5 <= time.monotonic() - t0 < 10
        release.set()
        with engine_start_lock(30.0, DEVICES) as waited:  # free once the first start is done
            assert waited < 30
    finally:
        release.set()
        holder.join(30)
        if holder.is_alive():
            holder.kill()
            holder.join()
    lock_path(DEVICES).unlink(missing_ok=True)


def test_a_dead_holder_frees_the_lock():
    ctx = mp.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(DEVICES + "d", held, release), daemon=True)
    holder.start()
    assert held.wait(60)
    holder.kill()  # SIGKILL mid-start: no cleanup runs in it
    holder.join(30)
    with engine_start_lock(10.0, DEVICES + "d") as waited:
        assert waited < 10
    lock_path(DEVICES + "d").unlink(missing_ok=True)
