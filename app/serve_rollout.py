"""Rollout: a Ray Serve deployment whose replicas each own a vLLM AsyncLLM.

Each replica registers with the weight hub (app/sync.py's WeightHub, run as a named Ray actor) and runs one
background loop that long-polls it: join a new epoch of the weight group, or receive a push, load it, set
the engine's weight version and acknowledge with checksums. Generation requests are token-in/token-out and
return, per sample, the token ids, the sampled tokens' log-probs, the finish reason and the policy version
of every token.

Version-gated join: a replica started while a run is under way (autoscaling, or Serve replacing a dead one)
registers, and its constructor waits until it has received and verified the current weights at the next
version boundary (the trainer re-forms the group when membership changes). Serve routes no request to a
replica before its constructor returns, so its first rollout tokens carry the current version. A replica
removed by downscaling leaves the group in its destructor, after finishing a push already announced to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from ray import serve

from app import vllm_adapter as vla

log = logging.getLogger(__name__)

DEPLOYMENT_NAME = "rollout"
NAMESPACE = "relay"  # named actors (hub, rollouter) live here, reachable from Serve replicas and jobs


def hub_name(prefix: str) -> str:
    return f"{prefix}-weight-hub"


def app_name(prefix: str) -> str:
    return f"{prefix}-rollout"


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
    ) -> None:
        import ray

        self.started = time.time()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = vla.create_engine(model_path, **engine)
        self.workers = 1  # tensor parallel size; each worker is one receiver rank
        self.version = -1  # weights from disk, not yet verified against the trainer's
        self.epoch = -1
        self.abort_seen = -1  # the hub's abort requests handled (set at registration)
        self.served_any = False
        self.leaving = False
        self.admitted = asyncio.Event()
        self.last_error: str | None = None
        self.hub = ray.get_actor(hub, namespace=NAMESPACE)
        self.poll_s = poll_s
        self.partial = partial
        self.generated_tokens = 0
        self.ongoing = 0
        from app.metrics import replica_metrics

        self.metrics = replica_metrics()
        self.tags = {"replica": self.replica_id}
        await vla.set_version(self.engine, self.version)
        need = await self.hub.register.remote(self.replica_id, self.workers, self.started)
        self.abort_seen = await self.hub.abort_count.remote()
        self.loop_task = asyncio.get_running_loop().create_task(self._sync_loop())
        if need < 0:  # the run is starting: the trainer's first push comes before any rollout
            self.admitted.set()
            return
        log.info("replica %s waits for the weights of version >= %d before serving", self.replica_id, need)
        try:
            await asyncio.wait_for(self.admitted.wait(), timeout=join_timeout_s)
        except asyncio.TimeoutError:
            self.loop_task.cancel()
            raise TimeoutError(
                f"replica {self.replica_id} did not receive the current weights (version >= {need}) within "
                f"rollout.join_timeout_s={join_timeout_s}s; last error: {self.last_error}; is the trainer "
                "still pushing?"
            ) from None
        log.info("replica %s admitted at version %d", self.replica_id, self.version)

    # ------------------------------------------------------------ generation

    async def generate(self, req: dict[str, Any]) -> dict[str, Any]:
        """req: prompt_ids, n, max_tokens, temperature, top_p, seed (optional)."""
        if not self.served_any:
            self.served_any = True
            with contextlib.suppress(Exception):
                await self.hub.served.remote(self.replica_id, self.version)
        self.ongoing += 1
        self.metrics.set("relay_replica_ongoing_requests", self.ongoing, self.tags)
        try:
            samples = await vla.generate(
                self.engine,
                req["prompt_ids"],
                n=req["n"],
                max_tokens=req["max_tokens"],
                temperature=req["temperature"],
                top_p=req.get("top_p", 1.0),
                version=self.version,
                seed=req.get("seed"),
                ignore_eos=req.get("ignore_eos", False),
            )
        finally:
            self.ongoing -= 1
            self.metrics.set("relay_replica_ongoing_requests", self.ongoing, self.tags)
        n_tok = sum(len(s["token_ids"]) for s in samples)
        self.generated_tokens += n_tok
        self.metrics.inc("relay_generated_tokens", n_tok, self.tags)
        return {"samples": samples, "replica": self.replica_id, "version": self.version}

    async def completion_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> dict[str, Any]:
        lps = await vla.completion_logprobs(self.engine, prompt_ids, completion_ids)
        return {"logprobs": lps, "version": self.version, "replica": self.replica_id}

    async def info(self) -> dict[str, Any]:
        import os

        import psutil

        children = [c.pid for c in psutil.Process().children(recursive=True)]
        return {
            "pid": os.getpid(),
            "child_pids": children,
            "replica": self.replica_id,
            "version": self.version,
            "epoch": self.epoch,
            "generated_tokens": self.generated_tokens,
            "last_error": self.last_error,
            "uptime_s": time.time() - self.started,
        }

    async def check_health(self) -> None:
        if self.loop_task.done():
            exc = self.loop_task.exception() if not self.loop_task.cancelled() else None
            raise RuntimeError(f"weight-sync loop of replica {self.replica_id} stopped: {exc!r}")

    # ------------------------------------------------------------ weight sync (control plane: the hub)

    async def _sync_loop(self) -> None:
        while True:
            try:
                instr = await self.hub.next_instruction.remote(
                    self.replica_id, self.epoch, self.version, self.poll_s, self.abort_seen
                )
            except Exception as e:  # the hub is gone: the run is over or restarting
                if self.leaving:
                    return
                self.last_error = f"hub unreachable: {e}"
                await asyncio.sleep(self.poll_s)
                continue
            kind = instr["kind"]
            if kind == "leave":
                return
            if kind == "unknown":
                await self.hub.register.remote(self.replica_id, self.workers, self.started)
            elif kind == "join":
                await self._join(instr)
            elif kind == "push":
                await self._receive(instr["plan"])
            elif kind == "abort":
                await self._abort(instr["seq"])

    async def _abort(self, seq: int) -> None:
        """End every in-flight generation now: each returns its tokens so far with finish reason 'abort'
        (the rollouter saves them as partial rollouts in a checkpoint)."""
        try:
            await vla.pause(self.engine, "resubmit")
            await vla.resume(self.engine)
            ok, detail = True, {}
        except Exception as e:
            ok, detail = False, {"error": str(e)}
        self.abort_seen = seq
        with contextlib.suppress(Exception):
            await self.hub.ack.remote(self.replica_id, "abort", seq, ok, detail)

    async def _join(self, instr: dict[str, Any]) -> None:
        from app.vllm_worker import group_to_json

        g = instr["group"]
        try:
            res = await vla.rpc(
                self.engine,
                "relay_join",
                timeout=g.timeout_s + 5,
                group_json=group_to_json(g),
                first_rank=instr["rank"],
            )
            self.epoch = g.epoch
            await self.hub.ack.remote(self.replica_id, "join", g.epoch, True, {"workers": res})
        except Exception as e:
            self.last_error = f"join of epoch {g.epoch} failed: {e}"
            log.warning("replica %s: %s", self.replica_id, self.last_error)
            await self.hub.ack.remote(self.replica_id, "join", g.epoch, False, {"error": str(e)})

    async def _receive(self, plan) -> None:
        from app.vllm_worker import plan_to_json

        t0 = time.perf_counter()
        try:
            await vla.pause(self.engine, self.partial)
            try:
                res = await vla.rpc(self.engine, "relay_receive", timeout=None, plan_json=plan_to_json(plan))
            finally:
                self.version = plan.version
                await vla.set_version(self.engine, plan.version)
                self.metrics.set("relay_replica_weight_version", plan.version, self.tags)
                await vla.resume(self.engine)
            checksums = res[0]["checksums"]
            self.admitted.set()
            await self.hub.ack.remote(
                self.replica_id,
                "push",
                plan.version,
                True,
                {
                    "checksums": checksums,
                    "transfer_s": res[0]["transfer_s"],
                    "load_s": res[0]["load_s"],
                    "pause_s": time.perf_counter() - t0,
                },
            )
        except Exception as e:
            self.last_error = f"receive of version {plan.version} failed: {e}"
            log.warning("replica %s: %s", self.replica_id, self.last_error)
            with contextlib.suppress(Exception):
                await self.hub.ack.remote(self.replica_id, "push", plan.version, False, {"error": str(e)})
            self.epoch = -1  # rejoin at the next epoch

    async def __del__(self) -> None:
        """Serve calls this when it removes the replica (downscaling, redeploy, shutdown): leave the weight
        group cleanly (finishing a push already announced to this replica), then stop the engine."""
        self.leaving = True
        try:
            await asyncio.wait_for(self.hub.leave.remote(self.replica_id), timeout=5)
            await asyncio.wait_for(asyncio.shield(self.loop_task), timeout=20)
        except Exception as e:  # the hub is gone (end of run) or a push never finished
            log.info("replica %s: leaving without the hub's goodbye: %r", self.replica_id, e)
        with contextlib.suppress(Exception):
            self.loop_task.cancel()
        with contextlib.suppress(Exception):
            vla.shutdown(self.engine)


def build_app(cfg, model_path: str):
    """The Serve application for `cfg.rollout` (autoscaling settings included)."""
    r = cfg.rollout
    use_gpu = r.replica_gpus > 0
    engine = dict(
        dtype=cfg.model.dtype,
        max_model_len=r.max_model_len,
        max_num_seqs=r.max_num_seqs,
        gpu_memory_utilization=r.gpu_memory_utilization,
        seed=cfg.seed,
        use_gpu=use_gpu,
    )
    opts: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": {
            "num_cpus": r.replica_cpus,
            "num_gpus": r.replica_gpus,
            "runtime_env": {"env_vars": {} if use_gpu else vla.cpu_env(r.kv_cache_gib)},
        },
        "max_ongoing_requests": max(64, r.max_num_seqs),
        "health_check_period_s": 10,
        "health_check_timeout_s": 60,
        "graceful_shutdown_timeout_s": 30,  # time to finish an announced push and leave the group
    }
    if r.scaling == "auto" and r.max_replicas > r.min_replicas:
        opts["autoscaling_config"] = {
            "min_replicas": r.min_replicas,
            "max_replicas": r.max_replicas,
            "target_ongoing_requests": r.target_ongoing_requests,
            "upscale_delay_s": 5,
            "downscale_delay_s": 30,
        }
    else:
        opts["num_replicas"] = r.min_replicas
    return serve.deployment(RolloutServer, **opts).bind(
        model_path, engine, hub_name(cfg.ray.name), 2.0, r.join_timeout_s, r.partial
    )
