"""The weight-sync transport with torch alone: planning, checksums, the hub, and a real two-process push."""

import asyncio
import multiprocessing as mp
import os
import time

import pytest
import torch

from app.tasks import tiny
from app.weights.buckets import checksum, plan_buckets, unpack
from app.weights.control import RunControl
from app.weights.group import free_port
from app.weights.hub import WeightHub, check_acks
from app.weights.records import (
    Abort,
    Ack,
    Acks,
    GroupInfo,
    Idle,
    Join,
    Leave,
    Push,
    SyncError,
    Unknown,
    group_from_json,
    group_to_json,
)
from app.weights.transport import make_transport


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


def test_a_plan_crosses_processes_as_its_version_and_one_layout_text():
    import dataclasses
    import json
    import pickle

    from app.weights.records import layout_from_text, layout_text, plan_from_json, plan_to_json

    state = _state()
    specs = [(n, tuple(t.shape), t.dtype) for n, t in state.items()]
    plan = plan_buckets(specs, 2**14, 4)
    wire = pickle.dumps(plan)
    assert len(wire) < len(layout_text(plan.buckets)) + 200  # no dataclass per tensor on the wire
    back = pickle.loads(wire)
    assert back == plan
    # the next push: the same layout, another version; the receiving end reuses what it parsed
    nxt = pickle.loads(pickle.dumps(dataclasses.replace(plan, version=5)))
    assert nxt.version == 5 and nxt.buckets is back.buckets
    assert layout_from_text(layout_text(plan.buckets)) is back.buckets
    # the JSON form the vLLM workers get: standard JSON, the same plan, also when written by hand
    text = plan_to_json(plan)
    assert json.loads(text)["version"] == 4 and plan_from_json(text) == plan
    by_hand = json.dumps({"buckets": json.loads(text)["buckets"], "version": 7}, indent=2)
    assert plan_from_json(by_hand) == dataclasses.replace(plan, version=7)
    # another layout (a bucket size) is another text
    assert layout_text(plan_buckets(specs, 2**16, 4).buckets) != layout_text(plan.buckets)


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


def test_pack_casts_into_the_pushed_dtype_in_one_batched_copy():
    from app.weights.buckets import pack_into

    state = _state()  # float32, as a trainer's master weights
    specs = [(n, tuple(t.shape), torch.bfloat16) for n, t in state.items()]
    for b in plan_buckets(specs, 2**15, 1).buckets:
        src = [state[t.name] for t in b.tensors]
        out = pack_into(b, src, torch.empty(b.numel, dtype=torch.bfloat16))
        want = torch.cat([t.reshape(-1).to(torch.bfloat16) for t in src])
        assert torch.equal(out, want)
        # sources of two dtypes (one already bf16): the same bytes
        mixed = [t.to(torch.bfloat16) if i % 2 else t for i, t in enumerate(src)]
        assert torch.equal(pack_into(b, mixed, torch.empty(b.numel, dtype=torch.bfloat16)), want)


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


def _group(port: int, timeout_s: float, transport: str) -> GroupInfo:
    return GroupInfo(
        epoch=0,
        host="127.0.0.1",
        port=port,
        world=2,
        backend="gloo",
        timeout_s=timeout_s,
        ranks={"r": 1},
        transport=transport,
    )


def _receiver(port: int, version_q, result_q, mode: str, timeout_s: float, transport: str) -> None:
    """A stand-in for one vLLM worker: joins through the named transport (built from the registry in this
    fresh process, as a vLLM worker does) and receives one push."""
    torch.set_num_threads(1)
    receiver = make_transport(transport)
    result_q.put("ready")  # imports done: the join below starts within the group's timeout of the sender's
    receiver.join(_group(port, timeout_s, transport), 1, "cpu")
    plan = version_q.get(timeout=120)
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

    cks, timing = receiver.receive(plan, take, "cpu")
    result_q.put(
        {
            "version": plan.version,
            "checksums": cks,
            "per_tensor": {n: checksum(t) for n, t in received.items()},
            "transport": type(receiver).__name__,
            "transport_stats": dict(getattr(receiver, "stats", {})),
        }
    )
    receiver.close()


def _push(mode: str, timeout_s: float = 5.0, transport: str = "broadcast", sender_out: dict | None = None):
    """Push a real model's state from this process through `transport` to a receiver process."""
    ctx = mp.get_context("spawn")
    version_q, result_q = ctx.Queue(), ctx.Queue()
    port = free_port()
    proc = ctx.Process(
        target=_receiver, args=(port, version_q, result_q, mode, timeout_s, transport), daemon=True
    )
    proc.start()
    try:
        assert result_q.get(timeout=120) == "ready"  # a loaded machine can take seconds to spawn
        sender = make_transport(transport)
        if sender_out is not None:
            sender_out["sender"] = sender
        sender.open(_group(port, timeout_s, transport), "cpu")
        state = _state(1)
        plan = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in state.items()], 2**18, version=7)
        assert len(plan.buckets) > 1
        version_q.put(plan)
        if mode == "die":
            proc.join(30)  # the receiver is gone before the broadcast
        t0 = time.monotonic()
        try:
            stats = sender.send(plan, lambda names: [state[n] for n in names], "cpu")
            return stats, state, result_q.get(timeout=120), time.monotonic() - t0
        except SyncError as e:
            return e, state, None, time.monotonic() - t0
        finally:
            sender.close()
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

OK = Ack(ok=True)


def _plan(version: int):
    return plan_buckets([("w", (2,), torch.float32)], 1024, version)


def test_hub_ranks_follow_the_senders():
    """Every trainer rank sends (colocated IPC): ranks 0..senders-1 are the trainer's, the replicas' follow."""

    async def scenario():
        hub = WeightHub()
        await hub.register("r1")
        await hub.register("r2", workers=2)
        g = await hub.open_epoch("127.0.0.1", 1234, "gloo", 5.0, "ipc", senders=2)
        assert g.senders == 2 and g.ranks == {"r1": 2, "r2": 3} and g.world == 5
        assert group_from_json(group_to_json(g)) == g

    asyncio.run(scenario())


def test_the_nccl_stream_priority_travels_with_the_epoch_to_every_member():
    """`sync.broadcast.nccl_high_priority` reaches each receiver in the epoch's GroupInfo (as JSON, as a vLLM
    worker gets it); off unless asked for; a gloo group built from it is unaffected."""
    from app.weights.group import StatelessGroup

    async def scenario():
        hub = WeightHub()
        await hub.register("r1")
        g = await hub.open_epoch("127.0.0.1", 1234, "nccl", 5.0, "broadcast", 1, True)
        assert group_from_json(group_to_json(g)).high_priority is True
        g = await hub.open_epoch("127.0.0.1", 1234, "nccl", 5.0)
        assert group_from_json(group_to_json(g)).high_priority is False

    asyncio.run(scenario())
    group = StatelessGroup("127.0.0.1", free_port(), 0, 1, "gloo", 5.0, high_priority=True)
    try:
        t = torch.arange(4.0)
        group.broadcast(t)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        group.close()


def test_a_member_joins_a_store_that_listens_late_and_fails_fast_where_none_ever_will(monkeypatch):
    """The trainer announces an epoch a moment before its store listens: a member that arrives first waits for
    it and joins. Where the trainer that announced the epoch is gone (killed mid-push), the join fails within
    STORE_LISTEN_S, naming the store, instead of two rounds of the group's timeout in TCPStore's connect loop
    (in a vLLM engine core, the new trainer's joins queued behind that one and failed too)."""
    import threading

    from app.weights import group as wg

    port, got = free_port(), {}

    def trainer():
        time.sleep(0.3)  # announced, not yet listening
        g = wg.StatelessGroup("127.0.0.1", port, 0, 2, "gloo", 30.0, epoch=1)
        try:
            g.broadcast(torch.arange(3.0))
        finally:
            g.close()

    th = threading.Thread(target=trainer)
    th.start()
    member = wg.StatelessGroup("127.0.0.1", port, 1, 2, "gloo", 30.0, epoch=1)
    try:
        got["t"] = torch.zeros(3)
        member.broadcast(got["t"])
    finally:
        member.close()
        th.join(timeout=60)
    assert got["t"].tolist() == [0.0, 1.0, 2.0]

    monkeypatch.setattr(wg, "STORE_LISTEN_S", 0.5)
    dead = free_port()  # nothing will ever listen here
    t0 = time.monotonic()
    with pytest.raises(
        SyncError, match=rf"epoch 3: nothing listens at the weight group's store 127.0.0.1:{dead} after 0.5s"
    ):
        wg.StatelessGroup("127.0.0.1", dead, 1, 2, "gloo", 60.0, epoch=3)
    assert time.monotonic() - t0 < 30  # not the 2 x 60 s of TCPStore's own connect loop


def test_hub_join_push_ack_cycle():
    async def scenario():
        hub = WeightHub()
        await hub.register("r1")
        await hub.register("r2")
        assert hub.membership_changed()
        g = await hub.open_epoch("127.0.0.1", 1234, "gloo", 5.0)
        assert g.world == 3 and sorted(g.ranks.values()) == [1, 2] and g.transport == "broadcast"
        ins = await hub.next_instruction("r1", -1, -1, 0.1)
        assert isinstance(ins, Join) and ins.rank == g.ranks["r1"] and ins.group == g
        await hub.ack("r1", "join", g.epoch, OK)
        acks = await hub.wait_acks("join", g.epoch, 0.2)
        assert isinstance(acks, Acks) and acks.missing == ["r2"] and not acks.complete
        await hub.ack("r2", "join", g.epoch, OK)
        # a replica long-polling is woken by the announcement
        waiter = asyncio.create_task(hub.next_instruction("r1", g.epoch, 0, 5.0))
        await asyncio.sleep(0.05)
        await hub.announce(_plan(1))
        ins = await waiter
        assert isinstance(ins, Push) and ins.plan.version == 1
        await hub.ack("r1", "push", 1, Ack(ok=True, checksums=["x"]))
        await hub.ack("r2", "push", 1, Ack(ok=True, checksums=["y"]))
        acks = await hub.wait_acks("push", 1, 1.0)
        assert acks.missing == [] and acks.complete
        with pytest.raises(SyncError, match="replica r2 loaded different bytes"):
            check_acks(acks, ["x"], 1.0)
        await hub.drop(["r2"])
        assert hub.membership_changed() and hub.alive_ids() == ["r1"]
        assert isinstance(await hub.next_instruction("r2", g.epoch, 1, 0.1), Unknown)

    asyncio.run(scenario())


def test_a_replica_is_not_sent_back_to_an_epoch_it_failed_in():
    """A trainer killed mid-push leaves its epoch current in the hub: the replica whose receive failed must not
    be sent to join that epoch again (its store is gone: the join would only fail, slowly), but joins the
    epoch the restarted trainer opens. The same for a failed join; registering again starts afresh."""

    async def scenario():
        hub = WeightHub()
        await hub.register("r1")
        g0 = await hub.open_epoch("127.0.0.1", 1234, "gloo", 5.0)
        await hub.ack("r1", "join", g0.epoch, OK)
        await hub.announce(_plan(4))
        await hub.ack("r1", "push", 4, Ack(ok=False, error="gloo: connection closed by peer"))
        # the replica leaves the failed epoch (-1) and asks what to do: nothing, until a new epoch
        assert isinstance(await hub.next_instruction("r1", -1, 3, 0.1), Idle)
        g1 = await hub.open_epoch("127.0.0.1", 1235, "gloo", 5.0)  # the restarted trainer's
        ins = await hub.next_instruction("r1", -1, 3, 0.1)
        assert isinstance(ins, Join) and ins.group.epoch == g1.epoch == g0.epoch + 1
        await hub.ack("r1", "join", g1.epoch, Ack(ok=False, error="no store"))
        assert isinstance(await hub.next_instruction("r1", -1, 3, 0.1), Idle)
        await hub.register("r1")  # dropped and back: a member afresh
        assert isinstance(await hub.next_instruction("r1", -1, 3, 0.1), Join)

    asyncio.run(scenario())


def test_announcement_to_a_stale_epoch_is_refused():
    """The trainer announces with its epoch; the hub refuses (announces nothing) once the membership changed or
    another epoch is current, so the trainer forms a new epoch first: no separate membership round trip."""

    async def scenario():
        hub = WeightHub()
        await hub.register("r1")
        g = await hub.open_epoch("127.0.0.1", 1234, "gloo", 5.0)
        assert await hub.announce(_plan(1), g.epoch) is True
        assert hub.plan is not None and hub.plan.version == 1 and hub.announced_at > 0
        assert await hub.announce(_plan(2), g.epoch + 1) is False  # not the current epoch
        await hub.register("r2")  # a replica joins: the membership changed
        assert await hub.announce(_plan(2), g.epoch) is False
        assert hub.plan.version == 1  # nothing was announced
        g2 = await hub.open_epoch("127.0.0.1", 1235, "gloo", 5.0)
        assert await hub.announce(_plan(2), g2.epoch) is True
        ins = await hub.next_instruction("r1", g2.epoch, 1, 0.1)
        assert isinstance(ins, Push) and ins.plan.version == 2 and ins.announced_at == hub.announced_at

    asyncio.run(scenario())


def test_retry_of_a_version_ignores_answers_to_the_failed_try():
    """A replica whose engine died answers push v with a failure and is dropped; the retry of v in a new epoch
    without it must be judged on the new epoch's answers alone (a stale failure failed every retry)."""

    async def scenario():
        hub = WeightHub()
        for rid in ("r1", "r2"):
            await hub.register(rid)
        g = await hub.open_epoch("127.0.0.1", 1234, "gloo", 5.0)
        for rid in ("r1", "r2"):
            await hub.ack(rid, "join", g.epoch, OK)
        await hub.announce(_plan(13))
        await hub.ack("r1", "push", 13, Ack(ok=True, checksums=["x"]))
        await hub.ack("r2", "push", 13, Ack(ok=False, error="EngineDeadError"))
        await hub.drop(["r2"], "its vLLM engine died")
        g2 = await hub.open_epoch("127.0.0.1", 1235, "gloo", 5.0)
        assert list(g2.ranks) == ["r1"]
        await hub.ack("r1", "join", g2.epoch, OK)
        await hub.announce(_plan(13))  # the retry
        ins = await hub.next_instruction("r1", g2.epoch, 13, 0.1)
        assert (
            isinstance(ins, Push) and ins.plan.version == 13
        )  # every member of the new epoch receives again
        await hub.ack("r1", "push", 13, Ack(ok=True, checksums=["x"]))
        acks = await hub.wait_acks("push", 13, 1.0)
        assert acks.complete and list(acks.got) == ["r1"] and not acks.failed
        check_acks(acks, ["x"], 1.0)

    asyncio.run(scenario())


def test_check_acks_names_missing_and_failed_replicas():
    acks = Acks(
        kind="push",
        key=4,
        got={"ok-1": Ack(ok=True, checksums=["a"]), "bad-1": Ack(ok=False, error="boom")},
        missing=["dead-1"],
    )
    assert acks.failed == ["bad-1"] and not acks.complete
    with pytest.raises(SyncError) as e:
        check_acks(acks, ["a"], 30)
    assert "dead-1 did not acknowledge push 4 within 30s" in str(e.value)
    assert "bad-1 failed push 4: boom" in str(e.value)
    assert acks.as_dict()["acks"]["ok-1"] == {"ok": True, "checksums": ["a"]}


class _ActorAt:
    """The one call the hub makes on a replica's actor handle (`__ray_ready__.remote()`), answered as Ray
    does for a live actor, a dead one (ActorDiedError) or one that does not answer in time."""

    def __init__(self, state: str) -> None:
        self.state = state
        self.__ray_ready__ = self

    def remote(self):
        async def ready() -> bool:
            from ray.exceptions import ActorDiedError

            if self.state == "dead":
                raise ActorDiedError()
            if self.state == "stuck":
                await asyncio.sleep(60)
            return True

        return ready()


def test_hub_new_epoch_leaves_out_replicas_whose_actor_died():
    async def scenario():
        hub = WeightHub()
        for rid, state in [("live", "alive"), ("killed", "dead"), ("busy", "stuck")]:
            await hub.register(rid, actor=_ActorAt(state))
        await hub.register("no-handle")  # registered without one (in-process use): never probed
        t0 = time.monotonic()
        g = await hub.open_epoch("127.0.0.1", 1234, "gloo", 5.0)
        assert sorted(g.ranks) == ["busy", "live", "no-handle"]  # a slow answer is not death
        assert time.monotonic() - t0 < 10  # the stuck probe gave up at its own deadline
        m = hub.members["killed"]
        assert not m.alive and m.dropped == "its replica actor died"

    asyncio.run(scenario())


def test_hub_version_gated_join_and_clean_leave():
    """A replica that registers mid-run must wait for the current version; one that leaves still gets the
    push already announced to its epoch, then `Leave`, and is out of the next epoch."""

    async def scenario():
        hub = WeightHub()
        assert await hub.register("r1", 1, started_at=100.0) == -1  # run start: nothing pushed yet
        g = await hub.open_epoch("127.0.0.1", 1, "gloo", 5.0)
        await hub.ack("r1", "join", g.epoch, OK)
        await hub.announce(_plan(0))
        await hub.ack("r1", "push", 0, OK)
        await hub.wait_acks("push", 0, 0.1)
        assert hub.version == 0 and hub.members["r1"].join_s is not None
        # a second replica starts mid-run: it must hold version >= 0 before serving
        assert await hub.register("r2", 1, started_at=time.time() - 3.0) == 0
        assert hub.membership_changed() and await hub.joiners() == ["r2"]  # the trainer pushes to it
        g2 = await hub.open_epoch("127.0.0.1", 2, "gloo", 5.0)
        assert await hub.joiners() == []
        assert set(g2.ranks) == {"r1", "r2"}
        assert isinstance(await hub.next_instruction("r2", -1, -1, 0.1), Join)
        for r in ("r1", "r2"):
            await hub.ack(r, "join", g2.epoch, OK)
        await hub.announce(_plan(1))
        await hub.ack("r1", "push", 1, OK)
        await hub.ack("r2", "push", 1, OK)
        acks = await hub.wait_acks("push", 1, 0.1)
        assert acks.got["r2"].detail["join_s"] >= 3.0 and "join_s" not in acks.got["r1"].detail
        await hub.served("r2", 1)
        assert hub.members["r2"].first_served == {"version": 1, "hub_version": 1}
        # what a replacement is checked against: the version current at its registration, its first push
        r1, r2 = hub.members["r1"], hub.members["r2"]
        assert (r1.registered_version, r1.admitted_version) == (-1, 0)
        assert (r2.registered_version, r2.admitted_version) == (0, 1)
        assert (await hub.status())["host"] == "127.0.0.1"  # the weight group's address: the trainer's node
        # r2 leaves while version 2 is announced to its epoch: it still receives 2, then is told to leave
        await hub.announce(_plan(2))
        await hub.leave("r2")
        assert isinstance(await hub.next_instruction("r2", g2.epoch, 1, 0.1), Push)
        await hub.ack("r2", "push", 2, OK)
        assert isinstance(await hub.next_instruction("r2", g2.epoch, 2, 0.1), Leave)
        assert hub.membership_changed() and hub.alive_ids() == ["r1"]
        await hub.ack("r1", "push", 2, OK)  # r1 got version 2 in epoch g2 (the broadcast failed elsewhere)
        g3 = await hub.open_epoch("127.0.0.1", 3, "gloo", 5.0)
        assert set(g3.ranks) == {"r1"}  # the next push does not wait on the replica that is gone
        # a push retried in a new epoch reaches a replica that already holds that version (it must take
        # part in the broadcast again), but only once per epoch
        await hub.ack("r1", "join", g3.epoch, OK)
        await hub.announce(_plan(2))
        assert isinstance(await hub.next_instruction("r1", g3.epoch, 2, 0.1), Push)
        await hub.ack("r1", "push", 2, OK)
        assert isinstance(await hub.next_instruction("r1", g3.epoch, 2, 0.1), Idle)
        st = await hub.status()
        assert st["members"]["r2"]["leaving"] and st["members"]["r2"]["pushes"] == 2

    asyncio.run(scenario())


def test_hub_rollback_after_a_restore():
    """After a trainer restores an older checkpoint its push of that version reaches replicas that hold a
    newer one."""

    async def scenario():
        hub = WeightHub()
        await hub.register("r1")
        g = await hub.open_epoch("127.0.0.1", 1234, "gloo", 5.0)
        await hub.ack("r1", "join", g.epoch, OK)
        await hub.announce(_plan(5))
        await hub.ack("r1", "push", 5, Ack(ok=True, checksums=["x"]))
        await hub.wait_acks("push", 5, 1.0)
        assert hub.version == 5
        assert isinstance(await hub.next_instruction("r1", g.epoch, 5, 0.05), Idle)
        # the trainer died and restored version 3: a new epoch, then a push of 3
        g2 = await hub.open_epoch("127.0.0.1", 1235, "gloo", 5.0)
        assert isinstance(await hub.next_instruction("r1", g.epoch, 5, 0.05), Join)
        await hub.ack("r1", "join", g2.epoch, OK)
        await hub.announce(_plan(3))
        assert hub.version == 2  # rolled back: acks of 3 make it current again
        ins = await hub.next_instruction("r1", g2.epoch, 5, 0.05)
        assert isinstance(ins, Push) and ins.plan.version == 3
        await hub.ack("r1", "push", 3, Ack(ok=True, checksums=["x"]))
        await hub.wait_acks("push", 3, 1.0)
        assert hub.version == 3
        assert isinstance(await hub.next_instruction("r1", g2.epoch, 3, 0.05), Idle)

    asyncio.run(scenario())


def test_run_control_stop_heartbeat_and_abort():
    """`abort_inflight` reaches every replica that polls, once, and waits for their answers; one that
    detached is not waited for. The hub's status reports the run control's stop reason and heartbeat."""

    async def scenario():
        control = RunControl()
        hub = WeightHub(control)
        assert isinstance(await control.next_control("r1", await control.abort_count(), 0.01), Idle)
        assert isinstance(await control.next_control("r2", 0, 0.01), Idle)
        await control.detach("r2")
        seen = await control.abort_count()
        task = asyncio.create_task(control.abort_inflight(2.0))
        ins = await control.next_control("r1", seen, 1.0)
        assert isinstance(ins, Abort)
        await control.ack("r1", ins.seq, OK)
        acks = await task
        assert acks["missing"] == [] and acks["acks"]["r1"]["ok"] and "r2" not in acks["acks"]
        assert isinstance(await control.next_control("r1", ins.seq, 0.05), Idle)
        # a replica that polled but never answers is reported missing at the deadline
        await control.next_control("r3", ins.seq, 0.01)
        t0 = time.monotonic()
        acks = await control.abort_inflight(0.3)
        assert acks["missing"] == ["r1", "r3"] and time.monotonic() - t0 < 0.3 + 10
        await control.beat({"phase": "training step 4"})
        await control.request_stop("signal SIGTERM")
        await control.request_stop("a second reason is ignored")
        assert await control.stop_reason() == "signal SIGTERM"
        st = await hub.status()
        assert st["trainer"]["phase"] == "training step 4" and st["stop"] == "signal SIGTERM"

    asyncio.run(scenario())
