"""The loop each Ray Train worker runs: fetch a batch, train, push the new version, log.

    sync          batch t is generated with weights t, trained, then t+1 is pushed.
    one_step_off  batch t+1 is generated (with weights t) while batch t trains; the push of t+1 waits
                  for that generation to finish, so every trained token is exactly one version old.

Rank 0 talks to the rollouter, the weight hub and MLflow; every rank trains its share and takes part in
the gathers of each push.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from app import checkpoint
from app.sync import PushStats, SyncError, check_acks, free_port, plan_buckets, resolve_backend, send_buckets
from app.train_loop import Learner, batch_metrics, staleness
from app.watchdog import REPORT as STALL_REPORT
from app.watchdog import Watchdog

log = logging.getLogger("app.train")


def _bcast(obj: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


EMPTY_PIPELINE: dict[str, Any] = {
    "epoch": 0,
    "epoch_seen": [],
    "cursor": 0,
    "taken": 0,
    "version": 0,
    "dropped_overlong": 0,
    "ready": [],
    "pending": [],
    "partial_groups": 0,
    "partial_tokens": 0,
}


class _nullcontext:
    def __init__(self, value: Any) -> None:
        self.value = value

    def __enter__(self) -> Any:
        return self.value

    def __exit__(self, *exc: Any) -> None:
        return None


def stall_report(rollouter: Any, hub: Any) -> dict[str, Any]:
    """What the rollouter and the replicas are doing, for the watchdog (each answer within 10 s)."""
    import ray

    out: dict[str, Any] = {}
    try:
        out["rollouter"] = ray.get(rollouter.progress.remote(), timeout=10)
    except Exception as e:
        out["rollouter"] = f"no answer within 10s ({e!r}): the rollouter itself is stuck or dead"
    try:
        st = ray.get(hub.status.remote(), timeout=10)
        out["replicas"] = {
            rid: {k: m.get(k) for k in ("alive", "version", "epoch", "dropped", "leaving")}
            for rid, m in st.get("members", {}).items()
        }
        out["hub_version"], out["last_push"] = st.get("version"), st.get("last_push")
    except Exception as e:
        out["replicas"] = f"the weight hub did not answer within 10s ({e!r})"
    return out


class TrainerSync:
    """Trainer side of app/sync.py's protocol. Rank 0 owns the weight group; every rank gathers."""

    def __init__(self, cfg: Any, learner: Learner, hub: Any, device: torch.device) -> None:
        self.cfg, self.learner, self.hub, self.device = cfg, learner, hub, device
        self.rank = learner.rank
        self.group = None
        self.backend = resolve_backend(cfg.sync.backend, device)
        self.last: PushStats | None = None

    def _ensure_group(self) -> None:
        import ray

        from app.sync import StatelessGroup

        if self.group is not None and not ray.get(self.hub.membership_changed.remote()):
            return
        if self.group is not None:
            self.group.close()
            self.group = None
        s = self.cfg.sync
        host = ray.util.get_node_ip_address()
        # every replica gone (died, being restarted by Serve): wait for one to register, within a deadline
        wait_s = self.cfg.rollout.join_timeout_s
        deadline = time.monotonic() + wait_s
        while not ray.get(self.hub.alive_count.remote()):
            if time.monotonic() > deadline:
                raise SyncError(
                    f"no rollout replica registered with the weight hub within rollout.join_timeout_s={wait_s}s"
                    " (the Serve deployment has no running replica: see the Serve view of the dashboard)"
                )
            time.sleep(1.0)
        for _attempt in range(3):
            info = ray.get(self.hub.open_epoch.remote(host, free_port(), self.backend, s.timeout_s))
            if info.world == 1:
                continue  # the last replica left between the check and the epoch
            t0 = time.perf_counter()
            try:
                group = StatelessGroup(
                    host, info.port, 0, info.world, self.backend, s.timeout_s, info.epoch, self.device
                )
            except Exception as e:  # someone did not join: find out who, drop them, form again
                acks = ray.get(self.hub.wait_acks.remote("join", info.epoch, 1.0))
                missing = acks["__missing__"]["ids"]
                log.warning("epoch %d did not form (%s); dropping %s", info.epoch, e, missing)
                ray.get(self.hub.drop.remote(missing))
                continue
            acks = ray.get(self.hub.wait_acks.remote("join", info.epoch, s.timeout_s))
            check_acks(acks, "join", info.epoch, None, s.timeout_s)
            self.group = group
            log.info(
                "weight group epoch %d formed: %d receivers in %.2fs",
                info.epoch,
                info.world - 1,
                time.perf_counter() - t0,
            )
            return
        raise SyncError("could not form the weight group after 3 attempts (replicas keep failing to join)")

    def push(self, version: int) -> PushStats:
        """Push `version` to every replica; collective over the trainer ranks. Retries once after a failure."""
        import ray

        s = self.cfg.sync
        plan = plan_buckets(self.learner.push_specs(), int(s.bucket_mb * 2**20), version)
        for attempt in range(2):
            err: str | None = None
            stats = PushStats(version=version)
            if self.rank == 0:
                try:
                    self._ensure_group()
                    ray.get(self.hub.announce.remote(plan))
                except Exception as e:
                    err = f"{e}"
            go = _bcast(err is None)
            if go:
                try:
                    stats = send_buckets(
                        plan, self.learner.gather, self.group if self.rank == 0 else None, self.device
                    )
                except SyncError as e:
                    err = str(e)
                if self.rank == 0:
                    t0 = time.perf_counter()
                    # after a transport failure (a receiver died mid-push) only collect who answered
                    ack_wait = s.timeout_s if err is None else min(5.0, s.timeout_s)
                    acks = ray.get(self.hub.wait_acks.remote("push", version, ack_wait))
                    stats.ack_s = time.perf_counter() - t0
                    try:
                        check_acks(
                            acks,
                            "push",
                            version,
                            stats.checksums if s.verify and not err else None,
                            s.timeout_s,
                        )
                        stats.extra = {k: v for k, v in acks.items() if k != "__missing__"}
                    except SyncError as e:
                        err = f"{err + '; ' if err else ''}{e}"
                        bad = [rid for rid, a in acks.items() if rid != "__missing__" and not a.get("ok")]
                        ray.get(self.hub.drop.remote(acks["__missing__"]["ids"] + bad))
            err = _bcast(err)
            if err is None:
                self.last = stats
                return stats
            log.warning("push of version %d failed (attempt %d): %s", version, attempt + 1, err)
            if self.rank == 0 and self.group is not None:
                self.group.close()
                self.group = None
        raise SyncError(f"push of version {version} failed twice: {err}")


def train_worker(config: dict[str, Any]) -> None:
    """Entry point of every Ray Train worker (see app/driver.py for what `config` holds)."""
    import ray
    import ray.train
    from omegaconf import OmegaConf

    from app.rollouter import rollouter_name
    from app.serve_rollout import NAMESPACE, hub_name
    from app.tracking import Tracker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = OmegaConf.create(config["cfg"])
    model_path = config["model_path"]
    torch.manual_seed(cfg.train.seed)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.train.use_gpu else torch.device("cpu")
    torch.set_num_threads(max(1, int(cfg.train.worker_cpus)))
    learner = Learner(cfg, model_path, device)
    rank = learner.rank
    hub = ray.get_actor(hub_name(cfg.ray.name), namespace=NAMESPACE)
    rollouter = ray.get_actor(rollouter_name(cfg.ray.name), namespace=NAMESPACE)
    sync = TrainerSync(cfg, learner, hub, device)
    tracker = Tracker(config["tracking_uri"], config["run_id"]) if rank == 0 else None
    from app.metrics import trainer_metrics

    prom = trainer_metrics()
    t_out = cfg.train.timeout_s
    a = cfg.algorithm

    def fetch(ref: Any, what: str, slack: float = 0.0) -> Any:
        try:
            return ray.get(ref, timeout=t_out + slack)
        except ray.exceptions.GetTimeoutError:
            prog = ray.get(rollouter.progress.remote(), timeout=10)
            status = ray.get(hub.status.remote(), timeout=10)
            raise TimeoutError(
                f"waited train.timeout_s={t_out}s for {what}; rollouter={prog}; hub={status}"
            ) from None

    def log_val(res: dict[str, Any], version: int, step: int) -> float:
        tracker.metrics(
            {
                "val/reward": res["reward"],
                "val/version": version,
                "val/version_max": res.get("version_max", version),
                "timing/val_s": res["seconds"],
            },
            step,
        )
        tracker.table(res["table"], f"samples/val_v{version:05d}.json")
        prom.set("relay_val_reward", res["reward"])
        log.info("validation at version %d: reward %.3f over %d prompts", version, res["reward"], res["n"])
        return res["reward"]

    validated = {"version": -1}

    def validate(version: int, step: int) -> float:
        validated["version"] = version
        return log_val(fetch(rollouter.validate.remote(), f"validation of version {version}"), version, step)

    fully_async = a.mode == "fully_async"
    run_dir = Path(config["run_dir"])
    trained_log = run_dir / "trained_groups.jsonl"
    version, val_first, val_last = 0, None, None
    start, skipped_total, tokens_trained = 0, 0, 0
    # a checkpoint to continue from: after a worker failure Ray Train's latest, or a newer complete one in
    # this run's storage (one reported just before the failure may not have been registered yet); else
    # --resume's
    ckpt = ray.train.get_checkpoint()
    restored_from = None
    choice: dict[str, Any] = {}
    if rank == 0:  # decided once, by rank 0, for every rank
        restart = ray.get(hub.status.remote(), timeout=30)["version"] >= 0  # this run pushed: a restart
        found = checkpoint.newest(run_dir / "ray_train") if restart else None
        if ckpt is not None and found is not None:
            with ckpt.as_directory() as d:
                if json.loads(Path(d, checkpoint.STATE).read_text())["step"] >= found[0]:
                    found = None
        choice = {"restart": restart, "path": str(found[1]) if found else None}
    choice = _bcast(choice)
    restart = choice["restart"]
    if choice["path"]:
        ckpt, source = None, choice["path"]
    else:
        source = None if ckpt is not None else config.get("resume")
    with ckpt.as_directory() if ckpt is not None else _nullcontext(source) as ckpt_dir:
        if ckpt_dir:
            state = checkpoint.load(learner, Path(ckpt_dir), rank)
            version, start = state["version"], state["step"]
            val_first, val_last = state.get("val_first"), state.get("val_last")
            skipped_total, tokens_trained = state.get("skipped_total", 0), state.get("tokens_trained", 0)
            restored_from = {"path": str(ckpt_dir), "step": start, "version": version}
            if rank == 0:
                if restart:  # same run: forget what the failed workers trained after the checkpoint
                    dropped = checkpoint.truncate_log(trained_log, start)
                    log.warning(
                        "restored step %d from %s; %d trained-group records after it dropped",
                        start,
                        ckpt_dir,
                        dropped,
                    )
                got = ray.get(rollouter.restore.remote(state["pipeline"]), timeout=120)
                restored_from["pipeline"] = got
                tracker.metrics({"ckpt/restored_step": start, "ckpt/restored_partial": got["partial"]}, start)
        elif restart and rank == 0:  # restarted before any checkpoint: start the stream afresh
            checkpoint.truncate_log(trained_log, 0)
            ray.get(rollouter.restore.remote(EMPTY_PIPELINE), timeout=120)
            log.warning("restarted without a checkpoint: training starts over from version 0")
    sync.push(version)  # the replicas now hold exactly the trainer's weights, verified by checksum
    bar = None
    if rank == 0:
        if restored_from is None or val_last is None:
            val_first = val_last = validate(version, start)
        from ray.experimental.tqdm_ray import tqdm

        bar = tqdm(total=cfg.train.steps, desc="relay train")
        if start:
            bar.update(start)
        if fully_async:
            ray.get(rollouter.start_stream.remote(), timeout=60)
    dog = None
    if rank == 0:
        dog = Watchdog(
            cfg.train.stall_timeout_s,
            lambda: stall_report(rollouter, hub),
            run_dir / STALL_REPORT,
        ).start()

    def phase(what: str) -> None:
        if dog is not None:
            dog.phase(what)
            hub.beat.remote(
                {
                    "phase": what,
                    "step": dog.last_step,
                    "restored_step": restored_from["step"] if restored_from else None,
                }
            )

    def freeze() -> dict[str, Any]:
        """End the generations in flight, keeping them as partial rollouts (rank 0; at the end of a run)."""
        return ray.get(rollouter.snapshot.remote(True, cfg.sync.timeout_s), timeout=cfg.sync.timeout_s + 60)

    def save_checkpoint(
        step_no: int, freeze: bool, metrics: dict[str, Any], pipeline: dict[str, Any] | None = None
    ) -> str | None:
        """Every rank writes its shard; rank 0 adds the counters and the rollouter's snapshot."""
        phase(f"saving the checkpoint of step {step_no}")
        t0 = time.perf_counter()
        if rank == 0 and pipeline is None:
            pipeline = ray.get(
                rollouter.snapshot.remote(freeze, cfg.sync.timeout_s), timeout=cfg.sync.timeout_s + 60
            )
        tmp = Path(tempfile.mkdtemp(prefix=f"relay-ckpt-r{rank}-"))
        try:
            state = {
                "version": version,
                "step": step_no,
                "val_first": val_first,
                "val_last": val_last,
                "skipped_total": skipped_total,
                "tokens_trained": tokens_trained,
                "mode": a.mode,
                "world": learner.world,
            }
            checkpoint.save(learner, tmp, rank, state, pipeline)
            name = _bcast(f"step_{step_no:06d}_{int(time.time() * 1000)}")
            ray.train.report(
                metrics, checkpoint=ray.train.Checkpoint.from_directory(str(tmp)), checkpoint_dir_name=name
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if rank == 0:
            tracker.metrics(
                {
                    "ckpt/save_s": time.perf_counter() - t0,
                    "ckpt/queued_groups": len(pipeline["ready"]),
                    "ckpt/pending_prompts": len(pipeline["pending"]),
                    "ckpt/partial_groups": pipeline["partial_groups"],
                    "ckpt/partial_tokens": pipeline["partial_tokens"],
                },
                step_no,
            )
            log.info(
                "checkpoint of step %d saved in %.2fs: %d queued groups, %d prompts in flight (%d partial)",
                step_no,
                time.perf_counter() - t0,
                len(pipeline["ready"]),
                len(pipeline["pending"]),
                pipeline["partial_groups"],
            )
        return name

    pending = None
    val_pending: tuple[Any, int] | None = None  # fully_async: validation running beside training
    steps = cfg.train.steps
    stop: str | None = None
    done = start
    pushed = version
    t_run = time.perf_counter()
    t_loop_end = t_run  # end of the last step's push (benchmarks: trained tokens per second of the loop)
    for step in range(start, steps):
        t0 = time.perf_counter()
        batch = None
        phase(f"waiting for {cfg.train.batch_groups} finished groups for step {step + 1}")
        if rank == 0:
            if fully_async:
                batch = fetch(
                    rollouter.get_batch.remote(cfg.train.batch_groups, version, t_out),
                    f"{cfg.train.batch_groups} finished groups for step {step}",
                    slack=30.0,  # the rollouter's own deadline fires first, with its report
                )
            else:
                if pending is None:
                    pending = rollouter.generate_batch.remote(cfg.train.batch_groups)
                batch = fetch(pending, f"rollout batch {step}")
                pending = None
                if a.mode == "one_step_off" and step + 1 < steps:
                    pending = rollouter.generate_batch.remote(cfg.train.batch_groups)  # overlaps training
        t_wait = time.perf_counter() - t0
        stop = ray.get(hub.stop_reason.remote(), timeout=30) if rank == 0 else None
        if rank == 0 and not batch.groups:
            stop = "the training data is exhausted (data.epochs) and every group was trained"
        batch, stop = _bcast((batch, stop))
        if not batch.groups:
            log.info("stopping after %d steps: %s", done, stop)
            break
        t1 = time.perf_counter()
        phase(f"training step {step + 1}")
        stats = learner.step(batch)
        t_train = time.perf_counter() - t1
        if rank == 0:  # trained: these groups leave the checkpoint state
            rollouter.ack.remote([g.key for g in batch.groups])
        if stats["train/skipped_steps"]:
            skipped_total += 1
            bad = run_dir / "nonfinite" / f"step_{step + 1:06d}.json"
            if rank == 0:
                bad.parent.mkdir(parents=True, exist_ok=True)
                bad.write_text(
                    json.dumps(
                        {
                            "step": step + 1,
                            "grad_norm": stats["actor/grad_norm"],
                            "loss": stats["loss/policy"],
                            "uids": [g.uid for g in batch.groups],
                        }
                    )
                )
            log.warning(
                "step %d: non-finite loss or gradient, update skipped (%d so far); prompt ids in %s",
                step + 1,
                skipped_total,
                bad,
            )
            if skipped_total > cfg.train.max_skipped_steps:
                raise FloatingPointError(
                    f"{skipped_total} steps had a non-finite loss or gradient, over "
                    f"train.max_skipped_steps={cfg.train.max_skipped_steps}; the prompt ids of each such batch "
                    f"are in {bad.parent}. Lower train.lr, check the reward and data, or raise the limit"
                )
        stats["train/skipped_steps"] = float(skipped_total)
        if rank == 0 and pending is not None:
            ray.wait([pending], timeout=t_out)  # the push must not land in the middle of generation t+1
        t_overlap_wait = time.perf_counter() - t1 - t_train
        version += 1
        last = step + 1 == steps or bool(stop)
        push = None
        if not fully_async or (step + 1) % a.sync_every == 0 or last:
            phase(f"pushing version {version}")
            push = sync.push(version)
            pushed = version
            if rank == 0 and fully_async:
                ray.get(rollouter.on_push.remote(version), timeout=30)
        t_loop_end = time.perf_counter()
        tokens_trained += batch.num_tokens
        if rank == 0:
            m = {**stats, **batch_metrics(batch), **staleness(batch, version - 1), **batch.extra}
            step_s = time.perf_counter() - t0
            m.update(
                {
                    "timing/generate_s": batch.generate_s,
                    "timing/wait_rollout_s": t_wait + t_overlap_wait,
                    "timing/train_s": t_train,
                    "timing/step_s": step_s,
                    "async/trainer_idle_ratio": (t_wait + t_overlap_wait) / max(step_s, 1e-9),
                    "perf/gen_tokens_per_s": batch.num_tokens / max(batch.generate_s, 1e-9),
                    "perf/train_tokens_per_s": stats["train/tokens"] / max(t_train, 1e-9),
                    "weight/version": version,
                    "weight/pushed_version": pushed,
                }
            )
            if push is not None:
                pauses = [x.get("pause_s", 0.0) for x in push.extra.values()]
                m.update(
                    {
                        "sync/time_s": push.total_s + push.ack_s,
                        "sync/gather_s": push.gather_s,
                        "sync/transfer_s": push.transfer_s,
                        "sync/ack_s": push.ack_s,
                        "sync/pause_s": max(pauses, default=0.0),
                        "sync/bytes": float(push.nbytes),
                        "rollout/replicas": float(len(push.extra)),
                    }
                )
                joins = [x["join_s"] for x in push.extra.values() if "join_s" in x]
                if joins and step > 0:  # a replica admitted mid-run (the initial ones join at version 0)
                    m["rollout/join_s"] = max(joins)
            tracker.metrics(m, step + 1)
            with open(trained_log, "a") as f:  # accounting: every trained group, once, with its versions
                for g in batch.groups:
                    f.write(
                        json.dumps(
                            {
                                "uid": g.uid,
                                "step": step + 1,
                                "trained_at": version - 1,
                                "min_version": g.min_version,
                                "max_version": g.max_version,
                            }
                        )
                        + "\n"
                    )
            for k, name in (
                ("rollout/replicas", "relay_rollout_replicas"),
                ("weight/version", "relay_weight_version"),
                ("staleness/mean", "relay_staleness_mean"),
                ("staleness/max", "relay_staleness_max"),
                ("sync/time_s", "relay_sync_seconds"),
                ("reward/mean", "relay_reward_mean"),
                ("perf/gen_tokens_per_s", "relay_gen_tokens_per_s"),
                ("perf/train_tokens_per_s", "relay_train_tokens_per_s"),
                ("async/queue_depth", "relay_queue_depth"),
            ):
                if k in m:
                    prom.set(name, m[k])
            if fully_async:  # validation runs on the replicas beside the stream; logged when it lands
                if val_pending is not None and ray.wait([val_pending[0]], timeout=0)[0]:
                    val_last = log_val(ray.get(val_pending[0]), val_pending[1], step + 1)
                    val_pending = None
                if last:
                    if val_pending is not None:
                        val_last = log_val(fetch(val_pending[0], "validation"), val_pending[1], step + 1)
                        val_pending = None
                    val_last = validate(version, step + 1)
                elif (step + 1) % a.val_every == 0 and val_pending is None:
                    val_pending = (rollouter.validate.remote(), pushed)
            elif (step + 1) % a.val_every == 0 or last:
                val_last = validate(version, step + 1)
            bar.update(1)
            bar.set_description(f"relay v{version} reward {m['reward/mean']:.2f} val {val_last:.2f}")
            log.info(
                "step %d: reward %.3f loss %.4f gen %.2fs train %.2fs sync %.3fs staleness %.2f",
                step + 1,
                m["reward/mean"],
                m["loss/policy"],
                batch.generate_s,
                t_train,
                m.get("sync/time_s", 0.0),
                m["staleness/mean"],
            )
        done = step + 1
        if dog is not None:
            dog.step_done(done)
        if stop:
            log.warning("stopping cleanly after step %d of %d: %s", done, steps, stop)
            break
        if cfg.train.save_every and done % cfg.train.save_every == 0 and done < steps:
            save_checkpoint(done, False, {"step": done, "weight_version": version})
    phase("finishing: final push, validation and checkpoint")
    # first stop generating: in-flight groups are ended and kept as partial rollouts for the checkpoint
    frozen = freeze() if rank == 0 else None
    if rank == 0 and fully_async:
        ray.get(rollouter.stop_stream.remote(), timeout=30)
        if val_pending is not None:
            val_last = log_val(fetch(val_pending[0], "validation"), val_pending[1], done)
    if pushed != version:  # the data ran out between pushes: the replicas get the final weights too
        sync.push(version)
    if rank == 0 and validated["version"] != version:
        val_last = validate(version, done)
    final = str(run_dir / "final")
    learner.save_hf(final, model_path)
    if rank == 0:
        tracker.artifact(final, "final_checkpoint")
        if cfg.tracking.register_model:
            tracker.register("final_checkpoint", cfg.tracking.register_model)
        if trained_log.exists():
            tracker.artifact(str(trained_log))
        bar.close()
    summary = {
        "weight_version": version,
        "steps": done,
        "stopped": stop,
        "val_reward_first": val_first,
        "val_reward_last": val_last,
        "train_wall_s": time.perf_counter() - t_run,
        "loop_s": t_loop_end - t_run,
        "trained_tokens": tokens_trained,
        "final_checkpoint": str(Path(final).resolve()),
        "restored_from": restored_from,
    }
    # the whole pipeline, in-flight generations frozen as partial rollouts: `--resume` continues from here
    summary["checkpoint_name"] = save_checkpoint(done, True, summary, frozen)
    if dog is not None:
        dog.stop()
    if rank == 0:
        (run_dir / "summary.json").write_text(json.dumps(summary))
