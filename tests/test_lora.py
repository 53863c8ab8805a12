"""LoRA (app/trainer/lora.py): the adapter's math by hand, freezing and the optimizer's parameters, the PEFT
format round trip, and the merge."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from app.trainer import lora


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(3, 2, bias=True)
        self.up_proj = nn.Linear(2, 2, bias=False)
        self.norm = nn.LayerNorm(2)


class Tiny(nn.Module):
    """Named like an HF decoder: model.layers.N.<linear>, plus an lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(2, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = layer.up_proj(layer.norm(layer.q_proj(x)))
            x = torch.cat([x, x[..., :1]], dim=-1)  # back to 3 features for the next layer
        return self.lm_head(x[..., :2])


def test_lora_linear_by_hand():
    base = nn.Linear(2, 2, bias=True)
    with torch.no_grad():
        base.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        base.bias.copy_(torch.tensor([0.5, -0.5]))
    m = lora.LoraLinear(base, rank=1, alpha=4.0)  # scaling 4
    x = torch.tensor([[1.0, 1.0]])
    # B starts at zero: exactly the base (x W^T + b = [3.5, 6.5])
    assert torch.equal(m(x), torch.tensor([[3.5, 6.5]]))
    with torch.no_grad():
        m.lora_A.weight.copy_(torch.tensor([[1.0, -2.0]]))  # A x = 1 - 2 = -1
        m.lora_B.weight.copy_(torch.tensor([[0.5], [1.0]]))  # B (A x) = [-0.5, -1]
    # + 4 * [-0.5, -1] = [1.5, 2.5]
    assert torch.allclose(m(x), torch.tensor([[1.5, 2.5]]))
    assert torch.allclose(m.delta_weight(), torch.tensor([[2.0, -4.0], [4.0, -8.0]]))
    m.adapter_enabled = False
    assert torch.equal(m(x), torch.tensor([[3.5, 6.5]]))
    # the base's parameters keep their names and objects; only the adapter trains
    assert m.weight is base.weight and not m.weight.requires_grad and not m.bias.requires_grad
    assert [n for n, p in m.named_parameters() if p.requires_grad] == ["lora_A.weight", "lora_B.weight"]


def test_dropout_applies_to_the_adapter_input_only():
    torch.manual_seed(0)
    m = lora.LoraLinear(nn.Linear(4, 4), rank=2, alpha=2.0, dropout=0.5)
    x = torch.ones(1, 4)
    base = m.weight @ x[0] + m.bias
    m.train()  # B = 0: dropout cannot change the output, however it drops
    assert torch.allclose(m(x)[0], base)
    with torch.no_grad():
        m.lora_B.weight.fill_(1.0)
    m.eval()
    a = m(x)
    assert torch.allclose(m(x), a)  # eval: deterministic
    m.train()
    outs = {tuple(m(x)[0].tolist()) for _ in range(8)}
    assert len(outs) > 1  # train: the adapter's input is dropped at random


def test_apply_freezes_the_base_and_trains_only_the_adapters():
    model = Tiny()
    adapted = lora.apply_lora(model, lora.LoraSpec(rank=2, alpha=4.0, targets=("q_proj", "up_proj")))
    assert adapted == [f"model.layers.{i}.{n}" for i in (0, 1) for n in ("q_proj", "up_proj")]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        f"model.layers.{i}.{n}.lora_{ab}.weight" for i in (0, 1) for n in ("q_proj", "up_proj") for ab in "AB"
    }
    assert {id(p) for p in lora.trainable_params(model)} == {
        id(p) for n, p in model.named_parameters() if n in trainable
    }
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.q_proj.weight" in names and "model.layers.0.q_proj.bias" in names  # unchanged
    assert "lm_head.weight" in names and not model.lm_head.weight.requires_grad
    # an optimizer over the trainable set changes the adapters and nothing else
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for _, m in lora.lora_modules(model):
            m.lora_B.weight.fill_(0.1)
    opt = torch.optim.SGD(lora.trainable_params(model), lr=0.1)
    model(torch.randn(5, 3)).pow(2).sum().backward()
    opt.step()
    for n, p in model.named_parameters():
        if not lora.is_adapter_param(n):
            assert torch.equal(p, before[n]), n


def test_disabled_gives_the_base_model():
    torch.manual_seed(1)
    model = Tiny()
    x = torch.randn(4, 3)
    want = model(x)
    lora.apply_lora(model, lora.LoraSpec(rank=2, alpha=2.0, targets=("q_proj",)))
    with torch.no_grad():
        for _, m in lora.lora_modules(model):
            m.lora_B.weight.normal_()
    assert not torch.allclose(model(x), want)
    with lora.disabled(model):
        assert torch.allclose(model(x), want)
    assert not torch.allclose(model(x), want)  # enabled again after the block


def test_unknown_target_names_the_linear_layers():
    with pytest.raises(
        ValueError,
        match=r"unknown target\(s\) qproj; this model's linear layers are lm_head, "
        r"q_proj, up_proj",
    ):
        lora.apply_lora(Tiny(), lora.LoraSpec(rank=2, alpha=2.0, targets=("q_proj", "qproj")))
    with pytest.raises(ValueError, match="no targets"):
        lora.check_targets(Tiny(), ())


def test_peft_format_round_trip_and_merge(tmp_path):
    torch.manual_seed(2)
    spec = lora.LoraSpec(rank=2, alpha=8.0, dropout=0.05, targets=("up_proj", "q_proj"))
    model = Tiny()
    lora.apply_lora(model, spec)
    with torch.no_grad():
        for _, m in lora.lora_modules(model):
            m.lora_B.weight.normal_()
    adapter = {n: p for n, p in model.named_parameters() if lora.is_adapter_param(n)}
    lora.save_adapter(tmp_path / "a", {**adapter, "lm_head.weight": model.lm_head.weight}, spec, "base/path")
    cfg = json.loads((tmp_path / "a" / lora.CONFIG_FILE).read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 2 and cfg["lora_alpha"] == 8
    assert cfg["target_modules"] == ["q_proj", "up_proj"] and cfg["base_model_name_or_path"] == "base/path"
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "a" / lora.WEIGHTS_FILE)))
    assert "base_model.model.model.layers.1.q_proj.lora_A.weight" in keys  # PEFT's key names
    assert len(keys) == 8  # adapter tensors only (lm_head.weight was not saved)
    spec2, tensors = lora.load_adapter(tmp_path / "a")
    assert spec2 == lora.LoraSpec(rank=2, alpha=8.0, dropout=0.05, targets=("q_proj", "up_proj"))
    other = Tiny()
    other.load_state_dict({n: p for n, p in model.state_dict().items() if not lora.is_adapter_param(n)})
    lora.apply_lora(other, spec2)
    lora.load_adapter_into(other, tensors)
    model.eval(), other.eval()  # no dropout
    x = torch.randn(3, 3)
    assert torch.allclose(other(x), model(x))
    with pytest.raises(ValueError, match="missing"):
        lora.load_adapter_into(other, {})
    # the merged model (plain linear layers) computes what base + adapter compute
    state = {n: p.detach() for n, p in model.named_parameters()}
    merged = lora.merged_state_dict(state, spec)
    assert not any(lora.is_adapter_param(n) for n in merged)
    plain = Tiny()
    plain.load_state_dict(merged)
    assert torch.allclose(plain(x), model(x), atol=1e-6)


def test_targets_parse_and_spec_from_config():
    assert lora.parse_targets(" q_proj, k_proj,,q_proj ") == ["q_proj", "k_proj"]

    class M:
        rank, alpha, dropout, targets = 0, 16.0, 0.0, "q_proj"

    assert lora.LoraSpec.from_config(M) is None
    M.rank = 8
    assert lora.LoraSpec.from_config(M) == lora.LoraSpec(8, 16.0, 0.0, ("q_proj",))
    assert lora.LoraSpec.from_config(M).scaling == 2.0


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["model.lora.rank=8", "rollout.partial=keep"],
            r"'rollout.partial': 'keep' with model.lora.rank=8.*finish_on_old",
        ),
        (["rollout.partial=finish_on_old"], r"finish_on_old needs LoRA \(model.lora.rank > 0\)"),
        (["model.lora.rank=8", "model.lora.targets=q_proj,model.x"], r"'model.x' is not a layer name"),
        (["model.lora.rank=8", "model.lora.targets= "], r"'model.lora.targets': empty"),
        (
            ["model.lora.rank=8", "algorithm.kl_coef=0.1", "ref.workers=1"],
            r"'ref.workers': 1 .*set ref.workers=0",
        ),
        (["model.lora.rank=600"], r"'model.lora.rank': 600; must be in \[0, 512\]"),
        (["model.lora.rank=8", "model.lora.alpha=0"], r"'model.lora.alpha': 0"),
        (["model.lora.dropout=1.0"], r"'model.lora.dropout': 1.0; must be in \[0, 1\)"),
    ],
)
def test_config_refuses_bad_lora_settings(overrides, match):
    from app.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_config_lora_defaults_to_finish_on_old():
    from app.config import load_config

    assert load_config(None, []).rollout.partial == "keep"  # full fine-tuning: as before
    cfg = load_config(None, ["model.lora.rank=8"])
    assert cfg.rollout.partial == "finish_on_old"
    assert lora.LoraSpec.from_config(cfg.model.lora).targets == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )


# ---------------------------------------------------------------- the replica's adapters (finish_on_old)


def test_adapter_book_keeps_old_adapters_while_requests_use_them():
    from app.vllm.adapters import Adapter, AdapterBook

    book = AdapterBook()
    assert book.acquire() is None  # before the first push: the base model
    assert book.publish(Adapter(0, "/a/v0")) == []
    first = book.acquire()  # admitted under v0 ...
    assert first == Adapter(0, "/a/v0") and first.lora_id == 1 and first.name == "relay-v0"
    assert book.publish(Adapter(1, "/a/v1")) == []  # ... so v0 stays while v1 is published
    second = book.acquire()
    assert second.version == 1 and sorted(book.held) == [0, 1]
    assert book.release(second) == []  # v1 is the newest: never removed
    assert book.release(first) == [Adapter(0, "/a/v0")]  # v0's last user finished: remove it
    assert sorted(book.held) == [1]
    # a push while nothing uses the old one removes it at once
    assert book.publish(Adapter(2, "/a/v2")) == [Adapter(1, "/a/v1")]
    with pytest.raises(KeyError, match=r"adapter version 1 is not held by this replica \(held: \[2\]\)"):
        book.acquire(1)
    with book.using(2) as (held, unused):
        assert held.version == 2 and book.users == {2: 1}
        book.publish(Adapter(3, "/a/v3"))
    assert unused == [Adapter(2, "/a/v2")] and book.users == {}


def test_engine_needs_add_lora_for_finish_on_old():
    from app.rollout.partial import partial_policy
    from app.vllm import engine as vla

    class Engine:
        def collective_rpc(self): ...
        def pause_generation(self, mode="keep"): ...
        def resume_generation(self): ...
        def update_weight_version(self): ...

    with pytest.raises(vla.EngineCapabilityError, match="lacks add_lora.*rollout.partial=finish_on_old"):
        vla.check_capabilities(Engine, partial_policy("finish_on_old"))
    Engine.add_lora = Engine.remove_lora = lambda self: None
    vla.check_capabilities(Engine, partial_policy("finish_on_old"))


def test_model_targets_are_checked_on_the_model_before_anything_starts(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    lora.check_model_targets(str(tmp_path), ["q_proj", "down_proj"])
    with pytest.raises(
        ValueError,
        match="unknown target\\(s\\) qkv_proj; this model's linear layers are down_proj, "
        "gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj",
    ):
        lora.check_model_targets(str(tmp_path), ["qkv_proj"])


def test_push_metrics_count_requests_that_finished_on_an_old_adapter():
    from app.trainer.step_metrics import push_metrics
    from app.weights.records import PushStats

    push = PushStats(version=3, nbytes=100)
    push.extra = {"r0": {"held_s": 0.0, "on_old": 3.0}, "r1": {"held_s": 0.0, "on_old": 2.0}}
    m = push_metrics(push, step=3)
    assert m["sync/requests_on_old"] == 5.0 and m["sync/pause_s"] == 0.0
    push.extra = {"r0": {"held_s": 0.2}}  # full weights: no such count
    assert "sync/requests_on_old" not in push_metrics(push, step=3)
