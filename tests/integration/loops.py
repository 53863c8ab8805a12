"""Train-worker loops used by integration tests (importable by Ray workers through PYTHONPATH)."""

from __future__ import annotations

import json
from typing import Any


def logprob_loop(config: dict[str, Any]) -> None:
    """Push v0, train one step on a rollout batch, push v1; compare trainer and replica log-probs."""
    import ray
    import torch
    from omegaconf import OmegaConf
    from ray import serve

    from app.names import DEPLOYMENT_NAME, NAMESPACE, app_name, hub_name, rollouter_name
    from app.sync import TrainerSync
    from app.trainer.comm import bcast
    from app.trainer.learner import Learner

    cfg = OmegaConf.create(config["cfg"])
    # the GPU test (tests/gpu/test_loop_gpu.py) runs this on cuda with the IPC transport
    dev = torch.device("cuda", torch.cuda.current_device()) if config.get("cuda") else torch.device("cpu")
    learner = Learner(cfg, config["model_path"], dev)
    sync = TrainerSync(cfg, learner, ray.get_actor(hub_name(cfg.ray.name), namespace=NAMESPACE), dev)
    handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app_name(cfg.ray.name))
    _push(sync, 0)
    batch = None
    if learner.rank == 0:
        batch = ray.get(
            ray.get_actor(rollouter_name(cfg.ray.name), namespace=NAMESPACE).generate_batch.remote(4),
            timeout=120,
        )
    batch = bcast(batch)
    g = batch.groups[0]
    prompt, completion = g.prompt_ids, g.samples[0].token_ids
    before = learner.logprobs_of(prompt, completion)
    vllm_before = (
        handle.completion_logprobs.remote(prompt, completion).result(timeout_s=60)
        if learner.rank == 0
        else None
    )
    learner.step(batch)
    push = sync.push(1)
    at_return = {rid: dict(x) for rid, x in push.extra.items()}  # the workers' answers, as the push returned
    sync.settle(30.0)  # then each replica's own (version set, resumed, its phases); rank 0's
    after = learner.logprobs_of(prompt, completion)
    if learner.rank == 0:
        vllm_after = handle.completion_logprobs.remote(prompt, completion).result(timeout_s=60)
        info = handle.info.remote().result(timeout_s=60)
        out = {
            "trainer_before": before,
            "trainer_after": after,
            "vllm_before": vllm_before,
            "vllm_after": vllm_after,
            "replica_version": info["version"],
            "push_bytes": push.nbytes,
            "push_buckets": push.buckets,
            "push": {"total_s": push.total_s, "transfer_s": push.transfer_s, "ack_s": push.ack_s},
            "acked_via": push.acked_via,
            "acks": push.extra,
            "acks_at_return": at_return,
            "push_checksums": push.checksums,
            "transport": sync.transport_name,
            "token_versions": [s.versions for s in g.samples],
        }
        with open(config["out"], "w") as f:
            json.dump(out, f)


# ---------------------------------------------------------------- the 2-GPU tier (tests/gpu/test_disagg_gpu.py)


def _trainer_checksums(learner: Any) -> dict[str, str]:
    """The trainer's checksum of every tensor it pushes (a collective on every trainer rank)."""
    from app.weights.buckets import checksum

    names = [n for n, _, _ in learner.push_specs()]
    return {n: checksum(t.reshape(-1)) for n, t in zip(names, learner.gather(names), strict=True)}


def _compare(mine: dict[str, str], theirs: dict[str, Any]) -> dict[str, Any]:
    """A replica's `loaded_checksums` against the trainer's checksums."""
    worker = theirs["workers"][0]
    held = worker["checksums"]
    return {
        "replica": theirs["replica"],
        "version": theirs["version"],
        "compared": len(held),
        "skipped": worker.get("skipped", []),
        "why": worker.get("why"),
        "unequal": sorted(n for n in held if held[n] != mine.get(n)),
        "missing": sorted(set(mine) - set(held) - set(worker.get("skipped", []))),
    }


def _exact(learner: Any, handle: Any) -> dict[str, Any]:
    """The trainer's checksum of every pushed tensor against what the replica's engine holds in its place."""
    mine = _trainer_checksums(learner)
    return _compare(mine, handle.loaded_checksums.remote().result(timeout_s=60))


def _until(what: str, fn: Any, timeout_s: float) -> Any:
    """Poll `fn()` until it returns something truthy, under a deadline; raise naming `what`."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:.0f}s")
        time.sleep(0.005)


def _push(sync: Any, version: int) -> Any:
    """A push, then (rank 0) its replicas' own answers, which follow their workers' acknowledgements and
    carry each replica's phases (`TrainerSync.settle`)."""
    stats = sync.push(version)
    sync.settle(30.0)  # rank 0's; a no-op elsewhere
    return stats


def _push_mid_generation(sync: Any, handle: Any, version: int, cfg: Any) -> dict[str, Any]:
    """Long generations in flight, then a push (keep mode): their tokens must carry both versions."""
    from app.records import GenerateRequest

    req = GenerateRequest(
        prompt_ids=[5, 6, 7, 8], max_tokens=cfg.rollout.max_model_len - 8, n=4, ignore_eos=True
    )
    calls = [handle.generate.remote(req) for _ in range(8)]
    _until("a generation in flight", lambda: handle.info.remote().result(timeout_s=30)["ongoing"] > 0, 60)
    stats = _push(sync, version)
    outs = [c.result(timeout_s=120) for c in calls]
    versions = [s.versions for o in outs for s in o.samples]
    return {"push": stats.record(), "versions": versions}


def _push_through_engine_kill(sync: Any, hub: Any, handle: Any, version: int) -> dict[str, Any]:
    """The replica's engine is frozen (SIGSTOP) before the push and SIGKILLed once the push is announced,
    as a crash mid-push: that try must fail naming the replica, and the push completes on the replica Serve
    starts in its place (the version-gated join)."""
    import os
    import signal
    import threading
    import time

    import ray

    info = handle.info.remote().result(timeout_s=30)
    victim, core = info["replica"], info["engine_pids"][0]  # the vLLM worker: the EngineCore process (TP 1)
    os.kill(core, signal.SIGSTOP)
    box: dict[str, Any] = {}

    def push() -> None:
        try:
            box["stats"] = _push(sync, version)
        except Exception as e:  # recorded: the test asserts what it says
            box["error"] = repr(e)

    t0 = time.monotonic()
    th = threading.Thread(target=push, daemon=True)
    th.start()
    _until(
        f"the announcement of v{version}",
        lambda: ray.get(hub.status.remote(), timeout=30)["last_push"].get("version") == version,
        60,
    )
    os.kill(core, signal.SIGKILL)
    th.join(timeout=sync._budget_s() + 60)
    after = ray.get(hub.status.remote(), timeout=30)
    return {
        "victim": victim,
        "elapsed_s": time.monotonic() - t0,
        "push": box["stats"].record() if "stats" in box else None,
        "error": box.get("error"),
        "dropped": after["members"][victim].get("dropped"),
        "alive_after": th.is_alive(),
    }


def disagg_loop(config: dict[str, Any]) -> None:
    """The 2-GPU tier: the trainer (this Ray Train worker, GPU0) pushes over NCCL into a Serve vLLM replica
    (GPU1) through the real TrainerSync and WeightHub; writes what happened to `config["out"]` as JSON."""
    import ray
    import torch
    from omegaconf import OmegaConf
    from ray import serve

    from app.names import DEPLOYMENT_NAME, NAMESPACE, app_name, hub_name, rollouter_name
    from app.sync import TrainerSync
    from app.trainer.learner import Learner

    cfg = OmegaConf.create(config["cfg"])
    cuda = config.get("cuda", True)  # False: the same scenario on CPU over gloo (a check of this harness)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    learner = Learner(cfg, config["model_path"], dev)
    hub = ray.get_actor(hub_name(cfg.ray.name), namespace=NAMESPACE)
    sync = TrainerSync(cfg, learner, hub, dev)
    handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app_name(cfg.ray.name))
    out: dict[str, Any] = {"transport": sync.transport_name, "backend": sync.backend, "pushes": []}
    out["pushes"].append(_push(sync, 0).record())
    out["exact_v0"] = _exact(learner, handle)
    rollouter = ray.get_actor(rollouter_name(cfg.ray.name), namespace=NAMESPACE)
    batch = ray.get(rollouter.generate_batch.remote(4), timeout=120)
    g = batch.groups[0]
    prompt, completion = g.prompt_ids, g.samples[0].token_ids
    out["trainer_before"] = learner.logprobs_of(prompt, completion)
    out["vllm_before"] = handle.completion_logprobs.remote(prompt, completion).result(timeout_s=60)
    learner.step(batch)
    out["pushes"].append(_push(sync, 1).record())
    out["exact_v1"] = _exact(learner, handle)
    out["trainer_after"] = learner.logprobs_of(prompt, completion)
    out["vllm_after"] = handle.completion_logprobs.remote(prompt, completion).result(timeout_s=60)
    for v in range(2, 2 + int(config.get("timed_pushes", 8))):  # back to back: the push alone
        out["pushes"].append(_push(sync, v).record())
    v = 2 + int(config.get("timed_pushes", 8))
    out["keep"] = _push_mid_generation(sync, handle, v, cfg)
    if config.get("kill", True):
        out["kill"] = _push_through_engine_kill(sync, hub, handle, v + 1)
    if out.get("kill", {}).get("push") is not None:
        out["after_kill"] = _push(sync, v + 2).record()
        out["exact_after_kill"] = _exact(learner, handle)
    with open(config["out"], "w") as f:
        json.dump(out, f)


# ---------------------------------------------------------------- every GPU of a box (tests/gpu/test_colocated_gpu.py)


def _each_replica(handle: Any, replicas: int, ask: Any, timeout_s: float = 120) -> dict[str, Any]:
    """`ask(handle)` (a Serve call whose answer names its replica) until every one of `replicas` answered."""
    import time

    seen: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only replicas {sorted(seen)} of {replicas} answered within {timeout_s:.0f}s")
        got = ask(handle)
        seen.setdefault(got["replica"], got)
    return seen


def colocated_loop(config: dict[str, Any]) -> None:
    """Every GPU holds a trainer rank and a replica (issue 30): each rank pushes to the replica on its own GPU
    by CUDA IPC. Push v0, train one step, push v1, then timed pushes; every replica's log-probs and loaded
    bytes are compared with the trainer's. Rank 0 writes the report to `config["out"]`."""
    import ray
    import torch
    from omegaconf import OmegaConf
    from ray import serve

    from app.names import DEPLOYMENT_NAME, NAMESPACE, app_name, hub_name, rollouter_name
    from app.sync import TrainerSync
    from app.trainer.comm import bcast
    from app.trainer.learner import Learner

    cfg = OmegaConf.create(config["cfg"])
    dev = torch.device("cuda", torch.cuda.current_device())
    learner = Learner(cfg, config["model_path"], dev)
    hub = ray.get_actor(hub_name(cfg.ray.name), namespace=NAMESPACE)
    sync = TrainerSync(cfg, learner, hub, dev)
    handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app_name(cfg.ray.name))
    pushes = [_push(sync, 0).record()]
    batch = None
    if learner.rank == 0:
        rollouter = ray.get_actor(rollouter_name(cfg.ray.name), namespace=NAMESPACE)
        batch = ray.get(rollouter.generate_batch.remote(4), timeout=120)
    batch = bcast(batch)
    g = batch.groups[0]
    prompt, completion = g.prompt_ids, g.samples[0].token_ids
    before = learner.logprobs_of(prompt, completion)
    learner.step(batch)
    pushes.append(_push(sync, 1).record())
    after = learner.logprobs_of(prompt, completion)
    mine = _trainer_checksums(learner)
    for v in range(2, 2 + int(config.get("timed_pushes", 8))):  # back to back: the push alone
        pushes.append(_push(sync, v).record())
    if learner.rank != 0:
        return
    n = int(cfg.rollout.max_replicas)
    lps = _each_replica(
        handle, n, lambda h: h.completion_logprobs.remote(prompt, completion).result(timeout_s=60)
    )
    exact = _each_replica(handle, n, lambda h: h.loaded_checksums.remote().result(timeout_s=60))
    out = {
        "transport": sync.transport_name,
        "senders": sync.senders,
        "world": learner.world,
        "pushes": pushes,
        "trainer_before": before,
        "trainer_after": after,
        "vllm_after": lps,
        "exact": {rid: _compare(mine, theirs) for rid, theirs in exact.items()},
        "hub": ray.get(hub.status.remote(), timeout=30),
    }
    with open(config["out"], "w") as f:
        json.dump(out, f, default=str)


# ---------------------------------------------------------------- a real model on CPU (tests/integration/test_real_model.py)


def _lp_pair(learner: Any, handle: Any, prompt: list[int], completion: list[int]) -> dict[str, Any]:
    """The trainer's and the replica's log-probs of one fixed completion, and the replica's version."""
    theirs = handle.completion_logprobs.remote(prompt, completion).result(timeout_s=120)
    return {
        "trainer": learner.logprobs_of(prompt, completion),
        "vllm": theirs["logprobs"],
        "version": theirs["version"],
    }


def _batch_record(batch: Any) -> list[dict[str, Any]]:
    """What a test reads of a rollout batch: each group's prompt and each sample's tokens, reward, ending."""
    return [
        {
            "uid": g.uid,
            "prompt_ids": list(g.prompt_ids),
            "answer": g.answer,
            "samples": [
                {
                    "token_ids": list(s.token_ids),
                    "text": s.text,
                    "versions": list(s.versions),
                    "finish_reason": s.finish_reason,
                    "reward": s.reward,
                    "reward_extras": dict(s.reward_extras),
                    "reward_error": s.reward_error,
                }
                for s in g.samples
            ],
        }
        for g in batch.groups
    ]


def real_model_loop(config: dict[str, Any]) -> None:
    """The two-step run on one trainer rank (the real model's Adam state fills a 2-core machine's share).

    Before any push, a greedy response to `config["probe"]` (prompt ids) and the replica's log-probs of it,
    twice, under the weights it loaded from disk; then push v0 (the same values), and those log-probs again.
    Then a rollout batch, the log-probs of one sampled response on both sides, step, push v1, a second batch,
    step, push v2. After every push: the trainer's checksums of what it pushed, each vLLM worker's of what it
    received, the replica's read-back (`loaded_checksums`) compared with them, and the log-probs of the
    sampled response again. Writes the record to `config["out"]` as JSON."""
    import time

    import ray
    import torch
    from omegaconf import OmegaConf
    from ray import serve

    from app.names import DEPLOYMENT_NAME, NAMESPACE, app_name, hub_name, rollouter_name
    from app.records import GenerateRequest
    from app.sync import TrainerSync
    from app.trainer.learner import Learner

    cfg = OmegaConf.create(config["cfg"])
    timeout_s = float(config.get("timeout_s", 300))
    # the GPU tier (tests/gpu/test_real_model_gpu.py) runs this on cuda
    dev = torch.device("cuda", torch.cuda.current_device()) if config.get("cuda") else torch.device("cpu")
    t0 = time.monotonic()
    learner = Learner(cfg, config["model_path"], dev)
    if learner.world != 1:
        raise ValueError(f"real_model_loop runs on one trainer rank, not {learner.world}")
    sync = TrainerSync(cfg, learner, ray.get_actor(hub_name(cfg.ray.name), namespace=NAMESPACE), dev)
    handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app_name(cfg.ray.name))
    rollouter = ray.get_actor(rollouter_name(cfg.ray.name), namespace=NAMESPACE)
    out: dict[str, Any] = {"build_s": time.monotonic() - t0, "pushes": [], "exact": [], "steps": []}
    out["trainer_checksums"], out["acks"], out["batches"] = [], [], []

    def push(version: int) -> None:
        stats = _push(sync, version)
        out["pushes"].append(stats.record())
        out["acks"].append(
            {"pushed": stats.checksums, "received": {r: a["checksums"] for r, a in stats.extra.items()}}
        )
        mine = _trainer_checksums(learner)
        out["trainer_checksums"].append(mine)
        out["exact"].append(_compare(mine, handle.loaded_checksums.remote().result(timeout_s=120)))

    probe = list(config["probe"])
    req = GenerateRequest(prompt_ids=probe, max_tokens=int(cfg.rollout.max_tokens), temperature=0.0)
    answer = list(handle.generate.remote(req).result(timeout_s=timeout_s).samples[0].token_ids)
    ask = lambda: handle.completion_logprobs.remote(probe, answer).result(timeout_s=120)  # noqa: E731
    out["probe"] = {"completion": answer, "disk": [ask(), ask()]}
    push(0)
    out["probe"]["v0"] = ask()

    prompt: list[int] = []
    completion: list[int] = []
    for version in (1, 2):
        t = time.monotonic()
        batch = ray.get(rollouter.generate_batch.remote(int(cfg.train.batch_groups)), timeout=timeout_s)
        out["batches"].append({"generate_s": time.monotonic() - t, "groups": _batch_record(batch)})
        if version == 1:  # one sampled response of the pretrained policy, followed through both steps
            prompt, completion = list(batch.groups[0].prompt_ids), list(batch.groups[0].samples[0].token_ids)
            out["logprobs"] = [_lp_pair(learner, handle, prompt, completion)]
        t = time.monotonic()
        out["steps"].append({**learner.step(batch), "step_s": time.monotonic() - t})
        push(version)
        out["logprobs"].append(_lp_pair(learner, handle, prompt, completion))
    out["replica"] = handle.info.remote().result(timeout_s=60)["version"]
    out["pushed"] = [n for n, _, _ in learner.push_specs()]
    out["wall_s"] = time.monotonic() - t0
    with open(config["out"], "w") as f:
        json.dump(out, f)
