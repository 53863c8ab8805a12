"""app/driver.py's start: the run folder opens while Ray starts, and what one opened is closed where the other
fails; a local cluster's runtime environment turns Ray Train's preemption watcher off (no Ray started)."""

from __future__ import annotations

import threading

import pytest
import ray

from app import driver
from app.infra import ray_compat
from app.preflight import load_config


class _Folder:
    def __init__(self) -> None:
        self.closed: list[str] = []

    def close(self, status: str) -> None:
        self.closed.append(status)


def test_the_folder_opens_in_another_thread_while_ray_starts(monkeypatch):
    seen: dict[str, object] = {}
    folder = _Folder()

    def open_folder():
        seen["folder_thread"] = threading.current_thread().name
        return folder

    def start_ray(cfg):
        seen["ray_thread"] = threading.current_thread().name
        return True

    monkeypatch.setattr(driver, "start_ray", start_ray)
    rec, started = driver.open_run_beside_ray(load_config(None, []), open_folder)
    assert rec is folder and started is True and not folder.closed
    assert seen["ray_thread"] == threading.main_thread().name != seen["folder_thread"]


def test_a_failed_ray_start_closes_the_folder(monkeypatch):
    folder = _Folder()

    def start_ray(cfg):
        raise ConnectionError("no cluster")

    monkeypatch.setattr(driver, "start_ray", start_ray)
    with pytest.raises(ConnectionError, match="no cluster"):
        driver.open_run_beside_ray(load_config(None, []), lambda: folder)
    assert folder.closed == ["FAILED"]


@pytest.mark.parametrize("started", [True, False])
def test_a_failed_folder_stops_only_a_cluster_this_run_started(monkeypatch, started):
    stopped: list[bool] = []
    monkeypatch.setattr(driver, "start_ray", lambda cfg: started)
    monkeypatch.setattr(ray, "shutdown", lambda: stopped.append(True))

    def open_folder():
        raise FileExistsError("a live run holds it")

    with pytest.raises(FileExistsError, match="a live run"):
        driver.open_run_beside_ray(load_config(None, []), open_folder)
    assert stopped == ([True] if started else [])


def test_a_local_cluster_runs_without_the_preemption_watcher(monkeypatch):
    calls: list[dict] = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    assert driver.start_ray(load_config(None, [])) is True
    assert calls[0]["address"] == "local"
    assert calls[0]["runtime_env"]["env_vars"]["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"


def test_a_given_cluster_keeps_its_preemption_watcher(monkeypatch):
    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    assert driver.start_ray(load_config(None, ["ray.address=ray://elsewhere:10001"])) is False
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in calls[0]["runtime_env"]["env_vars"]


def test_a_trainer_on_the_runs_own_cluster_has_no_placement_group_cleaner():
    """Ray Train 2.60 builds its cleaner among the default callbacks when `fit` starts; the wrapped trainer
    builds every other one."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    def kinds(trainer) -> list[type]:
        return [type(c) for c in trainer._create_default_callbacks()]

    plain = kinds(TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1)))
    assert PlacementGroupCleanerCallback in plain
    own = ray_compat.without_pg_cleaner(
        TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1))
    )
    assert kinds(own) == [k for k in plain if k is not PlacementGroupCleanerCallback]
