"""The config reference, docs/config.md (`python -m app config --write`): every key, its default, the
values it accepts and what it does, read from the field docstrings of the section modules."""

from __future__ import annotations

import ast
import inspect
import json
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from app.config.keys import constraint
from app.config.tree import RelayConfig

REFERENCE_PATH = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _field_docs(module: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> the docstring under that field, for the dataclasses of `module`."""
    docs: dict[tuple[str, str], str] = {}
    tree = ast.parse(inspect.getsource(sys.modules[module]))
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            body = node.body
            for i, stmt in enumerate(body):
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and i + 1 < len(body)
                ):
                    nxt = body[i + 1]
                    if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                        docs[(node.name, stmt.target.id)] = " ".join(str(nxt.value.value).split())
    return docs


def describe() -> list[tuple[str, Any, str]]:
    """(key, default, doc) for every leaf key, read from the field docstrings in each section's module."""
    out: list[tuple[str, Any, str]] = []

    def walk(cls: type, prefix: str) -> None:
        docs = _field_docs(cls.__module__)
        for f in fields(cls):
            default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
            if is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")
            else:
                out.append((f"{prefix}{f.name}", default, docs.get((cls.__name__, f.name), "")))

    walk(RelayConfig, "")
    return out


def reference_markdown() -> str:
    """docs/config.md: every key, its default, what it accepts and what it does (`python -m app config`)."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from app/config/ by `python -m app config --write`; do not edit by hand. -->",
        "",
        "Every key of the config tree, its default, the values it accepts and what it does. Set keys in a YAML",
        "file (`--config FILE.yaml` or a preset from `configs/`) or as `key=value` overrides; an unknown key or",
        "an invalid value fails at load, naming the key, the value, what is valid and the fix. Choices are",
        "matched exactly (`rollout.partial=off`; YAML's `no`/`false` are not `off`), and every number must be",
        "finite.",
        "",
        "| key | default | valid | what it does |",
        "|---|---|---|---|",
    ]
    for key, default, doc in describe():
        lines.append(f"| `{key}` | `{json.dumps(default)}` | {constraint(key)} | {doc} |")
    return "\n".join(lines) + "\n"
