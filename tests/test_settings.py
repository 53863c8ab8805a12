"""Role settings read from config sections by field name (app/infra/settings.py): every role's settings come
from the config it runs with, typed or as the plain DictConfig a Ray actor receives, and a field no section
holds (a renamed key) or two sections hold fails instead of keeping a default."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf

from app.config import AlgorithmConfig, RolloutConfig, TrainConfig, load_config, to_container, typed
from app.envs.agent.openai_chat import ChatSettings
from app.infra.settings import from_sections
from app.rollout.episode import EpisodeLimits
from app.rollout.generator import GenSettings
from app.rollout.producer import ProducerSettings


def test_every_role_reads_its_settings_from_the_config_it_runs_with():
    cfg = load_config(None, ["rollout.top_p=0.5", "reward.on_error=-1", "train.batch_groups=3", "seed=9"])
    for form in (cfg, OmegaConf.create(to_container(cfg)), typed(cfg)):
        gen = GenSettings.from_cfg(form)
        assert (gen.top_p, gen.seed, gen.stop, gen.lengths) == (0.5, 9, (), None)
        assert EpisodeLimits.from_cfg(form).on_error == -1.0
        assert ProducerSettings.from_cfg(form).batch_groups == 3
        chat = ChatSettings.from_cfg(form)
        assert (chat.model_name, chat.top_p, chat.max_sessions) == ("builtin:tiny", 0.5, 100_000)


@dataclass
class _Both:
    seed: int = 0
    n: int = 8


def test_a_field_no_section_or_two_sections_hold_is_an_error():
    rollout, algorithm = RolloutConfig(n=4), AlgorithmConfig()
    assert from_sections(_Both, rollout, seed=3) == _Both(seed=3, n=4)
    with pytest.raises(TypeError, match=r"_Both.seed: none of the config sections"):
        from_sections(_Both, rollout)  # no section has `seed`: not silently the default
    with pytest.raises(TypeError, match=r"_Both.n: 2 of the config sections"):
        from_sections(_Both, rollout, OmegaConf.create({"n": 2}), seed=1)
    assert from_sections(_Both, rollout, own=("seed",)).seed == 0
    with pytest.raises(TypeError, match="has no field max_staleness"):
        from_sections(_Both, rollout, algorithm, TrainConfig(), seed=1, max_staleness=2.0)
