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
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from app.sync import PushStats, SyncError, check_acks, free_port, plan_buckets, resolve_backend, send_buckets
from app.train_loop import Learner, batch_metrics, staleness

log = logging.getLogger("app.train")


def _bcast(obj: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
    trained_log = Path(config["run_dir"], "trained_groups.jsonl")
    version, val_first, val_last = 0, None, None
    sync.push(version)  # the replicas now hold exactly the trainer's weights, verified by checksum
    bar = None
    if rank == 0:
        val_first = val_last = validate(version, 0)
        from ray.experimental.tqdm_ray import tqdm

        bar = tqdm(total=cfg.train.steps, desc="relay train")
        if fully_async:
            ray.get(rollouter.start_stream.remote(), timeout=60)
    pending = None
    val_pending: tuple[Any, int] | None = None  # fully_async: validation running beside training
    steps = cfg.train.steps
    stop: str | None = None
    done = 0
    pushed = 0
    t_run = time.perf_counter()
    t_loop_end = t_run  # end of the last step's push (benchmarks: trained tokens per second of the loop)
    tokens_trained = 0
    for step in range(steps):
        t0 = time.perf_counter()
        batch = None
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
        stats = learner.step(batch)
        t_train = time.perf_counter() - t1
        if rank == 0 and pending is not None:
            ray.wait([pending], timeout=t_out)  # the push must not land in the middle of generation t+1
        t_overlap_wait = time.perf_counter() - t1 - t_train
        version += 1
        last = step + 1 == steps or bool(stop)
        push = None
        if not fully_async or (step + 1) % a.sync_every == 0 or last:
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
        if stop:
            log.warning("stopping cleanly after step %d of %d: %s", done, steps, stop)
            break
    if rank == 0 and fully_async:
        ray.get(rollouter.stop_stream.remote(), timeout=30)
        if val_pending is not None:
            val_last = log_val(fetch(val_pending[0], "validation"), val_pending[1], done)
    if pushed != version:  # the data ran out between pushes: the replicas get the final weights too
        sync.push(version)
    if rank == 0 and validated["version"] != version:
        val_last = validate(version, done)
    final = os.path.join(config["run_dir"], "final")
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
    }
    if rank == 0:
        Path(config["run_dir"], "summary.json").write_text(json.dumps(summary))
    ray.train.report(summary)
