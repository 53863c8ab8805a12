"""`python -m app eval` on one machine without Ray (`eval.engine`): one vLLM engine in this process, and
validation's group generator and reward pool.

    engine   `create_engine` (app/vllm/engine.py) with a rollout replica's arguments, environment and
             request handling (app/vllm/replica_engine.py): one vLLM configuration for both paths. On CPU
             the engine core is a spawned process, never a fork of this one (whose torch threads have run:
             a fork would deadlock in libgomp). The engine's processes are recorded once it is up and killed
             by pid (SIGKILL) when the evaluation ends: also after an error, Ctrl-C or SIGTERM
    prompts  every prompt of the files, read and tokenized here (`val_prompts`, as the rollouter reads them)
    samples  the rollouter's `GroupGenerator` (app/rollout/generator.py) on that engine: `eval.n` samples of
             each prompt at `eval.temperature` (top_p, top_k, stop and lengths of `rollout.*`), seeded from
             `seed` as the rollouter's `evaluate` seeds them, each scored by the `RewardPool` as it finishes;
             its scoring processes run here (`reward.workers` are Ray actors: none start)
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from app.records import GenerateRequest, GenerateResponse, Group, Prompt, Sample

log = logging.getLogger("app.eval")

REPLICA = "local"  # the `replica` of every sample
VERSION = -1  # the weights from disk, as a replica holds them before any push
KILL_GRACE_S = 5.0  # after the engine's own shutdown, before its processes still running are killed


def timed_out(timeout_s: float) -> TimeoutError:
    """The error of a generation past `eval.timeout_s` (either path)."""
    return TimeoutError(
        f"the evaluation's generation did not finish within eval.timeout_s={timeout_s:g}s; "
        "raise it, or evaluate fewer prompts or samples (eval.n)"
    )


def settings(cfg: DictConfig) -> DictConfig:
    """The config of a local evaluation: `resources.*` shares resolved against this machine (its GPUs and
    `ray.num_cpus` logical CPUs, as a local Ray cluster would resolve them), the placement checked (a GPU
    build of vLLM refuses a CPU engine), and the rewards scored in this process (`reward.workers=0`)."""
    from app.infra.resources import asks_for_gpus, check_placement, local_gpu_count, resolve

    gpus = local_gpu_count() if asks_for_gpus(cfg) else 0  # (torch is imported only where it can matter)
    shares = resolve(cfg, {"CPU": float(cfg.ray.num_cpus), "GPU": float(gpus)})
    out = OmegaConf.merge(
        cfg, OmegaConf.from_dotlist([f"{k}={v}" for k, v in shares.items()]), {"reward": {"workers": 0}}
    )
    check_placement(out)
    return out  # type: ignore[return-value]


class EngineGenerate:
    """The `GenerateFn` (app/rollout/generator.py) of an engine in this process: a replica's `generate`
    without Serve or a weight group (every token carries VERSION)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def __call__(self, req: GenerateRequest) -> GenerateResponse:
        from app.vllm.replica_engine import generate_request

        samples = await generate_request(self.engine, req, VERSION)
        return GenerateResponse(
            samples=[Sample(**s, replica=REPLICA) for s in samples], replica=REPLICA, version=VERSION
        )


def generate(cfg: DictConfig, model_path: str, val: list[str], columns: Any) -> list[Group]:
    """`eval.n` scored samples of every prompt of the files `val` (see the module docstring); raises
    `timed_out` past `eval.timeout_s` (counted from the engine's start)."""
    from app.vllm.replica_engine import engine_env

    os.environ.update(engine_env(cfg))  # before vLLM is imported; the engine's processes inherit it
    procs: list[Any] = []
    restore = _interrupt_on_sigterm()
    try:
        return asyncio.run(_generate(cfg, model_path, val, columns, procs))
    finally:
        restore()
        gc.collect()  # the engine, shut down already, is freed here (`_generate`)
        kill(procs)


async def _generate(
    cfg: DictConfig, model_path: str, val: list[str], columns: Any, procs: list[Any]
) -> list[Group]:
    from transformers import AutoTokenizer

    from app.config import typed
    from app.envs import make_factory
    from app.rewards.pool import RewardPool
    from app.rollout.dataset import val_prompts
    from app.rollout.generator import GroupGenerator
    from app.vllm import engine as vla

    d, c = cfg.data, typed(cfg)
    prompts = val_prompts(val, model_path, d.max_prompt_tokens, d.truncation, d.val_size, columns)
    tok = AutoTokenizer.from_pretrained(model_path)
    engine = start_engine(cfg, model_path, procs)
    rewards = RewardPool(cfg.reward, cfg.ray.name)
    gen = None
    try:
        gen = GroupGenerator(
            EngineGenerate(engine),
            lambda ids: tok.decode(ids, skip_special_tokens=True),
            rewards,  # a GroupScore: TRL-style rewards see a whole group
            c.rollout,
            reward=c.reward,
            seed=c.seed,
            stats=Counter(),
            env=make_factory(cfg.env.name, cfg, rewards.offload),
            encode=lambda text: list(tok.encode(text, add_special_tokens=False)),
            limits=c.env,
        )
        log.info("generating %d samples per prompt of %s (engine in this process)", cfg.eval.n, val)
        try:
            async with asyncio.timeout(cfg.eval.timeout_s) as deadline:
                ev = cfg.eval
                return await all_groups(
                    gen, prompts, ev.n, ev.temperature, cfg.seed, cfg.rollout.max_num_seqs
                )
        except TimeoutError:
            if deadline.expired():
                raise timed_out(cfg.eval.timeout_s) from None
            raise  # a request's own deadline (rollout.request_timeout_s): its message says so
    finally:
        rewards.close()
        vla.shutdown(engine)
        # a module that vLLM imported while the engine started can keep the frames of that start alive (an
        # import error's traceback, stored), this one among them: without these references the engine is
        # freed now, not at the interpreter's exit, where its __del__ fails with vLLM's modules torn down
        del engine, gen


async def all_groups(
    gen: Any, prompts: list[Prompt], n: int, temperature: float, seed: int, max_num_seqs: int
) -> list[Group]:
    """`n` scored samples of every prompt (`gen.group` with validation's arguments, as the rollouter's
    `evaluate`): up to twice as many samples generate at once as the engine batches
    (`max_num_seqs`), so vLLM's queue refills a slot as a sample ends and no request waits out its
    deadline (`rollout.request_timeout_s`) in a queue."""
    gate = asyncio.Semaphore(max(1, 2 * int(max_num_seqs) // n))

    async def one(p: Prompt) -> Group:
        async with gate:
            return await gen.group(p, seed=seed, n=n, temperature=temperature, train=False)

    return list(await asyncio.gather(*[one(p) for p in prompts]))


def start_engine(cfg: DictConfig, model_path: str, procs: list[Any]) -> Any:
    """The engine of a rollout replica of `cfg` on `model_path`; its processes (those this process has now
    and had not before, with theirs) are appended to `procs`, also where its start failed."""
    from app.rollout.partial import partial_policy
    from app.vllm import engine as vla
    from app.vllm.replica_engine import engine_args

    before = {p.pid for p in _descendants()}
    try:
        return vla.create_engine(model_path, **engine_args(cfg), partial=partial_policy(cfg.rollout.partial))
    finally:
        procs.extend(p for p in _descendants() if p.pid not in before and not _resource_tracker(p))


def _descendants() -> list[Any]:
    import psutil

    return psutil.Process().children(recursive=True)


def _resource_tracker(proc: Any) -> bool:
    """multiprocessing's resource tracker, which spawning the engine core may start: this process's, not the
    engine's (it cleans up after this process at its exit)."""
    import psutil

    try:
        return "resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def kill(procs: list[Any], grace_s: float = KILL_GRACE_S) -> None:
    """SIGKILL each of `procs` (psutil processes: a pid reused since is never hit) still running `grace_s`
    after the engine's own shutdown asked it to stop."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            log.warning("engine process %d still running after the engine's shutdown: killing it", p.pid)
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def _interrupt_on_sigterm() -> Callable[[], None]:
    """SIGTERM raises KeyboardInterrupt here (as Ctrl-C does) while the engine runs, so that the engine and
    its processes are stopped before this process ends; returns what restores the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)
