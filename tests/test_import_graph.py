"""The modules of app/ import each other in no circle: top-level and function-local imports alike (a circle
through a function-local import still ties the two modules' fates together); `if TYPE_CHECKING:` blocks are
left out (annotations only)."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[1] / "app"


def _modules() -> dict[str, Path]:
    mods = {}
    for p in sorted(APP.rglob("*.py")):
        rel = p.relative_to(APP.parent).with_suffix("")
        mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
    return mods


def _targets(cur: str, node: ast.AST, mods: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        names = {a.name for a in node.names}
    else:
        base = node.module or ""
        if node.level:  # relative: from the current package upward
            pkg = cur.split(".") if mods[cur].name == "__init__.py" else cur.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join([*pkg, base] if base else pkg)
        names = {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
    return {n for n in names if n in mods and n != cur}


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    edges = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for n in ast.walk(block)
        }
        edges[name] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in typing_only:
                edges[name] |= _targets(name, node, mods)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_circle_through_three_modules() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_app_modules_import_in_no_circle() -> None:
    edges = import_graph()
    assert len(edges) > 50 and "app.sync" in edges  # the graph covers the package
    found = cycles(edges)
    assert not found, f"modules of app/ import each other in a circle (function-local imports count): {found}"


# the ground floor: what app/config/ may import of app/ (app/errors.py imports nothing of app/ itself)
GROUND_FLOOR = ("app.config", "app.infra", "app.errors")


def _below(name: str, floors: tuple[str, ...]) -> bool:
    return any(name == f or name.startswith(f + ".") for f in floors)


def test_the_config_package_imports_no_role() -> None:
    """app/config/ imports nothing of app/ but app/config, app/infra and app/errors.py: top-level,
    function-local and `if TYPE_CHECKING:` imports alike. The checks that need a role are app/preflight.py's."""
    mods = _modules()
    found = {}
    for name, path in mods.items():
        if not _below(name, ("app.config",)):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                bad = {t for t in _targets(name, node, mods) if not _below(t, GROUND_FLOOR)}
                if bad:
                    found.setdefault(name, set()).update(bad)
    assert len([m for m in mods if _below(m, ("app.config",))]) > 10  # the package is there, split by role
    assert not found, f"app/config/ must import no role (move the check to app/preflight.py): {found}"
    assert not import_graph()["app.errors"], "app/errors.py is below app/config: it imports nothing of app/"


def test_config_plugins_envs_and_the_agent_kind_import_without_torch_ray_or_vllm() -> None:
    """Also the agent's kind (app/agent/kind.py), imported first (app/envs names it as `pkg.module:Name`, so
    the two packages import each other in no order) and found by its built-in name."""
    import subprocess
    import sys

    code = (
        "import app.agent.kind, app.config, app.plugins, app.envs; import sys; "
        "assert app.envs.env_kind('openai_agent') is app.agent.kind.OPENAI_AGENT; "
        "heavy = {'torch', 'ray', 'vllm'} & set(sys.modules); assert not heavy, heavy"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=APP.parent
    )
    assert p.returncode == 0, p.stderr
