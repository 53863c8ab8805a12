"""A user's own package `app` never shadows Relay's (app/infra/import_path.py, relay/__init__.py): the driver
paths Ray gives its workers put Relay's root first where a folder among them holds an `app`; a job whose paths
Relay did not order is refused in one line; `python -c` children and the driver of `relay.train` import Relay's.
No cluster: Ray's side is simulated from its 2.60 sources (what `connect` appends, how a worker inserts)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.infra import import_path, ray_compat
from app.infra.import_path import ROOT, ShadowedError, check_worker_paths, foreign_app, worker_paths

BOOM = 'raise RuntimeError("user app imported")\n'


def _user_folder(tmp_path: Path, name: str = "project") -> Path:
    """A project folder with a package `app` of its own that fails when imported."""
    folder = tmp_path / name
    (folder / "app").mkdir(parents=True)
    (folder / "app" / "__init__.py").write_text(BOOM)
    return folder


def _worker_sys_path(driver_paths: list[str], base: list[str]) -> list[str]:
    """A Ray 2.60 worker's sys.path after `maybe_initialize_job_config`: each driver path inserted at 0."""
    path = list(base)
    for p in driver_paths:
        path.insert(0, p)
    return path


def _first_app(path: list[str]) -> str:
    """The folder on `path` whose `app` an import finds first."""
    return next(p for p in path if p == ROOT or foreign_app(p))


def test_foreign_app_finds_a_package_a_module_and_a_namespace_folder_but_not_relays(tmp_path):
    assert foreign_app(str(_user_folder(tmp_path))).endswith("app/__init__.py")
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "app.py").write_text(BOOM)
    assert foreign_app(str(tmp_path / "mod")).endswith("app.py")
    (tmp_path / "ns" / "app").mkdir(parents=True)
    assert foreign_app(str(tmp_path / "ns")) == str(tmp_path / "ns" / "app")
    (tmp_path / "none").mkdir()
    assert foreign_app(str(tmp_path / "none")) is None
    assert foreign_app(ROOT) is None


def test_worker_paths_put_relays_root_first_on_a_worker_only_where_an_app_would_shadow_it(tmp_path):
    user = str(_user_folder(tmp_path))
    script = str(tmp_path / "bin")
    base = ["/ray/_private/workers", "/site-packages"]
    # Ray appends the script folder, then the working directory: the working directory ends up first
    assert _first_app(_worker_sys_path([script, user], [*base, ROOT])) == user
    ordered = worker_paths([script, user])
    assert ordered == [script, user, ROOT]
    worker = _worker_sys_path(ordered, base)
    assert worker[0] == ROOT and _first_app(worker) == ROOT
    check_worker_paths(ordered)  # what Relay ordered passes its own check
    # nothing to shadow: the paths stay as Ray made them (Relay's root not added anywhere)
    (tmp_path / "plain").mkdir()
    assert worker_paths([script, str(tmp_path / "plain")]) == [script, str(tmp_path / "plain")]
    assert worker_paths([ROOT]) == [ROOT]  # run from Relay's own checkout


def test_check_worker_paths_refuses_a_job_ray_started_from_a_folder_with_its_own_app(tmp_path):
    user = str(_user_folder(tmp_path))
    with pytest.raises(ShadowedError) as e:
        check_worker_paths([str(tmp_path / "bin"), user])
    msg = str(e.value)
    assert "\n" not in msg and user in msg and f"{ROOT}/app" in msg and "before ray.init" in msg
    check_worker_paths([user, ROOT])  # Relay's root inserted last: first on the workers' path
    check_worker_paths([str(tmp_path)])


def test_job_config_orders_the_paths_ray_appends_when_it_sends_the_config():
    """What `ray.init` does with the job config (Ray 2.60's `connect`): extend the driver paths, then
    serialize; the order function sees the paths Ray appended, and the protobuf carries its result."""
    source = inspect.getsource(__import__("ray._private.worker", fromlist=["connect"]).connect)
    extend, serialize = source.index("_py_driver_sys_path.extend("), source.index("job_config._serialize()")
    assert extend < serialize  # Ray appends its paths before it serializes: the order function sees them

    seen = []
    job = ray_compat.job_config(lambda paths: seen.append(list(paths)) or [*paths, "/relay"])
    job._py_driver_sys_path.extend(["/script", "/cwd"])
    pb = job._get_proto_job_config()
    assert seen == [["/script", "/cwd"]] and list(pb.py_driver_sys_path) == ["/script", "/cwd", "/relay"]
    assert job._serialize() == pb.SerializeToString() and len(seen) == 1  # ordered once


def test_python_c_child_imports_relays_app_from_a_folder_with_its_own(tmp_path):
    user = _user_folder(tmp_path)
    out = subprocess.run(
        import_path.python_c("import app; print(app.__file__)"),
        cwd=user,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(Path(ROOT) / "app" / "__init__.py")


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -c code` in `cwd` (first on its path), with this checkout's `relay` importable after it."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": ROOT},
    )


def test_relay_imports_its_own_app_ahead_of_the_working_directorys(tmp_path):
    user = _user_folder(tmp_path)
    out = _python(
        "import relay, sys; relay._import_app(); import app; print(app.__file__, sys.path[0])", user
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(Path(ROOT) / "app" / "__init__.py"), ROOT]
    # nothing to shadow: the caller's sys.path is left as it was
    (tmp_path / "plain").mkdir()
    out = _python("import relay, sys; relay._import_app(); print(sys.path[0])", tmp_path / "plain")
    assert out.returncode == 0 and out.stdout.strip() == "", out.stderr


def test_relay_refuses_a_users_app_already_imported_in_one_line(tmp_path):
    user = tmp_path / "project"
    (user / "app").mkdir(parents=True)
    (user / "app" / "__init__.py").write_text("")
    out = _python("import app, relay; relay._import_app()", user)
    assert out.returncode != 0
    (last,) = [ln for ln in out.stderr.splitlines() if ln.startswith("ImportError")]
    assert str(user / "app") in last and "is not Relay's" in last and "before importing" in last


def test_relay_train_refuses_a_ray_job_joined_from_a_folder_with_its_own_app(tmp_path, monkeypatch):
    """A caller that ran `ray.init` itself: the job's driver paths (as Ray recorded them) are checked."""
    import types

    import relay

    user = str(_user_folder(tmp_path))
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setattr(ray_compat, "job_driver_paths", lambda: [str(tmp_path), user])
    with pytest.raises(ShadowedError, match="call relay.train before ray.init"):
        relay._check_joined_ray()
    monkeypatch.setattr(ray_compat, "job_driver_paths", lambda: [str(tmp_path), user, ROOT])
    relay._check_joined_ray()
