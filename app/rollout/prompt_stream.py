"""The prompt stream: epochs of prompts, each prompt of an epoch handed out exactly once until trained.

Pure bookkeeping (no Ray): the rows of an epoch come from `epoch_rows(epoch)`, an iterator factory (in
production a Ray Data iterator over the tokenized, per-epoch shuffled dataset; in tests a list).

Every prompt taken is *outstanding* until the trainer acknowledges its group as trained (`ack`). A prompt
sent back (its group failed, or was over the staleness bound and is regenerated) is handed out again before
any new one. `snapshot()` / `restore()` round-trip the position (epoch, the uids of this epoch already
taken) and every outstanding prompt, so a restored run trains each prompt of an epoch exactly once.
`take`, `retry`, `ack` and `keep_partial` may be called from several threads (the rollouter pulls rows in a
worker thread because a Ray Data iterator blocks); a lock guards the state.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from app.records import Group, PipelineSnapshot, Prompt, Sample
from app.rollout.prompt_files import DataError

EpochRows = Callable[[int], Iterator[Prompt]]


class PromptStream:
    """Prompts epoch after epoch (`epochs` passes, 0: unlimited); overlong ones are counted and skipped."""

    def __init__(
        self, epoch_rows: EpochRows, *, epochs: int = 0, max_prompt_tokens: int | None = None
    ) -> None:
        self.epoch_rows = epoch_rows
        self.epochs = epochs
        self.max_prompt_tokens = max_prompt_tokens
        self.epoch = 0
        self.epoch_seen: set[str] = set()  # uids of the current epoch taken (also before a restore)
        self.cursor = 0  # fresh prompts handed out so far
        self.dropped_overlong = 0
        self.exhausted = False  # `epochs` reached: no fresh prompt left
        self.generation = 0  # bumped by `restore`: a take from before it gets nothing
        self.restores = 0
        self._it: Iterator[Prompt] | None = None
        self._retry: collections.deque[Prompt] = collections.deque()
        self.outstanding: dict[str, Prompt] = {}  # taken, not yet trained
        self.partials: dict[str, list[Sample]] = {}  # samples of groups a freeze ended
        self._lock = threading.Lock()

    @property
    def has_retry(self) -> bool:
        return bool(self._retry)

    def take(self, k: int, generation: int | None = None) -> list[Prompt]:
        """Up to k prompts: those sent back first, then fresh ones, crossing epochs. Fewer only when the
        epochs are exhausted; none when `generation` is older than the current one (a restore happened)."""
        out: list[Prompt] = []
        with self._lock:
            if generation is not None and generation != self.generation:
                return out
            while self._retry and len(out) < k:
                p = self._retry.popleft()
                self.outstanding[p.key] = p
                out.append(p)
            empty_epochs = 0
            while len(out) < k:
                p = self._next_fresh()
                if p is None:
                    if self.exhausted:
                        break
                    empty_epochs = empty_epochs + 1 if not out else 0
                    if empty_epochs > 1:
                        raise DataError(
                            "the training set has no usable prompt (all are over data.max_prompt_tokens?)"
                        )
                    continue
                self.outstanding[p.key] = p
                out.append(p)
                self.cursor += 1
        return out

    def _next_fresh(self) -> Prompt | None:
        """The next usable prompt of the current epoch, or None at an epoch's end (then the epoch advances)
        or when `epochs` is reached (then `exhausted` is set). Caller holds the lock."""
        while True:
            if self.epochs and self.epoch >= self.epochs:
                self.exhausted = True
                return None
            if self._it is None:
                self._it = iter(self.epoch_rows(self.epoch))
            try:
                p = next(self._it)
            except StopIteration:
                self._it = None
                self.epoch += 1
                self.epoch_seen = set()
                return None
            if p.uid in self.epoch_seen:  # taken before the checkpoint this run restored
                continue
            self.epoch_seen.add(p.uid)
            if self.max_prompt_tokens is not None and len(p.prompt_ids) > self.max_prompt_tokens:
                self.dropped_overlong += 1
                continue
            return dataclasses.replace(p, epoch=self.epoch, partial=[])

    def retry(self, prompt: Prompt) -> None:
        """Hand this outstanding prompt out again (before any fresh one)."""
        with self._lock:
            self._retry.append(prompt)

    def keep_partial(self, key: str, samples: list[Sample]) -> None:
        """A freeze ended this prompt's generation: its samples so far go into the snapshot."""
        with self._lock:
            self.partials[key] = samples

    def ack(self, keys: Sequence[str]) -> None:
        """The trainer trained these groups (`Group.key`): they leave the checkpoint state."""
        with self._lock:
            for k in keys:
                self.outstanding.pop(k, None)
                self.partials.pop(k, None)

    def snapshot(self, ready: Sequence[Group] = ()) -> PipelineSnapshot:
        """The position and every outstanding prompt; `ready` are the finished groups not yet trained
        (kept whole), every other outstanding prompt is pending, with its partial samples if frozen."""
        with self._lock:
            ready_keys = {g.key for g in ready}
            pending = [
                dataclasses.replace(p, partial=list(self.partials.get(key, p.partial)))
                for key, p in self.outstanding.items()
                if key not in ready_keys
            ]
            return PipelineSnapshot(
                epoch=self.epoch,
                epoch_seen=sorted(self.epoch_seen),
                cursor=self.cursor,
                dropped_overlong=self.dropped_overlong,
                ready=list(ready),
                pending=pending,
            )

    def restore(self, snap: PipelineSnapshot) -> None:
        """Continue from `snap`: its pending prompts are handed out first (partials kept on the prompt),
        then the epoch goes on past the uids it had taken. Its ready groups stay outstanding."""
        with self._lock:
            self.generation += 1
            self.restores += 1
            self._retry = collections.deque(snap.pending)
            self.outstanding = {p.key: p for p in snap.pending}
            self.outstanding.update({g.key: g.prompt() for g in snap.ready})
            self.partials = {}
            self.epoch, self.epoch_seen, self._it = snap.epoch, set(snap.epoch_seen), None
            self.cursor, self.dropped_overlong = snap.cursor, snap.dropped_overlong
            self.exhausted = False

    def progress(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "dropped_overlong": self.dropped_overlong,
            "exhausted": self.exhausted,
            "outstanding": len(self.outstanding),
            "restores": self.restores,
        }
