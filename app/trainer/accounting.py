"""`trained_groups.jsonl`: one JSON line per trained group, so a run can prove each prompt of an epoch was
trained exactly once, at which version, with tokens of which versions. `filtered_groups.jsonl`: one line per
group dynamic sampling dropped (`algorithm.filter_groups`); a prompt is in exactly one of the two."""

from __future__ import annotations

import json
from pathlib import Path

from app.records import Filtered, Group
from app.trainer import checkpoint

NAME = "trained_groups.jsonl"
FILTERED = "filtered_groups.jsonl"


class TrainedLog:
    """The accounting log of a run directory (written by trainer rank 0 only)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / NAME
        self.filtered_path = Path(run_dir) / FILTERED

    def append(self, step: int, trained_at: int, groups: list[Group]) -> None:
        """Record `groups` as trained at `step` (1-based) by weights of version `trained_at`."""
        with open(self.path, "a") as f:
            for g in groups:
                rec = {
                    "uid": g.uid,
                    "step": step,
                    "trained_at": trained_at,
                    "min_version": g.min_version,
                    "max_version": g.max_version,
                    # per replica, the oldest version of the tokens it generated (a replacement replica
                    # must have served only weights at least as new as those current when it joined)
                    "replica_min_version": _replica_min_versions(g),
                    # per sample, the versions its tokens span (max - min; > 0: a push landed while it was
                    # generated) and its model turns (multi-turn episodes; 0 for single-turn samples)
                    "sample_spans": [
                        max(s.versions) - min(s.versions) if s.versions else 0 for s in g.samples
                    ],
                    "turns": [s.turns for s in g.samples],
                }
                f.write(json.dumps(rec) + "\n")

    def append_filtered(self, step: int, groups: list[Filtered]) -> None:
        """Record `groups` as dropped by dynamic sampling while the batch of `step` (1-based) was made."""
        if not groups:
            return
        with open(self.filtered_path, "a") as f:
            for g in groups:
                f.write(json.dumps({"uid": g.uid, "epoch": g.epoch, "step": step, "reward": g.reward}) + "\n")

    def truncate(self, step: int) -> int:
        """Forget the records of steps after `step` (a restore discarded that work); returns how many
        trained-group records were dropped."""
        if self.filtered_path.exists():
            checkpoint.truncate_log(self.filtered_path, step)
        return checkpoint.truncate_log(self.path, step)

    def records(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(x) for x in self.path.read_text().splitlines()]


def _replica_min_versions(g: Group) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in g.samples:
        if s.versions:
            out[s.replica] = min(out.get(s.replica, s.versions[0]), *s.versions)
    return out
