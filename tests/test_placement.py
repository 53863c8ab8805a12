"""Explicit placement and one-GPU sharing (issue 12), without Ray or a GPU: resource shares, the refusal of a
placement that cannot work, vLLM's memory share, the automatic choice of the CUDA-IPC transport, the IPC
transport's protocol (with stand-in handles over a real gloo group), and per-token versions on engines
without weight-version spans (vLLM 0.26)."""

from __future__ import annotations

import os
import pickle
import threading
from types import SimpleNamespace

import pytest
import torch

from app.config import ConfigError, load_config
from app.infra.resources import (
    COLOCATED_REPLICA,
    COLOCATED_WORKER,
    ResourceError,
    auto_transport,
    check,
    check_nccl_devices,
    check_placement,
    cuda_alloc_env,
    demands,
    memory_share,
    ongoing_requests,
    replica_placement,
    resolve,
    role_env,
    trainer_env,
    worker_share,
)
from app.vllm import engine as vla
from app.weights import ipc as ipc_mod
from app.weights.buckets import plan_buckets
from app.weights.group import free_port
from app.weights.records import GroupInfo
from app.weights.transport import TRANSPORTS, transport_class


def gpu1(*extra: str):
    return load_config("gpu1", list(extra))


def test_gpu1_preset_fits_one_gpu_and_picks_ipc():
    cfg = gpu1()
    assert cfg.model.dtype == "bfloat16" and cfg.train.use_gpu and cfg.train.workers == 1
    need = check(cfg, {"CPU": 16, "GPU": 1})
    assert need["train"]["GPU"] == cfg.train.worker_gpus < 1
    assert need["rollout"]["GPU"] == cfg.rollout.replica_gpus < 1
    assert need["train"]["GPU"] + need["rollout"]["GPU"] <= 1
    assert auto_transport(cfg, {"CPU": 16, "GPU": 1}) == "ipc"
    assert memory_share(cfg.rollout) == cfg.rollout.replica_gpus
    check_placement(cfg, "gpu")


def test_gpu2_preset_gives_each_role_a_gpu_and_picks_the_nccl_broadcast():
    cfg = load_config("gpu2", [])
    two = {"CPU": 32, "GPU": 2}
    shares = resolve(cfg, two)
    assert shares["rollout.replica_gpus"] == 1 and shares["train.workers"] == 1 and shares["train.use_gpu"]
    merged = load_config("gpu2", [f"{k}={v}" for k, v in shares.items()])
    need = check(merged, two)
    assert need["train"]["GPU"] == 1 and need["rollout"]["GPU"] == 1
    assert auto_transport(merged, two) == "broadcast" and merged.sync.broadcast.bucket_mb == 256
    check_nccl_devices(merged, "broadcast")


def test_two_replicas_on_one_gpu_are_refused_for_the_nccl_push():
    cfg = load_config(None, ["rollout.replica_gpus=0.5", "rollout.max_replicas=2", "train.use_gpu=true"])
    with pytest.raises(ResourceError, match="rollout.replica_gpus=1"):
        check_nccl_devices(cfg, "broadcast")
    check_nccl_devices(cfg, "ipc")  # one GPU for all: CUDA IPC, no NCCL ranks
    check_nccl_devices(load_config(None, ["rollout.replica_gpus=1", "rollout.max_replicas=2"]), "broadcast")


def test_train_worker_gpus_counted_and_checked():
    cfg = load_config(None, ["train.use_gpu=true", "train.workers=1", "train.worker_gpus=0.5"])
    assert demands(cfg)["train"]["GPU"] == 0.5
    with pytest.raises(ResourceError, match="1.5 GPU asked"):
        check(
            load_config(
                None,
                ["train.use_gpu=true", "train.workers=1", "train.worker_gpus=0.5", "rollout.replica_gpus=1"],
            ),
            {"CPU": 16, "GPU": 1},
        )
    with pytest.raises(ConfigError, match="NCCL cannot put two ranks"):
        load_config(None, ["train.use_gpu=true", "train.workers=2", "train.worker_gpus=0.5"])
    with pytest.raises(ConfigError, match="train.worker_gpus"):
        load_config(None, ["train.worker_gpus=0"])
    # a share of one GPU from resources.train_gpus: one worker on that share
    got = resolve(load_config(None, ["resources.train_gpus=0.5"]), {"CPU": 8, "GPU": 1})
    assert got["train.workers"] == 1 and got["train.worker_gpus"] == 0.5 and got["train.use_gpu"]


def test_placement_refusals_name_the_fix():
    with pytest.raises(ResourceError, match="rollout.replica_gpus=0.4"):
        check_placement(load_config(None, []), "gpu")
    with pytest.raises(ResourceError, match="rollout.replica_gpus=0"):
        check_placement(load_config(None, ["rollout.replica_gpus=1"]), "cpu")
    check_placement(load_config(None, []), "cpu")
    check_placement(load_config(None, []), None)  # no vLLM installed: nothing to refuse here


def test_roles_without_gpu_are_hidden_from_gpus():
    assert role_env(0) == {"CUDA_VISIBLE_DEVICES": ""}
    assert role_env(0.0) == {"CUDA_VISIBLE_DEVICES": ""}
    assert role_env(0.4) == {} and role_env(1) == {}


def test_gpu_trainers_get_expandable_segments_unless_told_otherwise():
    gpu = load_config("gpu1", []).train
    assert trainer_env(gpu) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} or (
        "PYTORCH_CUDA_ALLOC_CONF" in os.environ and trainer_env(gpu) == {}
    )
    assert cuda_alloc_env("auto", {}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert (
        cuda_alloc_env("auto", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == {}
    )  # the user's own
    assert cuda_alloc_env("", {}) == {}
    assert cuda_alloc_env("max_split_size_mb:64", {}) == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}
    cpu = load_config(None, ["train.cuda_alloc_conf=max_split_size_mb:64"]).train
    assert trainer_env(cpu) == {"CUDA_VISIBLE_DEVICES": ""}  # a CPU trainer: hidden, no allocator settings


def test_memory_share_follows_the_replica_share_unless_set():
    r = SimpleNamespace(gpu_memory_utilization=None, replica_gpus=0.4)
    assert memory_share(r) == 0.4
    r.replica_gpus = 1.0
    assert memory_share(r) == 0.9
    r.gpu_memory_utilization = 0.3
    assert memory_share(r) == 0.3


def test_a_replica_takes_a_whole_step_of_requests_unless_set():
    # the CPU default: 16 groups x 8 of a step, 32 fully_async groups x 8, 256 sequences: 2 x 256
    # (one request a sample here; a group's request: the next test)
    by_sample = "rollout.group_requests=false"
    assert ongoing_requests(load_config(None, [by_sample])) == 512
    # the 2-GPU bench's step: 128 groups x 8 through 512 slots, all in vLLM's queue at once
    gpu = load_config(None, ["train.batch_groups=128", "rollout.max_num_seqs=512", by_sample])
    assert ongoing_requests(gpu) == 1024
    # a few slots: twice them, at least 64
    small = load_config(None, ["train.batch_groups=2", "rollout.max_inflight=2", "rollout.n=4", by_sample])
    small.rollout.max_num_seqs = 8
    assert ongoing_requests(small) == 64
    # partial=off: a push's drain finishes every request inside, so only what vLLM runs at once
    assert ongoing_requests(load_config(None, ["rollout.partial=off", by_sample])) == 256
    assert ongoing_requests(load_config(None, ["rollout.max_ongoing_requests=300", by_sample])) == 300
    with pytest.raises(ConfigError, match=r"rollout.max_ongoing_requests.*below rollout.max_num_seqs=256"):
        load_config(None, ["rollout.max_ongoing_requests=100", by_sample])


def test_with_group_requests_a_replica_takes_the_same_samples_in_groups():
    # a request is a group of n=8: the 2-GPU bench's 1,024 samples are its 128 groups
    gpu = load_config(
        None, ["train.batch_groups=128", "rollout.max_num_seqs=512", "rollout.group_requests=true"]
    )
    assert ongoing_requests(gpu) == 128
    # the CPU default: 2 x 256 slots in groups of 8 = 64, and at least 64 samples (8 groups) in general
    assert ongoing_requests(load_config(None, ["rollout.group_requests=true"])) == 64
    off = load_config(None, ["rollout.group_requests=true", "rollout.partial=off", "rollout.n=3"])
    assert ongoing_requests(off) == 86  # ceil(256 / 3): what vLLM runs at once, in groups
    # an explicit cap counts requests, so 40 groups of 8 (320 samples) can fill 256 slots; 30 (240) cannot
    ok = load_config(None, ["rollout.group_requests=true", "rollout.max_ongoing_requests=40"])
    assert ongoing_requests(ok) == 40
    with pytest.raises(ConfigError, match=r"30 requests of 8 sample\(s\) are below rollout.max_num_seqs=256"):
        load_config(None, ["rollout.group_requests=true", "rollout.max_ongoing_requests=30"])


def test_auto_transport_picks_ipc_only_on_a_shared_gpu():
    shared = load_config(
        None, ["train.use_gpu=true", "train.workers=1", "train.worker_gpus=0.5", "rollout.replica_gpus=0.4"]
    )
    assert auto_transport(shared, {"GPU": 1}) == "ipc"
    assert auto_transport(shared, {"GPU": 2}) == "broadcast"  # Ray may place them on two GPUs
    assert auto_transport(load_config(None, []), {"GPU": 1}) == "broadcast"  # CPU roles
    assert auto_transport(load_config(None, []), {"CPU": 8}) == "broadcast"
    assert "ipc" in TRANSPORTS and transport_class("ipc") is ipc_mod.IpcTransport


def test_colocate_puts_a_trainer_rank_and_a_replica_on_every_gpu():
    cfg = load_config("colocated", [])
    for gpus in (2, 4, 8):
        got = resolve(cfg, {"GPU": gpus, "CPU": 64})
        assert got == {
            "rollout.min_replicas": gpus,
            "rollout.max_replicas": gpus,
            "rollout.replica_gpus": COLOCATED_REPLICA,
            "train.use_gpu": True,
            "train.workers": gpus,
            "train.worker_gpus": COLOCATED_WORKER,
        }
    one = resolve(cfg, {"GPU": 1, "CPU": 8})
    assert (one["rollout.replica_gpus"], one["train.worker_gpus"], one["train.workers"]) == (0.4, 0.5, 1)
    assert auto_transport(cfg, {"GPU": 2}) == "ipc"
    with pytest.raises(ResourceError, match="cluster has 0 GPUs"):
        resolve(cfg, {"CPU": 8})
    with pytest.raises(ResourceError, match="leave resources.rollout_gpus"):
        resolve(load_config("colocated", ["resources.train_gpus=1"]), {"GPU": 2, "CPU": 8})


@pytest.mark.parametrize("policy", ["first_fit", "best_fit"])
@pytest.mark.parametrize("gpus", [2, 3, 4, 8])
def test_colocated_shares_give_each_gpu_one_rank_and_one_replica(policy, gpus):
    """Ray assigns fractional GPUs per GPU instance. The replicas start first (app/driver.py); whether Ray fills
    the first GPU that fits or the fullest one that fits, the colocated shares leave no choice but one replica
    and one trainer worker on every GPU."""
    free = [1.0] * gpus
    placed: dict[str, list[int]] = {"replica": [], "worker": []}
    for role, share in [("replica", COLOCATED_REPLICA)] * gpus + [("worker", COLOCATED_WORKER)] * gpus:
        fits = [i for i, f in enumerate(free) if f + 1e-9 >= share]
        assert fits, f"{role} {len(placed[role])} does not fit: {free}"
        i = fits[0] if policy == "first_fit" else min(fits, key=lambda j: (free[j], j))
        free[i] -= share
        placed[role].append(i)
    assert sorted(placed["replica"]) == list(range(gpus)) == sorted(placed["worker"])


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_colocated_tensor_parallel_replicas_span_their_gpus_beside_a_rank_each(gpus):
    """rollout.tensor_parallel_size=2 with colocate: N/2 replicas, each one bundle of 0.55 per worker packed on
    its node (STRICT_PACK: one worker per GPU, since two shares do not fit one GPU), the trainer's 0.4 beside
    each; vLLM's memory share is the worker's share."""
    cfg = load_config("colocated", ["rollout.tensor_parallel_size=2"])
    got = resolve(cfg, {"GPU": gpus, "CPU": 64})
    assert got["rollout.min_replicas"] == got["rollout.max_replicas"] == gpus // 2
    assert got["rollout.replica_gpus"] == pytest.approx(2 * COLOCATED_REPLICA)
    assert got["train.workers"] == gpus and got["train.worker_gpus"] == COLOCATED_WORKER
    rollout = SimpleNamespace(
        replica_gpus=got["rollout.replica_gpus"], tensor_parallel_size=2, replica_cpus=1.0
    )
    assert worker_share(rollout) == pytest.approx(COLOCATED_REPLICA)
    assert memory_share(SimpleNamespace(**vars(rollout), gpu_memory_utilization=None)) == pytest.approx(0.55)
    place = replica_placement(rollout, {"rollout": 1.0})
    assert place["placement_group_strategy"] == "STRICT_PACK"
    bundles = place["placement_group_bundles"]
    assert bundles == [
        {"CPU": 1.0, "GPU": pytest.approx(0.55), "rollout": 1.0},
        {"GPU": pytest.approx(0.55)},
    ]
    # replicas first (bundle by bundle, first fit), then the trainer's workers: one of each per GPU
    free = [1.0] * gpus
    worker_gpus = []
    for _ in range(gpus // 2):
        for b in bundles:
            i = next(j for j, f in enumerate(free) if f + 1e-9 >= b["GPU"])
            free[i] -= b["GPU"]
            worker_gpus.append(i)
    for _ in range(gpus):
        i = next(j for j, f in enumerate(free) if f + 1e-9 >= COLOCATED_WORKER)
        free[i] -= COLOCATED_WORKER
    assert sorted(worker_gpus) == list(range(gpus)) and min(free) >= -1e-9
    with pytest.raises(ResourceError, match="do not divide"):
        resolve(load_config("colocated", ["rollout.tensor_parallel_size=4"]), {"GPU": 2, "CPU": 8})


def test_tensor_parallel_placement_whole_gpus_or_refused():
    whole = SimpleNamespace(replica_gpus=2.0, tensor_parallel_size=2, replica_cpus=4.0)
    assert replica_placement(whole) == {} and worker_share(whole) == 1.0  # the actor asks for both GPUs
    assert replica_placement(SimpleNamespace(replica_gpus=0.4, tensor_parallel_size=1, replica_cpus=1)) == {}
    with pytest.raises(ConfigError, match="a worker takes one GPU or a share of one"):
        load_config(None, ["rollout.replica_gpus=3", "rollout.tensor_parallel_size=2"])
    with pytest.raises(ResourceError, match="replicas run on CPU"):
        resolve(load_config(None, ["rollout.tensor_parallel_size=2"]), {"CPU": 8})
    load_config(None, ["rollout.replica_gpus=2", "rollout.tensor_parallel_size=2"])  # whole GPUs
    load_config(None, ["rollout.replica_gpus=1.1", "rollout.tensor_parallel_size=2"])  # shares


def test_tensor_parallel_workers_must_agree_on_what_they_received():
    from app.weights.ack_board import agreed_checksums

    same = [{"checksums": ["a", "b"]}, {"checksums": ["a", "b"]}]
    assert agreed_checksums(same, "r1", 3) == ["a", "b"]
    with pytest.raises(
        RuntimeError, match=r"replica r1: worker 1 received other bytes .* version 3 \(buckets \[1\]\)"
    ):
        agreed_checksums([{"checksums": ["a", "b"]}, {"checksums": ["a", "x"]}], "r1", 3)


def test_ipc_transport_refuses_a_cpu_end():
    info = GroupInfo(
        epoch=0,
        host="127.0.0.1",
        port=free_port(),
        world=2,
        backend="gloo",
        timeout_s=5,
        ranks={},
        transport="ipc",
    )
    with pytest.raises(Exception, match="sync.transport=broadcast"):
        ipc_mod.IpcTransport().open(info, "cpu")


_GPU = threading.local()  # which stand-in GPU the current thread's end of the IPC transport is on


def _stand_in_ipc(monkeypatch) -> dict[int, tuple[int, torch.Tensor]]:
    """CPU tensors stand in for the CUDA IPC mappings, and each thread's `_GPU.uuid` for its GPU's UUID. Returns
    the shared table: handle -> (the exporting thread's stand-in GPU, the tensor)."""
    shared: dict[int, tuple[int, torch.Tensor]] = {}

    def export(t: torch.Tensor) -> bytes:
        shared[id(t)] = (_GPU.uuid, t)
        return pickle.dumps([None] * 7 + [id(t)])

    def open_handle(meta: bytes, dev: torch.device) -> torch.Tensor:
        gpu, t = shared[pickle.loads(meta)[7]]
        assert gpu == _GPU.uuid, "a receiver mapped memory of another GPU"
        return t

    monkeypatch.setattr(ipc_mod, "export_handle", export)
    monkeypatch.setattr(ipc_mod, "open_handle", open_handle)
    monkeypatch.setattr(ipc_mod.IpcTransport, "_check_device", staticmethod(lambda d: None))
    monkeypatch.setattr(ipc_mod, "_gpu_uuid", lambda d: torch.full((16,), _GPU.uuid, dtype=torch.uint8))
    return shared


def _ipc_walk(info: GroupInfo, gpus: list[int], state: dict[str, torch.Tensor], plan) -> tuple[list, dict]:
    """Senders (ranks < info.senders) and receivers of one epoch in threads, rank r on stand-in GPU gpus[r]:
    every sender walks `plan` over `state`, every receiver loads it. Returns each sender's stats (or error) and
    each receiver's checksums and loaded tensors (or error)."""
    sent: list = [None] * info.senders
    got: dict[int, dict] = {}

    def end(rank: int) -> None:
        _GPU.uuid = gpus[rank]
        t = ipc_mod.IpcTransport()
        try:
            if rank < info.senders:
                t.open(info, "cpu") if rank == 0 else t.join(info, rank, "cpu")
                sent[rank] = t.send(plan, lambda names: [state[n] for n in names], "cpu")
            else:
                t.join(info, rank, "cpu")
                loaded: dict[str, torch.Tensor] = {}
                sums, _ = t.receive(
                    plan, lambda items: loaded.update({k: v.clone() for k, v in items}), "cpu"
                )
                got[rank] = {"sums": sums, "loaded": loaded}
        except Exception as e:  # the test asserts on it
            (got if rank >= info.senders else {})[rank] = {"error": e}
            if rank < info.senders:
                sent[rank] = e
        finally:
            t.close()

    threads = [threading.Thread(target=end, args=(r,)) for r in range(info.world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    return sent, got


def _ipc_plan():
    state = {f"w{i}": torch.randn(300 + i, 7) for i in range(5)}
    state["b"] = torch.randn(11).to(torch.bfloat16)
    plan = plan_buckets([(k, tuple(v.shape), v.dtype) for k, v in state.items()], 20_000, version=3)
    assert len(plan.buckets) >= 3
    return state, plan


def _ipc_info(world: int, senders: int = 1) -> GroupInfo:
    return GroupInfo(
        epoch=1,
        host="127.0.0.1",
        port=free_port(),
        world=world,
        backend="gloo",
        timeout_s=20,
        ranks={},
        transport="ipc",
        senders=senders,
    )


def test_ipc_protocol_with_stand_in_handles(monkeypatch):
    """The walk, descriptions, copy-done signals and checksums over a real gloo group; CPU tensors stand in
    for the CUDA IPC mappings (the GPU test runs the real ones). One trainer, two replicas on its GPU."""
    _stand_in_ipc(monkeypatch)
    state, plan = _ipc_plan()
    (stats,), got = _ipc_walk(_ipc_info(3), [7, 7, 7], state, plan)
    assert stats.buckets == len(plan.buckets) and len(stats.checksums) == len(plan.buckets)
    for rank in (1, 2):
        assert got[rank]["sums"] == stats.checksums
        for k, v in state.items():
            assert torch.equal(got[rank]["loaded"][k], v), k


def test_ipc_every_rank_sends_to_the_replica_on_its_gpu(monkeypatch):
    """Colocated on two GPUs: trainer ranks 0 and 1 (GPUs 5 and 6) both send; the receiver on GPU 6 maps rank
    1's staging buffer and the one on GPU 5 rank 0's (the stand-in open_handle refuses another GPU's)."""
    _stand_in_ipc(monkeypatch)
    state, plan = _ipc_plan()
    sent, got = _ipc_walk(_ipc_info(4, senders=2), [5, 6, 6, 5], state, plan)
    assert all(not isinstance(s, Exception) for s in sent), sent
    assert sent[0].checksums == sent[1].checksums and len(sent[0].checksums) == len(plan.buckets)
    for rank in (2, 3):
        assert "error" not in got[rank], got[rank]
        assert got[rank]["sums"] == sent[0].checksums
        for k, v in state.items():
            assert torch.equal(got[rank]["loaded"][k], v), k


def test_ipc_sender_gathers_the_next_bucket_while_the_receivers_copy(monkeypatch):
    """Double-buffered staging: the trainer gathers and packs bucket i+1 while the replicas still copy bucket i
    (slow receivers here), and never overwrites a buffer a receiver is still reading (what they loaded is
    exact)."""
    import time

    _stand_in_ipc(monkeypatch)
    state, plan = _ipc_plan()
    events: list[tuple[str, int, float]] = []
    index = {t.name: b.index for b in plan.buckets for t in b.tensors}
    info = _ipc_info(3)
    loaded: dict[int, dict[str, torch.Tensor]] = {1: {}, 2: {}}
    sent: list = [None]

    def gather(names):
        events.append(("gather", index[names[0]], time.monotonic()))
        return [state[n] for n in names]

    def load(rank):
        def f(items):
            time.sleep(0.1)  # a slow copy: the trainer's next gather must not wait for it
            loaded[rank].update({k: v.clone() for k, v in items})
            events.append(("copied", index[items[0][0]], time.monotonic()))

        return f

    def end(rank: int) -> None:
        _GPU.uuid = 7
        t = ipc_mod.IpcTransport()
        try:
            if rank == 0:
                t.open(info, "cpu")
                sent[0] = t.send(plan, gather, "cpu")
            else:
                t.join(info, rank, "cpu")
                t.receive(plan, load(rank), "cpu")
        finally:
            t.close()

    threads = [threading.Thread(target=end, args=(r,)) for r in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert sent[0] is not None and len(sent[0].checksums) == len(plan.buckets)
    for rank in (1, 2):
        for k, v in state.items():
            assert torch.equal(loaded[rank][k], v), (rank, k)
    t_gather = {i: t for kind, i, t in events if kind == "gather"}
    t_copied = {i: max(t for kind, j, t in events if kind == "copied" and j == i) for i in t_gather}
    # bucket i+1 was gathered before the copies of bucket i were done
    assert all(t_gather[i + 1] < t_copied[i] for i in range(len(plan.buckets) - 1)), events


def test_ipc_replica_on_a_gpu_without_a_trainer_rank_is_refused(monkeypatch):
    _stand_in_ipc(monkeypatch)
    state, plan = _ipc_plan()
    _sent, got = _ipc_walk(_ipc_info(3, senders=2), [5, 6, 9], state, plan)
    assert "holds no trainer rank" in str(got[2]["error"]), got


def test_source_on_same_gpu():
    u = [torch.full((16,), g, dtype=torch.uint8) for g in (1, 2, 2, 1, 3)]
    assert [ipc_mod.source_on_same_gpu(u, r, 2) for r in range(5)] == [0, 1, 1, 0, None]


class _Detok:
    def __init__(self, n: int) -> None:
        self.n = n

    def num_output_tokens(self) -> int:
        return self.n


def test_version_book_labels_tokens_at_keep_pauses():
    """vLLM 0.26 has no weight-version spans: counts read while paused mark each version's tokens."""
    book = vla._Book()
    book.current = 0
    states = {
        "a": SimpleNamespace(external_req_id="r1", request_index=0, parent_req=None, detokenizer=_Detok(3)),
        "b": SimpleNamespace(
            request_id="c1",
            request_index=1,
            parent_req=SimpleNamespace(external_req_id="r1"),
            detokenizer=_Detok(5),
        ),
    }
    engine = SimpleNamespace(output_processor=SimpleNamespace(request_states=states))
    book.mark(engine)  # pause 1: v0 sampled 3 and 5 tokens
    book.current = 1
    states["a"].detokenizer.n = 4
    book.mark(engine)  # pause 2: v1 sampled up to 4 of sample 0
    book.current = 2
    assert book.versions("r1", 0, 6, fallback=-1) == [0, 0, 0, 1, 2, 2]
    assert book.versions("r1", 1, 7, fallback=-1) == [0] * 5 + [2, 2]  # v1 sampled none of sample 1
    assert book.versions("other", 0, 2, fallback=-1) == [2, 2]
    book.forget("r1")
    assert not book.marks


def test_engines_with_native_spans_keep_no_book():
    class Native:
        async def update_weight_version(self, v: str) -> None: ...

    assert vla._book(Native()) is None
    plain = SimpleNamespace()
    assert isinstance(vla._book(plain), vla._Book) and vla._book(plain) is vla._book(plain)


def test_custom_resources_pin_roles_and_are_checked_per_node():
    """resources.rollout_custom / train_custom (a two-node cluster: rollout on one node, training on the
    other) are asked by each replica and train worker, counted in the start-up check, and checked against
    the nodes that hold them."""
    from app.infra.resources import check_nodes, custom

    cfg = load_config(
        None,
        [
            "rollout.max_replicas=2",
            "train.workers=2",
            "resources.rollout_custom={rollout_node: 0.01}",
            "resources.train_custom={train_node: 0.5}",
        ],
    )
    assert custom(cfg, "rollout") == {"rollout_node": 0.01} and custom(cfg, "train") == {"train_node": 0.5}
    need = demands(cfg)
    assert need["rollout"]["rollout_node"] == 0.02 and need["train"]["train_node"] == 1.0
    cluster = {"CPU": 8, "rollout_node": 1, "train_node": 1}
    check(cfg, cluster)
    with pytest.raises(ResourceError, match=r"1 train_node asked \(train 1\) but the cluster has 0"):
        check(cfg, {"CPU": 8, "rollout_node": 1})
    rollout_node, train_node = {"CPU": 4, "rollout_node": 1}, {"CPU": 4, "train_node": 1}
    check_nodes(cfg, [rollout_node, train_node])
    with pytest.raises(ResourceError, match="train pinned by custom resources ask for 2 CPU"):
        check_nodes(cfg, [rollout_node, {"CPU": 1, "train_node": 1}])  # its node has too few CPUs
    with pytest.raises(ResourceError, match="no node can hold one rollout replica"):
        check_nodes(cfg, [{"CPU": 0.5, "rollout_node": 1}, train_node])  # nor one replica's 1 CPU
    check_nodes(load_config(None, []), [{"CPU": 1}])  # nothing pinned: the totals' check alone
    for bad, why in (("{CPU: 1}", "not a custom resource"), ("{x: 0}", "positive number")):
        with pytest.raises(ConfigError, match=why):
            load_config(None, [f"resources.train_custom={bad}"])
