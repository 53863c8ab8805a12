"""What the weight hub and the run control share: waiting for a change of their state with a deadline, and
calling a method of a Ray actor handle or of an object in this process alike."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from typing import Any


class Changes:
    """The state of an async actor changed: `notify()` wakes every long-poll waiting in `wait(left)`."""

    def __init__(self) -> None:
        self.cond = asyncio.Condition()

    async def notify(self) -> None:
        async with self.cond:
            self.cond.notify_all()

    async def wait(self, left: float) -> None:
        """Return at the next `notify()`, or after `left` seconds, whichever comes first."""
        async with self.cond:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.cond.wait(), timeout=left)


async def call(target: Any, method: str, *args: Any) -> Any:
    """`target.method(*args)` for a Ray actor handle or an object in this process (tests, a hub alone)."""
    fn = getattr(target, method)
    out = fn.remote(*args) if hasattr(fn, "remote") else fn(*args)
    return await out if inspect.isawaitable(out) else out
