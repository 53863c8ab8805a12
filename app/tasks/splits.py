"""Writing a built-in task's splits: one `.jsonl` file of rows per split, each written whole or not at all."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path


def write_splits(root: str | Path, splits: Mapping[str, Iterable[dict]]) -> Path:
    """Write each split's rows to `<root>/<name>.jsonl` (one JSON object a line) and return `root`. Each file
    is written under a name of this process's own and then renamed: a reader, or a second process building the
    same task at once, never sees a half-written split."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        tmp = root / f"{name}.jsonl.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        tmp.replace(root / f"{name}.jsonl")
    return root
