"""Prompt datasets from files: `.jsonl` and `.parquet` (verl layout) into typed, validated rows.

Rows are numbered from 0 in file order (blank `.jsonl` lines are not rows; messages also give the line).
Every problem raises DataError naming the file, the row and the fix.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.errors import UserError

log = logging.getLogger(__name__)

SUPPORTED = (".jsonl", ".parquet")
_JSONL_FORMAT = (
    "each line must be a JSON object with 'prompt' (a string or a list of {'role', 'content'} messages) "
    "and 'answer', or a verl-layout record ('prompt' messages, 'reward_model': {'ground_truth'})"
)
_PARQUET_FORMAT = (
    "expected verl columns 'prompt' (chat messages), 'reward_model' (struct with 'ground_truth') and "
    "'data_source', or plain 'prompt' and 'answer' columns"
)


STANDARD = ("prompt", "answer", "data_source", "extra_info")
"""The fields a row has under these names whatever the file calls them; its other columns are `columns`."""


@dataclass
class PromptRow:
    """One prompt: `prompt` is a string or chat messages; `index` is its 0-based row number in the file;
    `extra_info` is the row's verl `extra_info` mapping ({} when it has none), which reward functions see.

    `answer` is the reference answer as text (a number as its digits, a list or a mapping as JSON): what the
    built-in rewards compare with. `truth` is that answer as the data gives it when it is not a string (a
    number, a list, a mapping; None: `answer` is it), for verl's `ground_truth`. `columns` holds the record's
    other top-level fields under their own names (those of `STANDARD` aside), as TRL passes them to rewards.
    """

    uid: str
    prompt: str | list[dict]
    answer: str
    data_source: str
    index: int
    extra_info: dict[str, Any] = field(default_factory=dict)
    truth: Any = None
    columns: dict[str, Any] = field(default_factory=dict)


class DataError(UserError, ValueError):
    """A dataset file that cannot be used; the message names the file, the row and the fix."""


@dataclass(frozen=True)
class Columns:
    """Where a record keeps its fields (`data.prompt_key`, `data.answer_key`, `data.data_source_key`); a
    dotted key reads a nested field (`reward_model.ground_truth`). The defaults read both layouts as they are:
    `prompt`, the answer from verl's `reward_model.ground_truth` else `answer` (`answer=""`), `data_source`."""

    prompt: str = "prompt"
    answer: str = ""
    data_source: str = "data_source"

    @classmethod
    def from_cfg(cls, data: Any) -> Columns:
        """From the `data` config section (a dataclass, a DictConfig or a dict)."""
        get = data.get if isinstance(data, Mapping) else lambda k, d: getattr(data, k, d)
        return cls(get("prompt_key", "prompt"), get("answer_key", ""), get("data_source_key", "data_source"))

    def top_level(self) -> tuple[str, set[str]]:
        """The column the prompt is in, and the columns any of which may hold the answer."""
        answer = {self.answer.split(".")[0]} if self.answer else {"reward_model", "answer"}
        return self.prompt.split(".")[0], answer

    def apply(self, rec: Mapping, where: str) -> Mapping:
        """`rec` with its mapped fields under the standard keys `prompt`, `answer` and `data_source`."""
        if self == Columns():
            return rec
        out = dict(rec)
        for std, key, setting in (
            ("prompt", self.prompt, "data.prompt_key"),
            ("answer", self.answer, "data.answer_key"),
            ("data_source", self.data_source, "data.data_source_key"),
        ):
            if key and key != std:
                value = _lookup(rec, key)
                if value is _MISSING and std == "data_source":
                    out.pop(std, None)  # no source in this row: the file stem, as without a mapping
                    continue
                if value is _MISSING:
                    raise DataError(
                        f"{where}: no field {key!r} ({setting}={key}); the record has {sorted(rec)}: set "
                        f"{setting} to the one holding the {std}"
                    )
                out[std] = value
        if self.answer:
            out.pop("reward_model", None)  # the mapped answer wins over verl's ground truth
        return out


_MISSING = object()


def _lookup(rec: Mapping, dotted: str) -> Any:
    node: Any = rec
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _where(path: Path, row: int, line: int | None) -> str:
    return f"{path} row {row}" + (f" (line {line})" if line is not None else "")


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
            if not m["content"].strip():  # a blank turn renders as an empty chat message: a broken row
                raise DataError(f"{where}: prompt message {i} ({m['role']}) has blank 'content' ({fmt})")
        return [dict(m) for m in prompt]
    raise DataError(f"{where}: 'prompt' is a {type(prompt).__name__}, not a string or message list ({fmt})")


def _check_answer(answer: Any, where: str, key: str, fmt: str) -> tuple[str, Any]:
    """The reference answer as text, and as the data gives it when that is not a string (else None)."""
    if isinstance(answer, str):
        return answer, None
    if isinstance(answer, numbers.Real) and not isinstance(answer, bool):
        # JSON's NaN / Infinity parse as floats: as "nan" / "inf" no response could ever match them
        if not isinstance(answer, numbers.Integral) and not math.isfinite(answer):
            raise DataError(
                f"{where}: {key!r} is {answer!r}, not a finite number; give the reference answer as a "
                f"finite number or a string ({fmt})"
            )
        return str(answer), answer
    if isinstance(answer, (list, tuple, Mapping)):  # verl's ground truths: several answers, test cases...
        truth = dict(answer) if isinstance(answer, Mapping) else list(answer)
        return json.dumps(truth, ensure_ascii=False, default=str), truth
    raise DataError(
        f"{where}: {key!r} is {answer!r:.80}, expected a string, a number, a list or a mapping ({fmt})"
    )


def _optional_str(value: Any, where: str, key: str, fmt: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) or (isinstance(value, numbers.Integral) and not isinstance(value, bool)):
        return str(value)
    raise DataError(f"{where}: {key!r} is {value!r:.80}, expected a string or an integer ({fmt})")


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _answer(rec: Mapping, where: str, fmt: str) -> tuple[Any, str]:
    """The reference answer and the key it came from: verl's `reward_model.ground_truth`, else `answer`."""
    if rec.get("reward_model") is not None or ("reward_model" in rec and "answer" not in rec):
        rm = rec["reward_model"]
        if not isinstance(rm, Mapping) or rm.get("ground_truth") is None:
            raise DataError(f"{where}: 'reward_model' has no 'ground_truth' ({fmt})")
        return rm["ground_truth"], "reward_model.ground_truth"
    if "answer" not in rec:
        raise DataError(f"{where}: missing key 'answer' ({fmt})")
    return rec["answer"], "answer"


def normalize_row(
    rec: Any, path: str | Path, row: int, line: int | None = None, columns: Columns | None = None
) -> PromptRow:
    """One raw record of a prompt file (a parsed JSON line, or a parquet row as a dict) as a checked PromptRow.

    Both layouts, in either file type: plain `{"prompt", "answer"}` and verl's (`prompt` chat messages,
    `reward_model.ground_truth`, `data_source`, optional `extra_info.index`). The uid is the record's
    id/uid/extra_info.index, else "{stem}:{row}"; data_source defaults to the file stem. `row` is the
    0-based row number, `line` the 1-based JSONL line if any; `columns` maps other field names onto these.
    The answer may be a string, a number, a list or a mapping (see PromptRow); the record's other fields
    are kept in the row's `columns`. Raises DataError naming the file, the row (and line) and the fix. Uniqueness of ids across rows is the
    caller's check (load_rows).
    """
    p = Path(path)
    where = _where(p, row, line)
    fmt = _JSONL_FORMAT if p.suffix.lower() == ".jsonl" else _PARQUET_FORMAT
    if not isinstance(rec, Mapping):
        raise DataError(f"{where}: a JSON {type(rec).__name__}, not an object; {fmt}")
    raw = rec  # its columns as the file names them (a mapped answer column keeps its own name too)
    if columns is not None:
        rec = columns.apply(rec, where)
    if "prompt" not in rec:
        raise DataError(f"{where}: missing key 'prompt' ({fmt})")
    answer, key = _answer(rec, where, fmt)
    extra = rec.get("extra_info")
    index = extra.get("index") if isinstance(extra, Mapping) else None
    uid = _optional_str(_first(rec.get("id"), rec.get("uid"), index), where, "id", fmt)
    source = rec.get("data_source")
    if source is not None and not isinstance(source, str):
        raise DataError(f"{where}: 'data_source' must be a string, got {source!r:.80}")
    text, truth = _check_answer(answer, where, key, fmt)
    return PromptRow(
        uid=uid if uid is not None else f"{p.stem}:{row}",
        prompt=_check_prompt(rec["prompt"], where, fmt),
        answer=text,
        data_source=source or p.stem,
        index=row,
        extra_info=dict(extra) if isinstance(extra, Mapping) else {},
        truth=truth,
        columns={str(k): v for k, v in raw.items() if k not in STANDARD},
    )


def jsonl_lines(path: str | Path) -> Iterator[tuple[int, int, str]]:
    """A `.jsonl` file's rows as (row, line, text), read line by line: rows count the non-blank lines from 0,
    lines count every line from 1 (what every error message and default uid names). A line that is not UTF-8
    raises DataError naming the file, row, line and the fix. `decode_line` decodes a row's text: the loaders
    here do it at once (`_jsonl_records`), the streamed dataset where it checks the rows (`dataset.Normalize`)."""
    row = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{_where(Path(path), row, lineno)}: not UTF-8 text ({e}); save it as UTF-8 JSON lines"
                ) from e
            if not text.strip():
                continue
            yield row, lineno, text
            row += 1


def decode_line(text: str, path: str | Path, row: int, line: int) -> Any:
    """One non-blank `.jsonl` line (a row of `jsonl_lines`) as its JSON value; DataError naming the file, row,
    line and the fix if malformed."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{_where(Path(path), row, line)}: invalid JSON ({e.msg} at column {e.colno}); {_JSONL_FORMAT}"
        ) from e


def check_columns(path: str | Path, columns: list[str], mapping: Columns | None = None) -> None:
    """DataError unless a parquet file has the columns of a prompt file (verl or plain layout, or the ones
    `mapping` names)."""
    cols = set(columns)
    prompt, answer = (mapping or Columns()).top_level()
    if prompt not in cols or not (answer & cols):
        fix = (
            "; or name the columns holding them: data.prompt_key, data.answer_key"
            if mapping == Columns() or mapping is None
            else f" (data.prompt_key={mapping.prompt!r}, data.answer_key={mapping.answer!r}: "
            f"column {prompt!r} and one of {sorted(answer)} are needed)"
        )
        raise DataError(f"{path}: columns {sorted(cols)}; {_PARQUET_FORMAT}{fix}")


def duplicate_id(path: str | Path, uid: str, row: int, line: int | None, first_row: int) -> DataError:
    """The error for a row whose id an earlier row (`first_row`) already has."""
    return DataError(
        f"{_where(Path(path), row, line)}: duplicate id {uid!r} (also row {first_row}); ids must be unique"
    )


def empty_prompt(path: str | Path, row: PromptRow, tokenizer: str) -> DataError:
    """The error for a row whose prompt is no token at all once tokenized: vLLM cannot generate from it
    ("The decoder prompt cannot be empty"), so the data stage refuses it, whatever `data.truncation` says
    (like a blank prompt: a broken row, or a tokenizer that does not fit the data)."""
    return DataError(
        f"{path} row {row.index}: prompt {row.uid!r} is 0 tokens after tokenization (chat template "
        f"included) with the tokenizer of {tokenizer}: vLLM cannot generate from an empty prompt. Its text "
        "is unknown to this tokenizer or removed by it; fix or remove the row, or use a model whose "
        "tokenizer fits this data"
    )


def no_rows(path: str | Path) -> DataError:
    """The error for a prompt file without a single row."""
    fmt = _JSONL_FORMAT if Path(path).suffix.lower() == ".jsonl" else _PARQUET_FORMAT
    return DataError(f"{path}: no rows; {fmt}")


def _jsonl_records(path: Path) -> Iterator[tuple[int, int | None, Any]]:
    for row, line, text in jsonl_lines(path):
        yield row, line, decode_line(text, path, row, line)


def _parquet_records(path: Path, columns: Columns | None = None) -> Iterator[tuple[int, int | None, Any]]:
    try:
        import pyarrow.parquet as pq

        f = pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
    check_columns(path, f.schema_arrow.names, columns)
    row = 0
    with f:
        for batch in f.iter_batches(batch_size=1024):
            for rec in batch.to_pylist():
                yield row, None, rec
                row += 1


def check_path(path: str) -> Path:
    """The prompt file as a Path (`~` expanded), or DataError: a directory, not a regular file, missing, an
    unknown format."""
    p = Path(path).expanduser()
    where = "check data.train / data.val (relative to the working dir)"
    if p.is_dir():
        raise DataError(
            f"{path}: is a directory, not a file; point data.train / data.val at a .jsonl or .parquet file"
        )
    if p.exists() and not p.is_file():
        raise DataError(f"{path}: not a regular file (a pipe, socket or device); {where}")
    if p.suffix.lower() not in SUPPORTED:
        raise DataError(f"{path}: unsupported extension {p.suffix!r}; supported: {', '.join(SUPPORTED)}")
    if not p.is_file():
        raise DataError(f"{path}: file not found; {where}")
    return p


def load_rows(
    path: str, columns: Columns | None = None, limit: int = 0, uid_prefix: str = ""
) -> list[PromptRow]:
    """Load and validate every row (`limit` > 0: the first `limit`) of a `.jsonl` or `.parquet` prompt file
    (see normalize_row; `columns` maps other field names); raises DataError naming the file and the row.

    `.jsonl`: one object per line with "prompt" (string or chat messages) and "answer" (string or
    number), or a verl-layout record; optional "id"/"uid" and "data_source" (default: the file stem).
    `.parquet`: verl layout (`prompt` messages, `reward_model.ground_truth`, `data_source`, optional
    `extra_info.index`) or plain `prompt` + `answer` columns. `uid_prefix` is put before every uid (one of
    several files: see `uid_prefix`).
    """
    p = check_path(path)
    is_jsonl = p.suffix.lower() == ".jsonl"
    rows: list[PromptRow] = []
    seen: dict[str, int] = {}
    for row, line, rec in _jsonl_records(p) if is_jsonl else _parquet_records(p, columns):
        if limit and row >= limit:
            break
        r = normalize_row(rec, p, row, line, columns)
        if r.uid in seen:
            raise duplicate_id(p, r.uid, row, line, seen[r.uid])
        seen[r.uid] = row
        r.uid = uid_prefix + r.uid
        rows.append(r)
    if not rows:
        raise no_rows(path)
    return rows


def uid_prefix(index: int, count: int) -> str:
    """What goes before the uids of the `index`-th of `count` files of a split: nothing for one file; for
    several, `"<index>/"` (two files may both number their rows from 0, or share a stem)."""
    return f"{index}/" if count > 1 else ""


PREVIEW_ROWS = 256  # rows of each prompt file checked before Ray starts


def check_file(path: str, columns: Columns | None = None, rows: int = PREVIEW_ROWS) -> None:
    """Fail early, before a run starts: a prompt file that is missing, of an unknown format, without the
    columns a prompt file needs, or whose first `rows` rows are not valid (the rest are validated where they
    are read: in the rollouter, through Ray Data, with the same messages naming the file and the row)."""
    load_rows(path, columns, limit=rows)


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
