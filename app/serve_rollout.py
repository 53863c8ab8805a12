"""Rollout: a Ray Serve deployment whose replicas each own a vLLM AsyncLLM.

Each replica's weight-group membership is app/sync.py's `ReplicaSync`: it registers with the weight
hub and long-polls it (join a new epoch, or receive a push, load it, set the engine's weight version and
acknowledge with checksums), and answers the run control's abort requests. Generation requests are token-in/token-out and
return, per sample, the token ids, the sampled tokens' log-probs, the finish reason and the policy version
of every token.

Version-gated join: a replica started while a run is under way (autoscaling, or Serve replacing a dead one)
registers, and its constructor waits until it has received and verified the current weights at the next
version boundary (the trainer re-forms the group when membership changes), or at once where the trainer is
waiting for a batch (it pushes to a replica waiting to join). Serve routes no request to a
replica before its constructor returns, so its first rollout tokens carry the current version. A replica
removed by downscaling leaves the group in its destructor, after finishing a push already announced to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

from ray import serve

from app.infra import ray_compat
from app.infra.resources import (
    bundle_gpu_ids,
    custom,
    ongoing_requests,
    replica_placement,
    samples_per_request,
    worker_share,
)
from app.names import DEPLOYMENT_NAME, NAMESPACE, control_name, hub_name
from app.records import GenerateRequest, GenerateResponse, Sample
from app.rollout.partial import partial_policy
from app.sync import ReplicaSync
from app.vllm import engine as vla
from app.vllm import replica_engine

log = logging.getLogger(__name__)

__all__ = ["RolloutServer", "build_app"]


class RolloutServer:
    """One rollout replica: a vLLM engine plus its membership of the weight group."""

    async def __init__(
        self,
        model_path: str,
        engine: dict[str, Any],
        hub: str,
        poll_s: float = 2.0,
        join_timeout_s: float = 600.0,
        partial: str = "keep",
        control: str | None = None,
        recompute_kv: bool = True,
        drain_timeout_s: float = 120.0,
        lora: dict[str, Any] | None = None,
        bundle_share: float = 0.0,
        staged: bool = False,
    ) -> None:
        import ray

        from app.infra.log_filters import quiet_dead_engine_requests

        quiet_dead_engine_requests()  # an engine's death: one line, not a traceback per failed request
        self.started = time.time()
        self.replica_id = ray_compat.replica_id()
        workers = int(engine.get("tensor_parallel_size", 1))
        if bundle_share > 0:  # tensor-parallel workers on shares of several GPUs: start them on those GPUs
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(bundle_gpu_ids(workers, bundle_share))
            log.info(
                "replica %s: %d workers on GPUs %s",
                self.replica_id,
                workers,
                os.environ["CUDA_VISIBLE_DEVICES"],
            )
        policy = partial_policy(partial)  # rollout.partial, asked by the engine and the weight loader
        self.engine = vla.create_engine(model_path, **engine, partial=policy)
        self.worker_pids: list[int] = []  # the engine's worker processes, once asked (`info`)
        self.served_any = False
        self.hub = ray.get_actor(hub, namespace=NAMESPACE)
        self.generated_tokens = 0
        self.ongoing = 0
        from app.infra.metrics import replica_metrics

        self.metrics = replica_metrics()
        self.tags = {"replica": self.replica_id}
        self.sync = ReplicaSync(
            self.engine,
            self.replica_id,
            hub=self.hub,
            control=control,
            partial=policy,
            recompute_kv=recompute_kv,
            drain_timeout_s=drain_timeout_s,
            poll_s=poll_s,
            metrics=self.metrics,
            started=self.started,
            lora=lora,
            workers=workers,
            staged=staged,
        )
        await self.sync.start(join_timeout_s)

    @property
    def version(self) -> int:
        """The weight version this replica holds (-1: weights from disk, not yet verified)."""
        return self.sync.version

    # ------------------------------------------------------------ generation

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        """Token-in/token-out: `req.n` samples of `req.prompt_ids`, each with its tokens' behaviour log-probs
        and policy versions (unscored)."""
        if not self.served_any:
            self.served_any = True
            with contextlib.suppress(Exception):
                await self.hub.served.remote(self.replica_id, self.version)
        self.ongoing += 1
        self.metrics.set("relay_replica_ongoing_requests", self.ongoing, self.tags)
        try:
            async with self.sync.gate.admit():  # partial=off: waits while a push drains this replica
                samples = await self._generate(req)
        finally:
            self.ongoing -= 1
            self.metrics.set("relay_replica_ongoing_requests", self.ongoing, self.tags)
        n_tok = sum(len(s["token_ids"]) for s in samples)
        self.generated_tokens += n_tok
        self.metrics.inc("relay_generated_tokens", n_tok, self.tags)
        return GenerateResponse(
            samples=[Sample(**s, replica=self.replica_id) for s in samples],
            replica=self.replica_id,
            version=self.version,
        )

    async def _generate(self, req: GenerateRequest) -> list[dict[str, Any]]:
        """The samples, tagged with the version this replica holds when the request enters the engine (with
        LoRA: generated with, and tagged with, the adapter it was admitted under, `req.adapter` or the newest).
        A seeded request for `n` samples runs as `n` engine requests seeded `seed`, `seed + 1`, ...: the
        samples a group's per-sample requests would give (`rollout.group_requests`)."""
        async with self.sync.adapter(req.adapter) as adapter:
            return await replica_engine.generate_request(self.engine, req, self.version, adapter)

    async def completion_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> dict[str, Any]:
        """Log-probs of a fixed completion under this replica's newest weights (base + adapter, with LoRA)."""
        async with self.sync.adapter() as adapter:
            lps = await vla.completion_logprobs(self.engine, prompt_ids, completion_ids, adapter)
            version = adapter.version if adapter is not None else self.version
        return {"logprobs": lps, "version": version, "replica": self.replica_id}

    async def loaded_checksums(self) -> dict[str, Any]:
        """For each tensor of the last push, the checksum of what the engine holds in its place (each worker's
        answer; see `RelayWorkerExtension.relay_loaded_checksums`): verifies a load bit for bit."""
        return {
            "replica": self.replica_id,
            "version": self.version,
            "workers": await vla.rpc(self.engine, "relay_loaded_checksums"),
        }

    async def info(self) -> dict[str, Any]:
        import os

        import psutil

        children = [c.pid for c in psutil.Process().children(recursive=True)]
        return {
            "pid": os.getpid(),
            "child_pids": children,
            "replica": self.replica_id,
            "version": self.version,
            "epoch": self.sync.epoch,
            "generated_tokens": self.generated_tokens,
            "ongoing": self.ongoing,
            "engine_pids": await self._engine_pids(),
            "engine_log_stats": getattr(self.engine, "log_stats", None),  # None: vLLM renamed it
            "last_error": self.sync.last_error,
            "uptime_s": time.time() - self.started,
        }

    async def _engine_pids(self) -> list[int]:
        """Its vLLM workers' processes, asked once (they live as long as the engine); [] while the engine does
        not answer within 5 s (dead or stuck)."""
        if not self.worker_pids:
            try:
                self.worker_pids = await asyncio.wait_for(
                    vla.rpc(self.engine, "relay_pid", timeout=5), timeout=6
                )
            except Exception:
                return []
        return self.worker_pids

    async def check_health(self) -> None:
        """Fails when the engine is dead or the weight sync stopped: Serve then replaces this replica."""
        await self.sync.check_health()

    async def __del__(self) -> None:
        """Serve calls this when it removes the replica (downscaling, redeploy, shutdown): leave the weight
        group cleanly (finishing a push already announced to this replica), then stop the engine."""
        with contextlib.suppress(Exception):
            await self.sync.stop()
        with contextlib.suppress(Exception):
            vla.shutdown(self.engine)


def build_app(cfg, model_path: str):
    """The Serve application for `cfg.rollout` (autoscaling settings included)."""
    r = cfg.rollout
    engine = replica_engine.engine_args(cfg)  # as `python -m app eval` builds its in-process engine
    placement = replica_placement(r, custom(cfg, "rollout"))
    opts: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": {
            "num_cpus": r.replica_cpus,
            # placed by bundles: the actor takes the first worker's share, the bundles hold the others'
            "num_gpus": worker_share(r) if placement else r.replica_gpus,
            "resources": custom(cfg, "rollout"),  # resources.rollout_custom: only nodes that have them
            # a CPU replica is hidden from every GPU (a GPU build of vLLM is refused it: check_placement)
            "runtime_env": {"env_vars": replica_engine.engine_env(cfg)},
        },
        "max_ongoing_requests": ongoing_requests(cfg),
        "health_check_period_s": 10,
        "health_check_timeout_s": 60,
        "graceful_shutdown_timeout_s": 30,  # time to finish an announced push and leave the group
        # one access-log line per generate request was 98% of a default run's log: only at log_level=DEBUG
        "logging_config": {"enable_access_log": cfg.log_level == "DEBUG"},
        **placement,
    }
    if r.scaling == "auto" and r.max_replicas > r.min_replicas:
        opts["autoscaling_config"] = {
            "min_replicas": r.min_replicas,
            "max_replicas": r.max_replicas,
            # in samples: a group request carries n of them
            "target_ongoing_requests": r.target_ongoing_requests / samples_per_request(r),
            "upscale_delay_s": 5,
            "downscale_delay_s": 30,
        }
    else:
        opts["num_replicas"] = r.min_replicas
    return serve.deployment(RolloutServer, **opts).bind(
        model_path,
        engine,
        hub_name(cfg.ray.name),
        2.0,
        r.join_timeout_s,
        r.partial,
        control=control_name(cfg.ray.name),
        recompute_kv=r.recompute_kv,
        drain_timeout_s=r.request_timeout_s,  # partial=off: requests inside finish first, each within this
        lora=adapter_spec(cfg, model_path),
        bundle_share=worker_share(r) if placement else 0.0,
        staged=bool(cfg.sync.staged_receive),
    )


def adapter_spec(cfg: Any, model_path: str) -> dict[str, Any] | None:
    """What a replica writes into each pushed adapter's adapter_config.json (None without LoRA)."""
    from app.trainer.lora import LoraSpec

    spec = LoraSpec.from_config(cfg.model.lora)
    if spec is None:
        return None
    return {
        "rank": spec.rank,
        "alpha": spec.alpha,
        "dropout": spec.dropout,
        "targets": list(spec.targets),
        "base_model": model_path,
    }
