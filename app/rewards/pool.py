"""The reward stage: trajectories are scored as they finish, on CPU workers, beside generation.

The rollouter sends each sample of a group as its own request; the moment one finishes, its reward starts
here while the rest of the group (and of the batch) is still generating, so a slow reward (compiling and
running tests in the sandbox, a math-equivalence check) overlaps generation instead of following it.

With `rollout.group_requests` a group's samples come back together: a fast reward (under FAST_REWARD_S a
sample, timed on the run's samples) then scores them in one request to one scoring process, a reply each,
each within its own deadline (`score_each`); a slower one scores them at once, a request each.

- `reward.workers = 0`: rewards are scored from the rollouter's event loop (waited on in a thread pool).
- `reward.workers = N`: N Ray actors (`reward.worker_cpus` logical CPUs each), each running up to
  `reward.max_concurrency` rewards at once; the pool sends each reward to the least busy worker.

Either way a reward function runs in a `RewardProcesses` pool: long-lived scoring subprocesses (fresh
interpreters, started by fork+exec: never a bare fork of a process that holds threads and locks), one
reward at a time each, fed through pipes. A reward that misses `reward.timeout_s` has its process killed
(SIGKILL, by pid) and replaced, so the deadline holds for any input (a sympy power tower holds the GIL:
no thread could be stopped, not even the one waiting on the deadline) and an abandoned reward stops
using CPU. Sandboxed programs a killed process started die with it (parent-death signals).

Each scoring process has a memory limit (`reward.max_memory_mb`, as RLIMIT_DATA: heap and private
mappings, not the shared libraries it maps), so a reward cannot take the memory of vLLM and the trainer:
an allocation past it raises MemoryError there, the reward scores `on_error` (error "oom") and the process
is replaced. What a reward prints (stdout and stderr, also of C code) reaches the parent through a pipe:
the first OUTPUT_CAP_BYTES of each reward are logged, the rest is dropped and counted
(`RewardResult.output_dropped`), so a reward that prints megabytes does not grow the run's log by as much.

An exception, a timeout, an invalid value, a MemoryError or a dead process or worker scores
`reward.on_error` and is counted by kind (`reward/errors_exception`, `_timeout`, `_invalid`, `_oom`,
`_crash`). A dead worker is restarted by Ray (with a margin beyond `reward.timeout_s` for a worker that is
itself stuck). The one thing that raises into the rollout is `RewardsFailed` (app/rewards/guard.py): every
one of the run's first `reward.fail_fast_samples` samples failed.

Several functions (`reward.fns`, app/rewards/combine.py) each have their own scoring processes
(`RewardScorer`); a sample is scored by each in turn, each within `reward.timeout_s`, and combined.

A TRL-style function (app/rewards/styles.py) is batched: it sees a whole group of one prompt's samples in
one call (`score_group`, when the group's last sample finished: `batched` tells the generator so), as in
TRL, where a reward may rank a group's completions or judge them side by side. A run with one beside other
functions scores those groups whole too, the others sample by sample within the group call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from typing import Any

from app.infra.import_path import python_c
from app.rewards import RewardResult, resolve_reward_fn
from app.rewards.combine import RewardSpec, combine, reward_specs, spec_name
from app.rewards.guard import FailFast
from app.rewards.scoring_process import HEADER, read_exact
from app.rewards.styles import RewardCall, RewardInput

log = logging.getLogger(__name__)

WORKER_MARGIN_S = 30.0  # beyond reward.timeout_s before a worker itself counts as stuck
STARTUP_TIMEOUT_S = 120.0
"""Deadline to start a scoring process and import a reward's module (sympy, a user's torch import) on a
loaded machine; not counted against `reward.timeout_s`."""
_CHILD = "from app.rewards.scoring_process import child_main; child_main()"
OUTPUT_CAP_BYTES = 4096
"""What is kept (and logged) of one reward's output, stdout and stderr together; the rest is dropped."""
_DRAIN_READS = 16  # reads of the output pipe per drain: a reward printing without end cannot stall us
FAST_REWARD_S = 0.01
"""A reward whose samples take less than this (the mean of its last ones, timed in the scoring process) scores
the samples of a group that finish together in one request to one process, a reply each: the pipe round
trip a sample, not the reward, is then what costs. A slower one scores them in parallel, a request each."""
_MEAN_WEIGHT = 0.2  # of the newest sample in the running mean of a reward's time


class _Process:
    """One scoring subprocess: length-prefixed JSON requests on its stdin, replies on its stdout; what it
    prints (its stdout and stderr) on a third pipe, read as it comes and capped per request."""

    def __init__(self, spec: str, on_error: float, max_memory_mb: int | None = None) -> None:
        self.proc = subprocess.Popen(
            python_c(_CHILD),  # Relay's root ahead of the working directory (a user's own `app`)
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,
            close_fds=True,
            start_new_session=True,  # a Ctrl-C to our group is ours to handle, not the scorers'
        )
        assert self.proc.stderr is not None
        self.out_fd = self.proc.stderr.fileno()
        os.set_blocking(self.out_fd, False)
        self.out_open = True
        self.output = bytearray()  # what the current request printed, up to OUTPUT_CAP_BYTES
        self.dropped = 0  # bytes of it beyond the cap
        self.ready: set[str] = set()  # data sources whose reward function this process has resolved
        init = {"op": "init", "spec": spec, "on_error": on_error, "path": sys.path, "ppid": os.getpid()}
        self.send({**init, "max_memory_mb": max_memory_mb})

    def send(self, msg: dict[str, Any]) -> None:
        data = json.dumps(msg, default=str).encode()  # a row's extra_info may hold dates, bytes...
        assert self.proc.stdin is not None
        self.proc.stdin.write(HEADER.pack(len(data)) + data)

    def recv(self, deadline: float) -> dict[str, Any] | None:
        """The next reply, or None when `deadline` (monotonic) passes first; EOFError if the process died.
        What the process prints meanwhile is drained, so that a full output pipe never blocks it."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        if not self._wait_reply(fd, deadline):
            return None
        head = read_exact(fd, HEADER.size, deadline)
        if head is None:
            return None
        body = read_exact(fd, HEADER.unpack(head)[0], deadline)
        return None if body is None else json.loads(body)

    def _wait_reply(self, fd: int, deadline: float) -> bool:
        """Until `fd` is readable (True) or `deadline` passes (False), draining the output pipe."""
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if self.out_open:
            poller.register(self.out_fd, select.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            events = poller.poll(None if math.isinf(left) else left * 1000)
            if any(efd == fd for efd, _ in events):
                return True
            if events and not self.drain():
                poller.unregister(self.out_fd)  # the process closed it (or died): only the reply is left

    def drain(self) -> bool:
        """Read what the process printed so far, without blocking: the first OUTPUT_CAP_BYTES are kept,
        the rest counted in `dropped`. False once the pipe is closed."""
        for _ in range(_DRAIN_READS):
            if not self.out_open:
                return False
            try:
                chunk = os.read(self.out_fd, 65536)
            except BlockingIOError:
                return True
            except OSError:
                chunk = b""
            if not chunk:
                self.out_open = False
                return False
            keep = min(len(chunk), max(0, OUTPUT_CAP_BYTES - len(self.output)))
            self.output += chunk[:keep]
            self.dropped += len(chunk) - keep
        return self.out_open

    def take_output(self) -> tuple[bytes, int]:
        """(what the last request printed, up to the cap; bytes dropped beyond it), and start afresh."""
        self.drain()
        out, dropped = bytes(self.output), self.dropped
        self.output, self.dropped = bytearray(), 0
        return out, dropped

    def kill(self) -> None:
        """SIGKILL by pid (the process is our unreaped child: the pid cannot have been reused), reap."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


class RewardProcesses:
    """Scores rewards in killable subprocesses, one reward per process at a time; thread-safe.

    `score()` blocks its thread (call it from a thread pool, never on an event loop). Processes are kept
    for reuse (at most `max_idle`), killed at a deadline, after a MemoryError or on any protocol failure.
    One warm spare is kept beside those in use: when a reward takes the last idle process, another is
    started and readied (for every data source seen so far) in the background, so the reward after a
    killed one takes the spare and starts within its own deadline instead of waiting for a replacement;
    a killed process is replaced in the background too. All processes are started by one long-lived
    thread: their parent-death signal fires when the *thread* that started them exits. `max_memory_mb`
    (None: no limit) is each process's RLIMIT_DATA.
    """

    def __init__(
        self,
        spec: str,
        timeout_s: float,
        on_error: float,
        max_idle: int = 8,
        max_memory_mb: int | None = None,
    ) -> None:
        self.spec, self.timeout_s, self.on_error, self.max_idle = spec, timeout_s, on_error, max_idle
        self.max_memory_mb = max_memory_mb
        self.idle: list[_Process] = []
        self.lock = threading.Lock()
        self.spawner = ThreadPoolExecutor(1, thread_name_prefix="reward-spawner")
        self.killed: deque[int] = deque(maxlen=64)  # pids last killed at a deadline (tests, reports)
        self.output_dropped = 0  # bytes of reward output dropped beyond OUTPUT_CAP_BYTES, in total
        self.output_capped = 0  # rewards whose output was cut
        self.sources: set[str] = set()  # data sources some process has resolved: a spare resolves them all
        self.spares_pending = 0  # spares and replacements submitted to the spawner, not yet idle
        self.mean_s: float | None = None  # the reward's running mean time a sample (None: none timed yet)

    @property
    def fast(self) -> bool:
        """Whether samples that finish together are scored in one request (`FAST_REWARD_S`)."""
        return self.mean_s is not None and self.mean_s < FAST_REWARD_S

    def _timed(self, reply: dict[str, Any]) -> RewardResult:
        """A sample's reply as its result; the reward's time (`elapsed_s`) goes into `mean_s`."""
        took = float(reply.pop("elapsed_s", 0.0))
        mean = self.mean_s
        self.mean_s = took if mean is None else (1 - _MEAN_WEIGHT) * mean + _MEAN_WEIGHT * took
        return RewardResult(**reply)

    def _pop_idle(self) -> _Process | None:
        with self.lock:
            proc = self.idle.pop() if self.idle else None
        if proc is not None and proc.proc.poll() is not None:  # died while idle: not this sample's fault
            proc.kill()
            return None
        return proc

    def _take(self) -> _Process:
        """An idle process, else (on the spawner, after any replacement under way) a new one; the last idle
        one taken, a spare is started behind it."""
        proc = self._pop_idle() or self.spawner.submit(self._pop_or_start).result()
        with self.lock:
            start_spare = not self.idle and self.spares_pending == 0
            if start_spare:
                self.spares_pending += 1
        if start_spare:
            self.spawner.submit(self._replace, set(self.sources))
        return proc

    def _pop_or_start(self) -> _Process:
        return self._pop_idle() or self._start()

    def _start(self) -> _Process:
        return _Process(self.spec, self.on_error, self.max_memory_mb)

    def _give_back(self, proc: _Process) -> None:
        with self.lock:
            if len(self.idle) < self.max_idle:
                self.idle.append(proc)
                return
        proc.kill()

    def _replace(self, sources: set[str]) -> None:
        """A warm process, ready for `sources`: a spare, or one for a killed process (on the spawner thread)."""
        try:
            proc = self._start()
            for ds in sorted(sources):
                failed = self._resolve(proc, ds)
                self._log_output(proc)
                if failed is not None:
                    proc.kill()
                    return
        except (OSError, EOFError, ValueError) as e:
            log.warning("could not start a spare reward process: %s", e)
            return
        finally:
            with self.lock:
                self.spares_pending = max(0, self.spares_pending - 1)
        self._give_back(proc)

    def score(self, inp: RewardInput) -> RewardResult:
        """The function's score of `inp` in a scoring process, within `timeout_s`; never raises. What it
        printed is logged up to OUTPUT_CAP_BYTES; the bytes beyond are counted in `output_dropped`."""
        return self._score([inp], False)[0]

    def score_group(self, inps: list[RewardInput]) -> list[RewardResult]:
        """A TRL-style function's scores of `inps` (samples of one row) in one call, in one scoring process
        within one `timeout_s`: a result per sample (the output dropped counted on the first); never raises."""
        return self._score(inps, True)

    def score_each(self, inps: list[RewardInput]) -> list[RewardResult]:
        """`inps` (of one data source) scored one after the other in one request to one process, each within
        its own `timeout_s` from the reply before it, a result each as `score` gives; never raises. After a
        sample that timed out, crashed or ran out of memory, the process is replaced and the samples after it
        go to another one (those before keep their results)."""
        results: list[RewardResult] = []
        while len(results) < len(inps):
            results += self._score_run(inps[len(results) :])
        return results

    def _score_run(self, inps: list[RewardInput]) -> list[RewardResult]:
        """`score_each`'s request: the results of `inps` up to and including the first one that ended its
        process (its error's result), or all of them."""
        proc, results = None, []
        try:
            proc = self._take()
            failed = self._resolve(proc, inps[0].data_source)
            if failed:
                results = [replace(failed) for _ in inps]
            else:
                proc.send(
                    {
                        "op": "score_each",
                        "data_source": inps[0].data_source,
                        "inputs": [asdict(i) for i in inps],
                    }
                )
                for inp in inps:
                    res = self._reply(proc, inp.data_source)
                    res.output_dropped = self._log_output(proc)
                    results.append(res)
                    if res.error in ("timeout", "oom"):
                        break
        except (OSError, EOFError, ValueError, TypeError) as e:
            return [*results, self._crashed(proc, e)]
        self._retire_or_keep(proc, results)
        return results

    def _score(self, inps: list[RewardInput], group: bool) -> list[RewardResult]:
        proc = None
        try:
            proc = self._take()
            failed = self._resolve(proc, inps[0].data_source)
            results = [replace(failed) for _ in inps] if failed else self._evaluate(proc, inps, group)
        except (OSError, EOFError, ValueError, TypeError) as e:  # could not start, died, garbled reply
            crash = self._crashed(proc, e)
            return [crash, *[replace(crash, output_dropped=0) for _ in inps[1:]]]
        results[0].output_dropped = self._log_output(proc)
        self._retire_or_keep(proc, results)
        return results

    def _crashed(self, proc: _Process | None, e: BaseException) -> RewardResult:
        """The result of a process that could not start, died or garbled its reply (killed, its output
        logged: the bytes dropped counted on the result)."""
        dropped = 0
        if proc is not None:
            dropped = self._log_output(proc)
            proc.kill()
        log.warning("reward process crashed (%s: %s); scoring %s", type(e).__name__, e, self.on_error)
        detail = f"reward process died: {type(e).__name__}: {e}"
        return RewardResult(self.on_error, "crash", detail, output_dropped=dropped)

    def _retire_or_keep(self, proc: _Process, results: list[RewardResult]) -> None:
        """Kill `proc` (and replace it, in the background) after a timeout or an oom, else keep it."""
        errors = {res.error for res in results}
        if errors & {"timeout", "oom"}:  # stuck, or holding memory it may never give back
            if "timeout" in errors:
                self.killed.append(proc.proc.pid)
            proc.kill()
            with self.lock:
                self.spares_pending += 1
            self.spawner.submit(self._replace, set(proc.ready) | self.sources)
        else:
            self._give_back(proc)

    def _log_output(self, proc: _Process) -> int:
        """Log what `proc` printed for its last request (up to the cap); the count of bytes dropped."""
        out, dropped = proc.take_output()
        if out:
            text = out.decode("utf-8", errors="replace").rstrip()
            log.info("reward %s printed (scoring process %d):\n%s", self.spec, proc.proc.pid, text)
        if dropped:
            with self.lock:
                self.output_dropped += dropped
                self.output_capped += 1
            log.warning(
                "reward %s printed %d bytes more than the %d kept; dropped (%d bytes in %d rewards so far)",
                self.spec,
                dropped,
                OUTPUT_CAP_BYTES,
                self.output_dropped,
                self.output_capped,
            )
        return dropped

    def _resolve(self, proc: _Process, data_source: str) -> RewardResult | None:
        """Make `proc` ready to score `data_source`; a RewardResult when that failed."""
        if data_source in proc.ready:
            return None
        proc.send({"op": "resolve", "data_source": data_source})
        reply = proc.recv(time.monotonic() + STARTUP_TIMEOUT_S)
        if reply is None:
            return RewardResult(
                self.on_error, "timeout", f"resolving {self.spec!r} took over {STARTUP_TIMEOUT_S}s"
            )
        if reply.get("error"):
            return RewardResult(self.on_error, "exception", str(reply["error"]))
        proc.ready.add(data_source)
        self.sources.add(data_source)
        return None

    def _evaluate(self, proc: _Process, inps: list[RewardInput], group: bool) -> list[RewardResult]:
        data_source = inps[0].data_source
        if group:
            proc.send({"op": "score_group", "data_source": data_source, "inputs": [asdict(i) for i in inps]})
        else:
            proc.send({"op": "score", "data_source": data_source, "input": asdict(inps[0])})
            return [self._reply(proc, data_source)]
        reply = proc.recv(time.monotonic() + self._wait_s())
        if reply is None:
            return [self._timed_out(proc, data_source) for _ in inps]
        return [RewardResult(**d) for d in reply["results"]]

    def _wait_s(self) -> float:
        return self.timeout_s if 0 < self.timeout_s < math.inf else math.inf

    def _reply(self, proc: _Process, data_source: str) -> RewardResult:
        """The next sample's result from `proc`, within `timeout_s` (a timeout's result past it)."""
        reply = proc.recv(time.monotonic() + self._wait_s())
        return self._timed_out(proc, data_source) if reply is None else self._timed(reply)

    def _timed_out(self, proc: _Process, data_source: str) -> RewardResult:
        log.warning(
            "reward %s timed out after %ss; killed its process %d; scoring %s",
            self.spec,
            self.timeout_s,
            proc.proc.pid,
            self.on_error,
        )
        detail = f"reward {self.spec!r} ({data_source}) did not return within {self.timeout_s}s"
        return RewardResult(self.on_error, "timeout", detail)

    def close(self) -> None:
        self.spawner.shutdown(wait=True, cancel_futures=True)  # a spare not yet started never starts
        with self.lock:
            procs, self.idle = self.idle, []
        for p in procs:
            p.kill()


class RewardScorer:
    """A run's reward functions, each in its own `RewardProcesses`: `score(inp)` runs each in turn (each
    within `timeout_s`) and combines them (app/rewards/combine.py); blocks its thread, never raises."""

    def __init__(
        self,
        specs: str | Sequence[RewardSpec],
        timeout_s: float,
        on_error: float,
        max_idle: int = 8,
        max_memory_mb: int | None = None,
        named: bool = False,
    ) -> None:
        if isinstance(specs, str):
            specs = [RewardSpec(spec=specs, name=spec_name(specs))]
        self.named = named
        self.parts = [
            (spec, RewardProcesses(spec.spec, timeout_s, on_error, max_idle, max_memory_mb)) for spec in specs
        ]
        self.styles: dict[str, list[str]] = {}  # each function's style, by the data sources resolved

    def resolve(self, data_source: str) -> None:
        """Resolve every function for `data_source` here, so a bad spec raises in the caller, not in a
        scoring process."""
        if data_source not in self.styles:
            self.styles[data_source] = [
                RewardCall.of(resolve_reward_fn(spec.spec, data_source), spec.spec).style
                for spec, _ in self.parts
            ]

    def batched(self, data_source: str) -> bool:
        """Whether a function scores `data_source`'s groups whole (TRL style): then call `score_group`."""
        self.resolve(data_source)
        return "trl" in self.styles[data_source]

    def score(self, inp: RewardInput) -> RewardResult:
        return combine([(spec, procs.score(inp)) for spec, procs in self.parts], self.named)

    def fast(self) -> bool:
        """Whether every function is fast (`FAST_REWARD_S`): then `score_each` a group's finished samples."""
        return all(procs.fast for _, procs in self.parts)

    def score_each(self, inps: list[RewardInput]) -> list[RewardResult]:
        """Each of `inps` (of one data source) scored by every function, one request a function
        (`RewardProcesses.score_each`), and combined; blocks, never raises."""
        parts = [procs.score_each(inps) for _, procs in self.parts]
        specs = [spec for spec, _ in self.parts]
        return [
            combine(list(zip(specs, [p[i] for p in parts], strict=True)), self.named)
            for i in range(len(inps))
        ]

    def score_group(self, inps: list[RewardInput]) -> list[RewardResult]:
        """Each of `inps` (samples of one row) scored by every function and combined: a TRL-style one in one
        call on the group, any other sample by sample (all at once, in threads); blocks, never raises."""
        styles = self.styles[inps[0].data_source]  # resolve() first
        parts = []
        for (_, procs), style in zip(self.parts, styles, strict=True):
            if style == "trl":
                parts.append(procs.score_group(inps))
            else:
                with ThreadPoolExecutor(len(inps), thread_name_prefix="reward-sample") as pool:
                    parts.append(list(pool.map(procs.score, inps)))
        specs = [spec for spec, _ in self.parts]
        return [
            combine(list(zip(specs, [p[i] for p in parts], strict=True)), self.named)
            for i in range(len(inps))
        ]

    @property
    def processes(self) -> list[RewardProcesses]:
        return [procs for _, procs in self.parts]

    def close(self) -> None:
        for procs in self.processes:
            procs.close()


class RewardWorker:
    """One CPU reward worker (a Ray actor): its own scoring processes for each reward function."""

    def __init__(
        self,
        specs: str | Sequence[RewardSpec],
        timeout_s: float,
        on_error: float,
        concurrency: int = 8,
        max_memory_mb: int | None = None,
        named: bool = False,
    ) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.procs = RewardScorer(specs, timeout_s, on_error, max(1, concurrency), max_memory_mb, named)
        self.executor = ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="reward")

    def pid(self) -> int:
        return os.getpid()

    def scorer_pids(self) -> list[int]:
        """Pids of the idle scoring processes and of those killed at a deadline (for tests)."""
        procs = self.procs.processes
        return [p.proc.pid for ps in procs for p in ps.idle] + [-pid for ps in procs for pid in ps.killed]

    async def score(self, inp: RewardInput) -> dict[str, Any]:
        self.procs.resolve(inp.data_source)  # a bad spec raises here, as it always did, not in a subprocess
        loop = asyncio.get_running_loop()
        res = await loop.run_in_executor(self.executor, self.procs.score, inp)
        return asdict(res)

    async def batched(self, data_source: str) -> bool:
        return self.procs.batched(data_source)

    async def score_group(self, inps: list[RewardInput]) -> list[dict[str, Any]]:
        self.procs.resolve(inps[0].data_source)
        loop = asyncio.get_running_loop()
        return [asdict(r) for r in await loop.run_in_executor(self.executor, self.procs.score_group, inps)]

    async def run(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` in one of this worker's threads: an environment's blocking step (app/envs), such as
        code_feedback's sandboxed tests, run here beside the rewards instead of in the rollouter."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, fn, *args)


class RewardPool:
    """What the rollouter calls: `await pool.score(inp)` -> RewardResult (the weighted total of
    `reward.fns`, or `reward.fn`'s score). Raises `RewardsFailed` (app/rewards/guard.py) once every one of the
    first `reward.fail_fast_samples` samples failed."""

    def __init__(self, reward_cfg: Any, name_prefix: str) -> None:
        c = self.cfg = reward_cfg
        fns, weights = list(getattr(c, "fns", None) or []), list(getattr(c, "weights", None) or [])
        specs, named = reward_specs(c.fn, fns, weights), bool(fns)
        self.functions = len(specs)
        self.guard = FailFast(getattr(c, "fail_fast_samples", 0))
        self.workers: list[Any] = []
        self.busy: list[int] = []
        n, conc = int(c.workers), max(1, int(c.max_concurrency))
        self.procs: RewardScorer | None = None
        self.executor: ThreadPoolExecutor | None = None
        if n > 0:
            import ray

            cls = ray.remote(RewardWorker)
            self.workers = [
                cls.options(
                    name=f"{name_prefix}-reward-{i}",
                    num_cpus=c.worker_cpus,
                    max_concurrency=c.max_concurrency,
                    max_restarts=-1,  # a worker killed by a hostile reward comes back
                    max_task_retries=0,  # ...but the reward that killed it is not retried: it scores on_error
                ).remote(specs, c.timeout_s, c.on_error, conc, c.max_memory_mb, named)
                for i in range(n)
            ]
            self.busy = [0] * n
        else:  # threads that only wait on pipes: the event loop never blocks on a reward
            self.procs = RewardScorer(specs, c.timeout_s, c.on_error, conc, c.max_memory_mb, named)
            self.executor = ThreadPoolExecutor(conc, thread_name_prefix="reward")
        self.sem = asyncio.Semaphore(max(1, n) * conc)
        self._batched: dict[str, bool] = {}

    async def pids(self) -> list[int]:
        return [await w.pid.remote() for w in self.workers]

    async def score(self, inp: RewardInput) -> RewardResult:
        async with self.sem:
            if self.procs is not None:
                self.procs.resolve(inp.data_source)
                loop = asyncio.get_running_loop()
                res = await loop.run_in_executor(self.executor, self.procs.score, inp)
            else:
                res = (await self._remote([inp], False))[0]
        self.guard.observe(inp, res)
        return res

    def fast(self) -> bool:
        """Whether the samples of a group that finish together go to `score_each`: the rollouter's own
        scoring processes (`reward.workers=0`) with a fast reward (`FAST_REWARD_S`, timed on its samples)."""
        return self.procs is not None and self.procs.fast()

    async def score_each(self, inps: list[RewardInput]) -> list[RewardResult]:
        """Each of `inps` (samples of one row that finished together) scored as `score` scores it: with a fast
        reward (`fast`), all in one request a function; else each in its own call, at once."""
        if self.procs is None or not inps or not self.procs.fast():
            return list(await asyncio.gather(*[self.score(inp) for inp in inps]))
        async with self.sem:
            self.procs.resolve(inps[0].data_source)
            loop = asyncio.get_running_loop()
            results = await loop.run_in_executor(self.executor, self.procs.score_each, inps)
        for inp, res in zip(inps, results, strict=True):
            self.guard.observe(inp, res)
        return results

    async def batched(self, data_source: str) -> bool:
        """Whether `data_source`'s samples are scored a group at a time (a TRL-style function): the generator
        then calls `score_group` once a group's samples are all generated, instead of `score` on each."""
        if data_source not in self._batched:
            if self.procs is not None:
                self._batched[data_source] = self.procs.batched(data_source)
            else:
                try:
                    self._batched[data_source] = await self.workers[0].batched.remote(data_source)
                except Exception as e:  # a spec that does not resolve: each sample's `score` reports it
                    log.warning(
                        "reward for %r did not resolve (%s): scoring sample by sample", data_source, e
                    )
                    self._batched[data_source] = False
        return self._batched[data_source]

    async def score_group(self, inps: list[RewardInput]) -> list[RewardResult]:
        """Each of `inps` (the samples of one row) scored, a TRL-style function in one call on all of them
        (app/rewards/styles.py); raises `RewardsFailed` as `score` does."""
        async with self.sem:
            if self.procs is not None:
                self.procs.resolve(inps[0].data_source)
                loop = asyncio.get_running_loop()
                results = await loop.run_in_executor(self.executor, self.procs.score_group, inps)
            else:
                results = await self._remote(inps, True)
        for inp, res in zip(inps, results, strict=True):
            self.guard.observe(inp, res)
        return results

    @contextlib.contextmanager
    def _least_busy(self) -> Iterator[int]:
        """The index of the worker with the fewest calls in flight, counted busy while the block runs."""
        i = min(range(len(self.workers)), key=self.busy.__getitem__)
        self.busy[i] += 1
        try:
            yield i
        finally:
            self.busy[i] -= 1

    async def _remote(self, inps: list[RewardInput], group: bool) -> list[RewardResult]:
        """`inps` scored on the least busy worker: a group in one call, or the one sample of `inps`."""
        c = self.cfg
        with self._least_busy() as i:
            try:
                w = self.workers[i]
                ref = w.score_group.remote(inps) if group else w.score.remote(inps[0])
                # the functions run one after the other, each within timeout_s
                d = await asyncio.wait_for(ref, timeout=c.timeout_s * self.functions + WORKER_MARGIN_S)
                return [RewardResult(**r) for r in d] if group else [RewardResult(**d)]
            except asyncio.TimeoutError:
                failed = RewardResult(
                    c.on_error, "timeout", f"reward worker {i} did not answer within {c.timeout_s}s + margin"
                )
            except Exception as e:
                import ray

                if isinstance(e, ray.exceptions.RayActorError):
                    log.warning("reward worker %d died while scoring (restarting): %s", i, e)
                    failed = RewardResult(c.on_error, "crash", f"reward worker {i} died: {type(e).__name__}")
                else:
                    failed = RewardResult(c.on_error, "exception", f"{type(e).__name__}: {e}")
        return [replace(failed) for _ in inps]

    async def offload(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` (blocking, picklable) beside generation: on the least busy reward worker when there are
        any, sharing their concurrency with the rewards, else in a thread here. The environments' `Offload`
        (app/envs/base.py). A worker that dies raises its RayActorError (the episode scores on_error); the
        caller's deadline (env.step_timeout_s) bounds the wait."""
        if not self.workers:
            return await asyncio.to_thread(fn, *args)
        async with self.sem:
            with self._least_busy() as i:
                return await self.workers[i].run.remote(fn, *args)

    def close(self) -> None:
        """Kill the local scoring processes (workers' processes die with their actors)."""
        if self.procs is not None:
            self.procs.close()
