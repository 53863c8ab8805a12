"""Prompt files streamed through Ray Data (app.rollout.dataset.read_prompts) on the shared local cluster: the
rows and the errors are those of `app.rollout.prompt_files.load_rows`, across several read blocks."""

from __future__ import annotations

from pathlib import Path

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


def test_two_files_mixed_by_weight(ray_cluster, cache_dir, tmp_path):
    """data.train=[a,b] with data.train_weights=[1,1] through the rollouter's own dataset code: each epoch
    takes every row of the smaller file and as many sampled rows of the larger, uids prefixed by file; the
    same epoch gives the same rows in the same order (a resume), the next one another sample; validation
    takes the first val_size rows of each file."""
    from app.rollout.dataset import to_prompt, train_dataset, val_prompts
    from app.rollout.prompt_files import Columns
    from app.tasks.tiny import ensure_builtin

    tok = str(ensure_builtin(cache_dir) / "model")
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"max:{1000 + i}=", "answer": "1"} for i in range(8)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"q": f"max:{2000 + i}=", "ans": "2"} for i in range(40)])
    b_mapped = tmp_path / "b2.jsonl"  # one column mapping for every file: b's fields renamed to match
    write_jsonl(b_mapped, [{"prompt": f"max:{2000 + i}=", "answer": "2"} for i in range(40)])
    files = [a, str(b_mapped)]
    train = train_dataset(files, tok, 64, "drop", Columns(), [1, 1], shuffle=True, seed=3)
    assert train.counts == [8, 8]
    e0 = [to_prompt(r) for r in train.epoch(0)]
    assert len(e0) == 16 and sum(p.uid.startswith("0/") for p in e0) == 8
    assert {p.uid for p in e0 if p.uid.startswith("0/")} == {f"0/a:{i}" for i in range(8)}
    assert [to_prompt(r).uid for r in train.epoch(0)] == [p.uid for p in e0]
    e1 = {to_prompt(r).uid for r in train.epoch(1)}
    assert {u for u in e1 if u.startswith("1/")} != {p.uid for p in e0 if p.uid.startswith("1/")}
    val = val_prompts(files, tok, 64, "drop", 3, Columns())
    assert [p.uid for p in val] == ["0/a:0", "0/a:1", "0/a:2", "1/b2:0", "1/b2:1", "1/b2:2"]
    mapped = val_prompts([b], tok, 64, "drop", 2, Columns(prompt="q", answer="ans"))
    assert [(p.uid, p.answer) for p in mapped] == [("b:0", "2"), ("b:1", "2")]


def test_train_set_in_few_blocks_keeps_order_and_seeded_shuffles(ray_cluster, monkeypatch):
    """The training set is shuffled in few blocks (one per SHUFFLE_BLOCK_ROWS rows: a small file's shuffle
    starts no new Ray workers); the rows keep their order unshuffled, and a seeded epoch is the same order
    every time it is taken (a resume), another epoch another order."""
    import ray

    from app.rollout import dataset
    from app.rollout.dataset import TrainSet, few_blocks

    ctx = ray.data.DataContext.get_current()  # ordered execution, as the rollouter's configure_data_context
    monkeypatch.setattr(ctx.execution_options, "preserve_order", True)
    in_order = [f"t:{i}" for i in range(250)]
    read = ray.data.from_items([{"uid": u} for u in in_order], override_num_blocks=10).materialize()
    small = few_blocks(read)  # (the blocks the reader and the tokenizer made: 10 here)
    assert small.num_blocks() == 1
    assert [r["uid"] for r in TrainSet([small], None, shuffle=False, seed=0).epoch(0)] == in_order
    monkeypatch.setattr(dataset, "SHUFFLE_BLOCK_ROWS", 100)  # a "big" file: its shuffle stays parallel
    big = TrainSet([few_blocks(read)], None, shuffle=True, seed=5)
    assert big.datasets[0].num_blocks() == 3
    e0 = [r["uid"] for r in big.epoch(0)]
    assert sorted(e0) == sorted(in_order) and e0 != in_order
    assert [r["uid"] for r in big.epoch(0)] == e0
    assert [r["uid"] for r in big.epoch(1)] != e0


def test_a_small_training_file_tokenized_in_process_gives_the_streamed_epochs_and_errors(
    ray_cluster, cache_dir, tmp_path, monkeypatch
):
    """A training file of at most IN_PROCESS_BYTES is checked and tokenized in the rollouter's own process; a
    larger one streams through Ray Data's reader and tokenizer workers. Both give the same prompts in the same
    order at every seeded epoch, and the same one-line error for a bad row."""
    from app.rollout import dataset
    from app.rollout.prompt_files import Columns
    from app.tasks.tiny import ensure_builtin

    tok = str(ensure_builtin(cache_dir) / "model")
    rows = [{"prompt": f"max:{1000 + i}=", "answer": str(i % 7), "id": f"q{i}"} for i in range(300)]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    bad = write_jsonl(tmp_path / "bad.jsonl", [*rows[:150], {"prompt": "max:1=", "answer": "1", "id": "q3"}])

    def epochs() -> list[list]:
        train = dataset.train_dataset(path, tok, 64, "drop", Columns(), None, shuffle=True, seed=3)
        return [[dataset.to_prompt(r) for r in train.epoch(e)] for e in (0, 1)]

    def error() -> str:
        with pytest.raises(DataError) as exc:
            dataset.train_dataset(bad, tok, 64, "drop", Columns(), None, shuffle=True, seed=3)
        return str(exc.value)

    assert Path(path).stat().st_size <= dataset.IN_PROCESS_BYTES
    in_process, in_process_error = epochs(), error()
    monkeypatch.setattr(dataset, "IN_PROCESS_BYTES", 0)  # every file streamed
    assert epochs() == in_process
    assert error() == in_process_error and "row 150" in in_process_error and "'q3'" in in_process_error
    assert len(in_process[0]) == 300 and in_process[0] != in_process[1]
    assert sorted(p.uid for p in in_process[0]) == sorted(f"q{i}" for i in range(300))
