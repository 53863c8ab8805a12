"""The partial-rollout policies (app/rollout/partial.py): each value's answers, the registry, the config's
choices and rules agreeing with it, and the engine adapter asking it (a stand-in engine: no vLLM)."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from app.config import PARTIAL, ConfigError
from app.preflight import load_config
from app.rollout.partial import (
    PARTIAL_POLICIES,
    FinishOnOld,
    Keep,
    Off,
    PartialPolicy,
    Resubmit,
    partial_policy,
)
from app.vllm import engine as vla

# name -> (class, pause_mode, stops_at_once, freezes, spans_versions, adapter_per_version, drains, resubmits,
#          one_version_groups)
ANSWERS = {
    "keep": (Keep, "keep", True, True, True, False, False, False, False),
    "resubmit": (Resubmit, "abort", True, False, False, False, False, True, False),
    "off": (Off, "wait", False, False, False, False, True, False, True),
    "finish_on_old": (FinishOnOld, None, False, False, False, True, False, False, False),
}


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_each_policy_answers_for_its_value(name: str) -> None:
    p = partial_policy(name)
    cls, *answers = ANSWERS[name]
    assert type(p) is cls and isinstance(p, PartialPolicy) and p.name == str(p) == name
    got = [
        p.pause_mode,
        p.stops_at_once,
        p.freezes,
        p.spans_versions,
        p.adapter_per_version,
        p.drains,
        p.resubmits,
        p.one_version_groups,
    ]
    assert got == answers


def test_the_registry_holds_one_instance_per_config_choice() -> None:
    assert sorted(PARTIAL_POLICIES) == sorted(PARTIAL) == sorted(ANSWERS)
    for name, p in PARTIAL_POLICIES.items():
        assert partial_policy(name) is p and pickle.loads(pickle.dumps(p)) is p
        assert repr(p) == f"partial_policy({name!r})"


@pytest.mark.parametrize("name", ["bogus", "Off", "", None, False])
def test_an_unknown_value_is_refused_by_the_registry_and_the_config(name) -> None:
    with pytest.raises(ValueError, match="use one of off, keep, resubmit, finish_on_old"):
        partial_policy(name)
    if isinstance(name, str) and name:
        with pytest.raises(ConfigError, match="rollout.partial"):
            load_config(None, [f"rollout.partial={name}"])


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_the_configs_kept_kv_cache_rule_follows_the_policy(name: str) -> None:
    """`rollout.recompute_kv=false` is accepted exactly where the policy freezes requests across a push."""
    if name == "finish_on_old":
        return  # LoRA only: its own rule refuses it first
    overrides = ["rollout.recompute_kv=false", f"rollout.partial={name}"]
    if partial_policy(name).freezes:
        assert load_config(None, overrides).rollout.recompute_kv is False
    else:
        with pytest.raises(ConfigError, match="rollout.recompute_kv"):
            load_config(None, overrides)


def _engine_class(*capabilities: str) -> type:
    """An engine class with the calls every run needs plus `capabilities`."""

    class Engine:
        def collective_rpc(self): ...
        def pause_generation(self, mode="keep"): ...
        def resume_generation(self): ...

    for c in capabilities:
        setattr(Engine, c, lambda self: None)
    return Engine


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_the_engine_needs_what_the_policy_asks_of_it(name: str) -> None:
    p = partial_policy(name)
    everything = _engine_class("update_weight_version", "add_lora", "remove_lora")
    vla.check_capabilities(everything, p)
    bare = _engine_class()
    needs = [
        c
        for c, need in (("update_weight_version", p.spans_versions), ("add_lora", p.adapter_per_version))
        if need
    ]
    if not needs:
        vla.check_capabilities(bare, p)
        return
    with pytest.raises(vla.EngineCapabilityError, match=f"lacks {needs[0]}.*rollout.partial={name}"):
        vla.check_capabilities(bare, p)


def test_a_policy_that_never_pauses_is_refused_a_pause() -> None:
    with pytest.raises(ValueError, match="finish_on_old never pauses"):
        asyncio.run(vla.pause(object(), partial_policy("finish_on_old")))
