"""The scoring process's side (app/rewards/pool.py starts it): length-prefixed JSON requests on its stdin,
replies on its stdout, what the reward prints on its stderr. It dies with the thread that started it
(parent-death signal), keeps under its memory limit (RLIMIT_DATA), resolves reward functions per data source
and evaluates one request at a time (one sample; a group for a TRL-style function; or several samples one
after the other, replying to each as it is scored). A sample's reply says how long its reward took."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import select
import signal
import struct
import sys
import time
from dataclasses import asdict
from typing import Any

from app.rewards import evaluate, evaluate_group, resolve_reward_fn, warm_up
from app.rewards.styles import RewardCall, RewardInput

HEADER = struct.Struct("!I")
_PR_SET_PDEATHSIG = 1


def read_exact(fd: int, n: int, deadline: float) -> bytes | None:
    """`n` bytes from `fd`, or None at `deadline`; EOFError when the writer is gone."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    chunks: list[bytes] = []
    while n > 0:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(None if math.isinf(left) else left * 1000):
            return None
        chunk = os.read(fd, n)
        if not chunk:
            raise EOFError("the scoring process exited")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _read_msg(fd: int) -> dict[str, Any] | None:
    head = read_exact(fd, HEADER.size, math.inf)
    return None if head is None else json.loads(read_exact(fd, HEADER.unpack(head)[0], math.inf) or b"")


def _die_with_parent(ppid: int) -> None:
    """SIGKILL this process when the thread that started it exits (the pool's threads live as long as the
    pool): a scorer must not outlive its rollouter or worker, least of all one stuck in a computation."""
    import ctypes

    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != ppid:  # the parent died before the prctl
        os._exit(0)


def _limit_memory(max_mb: int | None) -> None:
    """This process's RLIMIT_DATA (soft and hard: the reward cannot raise it): `max_mb` MiB, None: none.

    RLIMIT_DATA, not RLIMIT_AS: it counts the heap and private writable mappings (what a reward allocates),
    not the address space of the shared libraries a reward's imports map (torch's are gigabytes). An
    allocation past it fails with MemoryError. Programs the code sandbox starts from here inherit it,
    under their own, smaller RLIMIT_AS (app.rewards.sandbox)."""
    if max_mb is None:
        return
    limit = int(max_mb) * 2**20
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _flush_output() -> None:
    """Push what the reward printed into the output pipe before the reply: the parent reads it with it."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def child_main() -> None:
    """The scoring process: resolve reward functions per data source, evaluate one request at a time."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    proto_in, proto_out = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)  # what a reward prints goes to the output pipe (capped by the parent), never the protocol
    fns: dict[str, RewardCall] = {}
    try:
        init = _read_msg(proto_in)
    except EOFError:
        return
    assert init is not None
    _die_with_parent(init["ppid"])
    _limit_memory(init.get("max_memory_mb"))
    sys.path[:] = init["path"]  # dotted-path rewards import as in the parent
    while True:
        try:
            msg = _read_msg(proto_in)
        except EOFError:
            return
        assert msg is not None
        ds = msg["data_source"]
        if msg["op"] == "resolve":
            try:
                fns[ds] = RewardCall.of(resolve_reward_fn(init["spec"], ds), init["spec"])
                warm_up(fns[ds].fn)
                reply: dict[str, Any] = {"error": None}
            except Exception as e:
                reply = {"error": f"{type(e).__name__}: {e}"}
        elif msg["op"] == "score_group":  # a TRL-style function on a whole group: one result per sample
            inps = [RewardInput(**d) for d in msg["inputs"]]
            reply = {"results": [asdict(r) for r in evaluate_group(fns[ds], inps, init["on_error"])]}
        elif msg["op"] == "score_each":  # samples one after the other, a reply each as it is scored
            for d in msg["inputs"]:
                _reply(proto_out, _timed(fns[ds], RewardInput(**d), init["on_error"]))
            continue
        else:
            reply = _timed(fns[ds], RewardInput(**msg["input"]), init["on_error"])
        _reply(proto_out, reply)


def _timed(fn: RewardCall, inp: RewardInput, on_error: float) -> dict[str, Any]:
    """`inp`'s result as a reply, with the seconds the reward took (`elapsed_s`)."""
    t0 = time.monotonic()
    res = asdict(evaluate(fn, inp, on_error))
    return {**res, "elapsed_s": time.monotonic() - t0}


def _reply(fd: int, reply: dict[str, Any]) -> None:
    _flush_output()
    data = json.dumps(reply).encode()
    os.write(fd, HEADER.pack(len(data)) + data)
