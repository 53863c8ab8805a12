"""app/rewards/by_source.py: the reward of each data source, named at a run's start (reward.fn=auto's pick made
visible), from JSONL and parquet files, a row without a source counting as its file's stem."""

from __future__ import annotations

import json
import logging

from app.config import load_config
from app.rewards.by_source import data_sources, name_rewards
from app.rollout.prompt_files import Columns


def _jsonl(path, sources):
    path.write_text("".join(json.dumps({"prompt": "1+1=", "answer": "2", **s}) + "\n" for s in sources))
    return str(path)


def test_auto_names_its_pick_per_data_source_and_falls_back_to_exact_match_aloud(tmp_path, caplog):
    train = _jsonl(tmp_path / "mix.jsonl", [{"data_source": "arith"}, {"data_source": "openai/gsm8k"}, {}])
    val = _jsonl(tmp_path / "val.jsonl", [{"data_source": "aime24"}])
    with caplog.at_level(logging.INFO, logger="app.rewards.by_source"):
        got = name_rewards(load_config(None, []), [train, val])
    assert got == {"aime24": "math", "arith": "exact_match", "mix": "exact_match", "openai/gsm8k": "gsm8k"}
    lines = [r.getMessage() for r in caplog.records]
    assert "reward for data source 'arith': exact_match (reward.fn=auto)" in lines
    assert "reward for data source 'openai/gsm8k': gsm8k (reward.fn=auto)" in lines


def test_several_functions_and_an_environment(tmp_path):
    train = _jsonl(tmp_path / "t.jsonl", [{"data_source": "gsm8k"}])
    cfg = load_config(None, ["reward.fns=[auto,exact_match]", "reward.weights=[1.0,0.5]"])
    assert name_rewards(cfg, [train]) == {"gsm8k": "1 * gsm8k + 0.5 * exact_match"}
    assert name_rewards(load_config(None, ["reward.fn=gsm8k"]), [train]) == {"gsm8k": "gsm8k"}
    cfg = load_config(None, ["env.name=openai_agent"])
    assert name_rewards(cfg, [train]) == {}  # the environment gives the rewards


def test_sources_of_a_parquet_column_a_mapped_key_and_a_long_jsonl(tmp_path, caplog):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"prompt": ["a", "b", "c"], "meta": [{"src": "math"}, {"src": "code"}, {"src": None}]}),
        tmp_path / "p.parquet",
    )
    nested = Columns(data_source="meta.src")
    assert data_sources([str(tmp_path / "p.parquet")], nested) == ["code", "math", "p"]
    pq.write_table(pa.table({"prompt": ["a"]}), tmp_path / "plain.parquet")
    assert data_sources([str(tmp_path / "plain.parquet")]) == ["plain"]
    long = _jsonl(tmp_path / "long.jsonl", [{"data_source": f"s{i}"} for i in range(5)])
    with caplog.at_level(logging.INFO, logger="app.rewards.by_source"):
        assert data_sources([long], limit=3) == ["s0", "s1", "s2"]
    assert any("from its first 3 rows" in r.getMessage() for r in caplog.records)
    assert data_sources([str(tmp_path / "missing.jsonl")]) == []  # the rollouter's checks say why
