"""How a reward function is called: the three styles users bring, told apart by parameter names at load.

    style   the function                                        Relay calls it with (one sample)
    plain   fn(response, answer)                                response, answer positionally; `prompt`,
                                                                `data_source`, `extra_info` as keywords when
                                                                it names them (or takes **kwargs)
    verl    compute_score(data_source, solution_str,            keywords: data_source, solution_str (the
            ground_truth, extra_info=None)                      response), ground_truth (the answer),
                                                                extra_info (those it names, or all with **kwargs)
    trl     fn(prompts, completions, **kwargs) -> list          keywords, each a list of one: prompts,
                                                                completions, answer, ground_truth, data_source,
                                                                extra_info (those it names, or all with **kwargs)

A function that names `solution_str` is verl's; one that names `completions` is TRL's; any other is plain and
must accept `(response, answer)` positionally. A parameter without a default that Relay does not pass, or a
plain function that cannot take two positional arguments, is refused at load (`SignatureError`) naming these
styles. All three return a number or a dict with a `"score"` key (TRL: a list of one of those; a `None` in
it, TRL's "does not apply to this sample", scores 0). As in TRL, a chat prompt gives the completion as
`[{"role": "assistant", "content": response}]`; a plain-text prompt gives the text.

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
    "(response, answer) [optionally naming prompt, data_source, extra_info]; "
    "verl's compute_score(data_source, solution_str, ground_truth, extra_info=None); "
    "TRL's batched (prompts, completions, **kwargs) returning a list of floats"
)
ROW_KEYS = ("prompt", "data_source", "extra_info")
VERL_KEYS = ("data_source", "solution_str", "ground_truth", "extra_info")
TRL_KEYS = ("prompts", "completions", "answer", "ground_truth", "data_source", "extra_info")


class SignatureError(ValueError):
    """A reward function whose parameters fit none of the styles; the message names them."""


class InvalidReturn(ValueError):
    """A reward returned something of the wrong shape for its style (scored as error "invalid")."""


@dataclass(frozen=True, kw_only=True)
class RewardInput:
    """One sample to score: the response, the row's reference answer, and what else the row has.

    `prompt` is the row's prompt as written in the data (a string or chat messages); `uid` names the row in
    messages and is never passed to a reward function.
    """

    response: str
    answer: str
    prompt: str | list[dict[str, Any]] = ""
    data_source: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    uid: str = ""

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
    """A reward function with the style it is called in and the keywords it receives."""

    fn: Callable[..., Any]
    style: str = "plain"
    keywords: tuple[str, ...] = ()

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
            return cls(fn, "verl", _keywords(params, VERL_KEYS, f"{name}{sig} (verl style)"))
        if "completions" in params:
            return cls(fn, "trl", _keywords(params, TRL_KEYS, f"{name}{sig} (TRL style)"))
        try:
            bound = sig.bind("", "")
        except TypeError as e:
            raise SignatureError(
                f"cannot call {name}{sig} as (response, answer): {e}. {STYLES_HELP}"
            ) from None
        free = {k: p for k, p in params.items() if k not in bound.arguments}
        row_keys = [k for k in ROW_KEYS if k not in bound.arguments]
        return cls(fn, "plain", _keywords(free, row_keys, f"{name}{sig}", required=False))

    def __call__(self, inp: RewardInput) -> Any:
        """The function's raw return value for one sample (awaitable for an async function)."""
        if self.style == "verl":
            offered = {
                "data_source": inp.data_source,
                "solution_str": inp.response,
                "ground_truth": inp.answer,
                "extra_info": inp.extra_info,
            }
            return self.fn(**{k: offered[k] for k in self.keywords})
        if self.style == "trl":
            chat = isinstance(inp.prompt, list)
            completion: Any = [{"role": "assistant", "content": inp.response}] if chat else inp.response
            offered = {
                "prompts": [inp.prompt],
                "completions": [completion],
                "answer": [inp.answer],
                "ground_truth": [inp.answer],
                "data_source": [inp.data_source],
                "extra_info": [inp.extra_info],
            }
            return self.fn(**{k: offered[k] for k in self.keywords})
        row = {"prompt": inp.prompt, "data_source": inp.data_source, "extra_info": inp.extra_info}
        return self.fn(inp.response, inp.answer, **{k: row[k] for k in self.keywords})

    def one(self, value: Any) -> Any:
        """The sample's value of what the function returned: a TRL-style list's one entry (None: 0.0)."""
        if self.style != "trl":
            return value
        if hasattr(value, "tolist"):  # a numpy array or a torch tensor
            value = value.tolist()
        if isinstance(value, (str, bytes, dict)) or not isinstance(value, Sequence):
            raise InvalidReturn(
                f"a TRL-style reward returns a list with one score per completion; got {value!r:.200}"
            )
        items = list(value)
        if len(items) != 1:
            raise InvalidReturn(f"a TRL-style reward got 1 completion and returned {len(items)} scores")
        return 0.0 if items[0] is None else items[0]


def _keywords(params: Any, offered: Sequence[str], what: str, required: bool = True) -> tuple[str, ...]:
    """The keywords of `offered` that a function with `params` receives: those it names, all of them with
    **kwargs. With `required`, a parameter without a default that is not offered is a SignatureError."""
    kinds = inspect.Parameter
    var_kw = any(p.kind is kinds.VAR_KEYWORD for p in params.values())
    named = [k for k in offered if k in params and params[k].kind is not kinds.POSITIONAL_ONLY]
    for k, p in params.items():
        if p.kind in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD) or p.default is not p.empty:
            continue
        if required and (k not in offered or p.kind is kinds.POSITIONAL_ONLY):
            raise SignatureError(
                f"cannot call {what}: Relay does not pass its parameter {k!r}; it passes "
                f"{', '.join(offered)} (by keyword). Rename it or give it a default. {STYLES_HELP}"
            )
    return tuple(offered) if var_kw else tuple(named)
