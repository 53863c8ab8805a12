from app.tasks import tiny


def test_problems_disjoint_and_correct():
    train, val = tiny.make_problems(0, n_train=500, n_val=50)
    digits = lambda ps: {p.prompt.split(":")[1].rstrip("=") for p in ps}  # noqa: E731
    assert not digits(train) & digits(val)
    for p in train[:50] + val:
        op, d = p.prompt.rstrip("=").split(":")
        assert p.answer == (max(d) if op == "max" else min(d))


def test_tokenizer_roundtrip_and_head_dim():
    tok = tiny.build_tokenizer()
    ids = tok.encode("max:3815=", add_special_tokens=False)
    assert len(ids) == 9 and tok.decode(ids) == "max:3815="
    assert tok.decode([*ids, tok.eos_token_id], skip_special_tokens=True) == "max:3815="
    cfg = tiny.model_config(len(tok))
    assert cfg.hidden_size // cfg.num_attention_heads >= 32


def test_builtin_is_built_once(tmp_path):
    root = tiny.ensure_builtin(tmp_path, warmup_steps=5)
    stamp = (root / "build.json").stat().st_mtime
    assert (root / "model" / "config.json").exists() and (root / "train.jsonl").exists()
    assert tiny.ensure_builtin(tmp_path, warmup_steps=5) == root
    assert (root / "build.json").stat().st_mtime == stamp
