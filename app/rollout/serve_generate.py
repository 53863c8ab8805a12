"""The production `GenerateFn`: the Serve deployment's `generate`, retried on live replicas when a replica
or its vLLM engine died.

A replica whose engine died answers every request with EngineDeadError until its health check fails and
Serve replaces it; a replica whose actor died fails its requests with RayActorError; while Serve has no
replica to route to, its handle raises its own unavailability errors. Each is retried (Serve routes the
retry to a replica it believes alive), with a growing pause, until the request's deadline
(`rollout.request_timeout_s`): a deadline, never a count, because a loaded machine takes longer to replace a
replica. Any other error (a bad request, a bug) is raised at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

from app.errors import raised_as
from app.records import GenerateRequest, GenerateResponse

log = logging.getLogger(__name__)

# exception class names (anywhere in the error's class hierarchy or cause chain) that mean "this replica
# or its engine is gone": vLLM's, and Serve's and Ray's that it raises from a handle call
RETRYABLE = {
    "EngineDeadError",
    "RayActorError",
    "ActorDiedError",
    "ActorUnavailableError",
    "ReplicaUnavailableError",
    "DeploymentUnavailableError",
    "BackPressureError",
    "WorkerCrashedError",
    "NodeDiedError",
}


def retryable(exc: BaseException) -> bool:
    """The error says a replica or its engine died (retry elsewhere), not that the request is bad."""
    return raised_as(exc, RETRYABLE)


RETRY_LOG_EVERY_S = 30.0


class RetryLog:
    """One warning for the first retry of an outage, then at most one every RETRY_LOG_EVERY_S with the count
    since (an engine's death fails every request in flight at once: one line each would flood the log)."""

    def __init__(self) -> None:
        self.last, self.since = -float("inf"), 0

    def retried(self, now: float, error: BaseException, pause: float) -> None:
        self.since += 1
        if now - self.last < RETRY_LOG_EVERY_S:
            return
        log.warning(
            "%d request(s) failed on a replica (last: %s); retrying on live ones (first in %.1fs)",
            self.since,
            type(error).__name__,
            pause,
        )
        self.last, self.since = now, 0


_RETRIES = RetryLog()  # one per process: the rollouter's generators share it


class ServeGenerate:
    """One request to the Serve deployment's `generate`, retried on live replicas until `deadline_s`."""

    def __init__(
        self, handle: Any, deadline_s: float, backoff_s: float = 0.5, stats: Counter[str] | None = None
    ) -> None:
        self.handle, self.deadline_s, self.backoff_s = handle, deadline_s, backoff_s
        self.stats: Counter[str] = stats if stats is not None else Counter()

    async def __call__(self, req: GenerateRequest) -> GenerateResponse:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadline_s
        pause, tries = self.backoff_s, 0
        while True:
            tries += 1
            try:
                return await self.handle.generate.remote(req)
            except Exception as e:
                if not retryable(e):
                    raise
                left = deadline - loop.time()
                if left <= pause:
                    raise RuntimeError(
                        f"generation failed for {self.deadline_s:g}s (rollout.request_timeout_s; {tries} tries, "
                        f"replicas dead or unavailable): {e}"
                    ) from e
                self.stats["rollout/replica_retries"] += 1
                _RETRIES.retried(loop.time(), e, pause)
                await asyncio.sleep(pause)
                pause = min(2 * pause, 5.0)
