"""Tests for app.rollout.prompt_files: loading .jsonl/.parquet prompt files, prompt rendering and overlong filtering."""

from __future__ import annotations

import json
import logging
import re
import string

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.rollout.prompt_files import (
    DataError,
    PromptRow,
    filter_overlong,
    load_rows,
    normalize_row,
    render_prompt,
)

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]


def write_jsonl(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


def write_verl_parquet(path, n=3, index=True):
    table = pa.table(
        {
            "data_source": ["openai/gsm8k"] * n,
            "prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(n)],
            "ability": ["math"] * n,
            "reward_model": [{"style": "rule", "ground_truth": str(10 + i)} for i in range(n)],
            "extra_info": [
                {"split": "train", "index": 100 + i} if index else {"split": "train"} for i in range(n)
            ],
        }
    )
    pq.write_table(table, path)
    return str(path)


def test_jsonl_good(tmp_path):
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": "max:3815=", "answer": "8"},
            "",
            {"prompt": MSGS, "answer": 4, "id": "q-7", "data_source": "arith"},
            "   ",
            {"prompt": "x", "answer": 2.5, "uid": 9},
        ],
    )
    rows = load_rows(path)
    assert rows == [  # a number is the answer's text, and kept as given (truth); other fields are columns
        PromptRow("train:0", "max:3815=", "8", "train", 0),
        PromptRow("q-7", MSGS, "4", "arith", 1, truth=4, columns={"id": "q-7"}),
        PromptRow("9", "x", "2.5", "train", 2, truth=2.5, columns={"uid": 9}),
    ]


def test_a_list_or_mapping_answer_is_kept_as_given_beside_its_json_text(tmp_path):
    """verl's ground truths may be several answers or a mapping (test cases): `truth` keeps them as the data
    gives them, `answer` is their JSON text for the built-in rewards; the row's other fields are `columns`."""
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"prompt": "a", "reward_model": {"ground_truth": ["1", "one"]}, "level": 3},
            {"prompt": "b", "answer": {"inputs": [1], "outputs": [2]}},
        ],
    )
    first, second = load_rows(path)
    assert (first.answer, first.truth) == ('["1", "one"]', ["1", "one"])
    assert first.columns == {"reward_model": {"ground_truth": ["1", "one"]}, "level": 3}
    assert (second.answer, second.truth) == (
        '{"inputs": [1], "outputs": [2]}',
        {"inputs": [1], "outputs": [2]},
    )


def test_parquet_verl_layout(tmp_path):
    rows = load_rows(write_verl_parquet(tmp_path / "gsm8k_train.parquet"))
    assert [r.uid for r in rows] == ["100", "101", "102"]
    extra = {"split": "train", "index": 101}  # carried to the reward functions, as the other columns are
    columns = {"ability": "math", "reward_model": {"style": "rule", "ground_truth": "11"}}
    assert rows[1] == PromptRow(
        "101", [{"role": "user", "content": "q1"}], "11", "openai/gsm8k", 1, extra, columns=columns
    )


def test_parquet_verl_without_index(tmp_path):
    rows = load_rows(write_verl_parquet(tmp_path / "t.parquet", index=False))
    assert [r.uid for r in rows] == ["t:0", "t:1", "t:2"]


def test_jsonl_verl_layout_loads_like_parquet(tmp_path):
    """verl rows written as JSON lines give the same PromptRows as the same rows in parquet."""
    parquet = load_rows(write_verl_parquet(tmp_path / "gsm8k.parquet"))
    recs = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(10 + i)},
            "extra_info": {"split": "train", "index": 100 + i},
        }
        for i in range(3)
    ]
    assert load_rows(write_jsonl(tmp_path / "gsm8k.jsonl", recs)) == parquet
    with pytest.raises(
        DataError, match=r"gsm8k\.jsonl row 0 \(line 1\): 'reward_model' has no 'ground_truth'"
    ):
        load_rows(write_jsonl(tmp_path / "gsm8k.jsonl", [{**recs[0], "reward_model": {"style": "rule"}}]))


def test_normalize_row_is_the_per_record_check(tmp_path):
    """The one function a streaming reader calls per record: same rules, file and row in every error."""
    row = normalize_row({"prompt": MSGS, "answer": 4}, tmp_path / "s.jsonl", 7, line=9)
    assert row == PromptRow("s:7", MSGS, "4", "s", 7, truth=4)
    verl = {
        "prompt": MSGS,
        "reward_model": {"ground_truth": "4"},
        "data_source": "d",
        "extra_info": {"index": 3},
    }
    assert normalize_row(verl, "x.parquet", 0) == PromptRow(
        "3", MSGS, "4", "d", 0, {"index": 3}, columns={"reward_model": {"ground_truth": "4"}}
    )
    with pytest.raises(DataError, match=r"^x\.parquet row 5: prompt message 1 \(user\) has blank 'content'"):
        normalize_row(
            {"prompt": [MSGS[0], {"role": "user", "content": " \n"}], "answer": "1"}, "x.parquet", 5
        )
    with pytest.raises(DataError, match=r"^x\.parquet row 2: missing key 'prompt'"):
        normalize_row({"answer": "1"}, "x.parquet", 2)


def test_parquet_plain_columns(tmp_path):
    path = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), path)
    rows = load_rows(str(path))
    assert rows == [PromptRow("plain:0", "a", "1", "plain", 0), PromptRow("plain:1", "b", "2", "plain", 1)]


@pytest.mark.parametrize(
    ("lines", "row", "fragment"),
    [
        (['{"prompt": "a", "answer": "1"}', "{not json"], "row 1 (line 2)", "invalid JSON"),
        ([{"prompt": "a"}], "row 0 (line 1)", "missing key 'answer'"),
        ([{"answer": "1"}], "row 0 (line 1)", "missing key 'prompt'"),
        (["[1, 2]"], "row 0 (line 1)", "not an object"),
        ([{"prompt": "  ", "answer": "1"}], "row 0 (line 1)", "empty 'prompt'"),
        ([{"prompt": [], "answer": "1"}], "row 0 (line 1)", "empty 'prompt' message list"),
        ([{"prompt": 5, "answer": "1"}], "row 0 (line 1)", "'prompt' is a int"),
        (
            [{"prompt": [{"content": "hi"}], "answer": "1"}],
            "row 0 (line 1)",
            "message 0 has no string 'role'",
        ),
        ([{"prompt": [{"role": "user"}], "answer": "1"}], "row 0 (line 1)", "has no string 'content'"),
        (
            [
                {
                    "prompt": [{"role": "system", "content": ""}, {"role": "user", "content": "q"}],
                    "answer": "1",
                }
            ],
            "row 0 (line 1)",
            "prompt message 0 (system) has blank 'content'",
        ),
        (
            [{"prompt": "a", "answer": "1"}, {"prompt": "\t\n", "answer": "1"}],
            "row 1 (line 2)",
            "empty 'prompt'",
        ),
        ([{"prompt": ["hi"], "answer": "1"}], "row 0 (line 1)", "message 0 has no string 'role'"),
        ([{"prompt": "a", "answer": None}], "row 0 (line 1)", "'answer' is None"),
        ([{"prompt": "a", "answer": True}], "row 0 (line 1)", "'answer' is True"),
        (
            [{"prompt": "a", "answer": "1"}, '{"prompt": "b", "answer": NaN}'],
            "row 1 (line 2)",
            "'answer' is nan, not a finite number",
        ),
        ([{"prompt": "a", "answer": float("inf")}], "row 0 (line 1)", "'answer' is inf, not a finite number"),
        (['{"prompt": "a", "answer": -Infinity}'], "row 0 (line 1)", "'answer' is -inf, not a finite"),
        (
            [{"prompt": "a", "reward_model": {"ground_truth": float("nan")}}],
            "row 0 (line 1)",
            "'reward_model.ground_truth' is nan, not a finite number",
        ),
        ([{"prompt": "a", "answer": "1", "id": [1]}], "row 0 (line 1)", "'id' is [1]"),
        ([{"prompt": "a", "answer": "1", "data_source": 3}], "row 0 (line 1)", "'data_source' must be"),
        (
            ["", {"prompt": "a", "answer": "1", "id": "x"}, {"prompt": "b", "answer": "2", "id": "x"}],
            "row 1 (line 3)",
            "duplicate id 'x' (also row 0)",
        ),
    ],
)
def test_jsonl_malformed(tmp_path, lines, row, fragment):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError) as exc:
        load_rows(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path} {row}: ")
    assert fragment in msg


def test_jsonl_message_names_the_format(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    with pytest.raises(DataError, match=r"train\.jsonl row 1 \(line 2\): missing key 'answer' \(each line"):
        load_rows(path)


def test_parquet_malformed_rows(tmp_path):
    path = tmp_path / "bad.parquet"
    table = pa.table(
        {
            "data_source": ["d", "d"],
            "prompt": [[{"role": "user", "content": "q"}], [{"role": "user", "content": "q"}]],
            "reward_model": [{"ground_truth": "1"}, {"ground_truth": None}],
        }
    )
    pq.write_table(table, path)
    with pytest.raises(
        DataError, match=rf"^{re.escape(str(path))} row 1: 'reward_model' has no 'ground_truth'"
    ):
        load_rows(str(path))

    pq.write_table(pa.table({"prompt": ["ok", ""], "answer": ["1", "2"]}), path)
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))} row 1: empty 'prompt'"):
        load_rows(str(path))

    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": None}]], "answer": ["1"]}), path)
    with pytest.raises(
        DataError, match=rf"^{re.escape(str(path))} row 0: prompt message 0 has no string 'content'"
    ):
        load_rows(str(path))


def test_parquet_nan_answer_names_the_row(tmp_path):
    path = tmp_path / "nan.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": [1.5, float("nan")]}), path)
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))} row 1: 'answer' is nan, not a finite"):
        load_rows(str(path))
    assert normalize_row({"prompt": "a", "answer": 10**400}, "big.jsonl", 0).answer == str(10**400)


def test_parquet_missing_columns(tmp_path):
    path = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"question": ["a"], "answer": ["1"]}), path)
    with pytest.raises(DataError, match=r"columns \['answer', 'question'\]; expected verl columns"):
        load_rows(str(path))


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match=r"unsupported extension '\.csv'; supported: \.jsonl, \.parquet"):
        load_rows(str(tmp_path / "x.csv"))
    with pytest.raises(DataError, match="file not found"):
        load_rows(str(tmp_path / "missing.jsonl"))
    (tmp_path / "split.jsonl").mkdir()
    with pytest.raises(DataError, match=r"split\.jsonl: is a directory, not a file"):
        load_rows(str(tmp_path / "split.jsonl"))
    with pytest.raises(DataError, match="is a directory, not a file"):
        load_rows(str(tmp_path))  # no extension: still named as a directory, not as a bad extension
    import os

    os.mkfifo(tmp_path / "pipe.jsonl")
    with pytest.raises(DataError, match="not a regular file"):
        load_rows(str(tmp_path / "pipe.jsonl"))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="not a readable parquet file"):
        load_rows(str(tmp_path / "junk.parquet"))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no rows"):
        load_rows(str(tmp_path / "empty.jsonl"))
    (tmp_path / "latin.jsonl").write_bytes('{"prompt": "caf\xe9", "answer": "1"}'.encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        load_rows(str(tmp_path / "latin.jsonl"))


TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture
def tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for c in string.printable:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def test_render_with_chat_template(tokenizer):
    tokenizer.chat_template = TEMPLATE
    ids = render_prompt(PromptRow("u", MSGS, "4", "d", 0), tokenizer)
    assert isinstance(ids, list) and all(type(t) is int for t in ids)
    assert tokenizer.decode(ids) == "<system>be brief\n<user>2+2?\n<assistant>"


def test_render_without_chat_template(tokenizer):
    assert not getattr(tokenizer, "chat_template", None)
    ids = render_prompt(PromptRow("u", MSGS, "4", "d", 0), tokenizer)
    assert tokenizer.decode(ids) == "be brief\n2+2?"


def test_render_string_prompt(tokenizer):
    tokenizer.chat_template = TEMPLATE  # not used for plain strings
    ids = render_prompt(PromptRow("u", "max:38=", "8", "d", 0), tokenizer)
    assert ids == tokenizer.encode("max:38=", add_special_tokens=False)
    assert len(ids) == 7


class _DictTokenizer:
    chat_template = "x"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return {"input_ids": [[5, 6, 7]], "attention_mask": [[1, 1, 1]]}


def test_render_normalizes_dict_output():
    assert render_prompt(PromptRow("u", MSGS, "4", "d", 0), _DictTokenizer()) == [5, 6, 7]


def _rows(lengths):
    return [(PromptRow(f"f:{i}", "p", "a", "f", i), list(range(n))) for i, n in enumerate(lengths)]


def test_filter_overlong_drop(caplog):
    items = _rows([3, 5, 4, 6])
    with caplog.at_level(logging.WARNING):
        kept, dropped = filter_overlong(items, 4, "drop")
    assert [r.uid for r, _ in kept] == ["f:0", "f:2"]
    assert dropped == 2
    assert any("dropped 2 of 4" in r.getMessage() for r in caplog.records)
    assert filter_overlong(items, 10, "drop") == (items, 0)


def test_filter_overlong_error():
    with pytest.raises(DataError) as exc:
        filter_overlong(_rows([3, 5, 6]), 4, "error")
    msg = str(exc.value)
    assert "'f:1'" in msg and "5 tokens" in msg
    assert "data.max_prompt_tokens" in msg and "data.truncation=drop" in msg
    assert filter_overlong(_rows([1, 2]), 4, "error")[1] == 0


def test_filter_overlong_bad_policy():
    with pytest.raises(ValueError, match=r"data\.truncation='truncate'"):
        filter_overlong([], 4, "truncate")


# ------------------------------------------------------------------ column mapping, several files, early checks


def test_column_mapping_reads_other_field_names(tmp_path):
    from app.rollout.prompt_files import Columns

    path = write_jsonl(
        tmp_path / "mine.jsonl",
        [
            {"question": "2+2?", "solution": "4", "meta": {"src": "arith-x"}},
            {"question": [{"role": "user", "content": "3+3?"}], "solution": 6, "meta": {}},
        ],
    )
    cols = Columns(prompt="question", answer="solution", data_source="meta.src")
    rows = load_rows(path, cols)
    assert [(r.prompt, r.answer, r.data_source) for r in rows] == [
        ("2+2?", "4", "arith-x"),
        ([{"role": "user", "content": "3+3?"}], "6", "mine"),  # no source in the row: the file's name
    ]


def test_mapped_answer_wins_over_verl_ground_truth(tmp_path):
    from app.rollout.prompt_files import Columns

    rec = {"prompt": "q", "reward_model": {"ground_truth": "1"}, "final": "2"}
    assert normalize_row(rec, "f.jsonl", 0, 1, Columns(answer="final")).answer == "2"
    assert normalize_row(rec, "f.jsonl", 0, 1, Columns(answer="reward_model.ground_truth")).answer == "1"
    assert normalize_row(rec, "f.jsonl", 0, 1).answer == "1"


def test_missing_mapped_field_names_the_setting_the_row_and_its_keys(tmp_path):
    from app.rollout.prompt_files import Columns

    path = write_jsonl(
        tmp_path / "f.jsonl", [{"question": "q", "solution": "1"}, {"q": "x", "solution": "2"}]
    )
    with pytest.raises(DataError) as e:
        load_rows(path, Columns(prompt="question", answer="solution"))
    msg = str(e.value)
    assert (
        "f.jsonl row 1 (line 2)" in msg and "data.prompt_key=question" in msg and "['q', 'solution']" in msg
    )


def test_parquet_columns_checked_against_the_mapping(tmp_path):
    from app.rollout.prompt_files import Columns

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["q"], "solution": ["1"]}), path)
    with pytest.raises(
        DataError, match=r"columns \['question', 'solution'\].*data.prompt_key, data.answer_key"
    ):
        load_rows(str(path))
    rows = load_rows(str(path), Columns(prompt="question", answer="solution"))
    assert (rows[0].prompt, rows[0].answer) == ("q", "1")
    with pytest.raises(DataError, match=r"data.prompt_key='question', data.answer_key='answer'"):
        load_rows(str(path), Columns(prompt="question", answer="answer"))


def test_check_file_reads_only_the_first_rows(tmp_path):
    from app.rollout.prompt_files import check_file

    good = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    path = write_jsonl(tmp_path / "f.jsonl", [*good, {"prompt": "late", "no_answer": 1}])
    check_file(path, rows=5)  # the bad row 5 is past the first rows: found where the file is read in full
    with pytest.raises(DataError, match=r"f.jsonl row 5 \(line 6\): missing key 'answer'"):
        check_file(path, rows=6)
    with pytest.raises(DataError, match="file not found"):
        check_file(str(tmp_path / "nope.jsonl"))


def test_bad_first_rows_fail_before_ray_and_before_any_model(tmp_path, monkeypatch):
    """resolve_inputs (the driver, before Ray and MLflow) checks each file's first rows; a bad one fails there,
    before the embedded model is built or a hub model looked up."""
    import app.driver as driver
    from app.config import load_config

    good = write_jsonl(tmp_path / "val.jsonl", [{"prompt": "q", "answer": "1"}])
    bad = write_jsonl(
        tmp_path / "train.jsonl", [{"prompt": "q", "answer": "1"}, {"prompt": "", "answer": "2"}]
    )
    monkeypatch.setattr(driver, "resolve_model_path", lambda spec: pytest.fail("model resolved before data"))
    cfg = load_config("gsm8k", [f"data.train=[{good},{bad}]", f"data.val={good}", "model.path=Org/Absent"])
    with pytest.raises(DataError, match=r"train.jsonl row 1 \(line 2\): empty 'prompt'"):
        driver.resolve_inputs(cfg)


def test_several_files_get_distinct_uids(tmp_path):
    """Two files that both number their rows from 0 and share a stem: every uid stays distinct (prefixed
    with the file's position), through the driver's Inputs and the streaming stage alike."""
    from app.config import load_config
    from app.driver import resolve_inputs
    from app.rollout.dataset import Normalize, jsonl_blocks

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = write_jsonl(
        tmp_path / "a" / "train.jsonl", [{"prompt": "x", "answer": "1"}, {"prompt": "y", "answer": "2"}]
    )
    two = write_jsonl(tmp_path / "b" / "train.jsonl", [{"prompt": "z", "answer": "3"}])
    cfg = load_config(None, [f"data.train=[{one},{two}]", f"data.val={one}", "data.train_weights=[2,1]"])
    inputs = resolve_inputs(cfg)
    assert inputs.train == [one, two] and inputs.val == [one]
    assert [r.uid for r in inputs.train_rows] == ["0/train:0", "0/train:1", "1/train:0"]
    assert [r.uid for r in inputs.val_rows] == ["train:0", "train:1"]  # one file: uids as they were
    stage = Normalize(two, None, "1/")
    assert [r.uid for b in jsonl_blocks(two) for r in stage.rows(b)] == ["1/train:0"]


@pytest.mark.parametrize(
    "sizes, weights, counts",
    [
        ([100, 1000], None, [100, 1000]),  # no weights: every row once
        ([100, 1000], [1, 1], [100, 100]),  # equal shares: the small file sets the epoch
        ([100, 1000], [1, 3], [100, 300]),
        ([1000, 100], [1, 3], [33, 100]),  # the weighted-up small file sets it: 100 / 0.75 = 133 rows
        ([10, 10, 10], [1, 2, 1], [5, 10, 5]),
    ],
)
def test_epoch_counts_keep_the_weights(sizes, weights, counts):
    from app.rollout.mixture import epoch_counts

    got = epoch_counts(sizes, weights)
    assert got == counts and all(k <= n for k, n in zip(got, sizes, strict=True))


def test_sample_seeds_differ_by_epoch_and_file():
    from app.rollout.mixture import sample_seed

    seeds = {sample_seed(0, e, i) for e in range(50) for i in range(4)}
    assert len(seeds) == 200 and sample_seed(3, 1, 0) == sample_seed(3, 1, 0)


# ------------------------------------------------------------------ scripts/prepare_data.py


def _prepare():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "prepare_data.py"
    spec = importlib.util.spec_from_file_location("prepare_data", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prepare_gsm8k_writes_prompt_files_relay_reads(tmp_path):
    from app.rewards import gsm8k_reward

    src = write_jsonl(
        tmp_path / "gsm8k_test.jsonl",
        [
            {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
            {"question": "A big sum?", "answer": "...\n#### 1,234"},
        ],
    )
    assert _prepare().main(["gsm8k", "--test", src, "--out", str(tmp_path / "out")]) == 0
    rows = load_rows(str(tmp_path / "out" / "test.parquet"))
    assert [r.answer for r in rows] == ["7", "1234"] and {r.data_source for r in rows} == {"openai/gsm8k"}
    assert rows[0].prompt[0]["role"] == "user" and 'after "####"' in rows[0].prompt[0]["content"]
    assert gsm8k_reward("so 3+4=7\n#### 7", rows[0].answer) == 1.0
    assert gsm8k_reward("#### 1234", rows[1].answer) == 1.0


def test_prepare_math_takes_the_last_boxed_answer(tmp_path):
    mod = _prepare()
    src = write_jsonl(
        tmp_path / "math.jsonl",
        [
            {"problem": "Half of 1?", "solution": "First \\boxed{2} no, it is $\\boxed{\\frac{1}{2}}$."},
            {"problem": "Given", "solution": "x", "answer": "\\sqrt{2}"},  # MATH-500 carries its answer
        ],
    )
    assert mod.main(["math", "--train", src, "--out", str(tmp_path / "m")]) == 0
    rows = load_rows(str(tmp_path / "m" / "train.parquet"))
    assert [r.answer for r in rows] == ["$\\frac{1}{2}$", "$\\sqrt{2}$"]
    assert {r.data_source for r in rows} == {"math"} and "\\boxed{}" in rows[0].prompt[0]["content"]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"problem": "p", "solution": "no box here"}])
    with pytest.raises(mod.PrepareError, match=r"bad.jsonl row 0: the solution has no \\boxed"):
        mod.convert("math", mod.Path(bad), tmp_path / "x.parquet", "train")
    assert mod.main(["math", "--train", bad, "--out", str(tmp_path / "x")]) == 2


def test_val_prompts_are_made_in_process_with_the_streams_checks(tmp_path, tokenizer):
    """Validation prompts: no Ray Data pipeline, the same rows, ids, limits and errors as the stream's."""
    from app.rollout.dataset import val_prompts

    tokenizer.save_pretrained(tmp_path / "tok")
    tok = str(tmp_path / "tok")
    lines = [
        {"prompt": "12+3=", "answer": "15"},
        "",
        {"prompt": "x" * 40, "answer": "1"},
        {"prompt": "9=", "answer": "9"},
    ]
    a = write_jsonl(tmp_path / "a.jsonl", lines)
    uids = [r.uid for r in load_rows(a)]
    got = val_prompts(a, tok, 16, "drop", 0)
    assert [p.uid for p in got] == [uids[0], uids[2]]  # the 40-token prompt does not fit
    assert got[0].prompt_ids == tokenizer.encode("12+3=", add_special_tokens=False) and got[1].answer == "9"
    assert [p.uid for p in val_prompts(a, tok, 16, "drop", 1)] == [uids[0]]
    pq_path = write_verl_parquet(tmp_path / "b.parquet", n=3)
    both = val_prompts([a, pq_path], tok, 16, "drop", 2)
    assert len(both) == 3 and both[0].uid != uids[0] and both[-1].answer == "11" and both[-1].chat
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1=", "answer": "1"}, {"prompt": "2="}])
    with pytest.raises(DataError, match=r"bad\.jsonl row 1 \(line 2\): missing key 'answer'"):
        val_prompts(bad, tok, 16, "drop", 0)
    with pytest.raises(DataError, match="no rows"):
        val_prompts(write_jsonl(tmp_path / "empty.jsonl", [""]), tok, 16, "drop", 0)
