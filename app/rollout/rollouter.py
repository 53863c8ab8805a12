"""The rollouter: a named async Ray actor that feeds the trainer with scored prompt groups.

A thin facade over app/rollout/: the `PromptStream` (epochs of prompts, exactly-once bookkeeping, the
checkpoint state), the `GroupGenerator` (one group through the Serve deployment's `generate`, rewards as
each sample finishes, reference log-probs) and the `AsyncProducer` (fully_async: admission, the bounded
queue of finished groups). The prompt files are read, validated and tokenized in Ray Data inside this actor.

Two ways to feed the trainer:
- `generate_batch(k)` (sync, one_step_off): the next k groups, generated on request.
- `start_stream()` + `get_batch(k, version)` (fully_async): the producer keeps admitted groups generating;
  `on_push(version)` raises the admission limit after every push.

Checkpoint state (`snapshot` / `restore`, a `PipelineSnapshot`): every prompt taken is outstanding until the
trainer acknowledges its group (`ack`); a snapshot holds the stream position, the finished groups not yet
trained and every other outstanding prompt, with its partial samples where a freeze ended its generation.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from app.config import typed
from app.envs import make_factory
from app.infra.resources import ongoing_requests, samples_per_request
from app.records import Batch, Group, PipelineSnapshot, Prompt, ValResult
from app.rollout import filtering
from app.rollout.episode import env_metrics
from app.rollout.generator import Frozen, GroupGenerator
from app.rollout.producer import AsyncProducer, reward_errors
from app.rollout.prompt_stream import PromptStream
from app.rollout.serve_generate import ServeGenerate

log = logging.getLogger(__name__)


class Rollouter:
    """Async Ray actor (see the module docstring). `train` and `val` are prompt file paths."""

    def __init__(
        self, cfg: dict[str, Any], model_path: str, train: str | list[str], val: str | list[str]
    ) -> None:
        from omegaconf import OmegaConf
        from ray import serve
        from transformers import AutoTokenizer

        from app.names import DEPLOYMENT_NAME, app_name
        from app.rewards.pool import RewardPool
        from app.rollout.dataset import to_prompt, train_dataset, val_prompts
        from app.rollout.prompt_files import Columns

        self.cfg = cfg = OmegaConf.create(cfg)
        d = cfg.data
        tok = AutoTokenizer.from_pretrained(model_path)
        # streamed from the file and tokenized once in Ray Data (kept in the object store), then shuffled
        # and streamed epoch after epoch; a bad row fails here with a DataError naming the file and row
        columns = Columns.from_cfg(d)
        # (no training file: `python -m app eval`, which generates for the validation prompts only)
        self.train_set = (
            None
            if not train
            else train_dataset(
                train,
                model_path,
                d.max_prompt_tokens,
                d.truncation,
                columns,
                list(d.train_weights),
                d.shuffle,
                d.seed,
            )
        )
        self.val_prompts = val_prompts(
            val, model_path, d.max_prompt_tokens, d.truncation, d.val_size, columns
        )
        refs = None
        if cfg.algorithm.kl_coef > 0 and cfg.ref.workers > 0:
            from app.rollout.reference import RefPool

            refs = RefPool(cfg, model_path)
        self.stats: Counter[str] = Counter()
        self._scoring_after_s = 0.0  # a sync batch's scoring after generation (reward.overlap=false)
        handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app_name(cfg.ray.name))
        rewards = RewardPool(cfg.reward, cfg.ray.name)  # environments' blocking steps run beside rewards
        c = typed(cfg)  # the sections as their dataclasses
        self.generator = GroupGenerator(
            ServeGenerate(handle, c.rollout.request_timeout_s, stats=self.stats),
            lambda ids: tok.decode(ids, skip_special_tokens=True),
            rewards,  # a GroupScore: TRL-style rewards see a whole group
            c.rollout,
            reward=c.reward,
            seed=c.seed,
            refs=refs,
            stats=self.stats,
            env=make_factory(cfg.env.name, cfg, rewards.offload),
            encode=lambda text: list(tok.encode(text, add_special_tokens=False)),
            limits=c.env,
        )
        self.stream = PromptStream(self._epoch_rows, epochs=d.epochs, max_prompt_tokens=d.max_prompt_tokens)
        self.producer = AsyncProducer(
            self.stream,
            self._stream_group,
            c.algorithm,
            batch_groups=c.train.batch_groups,
            max_inflight=c.rollout.max_inflight,
            seed=c.seed,
            stats=self.stats,
        )
        self._to_prompt = to_prompt
        self.gen_busy_s = 0.0

    def _epoch_rows(self, epoch: int) -> Iterator[Prompt]:
        if self.train_set is None:
            raise RuntimeError("this rollouter was started without a training file (for evaluation only)")
        return map(self._to_prompt, self.train_set.epoch(epoch))

    async def _train_group(self, prompt: Prompt, seed: int, score_now: bool = True) -> Group:
        try:
            return await self.generator.group(prompt, seed=seed, score_now=score_now)
        except Frozen as f:  # a checkpoint ended it: saved with its versions, continued after a restore
            self.stream.keep_partial(f.key, f.samples)
            raise

    async def _stream_group(self, prompt: Prompt, seed: int) -> Group:
        return await self.generator.group(prompt, seed=seed)

    # ------------------------------------------------------------ sync and one_step_off

    async def generate_batch(self, num_groups: int) -> Batch:
        """The next `num_groups` groups: those restored from a checkpoint first, then fresh prompts. With
        `algorithm.filter_groups`, groups without reward variance are dropped (`Batch.filtered`) and refilled
        from the stream until the batch is full or the data runs out."""
        t0 = time.perf_counter()
        gen = self.stream.generation
        ready = self.producer.ready
        restored = [ready.popleft() for _ in range(min(num_groups, len(ready)))]
        self._scoring_after_s = 0.0
        keep, drop = await filtering.fill(
            num_groups, restored, lambda k: self._fresh_groups(k, gen), self.cfg.algorithm.filter_groups
        )
        self.stats["async/filtered_groups"] += len(drop)
        dt = time.perf_counter() - t0
        self.gen_busy_s += dt
        return Batch(
            groups=keep,
            generate_s=dt,
            dropped_overlong=self.stream.dropped_overlong,
            reward_errors=reward_errors(self.stats),
            filtered=drop,
            extra={
                "async/filtered_groups": float(self.stats["async/filtered_groups"]),
                **({} if self.cfg.reward.overlap else {"timing/reward_after_s": self._scoring_after_s}),
            },
        )

    async def _fresh_groups(self, k: int, gen: int) -> list[Group]:
        """`k` fresh prompts from the stream, generated and scored (fewer when the data runs out)."""
        t0 = time.perf_counter()
        prompts = await asyncio.to_thread(self.stream.take, k, gen)
        base = random.Random(self.cfg.seed * 1_000_003 + self.stream.cursor)
        overlap = self.cfg.reward.overlap
        fresh = await asyncio.gather(
            *[self._train_group(p, base.randrange(2**31), score_now=overlap) for p in prompts]
        )
        if not overlap:  # the baseline: score the batch once all of it is generated
            t_gen = time.perf_counter() - t0
            fresh = await asyncio.gather(*[self.generator.score_group(g) for g in fresh])
            self._scoring_after_s += time.perf_counter() - t0 - t_gen  # this batch's, for its metrics
            self.stats["timing/reward_after_s"] = self._scoring_after_s
        if gen != self.stream.generation:
            raise RuntimeError("this batch request was superseded by a restore from a checkpoint")
        return list(fresh)

    async def evaluate(self, n: int, temperature: float, seed: int = 0) -> list[Group]:
        """`n` scored samples of every validation prompt (rewards never shaped): what validation and
        `python -m app eval` score (app/evaluation/scores.py). Up to twice as many samples generate at once
        as the replicas batch (`rollout.max_num_seqs` each, and no more than they take): vLLM's queue refills
        a slot as a sample ends, and a large file never waits out a request's deadline in a queue."""
        r = self.cfg.rollout
        held = ongoing_requests(self.cfg) * samples_per_request(r, n)  # samples a replica takes
        at_once = min(2 * r.max_num_seqs, held) * r.max_replicas
        gate = asyncio.Semaphore(max(1, at_once // n))

        async def one(p: Prompt) -> Group:
            async with gate:
                return await self.generator.group(p, seed=seed, n=n, temperature=temperature, train=False)

        return list(await asyncio.gather(*[one(p) for p in self.val_prompts]))

    async def validate(self) -> ValResult:
        """`eval.val_n` greedy (or `algorithm.val_temperature`) answers to each validation prompt: the mean
        reward, mean@n and pass@k per data source, and a table of first answers."""
        from app.evaluation.scores import PromptRewards, ks_for, score, sub_score_means

        t0 = time.perf_counter()
        n, ev = self.cfg.eval.val_n, self.cfg.eval
        groups = await self.evaluate(n, self.cfg.algorithm.val_temperature)
        rewards = [s.reward for g in groups for s in g.samples]
        versions = [v for g in groups for s in g.samples for v in s.versions]
        table = [
            {
                "uid": g.uid,
                "prompt": g.prompt_text,
                "response": g.samples[0].text,
                "answer": g.answer,
                "reward": g.samples[0].reward,
                "version": g.samples[0].versions[-1] if g.samples[0].versions else -1,
            }
            for g in groups[: self.cfg.tracking.log_samples]
        ]
        scores = score(
            [PromptRewards(g.data_source, [s.reward for s in g.samples]) for g in groups],
            ks_for(ev.k, n),
            ev.pass_threshold,
        )
        return ValResult(
            reward=sum(rewards) / max(1, len(rewards)),
            n=len(groups),
            seconds=time.perf_counter() - t0,
            version_max=max(versions, default=-1),
            version_min=min(versions, default=-1),
            table=table,
            scores=scores,
            extra={
                **{
                    f"val/{k.split('/')[-1]}": v
                    for k, v in env_metrics([s for g in groups for s in g.samples]).items()
                },
                **sub_score_means((s.reward_extras for g in groups for s in g.samples), "val/sub/"),
            },
        )

    # ------------------------------------------------------------ fully_async

    async def start_stream(self) -> None:
        """Start the background producer (idempotent). Call after the trainer's first push."""
        await self.producer.start()

    async def on_push(self, version: int) -> None:
        await self.producer.on_push(version)

    async def get_batch(self, num_groups: int, version: int, timeout_s: float) -> Batch:
        return await self.producer.get_batch(num_groups, version, timeout_s)

    async def stop_stream(self) -> None:
        self.producer.stop()

    # ------------------------------------------------------------ checkpoint state

    async def ack(self, keys: list[str]) -> None:
        """The trainer trained these groups (`Group.key`): they leave the checkpoint state."""
        self.stream.ack(keys)

    async def snapshot(self, freeze: bool = False, timeout_s: float = 60.0) -> PipelineSnapshot:
        """The pipeline state a checkpoint needs; call at a step boundary, after `ack`.

        freeze=True (a clean stop, the end of a run): stop starting groups and end every generation in flight
        on every replica (vLLM's abort), keeping each group's samples so far, with their per-token versions
        and behaviour log-probs, as a partial rollout that `restore` continues. Without freeze, groups in
        flight are saved as prompts to generate again (what a crash would lose is compute, not prompts).
        """
        if freeze:
            self.generator.freezing = True
            self.producer.stop()
            acks = await _abort_inflight(self.cfg.ray.name, timeout_s)
            deadline = time.monotonic() + timeout_s
            while self.generator.inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.generator.inflight:
                raise TimeoutError(
                    f"checkpoint: {len(self.generator.inflight)} groups still generating {timeout_s:.0f}s after "
                    f"the replicas were asked to abort them ({sorted(self.generator.inflight)[:5]}...); "
                    f"replica answers: {acks}"
                )
        snap = self.stream.snapshot(list(self.producer.ready))
        snap.taken, snap.version = self.producer.taken, self.producer.version
        return snap

    async def restore(self, snap: PipelineSnapshot | dict[str, Any]) -> dict[str, int]:
        """Continue from a snapshot: its finished groups are trained first, its other prompts generated
        first (partial rollouts continued from their saved tokens), then the stream goes on where it was."""
        if isinstance(snap, dict):  # a pipeline.json read by a caller that has not typed it
            snap = PipelineSnapshot.from_dict(snap)
        self.stream.restore(snap)  # groups started before this point are dropped when they finish
        self.producer.reset(list(snap.ready), snap.taken, snap.version)
        self.generator.freezing = False
        self.generator.inflight = set()
        log.info(
            "restored the prompt stream: epoch %d, %d finished groups to train, %d prompts to generate "
            "(%d partial)",
            snap.epoch,
            len(snap.ready),
            len(snap.pending),
            snap.partial_groups,
        )
        return {"ready": len(snap.ready), "pending": len(snap.pending), "partial": snap.partial_groups}

    async def progress(self) -> dict[str, Any]:
        return {
            **self.stream.progress(),
            **self.producer.progress(),
            "generating": len(self.generator.inflight),
            **dict(self.stats),
        }


async def _abort_inflight(prefix: str, timeout_s: float) -> Any:
    """Ask every replica to end its in-flight generations (through the run-control actor)."""
    from app.names import control_name
    from app.weights.actors import get_actor

    return await get_actor(control_name(prefix)).abort_inflight.remote(timeout_s)
