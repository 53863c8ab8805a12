"""MLflow tracking. Monitoring failures are logged, never raised into training; a bad URI fails at start."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def default_uri(run_dir: str) -> str:
    path = Path(run_dir).expanduser().resolve() / "mlflow.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


class Tracker:
    """Thin wrapper over MlflowClient bound to one run (usable from any process that knows the run id)."""

    def __init__(self, uri: str, run_id: str) -> None:
        from mlflow.tracking import MlflowClient

        self.uri, self.run_id = uri, run_id
        self.client = MlflowClient(tracking_uri=uri)

    @classmethod
    def start(cls, uri: str, experiment: str, run_name: str | None, params: dict[str, Any]) -> Tracker:
        from mlflow.tracking import MlflowClient

        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
        run = client.create_run(exp_id, run_name=run_name or None)
        t = cls(uri, run.info.run_id)
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            t.client.log_batch(t.run_id, params=items[i : i + 100])
        return t

    def tags(self, values: dict[str, str]) -> None:
        for k, v in values.items():
            self.client.set_tag(self.run_id, k, str(v))

    def metrics(self, values: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [
            Metric(k.replace("@", "_"), float(v), ts, step)
            for k, v in values.items()
            if isinstance(v, int | float) and math.isfinite(float(v))
        ]
        try:
            self.client.log_batch(self.run_id, metrics=items)
        except Exception as e:  # monitoring must not take training down
            log.warning("MLflow log_batch failed: %s", e)

    def table(self, rows: list[dict[str, Any]], name: str) -> None:
        if not rows:
            return
        cols = {k: [r.get(k) for r in rows] for k in rows[0]}
        try:
            self.client.log_table(self.run_id, data=cols, artifact_file=name)
        except Exception as e:
            log.warning("MLflow log_table failed: %s", e)

    def register(self, artifact_path: str, name: str) -> str | None:
        """Register a logged artifact folder as a new version of model `name`; returns the version."""
        try:
            src = f"runs:/{self.run_id}/{artifact_path}"
            with contextlib.suppress(Exception):
                self.client.create_registered_model(name)
            mv = self.client.create_model_version(name, src, run_id=self.run_id)
            log.info("registered %s as model %s version %s", src, name, mv.version)
            return str(mv.version)
        except Exception as e:
            log.warning("MLflow model registration failed: %s", e)
            return None

    def artifact(self, path: str, artifact_path: str | None = None) -> None:
        try:
            if Path(path).is_dir():
                self.client.log_artifacts(self.run_id, path, artifact_path)
            else:
                self.client.log_artifact(self.run_id, path, artifact_path)
        except Exception as e:
            log.warning("MLflow artifact upload failed: %s", e)

    def text(self, text: str, name: str) -> None:
        try:
            self.client.log_text(self.run_id, text, name)
        except Exception as e:
            log.warning("MLflow log_text failed: %s", e)

    def dict(self, d: dict[str, Any], name: str) -> None:
        self.text(json.dumps(d, indent=2, default=str), name)

    def start_system_metrics(self) -> None:
        """CPU, memory, disk, network (and GPU where present) of this node, sampled every 10 s into the run."""
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._sysmon = SystemMetricsMonitor(self.run_id, sampling_interval=10, tracking_uri=self.uri)
            self._sysmon.start()
        except Exception as e:
            log.warning("MLflow system metrics unavailable: %s", e)

    def reward_curve(self, out_dir: str) -> None:
        """Plot reward/mean and val/reward against the step, save as PNG and log it as an artifact."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(7, 4))
            for key, style in (("reward/mean", "-"), ("val/reward", "o-")):
                hist = sorted(self.client.get_metric_history(self.run_id, key), key=lambda m: m.step)
                if hist:
                    ax.plot([m.step for m in hist], [m.value for m in hist], style, label=key)
            ax.set_xlabel("step (weight version)")
            ax.set_ylabel("reward")
            ax.grid(alpha=0.3)
            ax.legend()
            path = Path(out_dir) / "reward_curve.png"
            fig.savefig(path, dpi=120, bbox_inches="tight")
            plt.close(fig)
            self.artifact(str(path))
        except Exception as e:
            log.warning("reward curve plot failed: %s", e)

    def end(self, status: str = "FINISHED") -> None:
        mon = getattr(self, "_sysmon", None)
        if mon is not None:
            try:
                mon.finish()
            except Exception as e:
                log.warning("stopping system metrics: %s", e)
        try:
            self.client.set_terminated(self.run_id, status=status)
        except Exception as e:
            log.warning("MLflow set_terminated failed: %s", e)
