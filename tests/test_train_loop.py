"""Trainer pieces without Ray: batch layout, one-process learning, and FSDP2 over two gloo processes."""

import math
import multiprocessing as mp
import os

import pytest
import torch

from app.config import load_config
from app.records import Batch, Group, Sample
from app.tasks import tiny
from app.trainer.batch_metrics import staleness
from app.trainer.batch_tensors import collate, flatten_batch
from app.trainer.learner import Learner


def _batch(answer_tok: int, wrong_tok: int, eos: int, prompt: list[int], groups: int = 4) -> Batch:
    gs = []
    for g in range(groups):
        samples = [
            _sample([answer_tok, eos], [-2.0, -0.1], 1.0),
            _sample([wrong_tok, eos], [-1.0, -0.1], 0.0),
            _sample([wrong_tok, eos], [-1.0, -0.1], 0.0),
            _sample([answer_tok, eos], [-2.0, -0.1], 1.0),
        ]
        gs.append(Group(uid=f"g{g}", prompt_ids=prompt, answer="x", samples=samples))
    return Batch(groups=gs)


def _sample(ids: list[int], lps: list[float], reward: float, versions: list[int] | None = None) -> Sample:
    return Sample(
        token_ids=ids,
        logprobs=lps,
        versions=versions if versions is not None else [0] * len(ids),
        finish_reason="stop",
        reward=reward,
    )


def test_flatten_and_collate_alignment():
    samples = [
        _sample([8, 9], [-0.5, -0.25], 1.0, versions=[3, 3]),
        Sample(token_ids=[4], logprobs=[-1.5], versions=[2], finish_reason="length", reward=0.0),
    ]
    b = Batch(groups=[Group(uid="g", prompt_ids=[5, 6, 7], answer="a", samples=samples)])
    rows = flatten_batch(b, normalize_std=True)
    assert [r.advantage for r in rows] == pytest.approx([1.0, -1.0], abs=1e-5)
    mb = collate(rows, pad_id=0, device=torch.device("cpu"))
    assert mb["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 4, 0]]
    # position t predicts token t+1: response tokens sit at positions 2.. of the targets
    assert mb["targets"][0].tolist() == [6, 7, 8, 9]
    assert mb["mask"].tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]
    assert mb["old"][0].tolist() == [0, 0, -0.5, -0.25]
    assert mb["adv"][1, 2].item() == pytest.approx(-1.0, abs=1e-5)
    st = staleness(b, 4)
    assert st["staleness/mean"] == pytest.approx((1 + 1 + 2) / 3) and st["staleness/max"] == 2.0
    # deciles by response length (two samples: the 1-token one, then the 2-token one)
    assert st["staleness/len_decile_0"] == 2.0 and st["staleness/len_decile_1"] == 1.0
    assert st["async/partial_ratio"] == 1.0 and st["async/max_version_span"] == 1.0  # versions 2..3


def _setup(tmp_path):
    root = tiny.ensure_builtin(tmp_path / "cache", warmup_steps=5)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root / "model")
    prompt = tok.encode("max:3815=", add_special_tokens=False)
    return str(root / "model"), tok, prompt


def test_single_process_step_raises_rewarded_logprob(tmp_path):
    path, tok, prompt = _setup(tmp_path)
    eight, one = tok.convert_tokens_to_ids("8"), tok.convert_tokens_to_ids("1")
    cfg = load_config(None, ["train.lr=0.01", "train.micro_batch_size=4"])
    learner = Learner(cfg, path, torch.device("cpu"))
    before = learner.logprobs_of(prompt, [eight])[0]
    for _ in range(3):
        m = learner.step(_batch(eight, one, tok.eos_token_id, prompt))
    after = learner.logprobs_of(prompt, [eight])[0]
    assert after > before + 0.1
    assert m["actor/grad_norm"] > 0 and 0 <= m["actor/clip_frac"] <= 1


def test_off_policy_corrections_weight_stale_tokens(tmp_path):
    """Behaviour log-probs far below the trainer's (stale samples): `none` clips the ratio (no gradient on
    rewarded tokens whose ratio is past 1 + clip_high), `tis` weights by min(pi/mu, cap), `decoupled`
    uncapped; with on-policy behaviour log-probs all three give the same step."""
    path, tok, prompt = _setup(tmp_path)
    eight, one = tok.convert_tokens_to_ids("8"), tok.convert_tokens_to_ids("1")
    out = {}
    for corr in ("none", "tis", "decoupled"):
        cfg = load_config(None, ["train.micro_batch_size=4", f"algorithm.correction={corr}"])
        learner = Learner(cfg, path, torch.device("cpu"))
        on = _batch(eight, one, tok.eos_token_id, prompt)
        for g in on.groups:  # on-policy: behaviour log-probs = the trainer's own
            for smp in g.samples:
                smp.logprobs = learner.logprobs_of(prompt, smp.token_ids)
        stale = _batch(eight, one, tok.eos_token_id, prompt)
        for g in stale.groups:  # behaviour policy much less likely (log-prob 3 below): weight e^3 ~ 20
            for smp in g.samples:
                smp.logprobs = [lp - 3.0 for lp in learner.logprobs_of(prompt, smp.token_ids)]
        lr0 = learner.opt.param_groups[0]["lr"]
        learner.opt.param_groups[0]["lr"] = 0.0  # measure, do not move
        out[corr] = (learner.step(on), learner.step(stale))
        learner.opt.param_groups[0]["lr"] = lr0
    for corr in ("tis", "decoupled"):
        assert out[corr][0]["loss/policy"] == pytest.approx(out["none"][0]["loss/policy"], abs=1e-6)
        assert out[corr][0]["actor/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert out["none"][1]["actor/clip_frac"] > 0.4  # stale positive-advantage tokens are clipped
    assert out["tis"][1]["actor/is_weight_max"] == pytest.approx(2.0)  # capped at algorithm.is_cap
    assert out["decoupled"][1]["actor/is_weight_max"] == pytest.approx(math.exp(3.0), rel=1e-3)
    assert out["tis"][1]["actor/clip_frac"] == 0.0  # clipped against the trainer's own policy instead


def _fsdp_worker(
    rank: int, port: int, path: str, prompt: list[int], toks: tuple[int, int, int], extra: list[str], q
) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=__import__("datetime").timedelta(seconds=60)
    )
    try:
        cfg = load_config(
            None, ["train.lr=0.01", "train.micro_batch_size=2", "algorithm.kl_coef=0.1", *extra]
        )
        learner = Learner(cfg, path, torch.device("cpu"))
        before = learner.logprobs_of(prompt, [toks[0]])[0]
        metrics = [learner.step(_batch(toks[0], toks[1], toks[2], prompt, groups=3)) for _ in range(3)]
        after = learner.logprobs_of(prompt, [toks[0]])[0]
        names = [spec[0] for spec in learner.push_specs()]
        full = learner.gather(names)
        q.put((rank, before, after, metrics[-1], {n: float(t.double().sum()) for n, t in zip(names, full)}))
    finally:
        dist.destroy_process_group()


def _two_ranks(target, *args) -> list:
    """Run `target(rank, port, *args, queue)` in two spawned processes (one gloo group); each puts one
    result tuple starting with its rank. Returns them sorted by rank; fails on a crash or after 180 s."""
    import time

    from app.weights.group import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = []
    try:
        deadline = time.monotonic() + 180
        while len(results) < 2 and time.monotonic() < deadline:
            try:
                results.append(q.get(timeout=1))
            except Exception:
                assert all(p.is_alive() or p.exitcode == 0 for p in procs), "a worker process crashed"
        assert len(results) == 2, "the two worker processes did not finish within 180s"
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return sorted(results, key=lambda r: r[0])


@pytest.mark.parametrize(
    "extra",
    # PPO mini-batches of 2 and 1 groups: the proximal pass and both updates run the same passes on each rank
    [[], ["algorithm.ppo_mini_batch_size=2", "algorithm.correction=tis"]],
    ids=["one_update", "mini_batches"],
)
def test_fsdp2_two_ranks_gloo(tmp_path, extra):
    path, tok, prompt = _setup(tmp_path)
    toks = (tok.convert_tokens_to_ids("8"), tok.convert_tokens_to_ids("1"), tok.eos_token_id)
    results = _two_ranks(_fsdp_worker, path, prompt, toks, extra)
    (_, b0, a0, m0, full0), (_, b1, a1, m1, full1) = results
    assert m0["actor/optimizer_steps"] == (2.0 if extra else 1.0)
    assert a0 > b0 + 0.1 and a0 == pytest.approx(a1)  # both ranks see the same updated model
    assert m0["loss/kl"] > 0 and m0 == m1  # metrics are all-reduced
    assert full0 == full1  # every rank gathers the same full tensors


def test_fsdp2_two_ranks_keeping_gathered_params_trains_as_gathering_per_micro_batch(tmp_path):
    """`train.gather_once=params` (the gathered layers kept through the step's micro-batches, gradients still
    reduce-scattered after each) takes the same steps as a gather and a reduce-scatter per micro-batch."""
    path, tok, prompt = _setup(tmp_path)
    toks = (tok.convert_tokens_to_ids("8"), tok.convert_tokens_to_ids("1"), tok.eos_token_id)
    runs = {
        m: _two_ranks(_fsdp_worker, path, prompt, toks, [f"train.gather_once={m}"]) for m in ("off", "params")
    }
    (_, b_off, a_off, m_off, full_off), _ = runs["off"]
    (_, b_par, a_par, m_par, full_par), (_, _, a_par1, _, full_par1) = runs["params"]
    assert b_par == pytest.approx(b_off) and a_par == pytest.approx(a_off, abs=1e-5) and a_par1 == a_par
    assert a_off > b_off + 0.1  # the steps moved the model
    assert m_par["loss/policy"] == pytest.approx(m_off["loss/policy"], abs=1e-5)
    # the key projection's bias has no gradient but rounding noise (softmax ignores a shift of every key), which
    # AdamW turns into steps of its own: the two reduction orders move it differently, so it is left out
    moved = {n: v for n, v in full_off.items() if not n.endswith("k_proj.bias")}
    assert full_par == full_par1 and {n: full_par[n] for n in moved} == pytest.approx(
        moved, rel=1e-5, abs=1e-5
    )


def test_nonfinite_step_is_skipped(tmp_path):
    path, tok, prompt = _setup(tmp_path)
    eight, one = tok.convert_tokens_to_ids("8"), tok.convert_tokens_to_ids("1")
    learner = Learner(load_config(None, ["train.micro_batch_size=4"]), path, torch.device("cpu"))
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    bad = _batch(eight, one, tok.eos_token_id, prompt)
    bad.groups[0].samples[0].reward = float("inf")  # an inf reward poisons the advantages and the loss
    m = learner.step(bad)
    assert m["train/skipped_steps"] == 1.0 and not math.isfinite(m["actor/grad_norm"])
    assert all(torch.equal(before[n], p) for n, p in learner.model.named_parameters())  # no update
    assert learner.step(_batch(eight, one, tok.eos_token_id, prompt))["train/skipped_steps"] == 0.0


def _ckpt_worker(rank: int, port: int, path: str, prompt: list[int], toks, root: str, q) -> None:
    """Train 2 steps, save (each rank into its own folder, merged as Ray Train does), load into a fresh
    learner, then take the same next step with both: identical results."""
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    from app.trainer import checkpoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=__import__("datetime").timedelta(seconds=60)
    )
    try:
        cfg = load_config(None, ["train.lr=0.01", "train.micro_batch_size=2", "train.warmup_steps=5"])
        batch = _batch(toks[0], toks[1], toks[2], prompt, groups=3)
        learner = Learner(cfg, path, torch.device("cpu"))
        for _ in range(2):
            learner.step(batch)
        mine = Path(root, f"rank{rank}")
        checkpoint.save(learner, mine, rank, {"version": 2, "step": 2}, {"ready": []} if rank == 0 else None)
        dist.barrier()
        if rank == 0:
            for r in range(2):
                shutil.copytree(Path(root, f"rank{r}"), Path(root, "merged"), dirs_exist_ok=True)
        dist.barrier()
        torch.manual_seed(1234)  # the restore must bring the RNG back too
        fresh = Learner(cfg, path, torch.device("cpu"))
        state = checkpoint.load(fresh, Path(root, "merged"), rank)
        a, b = learner.step(batch), fresh.step(batch)
        la = learner.logprobs_of(prompt, [toks[0]])[0]
        lb = fresh.logprobs_of(prompt, [toks[0]])[0]
        q.put((rank, state["step"], state["pipeline"], a, b, la, lb))
    finally:
        dist.destroy_process_group()


def test_checkpoint_roundtrip_two_ranks(tmp_path):
    path, tok, prompt = _setup(tmp_path)
    toks = (tok.convert_tokens_to_ids("8"), tok.convert_tokens_to_ids("1"), tok.eos_token_id)
    results = _two_ranks(_ckpt_worker, path, prompt, toks, str(tmp_path / "ckpt"))
    for _rank, step, pipeline, a, b, la, lb in results:
        assert step == 2 and pipeline == {"ready": []}
        assert a["actor/lr"] == b["actor/lr"] == pytest.approx(0.01 * 4 / 5)  # scheduler restored
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], abs=1e-6)
        assert la == pytest.approx(lb, abs=1e-6)  # model and optimizer (Adam moments) restored
