"""One vLLM engine starts on a GPU at a time: a lock file per GPU, held while an engine starts.

vLLM sizes its KV cache from what the GPU has free while it profiles at start: an engine starting beside
another one still allocating (two replicas sharing a rollout GPU, started together by Serve) counts the
other's allocations as its own and starts with a wrong or no cache, or refuses to start. The lock is an
`flock` on a file named by the GPUs the process sees (`CUDA_VISIBLE_DEVICES`, which Ray sets), so the kernel
frees it when its holder dies; the wait for it has a deadline and names the holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("app.vllm")


def lock_path(devices: str) -> Path:
    """The lock file of the GPUs `devices` (a CUDA_VISIBLE_DEVICES value) on this host."""
    name = "".join(c if c.isalnum() else "_" for c in devices) or "none"
    return Path(tempfile.gettempdir()) / f"relay-vllm-start-gpu{name}.lock"


@contextlib.contextmanager
def engine_start_lock(timeout_s: float, devices: str | None = None) -> Iterator[float]:
    """Hold this host's start lock of the GPUs this process sees while the body starts an engine; yields the
    seconds waited. Raises TimeoutError, naming the holder's pid, where another start holds it past
    `timeout_s`."""
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "") if devices is None else devices
    path = lock_path(devices)
    t0 = time.monotonic()
    with open(path, "a+") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - t0 > timeout_s:
                    f.seek(0)
                    holder = f.read().strip() or "unknown"
                    raise TimeoutError(
                        f"another vLLM engine (pid {holder}) has been starting on GPU(s) {devices!r} for over "
                        f"{timeout_s:.0f}s ({path}); one engine starts on a GPU at a time, so its KV cache is "
                        "sized from what the others left: see that replica's log"
                    ) from None
                time.sleep(0.2)
        waited = time.monotonic() - t0
        if waited > 1:
            log.info("waited %.1fs for another engine's start on GPU(s) %s", waited, devices)
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield waited
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
