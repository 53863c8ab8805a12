"""The OpenAI chat-completions protocol over Relay's token-in/token-out generation, and session records.

`ChatCore` is what the HTTP frontend (app/agent/openai_api.py) runs for `POST .../v1/chat/completions`, without
HTTP or Ray: it turns chat messages into prompt token ids, generates through a `GenerateFn` (the rollout
deployment's `generate`: load-balanced over the vLLM replicas, each token with its behaviour log-prob and
policy version), and answers in the OpenAI response shape. Relay's own fields ride along in `relay`
(readable through an OpenAI client's extra fields: `response.model_extra["relay"]`): the completion's
token ids, log-probs, versions and the replica.

Chat rendering: the tokenizer's chat template with the generation prompt when it has one; else a plain
fallback (the built-in tiny models have none): the messages' contents concatenated, each assistant
message followed by the EOS token, consecutive non-assistant messages joined with a newline (so a chat
prompt renders as app/rollout/prompt_files.py renders it, and a conversation as Relay's own multi-turn episodes are laid
out: prompt, model turn + EOS, observation, model turn...).

Sessions (opened by Relay's runner, app/agent/session.py): every call of a session is recorded
(`SessionCall`), and a call whose rendered conversation extends the previous call's prompt + reply (as text)
reuses that context's token ids and tokenizes only what was added, so a conversation that grows by appending
stays token-for-token consistent (re-tokenizing a model's reply can give other tokens than it sampled).
A session samples with the settings Relay opened it with (the run's policy: temperature, top_p); a request
asking for others is refused. `max_tokens` is capped at the session's (rollout.max_tokens) and by
rollout.max_model_len. Not supported (refused with a message): streaming, n > 1, tools/functions, stop
sequences, top_logprobs > 0.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from app.agent.session import SessionCall
from app.records import GenerateRequest, Sample
from app.rollout import admission

MAX_RESUBMITS = 100
MAX_SESSIONS = 100_000  # open sessions at most (each is taken when its episode ends; idle ones expire)
SEED_STRIDE = 7919  # a session's k-th call samples with seed + SEED_STRIDE * k (as Relay's episodes do)


class RequestError(Exception):
    """A bad request: answered with `status` and OpenAI's error shape, naming the problem and the fix."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}


@dataclass(frozen=True, kw_only=True)
class ChatSettings:
    """The frontend's limits and sampling defaults: a plain record, since it crosses into the frontend's
    Serve replica; built from the run's config by `of` alone (no defaults of its own)."""

    model_name: str  # what responses and /v1/models call the model: `model.path`
    max_model_len: int
    max_tokens: int
    temperature: float
    top_p: float
    request_timeout_s: float
    session_ttl_s: float  # a session neither used nor taken for this long is dropped

    @classmethod
    def of(cls, cfg: Any) -> ChatSettings:
        """The run's: `rollout.*`, named by `model.path`; a session outlives its agent (`env.agent_timeout_s`)."""
        r = cfg.rollout
        return cls(
            model_name=cfg.model.path,
            max_model_len=r.max_model_len,
            max_tokens=r.max_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            request_timeout_s=r.request_timeout_s,
            session_ttl_s=max(600.0, 2 * cfg.env.agent_timeout_s),
        )


@dataclass
class ChatSession:
    """One session's sampling settings, its recorded calls, and the context of its last call (as text and
    as token ids) that the next call may extend."""

    settings: dict[str, Any]
    calls: list[SessionCall] = field(default_factory=list)
    text: str = ""
    ids: list[int] = field(default_factory=list)
    shown: str = ""  # `text` as the client saw it: the reply without its special tokens (but its EOS)
    touched: float = field(default_factory=time.monotonic)
    started: int = 0  # calls started (refused beyond settings["max_calls"])


def message_text(m: Any, i: int) -> tuple[str, str]:
    """(role, content) of message `i`; content parts of type text are joined. Raises RequestError."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RequestError(f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
    content = m.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise RequestError(f"messages[{i}]: only text content parts are supported", f"messages[{i}]")
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise RequestError(f"messages[{i}].content must be a string or text parts", f"messages[{i}]")
    if m.get("tool_calls"):
        raise RequestError("tool calls are not supported: write tool calls as text", f"messages[{i}]")
    return m["role"], content


def render_chat(tok: Any, messages: list[dict[str, str]]) -> str:
    """The prompt text of `messages` (see the module docstring: chat template, else the fallback)."""
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out: list[str] = []
    prev = "assistant"
    for m in messages:
        if m["role"] == "assistant":
            out.append(m["content"] + tok.eos_token)
        else:
            out.append(("" if prev == "assistant" else "\n") + m["content"])
        prev = m["role"]
    return "".join(out)


UNSUPPORTED = {
    "stream": "streaming is not supported: call without stream",
    "tools": "tools/functions are not supported: describe tools in the prompt and parse calls from the text",
    "functions": "tools/functions are not supported: describe tools in the prompt and parse calls from the text",
    "stop": "stop sequences are not supported (the recorded trajectory must be what the model sampled)",
}


def _check_request(body: dict[str, Any]) -> None:
    for key, why in UNSUPPORTED.items():
        if body.get(key) not in (None, False, [], ""):
            raise RequestError(why, key)
    if body.get("n", 1) != 1:
        raise RequestError("n must be 1 (one completion per call)", "n")
    if body.get("top_logprobs") not in (None, 0):
        raise RequestError(
            "top_logprobs must be 0: only the sampled token's log-prob is reported", "top_logprobs"
        )
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise RequestError("messages must be a non-empty list", "messages")


def _sampling(body: dict[str, Any], s: dict[str, Any]) -> tuple[float, float]:
    """The request's temperature and top_p: those of the session (a request may repeat them only)."""
    out = []
    for key in ("temperature", "top_p"):
        v = body.get(key)
        if v is not None and abs(float(v) - float(s[key])) > 1e-9:
            raise RequestError(
                f"{key}={v}: this session samples the policy being trained with {key}={s[key]} (the run's "
                f"rollout settings); omit {key} or send that value",
                key,
            )
        out.append(float(s[key]))
    return out[0], out[1]


class ChatCore:
    """Chat completions and session records over `generate` (a `GenerateFn`); `tok` is the model's HF
    tokenizer. Session calls are recorded until `take_session`."""

    def __init__(self, tok: Any, generate: Callable[..., Any], settings: ChatSettings) -> None:
        self.tok, self.generate, self.s = tok, generate, settings
        self.sessions: dict[str, ChatSession] = {}

    def open_session(self, sid: str, settings: dict[str, Any]) -> None:
        """Start recording session `sid` (sampling `settings`: temperature, top_p, max_tokens, seed,
        max_calls); drops sessions idle for longer than `session_ttl_s`."""
        now = time.monotonic()
        for k in [k for k, v in self.sessions.items() if now - v.touched > self.s.session_ttl_s]:
            del self.sessions[k]
        if len(self.sessions) >= MAX_SESSIONS:
            raise RuntimeError(f"{len(self.sessions)} sessions open: are sessions taken when they end?")
        self.sessions[sid] = ChatSession(settings=dict(settings))

    def take_session(self, sid: str) -> list[SessionCall]:
        """The calls session `sid` made, in the order they finished; the session ends."""
        session = self.sessions.pop(sid, None)
        return session.calls if session is not None else []

    def _prompt_ids(self, session: ChatSession | None, text: str) -> list[int]:
        """The prompt ids of `text`: the session's context ids + the added text's, when `text` extends the
        context as generated or as the client was shown it (a reply's special tokens other than EOS, an
        UNK say, are not in its content: the model's context keeps them); else `text` tokenized."""
        if session is not None and session.text:
            for seen in (session.text, session.shown):
                if text.startswith(seen):
                    return session.ids + self._encode(text[len(seen) :])
        return self._encode(text)

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tok.encode(text, add_special_tokens=False)] if text else []

    async def complete(self, sid: str | None, body: dict[str, Any]) -> dict[str, Any]:
        """One chat completion (the OpenAI response as a dict); raises RequestError for a bad request."""
        _check_request(body)
        session = None
        if sid is not None:
            session = self.sessions.get(sid)
            if session is None:
                raise RequestError(
                    f"no open session {sid!r} (sessions are opened by Relay's runner)", status=404
                )
            session.touched = time.monotonic()
        st = session.settings if session else {"temperature": self.s.temperature, "top_p": self.s.top_p}
        if session is None:  # no session: the request's own sampling settings
            st = {k: body.get(k, v) for k, v in st.items()}
        temperature, top_p = _sampling(body, st)
        messages = [
            dict(zip(("role", "content"), message_text(m, i), strict=True))
            for i, m in enumerate(body["messages"])
        ]
        text = render_chat(self.tok, messages)
        prompt_ids = self._prompt_ids(session, text)
        req = self._request(body, session, prompt_ids, temperature, top_p)
        t0 = time.perf_counter()
        s = await self._generate(req)
        seconds = time.perf_counter() - t0
        if session is not None:
            session.calls.append(
                SessionCall(
                    prompt_ids=prompt_ids,
                    completion_ids=list(s.token_ids),
                    logprobs=list(s.logprobs),
                    versions=list(s.versions),
                    finish_reason=s.finish_reason,
                    replica=s.replica,
                    seconds=seconds,
                )
            )
            session.text = text + self.tok.decode(s.token_ids, skip_special_tokens=False)
            eos = self.tok.eos_token if s.token_ids and s.token_ids[-1] == self.tok.eos_token_id else ""
            session.shown = text + self.tok.decode(s.token_ids, skip_special_tokens=True) + eos
            session.ids = [*prompt_ids, *s.token_ids]
            session.touched = time.monotonic()
        return self._response(sid, len(session.calls) if session else 0, body, prompt_ids, s)

    def _request(
        self,
        body: dict[str, Any],
        session: ChatSession | None,
        prompt_ids: list[int],
        temp: float,
        top_p: float,
    ) -> GenerateRequest:
        cap = int(session.settings["max_tokens"]) if session else self.s.max_tokens
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        room = self.s.max_model_len - len(prompt_ids)
        if room <= 0:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens: no room left within rollout.max_model_len="
                f"{self.s.max_model_len}; shorten the conversation (or raise rollout.max_model_len)",
                "messages",
            )
        seed = body.get("seed")
        if session is not None:
            if session.started >= session.settings.get("max_calls", 1 << 30):
                raise RequestError(
                    f"this session made env.max_turns={session.settings['max_calls']} calls, its limit; "
                    "end the episode (or raise env.max_turns)"
                )
            session.started += 1
            if seed is None and session.settings.get("seed") is not None:
                seed = int(session.settings["seed"]) + SEED_STRIDE * session.started
        return GenerateRequest(
            prompt_ids=prompt_ids,
            max_tokens=max(1, min(int(asked or cap), cap, room)),
            temperature=temp,
            top_p=top_p,
            seed=None if seed is None else int(seed),
        )

    async def _generate(self, req: GenerateRequest) -> Sample:
        """One completion; one aborted by a push (rollout.partial=resubmit, or a freeze) goes back as prompt
        + partial completion until it finishes, every token keeping its version and log-prob."""
        timeout = self.s.request_timeout_s
        resp = await asyncio.wait_for(self.generate(req), timeout)
        s = resp.samples[0]
        s.replica = s.replica or resp.replica
        for _ in range(MAX_RESUBMITS):
            if s.finish_reason != "abort" or len(s.token_ids) >= req.max_tokens:
                break
            cont = replace(
                req,
                prompt_ids=req.prompt_ids + s.token_ids,
                max_tokens=req.max_tokens - len(s.token_ids),
                seed=None,
            )
            s = admission.merge_partial(s, (await asyncio.wait_for(self.generate(cont), timeout)).samples[0])
        return s

    def _response(
        self, sid: str | None, call: int, body: dict[str, Any], prompt_ids: list[int], s: Sample
    ) -> dict[str, Any]:
        content = self.tok.decode(s.token_ids, skip_special_tokens=True)
        logprobs = None
        if body.get("logprobs"):
            pieces = [self.tok.decode([t], skip_special_tokens=False) for t in s.token_ids]
            logprobs = {
                "content": [
                    {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                    for p, lp in zip(pieces, s.logprobs, strict=True)
                ]
            }
        finish = s.finish_reason if s.finish_reason in ("stop", "length") else "length"
        return {
            "id": f"chatcmpl-{sid or 'nosession'}-{call}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.s.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": finish,
                    "logprobs": logprobs,
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(s.token_ids),
                "total_tokens": len(prompt_ids) + len(s.token_ids),
            },
            "relay": {
                "session": sid,
                "call": call,
                "token_ids": list(s.token_ids),
                "logprobs": list(s.logprobs),
                "versions": list(s.versions),
                "replica": s.replica,
                "finish_reason": s.finish_reason,
            },
        }
