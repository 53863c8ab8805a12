"""Which LoRA adapter versions a replica holds, and which requests use them (no vLLM here: pure bookkeeping).

With `rollout.partial=finish_on_old` a push never pauses generation: the pushed adapter of version v is added to
the engine beside the older ones (vLLM's `lora_int_id` = v + 1, ids start at 1). A request is admitted under
the newest adapter (or one it names) and holds it until it finishes, so every token of a sample carries that
one version. An adapter that is no longer the newest is removed from the engine once no request holds it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapter version the engine holds: its weight version and PEFT folder."""

    version: int
    path: str

    @property
    def lora_id(self) -> int:
        """vLLM's `lora_int_id` (must be >= 1): the version + 1."""
        return self.version + 1

    @property
    def name(self) -> str:
        return f"relay-v{self.version}"


class AdapterBook:
    """The adapters of one replica: the newest, every older one still in use, and how many requests use each."""

    def __init__(self) -> None:
        self.held: dict[int, Adapter] = {}
        self.users: dict[int, int] = {}
        self.newest: int | None = None

    def publish(self, adapter: Adapter) -> list[Adapter]:
        """`adapter` becomes the one new requests take; returns the older ones no request uses (to remove).

        Publishing a version already held (a trainer restored from a checkpoint rolls back and pushes it again)
        replaces its folder: its users, if any, go on with the engine's copy."""
        self.held[adapter.version] = adapter
        self.newest = adapter.version
        return self._unused()

    def acquire(self, version: int | None = None) -> Adapter | None:
        """The adapter a new request generates with (`version`, else the newest), counted as in use; None
        before the first push (the base model). Raises KeyError naming the held versions for one not held."""
        v = self.newest if version is None else version
        if v is None:
            return None
        if v not in self.held:
            raise KeyError(f"adapter version {v} is not held by this replica (held: {sorted(self.held)})")
        self.users[v] = self.users.get(v, 0) + 1
        return self.held[v]

    def release(self, adapter: Adapter | None) -> list[Adapter]:
        """A request using `adapter` finished; returns the adapters no request uses any more (to remove)."""
        if adapter is None:
            return []
        left = self.users.get(adapter.version, 0) - 1
        if left > 0:
            self.users[adapter.version] = left
        else:
            self.users.pop(adapter.version, None)
        return self._unused()

    @contextlib.contextmanager
    def using(self, version: int | None = None) -> Iterator[tuple[Adapter | None, list[Adapter]]]:
        """acquire/release around a block; the list it yields fills with the adapters to remove after it."""
        adapter = self.acquire(version)
        unused: list[Adapter] = []
        try:
            yield adapter, unused
        finally:
            unused.extend(self.release(adapter))

    def _unused(self) -> list[Adapter]:
        out = [a for v, a in self.held.items() if v != self.newest and not self.users.get(v)]
        for a in out:
            del self.held[a.version]
        return out
