"""`python -m app eval` without Ray (app/evaluation/local.py, app/vllm/replica_engine.py): which path an evaluation
takes, the local path's settings, its generation through the rollout's group generator (the vLLM call replaced
by a fake that answers per seed: no Ray, no vLLM), and the stop of the engine's processes by pid. The whole local
path runs in tests/integration/test_eval.py."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import psutil
import pytest
import yaml

from app.__main__ import main
from app.config import ConfigError, load_config, typed
from app.evaluation import command, local
from app.records import Prompt
from app.rewards import RewardResult
from app.rollout.generator import GroupGenerator
from app.vllm import engine as vla
from app.vllm import replica_engine


def test_one_machine_evaluates_in_process_and_a_cluster_address_on_the_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert load_config(None, []).eval.engine == "auto"
    assert command.engine(load_config(None, [])) == "local"
    assert command.engine(load_config(None, ["ray.address=10.0.0.9:6379"])) == "cluster"
    assert command.engine(load_config(None, ["eval.engine=cluster"])) == "cluster"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")
    assert command.engine(load_config(None, [])) == "cluster"
    assert command.engine(load_config(None, ["eval.engine=local"])) == "local"
    with pytest.raises(ConfigError, match="eval.engine"):
        load_config(None, ["eval.engine=ray"])


def test_an_environment_that_needs_serve_evaluates_on_the_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert command.engine(load_config("calc_agent", [])) == "cluster"  # the OpenAI endpoint is a Serve app
    assert command.engine(load_config("code_feedback", [])) == "local"  # its environments need no service
    with pytest.raises(ConfigError, match=r"eval.engine=local: env.name=openai_agent needs Ray Serve"):
        command.load("calc_agent", ["eval.engine=local"])


def test_a_runs_engine_choice_stays_with_the_run(tmp_path):
    from omegaconf import OmegaConf

    run = tmp_path / "r1"
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml(load_config(None, ["eval.engine=cluster"])))
    (run / "run_identity.json").write_text("{}")
    assert command.load(None, [f"eval.checkpoint={run}"]).eval.engine == "auto"


def test_print_config_prints_the_evaluations_config_and_starts_nothing(capsys):
    assert main(["eval", "--print-config", "eval.n=2", "eval.engine=local"]) == 0
    out = capsys.readouterr().out
    printed = yaml.safe_load(out)
    assert printed["eval"]["n"] == 2 and printed["eval"]["engine"] == "local"
    assert not any(line.startswith("RESULT ") for line in out.splitlines())


def test_the_local_path_scores_in_this_process_with_the_shares_of_this_machine():
    cfg = load_config(None, ["reward.workers=2", "resources.rollout_cpus=4", "ray.num_cpus=8"])
    out = local.settings(cfg)
    assert out.reward.workers == 0  # reward workers are Ray actors
    assert out.rollout.replica_cpus == 4 / cfg.rollout.max_replicas  # as a local Ray cluster resolves it


def test_a_replica_and_the_local_engine_take_one_set_of_engine_settings():
    cfg = load_config(None, ["seed=3", "rollout.max_num_seqs=16", "rollout.kv_cache_gib=2"])
    args = replica_engine.engine_args(cfg)
    assert (args["seed"], args["max_num_seqs"], args["use_gpu"]) == (3, 16, False)
    assert args["dtype"] == cfg.model.dtype
    assert args["max_model_len"] == cfg.rollout.max_model_len and args["lora_rank"] == cfg.model.lora.rank
    env = replica_engine.engine_env(cfg)  # a CPU engine: its KV space, one worker in the engine core, no GPU
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert replica_engine.engine_env(load_config(None, ["rollout.replica_gpus=1"])) == {}


class _FakeEngine:
    """Stands in for vLLM's sampling: a sample's one token is its seed (or 0 unseeded); it records what ran
    at once."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int | None]] = []
        self.running = self.most = 0

    async def generate(self, engine, prompt_ids, *, n, seed=None, version, **kwargs):
        self.calls.append((n, seed))
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(0.01)
        self.running -= 1
        tok = seed if seed is not None else 0
        return [
            {"token_ids": [tok], "logprobs": [-0.5], "finish_reason": "stop", "versions": [version]}
            for _ in range(n)
        ]


def test_a_seeded_request_for_n_samples_runs_as_n_seeded_engine_requests(monkeypatch):
    from app.records import GenerateRequest

    fake = _FakeEngine()
    monkeypatch.setattr(vla, "generate", fake.generate)
    req = GenerateRequest(prompt_ids=[1], max_tokens=4, n=3, seed=10)
    seeded = asyncio.run(replica_engine.generate_request(None, req, 2))
    assert fake.calls == [(1, 10), (1, 11), (1, 12)]
    assert [s["token_ids"] for s in seeded] == [[10], [11], [12]] and seeded[0]["versions"] == [2]
    fake.calls.clear()
    asyncio.run(replica_engine.generate_request(None, GenerateRequest(prompt_ids=[1], max_tokens=4, n=3), 2))
    assert fake.calls == [(3, None)]


def test_the_local_path_generates_every_prompt_seeded_as_validation_and_scores_each_sample(monkeypatch):
    fake = _FakeEngine()
    monkeypatch.setattr(vla, "generate", fake.generate)
    cfg = typed(load_config(None, ["rollout.max_tokens=4"]))

    async def score(inp):
        return RewardResult(1.0 if inp.response == "11" else 0.0)

    gen = GroupGenerator(
        local.EngineGenerate(None), lambda ids: " ".join(map(str, ids)), score, cfg.rollout,
        reward=cfg.reward, seed=cfg.seed,
    )  # fmt: skip
    prompts = [Prompt(uid=f"u{i}", prompt_ids=[1, 2], answer="x", data_source="arith") for i in range(3)]
    groups = asyncio.run(local.all_groups(gen, prompts, 4, 1.0, 10, max_num_seqs=2))
    assert [g.uid for g in groups] == ["u0", "u1", "u2"]
    for g in groups:  # sample i of every prompt seeded seed + i, as the rollouter's `evaluate` seeds them
        assert [s.token_ids for s in g.samples] == [[10], [11], [12], [13]]
        assert [s.reward for s in g.samples] == [0.0, 1.0, 0.0, 0.0] and g.samples[0].replica == "local"
    assert fake.most == 4  # 2 x max_num_seqs samples at once: one group of 4 at a time


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_the_engines_processes_are_recorded_also_when_its_start_fails_and_killed_by_pid(monkeypatch):
    started: list[subprocess.Popen] = []

    def failing_engine(*args, **kwargs):
        started.append(_sleeper())  # an engine core that came up before the start failed
        raise RuntimeError("engine start failed")

    monkeypatch.setattr(vla, "create_engine", failing_engine)
    procs: list = []
    with pytest.raises(RuntimeError, match="engine start failed"):
        local.start_engine(load_config(None, []), "/m", procs)
    assert [p.pid for p in procs] == [started[0].pid]
    local.kill(procs, grace_s=0.2)
    assert not psutil.pid_exists(started[0].pid)  # killed and reaped
    local.kill(procs, grace_s=0.2)  # gone already: nothing to do


def test_sigterm_interrupts_the_local_evaluation_so_that_its_engine_is_stopped():
    before = signal.getsignal(signal.SIGTERM)
    restore = local._interrupt_on_sigterm()
    try:
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) is before
