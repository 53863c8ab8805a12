"""`reward.*`: the reward functions, their weights and deadlines, the reward workers and DAPO's overlong
punishment. That `reward.fn` / `reward.fns` resolve (and fit `reward.weights`) is checked by app/preflight.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from app.config.base import _SHARE, _TIMEOUT, Range, _Section, rng


@dataclass
class RewardConfig(_Section):
    fn: str = "auto"
    """`auto` (per data source), `exact_match`, `gsm8k`, `gsm8k_shaped` (the strict `#### N` match 1.0, the
    flexible last-number match 0.8, the format alone 0.1: signal for a small model), `math` (answer
    equivalence with math-verify), `math_shaped` (the boxed answer 1.0, math-verify's reading of the whole
    response 0.8, a wrong `\\boxed{}` 0.1), `code` (sandboxed tests), `humaneval` (HumanEval's tests in the
    sandbox), or a dotted path `pkg.module:function`/`pkg.module.function` to a function in one of three
    styles, told apart by its parameter names: `(response, answer)`, verl's `compute_score(data_source,
    solution_str, ground_truth, extra_info)` or TRL's batched `(prompts, completions, **kwargs)` returning a
    list. A user function is also called once on the training data's first row before the run starts."""
    fns: list[str] = field(default_factory=list)
    """Several reward functions (each as `reward.fn` takes one), instead of `reward.fn`: a sample's reward is
    their weighted sum (`reward.weights`), each function's score is logged as `reward/<name>` (its built-in or
    function name) and kept in the trajectory record. A failed function scores `on_error` in the sum."""
    weights: list[float] = field(default_factory=list)
    """One weight per function of `reward.fns` (or of `reward.fn`); empty: all 1.0."""
    fail_fast_samples: int = 32
    """Stop the run, naming the first failure (function, error, row), when every one of the first this many
    samples scored failed (raised, timed out, returned a non-number) instead of training on `on_error`; 0: off."""
    timeout_s: float = 10.0
    """Deadline for one reward computation; a timeout scores `on_error`."""
    on_error: float = 0.0
    """Score given to a sample whose reward function raised, hung or returned a non-number."""
    workers: int = 0
    """CPU reward workers (Ray actors); 0 scores in the rollouter's own threads."""
    worker_cpus: float = 0.5
    """Logical CPUs per reward worker."""
    max_concurrency: int = 8
    """Rewards one worker (or, with no workers, the rollouter) computes at once."""
    max_memory_mb: int = 4096
    """Memory limit of each scoring process (RLIMIT_DATA: heap and private mappings, MiB), so a reward
    cannot take the memory of vLLM and the trainer; a reward that allocates past it scores `on_error`,
    counted as reward/errors_oom. What a reward prints is capped too (the rest is dropped and counted)."""
    overlap: bool = True
    """Score each trajectory the moment it finishes, while the rest generate; false scores a batch after
    all of it is generated (sync and one_step_off; the baseline of bench/reward_overlap.py)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment (0: off): a training response longer than rollout.max_tokens - this
    loses overlong_factor x (its excess / this) of reward, reaching -overlong_factor at max_tokens.
    Validation rewards are never shaped. Logged per sample as the sub-score `overlong_penalty`."""
    overlong_factor: float = 1.0
    """The most reward the overlong punishment takes (at rollout.max_tokens)."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "overlong_buffer": rng(">= 0", "0 turns the overlong punishment off"),
        "overlong_factor": rng(">= 0"),
        "timeout_s": _TIMEOUT,
        "on_error": rng("finite", "it is averaged into rewards and advantages"),
        "workers": rng(">= 0", "0: score in the rollouter"),
        "worker_cpus": _SHARE,
        "max_concurrency": rng(">= 1"),
        "max_memory_mb": rng(">= 128", "the interpreter and a reward's imports need about 100 MiB"),
        "fail_fast_samples": rng(">= 0", "0 turns the check off"),
    }
