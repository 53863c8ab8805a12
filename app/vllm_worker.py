"""Runs inside each vLLM worker process: joins the weight group and loads pushed buckets.

vLLM imports this class through the engine argument `worker_extension_cls` and mixes it into its Worker,
so its methods are reachable with `collective_rpc`. Arguments travel as JSON strings (tensors passed as RPC
arguments arrive as lists); tensors travel only through the weight group (see app/sync.py).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch

from app.sync import Bucket, GroupInfo, PushPlan, StatelessGroup, TensorSpec, receive_buckets

log = logging.getLogger(__name__)


def plan_to_json(plan: PushPlan) -> str:
    return json.dumps(
        {
            "version": plan.version,
            "buckets": [
                {
                    "index": b.index,
                    "dtype": b.dtype,
                    "numel": b.numel,
                    "tensors": [[t.name, list(t.shape), t.dtype, t.offset] for t in b.tensors],
                }
                for b in plan.buckets
            ],
        }
    )


def plan_from_json(s: str) -> PushPlan:
    d = json.loads(s)
    buckets = tuple(
        Bucket(
            b["index"],
            b["dtype"],
            b["numel"],
            tuple(TensorSpec(n, tuple(shape), dt, off) for n, shape, dt, off in b["tensors"]),
        )
        for b in d["buckets"]
    )
    return PushPlan(d["version"], buckets)


def group_to_json(g: GroupInfo) -> str:
    return json.dumps(g.__dict__)


class RelayWorkerExtension:
    """Mixed into vLLM's Worker. `self` is the worker: it has get_model(), model_config, device, rank."""

    def _relay_device(self) -> torch.device:
        dev = getattr(self, "device", None)
        return dev if isinstance(dev, torch.device) else torch.device("cpu")

    def relay_join(self, group_json: str, first_rank: int) -> dict[str, Any]:
        info = json.loads(group_json)
        old = getattr(self, "_relay_group", None)
        if old is not None:
            old.close()
        rank = first_rank + int(getattr(self, "rank", 0) or 0)
        t0 = time.perf_counter()
        self._relay_group = StatelessGroup(
            info["host"],
            info["port"],
            rank,
            info["world"],
            info["backend"],
            info["timeout_s"],
            epoch=info["epoch"],
            device=self._relay_device(),
        )
        return {"rank": rank, "join_s": time.perf_counter() - t0}

    def relay_receive(self, plan_json: str) -> dict[str, Any]:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        group = getattr(self, "_relay_group", None)
        if group is None:
            raise RuntimeError("relay_receive before relay_join: this worker is not in the weight group")
        plan = plan_from_json(plan_json)
        model = self.get_model()
        # On CPU, linear layers pre-pack their weights and drop `.weight`: a plain load_weights crashes.
        # The layerwise reload restores the layout, loads, and re-runs the post-load processing.
        initialize_layerwise_reload(model)
        try:
            checksums, timing = receive_buckets(
                plan, group, lambda items: model.load_weights(items), device=self._relay_device()
            )
        finally:
            finalize_layerwise_reload(model, self.model_config)
        return {"checksums": checksums, **timing}

    def relay_leave(self) -> None:
        group = getattr(self, "_relay_group", None)
        if group is not None:
            group.close()
            self._relay_group = None

    def relay_param_checksum(self, name: str) -> str:
        """Checksum of one loaded parameter (for tests); names as the vLLM model holds them."""
        from app.sync import checksum

        return checksum(dict(self.get_model().named_parameters())[name].detach().float().reshape(-1))
