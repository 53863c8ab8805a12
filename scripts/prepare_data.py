"""Write GSM8K- or MATH-style prompt files for Relay from a local copy of the public data set.

    python scripts/prepare_data.py gsm8k --train gsm8k/train.jsonl --test gsm8k/test.jsonl --out ~/data/gsm8k
    python scripts/prepare_data.py math --train math/train.jsonl --test math/test.jsonl --out ~/data/math

Input: `.jsonl` or `.parquet` in the public layouts: GSM8K rows `{"question", "answer": "... #### 72"}`
(openai/gsm8k), MATH rows `{"problem", "solution": "... \\boxed{...}"}` (hendrycks MATH; an `answer` field, as in
MATH-500, is taken as is). Output: `<out>/train.parquet` and `<out>/test.parquet` with the columns Relay reads
(app/rollout/prompt_files.py): `prompt` (one user chat message: the question and an instruction on the answer
format), `answer` (the reference: GSM8K's number, MATH's final answer as `$...$`), `data_source`
(`openai/gsm8k`, `math`: `reward.fn=auto` picks the matching reward), `extra_info` (`split`, `index`). A row
without the fields, or a MATH solution without a `\\boxed{}` answer, fails naming the file and row.
Needs only pyarrow (no network, no `datasets`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("prepare_data")

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


class PrepareError(ValueError):
    """An input file or row that cannot be converted; the message names the file, the row and the fix."""


def read_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number from 0, record) of a `.jsonl` (blank lines skipped) or `.parquet` file."""
    if not path.is_file():
        raise PrepareError(f"{path}: file not found")
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        yield from enumerate(pq.read_table(path).to_pylist())
        return
    if path.suffix.lower() not in (".jsonl", ".json"):
        raise PrepareError(f"{path}: unsupported extension {path.suffix!r}; give a .jsonl or .parquet file")
    lines = (line for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    for row, line in enumerate(lines):
        try:
            yield row, json.loads(line)
        except json.JSONDecodeError as e:
            raise PrepareError(f"{path} row {row}: invalid JSON ({e.msg})") from e


def _field(rec: dict[str, Any], key: str, where: str, layout: str) -> str:
    value = rec.get(key)
    if not isinstance(value, str) or not value.strip():
        raise PrepareError(f"{where}: no string {key!r} (keys: {sorted(rec)}); expected {layout}")
    return value


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces matched; None if none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def gsm8k_row(rec: dict[str, Any], where: str) -> tuple[str, str]:
    """(question, reference number) of a GSM8K record."""
    layout = 'GSM8K rows {"question", "answer": "... #### 72"}'
    question, answer = _field(rec, "question", where, layout), _field(rec, "answer", where, layout)
    if "####" not in answer:
        raise PrepareError(f"{where}: 'answer' has no '#### N' final answer; expected {layout}")
    final = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return question, final


def math_row(rec: dict[str, Any], where: str) -> tuple[str, str]:
    """(problem, reference answer as `$...$`) of a MATH record: its `answer`, else its solution's last box."""
    layout = 'MATH rows {"problem", "solution": "... \\\\boxed{...}"} (or with an "answer" field)'
    problem = _field(rec, "problem", where, layout)
    answer = rec.get("answer")
    if not (isinstance(answer, str) and answer.strip()):
        answer = last_boxed(_field(rec, "solution", where, layout))
        if not answer:
            raise PrepareError(f"{where}: the solution has no \\boxed{{}} final answer; expected {layout}")
    answer = answer.strip()
    return problem, answer if answer.startswith("$") else f"${answer}$"


TASKS: dict[str, tuple[Callable[[dict[str, Any], str], tuple[str, str]], str, str]] = {
    "gsm8k": (gsm8k_row, GSM8K_INSTRUCTION, "openai/gsm8k"),
    "math": (math_row, MATH_INSTRUCTION, "math"),
}


def convert(task: str, src: Path, dst: Path, split: str) -> int:
    """Write `dst` (parquet) from `src` in `task`'s public layout; returns the number of rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    row_fn, instruction, source = TASKS[task]
    out: dict[str, list] = {"prompt": [], "answer": [], "data_source": [], "extra_info": []}
    for row, rec in read_rows(src):
        if not isinstance(rec, dict):
            raise PrepareError(f"{src} row {row}: a {type(rec).__name__}, not an object")
        question, answer = row_fn(rec, f"{src} row {row}")
        out["prompt"].append([{"role": "user", "content": f"{question.strip()} {instruction}"}])
        out["answer"].append(answer)
        out["data_source"].append(source)
        out["extra_info"].append({"split": split, "index": row})
    if not out["prompt"]:
        raise PrepareError(f"{src}: no rows")
    dst.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(out), dst)
    return len(out["prompt"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("task", choices=sorted(TASKS))
    p.add_argument("--train", type=Path, help="the public train split (.jsonl or .parquet)")
    p.add_argument("--test", type=Path, help="the public test split (.jsonl or .parquet)")
    p.add_argument("--out", type=Path, required=True, help="folder for train.parquet and test.parquet")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not (args.train or args.test):
        p.error("give --train and/or --test")
    try:
        for split, src in (("train", args.train), ("test", args.test)):
            if src is not None:
                dst = args.out.expanduser() / f"{split}.parquet"
                n = convert(args.task, src.expanduser(), dst, split)
                log.info("wrote %s (%d rows)", dst, n)
    except PrepareError as e:
        log.error("%s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
