"""Runs inside each vLLM worker process: joins the weight group and loads pushed buckets.

vLLM imports `RelayWorkerExtension` through the engine argument `worker_extension_cls`
(`app.vllm.engine.WORKER_EXTENSION`) and mixes it into its Worker, so its methods are reachable with
`collective_rpc`. Arguments travel as JSON strings (tensors passed as RPC arguments arrive as lists); tensors
travel only through the epoch's transport (app/sync/transport.py), built from the name in `GroupInfo`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from app.log_filters import silence_vllm_reload_warnings
from app.sync import checksum, group_from_json, make_transport, plan_from_json

log = logging.getLogger(__name__)
# vLLM restores each RotaryEmbedding's computed buffer after a reload and warns about it on every push
silence_vllm_reload_warnings()


class RelayWorkerExtension:
    """Mixed into vLLM's Worker. `self` is the worker: it has get_model(), model_config, device, rank."""

    def _relay_device(self) -> torch.device:
        dev = getattr(self, "device", None)
        return dev if isinstance(dev, torch.device) else torch.device("cpu")

    def relay_join(self, group_json: str, first_rank: int) -> dict[str, Any]:
        """Join epoch `info.epoch` as rank `first_rank` + this worker's rank, through its transport."""
        info = group_from_json(group_json)
        self.relay_leave()
        rank = first_rank + int(getattr(self, "rank", 0) or 0)
        t0 = time.perf_counter()
        transport = make_transport(info.transport)
        transport.join(info, rank, self._relay_device())
        self._relay_transport = transport
        return {"rank": rank, "join_s": time.perf_counter() - t0}

    def relay_receive(self, plan_json: str) -> dict[str, Any]:
        """Receive and load one push; returns the per-bucket checksums and timings."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        transport = getattr(self, "_relay_transport", None)
        if transport is None:
            raise RuntimeError("relay_receive before relay_join: this worker is not in the weight group")
        plan = plan_from_json(plan_json)
        model = self.get_model()
        # On CPU, linear layers pre-pack their weights and drop `.weight`: a plain load_weights crashes.
        # The layerwise reload restores the layout, loads, and re-runs the post-load processing.
        initialize_layerwise_reload(model)
        try:
            checksums, timing = transport.receive(
                plan, lambda items: model.load_weights(items), self._relay_device()
            )
        finally:
            finalize_layerwise_reload(model, self.model_config)
        return {"checksums": checksums, **timing}

    def relay_leave(self) -> None:
        transport = getattr(self, "_relay_transport", None)
        if transport is not None:
            transport.close()
            self._relay_transport = None

    def relay_param_checksum(self, name: str) -> str:
        """Checksum of one loaded parameter (for tests); names as the vLLM model holds them."""
        return checksum(dict(self.get_model().named_parameters())[name].detach().float().reshape(-1))
