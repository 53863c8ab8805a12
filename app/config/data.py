"""`data.*`: the prompt files (or built-in tasks) of training and validation, and how they are read."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import ListConfig

from app.config.base import _SEED, Range, Truncation, _Section, require, rng


@dataclass
class DataConfig(_Section):
    train: Any = "builtin:arith"
    """`builtin:arith`, `builtin:code` (small programs with tests, scored in the sandbox), `builtin:calc`
    (two-digit products with a calculator tool: multi-turn, env.name=calculator), `builtin:wordproblems`
    (seeded GSM8K-layout word problems for a real model), `builtin:mathproblems` (seeded MATH-layout problems
    with `\\boxed{}` answers, for a real model), `builtin:humaneval` (OpenAI's HumanEval), or a .parquet
    (verl layout) / .jsonl (`{"prompt", "answer"}`) file (`~` expanded), or a list of such files
    (`data.train=[a.parquet,b.jsonl]`): mixed as `train_weights` says. With several files each row's uid
    is prefixed with its file's position (`1/17`). Every file's columns and first rows are checked at start,
    before Ray; the rest where they are read, naming the file and the row."""
    train_weights: list[float] = field(default_factory=list)
    """One weight per `data.train` file: each epoch draws from the files in these proportions, until the
    file with the fewest rows per weight is used up (the other files give a fresh seeded sample of their
    share each epoch, so every row comes up across epochs). Empty: every row of every file once per epoch."""
    val: Any = "builtin:arith"
    """Validation split: `builtin:arith` (its held-out split) or a file (or a list of files) like `train`."""
    prompt_key: str = "prompt"
    """The field (column) holding the prompt: a string or chat messages. A dotted key reads a nested field."""
    answer_key: str = ""
    """The field holding the reference answer (e.g. `solution`, `reward_model.ground_truth`); "": verl's
    `reward_model.ground_truth`, else `answer`."""
    data_source_key: str = "data_source"
    """The field naming each row's data source (picks `reward.fn=auto`'s reward); rows without one take their
    file's name."""
    max_prompt_tokens: int = 64
    """Prompts longer than this are handled per `truncation`."""
    truncation: Truncation = "drop"
    """`drop`: skip overlong prompts and count them; `error`: fail on the first one, naming its row."""
    val_size: int = 64
    """Number of validation prompts used at each validation (the first of the file); 0: the whole split."""
    shuffle: bool = True
    """Shuffle the training prompts at every epoch (seeded by `data.seed` + epoch)."""
    seed: int = 0
    """Seed of the per-epoch shuffle."""
    epochs: int = 0
    """Passes over the training prompts; 0: unlimited (`train.steps` ends the run). With a limit the run ends
    when the data is exhausted: the last groups drain and are trained (a smaller last batch)."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "max_prompt_tokens": rng(">= 1"),
        "val_size": rng(">= 0", "0: the whole split"),
        "seed": _SEED,
        "epochs": rng(">= 0", "0: unlimited"),
    }

    def check(self, prefix: str) -> None:
        """The files' form and weights; a `builtin:` task is checked against app/tasks by app/preflight.py."""
        super().check(prefix)
        for split in ("train", "val"):
            files = data_files(getattr(self, split), f"{prefix}{split}")
            for spec in files:
                if spec.startswith("builtin:"):
                    require(
                        f"{prefix}{split}",
                        len(files) == 1,
                        f"{spec} is a built-in task: give it alone, not in a list of files",
                    )
        n = len(data_files(self.train))
        require(
            f"{prefix}train_weights",
            not self.train_weights or len(self.train_weights) == n,
            f"{list(self.train_weights)}: {len(self.train_weights)} weights for {n} data.train file(s); give one "
            f"per file, in the same order (e.g. {prefix}train_weights=[{','.join(['1'] * n)}]), or [] for none",
        )
        require(
            f"{prefix}train_weights",
            all(math.isfinite(w) and w > 0 for w in self.train_weights),
            f"{list(self.train_weights)}: every weight must be a finite number > 0 (drop a file to leave it out)",
        )
        for name in ("prompt_key", "data_source_key"):
            require(f"{prefix}{name}", bool(getattr(self, name)), "empty; name the field, e.g. the default")


def data_files(spec: Any, key: str = "data.train") -> list[str]:
    """`data.train` / `data.val` as a list of file specs (one string, or a list of strings). Raises
    ConfigError for anything else."""
    if isinstance(spec, str):
        files = [spec]
    elif isinstance(spec, (list, tuple, ListConfig)) and all(isinstance(x, str) for x in spec):
        files = list(spec)
    else:
        files = []
    require(
        key,
        bool(files) and all(f.strip() for f in files),
        f"{spec!r}; expected a file path (.parquet / .jsonl), a built-in task (builtin:NAME, e.g. builtin:arith) "
        f"or a non-empty list of file paths in brackets, e.g. {key}=[a.parquet,b.parquet]",
    )
    return files
