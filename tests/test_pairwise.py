"""The pairwise transport (app/weights/pairwise.py): trainer rank 0 pushes a real model's state to two receiver
processes, each over its own two-rank gloo group on the epoch's one TCPStore (as two vLLM engines sharing a
GPU would be reached over NCCL). Real process groups, real TCPStore; the receivers stand in for vLLM workers."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time

import torch

from app.config import load_config
from app.infra.resources import auto_transport, check_nccl_devices, memory_share
from app.weights.ack_board import post_worker_answer, worker_key
from app.weights.buckets import checksum, plan_buckets
from app.weights.group import free_port
from app.weights.records import GroupInfo, SyncError
from app.weights.transport import make_transport
from tests.test_sync import _state

RECEIVERS = (1, 2)


def _info(port: int, timeout_s: float) -> GroupInfo:
    return GroupInfo(
        epoch=3,
        host="127.0.0.1",
        port=port,
        world=1 + len(RECEIVERS),
        backend="gloo",
        timeout_s=timeout_s,
        ranks={f"r{r}": r for r in RECEIVERS},
        transport="pairwise",
    )


def _receiver(rank: int, port: int, go, plan_q, result_q, die_mid: bool, timeout_s: float) -> None:
    """One stand-in vLLM worker: joins as weight-group `rank`, receives one push, answers into the epoch's
    store under its rank (what `ack_board.answered` does in a worker) and reports what it got.

    It joins once `go` is set, when every receiver has started: on a loaded machine one spawned process can
    take longer to import torch than the group's timeout, which would fail the first one's join instead (a
    replica joins an epoch the trainer has just announced, never one announced before it started)."""
    torch.set_num_threads(1)
    receiver = make_transport("pairwise")
    result_q.put(("ready", rank))
    if not go.wait(120):
        raise TimeoutError("the test never let the receivers join")
    receiver.join(_info(port, timeout_s), rank, "cpu")
    plan = plan_q.get(timeout=120)
    got: dict[str, torch.Tensor] = {}

    def take(items) -> None:
        got.update({n: t.clone() for n, t in items})
        if die_mid:  # killed in the middle of the push, after its first bucket
            os._exit(3)

    try:
        cks, _ = receiver.receive(plan, take, "cpu")
    except Exception as e:  # the push failed for everyone: reported, under this receiver's deadline
        result_q.put(("failed", rank, repr(e)))
        receiver.close()
        return
    group = receiver.group
    post_worker_answer(group.store, 3, plan.version, group.rank, {"ok": True, "checksums": cks})
    result_q.put(("done", rank, cks, {n: checksum(t) for n, t in got.items()}))
    receiver.close()


def _push(timeout_s: float = 30.0, die_mid: int = 0):
    ctx = mp.get_context("spawn")
    result_q, port, go = ctx.Queue(), free_port(), ctx.Event()
    plan_qs = {r: ctx.Queue() for r in RECEIVERS}
    procs = {
        r: ctx.Process(
            target=_receiver, args=(r, port, go, plan_qs[r], result_q, r == die_mid, timeout_s), daemon=True
        )
        for r in RECEIVERS
    }
    for p in procs.values():
        p.start()
    sender = make_transport("pairwise")
    try:
        assert sorted(result_q.get(timeout=120)[1] for _ in RECEIVERS) == list(RECEIVERS)
        go.set()
        sender.open(_info(port, timeout_s), "cpu")
        state = _state(1)
        plan = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in state.items()], 2**18, version=9)
        assert len(plan.buckets) > 1
        for q in plan_qs.values():
            q.put(plan)
        t0 = time.monotonic()
        try:
            out = sender.send(plan, lambda names: [state[n] for n in names], "cpu")
        except SyncError as e:
            out = e
        dt = time.monotonic() - t0
        alive = [r for r in RECEIVERS if r != die_mid]
        done = {m[1]: m for m in (result_q.get(timeout=120) for _ in alive)}
        answers = {  # the workers' answers, read where the trainer reads them
            r: pickle.loads(sender.group.store.get(worker_key(3, 9, r)))
            for r in alive
            if done[r][0] == "done"
        }
        return out, dt, state, done, answers
    finally:
        sender.close()
        for p in procs.values():
            p.join(timeout_s + 15)
            if p.is_alive():
                p.kill()
                p.join()


def test_pairwise_push_reaches_every_receiver_bit_exact_and_answers_by_rank():
    stats, _, state, done, answers = _push()
    assert not isinstance(stats, Exception), stats
    want = {n: checksum(t) for n, t in state.items()}
    for r in RECEIVERS:
        _, rank, cks, per_tensor = done[r]
        assert rank == r and cks == stats.checksums and per_tensor == want
        assert answers[r] == {"ok": True, "checksums": stats.checksums}  # keyed by its weight-group rank
    assert stats.nbytes == sum(t.numel() * 4 for t in state.values())


def test_a_receiver_killed_mid_push_fails_the_push_within_its_deadline_naming_its_rank():
    """As with one group: the trainer stops the walk at the failure (the push fails and the epoch is formed
    again without the dead replica), so the survivor's receive fails too, under its own deadline."""
    err, dt, _, done, answers = _push(timeout_s=5.0, die_mid=2)
    assert isinstance(err, SyncError) and "rank 2" in str(err), err
    assert dt < 5.0 + 5
    assert done[1][0] == "failed" and not answers


def test_auto_picks_pairwise_for_replicas_sharing_a_rollout_gpu():
    two = {"CPU": 32, "GPU": 2}
    shared = ["rollout.replica_gpus=0.5", "rollout.max_replicas=2", "train.use_gpu=true"]
    cfg = load_config(None, shared)
    assert auto_transport(cfg, two) == "pairwise"
    check_nccl_devices(cfg, "pairwise")
    # their vLLM memory shares leave room for the engines' CUDA contexts and the pushes: 0.8 of each half
    assert memory_share(cfg.rollout) == 0.4
    assert (
        auto_transport(load_config(None, ["rollout.replica_gpus=1", "train.use_gpu=true"]), two)
        == "broadcast"
    )
    assert auto_transport(load_config(None, [*shared, "sync.backend=gloo"]), two) == "broadcast"
    assert auto_transport(cfg, {"CPU": 16, "GPU": 1}) == "ipc"  # trainer and replicas on the one GPU
