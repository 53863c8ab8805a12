"""One real call of each user reward function on the training data's first row, before Ray starts.

Config load already refused a function whose parameters fit none of the styles (app/rewards/styles.py). This
calls each dotted-path function (`reward.fn` / `reward.fns`; the built-ins are Relay's own and tested) once,
in a scoring process with the run's deadline and memory limit (app/rewards/pool.py), on the first row of the
training data with the row's reference answer as the response. A function that raises, hangs, returns
something that is not a score or takes a column the data does not have there would fail on every sample of
the run: `RewardCheckError` says so now, naming the function, its style, the row and the error, instead of
minutes later (or never).
"""

from __future__ import annotations

import logging
from typing import Any

from app.errors import UserError
from app.rewards import BUILTINS, resolve_reward_fn
from app.rewards.combine import RewardSpec, reward_specs
from app.rewards.pool import RewardProcesses
from app.rewards.styles import RewardCall, RewardInput
from app.rollout.prompt_files import Columns, PromptRow, load_rows

log = logging.getLogger(__name__)


class RewardCheckError(UserError, ValueError):
    """A user reward function failed on the training data's first row; the message names it and the row."""


def first_row(path: str, columns: Columns | None = None) -> PromptRow:
    """The first row of a prompt file, read and checked as the run will read it (`columns`: data.*_key)."""
    return load_rows(path, columns, limit=1)[0]


def user_specs(reward_cfg: Any) -> list[RewardSpec]:
    """The configured functions that are not built-ins (dotted paths)."""
    specs = reward_specs(reward_cfg.fn, list(reward_cfg.fns or []), list(reward_cfg.weights or []))
    return [s for s in specs if s.spec not in BUILTINS and s.spec != "auto"]


def check_on_first_row(reward_cfg: Any, train: str | list[str], columns: Columns | None = None) -> None:
    """Call every user reward function once on the first row of the training data (the first of its files);
    RewardCheckError when one fails (raises, misses `reward.timeout_s`, returns a non-score). Reads nothing
    without user functions."""
    specs = user_specs(reward_cfg)
    if not specs:
        return
    train_path = train if isinstance(train, str) else train[0]
    row = first_row(train_path, columns)
    inp = RewardInput(
        response=row.answer,
        answer=row.answer,
        prompt=row.prompt,
        data_source=row.data_source,
        extra_info=row.extra_info,
        truth=row.truth,
        columns=row.columns,
        uid=row.uid,
    )
    for spec in specs:
        style = RewardCall.of(resolve_reward_fn(spec.spec, row.data_source), spec.spec).style
        procs = RewardProcesses(
            spec.spec, reward_cfg.timeout_s, reward_cfg.on_error, 1, reward_cfg.max_memory_mb
        )
        try:
            res = procs.score(inp)
        finally:
            procs.close()
        if res.error is not None:
            raise RewardCheckError(
                f"reward {spec.spec!r} ({style} style) failed on the first row of {train_path}, called with "
                f"the row's answer as the response: {res.error}: {res.detail}; on {inp.where()}. It would "
                "fail the same way on every sample: fix the function (call it on that row yourself)"
            )
        log.info(
            "reward %s (%s style) scored %.4g on the first row of %s (its answer as the response)",
            spec.spec,
            style,
            res.score,
            train_path,
        )
