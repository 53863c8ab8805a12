"""The prompt files as Ray Data datasets: streamed, validated (app.rollout.prompt_files), tokenized, typed as `Prompt`s.

A file over `IN_PROCESS_BYTES` is never whole in one process. One Ray Data read task per file (`PromptFile`,
pinned to the rollouter's node, where the path was checked) reads it block by block: `.jsonl` line by line,
`.parquet` batch by batch. That reader numbers the rows (and JSONL lines) as it goes, so the numbers are exact
by construction, whatever order later stages see the blocks in: they are in every error message and are the
default uids. JSON is decoded per line (not `read_json`: Arrow's schema inference breaks when `prompt` is a
string in some rows and messages in others, and line numbers would be lost).

Stages: read -> `Normalize` (one actor: `app.rollout.prompt_files.normalize_row` per record, plus the
duplicate-id check, which needs every id of the file in one place) -> `Tokenize` (chat template;
`data.truncation=error` fails on an overlong prompt, naming the file and row; under `drop` the `PromptStream`
counts and skips them; a prompt of 0 tokens fails under either, naming the file and row: vLLM cannot generate
from it). The training set is materialized once (token ids are small; the object store spills to disk). A
training file of at most `IN_PROCESS_BYTES` goes through the same stages in the rollouter's own process
(`prepared_file`) and enters the object store as one block. Validation prompts (a few hundred rows) go through
the same stages in the rollouter's own process (`val_prompts`): no worker process to start for them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from app.records import Prompt
from app.rollout.mixture import epoch_counts, sample_seed
from app.rollout.prompt_files import (
    Columns,
    DataError,
    PromptRow,
    check_columns,
    check_path,
    decode_line,
    duplicate_id,
    empty_prompt,
    jsonl_lines,
    no_rows,
    normalize_row,
    render_prompt,
    uid_prefix,
)

BLOCK_ROWS = 4096  # rows per block the reader yields: bounded memory whatever the file's size
ROW = "_relay_row"  # the row-number column the parquet reader adds to the file's own columns
COLUMNS = ("uid", "prompt", "is_chat", "answer", "data_source", "index", "extra_info", "truth", "columns")


def is_parquet(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".parquet"


def jsonl_blocks(path: str, block_rows: int = BLOCK_ROWS) -> Iterator[Any]:
    """`prompt_files.jsonl_lines` (the non-blank lines of a `.jsonl` file, numbered) as Arrow blocks of (row,
    line, text); `Normalize` decodes each text with `prompt_files.decode_line`."""
    import pyarrow as pa

    cols: dict[str, list] = {"row": [], "line": [], "text": []}
    for row, line, text in jsonl_lines(path):
        cols["row"].append(row)
        cols["line"].append(line)
        cols["text"].append(text)
        if len(cols["row"]) >= block_rows:
            yield pa.table(cols)
            cols = {k: [] for k in cols}
    if cols["row"]:
        yield pa.table(cols)


def parquet_blocks(path: str, block_rows: int = BLOCK_ROWS) -> Iterator[Any]:
    """A `.parquet` file's batches as Arrow blocks, with its 0-based row numbers in column `ROW`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    start = 0
    with pq.ParquetFile(path) as f:
        for batch in f.iter_batches(batch_size=block_rows):
            table = pa.Table.from_batches([batch])
            yield table.append_column(ROW, pa.array(range(start, start + table.num_rows), pa.int64()))
            start += table.num_rows


class Normalize:
    """Ray Data stage (one actor: one set of ids per file): the reader's records as checked prompt rows.

    Row numbers come with the records, so batches may arrive in any order; a duplicate id names the later
    row and the earlier one, as `load_rows` does. `columns` maps the file's field names (data.*_key);
    `prefix` goes before every uid (one of several files: `prompt_files.uid_prefix`).
    """

    def __init__(self, path: str, columns: Columns | None = None, prefix: str = "") -> None:
        self.path, self.jsonl = path, not is_parquet(path)
        self.columns, self.prefix = columns, prefix
        self.seen: dict[str, tuple[int, int | None]] = {}  # uid -> (row, line) of its first row

    def rows(self, batch: Any) -> list[PromptRow]:
        """The records of one Arrow block (see `jsonl_blocks` / `parquet_blocks`) as checked PromptRows."""
        out: list[PromptRow] = []
        for rec in batch.to_pylist():
            if self.jsonl:
                row, line = rec["row"], rec["line"]
                rec = decode_line(rec["text"], self.path, row, line)
            else:
                row, line = rec.pop(ROW), None
            r = normalize_row(rec, self.path, row, line, self.columns)
            first = self.seen.setdefault(r.uid, (row, line))
            if first[0] != row:
                (row0, _), (row1, line1) = sorted([first, (row, line)], key=lambda x: x[0])
                raise duplicate_id(self.path, r.uid, row1, line1, row0)
            r.uid = self.prefix + r.uid
            out.append(r)
        return out

    def __call__(self, batch: Any) -> dict[str, list]:
        plain = [plain_row(r) for r in self.rows(batch)]
        return {k: [p[k] for p in plain] for k in COLUMNS}


class Tokenize:
    """Ray Data stage: tokenize prompts (chat template when the tokenizer has one) and flag overlong ones."""

    def __init__(self, tokenizer_path: str, max_prompt_tokens: int, truncation: str, path: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(tokenizer_path)
        self.tokenizer_path = tokenizer_path
        self.max_tokens, self.truncation, self.path = max_prompt_tokens, truncation, path

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        ids_col: list[list[int]] = []
        for i in range(len(batch["uid"])):
            row = prompt_row({k: batch[k][i] for k in COLUMNS})
            ids = render_prompt(row, self.tok)
            if not ids:
                raise empty_prompt(self.path, row, self.tokenizer_path)
            if len(ids) > self.max_tokens and self.truncation == "error":
                raise DataError(
                    f"{self.path} row {row.index}: prompt {row.uid!r} has {len(ids)} tokens, over "
                    f"data.max_prompt_tokens={self.max_tokens}; raise data.max_prompt_tokens or set "
                    "data.truncation=drop"
                )
            ids_col.append(ids)
        return {**batch, "prompt_ids": ids_col}


def plain_row(r: PromptRow) -> dict[str, Any]:
    """A validated row as Ray Data columns (chat messages, extra_info, the answer as the data gives it and the
    row's other columns as JSON strings: one column type for every row)."""
    chat = isinstance(r.prompt, list)
    return {
        "uid": r.uid,
        "prompt": json.dumps(r.prompt) if chat else r.prompt,
        "is_chat": chat,
        "answer": r.answer,
        "data_source": r.data_source,
        "index": r.index,
        "extra_info": json.dumps(r.extra_info, default=str),
        "truth": json.dumps(r.truth, default=str),
        "columns": json.dumps(r.columns, default=str),
    }


def prompt_row(rec: dict[str, Any]) -> PromptRow:
    """A Ray Data row of `plain_row`'s columns (numpy scalars allowed) back as a PromptRow."""
    text = str(rec["prompt"])
    return PromptRow(
        uid=str(rec["uid"]),
        prompt=json.loads(text) if bool(rec["is_chat"]) else text,
        answer=str(rec["answer"]),
        data_source=str(rec["data_source"]),
        index=int(rec["index"]),
        extra_info=json.loads(str(rec["extra_info"])),
        truth=json.loads(str(rec["truth"])),
        columns=json.loads(str(rec["columns"])),
    )


class Prepare:
    """Ray Data stage (one actor per file): `Normalize`, then `Tokenize`, in one process. Two stages of one
    actor each cost a dataset two more worker processes to start (each importing the reader and transformers),
    about half a minute of a 2-core machine per run."""

    def __init__(
        self,
        path: str,
        tokenizer_path: str,
        max_prompt_tokens: int,
        truncation: str,
        columns: Columns | None = None,
        prefix: str = "",
    ) -> None:
        self.normalize = Normalize(path, columns, prefix)
        self.tokenize = Tokenize(tokenizer_path, max_prompt_tokens, truncation, path)

    def __call__(self, batch: Any) -> dict[str, Any]:
        return self.tokenize(self.normalize(batch))


def checked_file(path: str, columns: Columns | None = None) -> Path:
    """`path`, checked: it exists with a known format, and a parquet file has a prompt file's columns."""
    p = check_path(path)
    if is_parquet(p):
        check_columns(p, _parquet_columns(p), columns)
    return p


def read_records(path: str, limit: int = 0, columns: Columns | None = None):
    """The raw records of one prompt file (`limit` > 0: its first `limit` rows) as a Ray Data dataset, read on
    this node (`PromptFile`)."""
    import ray

    configure_data_context()
    p = checked_file(path, columns)  # here, on the rollouter's node, where the read task is pinned
    ds = ray.data.read_datasource(_prompt_file(str(p)), num_cpus=0.25)
    return ds.limit(limit) if limit > 0 else ds


def read_prompts(path: str, limit: int = 0):
    """The checked rows of one prompt file (`limit` > 0: its first `limit` rows) as a Ray Data dataset of
    `plain_row` columns, untokenized. Errors (raised when the dataset executes) name the file and the row /
    line."""
    import ray

    return read_records(path, limit).map_batches(
        Normalize,
        fn_constructor_args=(str(check_path(path)),),
        batch_format="pyarrow",
        batch_size=1024,
        compute=ray.data.ActorPoolStrategy(size=1),
        num_cpus=0.25,
    )


def configure_data_context() -> None:
    """This process's Ray Data settings for the prompt datasets (taken by every dataset built after)."""
    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    # file order when data.shuffle is off, and the seeded per-epoch shuffles reproducible
    ctx.execution_options.preserve_order = True
    # a bad row's DataError reaches the caller as itself, not as a UserCodeException that loses it
    ctx.raise_original_map_exception = True


def _parquet_columns(p: Path) -> list[str]:
    try:
        import pyarrow.parquet as pq

        return list(pq.read_schema(p).names)
    except Exception as e:
        raise DataError(f"{p}: not a readable parquet file ({type(e).__name__}: {e})") from e


@functools.cache
def _prompt_file_class() -> type:
    """`PromptFile`, a Ray Data `Datasource` (built on first use: `ray.data` is imported lazily)."""
    from ray.data import Datasource, ReadTask
    from ray.data.block import BlockMetadata

    class PromptFile(Datasource):
        """One prompt file as one read task, on this node (the path is local to it)."""

        def __init__(self, path: str) -> None:
            super().__init__()
            self.path = path

        def get_name(self) -> str:
            return "ReadPromptFile"

        @property
        def supports_distributed_reads(self) -> bool:
            return False  # Ray Data then runs the read on the node that builds the dataset

        def estimate_inmemory_data_size(self) -> int | None:
            return os.path.getsize(self.path)

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, **_: Any) -> list:
            blocks = parquet_blocks if is_parquet(self.path) else jsonl_blocks
            meta = BlockMetadata(
                num_rows=None,
                size_bytes=self.estimate_inmemory_data_size(),
                input_files=[self.path],
                exec_stats=None,
            )
            read = functools.partial(blocks, self.path)
            return [ReadTask(read, meta, per_task_row_limit=per_task_row_limit)]

    return PromptFile


def _prompt_file(path: str) -> Any:
    return _prompt_file_class()(path)


def prompt_dataset(
    path: str,
    tokenizer_path: str,
    max_prompt_tokens: int,
    truncation: str,
    limit: int = 0,
    columns: Columns | None = None,
    prefix: str = "",
):
    """The checked, tokenized prompts of one file (`limit` > 0: its first `limit` rows) as a Ray Data dataset
    of `plain_row` columns plus `prompt_ids`. Errors (raised when the dataset executes) name the file and the
    row / line."""
    import ray

    return read_records(path, limit, columns).map_batches(
        Prepare,
        fn_constructor_args=(
            str(check_path(path)),
            tokenizer_path,
            max_prompt_tokens,
            truncation,
            columns,
            prefix,
        ),
        batch_format="pyarrow",
        batch_size=256,
        compute=ray.data.ActorPoolStrategy(size=1),
        num_cpus=0.25,
    )


class TrainSet:
    """The training prompts of one or more files (each read once, tokenized and materialized), epoch by
    epoch: every row of every file, or with `weights` each file's share (app/rollout/mixture.py), shuffled
    per epoch (seeded) when `shuffle`. The same epoch gives the same rows in the same order (a resume)."""

    def __init__(self, datasets: list[Any], weights: list[float] | None, shuffle: bool, seed: int) -> None:
        self.datasets, self.weights, self.shuffle, self.seed = datasets, list(weights or []), shuffle, seed
        self.counts = epoch_counts([ds.count() for ds in datasets], self.weights)

    def epoch(self, epoch: int) -> Iterator[dict[str, Any]]:
        """The rows of `epoch` (Ray Data rows: see `to_prompt`)."""
        parts = self.datasets
        if self.weights:
            parts = [
                ds.random_shuffle(seed=sample_seed(self.seed, epoch, i)).limit(k)
                for i, (ds, k) in enumerate(zip(self.datasets, self.counts, strict=True))
            ]
        ds = parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
        if self.shuffle:
            ds = ds.random_shuffle(seed=self.seed + epoch)
        return ds.iter_rows()


def train_dataset(
    paths: str | list[str],
    tokenizer_path: str,
    max_prompt_tokens: int,
    truncation: str,
    columns: Columns | None = None,
    weights: list[float] | None = None,
    shuffle: bool = True,
    seed: int = 0,
) -> TrainSet:
    """The tokenized training prompts of each file, read once and materialized, as a `TrainSet` (the
    PromptStream takes its epochs)."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    datasets = []
    for i, path in enumerate(paths):
        prefix = uid_prefix(i, len(paths))
        with data_errors():
            ds = prepared_file(path, tokenizer_path, max_prompt_tokens, truncation, columns, prefix)
        if ds.count() == 0:
            raise no_rows(check_path(path))
        datasets.append(ds)
    return TrainSet(datasets, weights, shuffle, seed)


# a training file up to this size is read and tokenized in the calling process (the rollouter); larger ones
# are streamed through Ray Data's reader and tokenizer workers, a block at a time
IN_PROCESS_BYTES = 16 * 2**20


def prepared_file(
    path: str,
    tokenizer_path: str,
    max_prompt_tokens: int,
    truncation: str,
    columns: Columns | None = None,
    prefix: str = "",
) -> Any:
    """One training file, checked and tokenized, as a materialized Ray Data dataset in few blocks.

    A file of at most IN_PROCESS_BYTES goes through `Prepare` here, block by block, as the validation
    prompts do, and becomes one Arrow block in the object store: the rows, their order and the errors are
    those of the streamed path, without a reader task and a tokenizer actor to start (a worker process that
    imports the reader and transformers: about 10 CPU-seconds before a run's first step, for milliseconds of
    tokenizing). A larger file is streamed (`prompt_dataset`): never whole in one process."""
    import ray

    p = check_path(path)  # (each path below checks the file whole: `checked_file`)
    if p.is_file() and p.stat().st_size > IN_PROCESS_BYTES:
        ds = prompt_dataset(str(p), tokenizer_path, max_prompt_tokens, truncation, 0, columns, prefix)
        return few_blocks(ds.materialize())
    import pyarrow as pa

    configure_data_context()
    rows = prepared_rows(str(p), tokenizer_path, max_prompt_tokens, truncation, 0, columns, prefix)
    ds = ray.data.from_arrow(pa.Table.from_pylist(rows))
    return ds if ds.count() <= SHUFFLE_BLOCK_ROWS else few_blocks(ds)


SHUFFLE_BLOCK_ROWS = 100_000  # rows per block of a materialized training set (see `few_blocks`)


def few_blocks(ds: Any) -> Any:
    """`ds` (materialized) in ceil(rows / SHUFFLE_BLOCK_ROWS) blocks, in order, materialized again.

    A per-epoch `random_shuffle` runs a map and a reduce task per block, each wanting a CPU: the reader's
    small blocks made a 600-row file's shuffle start ~10 new Ray workers per run (seconds of CPU each on a
    small machine) for a shuffle of milliseconds. One block shuffles in one task; a big dataset keeps a
    block per 100k rows, so its shuffle still runs in parallel. The rows keep their order (`data.shuffle`
    off reads them in file order); a seeded shuffle of the same blocks gives the same order every time."""
    import math

    blocks = max(1, math.ceil(ds.count() / SHUFFLE_BLOCK_ROWS))
    return ds.repartition(blocks).materialize()


def val_prompts(
    paths: str | list[str],
    tokenizer_path: str,
    max_prompt_tokens: int,
    truncation: str,
    val_size: int,
    columns: Columns | None = None,
) -> list[Prompt]:
    """The first `val_size` (0: all) validation prompts of each file that fit `max_prompt_tokens`.

    Read and tokenized in this process, block by block, through the training stream's own stages (`Prepare`:
    the same checks, the same messages naming the file and row). A validation set is a few hundred rows at
    most: a Ray Data pipeline would start a worker process for it (importing the reader and transformers,
    half a minute of a 2-core machine on every run's critical path) to do milliseconds of work."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    out: list[Prompt] = []
    for i, path in enumerate(paths):
        prefix = uid_prefix(i, len(paths))
        rows = prepared_rows(path, tokenizer_path, max_prompt_tokens, truncation, val_size, columns, prefix)
        if not rows:
            raise no_rows(check_path(path))
        out += [p for p in map(to_prompt, rows) if len(p.prompt_ids) <= max_prompt_tokens]
    return out


def prepared_rows(
    path: str,
    tokenizer_path: str,
    max_prompt_tokens: int,
    truncation: str,
    limit: int = 0,
    columns: Columns | None = None,
    prefix: str = "",
) -> list[dict[str, Any]]:
    """`prompt_dataset`'s rows (`limit` > 0: of the file's first `limit` rows), made in this process."""
    p = checked_file(path, columns)
    prepare = Prepare(str(p), tokenizer_path, max_prompt_tokens, truncation, columns, prefix)
    rows: list[dict[str, Any]] = []
    for block in (parquet_blocks if is_parquet(p) else jsonl_blocks)(str(p)):
        if limit > 0:
            block = block.slice(0, limit - len(rows))
        batch = prepare(block)
        rows += [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        if 0 < limit <= len(rows):
            break
    return rows


# what Ray Data appends to a failed map's exception (its retry context): not part of the row's error
_RETRY_NOTE = re.compile(r"\nFailed to .* after \d+/\d+ attempts \(total backoff [0-9.]+s\)\.[\s\S]*\Z")


def _data_error(exc: BaseException) -> DataError | None:
    """The DataError behind an error of a Ray Data execution (a task error inside a user-code error)."""
    from ray.exceptions import RayError

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        cause = getattr(e, "cause", None)  # RayTaskError: the exception the task raised
        if isinstance(cause, DataError):
            return cause
        if isinstance(e, DataError) and not isinstance(e, RayError):
            return e
        e = e.__cause__ or e.__context__
    return None


@contextlib.contextmanager
def data_errors() -> Iterator[None]:
    """Re-raise a bad row found in a Ray Data task as a plain DataError: its message, not Ray's wrapping."""
    try:
        yield
    except Exception as e:
        found = _data_error(e)
        if found is None:
            raise
        raise DataError(_RETRY_NOTE.sub("", str(found))) from None


def to_prompt(row: dict[str, Any]) -> Prompt:
    """A Ray Data row (numpy scalars and arrays) as a plain-Python `Prompt`."""
    return Prompt(
        uid=str(row["uid"]),
        prompt_ids=[int(t) for t in row["prompt_ids"]],
        answer=str(row["answer"]),
        data_source=str(row["data_source"]),
        prompt_text=str(row["prompt"]),
        chat=bool(row["is_chat"]),
        extra_info=json.loads(str(row["extra_info"])),
        index=int(row["index"]),
        truth=json.loads(str(row["truth"])),
        columns=json.loads(str(row["columns"])),
    )
