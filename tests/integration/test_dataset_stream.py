"""Prompt files streamed through Ray Data (app.rollout.dataset.read_prompts) on the shared local cluster: the
rows and the errors are those of `app.rollout.prompt_files.load_rows`, across several read blocks."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.rollout.dataset import BLOCK_ROWS, data_errors, prompt_row, read_prompts
from app.rollout.prompt_files import DataError, load_rows
from tests.test_data import MSGS, write_jsonl, write_verl_parquet


def streamed(path: str, limit: int = 0) -> list:
    with data_errors():
        rows = [prompt_row(r) for r in read_prompts(path, limit).take_all()]
    return sorted(rows, key=lambda r: r.index)


def mixed_lines(n: int) -> list:
    """n rows: plain strings, chat messages, verl records, numbers as answers, some ids, blank lines."""
    out: list = []
    for i in range(n):
        if i % 4 == 0:
            out.append({"prompt": f"max:{i}=", "answer": i})
        elif i % 4 == 1:
            out.append(
                {"prompt": [MSGS[0], {"role": "user", "content": f"q{i}"}], "answer": "4", "id": f"m{i}"}
            )
        elif i % 4 == 2:
            out.append({"prompt": MSGS, "reward_model": {"ground_truth": str(i)}, "data_source": "verl"})
        else:
            out.append("")
    return out


def test_jsonl_and_parquet_stream_to_load_rows(ray_cluster, tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", mixed_lines(2 * BLOCK_ROWS + 100))  # three read blocks
    rows = streamed(path)
    assert rows == load_rows(path)
    assert streamed(path, limit=5) == rows[:5]  # validation rows: the first val_size

    verl = write_verl_parquet(tmp_path / "gsm8k.parquet", n=7)
    assert streamed(verl) == load_rows(verl)
    big = tmp_path / "plain.parquet"
    n = BLOCK_ROWS + 10
    pq.write_table(
        pa.table({"prompt": [f"p{i}" for i in range(n)], "answer": [str(i) for i in range(n)]}), big
    )
    assert streamed(str(big)) == load_rows(str(big))


@pytest.mark.parametrize(
    "bad",
    [
        "{not json",
        {"prompt": "a"},
        {"prompt": "  ", "answer": "1"},
        {"prompt": "b", "answer": "1", "id": "m1"},  # the id of row 1
    ],
)
def test_bad_row_fails_naming_file_and_line(ray_cluster, tmp_path, bad):
    lines = mixed_lines(BLOCK_ROWS + 50)
    lines.insert(BLOCK_ROWS + 20, bad)  # in the second read block
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError) as loaded:
        load_rows(path)
    with pytest.raises(DataError) as exc:
        streamed(path)
    assert type(exc.value) is DataError
    assert str(exc.value) == str(loaded.value)
    assert str(exc.value).startswith(f"{path} row ")
    assert f"(line {BLOCK_ROWS + 21})" in str(exc.value)
