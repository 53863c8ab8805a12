"""`python -m app eval`: mean@n and pass@k per data source of a checkpoint on a prompt file.

weights   `eval.checkpoint` (app/evaluation/checkpoints.py): an HF folder, a run directory or a checkpoint;
          a sharded checkpoint is exported to an HF folder in the evaluation's folder first. None given:
          `model.path`.
settings  a run's checkpoint brings the run's config (reward function, lengths, model dtype) unless
          `--config` is given; `key=value` overrides apply on top, as for `train`
generate  `eval.n` samples of every prompt of `eval.data` (else `data.val`), scored by the reward function
          as in validation, where `eval.engine` says (`engine`):
            local    one vLLM engine in this process, no Ray (app/evaluation/local.py): the default on one
                     machine
            cluster  the rollout deployment and the rollouter of training (app/driver.py), named
                     `<ray.name>-eval` so a training run on the same cluster keeps its own
report    `<run_dir>/<eval run>/generations.jsonl` (one line per sample) and `scores.json` (the scores per
          source, the reward's sub-scores, pass@k per prompt), an MLflow run
          (`eval/<source>/mean_at_4`, `eval/<source>/pass_at_1`, ...) and the RESULT record, whose scores
          carry the same names (`mean_at_4`, `pass_at_1`)
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from app.config import ALL_KEYS, ConfigError, ConfigFiles
from app.evaluation import checkpoints, local
from app.evaluation.checkpoints import Weights
from app.evaluation.scores import ALL, PromptRewards, metric_items, per_prompt, score, sub_score_means
from app.preflight import load_config
from app.records import Group

log = logging.getLogger("app.eval")

GENERATIONS = "generations.jsonl"
SCORES = "scores.json"
# a run's settings that belong to that run, not to an evaluation of its weights
NOT_INHERITED = (
    "train.resume",
    "tracking.run_name",
    "tracking.register_model",
    "ray.address",  # where the run was hosted: an evaluation runs where it is started (or RAY_ADDRESS)
    "eval.engine",
    "eval.checkpoint",
    "eval.data",
)


def load(config_file: ConfigFiles, overrides: list[str]) -> DictConfig:
    """The evaluation's config: defaults < `config_file` (else, for a Relay run's weights, that run's config)
    < `overrides`. Raises ConfigError naming the key and the fix."""
    cfg = _load(config_file, overrides)
    engine(cfg)  # `eval.engine=local` with an environment that needs Serve: refused here
    return cfg


def _load(config_file: ConfigFiles, overrides: list[str]) -> DictConfig:
    cfg = load_config(config_file, overrides)
    found = checkpoints.run_config(cfg.eval.checkpoint) if cfg.eval.checkpoint and not config_file else None
    if found is None:
        if cfg.eval.checkpoint and checkpoints.is_hf_folder(Path(cfg.eval.checkpoint).expanduser()):
            # weights no Relay run wrote are the model of this evaluation: held to the settings a run of that
            # model is held to (the toy default's lengths, dtype and CPUs are refused, naming the presets)
            load_config(config_file, [*overrides, f"model.path={Path(cfg.eval.checkpoint).expanduser()}"])
        return cfg
    saved, where = found
    with tempfile.TemporaryDirectory(prefix="relay-eval-") as tmp:
        path = Path(tmp, "run-config.yaml")
        path.write_text(yaml.safe_dump(_inherited(saved)))
        try:
            cfg = load_config(str(path), overrides)
        except ConfigError as e:
            raise ConfigError(
                f"{e}: in the settings of the run that wrote {cfg.eval.checkpoint} ({where}); override the key, "
                "or give --config FILE to evaluate with other settings"
            ) from None
    log.info("settings of the run that wrote the weights: %s (--config FILE replaces them)", where)
    return cfg


def _inherited(saved: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The keys of a run's config that this version knows, less those that belong to the run itself."""
    out: dict[str, Any] = {}
    for k, v in saved.items():
        key = f"{prefix}{k}"
        if key not in ALL_KEYS or key in NOT_INHERITED:
            continue
        if isinstance(v, dict) and any(a.startswith(key + ".") for a in ALL_KEYS):
            out[k] = _inherited(v, key + ".")
        else:
            out[k] = v
    return out


def engine(cfg: DictConfig) -> str:
    """Where this evaluation generates: `eval.engine`, with `auto` resolved (`local` unless `ray.address` or
    RAY_ADDRESS names a cluster, or `env.name` needs Serve). Raises ConfigError for `local` with an
    environment that needs Serve."""
    serve_env = _needs_serve(cfg.env.name)
    if cfg.eval.engine == "local" and serve_env:
        raise ConfigError(
            f"eval.engine=local: env.name={cfg.env.name} needs Ray Serve (its environments talk to the "
            "rollout through a served endpoint); use eval.engine=cluster (or auto)"
        )
    if cfg.eval.engine != "auto":
        return str(cfg.eval.engine)
    return "cluster" if cfg.ray.address or os.environ.get("RAY_ADDRESS") or serve_env else "local"


def _needs_serve(env_name: str) -> bool:
    """The environment kind deploys services beside the rollout deployment (app/envs/base.py `EnvKind`)."""
    from app.envs import env_kind
    from app.envs.base import EnvKind

    kind = type(env_kind(env_name))
    return kind.deploy is not EnvKind.deploy or kind.before_serve is not EnvKind.before_serve


def run(cfg: DictConfig) -> dict[str, Any]:
    """One evaluation (see the module docstring); returns the RESULT record, raises where it failed."""
    from app.driver import Inputs, check_machine, resolve_inputs, start_ray, teardown
    from app.run_folder import open_run

    t0 = time.time()
    where = engine(cfg)
    check_machine(cfg)
    weights = checkpoints.locate(cfg.eval.checkpoint) if cfg.eval.checkpoint else None
    cfg = _settings(cfg, weights)
    if where == "local":
        cfg = local.settings(cfg)
    inputs = resolve_inputs(cfg)  # the model (built-in ones built), the prompt file checked: before Ray
    rec = open_run(cfg, None)
    status = "FAILED"
    started = False
    try:
        model = inputs.model_path
        if weights is not None and not weights.hf:  # a sharded checkpoint of a run of that model
            model = str(checkpoints.export_hf(weights.path, model, rec.dir / "model", cfg.model.dtype))
        log.info("eval.engine=%s: generating %s", cfg.eval.engine, _ENGINES[where])
        if where == "local":
            groups = local.generate(cfg, model, inputs.val, inputs.columns)
        else:
            started = start_ray(cfg)
            groups = _generate(cfg, Inputs(model, [], inputs.val, inputs.columns))
        what = weights.what if weights is not None else "model.path"
        out = _report(cfg, rec, groups, {"model": model, "weights": what, "data": inputs.val})
        out["wall_s"] = round(time.time() - t0, 1)
        status = "FINISHED"
        return out
    finally:
        rec.close(status)
        if where == "cluster" and (started or _ray_up()):
            teardown(cfg, started)


_ENGINES = {
    "local": "with one vLLM engine in this process (no Ray)",
    "cluster": "on the rollout deployment (Ray Serve)",
}


def _ray_up() -> bool:
    import ray

    return ray.is_initialized()


def _settings(cfg: DictConfig, weights: Weights | None) -> DictConfig:
    """The config of this evaluation: its own run name and Ray names, every prompt of the file read (as
    `data.val`), the weights as `model.path` where they are an HF folder, and no resources for what only
    training uses (the trainer, reference workers, a weight group): the start-up checks count only what runs."""
    from app.infra.run_lock import new_run_name

    spec = cfg.eval.data or cfg.data.val
    new: dict[str, Any] = {
        "data": {"train": spec, "val": spec, "val_size": 0},
        "tracking": {"run_name": cfg.tracking.run_name or new_run_name().replace("relay-", "eval-", 1)},
        "ray": {"name": f"{cfg.ray.name}-eval"},
        "train": {"use_gpu": False, "worker_cpus": 0},
        "resources": {"train_gpus": 0, "train_cpus": 0, "ref_gpus": 0, "ref_cpus": 0},
        "ref": {"workers": 0},
        "sync": {"transport": "broadcast", "backend": "gloo"},
    }
    if weights is not None and weights.hf:
        new["model"] = {"path": str(weights.path)}
    return OmegaConf.merge(cfg, new)  # type: ignore[return-value]


def _generate(cfg: DictConfig, inputs: Any) -> list[Group]:
    """`eval.n` scored samples of every prompt, on the rollout deployment training uses."""
    import ray

    from app.driver import start_roles
    from app.names import app_name
    from app.rollout.start_watch import RolloutStartWatch

    watch = RolloutStartWatch(app_name(cfg.ray.name))
    roles = start_roles(cfg, inputs, watch)  # (the handles must live while the actors work)
    cfg, rollouter = roles[0], roles[3]
    watch.wait(cfg.rollout.join_timeout_s)
    log.info("generating %d samples per prompt of %s", cfg.eval.n, inputs.val)
    ref = rollouter.evaluate.remote(cfg.eval.n, cfg.eval.temperature, cfg.seed)
    deadline = time.monotonic() + cfg.eval.timeout_s
    while not ray.wait([ref], timeout=1.0)[0]:
        if time.monotonic() > deadline:
            ray.cancel(ref)
            raise local.timed_out(cfg.eval.timeout_s)
    return ray.get(ref)


def _report(cfg: DictConfig, rec: Any, groups: list[Group], where: dict[str, str]) -> dict[str, Any]:
    """generations.jsonl, scores.json and the MLflow run's metrics; the RESULT record."""
    rows = [sample_row(g, i) for g in groups for i in range(len(g.samples))]
    gen_path = rec.dir / GENERATIONS
    gen_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    scores = score(
        [PromptRewards(g.data_source, [s.reward for s in g.samples]) for g in groups],
        list(cfg.eval.k),
        cfg.eval.pass_threshold,
    )
    errors = sum(1 for r in rows if r["reward_error"])
    subs = sub_score_means(s.reward_extras for g in groups for s in g.samples)  # e.g. strict, flexible
    problems = per_prompt(
        [(g.uid, [s.reward for s in g.samples]) for g in groups], list(cfg.eval.k), cfg.eval.pass_threshold
    )
    record = {"scores": scores, "sub_scores": subs, "per_prompt": problems, **where}
    (rec.dir / SCORES).write_text(json.dumps(record, indent=1))
    rec.tracker.tags({"relay.kind": "eval", "relay.weights": where["weights"], "relay.model": where["model"]})
    metrics = {**metric_items(scores, "eval"), **{f"eval/sub/{k}": v for k, v in subs.items()}}
    rec.tracker.metrics({**metrics, "eval/reward_errors": float(errors)}, 0)
    rec.tracker.artifact(str(gen_path))
    rec.tracker.artifact(str(rec.dir / SCORES))
    for src, values in scores.items():
        log.info("%s: %s", src, ", ".join(f"{k} {v:.4g}" for k, v in values.items()))
    if errors:
        log.warning(
            "%d of %d samples' rewards failed (scored reward.on_error); see %s", errors, len(rows), gen_path
        )
    return {
        "run_id": rec.tracker.run_id,
        "tracking_uri": rec.uri,
        **where,
        "n": cfg.eval.n,
        "k": list(cfg.eval.k),
        "prompts": int(scores.get(ALL, {}).get("prompts", 0)),
        "scores": scores,
        "sub_scores": subs,
        "reward_errors": errors,
        "generations": str(gen_path),
    }


def sample_row(g: Group, i: int) -> dict[str, Any]:
    """One line of generations.jsonl: the prompt, the i-th sample's response and its reward."""
    s = g.samples[i]
    return {
        "uid": g.uid,
        "data_source": g.data_source,
        "sample": i,
        "prompt": g.prompt_text,
        "answer": g.answer,
        "response": s.text,
        "reward": s.reward,
        "reward_error": s.reward_error,
        "reward_extras": s.reward_extras,
        "finish_reason": s.finish_reason,
        "response_tokens": len(s.token_ids),
    }
