"""A replica's LoRA adapters (`model.lora.rank > 0`, `rollout.partial=finish_on_old`): how each push arrives,
is taken by new requests, and leaves.

A push never pauses generation: the workers receive the adapter tensors and write them as a PEFT folder, the
engine adds it as the adapter of version v beside the older ones (vLLM `add_lora`, id v + 1), new requests
take it, requests in flight finish on the adapter they were admitted under (so every token of a sample carries
one version), and an older adapter is removed from the engine, its folder from disk, once no request uses it.
Which versions are held and by whom is app/vllm/adapters.py's `AdapterBook`; the engine is reached only through
app/vllm/engine.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from app.vllm import engine as vla
from app.vllm.adapters import Adapter, AdapterBook
from app.weights.records import PushPlan, plan_to_json

log = logging.getLogger("app.sync")


class ReplicaAdapters:
    """The adapters one replica's engine holds, each a PEFT folder under `root` (removed by `close`).

    `spec` is the LoraSpec of the pushed adapters, as a dict (written into each folder's adapter_config.json);
    `label(version)` records the version this replica holds from then on (its own record and metric)."""

    def __init__(
        self, engine: Any, replica_id: str, spec: dict[str, Any], label: Callable[[int], None]
    ) -> None:
        self.engine, self.replica_id, self.spec, self.label = engine, replica_id, spec, label
        self.book = AdapterBook()
        self.root = tempfile.mkdtemp(prefix="relay-lora-")
        self.pushes = 0

    async def load(
        self, plan: PushPlan, ph: dict[str, float], *, ack_epoch: int | None = None, timeout_s: float = 0.0
    ) -> list[dict[str, Any]]:
        """No pause at all. The workers receive the adapter and write it as a PEFT folder; the engine adds it
        beside the older ones as version v, new requests take it, requests in flight finish on theirs, and older
        adapters no request uses are removed. Phases: receive (the workers' RPC), add (vLLM loads the folder),
        held 0 (generation never paused). The replica acknowledges itself (`ack_epoch` and `timeout_s`, the
        paused loads' arguments, are not used)."""
        self.pushes += 1
        path = os.path.join(self.root, f"v{plan.version}-{self.pushes}")
        t0 = time.perf_counter()
        res = await vla.rpc(
            self.engine,
            "relay_receive",
            timeout=None,
            plan_json=plan_to_json(plan),
            adapter_dir=path,
            adapter_json=json.dumps(self.spec),
        )
        t1 = time.perf_counter()
        adapter = Adapter(plan.version, path)
        await vla.add_adapter(self.engine, adapter)
        t2 = time.perf_counter()
        unused = self.book.publish(adapter)
        self.label(plan.version)
        await self._retire(unused)
        on_old = sum(n for v, n in self.book.users.items() if v != plan.version)
        ph.update(receive_s=t1 - t0, add_s=t2 - t1, pause_s=0.0, held_s=0.0, on_old=float(on_old))
        return res

    @contextlib.asynccontextmanager
    async def using(self, version: int | None = None) -> AsyncIterator[Adapter | None]:
        """The adapter a generation request uses from admission to its end (None before the first push); old
        adapters it was the last user of are removed after it."""
        unused: list[Adapter] = []
        try:
            with self.book.using(version) as (held, unused):
                yield held
        finally:
            await self._retire(unused)

    async def _retire(self, adapters: list[Adapter]) -> None:
        """Remove adapters no request uses from the engine and their folders from disk (a failure is logged:
        the engine's adapter cache then evicts it)."""
        for a in adapters:
            try:
                await vla.remove_adapter(self.engine, a)
            except Exception as e:
                log.warning("replica %s: removing adapter %s failed: %r", self.replica_id, a.name, e)
            shutil.rmtree(a.path, ignore_errors=True)

    def close(self) -> None:
        """Remove every adapter folder of this replica from disk (the replica is leaving)."""
        shutil.rmtree(self.root, ignore_errors=True)
