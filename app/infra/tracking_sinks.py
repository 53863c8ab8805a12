"""Metric sinks beside MLflow (`tracking.sinks`): TensorBoard and W&B, fed by every `Tracker.metrics` call.

tensorboard  torch.utils.tensorboard's SummaryWriter, into `<run folder>/tensorboard`: `add_scalar` only
             queues, the writer's own thread writes the event file. The driver and trainer rank 0 each write
             an event file of their own there; TensorBoard reads the folder as one run.
wandb        one W&B run per run folder: project `tracking.experiment`, named after the folder, its id kept in
             the folder's tracking.json so that a resume continues it. A process opens the run when it first
             logs (`resume="allow"`) and finishes it when it closes; the driver opens it at start (a missing
             login fails the run there, before Ray starts), then lets it go for the trainer. Metrics are
             logged against `relay/step` (STEP_KEY), not W&B's own step, which only grows: two calls of one
             step, or the steps a resume trains again, would be dropped. `log` queues for W&B's service
             process.

A sink that cannot start raises SinkError at start (a missing package names its `pip install`); one that fails
afterwards is warned about once and never raises into training.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from app.errors import UserError

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
STEP_KEY = "relay/step"


class SinkError(UserError, RuntimeError):
    """A sink of `tracking.sinks` cannot start; the message names it and the fix."""


class Sink(Protocol):
    name: str

    def log(self, values: dict[str, float], step: int) -> None: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars into an event file under `folder` (created), through SummaryWriter's own writer thread."""

    name = "tensorboard"

    def __init__(self, folder: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise SinkError(
                f"tracking.sinks has tensorboard, but it cannot be imported here ({e}): pip install tensorboard "
                "(or pip install 'relay-rl[tensorboard]'), or drop tensorboard from tracking.sinks"
            ) from e
        try:
            self.writer = SummaryWriter(log_dir=str(folder), flush_secs=10)
        except OSError as e:
            raise SinkError(f"tracking.sinks=tensorboard: cannot write into {folder}: {e}") from e

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def release(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run (`run_id`), opened on the first `log` (or `open`), finished by `release`/`close`."""

    name = "wandb"

    def __init__(
        self, project: str, name: str, run_id: str, folder: Path, config: dict[str, Any] | None = None
    ) -> None:
        try:
            import wandb
        except ImportError as e:
            raise SinkError(
                f"tracking.sinks has wandb, but it cannot be imported here ({e}): pip install wandb (or pip "
                "install 'relay-rl[wandb]'), or drop wandb from tracking.sinks"
            ) from e
        self._wandb = wandb
        self._init = {
            "project": project,
            "name": name,
            "id": run_id,
            "resume": "allow",
            "dir": str(folder),
            "config": config,
        }
        self.run: Any = None

    def open(self) -> None:
        if self.run is not None:
            return
        self.run = self._wandb.init(**self._init)
        self._init["config"] = None  # logged by the first process only
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)

    def log(self, values: dict[str, float], step: int) -> None:
        self.open()
        self.run.log({**values, STEP_KEY: step})

    def release(self) -> None:
        """Finish this process's hold of the run (another process opens it next; a later `log` reopens it)."""
        run, self.run = self.run, None
        if run is not None:
            run.finish()

    close = release


class Sinks:
    """The sinks of one process: `log` feeds each; a failure is warned about once per sink, never raised."""

    def __init__(self, sinks: list[Sink] | None = None) -> None:
        self.sinks = list(sinks or [])
        self._warned: set[str] = set()

    def log(self, values: dict[str, float], step: int) -> None:
        if values:
            self._each("log metrics to", lambda s: s.log(values, step))

    def release(self) -> None:
        """Let go what another process takes over (the W&B run), keeping the sinks usable."""
        self._each("hand over", lambda s: s.release())

    def close(self) -> None:
        self._each("close", lambda s: s.close())

    def _each(self, what: str, call: Any) -> None:
        for sink in self.sinks:
            try:
                call(sink)
            except Exception as e:
                if sink.name not in self._warned:
                    self._warned.add(sink.name)
                    log.warning(
                        "tracking sink %s: could not %s it (%s: %s); training goes on, later failures of "
                        "this sink are not reported",
                        sink.name,
                        what,
                        type(e).__name__,
                        str(e)[:300],
                    )


def open_sinks(
    names: list[str], run_dir: Path, project: str, wandb_id: str, config: dict[str, Any] | None = None
) -> Sinks:
    """The sinks of `tracking.sinks` other than MLflow, started for the run folder `run_dir` (the W&B run
    opened: a missing login fails here). Raises SinkError naming the sink and the fix."""
    run_dir = Path(run_dir)
    opened: list[Sink] = []
    try:
        for name in names:
            if name == "tensorboard":
                opened.append(TensorBoardSink(run_dir / TENSORBOARD_DIR))
            elif name == "wandb":
                sink = WandbSink(project, run_dir.name, wandb_id, run_dir, config)
                opened.append(sink)
                _open_wandb(sink)
    except BaseException:
        Sinks(opened).close()
        raise
    return Sinks(opened)


def _open_wandb(sink: WandbSink) -> None:
    try:
        sink.open()
    except Exception as e:
        raise SinkError(
            f"tracking.sinks=wandb: W&B could not start run {sink._init['id']} of project "
            f"{sink._init['project']!r} ({type(e).__name__}: {str(e)[:500]}): log in (`wandb login`, or "
            "WANDB_API_KEY), set WANDB_MODE=offline to keep the run on disk, or drop wandb from tracking.sinks"
        ) from e
