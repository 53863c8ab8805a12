"""Roles take their settings from the typed config (app/config/), never from copies with defaults of their
own: a copy's default drifts from the config's (a generator once waited 300 s for a request the config bounds
at 120 s). The one record that crosses into another process, the chat frontend's `ChatSettings`, has no
defaults and is built from the config it runs with, in every form a role receives it."""

from __future__ import annotations

import ast
from pathlib import Path

from omegaconf import OmegaConf

from app.agent.openai_chat import ChatSettings
from app.config import load_config, to_container, typed

APP = Path(__file__).resolve().parents[1] / "app"


def _settings_classes_with_defaults() -> list[str]:
    """`path:Class.field` for each field given a default in a class of app/ whose name ends in Settings."""
    found = []
    for path in sorted(APP.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Settings"):
                found += [
                    f"{path.relative_to(APP.parent)}:{node.name}.{ast.unparse(f.target)}"
                    for f in node.body
                    if isinstance(f, ast.AnnAssign) and f.value is not None
                ]
    return found


def test_no_settings_class_in_app_keeps_defaults_of_its_own():
    found = _settings_classes_with_defaults()
    assert not found, f"settings with their own defaults (take the config's section instead): {found}"


def test_the_chat_frontends_settings_come_from_the_config_it_runs_with():
    cfg = load_config(None, ["rollout.top_p=0.5", "rollout.request_timeout_s=7", "env.agent_timeout_s=400"])
    for form in (cfg, OmegaConf.create(to_container(cfg)), typed(cfg)):
        chat = ChatSettings.of(form)
        assert (chat.model_name, chat.top_p, chat.request_timeout_s) == ("builtin:tiny", 0.5, 7)
        assert chat.max_tokens == cfg.rollout.max_tokens and chat.session_ttl_s == 800.0
