"""The prompt files as Ray Data datasets: read and validated (app.data), tokenized, typed as `Prompt`s.

The training file is streamed: read by Ray Data's readers in tasks, tokenized in a `map_batches` stage and
kept in the object store (which spills to disk), so no single process holds the whole file. Overlong
prompts are flagged here (`data.truncation=error` fails naming the file and row); the `PromptStream`
counts and skips them.
"""

from __future__ import annotations

import json
from typing import Any

from app.data import DataError, PromptRow, render_prompt
from app.records import Prompt


class Tokenize:
    """Ray Data stage: tokenize prompts (chat template when the tokenizer has one) and flag overlong ones."""

    def __init__(self, tokenizer_path: str, max_prompt_tokens: int, truncation: str, path: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(tokenizer_path)
        self.max_tokens, self.truncation, self.path = max_prompt_tokens, truncation, path

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        ids_col: list[list[int]] = []
        for i, uid in enumerate(batch["uid"]):
            text = str(batch["prompt"][i])
            row = PromptRow(
                uid=str(uid),
                prompt=json.loads(text) if batch["is_chat"][i] else text,
                answer=str(batch["answer"][i]),
                data_source=str(batch["data_source"][i]),
                index=int(batch["index"][i]),
            )
            ids = render_prompt(row, self.tok)
            if len(ids) > self.max_tokens and self.truncation == "error":
                raise DataError(
                    f"{self.path} row {row.index}: prompt {row.uid!r} has {len(ids)} tokens, over "
                    f"data.max_prompt_tokens={self.max_tokens}; raise data.max_prompt_tokens or set "
                    "data.truncation=drop"
                )
            ids_col.append(ids)
        return {**batch, "prompt_ids": ids_col}


def plain_row(r: PromptRow) -> dict[str, Any]:
    """A validated row as Ray Data columns (chat messages as a JSON string: one column type for both)."""
    chat = isinstance(r.prompt, list)
    return {
        "uid": r.uid,
        "prompt": json.dumps(r.prompt) if chat else r.prompt,
        "is_chat": chat,
        "answer": r.answer,
        "data_source": r.data_source,
        "index": r.index,
    }


def read_prompts(path: str):
    """The validated rows of one prompt file as a Ray Data dataset (errors name the file and row)."""
    import ray

    from app.data import load_rows

    # TODO(issue 11, part 6): read with ray.data.read_json/read_parquet + a row-normalising map_batches
    # (app.data), so that the file is never whole in one process; today it is loaded here, in the
    # rollouter actor (no longer in the driver).
    return ray.data.from_items([plain_row(r) for r in load_rows(path)])


def prompt_dataset(path: str, tokenizer_path: str, max_prompt_tokens: int, truncation: str, limit: int = 0):
    """The tokenized prompts of one file (`limit` > 0: its first `limit` rows) as a Ray Data dataset."""
    import ray

    ray.data.DataContext.get_current().enable_progress_bars = False
    ds = read_prompts(path)
    if limit > 0:
        ds = ds.limit(limit)
    return ds.map_batches(
        Tokenize,
        fn_constructor_args=(tokenizer_path, max_prompt_tokens, truncation, path),
        batch_size=256,
        compute=ray.data.ActorPoolStrategy(size=1),
        num_cpus=0.25,
    )


def to_prompt(row: dict[str, Any]) -> Prompt:
    """A Ray Data row (numpy scalars and arrays) as a plain-Python `Prompt`."""
    return Prompt(
        uid=str(row["uid"]),
        prompt_ids=[int(t) for t in row["prompt_ids"]],
        answer=str(row["answer"]),
        data_source=str(row["data_source"]),
        prompt_text=str(row["prompt"]),
        index=int(row["index"]),
    )
