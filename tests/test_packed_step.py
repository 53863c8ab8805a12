"""Issue 15's equivalence: chunked log-probs and packed micro-batches against the reference step.

The reference step is the padded one with full float32 logits (`train.micro_batch_tokens=0`,
`train.logprob_chunk_tokens=0`); on CPU in float32 the packed, chunked step must give the same loss, metrics
and gradients to 1e-5, in every loss aggregation mode, with an in-trainer reference (KL) and under FSDP2, on
every packable architecture (Llama, Mistral, Qwen2, Qwen3); any other architecture trains padded.
"""

import itertools
import math
import multiprocessing as mp
import os

import pytest
import torch

from app.config import load_config
from app.records import Batch, Group, Sample
from app.trainer import grpo
from app.trainer.batch_tensors import Row, collate, row_values
from app.trainer.learner import Learner
from app.trainer.logprobs import response_logprobs, scored_logprobs
from app.trainer.packing import collate_packed, plan_micro_batches

VOCAB = 40


# ---------------------------------------------------------------- chunked log-probs


def test_chunked_logprobs_hand_values():
    # hidden rows pick weight columns: logits of row i are weight[:, i]
    weight = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, -1.0]])  # V=4, H=2
    hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    targets = torch.tensor([2, 0, 3])
    # row 0: logits all 0 -> log(1/4); rows 1, 2: logits [1, 0, 0, -1]
    z = math.e + 2 + math.exp(-1)
    want = [math.log(0.25), 1 - math.log(z), -1 - math.log(z)]
    p = [math.e / z, 1 / z, 1 / z, math.exp(-1) / z]
    ent1 = -sum(q * math.log(q) for q in p)
    for chunk in (0, 1, 2, 5):
        logp, ent = grpo.chunked_token_logprobs(hidden, weight, targets, chunk, with_entropy=True)
        assert logp.tolist() == pytest.approx(want, abs=1e-6)
        assert ent.tolist() == pytest.approx([math.log(4), ent1, ent1], abs=1e-6)
    assert grpo.chunked_token_logprobs(hidden, weight, targets, 2)[1] is None


def test_chunked_matches_full_logprobs_and_gradients():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 8, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, VOCAB, (23,), generator=g)
    coef = torch.randn(23, generator=g)
    full = grpo.token_logprobs(hidden @ weight.t(), targets)
    want = torch.autograd.grad((full * coef).sum(), (hidden, weight))
    for chunk in (1, 5, 23, 100):
        logp, ent = grpo.chunked_token_logprobs(hidden, weight, targets, chunk, with_entropy=True)
        torch.testing.assert_close(logp, full, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, grpo.entropy_from_logits(hidden @ weight.t()), atol=1e-5, rtol=0)
        got = torch.autograd.grad((logp * coef).sum(), (hidden, weight))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_fused_chunked_logprobs_match_eager():
    """The compiled chunk kernels (train.compile) give the eager chunks' log-probs, entropy and gradients."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(23, 8, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, VOCAB, (23,), generator=g)
    coef = torch.randn(23, generator=g)
    for chunk in (5, 23):
        out = {}
        for fused in (False, True):
            logp, ent = grpo.chunked_token_logprobs(hidden, weight, targets, chunk, True, fused=fused)
            out[fused] = (logp, ent, *torch.autograd.grad((logp * coef).sum(), (hidden, weight)))
        for a, b in zip(out[True], out[False], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_tied_embedding_gradient():
    """The output embedding is the input embedding: both uses of the matrix reach its gradient."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (11,), generator=g)
    targets = torch.randint(0, VOCAB, (11,), generator=g)
    grads = []
    for chunk in (0, 4):
        emb = torch.nn.Embedding(VOCAB, 6)
        emb.weight.data = torch.randn(VOCAB, 6, generator=torch.Generator().manual_seed(2))
        hidden = torch.tanh(emb(ids))
        logp, _ = grpo.chunked_token_logprobs(hidden, emb.weight, targets, chunk)
        logp.sum().backward()
        grads.append(emb.weight.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=0)
    assert grads[0][targets].abs().sum() > 0


# ---------------------------------------------------------------- packing


def test_plan_micro_batches_balances_and_respects_the_budget():
    lengths = [9, 3, 7, 2, 5, 30, 4]
    plan = plan_micro_batches(lengths, world=2, budget=10)
    flat = sorted(i for rank in plan for mb in rank for i in mb)
    assert flat == list(range(len(lengths)))
    for rank in plan:
        for mb in rank:
            assert sum(lengths[i] for i in mb) <= 10 or len(mb) == 1  # 30 tokens: a pass of its own
    assert [30] in [[lengths[i] for i in mb] for rank in plan for mb in rank]
    loads = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
    assert max(loads) - min(loads) <= 30
    assert plan_micro_batches(lengths, 1, 100) == [[list(range(7))]]


def test_collate_packed_layout():
    rows = [Row([5, 6], [7, 8, 9], [-0.1, -0.2, -0.3], 0.5, []), Row([4], [3], [-1.0], -0.5, [])]
    mb = collate_packed(rows, torch.device("cpu"))
    assert mb["input_ids"].tolist() == [[5, 6, 7, 8, 9, 4, 3]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert mb["packed"].cu_host == [0, 5, 7] and mb["packed"].cu.tolist() == [0, 5, 7]
    assert mb["packed"].max_len == 5
    # hidden position 1 (token 6) predicts 7, ... position 5 (token 4) predicts 3
    assert mb["score_idx"].tolist() == [1, 2, 3, 5]
    assert mb["score_targets"].tolist() == [7, 8, 9, 3]
    assert mb["mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert mb["grid_idx"].tolist() == [0, 1, 2, 3]
    assert mb["old"][0].tolist() == pytest.approx([-0.1, -0.2, -0.3]) and mb["adv"][1, 0].item() == -0.5
    padded = collate(rows, pad_id=0, device=torch.device("cpu"))
    assert padded["score_idx"].tolist() == [1, 2, 3, 5] and padded["grid_idx"].tolist() == [1, 2, 3, 4]


# ---------------------------------------------------------------- a model


def _model_dir(tmp_path, tied: bool = True) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    path = tmp_path / ("tied" if tied else "untied")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _rows() -> list[Row]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i, (p, n) in enumerate([(3, 5), (3, 2), (6, 7), (2, 1), (4, 9), (5, 3)]):
        prompt = torch.randint(2, VOCAB, (p,), generator=g).tolist()
        resp = torch.randint(2, VOCAB, (n,), generator=g).tolist()
        lps = (-torch.rand(n, generator=g) * 4).tolist()
        out.append(Row(prompt, resp, lps, (-1.0) ** i * (0.5 + 0.1 * i), [0] * n))
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_per_seq_attention_batches_sequences_of_one_length_and_equals_one_call_each(window):
    """`per_seq` packed attention: sequences of one length go through one sdpa call together; output and
    gradients equal a causal sdpa call on each sequence alone (GQA: 4 query heads, 2 key/value heads; a
    sliding window of 5 bands the sequences longer than it)."""
    from app.trainer.packing import LengthGroups, PackedSeqs, _band, _per_seq

    lens = [3, 7, 3, 7, 7, 2, 9, 3]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, cu[-1], 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, cu[-1], 8, generator=gen, requires_grad=True) for _ in range(2))
    p = PackedSeqs(cu=torch.tensor(cu, dtype=torch.int32), cu_host=cu, max_len=max(lens), mode="per_seq")
    assert p.groups(q.device).sizes == [(3, 3), (7, 3), (2, 1), (9, 1)]  # 4 calls, not 8
    got = _per_seq(q, k, v, p, None, window)
    want = []
    for a, b in itertools.pairwise(cu):
        band = _band(b - a, window, q.device) if window is not None and b - a > window else None
        sl = [x[:, :, a:b] for x in (q, k, v)]
        want.append(
            torch.nn.functional.scaled_dot_product_attention(
                *sl, attn_mask=band, is_causal=band is None, enable_gqa=True
            )
        )
    want = torch.cat(want, dim=2).transpose(1, 2)
    assert got.shape == (1, cu[-1], 4, 8)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    weights = torch.randn(got.shape, generator=gen)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    for g, w in zip(grads, torch.autograd.grad((want * weights).sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert LengthGroups.of([0, 2, 5, 9], q.device).perm is None  # every length once: no reordering


def test_packed_forward_matches_padded(tmp_path):
    from app.trainer.model_build import build_fsdp_model

    path = _model_dir(tmp_path)
    rows = _rows()
    plain = build_fsdp_model(path, "float32", torch.device("cpu"), train=False)
    packed = build_fsdp_model(path, "float32", torch.device("cpu"), train=False, packed=True)
    with torch.no_grad():
        ref, logits = response_logprobs(plain, collate(rows, 0, torch.device("cpu")))
        mb = collate_packed(rows, torch.device("cpu"), mode="per_seq")
        got, ent = scored_logprobs(packed, mb, chunk_tokens=4, with_entropy=True)
        pmb = collate(rows, 0, torch.device("cpu"))
        chunked_padded, _ = scored_logprobs(plain, pmb, chunk_tokens=4)
    ref_ent = grpo.entropy_from_logits(logits)
    for i, r in enumerate(rows):
        want = row_values(pmb, ref, i, r)
        assert row_values(mb, got, i, r) == pytest.approx(want, abs=1e-5)
        assert row_values(pmb, chunked_padded, i, r) == pytest.approx(want, abs=1e-5)
        assert row_values(mb, ent, i, r) == pytest.approx(row_values(pmb, ref_ent, i, r), abs=1e-5)


# ---------------------------------------------------------------- the step

VARIANTS = {
    "padded_full": ["train.micro_batch_tokens=0", "train.logprob_chunk_tokens=0", "train.micro_batch_size=4"],
    "padded_chunked": [
        "train.micro_batch_tokens=0",
        "train.logprob_chunk_tokens=3",
        "train.micro_batch_size=4",
    ],
    # a budget of 20 tokens: several micro-batches of several sequences each
    "packed_chunked": ["train.micro_batch_tokens=20", "train.logprob_chunk_tokens=3"],
    "packed_full": ["train.micro_batch_tokens=20", "train.logprob_chunk_tokens=0"],
    # the GPU defaults of issue 15's second round, forced on: compiled RMSNorm/MLP and fused AdamW
    "packed_chunked_compiled_fused": [
        "train.micro_batch_tokens=20",
        "train.logprob_chunk_tokens=3",
        "train.compile=on",
        "train.optimizer_impl=fused",
    ],
}


def _batch() -> Batch:
    rows = _rows()
    groups = []
    for gi in range(0, len(rows), 3):
        samples = [
            Sample(
                token_ids=r.response_ids,
                logprobs=r.behaviour_logprobs,
                versions=r.versions,
                finish_reason="stop",
                reward=float((gi + k) % 2 + 0.25 * k),
            )
            for k, r in enumerate(rows[gi : gi + 3])
        ]
        groups.append(Group(uid=f"g{gi}", prompt_ids=rows[gi].prompt_ids, answer="", samples=samples))
    return Batch(groups=groups)


def step_with_grads(learner: Learner, batch: Batch) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One step; the gradients as the optimizer saw them (full tensors under FSDP2)."""
    grads: dict[str, torch.Tensor] = {}
    inner = learner._optimizer_step

    def capture() -> float:
        for n, p in learner.model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[n.replace("_fsdp_wrapped_module.", "")] = g.detach().clone()
        return inner()

    learner._optimizer_step = capture
    return learner.step(batch), grads


@pytest.mark.parametrize(
    "extra",
    [
        ["algorithm.loss_agg=token_mean"],
        ["algorithm.loss_agg=seq_mean", "algorithm.kl_coef=0.1"],
        ["algorithm.entropy_coef=0.05"],  # the entropy's gradient: autograd (padded_full) = the chunks' own
    ],
)
def test_step_equivalence(tmp_path, extra):
    path = _model_dir(tmp_path)
    out = {}
    for name, keys in VARIANTS.items():
        torch.manual_seed(0)
        cfg = load_config(None, ["train.lr=0.01", "algorithm.correction=tis", *keys, *extra])
        out[name] = step_with_grads(Learner(cfg, path, torch.device("cpu")), _batch())
    ref_m, ref_g = out["padded_full"]
    assert ref_m["loss/policy"] != 0 and ref_m["actor/grad_norm"] > 0
    for name, (m, g) in out.items():
        for k, v in ref_m.items():
            assert m[k] == pytest.approx(v, abs=1e-5), (name, k)
        assert g.keys() == ref_g.keys()
        for k, v in ref_g.items():
            torch.testing.assert_close(g[k], v, atol=1e-5, rtol=0, msg=lambda s, k=k, n=name: f"{n} {k}: {s}")


# ---------------------------------------------------------------- architectures

# tiny random models of the packable types (app.trainer.packing.PACKED_MODEL_TYPES); the sequences of `_rows()`
# run 3 to 13 tokens, so Mistral's window of 6 and Qwen3's sliding layer (window 5) cut into the longer ones
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral_window6": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 6}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3_sliding_layer": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            "layer_types": ["full_attention", "sliding_attention"],
            "sliding_window": 5,
            "use_sliding_window": True,
        },
    ),
}


def _arch_dir(tmp_path, arch: str) -> str:
    """A tiny randomly initialised model of `arch` (hidden 64, 2 layers, 4 heads, 2 KV heads), saved; `arch`
    is a key of ARCHS or a transformers prefix with `<arch>Config` and `<arch>LMHeadModel` (GPT2)."""
    import transformers

    cfg_cls, model_cls, extra = ARCHS.get(arch) or (f"{arch}Config", f"{arch}LMHeadModel", {})
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        **extra,
    )
    path = tmp_path / arch
    getattr(transformers, model_cls)(cfg).save_pretrained(path)
    return str(path)


def _step(path: str, keys: list[str]) -> tuple[Learner, dict[str, float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    cfg = load_config(None, ["train.lr=0.01", "algorithm.correction=tis", "algorithm.kl_coef=0.1", *keys])
    learner = Learner(cfg, path, torch.device("cpu"))
    return learner, *step_with_grads(learner, _batch())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_packed_step_equals_padded_per_architecture(tmp_path, arch):
    """Each packable architecture: the packed step (chunked and full log-probs; per_seq attention on CPU),
    with an in-trainer KL reference, gives the padded step's loss, metrics and gradients; Mistral's also
    with its layers compiled."""
    from app.trainer.packing import packable

    path = _arch_dir(tmp_path, arch)
    ref, ref_m, ref_g = _step(path, VARIANTS["padded_full"])
    assert not ref.packed and ref_m["loss/policy"] != 0 and ref_m["actor/grad_norm"] > 0
    names = ["packed_chunked", "packed_full"] + (
        ["packed_chunked_compiled_fused"] if "mistral" in arch else []
    )
    for name in names:
        learner, m, g = _step(path, VARIANTS[name])
        assert learner.packed and packable(learner.model.config.model_type), name
        for k, v in ref_m.items():
            assert m[k] == pytest.approx(v, abs=1e-5), (name, k)
        assert g.keys() == ref_g.keys()
        for k, v in ref_g.items():
            torch.testing.assert_close(g[k], v, atol=1e-5, rtol=0, msg=lambda s, k=k, n=name: f"{n} {k}: {s}")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_packed_forward_builds_no_mask(tmp_path, arch, monkeypatch):
    """A packed forward never reaches transformers' mask building: neither the packed-sequence detection
    (a host synchronisation) nor the mask function (a [T, T] mask) runs."""
    from transformers import masking_utils

    from app.trainer.model_build import build_fsdp_model
    from app.trainer.packing import ATTN_NAME

    model = build_fsdp_model(
        _arch_dir(tmp_path, arch), "float32", torch.device("cpu"), train=False, packed=True
    )

    def boom(*args, **kwargs):
        raise AssertionError("a packed forward built a mask")

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", boom)
    monkeypatch.setitem(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, ATTN_NAME, boom)
    with torch.no_grad():
        got, _ = scored_logprobs(model, collate_packed(_rows(), torch.device("cpu"), "per_seq"), 4)
    assert torch.isfinite(got).all()


def test_unsupported_architecture_trains_padded_with_one_warning(tmp_path, caplog):
    """GPT-2 is not a packable type: with train.micro_batch_tokens > 0 the learner takes padded
    micro-batches, says so in one warning naming the model type and the setting, and steps exactly as with
    train.micro_batch_tokens=0."""
    from app.trainer.packing import packable, packing_enabled

    assert not packable("gpt2") and packable("llama") and not packing_enabled(0, "llama")
    path = _arch_dir(tmp_path, "GPT2")
    with caplog.at_level("WARNING"):
        learner, m, g = _step(path, VARIANTS["packed_chunked"])
    warned = [r for r in caplog.records if r.name == "app.trainer.packing"]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    msg = warned[0].getMessage()
    assert "'gpt2'" in msg and "train.micro_batch_tokens=20" in msg and "\n" not in msg
    assert not learner.packed and "packed" not in learner.collate(_rows()[:2])
    ref = ["train.micro_batch_tokens=0", *VARIANTS["packed_chunked"][1:]]
    _, ref_m, ref_g = _step(path, ref)
    assert m == ref_m
    for k, v in ref_g.items():
        torch.testing.assert_close(g[k], v, atol=0, rtol=0)


def _fsdp_one_rank(port: int, path: str, keys: list[str], q) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        learner = Learner(load_config(None, keys), path, torch.device("cpu"))
        m, g = step_with_grads(learner, _batch())
        lp = learner.logprobs_of([3, 4, 5], [6, 7])
        m2 = learner.step(_batch())  # after a forward-only call: the updated weights, not a stale gather
        q.put((m, {k: v.tolist() for k, v in g.items()}, lp, m2))
    except BaseException as e:
        q.put(repr(e))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "fast",
    [[], ["train.gather_once=on", "train.optimizer_impl=fused", "train.compile=on"]],
    ids=["packed_chunked", "gather_once_fused_compiled"],
)
def test_fsdp2_one_rank_packed_chunked_equals_reference(tmp_path, fast):
    """Under FSDP2 (gloo, one rank) the packed, chunked step gathers the tied output embedding inside its
    forward method and gives the reference step's loss and gradients; so does the fast path (layers gathered
    once per step, gradients accumulated unsharded over the micro-batches, fused AdamW, compiled layers),
    through the optimizer update, a forward-only call and a second step."""
    from app.weights.group import free_port

    path = _model_dir(tmp_path)
    common = ["train.lr=0.01", "algorithm.loss_agg=seq_mean", "algorithm.kl_coef=0.1"]
    torch.manual_seed(0)
    ref = Learner(load_config(None, [*common, *VARIANTS["padded_full"]]), path, torch.device("cpu"))
    ref_m, ref_g = step_with_grads(ref, _batch())
    ref_lp = ref.logprobs_of([3, 4, 5], [6, 7])
    ref_m2 = ref.step(_batch())
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(
        target=_fsdp_one_rank, args=(free_port(), path, [*common, *VARIANTS["packed_chunked"], *fast], q)
    )
    proc.start()
    try:
        got = q.get(timeout=120)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert not isinstance(got, str), got
    m, g, lp, m2 = got
    for k, v in ref_m.items():
        assert m[k] == pytest.approx(v, abs=1e-5), k
    assert g.keys() == ref_g.keys() and "model.embed_tokens.weight" in g
    for k, v in ref_g.items():
        torch.testing.assert_close(torch.tensor(g[k]), v, atol=1e-5, rtol=0, msg=lambda s, k=k: f"{k}: {s}")
    assert lp == pytest.approx(ref_lp, abs=1e-5)
    for k, v in ref_m2.items():
        assert m2[k] == pytest.approx(v, abs=1e-5), ("second step", k)


# ---------------------------------------------------------------- multi-turn loss masks


def _env_batch(masked: bool, env_old: float | None = None) -> Batch:
    """`_batch()` with the middle third of each response of 3+ tokens made environment tokens (loss mask
    0); `env_old` overwrites their behaviour log-probs (they must not matter when masked)."""
    b = _batch()
    for g in b.groups:
        for s in g.samples:
            n = len(s.token_ids)
            env = set(range(n // 3, 2 * n // 3)) if n >= 3 else set()
            s.loss_mask = [0 if i in env else 1 for i in range(n)] if masked else None
            if env_old is not None:
                s.logprobs = [env_old if i in env else lp for i, lp in enumerate(s.logprobs)]
    return b


@pytest.mark.parametrize("variant", ["padded_full", "packed_chunked"])
def test_environment_tokens_never_reach_the_loss(tmp_path, variant):
    path = _model_dir(tmp_path)

    def run(batch: Batch):
        torch.manual_seed(0)
        cfg = load_config(None, ["train.lr=0.01", "algorithm.correction=tis", *VARIANTS[variant]])
        return step_with_grads(Learner(cfg, path, torch.device("cpu")), batch)

    masked, grads = run(_env_batch(True))
    model_tokens = sum(s.model_tokens for g in _env_batch(True).groups for s in g.samples)
    all_tokens = sum(len(s.token_ids) for g in _batch().groups for s in g.samples)
    assert masked["train/tokens"] == model_tokens < all_tokens
    # environment tokens' behaviour log-probs (0 in a real trajectory) change nothing when masked ...
    other, other_grads = run(_env_batch(True, env_old=-9.0))
    for k, v in masked.items():
        assert other[k] == pytest.approx(v, abs=1e-6), k
    for k, v in grads.items():
        torch.testing.assert_close(other_grads[k], v, atol=1e-6, rtol=0)
    # ... and everything when they are trained (no mask): another loss, another gradient
    unmasked, unmasked_grads = run(_env_batch(False, env_old=-9.0))
    assert unmasked["train/tokens"] == all_tokens
    assert abs(unmasked["loss/policy"] - masked["loss/policy"]) > 1e-3
    assert any((unmasked_grads[k] - v).abs().max() > 1e-4 for k, v in grads.items())


def test_masked_loss_by_hand(tmp_path):
    """The padded step's policy loss (token_mean, no correction) is the mean of -A * ratio over model
    tokens only, computed here from the model's own log-probs."""
    path = _model_dir(tmp_path)
    torch.manual_seed(0)
    cfg = load_config(None, ["train.lr=0.01", "algorithm.correction=none", *VARIANTS["padded_full"]])
    learner = Learner(cfg, path, torch.device("cpu"))
    batch = _env_batch(True)
    from app.trainer.batch_tensors import flatten_batch

    rows = flatten_batch(batch, True)
    with torch.no_grad():
        mb = collate(rows, 0, torch.device("cpu"))
        logp, _ = response_logprobs(learner.model, mb)
    num, den = 0.0, 0
    for i, r in enumerate(rows):
        lp = row_values(mb, logp, i, r)
        for j, keep in enumerate(r.loss_mask or [1] * len(lp)):
            if keep:
                ratio = math.exp(lp[j] - r.behaviour_logprobs[j])
                # clipped surrogate: -min(ratio*A, clip(ratio)*A)
                lo, hi = 1 - cfg.algorithm.clip_low, 1 + cfg.algorithm.clip_high
                num += -min(ratio * r.advantage, min(max(ratio, lo), hi) * r.advantage)
                den += 1
    m = learner.step(batch)
    assert m["loss/policy"] == pytest.approx(num / den, abs=1e-5)
