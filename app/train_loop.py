"""The trainer loop, as the algorithm reads: get a batch, train, push the new version, log, checkpoint; and
`train_worker`, the entry point of every Ray Train worker (build the trainer's pieces, restore or start, run
the loop, `finish`).

    sync          batch t is generated with weights t, trained, then t+1 is pushed.
    one_step_off  batch t+1 is generated (with weights t) while batch t trains; the push of t+1 waits
                  for that generation to finish, so every trained token is exactly one version old.
    fully_async   groups stream in while the trainer trains; pushes every `algorithm.sync_every` steps.

How batches are made and when weights are pushed or validated differ by `algorithm.mode`; the loop asks the
mode's `BatchSource` (app/trainer/sources/) and never branches on the mode itself. Every rank runs this in
lock-step: rank 0 fetches the batch and shares it, every rank trains its share and takes part in each push.
The loop's parts are in app/trainer/ (the learner: app/trainer/learner.py).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from app.infra.log_filters import configure_logging
from app.plugins import resolve
from app.records import Batch
from app.sync import TrainerSync
from app.trainer.accounting import TrainedLog
from app.trainer.comm import Actors, bcast
from app.trainer.learner import Learner
from app.trainer.monitor import Monitor
from app.trainer.parts import Trainer
from app.trainer.rollout_log import RolloutLog
from app.trainer.saving import save_checkpoint
from app.trainer.sources import SOURCES
from app.trainer.state import RunState, restore_or_start
from app.trainer.step_metrics import PROMETHEUS, StepTimings, step_metrics
from app.trainer.validation import Validator
from app.trainer.warm_up import warm_up
from app.weights.records import PushStats

log = logging.getLogger("app.train")


def run(t: Trainer, st: RunState) -> None:
    """Train from `st` until `train.steps`, a stop request or the end of the data; then `finish`."""
    begin(t, st)
    steps = t.cfg.train.steps
    for step in range(st.step + 1, steps + 1):  # 1-based: the step about to be trained
        t0 = time.perf_counter()
        t.monitor.phase(f"waiting for {t.cfg.train.batch_groups} finished groups for step {step}")
        batch, st.stop = next_batch(t, st, more=step < steps)
        if not batch.groups:
            settle_filtered(t, st.step, batch)
            log.info("stopping after %d steps: %s", st.step, st.stop)
            break
        wait_s = time.perf_counter() - t0
        stats, train_s, overlap_s = train(t, st, batch, step)
        last = step == steps or bool(st.stop)
        push = push_weights(t, st, step, last)
        timings = StepTimings(
            wait_s=wait_s, overlap_wait_s=overlap_s, train_s=train_s, step_s=time.perf_counter() - t0
        )
        report(t, st, step, last, batch, stats, timings, push)
        st.step = step
        t.monitor.step_done(step)
        if st.stop:
            log.warning("stopping cleanly after step %d of %d: %s", step, steps, st.stop)
            break
        if t.cfg.train.save_every and step % t.cfg.train.save_every == 0 and step < steps:
            save_checkpoint(t, st, False, {"step": step, "weight_version": st.version})
    finish(t, st)


def begin(t: Trainer, st: RunState) -> None:
    """Push the trainer's weights (the replicas then hold exactly them, verified by checksum), validate them
    unless restored with a validation, start the mode's stream and the watchdog. The rollout replicas start
    beside the trainer: the first push waits for one."""
    t.monitor.phase("waiting for the first rollout replica to register")
    waited = t.sync.wait_for_rollout(t.cfg.rollout.join_timeout_s)
    if waited > 1:
        level = logging.INFO if t.lead else logging.DEBUG  # one line a run, not one a rank
        log.log(level, "the first rollout replica registered after %.1fs", waited)
    push_version(t, st, "the first weights", notify=False)
    more = st.step < t.cfg.train.steps  # not so for a run restored at its last step
    if t.lead:
        if st.restored_from is None or st.val_last is None:
            st.val_first = st.val_last = t.validator.run(st.version, st.step)
        from app.infra.ray_compat import progress_bar

        t.bar = progress_bar(total=t.cfg.train.steps, desc="relay train")
        if st.step:
            t.bar.update(st.step)
        t.source.start(more)
    t.monitor.start(st.restored_from["step"] if st.restored_from else None)
    st.t_run = st.t_loop_end = time.perf_counter()  # benchmarks: trained tokens per second of the loop
    if more:  # inside the loop's time: it overlaps the first generation
        t.monitor.phase("warming up the trainer (compiling its kernels) while the first batch generates")
        warm_up(t.learner, t.cfg.train.warm_up)


def next_batch(t: Trainer, st: RunState, more: bool) -> tuple[Batch, str | None]:
    """Rank 0's next batch and the reason to stop after it (if any), on every rank.

    While rank 0 waits for it (in a thread), every rank learns once a second whether a replica is waiting to
    join the weight group, and then pushes it the current weights (collective). A replica started mid-run
    serves only once it holds them, and the next push otherwise comes after the next step: where no other
    replica is left to generate that step's groups (all died; their replacements are starting), nothing
    else would ever push them, and the run would wait out its deadlines."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-batch") as pool:
        fut = pool.submit(_fetch_batch, t, st.version, more) if t.lead else None
        while (state := bcast(_wait_state(t, fut))) != "done":
            if state == "join":  # its stats go into the next step's metrics (rollout/join_s)
                t.between.append(push_version(t, st, "to a replica that joined"))
        return bcast(fut.result() if fut is not None else None)


def _fetch_batch(t: Trainer, version: int, more: bool) -> tuple[Batch, str | None]:
    import ray

    batch = t.source.next_batch(version, more)
    stop = ray.get(t.actors.control.stop_reason.remote(), timeout=30)
    if not batch.groups:
        stop = "the training data is exhausted (data.epochs) and every group was trained"
    return batch, stop


def _wait_state(t: Trainer, fut: Any) -> str | None:
    """Rank 0, after waiting up to a second for its batch: `done` (or failed: raised after the loop), `join`
    (a replica waits to join the weight group) or `wait`. Other ranks: None (they take rank 0's)."""
    import concurrent.futures

    import ray

    if fut is None:
        return None
    try:
        fut.result(timeout=1.0)
        return "done"
    except concurrent.futures.TimeoutError:
        return "join" if ray.get(t.actors.hub.joiners.remote(), timeout=30) else "wait"
    except Exception:
        return "done"


def train(t: Trainer, st: RunState, batch: Batch, step: int) -> tuple[dict[str, float], float, float]:
    """Train on `batch` (one optimizer step, or one per PPO mini-batch and epoch), then wait for what must end
    before a push. Returns the step's stats, the training seconds and the seconds waited after training."""
    t1 = time.perf_counter()
    t.monitor.phase(f"training step {step}")
    stats = t.learner.step(batch)
    train_s = time.perf_counter() - t1
    if t.lead:  # trained: these groups leave the checkpoint state
        t.source.ack(batch)
    count_skipped(t, st, stats, batch, step)
    if t.lead:
        t.source.before_push()
    st.version += 1
    st.tokens_trained += batch.num_tokens
    return stats, train_s, time.perf_counter() - t1 - train_s


def settle_filtered(t: Trainer, step: int, batch: Batch) -> None:
    """Rank 0, a batch with nothing left to train (the data ran out): the groups dynamic sampling dropped
    while making it still leave the checkpoint state and enter the accounting, as of the last step."""
    if t.lead and batch.filtered:
        t.source.ack(batch)
        t.accounting.append_filtered(step, batch.filtered)


def count_skipped(t: Trainer, st: RunState, stats: dict[str, float], batch: Batch, step: int) -> None:
    """An optimizer step whose loss or gradient was non-finite changed nothing: count it, keep the batch's prompt
    ids, and end the run past `train.max_skipped_steps`."""
    if stats["train/skipped_steps"]:
        st.skipped_total += int(stats["train/skipped_steps"])
        bad = t.run_dir / "nonfinite" / f"step_{step:06d}.json"
        if t.lead:
            bad.parent.mkdir(parents=True, exist_ok=True)
            rec = {"step": step, "grad_norm": stats["actor/grad_norm"], "loss": stats["loss/policy"]}
            bad.write_text(json.dumps({**rec, "uids": [g.uid for g in batch.groups]}))
        log.warning(
            "step %d: non-finite loss or gradient, update skipped (%d so far); prompt ids in %s",
            step,
            st.skipped_total,
            bad,
        )
        limit = t.cfg.train.max_skipped_steps
        if st.skipped_total > limit:
            raise FloatingPointError(
                f"{st.skipped_total} steps had a non-finite loss or gradient, over train.max_skipped_steps="
                f"{limit}; the prompt ids of each such batch are in {bad.parent}. Lower train.lr, check the "
                "reward and data, or raise the limit"
            )
    stats["train/skipped_steps"] = float(st.skipped_total)


def push_weights(t: Trainer, st: RunState, step: int, last: bool) -> PushStats | None:
    """Push the new version if the mode pushes after this step (collective)."""
    stats = push_version(t, st, "after the step") if t.source.should_push(step, last) else None
    st.t_loop_end = time.perf_counter()
    return stats


def push_version(t: Trainer, st: RunState, why: str, notify: bool = True) -> PushStats:
    """The loop's one push: the current version to every replica (collective, every rank), checked by
    checksum; then the mode hears of a new version (`notify`: not before its stream started)."""
    t.monitor.phase(f"pushing version {st.version} ({why})")
    stats = t.sync.push(st.version)
    new = st.pushed != st.version
    st.pushed = st.version
    if new and notify and t.lead:
        t.source.on_push(st.version)
    return stats


def report(
    t: Trainer,
    st: RunState,
    step: int,
    last: bool,
    batch: Batch,
    stats: dict[str, float],
    timings: StepTimings,
    push: PushStats | None,
) -> None:
    """Rank 0: metrics to the tracker and Prometheus, the accounting log, validation, progress."""
    between, t.between = t.between, []
    if not t.lead:
        return
    t.sync.settle(5.0)  # the push's replicas' own phases, where their workers acknowledged it
    families = t.source.metric_families | ({"filtered"} if t.cfg.algorithm.filter_groups else set())
    m = step_metrics(stats, batch, timings, push, st.version, st.pushed, step, between, families)
    t.tracker.metrics(m, step)
    t.accounting.append(step, st.version - 1, batch.groups)
    t.rollouts.append(step, st.version - 1, batch)
    t.accounting.append_filtered(step, batch.filtered)
    for k, gauge in PROMETHEUS.items():
        if k in m:
            t.prom.set(gauge, m[k])
    val = t.source.validate(t.validator, step, st.version, st.pushed, last)
    st.val_last = st.val_last if val is None else val
    t.bar.update(1)
    t.bar.set_description(f"relay v{st.version} reward {m['reward/mean']:.2f} val {st.val_last:.2f}")
    log.info(
        "step %d: reward %.3f loss %.4f gen %.2fs train %.2fs sync %.3fs staleness %.2f",
        step,
        m["reward/mean"],
        m["loss/policy"],
        batch.generate_s,
        timings.train_s,
        m.get("sync/time_s", 0.0),
        m["staleness/mean"],
    )


def finish(t: Trainer, st: RunState) -> None:
    """Stop generating (in-flight groups kept as partial rollouts), push and validate the final weights,
    save them as an HF model, and checkpoint the whole pipeline: `--resume` continues from there."""
    t.monitor.phase("finishing: final push, validation and checkpoint")
    frozen = t.source.snapshot(True) if t.lead else None
    if t.lead:
        val = t.source.stop(t.validator, st.step)
        st.val_last = st.val_last if val is None else val
    if st.pushed != st.version:  # the data ran out between pushes: the replicas get the final weights too
        push_version(t, st, "the final weights", notify=False)
        t.sync.settle(5.0)  # its replicas' own phases, for the log line (a no-op but on rank 0)
    if t.lead and t.validator.validated != st.version:
        st.val_last = t.validator.run(st.version, st.step)
    final = t.run_dir / "final"
    t.learner.save_hf(str(final), t.model_path)
    if t.lead:
        publish(t, final)
    summary = summarize(st, final)
    summary["checkpoint_name"] = save_checkpoint(t, st, True, summary, frozen)
    t.monitor.stop()
    if t.lead:
        (t.run_dir / "summary.json").write_text(json.dumps(summary))


def publish(t: Trainer, final: Path) -> None:
    """Rank 0: the final model (`final/`, the name it has on disk), the accounting log and the sampled
    rollouts to the tracker (the model copied or referenced by `tracking.log_model`, and registered)."""
    tr = t.cfg.tracking
    t.tracker.log_model(final, tr.log_model, tr.log_model_max_mb, tr.register_model)
    for path in (t.accounting.path, t.rollouts.path):
        if path.exists():
            t.tracker.artifact(str(path))
    t.bar.close()


def summarize(st: RunState, final: Path) -> dict[str, Any]:
    """summary.json (the driver's result) from the run's state."""
    return {
        "weight_version": st.version,
        "steps": st.step,
        "stopped": st.stop,
        "val_reward_first": st.val_first,
        "val_reward_last": st.val_last,
        "train_wall_s": time.perf_counter() - st.t_run,
        "loop_s": st.t_loop_end - st.t_run,
        "trained_tokens": st.tokens_trained,
        "final_checkpoint": str(final.resolve()),
        "restored_from": st.restored_from,
    }


# ---------------------------------------------------------------------------------------------- the entry point


def train_worker(config: dict[str, Any]) -> None:
    """Entry point of every Ray Train worker (see app/driver.py for what `config` holds)."""
    from omegaconf import OmegaConf

    configure_logging()  # log_level (RELAY_LOG_LEVEL) in this worker: DEBUG shows each push's phases
    t = build(OmegaConf.create(config["cfg"]), config)
    try:
        run(t, restore_or_start(t, config.get("resume")))
    finally:  # rank 0's queued MLflow calls, written within a deadline (app/infra/tracking.py)
        if t.tracker is not None:
            t.tracker.close()
    # a clean end: every rank is here, so the default group can go (Ray Train destroys it only for 2+
    # workers; an NCCL group left to the process's exit warns "destroy_process_group() was not called")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def build(cfg: Any, config: dict[str, Any]) -> Trainer:
    """This worker's learner (its FSDP2 shard), weight sync, batch source and, on rank 0, the loggers."""
    from app.infra.metrics import trainer_metrics
    from app.infra.tracking import METRICS_FILE, Tracker
    from app.run_folder import trainer_sinks

    torch.manual_seed(cfg.train.seed)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.train.use_gpu else torch.device("cpu")
    torch.set_num_threads(max(1, int(cfg.train.worker_cpus)))
    learner = Learner(cfg, config["model_path"], device)
    actors = lookup_actors(cfg.ray.name, cfg.train.timeout_s)
    lead = learner.rank == 0
    run_dir = Path(config["run_dir"])
    tracker = (
        Tracker(
            config["tracking_uri"],
            config["run_id"],
            jsonl=run_dir / METRICS_FILE,
            sinks=trainer_sinks(cfg, run_dir),  # tracking.sinks: TensorBoard, W&B
        )
        if lead
        else None
    )
    prom = trainer_metrics()
    return Trainer(
        cfg=cfg,
        rank=learner.rank,
        learner=learner,
        sync=TrainerSync(cfg, learner, actors.hub, device),
        source=resolve("algorithm.mode", cfg.algorithm.mode, SOURCES)(cfg, actors),
        actors=actors,
        run_dir=run_dir,
        model_path=config["model_path"],
        monitor=Monitor(actors if lead else None, cfg.train.stall_timeout_s, run_dir),
        accounting=TrainedLog(run_dir),
        rollouts=RolloutLog(run_dir, cfg.tracking.rollouts_per_step, cfg.seed),
        prom=prom,
        tracker=tracker,
        validator=Validator(actors, tracker, prom) if lead else None,
    )


def lookup_actors(prefix: str, timeout_s: float) -> Actors:
    """The actors of run `prefix` (created by app/driver.py), looked up by name, once the rollouter has
    started (the driver does not wait for it: it reads the prompts while the trainer starts)."""
    from app.names import control_name, hub_name, rollouter_name
    from app.weights.actors import get_actor

    actors = Actors(
        hub=get_actor(hub_name(prefix)),
        control=get_actor(control_name(prefix)),
        rollouter=get_actor(rollouter_name(prefix)),
        timeout_s=timeout_s,
    )
    actors.get(
        actors.rollouter.progress.remote(), "the rollouter's start (reading and tokenizing the prompts)"
    )
    return actors
