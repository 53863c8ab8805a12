"""Every extension point takes a dotted path through one loader (app/plugins.py): a reward, a loss, a batch
source, an environment and a weight transport from a module outside app/ (tests/plugins_example.py), loaded by
the same code the run uses; typos are refused at config load, naming the key."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.config import ConfigError
from app.plugins import PluginError, resolve
from app.preflight import load_config
from tests import plugins_example as ext

M = "tests.plugins_example"


def test_a_users_extensions_load_by_dotted_path_with_no_change_to_app():
    cfg = load_config(
        None,
        [
            f"reward.fn={M}:length_reward",
            f"algorithm.correction={M}:loss",
            f"algorithm.mode={M}:LoggedSyncSource",
            f"env.name={M}:calculator_env",
            f"sync.transport={M}:CountingTransport",
        ],
    )
    from app.envs import make_factory
    from app.rewards import resolve_reward_fn
    from app.trainer.losses import LOSSES
    from app.trainer.sources import SOURCES
    from app.weights.transport import make_transport

    assert resolve_reward_fn(cfg.reward.fn) is ext.length_reward
    assert resolve("algorithm.correction", cfg.algorithm.correction, LOSSES) is ext.loss  # as the learner
    source_cls = resolve("algorithm.mode", cfg.algorithm.mode, SOURCES)  # as the train loop
    assert source_cls is ext.LoggedSyncSource
    assert source_cls(cfg, SimpleNamespace(rollouter=None)).batches == 0
    assert make_factory(cfg.env.name, cfg) is ext.CalculatorEnv  # as the rollouter
    assert isinstance(make_transport(cfg.sync.transport), ext.CountingTransport)  # as both ends of the push
    # built-in names still resolve through the same loader
    assert resolve("algorithm.mode", "sync", SOURCES) is SOURCES["sync"]


@pytest.mark.parametrize(
    "override,named",
    [
        (f"algorithm.correction={M}:no_such_loss", "has no attribute 'no_such_loss'"),
        ("algorithm.mode=nowhere.at_all:Source", "cannot import module 'nowhere.at_all'"),
        (f"env.name={M}:calculator_envv", "has no attribute 'calculator_envv'"),
        ("algorithm.correction=tiss", "did you mean tis?"),
    ],
)
def test_a_wrong_extension_is_refused_at_load_naming_the_key(override, named):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert key in str(e.value) and named in str(e.value), str(e.value)


def test_resolve_names_the_form_it_expects():
    with pytest.raises(PluginError, match=r"env.agent='oops': expected a dotted path 'pkg.module:Name'"):
        resolve("env.agent", "oops")
    with pytest.raises(PluginError, match=r"a built-in \('a', 'b'\)"):
        resolve("k", "c", {"a": 1, "b": 2})


def test_a_kind_of_environment_checks_its_own_keys_at_load_and_needs_no_name_check():
    from app.agent.kind import OpenAIAgentKind
    from app.envs import EnvKind, env_kind, make_factory

    cfg = load_config(None, [f"env.name={M}:two_turn_calculator", "env.max_turns=2"])
    assert (
        env_kind(cfg.env.name) is ext.two_turn_calculator
        and make_factory(cfg.env.name, cfg) is ext.CalculatorEnv
    )
    with pytest.raises(ConfigError, match=r"'env.max_turns': 1: the calculator needs a turn to call"):
        load_config(None, [f"env.name={M}:two_turn_calculator", "env.max_turns=1"])
    plain = env_kind(f"{M}:calculator_env")  # a plain function is a kind whose hooks do nothing
    assert type(plain) is EnvKind and plain.before_serve(cfg) is cfg and plain(cfg, None) is ext.CalculatorEnv
    assert isinstance(env_kind("openai_agent"), OpenAIAgentKind) and type(env_kind("")) is EnvKind
