"""How a reward function is called: the three styles users bring, told apart by parameter names at load.

    style   the function                                  Relay calls it with
    plain   fn(response, answer)                          one sample: response, answer (as text) positionally;
                                                          `prompt`, `data_source`, `extra_info` and the row's
                                                          columns by keyword when it names them (or **kwargs)
    verl    compute_score(data_source, solution_str,      one sample, by keyword: data_source, solution_str (the
            ground_truth, extra_info=None)                response), ground_truth (the answer as the data gives
                                                          it: text, number, list or mapping), extra_info, and the
                                                          row's columns it names (all of them with **kwargs)
    trl     fn(prompts, completions, **kwargs) -> list    a whole group in one call, by keyword, lists with one
                                                          entry per completion: prompts, completions, answer and
                                                          ground_truth (as the data gives it), data_source,
                                                          extra_info, and each column of the row by its own name

A function that names `solution_str` is verl's; one that names `completions` is TRL's; any other is plain and
must accept `(response, answer)` positionally. The row's columns are its fields other than prompt, answer,
data_source and extra_info, under the names the data file gives them (a column mapped by `data.answer_key`
keeps its own name too); Relay's keywords win over a column of the same name. As in TRL, a parameter of a
TRL-style function that Relay does not pass is a column the data must have: a row without it fails the call
(`MissingColumn`, found by the first-row check before Ray starts, app/rewards/check.py). Any other parameter
without a default that Relay does not pass, or a plain function that cannot take two positional arguments,
is refused at load (`SignatureError`) naming these styles. All three return a number or a dict with a
`"score"` key (TRL: a list of those, one per completion; a `None` in it, TRL's "does not apply to this
sample", scores 0). As in TRL, a chat prompt gives the completion as `[{"role": "assistant", "content":
response}]`; a plain-text prompt gives the text.

Imports nothing heavy.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.records import Prompt

STYLES_HELP = (
    "Relay calls a reward function in one of three styles, told apart by parameter names: "
    "(response, answer) [optionally naming prompt, data_source, extra_info or a column of the data]; "
    "verl's compute_score(data_source, solution_str, ground_truth, extra_info=None); "
    "TRL's batched (prompts, completions, **kwargs) returning a list of floats (its other parameters: "
    "columns of the data, by name)"
)
ROW_KEYS = ("prompt", "data_source", "extra_info")
VERL_KEYS = ("data_source", "solution_str", "ground_truth", "extra_info")
TRL_KEYS = ("prompts", "completions", "answer", "ground_truth", "data_source", "extra_info")


class SignatureError(ValueError):
    """A reward function whose parameters fit none of the styles; the message names them."""


class MissingColumn(ValueError):
    """A reward takes a column (a TRL-style parameter without a default) that the row does not have."""


class InvalidReturn(ValueError):
    """A reward returned something of the wrong shape for its style (scored as error "invalid")."""


@dataclass(frozen=True, kw_only=True)
class RewardInput:
    """One sample to score: the response, the row's reference answer, and what else the row has.

    `prompt` is the row's prompt as written in the data (a string or chat messages); `answer` the reference
    answer as text, `truth` as the data gives it when that is not a string (None: `answer` is it); `columns`
    the row's other columns by name; `uid` names the row in messages and is never passed to a reward function.
    """

    response: str
    answer: str
    prompt: str | list[dict[str, Any]] = ""
    data_source: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    truth: Any = None
    columns: dict[str, Any] = field(default_factory=dict)
    uid: str = ""

    @property
    def ground_truth(self) -> Any:
        """The reference answer as the data gives it (verl's `ground_truth`): `truth`, else `answer`."""
        return self.answer if self.truth is None else self.truth

    @classmethod
    def of(cls, prompt: Prompt, response: str) -> RewardInput:
        """The reward's view of `response` to the prompt record `prompt` (app/records.py)."""
        text: str | list[dict[str, Any]] = prompt.prompt_text
        if prompt.chat and text:
            text = json.loads(text)
        return cls(
            response=response,
            answer=prompt.answer,
            prompt=text,
            data_source=prompt.data_source,
            extra_info=dict(prompt.extra_info),
            truth=prompt.truth,
            columns=dict(prompt.columns),
            uid=prompt.uid,
        )

    def where(self) -> str:
        """The row, in words, for error messages."""
        prompt = self.prompt if isinstance(self.prompt, str) else json.dumps(self.prompt)
        return (
            f"row {self.uid!r} (data_source {self.data_source!r}, prompt {prompt[:120]!r}, "
            f"answer {self.answer[:120]!r}), response {self.response[:120]!r}"
        )


@dataclass(frozen=True)
class RewardCall:
    """A reward function with the style it is called in and what it receives: `keywords`, Relay's own (see
    the module docstring); `takes`, its other keyword parameters, filled from the row's columns of those
    names; `needs`, those of `takes` a row must have (TRL style: no default); `rest`, with **kwargs, the
    names no column is passed under (Relay's keywords, the plain style's positional parameters), None
    without: then it gets only the columns it names."""

    fn: Callable[..., Any]
    style: str = "plain"
    keywords: tuple[str, ...] = ()
    takes: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    rest: frozenset[str] | None = None

    @classmethod
    def of(cls, fn: Callable[..., Any], name: str = "") -> RewardCall:
        """Detect `fn`'s style from its parameters; SignatureError naming the styles when none fits."""
        name = name or getattr(fn, "__qualname__", repr(fn))
        try:
            sig = inspect.signature(fn)
        except (
            TypeError,
            ValueError,
        ):  # no introspectable signature (some C builtins): as (response, answer)
            return cls(fn)
        params = sig.parameters
        if "solution_str" in params:
            return cls(fn, "verl", **_parameters(params, VERL_KEYS, f"{name}{sig} (verl style)"))
        if "completions" in params:
            what = f"{name}{sig} (TRL style)"
            return cls(fn, "trl", **_parameters(params, TRL_KEYS, what, columns_required=True))
        try:
            bound = sig.bind("", "")
        except TypeError as e:
            raise SignatureError(
                f"cannot call {name}{sig} as (response, answer): {e}. {STYLES_HELP}"
            ) from None
        free = {k: p for k, p in params.items() if k not in bound.arguments}
        row_keys = [k for k in ROW_KEYS if k not in bound.arguments]
        found = _parameters(free, row_keys, f"{name}{sig}", required=False)
        if found["rest"] is not None:  # **kwargs: no column under the names filled by position
            found["rest"] = found["rest"] | set(bound.arguments)
        return cls(fn, "plain", **found)

    def __call__(self, inp: RewardInput) -> Any:
        """The function's raw return value for one sample (awaitable for an async function); TRL style: a
        group of one."""
        if self.style == "trl":
            return self.group([inp])
        columns = self.columns(inp.columns)
        if self.style == "verl":
            offered = {
                "data_source": inp.data_source,
                "solution_str": inp.response,
                "ground_truth": inp.ground_truth,
                "extra_info": inp.extra_info,
            }
            return self.fn(**columns, **{k: offered[k] for k in self.keywords})
        row = {"prompt": inp.prompt, "data_source": inp.data_source, "extra_info": inp.extra_info}
        return self.fn(inp.response, inp.answer, **columns, **{k: row[k] for k in self.keywords})

    def group(self, inps: Sequence[RewardInput]) -> Any:
        """A TRL-style function's raw return value for a group of samples of one row, in one call: every
        keyword a list with one entry per sample (awaitable for an async function)."""
        if self.style != "trl":
            raise ValueError(f"only a TRL-style reward scores a group in one call, not a {self.style} one")
        offered = {
            "prompts": [i.prompt for i in inps],
            "completions": [_completion(i) for i in inps],
            "answer": [i.ground_truth for i in inps],
            "ground_truth": [i.ground_truth for i in inps],
            "data_source": [i.data_source for i in inps],
            "extra_info": [i.extra_info for i in inps],
        }
        names = self.columns(inps[0].columns) if inps else {}
        columns = {k: [i.columns.get(k) for i in inps] for k in names}
        return self.fn(**columns, **{k: offered[k] for k in self.keywords})

    def columns(self, row: dict[str, Any]) -> dict[str, Any]:
        """The columns of `row` (a RewardInput's `columns`) this function receives, by name; MissingColumn
        when `row` lacks one it needs."""
        missing = [k for k in self.needs if k not in row]
        if missing:
            raise MissingColumn(
                f"the reward takes {', '.join(map(repr, missing))}, which Relay passes from the data's "
                f"column{'s' if len(missing) > 1 else ''} of that name, and this row has none; its columns: "
                f"{sorted(row)} besides prompt, answer, data_source, extra_info (data.answer_key's column "
                "keeps its own name). Rename the parameter or give it a default"
            )
        if self.rest is None:
            return {k: row[k] for k in self.takes if k in row}
        return {k: v for k, v in row.items() if k not in self.rest}

    def entries(self, value: Any, n: int = 1) -> list[Any]:
        """Each sample's value of what the function returned for `n` samples: a TRL-style list's entries (None:
        0.0), else the value itself (n is 1)."""
        if self.style != "trl":
            return [value]
        if hasattr(value, "tolist"):  # a numpy array or a torch tensor
            value = value.tolist()
        if isinstance(value, (str, bytes, dict)) or not isinstance(value, Sequence):
            raise InvalidReturn(
                f"a TRL-style reward returns a list with one score per completion; got {value!r:.200}"
            )
        items = list(value)
        if len(items) != n:
            raise InvalidReturn(
                f"a TRL-style reward got {n} completion{'s' if n > 1 else ''} and returned {len(items)} scores"
            )
        return [0.0 if v is None else v for v in items]


def _completion(inp: RewardInput) -> Any:
    """TRL's completion: the assistant's message for a chat prompt, else the text."""
    return [{"role": "assistant", "content": inp.response}] if isinstance(inp.prompt, list) else inp.response


def _parameters(
    params: Any, offered: Sequence[str], what: str, required: bool = True, columns_required: bool = False
) -> dict[str, Any]:
    """What a function with `params` receives (RewardCall's fields): the keywords of `offered` it names (all
    of them with **kwargs) and its other keyword parameters (columns). A parameter without a default that is
    not offered is a SignatureError with `required`, a column the data must have with `columns_required`."""
    kinds = inspect.Parameter
    var_kw = any(p.kind is kinds.VAR_KEYWORD for p in params.values())
    named = [k for k in offered if k in params and params[k].kind is not kinds.POSITIONAL_ONLY]
    takes, needs = [], []
    for k, p in params.items():
        if p.kind in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD) or k in named:
            continue
        if p.kind is not kinds.POSITIONAL_ONLY:
            takes.append(k)
        if p.default is not p.empty:
            continue
        if columns_required and p.kind is not kinds.POSITIONAL_ONLY:
            needs.append(k)
        elif required:
            raise SignatureError(
                f"cannot call {what}: Relay does not pass its parameter {k!r}; it passes "
                f"{', '.join(offered)} (by keyword). Rename it or give it a default. {STYLES_HELP}"
            )
    return {
        "keywords": tuple(offered) if var_kw else tuple(named),
        "takes": tuple(takes),
        "needs": tuple(needs),
        "rest": frozenset(offered) if var_kw else None,
    }
