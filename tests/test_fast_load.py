"""app/vllm/fast_load.py: where pushed tensors land in an engine that keeps its parameters whole."""

from __future__ import annotations

import torch

from app.vllm.fast_load import Slot, copy_into, plan_slots

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _pushed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (10, 4),
        "model.layers.0.self_attn.q_proj.weight": (4, 4),
        "model.layers.0.self_attn.k_proj.weight": (2, 4),
        "model.layers.0.self_attn.v_proj.weight": (2, 4),
        "model.layers.0.self_attn.q_proj.bias": (4,),
        "model.layers.0.self_attn.k_proj.bias": (2,),
        "model.layers.0.self_attn.v_proj.bias": (2,),
        "model.layers.0.mlp.gate_proj.weight": (6, 4),
        "model.layers.0.mlp.up_proj.weight": (6, 4),
        "model.layers.0.mlp.down_proj.weight": (4, 6),
        "lm_head.weight": (10, 4),
    }
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def _engine() -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": torch.zeros(10, 4),
        "model.layers.0.self_attn.qkv_proj.weight": torch.zeros(8, 4),
        "model.layers.0.self_attn.qkv_proj.bias": torch.zeros(8),
        "model.layers.0.mlp.gate_up_proj.weight": torch.zeros(12, 4),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(4, 6),
    }


def _shapes(d: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in d.items()}


def test_packed_parts_land_in_order_and_tied_head_is_skipped():
    pushed, engine = _pushed(), _engine()
    slots = plan_slots(_shapes(pushed), _shapes(engine), PACKED, skip=("lm_head.",))
    assert slots is not None
    assert slots["model.layers.0.self_attn.k_proj.weight"] == Slot(
        "model.layers.0.self_attn.qkv_proj.weight", 4, 2
    )
    assert slots["model.layers.0.self_attn.v_proj.bias"] == Slot(
        "model.layers.0.self_attn.qkv_proj.bias", 6, 2
    )
    assert slots["model.layers.0.mlp.up_proj.weight"] == Slot("model.layers.0.mlp.gate_up_proj.weight", 6, 6)
    assert slots["lm_head.weight"] is None
    items = list(pushed.items())
    copy_into(engine, slots, items[:5])  # two buckets, split inside the packed q/k/v
    copy_into(engine, slots, items[5:])
    a = "model.layers.0.self_attn."
    want_qkv = torch.cat([pushed[a + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(engine[a + "qkv_proj.weight"], want_qkv)
    assert torch.equal(
        engine[a + "qkv_proj.bias"],
        torch.cat([pushed[a + p + ".bias"] for p in ("q_proj", "k_proj", "v_proj")]),
    )
    m = "model.layers.0.mlp."
    assert torch.equal(
        engine[m + "gate_up_proj.weight"],
        torch.cat([pushed[m + "gate_proj.weight"], pushed[m + "up_proj.weight"]]),
    )
    assert torch.equal(engine["model.embed_tokens.weight"], pushed["model.embed_tokens.weight"])
    assert torch.equal(engine[m + "down_proj.weight"], pushed[m + "down_proj.weight"])


def test_copy_casts_to_the_engine_dtype():
    pushed, engine = _pushed(), {n: t.to(torch.bfloat16) for n, t in _engine().items()}
    slots = plan_slots(_shapes(pushed), _shapes(engine), PACKED, skip=("lm_head.",))
    copy_into(engine, slots, list(pushed.items()))
    assert torch.equal(
        engine["model.embed_tokens.weight"], pushed["model.embed_tokens.weight"].to(torch.bfloat16)
    )


def test_anything_it_cannot_place_falls_back():
    pushed, engine = _pushed(), _engine()
    # a sharded engine (tensor parallel 2): qkv holds half the rows
    sharded = {**_shapes(engine), "model.layers.0.self_attn.qkv_proj.weight": (4, 4)}
    assert plan_slots(_shapes(pushed), sharded, PACKED, skip=("lm_head.",)) is None
    # a padded vocabulary
    padded = {**_shapes(engine), "model.embed_tokens.weight": (16, 4)}
    assert plan_slots(_shapes(pushed), padded, PACKED, skip=("lm_head.",)) is None
    # an untied head the engine has no parameter for
    assert plan_slots(_shapes(pushed), _shapes(engine), PACKED) is None
    # an engine parameter the push leaves unfilled
    extra = {**_shapes(engine), "model.norm.weight": (4,)}
    assert plan_slots(_shapes(pushed), extra, PACKED, skip=("lm_head.",)) is None
    # a part without its siblings
    partial = {k: v for k, v in _shapes(pushed).items() if "v_proj" not in k}
    assert plan_slots(partial, _shapes(engine), PACKED, skip=("lm_head.",)) is None


def test_loaded_checksums_read_past_a_padded_vocabulary():
    """vLLM pads a vocabulary to a multiple of 64 rows: the read-back of a push (`relay_loaded_checksums`)
    compares the pushed rows and ignores the padding, so the GPU tier can check every load bit for bit."""
    from app.vllm.worker import _unpadded

    assert _unpadded((64, 128), (22, 128)) == (22, 128)  # padded rows are nobody's
    assert _unpadded((22, 128), (22, 128)) == (22, 128)
    assert _unpadded((64, 128), (22, 96)) == (64, 128)  # another width: not the same tensor
    assert _unpadded((64, 128), None) == (64, 128)  # not pushed
    assert _unpadded((16, 128), (22, 128)) == (16, 128)  # fewer rows than pushed: no place
    pushed = {"model.embed_tokens.weight": (22, 128), "lm_head.weight": (22, 128)}
    held = {"model.embed_tokens.weight": (64, 128), "lm_head.weight": (64, 128)}
    assert plan_slots(pushed, held, {}) is None  # the fast load cannot place them (it falls back)
    slots = plan_slots(pushed, {n: _unpadded(s, pushed.get(n)) for n, s in held.items()}, {})
    assert slots == {n: Slot(n, 0, 22) for n in pushed}


def _bucketed(pushed: dict[str, torch.Tensor], bucket_bytes: int):
    """The pushed tensors in buckets as the trainer plans them, each packed into its flat buffer."""
    from app.weights.buckets import pack_into, plan_buckets

    plan = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in pushed.items()], bucket_bytes, 1)
    flats = []
    for b in plan.buckets:
        flat = torch.empty(b.numel, dtype=pushed[b.tensors[0].name].dtype)
        flats.append(pack_into(b, [pushed[t.name] for t in b.tensors], flat))
    return plan, flats


def test_slot_loader_loads_a_flat_bucket_as_the_per_tensor_copy_does():
    from app.vllm.fast_load import SlotLoader
    from app.weights.buckets import load_bucket, unpack

    pushed = _pushed()
    plan, flats = _bucketed(pushed, 200)  # several buckets, packed parameters split across them
    assert len(plan.buckets) > 2
    by_items, by_flat = _engine(), _engine()
    slots = plan_slots(_shapes(pushed), _shapes(by_items), PACKED, skip=("lm_head.",))
    loader = SlotLoader(by_flat, slots)
    for _ in range(2):  # the second load of each bucket takes the worked-out copy
        for b, flat in zip(plan.buckets, flats, strict=True):
            copy_into(by_items, slots, unpack(b, flat))
            assert loader.flat(b, flat)
            load_bucket(loader, b, flat)
    for name in by_items:
        assert torch.equal(by_flat[name], by_items[name]), name
    # a received buffer longer than its bucket (a reused staging buffer): the tail is not read
    longer = [torch.cat([f, torch.full((5,), float("nan"))]) for f in flats]
    fresh = _engine()
    for b, flat in zip(plan.buckets, longer, strict=True):
        assert SlotLoader(fresh, slots).flat(b, flat)
    assert all(torch.equal(fresh[n], by_items[n]) for n in fresh)
    # a parameter whose storage is replaced (`.data` swapped, as a reload may do): loaded into the new storage
    params = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in _engine().items()}
    loader = SlotLoader(params, slots)
    for b, flat in zip(plan.buckets, flats, strict=True):
        loader.flat(b, flat)
    for p in params.values():
        p.data = torch.zeros_like(p.data)
    for b, flat in zip(plan.buckets, flats, strict=True):
        assert loader.flat(b, flat)
    assert all(torch.equal(params[n].data, by_items[n]) for n in params)


def test_slot_loader_leaves_a_cast_to_the_per_tensor_copy():
    from app.vllm.fast_load import SlotLoader
    from app.weights.buckets import load_bucket

    pushed = _pushed()
    plan, flats = _bucketed(pushed, 1 << 20)
    engine = {n: t.to(torch.bfloat16) for n, t in _engine().items()}
    slots = plan_slots(_shapes(pushed), _shapes(engine), PACKED, skip=("lm_head.",))
    loader = SlotLoader(engine, slots)
    assert not loader.flat(plan.buckets[0], flats[0])  # float32 pushed into bfloat16: cast per tensor
    load_bucket(loader, plan.buckets[0], flats[0])
    assert torch.equal(
        engine["model.embed_tokens.weight"], pushed["model.embed_tokens.weight"].to(torch.bfloat16)
    )
