"""Reward functions as verl and TRL users write them, outside app/, selected by dotted path
(tests/test_rewards_styles.py). The scoring processes import this module: it imports nothing heavy."""

from __future__ import annotations

from typing import Any


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> dict:
    """verl's signature: 1 for the ground truth after `####`, plus the row's extra_info `bonus`; the data
    source as a sub-score, to show it arrives."""
    answer = solution_str.rsplit("####", 1)[-1].strip()
    bonus = float((extra_info or {}).get("bonus", 0.0))
    return {
        "score": float(answer == ground_truth) + bonus,
        "gsm8k_source": float(data_source == "openai/gsm8k"),
    }


def accuracy_reward(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float]:
    """TRL's batched signature: one score per completion; with chat prompts, TRL gives each completion as
    `[{"role": "assistant", "content": ...}]`. 0.5 more when the prompt was a chat one with a system turn."""
    out = []
    for prompt, completion, truth in zip(prompts, completions, answer, strict=True):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        system = isinstance(prompt, list) and prompt[0]["role"] == "system"
        out.append(float(text.strip() == truth) + 0.5 * system)
    return out


def trl_scalar(prompts: list, completions: list, **kwargs: Any) -> float:
    """A TRL-style function that forgot to return a list."""
    return 1.0


def trl_not_applicable(completions: list, **kwargs: Any) -> list:
    """TRL's "does not apply to this sample": None."""
    return [None for _ in completions]


def plain_with_row(
    response: str, answer: str, prompt: Any = None, data_source: str = "", extra_info: Any = None
):
    """Relay's (response, answer), also naming the row's other fields: returns what it saw."""
    return {
        "score": float(response == answer),
        "chat": float(isinstance(prompt, list)),
        "index": float((extra_info or {}).get("index", -1)),
        "source_len": float(len(data_source)),
    }


def length_bonus(response: str, answer: str) -> float:
    """A second reward for the weighted tests: the response's length in characters."""
    return float(len(response))


def needs_split(response: str, answer: str, extra_info: Any = None) -> float:
    """Loads at config time, then fails on every real row (its data has no 'split')."""
    return float(extra_info["split"] == "train")


def always_raises(response: str, answer: str) -> float:
    raise KeyError("reference_solution")


def sometimes_raises(response: str, answer: str) -> float:
    if response.endswith("1"):
        raise ValueError("cannot parse")
    return 1.0


def three_unknown(a: str, b: str, c: str) -> float:
    """Fits no style: three required parameters Relay cannot fill."""
    return 0.0


def verl_extra_required(data_source: str, solution_str: str, ground_truth: str, tokenizer: Any) -> float:
    """verl's names plus a required parameter Relay does not pass."""
    return 0.0


def only_marker(response: str, answer: str) -> float:
    """Passes the check on a first row whose answer is "zzzz" (called with it as the response), then fails on
    every response a model writes."""
    if response != "zzzz":
        raise KeyError("reference_solution")
    return 1.0
