"""Which reward scores each data source, said once at a run's start: a log line per source and the MLflow tag
`relay.rewards` ({source: reward}). `reward.fn=auto` picks a function by the source's name (app/rewards
`resolve_reward_fn`) and falls back to exact match for a name it does not know: this makes the pick visible.

The sources are the distinct `data_source` values of the training and validation files, read from that field
alone: a parquet file's column, a JSONL file's lines (the first SCAN_ROWS of each). A row without one has its
file's stem, as the rollouter reads it (app/rollout/prompt_files.py). A file that cannot be read here is
skipped with a warning: the data's own checks are the rollouter's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from app.rewards import BUILTINS, resolve_reward_fn
from app.rewards.combine import reward_specs
from app.rollout.prompt_files import Columns

log = logging.getLogger(__name__)

SCAN_ROWS = 200_000  # JSONL rows read per file for its sources (a parquet column is read whole)


def _field(rec: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(rec, dict) or part not in rec:
            return None
        rec = rec[part]
    return rec


def _file_sources(path: Path, key: str, limit: int) -> tuple[set[str], bool]:
    """The distinct data sources of one prompt file, and whether every row was read."""
    values: list[Any] = []
    complete = True
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        top, _, rest = key.partition(".")
        f = pq.ParquetFile(path)
        if top in f.schema_arrow.names:
            column = f.read(columns=[top]).column(top).to_pylist()
            values = [_field(v, rest) if rest else v for v in column]
        else:
            values = [None] * f.metadata.num_rows
    else:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                if len(values) >= limit:
                    complete = False
                    break
                values.append(_field(json.loads(line), key))
    return {v if isinstance(v, str) and v else path.stem for v in values}, complete


def data_sources(files: list[str], columns: Columns | None = None, limit: int = SCAN_ROWS) -> list[str]:
    """The distinct data sources of the prompt files, sorted (a file past `limit` JSONL rows: of its first
    `limit`, said in a log line)."""
    key = (columns or Columns()).data_source or "data_source"
    found: set[str] = set()
    for f in dict.fromkeys(files):
        try:
            got, complete = _file_sources(Path(f), key, limit)
        except Exception as e:  # the rollouter reads and checks the data; this only names rewards
            log.warning("data sources of %s not read (%s: %s)", f, type(e).__name__, str(e)[:200])
            continue
        found |= got
        if not complete:
            log.info("data sources of %s: from its first %d rows", f, limit)
    return sorted(found)


def reward_for(reward_cfg: Any, source: str) -> str:
    """The reward a sample of `source` gets: the built-in `auto` picks for it, else the configured spec; with
    several functions (`reward.fns`) their weighted sum."""
    specs = reward_specs(reward_cfg.fn, list(reward_cfg.fns or []), list(reward_cfg.weights or []))
    names = {id(fn): name for name, fn in BUILTINS.items()}
    parts = []
    for s in specs:
        what = s.spec
        if s.spec.strip() == "auto":
            fn = resolve_reward_fn("auto", source)
            what = names.get(id(fn), getattr(fn, "__name__", str(fn)))
        parts.append(what if len(specs) == 1 else f"{s.weight:g} * {what}")
    return " + ".join(parts)


def name_rewards(cfg: Any, files: list[str], columns: Columns | None = None) -> dict[str, str]:
    """Log the reward of each data source of `files` (`reward for data source 'arith': exact_match
    (reward.fn=auto)`) and return them by source; {} where an environment (`env.name`) gives the rewards."""
    if cfg.env.name:
        return {}
    r = cfg.reward
    setting = f"reward.fns={list(r.fns)}" if r.fns else f"reward.fn={r.fn}"
    out = {source: reward_for(r, source) for source in data_sources(files, columns)}
    for source, reward in out.items():
        log.info("reward for data source %r: %s (%s)", source, reward, setting)
    return out
