"""The staged receive (app/weights/staging.py, `sync.staged_receive`): a push received in a thread while the
engine's thread keeps working, then copied into the model; checksums and bytes as in a paused receive."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import select
import socket
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from app.weights.buckets import checksum, plan_buckets
from app.weights.group import free_port
from app.weights.records import SyncError, dtype_of
from app.weights.staging import StagedPush, stage_notices
from app.weights.transport import make_transport
from tests.test_sync import _group, _state

ENGINE_STEPS = 20  # engine steps the receiver makes while its staged receive waits for the bytes


def _staged_receiver(port: int, plan_q, result_q, go_q) -> None:
    """A stand-in for one vLLM worker (the engine thread is a matmul loop): stage the push in a thread, keep
    stepping until the thread's notice arrives on a Unix socket, then load the staged tensors into a model."""
    torch.set_num_threads(1)
    receiver = make_transport("broadcast")
    result_q.put("ready")
    receiver.join(_group(port, 10.0, "broadcast"), 1, "cpu")
    plan = plan_q.get(timeout=120)
    path = str(Path(tempfile.mkdtemp()) / "s")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    stage = StagedPush(receiver, plan, torch.device("cpu"), {})
    stage.start(path)
    x, steps = torch.randn(64, 64), 0
    while not select.select([listener], [], [], 0)[0]:  # the engine's loop: it never waits for the push
        x = torch.tanh(x @ x)
        steps += 1
        if steps == ENGINE_STEPS:
            go_q.put(steps)  # the sender starts only now: the bytes were not there during these steps
    notice = listener.accept()[0].makefile().readline()
    model = {t.name: torch.zeros(t.shape, dtype=dtype_of(t.dtype)) for b in plan.buckets for t in b.tensors}
    loaded = []

    def load(items) -> None:
        loaded.append([n for n, _ in items])
        for n, t in items:
            model[n].copy_(t)

    res = stage.load(load, timeout_s=10)
    result_q.put(
        {
            "notice": notice,
            "steps": steps,
            "checksums": res["checksums"],
            "per_tensor": {n: checksum(t) for n, t in model.items()},
            "loaded": loaded,
        }
    )
    receiver.close()


def test_staged_receive_runs_beside_the_engine_and_loads_the_pushed_bytes():
    ctx = mp.get_context("spawn")
    plan_q, result_q, go_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=_staged_receiver, args=(port, plan_q, result_q, go_q), daemon=True)
    proc.start()
    try:
        assert result_q.get(timeout=120) == "ready"
        sender = make_transport("broadcast")
        sender.open(_group(port, 10.0, "broadcast"), "cpu")
        state = _state(2)
        plan = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in state.items()], 2**18, version=3)
        assert len(plan.buckets) > 1
        plan_q.put(plan)
        assert go_q.get(timeout=120) == ENGINE_STEPS  # the engine stepped while the receive waited
        try:
            stats = sender.send(plan, lambda names: [state[n] for n in names], "cpu")
        finally:
            sender.close()
        got = result_q.get(timeout=120)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert '"ok": true' in got["notice"]
    assert got["steps"] >= ENGINE_STEPS
    assert got["checksums"] == stats.checksums  # what the trainer acknowledges against
    assert got["per_tensor"] == {n: checksum(t) for n, t in state.items()}  # the model holds the pushed bytes
    assert got["loaded"] == [[t.name for t in b.tensors] for b in plan.buckets]  # bucket by bucket, in order


class _FailingTransport:
    def receive(self, plan, load, device):
        raise RuntimeError("peer gone")


def test_a_failed_staged_receive_is_told_to_the_replica_and_refuses_to_load():
    plan = plan_buckets([("w", (4,), torch.float32)], 2**10, version=5)

    async def run() -> str:
        async with stage_notices(1) as notices:
            stage = StagedPush(_FailingTransport(), plan, torch.device("cpu"), {})
            await asyncio.to_thread(stage.start, notices.path)
            with pytest.raises(SyncError, match="v5 failed: peer gone") as e:
                await notices.wait(10, "replica r, push of v5")
            with pytest.raises(SyncError, match="peer gone"):
                stage.load(lambda items: None, timeout_s=1)
            return str(e.value)

    assert asyncio.run(run()).startswith("replica r, push of v5")


def test_stage_notices_fail_on_the_deadline_naming_the_workers_missing():
    async def run() -> None:
        async with stage_notices(2) as notices:
            done = threading.Event()

            def one_worker() -> None:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(notices.path)
                s.sendall(b'{"ok": true}\n')
                s.close()
                done.set()

            threading.Thread(target=one_worker).start()
            with pytest.raises(SyncError, match="1 of 2 workers finished the staged receive within 1s"):
                await notices.wait(1.0, "replica r")
            assert done.is_set()

    asyncio.run(run())
