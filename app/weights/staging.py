"""A staged receive: one push received off the engine's thread, into staging buffers, and loaded later.

The paused receive (app/weights/loaders.py `PausedLoad`) holds generation for the whole transfer and load.
A staged receive (`sync.staged_receive`) runs the transfer in a thread of the vLLM worker while the engine keeps
generating with the old weights: every pushed tensor is copied into a staging buffer of its own (kept from
push to push: one more copy of the pushed weights in the worker's memory). The thread tells the replica it is
done through a Unix socket (`notify`: one JSON line per worker, no polling); the replica then pauses generation
and the worker copies the staged tensors into the model (`StagedPush.load`), so a client sees a pause of one
device-to-device copy instead of the whole push. Versions and checksums are unchanged: the checksums are the
received buckets', as in a paused receive, and the version is set after the copy.

    worker   stage = StagedPush(transport, plan, device, buffers); stage.start(notify_path)   # RPC returns
    replica  waits for every worker's line on its socket (`StageNotices`), pauses generation
    worker   stage.load(loader)                                                           # RPC, engine paused
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from app.weights.buckets import device_ordered
from app.weights.records import PushPlan, SyncError

Items = list[tuple[str, torch.Tensor]]


class StagedPush:
    """One push received in a thread into `buffers` (name -> staging tensor, reused across pushes while the
    shape and dtype stay the same)."""

    def __init__(
        self, transport: Any, plan: PushPlan, device: torch.device, buffers: dict[str, torch.Tensor]
    ) -> None:
        self.transport, self.plan, self.device, self.buffers = transport, plan, device, buffers
        self.result: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = threading.Event()

    def start(self, notify: str) -> None:
        """Receive in a thread; on the end (received or failed) send one JSON line to the socket `notify`."""
        threading.Thread(target=self._run, args=(notify,), name="relay-stage", daemon=True).start()

    def _run(self, notify: str) -> None:
        t0 = time.perf_counter()
        try:
            if self.device.type == "cuda":  # the current device is per thread; a stream of its own
                torch.cuda.set_device(self.device)
                stream = torch.cuda.Stream(self.device)
                with torch.cuda.stream(stream):
                    checksums, timing = self.transport.receive(self.plan, self._keep, self.device)
                stream.synchronize()  # the staged bytes are in place before the replica is told
            else:
                checksums, timing = self.transport.receive(self.plan, self._keep, self.device)
            self.result = {"checksums": checksums, **timing, "stage_s": time.perf_counter() - t0}
        except BaseException as e:  # told to the replica, which fails the push naming it
            self.error = f"staged receive of v{self.plan.version} failed: {e}"
        finally:
            self.done.set()
            _send_line(notify, {"ok": self.error is None, "error": self.error})

    @device_ordered  # copies into the staging buffers, queued on the staging stream
    def _keep(self, items: Items) -> None:
        dsts, srcs = [], []
        for name, t in items:
            buf = self.buffers.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != t.device:
                buf = self.buffers[name] = torch.empty_like(t)
            dsts.append(buf)
            srcs.append(t)
        torch._foreach_copy_(dsts, srcs)

    def load(self, loader: Callable[[Items], None], timeout_s: float) -> dict[str, Any]:
        """Copy the staged tensors into the model through `loader`, bucket by bucket as pushed. Raises where
        the receive failed or is not done within `timeout_s`."""
        if not self.done.wait(timeout_s):
            raise SyncError(f"staged receive of v{self.plan.version} not done within {timeout_s:.0f}s")
        if self.error is not None or self.result is None:
            raise SyncError(self.error or "staged receive ended without a result")
        t0 = time.perf_counter()
        for bucket in self.plan.buckets:
            loader([(t.name, self.buffers[t.name]) for t in bucket.tensors])
        return {**self.result, "load_s": time.perf_counter() - t0}


def _send_line(path: str, msg: dict[str, Any]) -> None:
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall((json.dumps(msg) + "\n").encode())


class StageNotices:
    """The replica's end: a Unix socket that collects one line from each of `workers` staging workers."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.dir = tempfile.mkdtemp(prefix="relay-stage-")
        self.path = os.path.join(self.dir, "s")
        self.lines: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.server: asyncio.AbstractServer | None = None

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            await self.lines.put(json.loads(line or b'{"ok": false, "error": "empty notice"}'))
        finally:
            writer.close()

    async def wait(self, timeout_s: float, what: str) -> None:
        """Return once every worker said it received; raise the first worker's error, or on the deadline."""
        deadline = time.monotonic() + timeout_s
        for got in range(self.workers):
            try:
                msg = await asyncio.wait_for(self.lines.get(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise SyncError(
                    f"{what}: {got} of {self.workers} workers finished the staged receive within "
                    f"{timeout_s:.0f}s"
                ) from None
            if not msg.get("ok"):
                raise SyncError(f"{what}: {msg.get('error')}")


@contextlib.asynccontextmanager
async def stage_notices(workers: int) -> AsyncIterator[StageNotices]:
    """A `StageNotices` listening for the length of the block; its socket is removed after."""
    n = StageNotices(workers)
    n.server = await asyncio.start_unix_server(n._client, path=n.path)
    try:
        yield n
    finally:
        n.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(n.server.wait_closed(), 5)
        with contextlib.suppress(OSError):
            os.unlink(n.path)
            os.rmdir(n.dir)
