"""Prompt datasets from files: `.jsonl` and `.parquet` (verl layout) into typed, validated rows.

Rows are numbered from 0 in file order (blank `.jsonl` lines are not rows; messages also give the line).
Every problem raises DataError naming the file, the row and the fix.
"""

from __future__ import annotations

import json
import logging
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SUPPORTED = (".jsonl", ".parquet")
_JSONL_FORMAT = (
    "each line must be a JSON object with 'prompt' (a string or a list of {'role', 'content'} messages) "
    "and 'answer'"
)
_PARQUET_FORMAT = (
    "expected verl columns 'prompt' (chat messages), 'reward_model' (struct with 'ground_truth') and "
    "'data_source', or plain 'prompt' and 'answer' columns"
)


@dataclass
class PromptRow:
    """One prompt: `prompt` is a string or chat messages; `index` is its 0-based row number in the file."""

    uid: str
    prompt: str | list[dict]
    answer: str
    data_source: str
    index: int


class DataError(ValueError):
    """A dataset file that cannot be used; the message names the file, the row and the fix."""


def _check_prompt(prompt: Any, where: str, fmt: str) -> str | list[dict]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: empty 'prompt' ({fmt})")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise DataError(f"{where}: empty 'prompt' message list ({fmt})")
        for i, m in enumerate(prompt):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise DataError(f"{where}: prompt message {i} has no string 'role' ({fmt})")
            if not isinstance(m.get("content"), str):
                raise DataError(f"{where}: prompt message {i} has no string 'content' ({fmt})")
        return [dict(m) for m in prompt]
    raise DataError(f"{where}: 'prompt' is a {type(prompt).__name__}, not a string or message list ({fmt})")


def _check_answer(answer: Any, where: str, key: str, fmt: str) -> str:
    if isinstance(answer, str):
        return answer
    if isinstance(answer, numbers.Real) and not isinstance(answer, bool):
        return str(answer)
    raise DataError(f"{where}: {key!r} is {answer!r:.80}, expected a string or a number ({fmt})")


def _optional_str(value: Any, where: str, key: str, fmt: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) or (isinstance(value, numbers.Integral) and not isinstance(value, bool)):
        return str(value)
    raise DataError(f"{where}: {key!r} is {value!r:.80}, expected a string or an integer ({fmt})")


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _jsonl_records(path: Path):
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e}); save it as UTF-8 JSON lines") from e
    row = 0
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path} row {row} (line {lineno})"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno}); {_JSONL_FORMAT}") from e
        if not isinstance(rec, dict):
            raise DataError(f"{where}: a JSON {type(rec).__name__}, not an object; {_JSONL_FORMAT}")
        for key in ("prompt", "answer"):
            if key not in rec:
                raise DataError(f"{where}: missing key {key!r} ({_JSONL_FORMAT})")
        uid = _optional_str(_first(rec.get("id"), rec.get("uid")), where, "id", _JSONL_FORMAT)
        source = rec.get("data_source")
        if source is not None and not isinstance(source, str):
            raise DataError(f"{where}: 'data_source' must be a string, got {source!r:.80}")
        yield row, where, rec["prompt"], rec["answer"], "answer", uid, source
        row += 1


def _parquet_records(path: Path):
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
    cols = set(table.column_names)
    verl = "reward_model" in cols
    if "prompt" not in cols or not (verl or "answer" in cols):
        raise DataError(f"{path}: columns {sorted(cols)}; {_PARQUET_FORMAT}")
    for row, rec in enumerate(table.to_pylist()):
        where = f"{path} row {row}"
        if verl:
            rm = rec["reward_model"]
            if not isinstance(rm, Mapping) or rm.get("ground_truth") is None:
                raise DataError(f"{where}: 'reward_model' has no 'ground_truth' ({_PARQUET_FORMAT})")
            answer, key = rm["ground_truth"], "reward_model.ground_truth"
        else:
            answer, key = rec["answer"], "answer"
        extra = rec.get("extra_info")
        index = extra.get("index") if isinstance(extra, Mapping) else None
        uid = _optional_str(_first(rec.get("id"), rec.get("uid"), index), where, "id", _PARQUET_FORMAT)
        source = rec.get("data_source")
        if source is not None and not isinstance(source, str):
            raise DataError(f"{where}: 'data_source' must be a string, got {source!r:.80}")
        yield row, where, rec["prompt"], answer, key, uid, source


def load_rows(path: str) -> list[PromptRow]:
    """Load and validate every row of a `.jsonl` or `.parquet` prompt file; raises DataError.

    `.jsonl`: one object per line with "prompt" (string or chat messages) and "answer" (string or
    number); optional "id"/"uid" and "data_source" (default: the file stem). `.parquet`: verl layout
    (`prompt` messages, `reward_model.ground_truth`, `data_source`, optional `extra_info.index`) or
    plain `prompt` + `answer` columns. The uid is the row's id/uid/extra_info.index, else "{stem}:{row}".
    """
    p = Path(path)
    if p.suffix.lower() not in SUPPORTED:
        raise DataError(f"{path}: unsupported extension {p.suffix!r}; supported: {', '.join(SUPPORTED)}")
    if not p.is_file():
        raise DataError(f"{path}: file not found; check data.train / data.val (relative to the working dir)")
    is_jsonl = p.suffix.lower() == ".jsonl"
    records = _jsonl_records(p) if is_jsonl else _parquet_records(p)
    fmt = _JSONL_FORMAT if is_jsonl else _PARQUET_FORMAT
    rows: list[PromptRow] = []
    seen: dict[str, int] = {}
    for row, where, prompt, answer, key, uid, source in records:
        uid = uid if uid is not None else f"{p.stem}:{row}"
        if uid in seen:
            raise DataError(f"{where}: duplicate id {uid!r} (also row {seen[uid]}); ids must be unique")
        seen[uid] = row
        rows.append(
            PromptRow(
                uid=uid,
                prompt=_check_prompt(prompt, where, fmt),
                answer=_check_answer(answer, where, key, fmt),
                data_source=source or p.stem,
                index=row,
            )
        )
    if not rows:
        raise DataError(f"{path}: no rows; {fmt}")
    return rows


def _to_ids(encoded: Any) -> list[int]:
    """Normalize a tokenizer's output (list, nested list, dict/BatchEncoding, tensor) to list[int]."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    encoded = list(encoded)
    if encoded and isinstance(encoded[0], (list, tuple)):
        encoded = list(encoded[0])
    return [int(t) for t in encoded]


def render_prompt(row: PromptRow, tokenizer: Any) -> list[int]:
    """Token ids of the row's prompt.

    Chat messages go through the tokenizer's chat template (with the generation prompt) when it has one,
    else their contents are joined with newlines; strings are encoded without added special tokens.
    """
    if isinstance(row.prompt, list):
        if getattr(tokenizer, "chat_template", None):
            out = tokenizer.apply_chat_template(row.prompt, add_generation_prompt=True, tokenize=True)
            return _to_ids(out)
        text = "\n".join(m["content"] for m in row.prompt)
    else:
        text = row.prompt
    return _to_ids(tokenizer.encode(text, add_special_tokens=False))


def filter_overlong(
    rows_with_ids: list[tuple[PromptRow, list[int]]], max_tokens: int, policy: str
) -> tuple[list[tuple[PromptRow, list[int]]], int]:
    """Apply `data.truncation` to prompts longer than `max_tokens`: returns (kept, dropped count).

    "drop" skips them (a warning gives the count); "error" raises DataError naming the first one.
    """
    if policy not in ("drop", "error"):
        raise ValueError(f"data.truncation={policy!r}: expected 'drop' or 'error'")
    kept = [(r, ids) for r, ids in rows_with_ids if len(ids) <= max_tokens]
    dropped = len(rows_with_ids) - len(kept)
    if dropped and policy == "error":
        row, ids = next((r, ids) for r, ids in rows_with_ids if len(ids) > max_tokens)
        raise DataError(
            f"prompt {row.uid!r} (row {row.index}) has {len(ids)} tokens > data.max_prompt_tokens="
            f"{max_tokens}; raise data.max_prompt_tokens or set data.truncation=drop"
        )
    if dropped:
        log.warning(
            "dropped %d of %d prompts longer than data.max_prompt_tokens=%d",
            dropped,
            len(rows_with_ids),
            max_tokens,
        )
    return kept, dropped
