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
    ResourceError,
    auto_transport,
    check,
    check_nccl_devices,
    check_placement,
    cuda_alloc_env,
    demands,
    memory_share,
    resolve,
    role_env,
    trainer_env,
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
    assert auto_transport(merged, two) == "broadcast" and merged.sync.bucket_mb == 256
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


def test_auto_transport_picks_ipc_only_on_a_shared_gpu():
    shared = load_config(
        None, ["train.use_gpu=true", "train.workers=1", "train.worker_gpus=0.5", "rollout.replica_gpus=0.4"]
    )
    assert auto_transport(shared, {"GPU": 1}) == "ipc"
    assert auto_transport(shared, {"GPU": 2}) == "broadcast"  # Ray may place them on two GPUs
    assert auto_transport(load_config(None, []), {"GPU": 1}) == "broadcast"  # CPU roles
    assert auto_transport(load_config(None, []), {"CPU": 8}) == "broadcast"
    assert "ipc" in TRANSPORTS and transport_class("ipc") is ipc_mod.IpcTransport


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


def test_ipc_protocol_with_stand_in_handles(monkeypatch):
    """The walk, descriptions, copy-done signals and checksums over a real gloo group; CPU tensors stand in
    for the CUDA IPC mappings (the GPU test runs the real ones)."""
    shared: dict[int, torch.Tensor] = {}

    def export(t: torch.Tensor) -> bytes:
        shared[id(t)] = t
        return pickle.dumps([None] * 7 + [id(t)])

    monkeypatch.setattr(ipc_mod, "export_handle", export)
    monkeypatch.setattr(ipc_mod, "open_handle", lambda meta, dev: shared[pickle.loads(meta)[7]])
    monkeypatch.setattr(ipc_mod.IpcTransport, "_check_device", staticmethod(lambda d: None))
    monkeypatch.setattr(ipc_mod.IpcTransport, "_check_same_gpu", lambda self, rank: None)
    state = {f"w{i}": torch.randn(300 + i, 7) for i in range(5)}
    state["b"] = torch.randn(11).to(torch.bfloat16)
    plan = plan_buckets([(k, tuple(v.shape), v.dtype) for k, v in state.items()], 20_000, version=3)
    assert len(plan.buckets) >= 3
    info = GroupInfo(
        epoch=1,
        host="127.0.0.1",
        port=free_port(),
        world=3,
        backend="gloo",
        timeout_s=20,
        ranks={},
        transport="ipc",
    )
    got: dict[int, dict] = {}

    def receiver(rank: int) -> None:
        t = ipc_mod.IpcTransport()
        t.join(info, rank, "cpu")
        loaded: dict[str, torch.Tensor] = {}
        sums, timing = t.receive(plan, lambda items: loaded.update({k: v.clone() for k, v in items}), "cpu")
        got[rank] = {"sums": sums, "loaded": loaded}
        t.close()

    threads = [threading.Thread(target=receiver, args=(r,)) for r in (1, 2)]
    for th in threads:
        th.start()
    sender = ipc_mod.IpcTransport()
    sender.open(info, "cpu")
    stats = sender.send(plan, lambda names: [state[n] for n in names], "cpu")
    for th in threads:
        th.join(30)
    sender.close()
    assert stats.buckets == len(plan.buckets) and len(stats.checksums) == len(plan.buckets)
    for rank in (1, 2):
        assert got[rank]["sums"] == stats.checksums
        for k, v in state.items():
            assert torch.equal(got[rank]["loaded"][k], v), k


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
