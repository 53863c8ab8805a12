"""The weight-sync transport with torch alone: planning, checksums, the hub, and a real two-process push."""

import asyncio
import multiprocessing as mp
import os
import time

import pytest
import torch

from app import tiny
from app.sync import (
    StatelessGroup,
    SyncError,
    WeightHub,
    check_acks,
    checksum,
    free_port,
    plan_buckets,
    receive_buckets,
    send_buckets,
    unpack,
)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny.model_config(32))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_plan_buckets_respects_size_and_dtype():
    specs = [
        ("a", (10,), torch.float32),
        ("b", (10,), torch.float32),
        ("c", (100,), torch.float32),
        ("d", (4,), torch.bfloat16),
        ("e", (3,), torch.float32),
    ]
    plan = plan_buckets(specs, bucket_bytes=100, version=3)
    assert plan.version == 3
    layout = [[t.name for t in b.tensors] for b in plan.buckets]
    assert layout == [["a", "b"], ["c"], ["d"], ["e"]]  # 80 B fit, c is oversize alone, dtype change splits
    assert [t.offset for t in plan.buckets[0].tensors] == [0, 10]
    assert plan.nbytes == (10 + 10 + 100 + 3) * 4 + 4 * 2


def test_checksum_is_bit_exact_and_position_sensitive():
    x = torch.randn(1000)
    assert checksum(x) == checksum(x.clone())
    y = x.clone()
    y[[3, 4]] = y[[4, 3]]
    assert checksum(y) != checksum(x)
    z = x.clone()
    z[500] = torch.nextafter(z[500], torch.tensor(1e9))  # one ulp
    assert checksum(z) != checksum(x)
    assert checksum(torch.ones(3, dtype=torch.bfloat16)) != checksum(torch.ones(3, dtype=torch.bfloat16) * 2)


def test_pack_unpack_roundtrip():
    state = _state()
    plan = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in state.items()], 2**16, 1)
    seen = {}
    for b in plan.buckets:
        flat = torch.empty(b.numel)
        for spec in b.tensors:
            flat[spec.offset : spec.offset + spec.numel] = state[spec.name].reshape(-1)
        seen.update(dict(unpack(b, flat)))
    assert set(seen) == set(state)
    assert all(torch.equal(seen[n], state[n]) for n in state)


# ------------------------------------------------------------------ two processes over gloo


def _receiver(port: int, version_q, result_q, mode: str, timeout_s: float) -> None:
    torch.set_num_threads(1)
    group = StatelessGroup("127.0.0.1", port, 1, 2, "gloo", timeout_s)
    plan = version_q.get(timeout=30)
    if mode == "die":
        os._exit(3)
    if mode == "stall":
        time.sleep(timeout_s + 10)
        return
    received: dict[str, torch.Tensor] = {}

    def take(items) -> None:
        received.update({n: t.clone() for n, t in items})
        if mode == "die_mid":  # killed in the middle of the push, after its first bucket
            os._exit(3)

    cks, timing = receive_buckets(plan, group, take)
    result_q.put(
        {
            "version": plan.version,
            "checksums": cks,
            "per_tensor": {n: checksum(t) for n, t in received.items()},
        }
    )
    group.close()


def _push(mode: str, timeout_s: float = 5.0):
    ctx = mp.get_context("spawn")
    version_q, result_q = ctx.Queue(), ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=_receiver, args=(port, version_q, result_q, mode, timeout_s), daemon=True)
    proc.start()
    try:
        group = StatelessGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s)
        state = _state(1)
        plan = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in state.items()], 2**18, version=7)
        assert len(plan.buckets) > 1
        version_q.put(plan)
        if mode == "die":
            proc.join(30)  # the receiver is gone before the broadcast
        t0 = time.monotonic()
        try:
            stats = send_buckets(plan, lambda names: [state[n] for n in names], group)
            return stats, state, result_q.get(timeout=30), time.monotonic() - t0
        except SyncError as e:
            return e, state, None, time.monotonic() - t0
        finally:
            group.close()
    finally:
        proc.join(timeout_s + 15)
        if proc.is_alive():
            proc.kill()
            proc.join()


def test_push_of_real_model_state_is_bit_exact():
    stats, state, got, _ = _push("ok")
    assert got["version"] == 7
    assert got["checksums"] == stats.checksums  # what the trainer acknowledges against
    assert got["per_tensor"] == {n: checksum(t) for n, t in state.items()}
    assert stats.nbytes == sum(t.numel() * 4 for t in state.values())


def test_push_to_dead_receiver_fails_fast():
    err, _, _, dt = _push("die", timeout_s=5.0)
    assert isinstance(err, SyncError) and "v7" in str(err)
    assert dt < 5.0 + 5


def test_receiver_killed_mid_push_fails_within_deadline():
    err, _, _, dt = _push("die_mid", timeout_s=5.0)
    assert isinstance(err, SyncError) and "v7" in str(err)
    assert dt < 5.0 + 5


def test_push_to_stuck_receiver_fails_within_deadline():
    err, _, _, dt = _push("stall", timeout_s=3.0)
    assert isinstance(err, SyncError)
    assert dt < 3.0 + 10


# ------------------------------------------------------------------ the control plane


def test_hub_join_push_ack_cycle():
    async def scenario():
        hub = WeightHub()
        await hub.register("r1")
        await hub.register("r2")
        assert hub.membership_changed()
        g = await hub.open_epoch("127.0.0.1", 1234, "gloo", 5.0)
        assert g.world == 3 and sorted(g.ranks.values()) == [1, 2]
        ins = await hub.next_instruction("r1", -1, -1, 0.1)
        assert ins["kind"] == "join" and ins["rank"] == g.ranks["r1"]
        await hub.ack("r1", "join", g.epoch, True, {})
        acks = await hub.wait_acks("join", g.epoch, 0.2)
        assert acks["__missing__"]["ids"] == ["r2"]
        await hub.ack("r2", "join", g.epoch, True, {})
        plan = plan_buckets([("w", (2,), torch.float32)], 1024, 1)
        # a replica long-polling is woken by the announcement
        waiter = asyncio.create_task(hub.next_instruction("r1", g.epoch, 0, 5.0))
        await asyncio.sleep(0.05)
        await hub.announce(plan)
        assert (await waiter)["kind"] == "push"
        await hub.ack("r1", "push", 1, True, {"checksums": ["x"]})
        await hub.ack("r2", "push", 1, True, {"checksums": ["y"]})
        acks = await hub.wait_acks("push", 1, 1.0)
        with pytest.raises(SyncError, match="replica r2 loaded different bytes"):
            check_acks(acks, "push", 1, ["x"], 1.0)
        await hub.drop(["r2"])
        assert hub.membership_changed() and hub.alive_ids() == ["r1"]
        assert (await hub.next_instruction("r2", g.epoch, 1, 0.1))["kind"] == "unknown"

    asyncio.run(scenario())


def test_check_acks_names_missing_and_failed_replicas():
    acks = {
        "__missing__": {"ids": ["dead-1"]},
        "ok-1": {"ok": True, "checksums": ["a"]},
        "bad-1": {"ok": False, "error": "boom"},
    }
    with pytest.raises(SyncError) as e:
        check_acks(acks, "push", 4, ["a"], 30)
    assert "dead-1 did not acknowledge push 4 within 30s" in str(e.value)
    assert "bad-1 failed push 4: boom" in str(e.value)


def test_hub_version_gated_join_and_clean_leave():
    """A replica that registers mid-run must wait for the current version; one that leaves still gets the
    push already announced to its epoch, then 'leave', and is out of the next epoch."""

    async def scenario():
        hub = WeightHub()
        assert await hub.register("r1", 1, started_at=100.0) == -1  # run start: nothing pushed yet
        g = await hub.open_epoch("127.0.0.1", 1, "gloo", 5.0)
        await hub.ack("r1", "join", g.epoch, True, {})
        await hub.announce(plan_buckets([("w", (2,), torch.float32)], 1024, 0))
        await hub.ack("r1", "push", 0, True, {})
        await hub.wait_acks("push", 0, 0.1)
        assert hub.version == 0 and hub.members["r1"].join_s is not None
        # a second replica starts mid-run: it must hold version >= 0 before serving
        assert await hub.register("r2", 1, started_at=time.time() - 3.0) == 0
        assert hub.membership_changed()
        g2 = await hub.open_epoch("127.0.0.1", 2, "gloo", 5.0)
        assert set(g2.ranks) == {"r1", "r2"}
        assert (await hub.next_instruction("r2", -1, -1, 0.1))["kind"] == "join"
        for r in ("r1", "r2"):
            await hub.ack(r, "join", g2.epoch, True, {})
        await hub.announce(plan_buckets([("w", (2,), torch.float32)], 1024, 1))
        await hub.ack("r1", "push", 1, True, {})
        await hub.ack("r2", "push", 1, True, {})
        acks = await hub.wait_acks("push", 1, 0.1)
        assert "join_s" in acks["r2"] and acks["r2"]["join_s"] >= 3.0 and "join_s" not in acks["r1"]
        await hub.served("r2", 1)
        assert hub.members["r2"].first_served == {"version": 1, "hub_version": 1}
        # r2 leaves while version 2 is announced to its epoch: it still receives 2, then is told to leave
        await hub.announce(plan_buckets([("w", (2,), torch.float32)], 1024, 2))
        await hub.leave("r2")
        assert (await hub.next_instruction("r2", g2.epoch, 1, 0.1))["kind"] == "push"
        await hub.ack("r2", "push", 2, True, {})
        assert (await hub.next_instruction("r2", g2.epoch, 2, 0.1))["kind"] == "leave"
        assert hub.membership_changed() and hub.alive_ids() == ["r1"]
        await hub.ack(
            "r1", "push", 2, True, {}
        )  # r1 got version 2 in epoch g2 (the broadcast failed elsewhere)
        g3 = await hub.open_epoch("127.0.0.1", 3, "gloo", 5.0)
        assert set(g3.ranks) == {"r1"}  # the next push does not wait on the replica that is gone
        # a push retried in a new epoch reaches a replica that already holds that version (it must take
        # part in the broadcast again), but only once per epoch
        await hub.ack("r1", "join", g3.epoch, True, {})
        await hub.announce(plan_buckets([("w", (2,), torch.float32)], 1024, 2))
        assert (await hub.next_instruction("r1", g3.epoch, 2, 0.1))["kind"] == "push"
        await hub.ack("r1", "push", 2, True, {})
        assert (await hub.next_instruction("r1", g3.epoch, 2, 0.1))["kind"] == "idle"
        st = await hub.status()
        assert st["members"]["r2"]["leaving"] and st["members"]["r2"]["pushes"] == 2

    asyncio.run(scenario())


def test_hub_rollback_and_abort_instructions():
    """After a trainer restores an older checkpoint its push of that version reaches replicas that hold a
    newer one; `abort_inflight` reaches every live replica once and waits for their answers."""

    async def scenario():
        hub = WeightHub()
        await hub.register("r1")
        g = await hub.open_epoch("127.0.0.1", 1234, "gloo", 5.0)
        await hub.ack("r1", "join", g.epoch, True, {})
        await hub.announce(plan_buckets([("w", (2,), torch.float32)], 1024, 5))
        await hub.ack("r1", "push", 5, True, {"checksums": ["x"]})
        await hub.wait_acks("push", 5, 1.0)
        assert hub.version == 5
        assert (await hub.next_instruction("r1", g.epoch, 5, 0.05))["kind"] == "idle"
        # the trainer died and restored version 3: a new epoch, then a push of 3
        g2 = await hub.open_epoch("127.0.0.1", 1235, "gloo", 5.0)
        assert (await hub.next_instruction("r1", g.epoch, 5, 0.05))["kind"] == "join"
        await hub.ack("r1", "join", g2.epoch, True, {})
        await hub.announce(plan_buckets([("w", (2,), torch.float32)], 1024, 3))
        assert hub.version == 2  # rolled back: acks of 3 make it current again
        ins = await hub.next_instruction("r1", g2.epoch, 5, 0.05)
        assert ins["kind"] == "push" and ins["plan"].version == 3
        await hub.ack("r1", "push", 3, True, {"checksums": ["x"]})
        await hub.wait_acks("push", 3, 1.0)
        assert hub.version == 3
        assert (await hub.next_instruction("r1", g2.epoch, 3, 0.05))["kind"] == "idle"
        # abort: every live replica is told once
        seen = await hub.abort_count()
        task = asyncio.create_task(hub.abort_inflight(2.0))
        await asyncio.sleep(0.05)
        ins = await hub.next_instruction("r1", g2.epoch, 3, 0.05, seen)
        assert ins["kind"] == "abort"
        await hub.ack("r1", "abort", ins["seq"], True, {})
        acks = await task
        assert acks["__missing__"]["ids"] == [] and acks["r1"]["ok"]
        assert (await hub.next_instruction("r1", g2.epoch, 3, 0.05, ins["seq"]))["kind"] == "idle"
        await hub.beat({"phase": "training step 4"})
        st = await hub.status()
        assert st["trainer"]["phase"] == "training step 4" and st["last_push"]["version"] == 3

    asyncio.run(scenario())
