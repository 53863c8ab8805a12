"""The streaming prompt reader (app.rollout.dataset) without Ray: its readers and its Normalize stage give the
rows `app.rollout.prompt_files.load_rows` gives, with the same errors, whatever the block size and the order blocks come in."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.rollout.dataset import (
    COLUMNS,
    Normalize,
    Tokenize,
    _data_error,
    data_errors,
    is_parquet,
    jsonl_blocks,
    parquet_blocks,
    plain_row,
    prompt_row,
)
from app.rollout.prompt_files import DataError, PromptRow, check_path, load_rows
from tests.test_data import MSGS, write_jsonl, write_verl_parquet


def stream_rows(path: str, block_rows: int = 2, reverse: bool = False) -> list[PromptRow]:
    """What the Ray Data pipeline's read + Normalize stages give, run in this process (blocks of `block_rows`;
    `reverse`: the blocks reach the stage last first, as an unordered execution may hand them over)."""
    p = str(check_path(path))
    blocks = list((parquet_blocks if is_parquet(p) else jsonl_blocks)(p, block_rows))
    stage = Normalize(p)
    rows = [r for b in (blocks[::-1] if reverse else blocks) for r in stage.rows(b)]
    return sorted(rows, key=lambda r: r.index)


MIXED = [
    {"prompt": "max:3815=", "answer": "8"},
    "",
    {"prompt": MSGS, "answer": 4, "id": "q-7", "data_source": "arith"},
    "   ",
    {"prompt": "x", "answer": 2.5, "uid": 9},
    {"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": "3"}, "data_source": "d"},
    {"prompt": "y", "answer": "1", "extra_info": {"index": 7}},
]


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("block_rows", [1, 2, 4096])
def test_jsonl_mixed_prompts_stream_like_load_rows(tmp_path, block_rows, reverse):
    path = write_jsonl(tmp_path / "train.jsonl", MIXED)
    rows = stream_rows(path, block_rows, reverse)
    assert rows == load_rows(path)
    assert [r.uid for r in rows] == ["train:0", "q-7", "9", "train:3", "7"]


@pytest.mark.parametrize("reverse", [False, True])
def test_parquet_streams_like_load_rows(tmp_path, reverse):
    verl = write_verl_parquet(tmp_path / "gsm8k.parquet", n=5)
    assert stream_rows(verl, 2, reverse) == load_rows(verl)
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "answer": ["1", "2", "3"]}), plain)
    assert stream_rows(str(plain), 2, reverse) == load_rows(str(plain))
    noindex = write_verl_parquet(tmp_path / "t.parquet", n=3, index=False)
    assert [r.uid for r in stream_rows(noindex, 1, reverse)] == ["t:0", "t:1", "t:2"]


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(
    ("lines", "fragment"),
    [
        (['{"prompt": "a", "answer": "1"}', "", "{not json"], "row 1 (line 3): invalid JSON"),
        ([{"prompt": "a", "answer": "1"}, {"prompt": "b"}], "row 1 (line 2): missing key 'answer'"),
        (
            [{"prompt": "a", "answer": "1"}, {"prompt": " \t", "answer": "1"}],
            "row 1 (line 2): empty 'prompt'",
        ),
        (["[1, 2]"], "row 0 (line 1): a JSON list, not an object"),
        (
            [
                "",
                {"prompt": "a", "answer": "1", "id": "x"},
                {"prompt": "b", "answer": "2"},
                {"prompt": "c", "answer": "3", "id": "x"},
            ],
            "row 2 (line 4): duplicate id 'x' (also row 0)",
        ),
    ],
)
def test_bad_jsonl_row_fails_like_load_rows(tmp_path, lines, fragment, reverse):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError) as streamed:
        stream_rows(path, 1, reverse)
    with pytest.raises(DataError) as loaded:
        load_rows(path)
    assert str(streamed.value) == str(loaded.value)
    assert str(streamed.value).startswith(f"{path} {fragment}")


def test_bad_parquet_row_names_the_row(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["ok", "fine", ""], "answer": ["1", "2", "3"]}), path)
    with pytest.raises(DataError, match=r"bad\.parquet row 2: empty 'prompt'"):
        stream_rows(str(path), 2)
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"], "id": ["x", "x"]}), path)
    with pytest.raises(DataError, match=r"bad\.parquet row 1: duplicate id 'x' \(also row 0\)"):
        stream_rows(str(path), 1, reverse=True)


def test_jsonl_not_utf8_names_the_row_the_line_and_the_fix_like_load_rows(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n\n{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(DataError, match=r"latin\.jsonl row 1 \(line 3\): not UTF-8 text") as streamed:
        stream_rows(str(path))
    with pytest.raises(DataError) as loaded:
        load_rows(str(path))
    assert str(streamed.value) == str(loaded.value)
    assert str(loaded.value).endswith("; save it as UTF-8 JSON lines")


def test_jsonl_crlf_and_no_trailing_newline(tmp_path):
    path = tmp_path / "crlf.jsonl"
    recs = [{"prompt": "a", "answer": "1"}, {"prompt": MSGS, "answer": "2"}]
    path.write_bytes(
        ("\r\n".join(json.dumps(r) for r in recs) + "\r\n\r\n" + json.dumps(recs[0] | {"id": "z"})).encode()
    )
    assert stream_rows(str(path)) == load_rows(str(path))


def test_plain_row_round_trip():
    for r in [PromptRow("u", MSGS, "4", "d", 3), PromptRow("v", "text", "1", "s", 0)]:
        assert prompt_row(plain_row(r)) == r


def test_data_error_unwraps_ray_task_errors():
    from ray.exceptions import RayTaskError, UserCodeException

    bad = DataError("f.jsonl row 3 (line 5): missing key 'answer'")
    task_err = RayTaskError("Normalize", "traceback text", bad).as_instanceof_cause()
    try:
        try:
            raise task_err
        except Exception as e:
            raise UserCodeException("map_batches failed") from e
    except Exception as wrapped:
        assert _data_error(wrapped) is bad
    assert _data_error(ValueError("x")) is None


def test_data_errors_drops_ray_retry_note():
    from ray.exceptions import RayTaskError

    note = (
        "\nFailed to apply UDF transform after 1/1 attempts (total backoff 0.0s)."
        "\nTo change retry attempts, configure it if you believe this to be transient."
    )
    bad = DataError("f.jsonl row 3 (line 5): missing key 'answer' (each line ...)" + note)
    with pytest.raises(DataError) as exc, data_errors():
        raise RayTaskError("Normalize", "tb", bad).as_instanceof_cause()
    assert str(exc.value) == "f.jsonl row 3 (line 5): missing key 'answer' (each line ...)"
    assert type(exc.value) is DataError


def _digit_blind_tokenizer(tmp_path) -> str:
    """A saved word-level tokenizer that drops digits before it splits words: a prompt of digits only is
    0 tokens (as prompts of words a word-level vocabulary strips are)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "max": 3}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(Regex("[0-9]"), "")
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(tmp_path / "tok")
    return str(tmp_path / "tok")


def _batch(rows: list[PromptRow]) -> dict[str, list]:
    plain = [plain_row(r) for r in rows]
    return {k: [p[k] for p in plain] for k in COLUMNS}


@pytest.mark.parametrize("truncation", ["drop", "error"])
def test_a_prompt_of_zero_tokens_is_refused_naming_the_file_and_row(tmp_path, truncation):
    """vLLM fails every request of an empty prompt ("The decoder prompt cannot be empty"): the Tokenize
    stage refuses the row before the run starts, under either data.truncation."""
    tok = _digit_blind_tokenizer(tmp_path)
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [{"prompt": "max 3815", "answer": "8"}, "", {"prompt": "3815", "answer": "8", "id": "digits"}],
    )
    rows = stream_rows(path)
    stage = Tokenize(tok, 64, truncation, path)
    assert stage(_batch(rows[:1]))["prompt_ids"] == [[3]]
    with pytest.raises(DataError) as exc:
        stage(_batch(rows))
    msg = str(exc.value)
    assert msg.startswith(f"{path} row 1: prompt 'digits' is 0 tokens after tokenization"), msg
    assert tok in msg and "fix or remove the row" in msg
