"""Logging set-up shared by the driver and every role, and filters for known-harmless third-party warnings.

`configure_logging(level)` gives a process Relay's log format at `log_level` (the config key; Ray workers get
it as RELAY_LOG_LEVEL from the driver's runtime env, so a role can call `configure_logging()` bare).

`silence_vllm_reload_warnings()` runs inside the vLLM worker process (where the worker extension is imported):
on every weight push vLLM's layer-wise reload warns "RotaryEmbedding: Failed to load weights" once per
model. A rotary embedding holds only `cos_sin_cache`, a non-persistent buffer computed from the model config,
so no checkpoint or push contains it; vLLM then puts the layer's own tensors back (reload/layerwise.py,
`finalize_layerwise_reload`), which is exactly right. Only that layer type is silenced: the same warning for
any other layer means weights really went missing and still shows.

`quiet_ray_noise()` runs in the driver before Ray is imported: it gives Ray's documented log filter
(`RAY_DEDUP_LOGS_SKIP_REGEX`, read once when Ray is imported, applied where the driver prints its workers' and
the raylet's lines) the lines that Ray, Serve, Ray Train and vLLM print on every clean run and that read as
failures (RAY_NOISE, each with why it is harmless). A user's own RAY_DEDUP_LOGS_SKIP_REGEX is kept beside
it; RAY_DEDUP_LOGS=0 (Ray's switch) prints every line again. The causes Relay controls are fixed where they
arise instead: the driver stops the actors that hold Serve handles before Serve's apps, deletes the apps
before the cluster stops (no `serve.shutdown()`, whose own call dies with the controller), and the trainer
destroys its process group at a clean end (app/driver.py `teardown`, app/train_loop.py `train_worker`).

Imports nothing heavy (no torch, Ray or vLLM).
"""

from __future__ import annotations

import logging
import os
import re
import sys

ENV = "RELAY_LOG_LEVEL"
FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
VLLM_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RAY_SKIP_ENV = "RAY_DEDUP_LOGS_SKIP_REGEX"
# Lines of a clean run that say nothing is wrong. Each pattern is as narrow as the message allows.
RAY_NOISE: dict[str, str] = {
    # Serve's controller kills itself at the end of its graceful shutdown while a caller's call on it (the
    # shutdown request itself, a handle's long poll) is pending; the core worker reports the dead call
    "serve-controller-killed": r"Task ServeController\.\w+ failed\. There are infinite retries remaining, so "
    r"the task will be retried\. Error: The actor is dead because it was killed by `ray\.kill`",
    # Serve's controller narrating a replica's stop (Relay's weight hub logs a replica that leaves)
    "serve-replica-stop": r"controller \d+ -- (Removing \d+ replicas? from Deployment\(|Replica\(id='[^']*', "
    r"deployment='[^']*', app='[^']*'\) is stopped\.)",
    # the raylet counts started worker processes against min(cores, num_cpus): on a 2-core machine every run
    # with Serve, Train and Data actors passes it (a hint about start-up load, not a failure)
    "raylet-startup-concurrency": r"WARNING: \d+ PYTHON worker processes have been started on node: \S+ with "
    r"address: \S+, which is \d+x the maximum expected startup concurrency",
    # Ray Train's placement-group cleaner (a safety net for a controller that dies without cleaning up)
    # polls the dashboard's state API every second and warns on each failed poll
    "train-pg-cleaner": r"Failed to query Ray Train Controller actor state\. State API may be temporarily "
    r"unavailable\. Continuing to monitor\.",
    # vLLM's engine shutdown inside a stopping replica: worker processes still exiting after its grace period
    # are ended by vLLM itself
    "vllm-shutdown": r"\[shutdown\] (Executor: workers still running after grace period; sending SIGTERM|"
    r"Process manager: force killing remaining process|force killing sub process VLLM::)",
    # an NCCL process group of a process that exits (the weight group's side groups on GPUs)
    "nccl-destroy": r"WARNING: destroy_process_group\(\) was not called before program exit",
}


def configure_logging(level: str | None = None) -> str:
    """Relay's format on the root logger at `level` (default: $RELAY_LOG_LEVEL, else INFO); returns the level.

    Safe to call again (the driver does once the config is read): the handler is added once, the level reset.
    """
    name = (level or os.environ.get(ENV) or "INFO").upper()
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format=FORMAT)
    root.setLevel(name)
    return name


class RotaryReloadFilter(logging.Filter):
    """Drops vLLM's "<...>RotaryEmbedding: Failed to load weights" (expected on every push, see module doc)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (
            msg.endswith(": Failed to load weights") and msg.split(":", 1)[0].endswith("RotaryEmbedding")
        )


def silence_vllm_reload_warnings() -> None:
    """Install RotaryReloadFilter on vLLM's reload logger (idempotent; before or after vLLM is imported)."""
    logger = logging.getLogger(VLLM_RELOAD_LOGGER)
    if not any(isinstance(f, RotaryReloadFilter) for f in logger.filters):
        logger.addFilter(RotaryReloadFilter())


def ray_noise_regex() -> str:
    """One regex that matches any RAY_NOISE line."""
    return "|".join(f"(?:{p})" for p in RAY_NOISE.values())


def quiet_ray_noise() -> bool:
    """Have Ray's driver drop the RAY_NOISE lines (see module doc); call before Ray is imported. Returns
    False where Ray was imported already (the filter is then as Ray read it at import)."""
    ours = ray_noise_regex()
    theirs = os.environ.get(RAY_SKIP_ENV, "")
    if ours not in theirs:
        os.environ[RAY_SKIP_ENV] = f"{theirs}|{ours}" if theirs else ours
    if theirs:
        try:  # Ray would fail on it at import, naming neither the variable nor the fix
            re.compile(theirs)
        except re.error as e:
            raise ValueError(
                f"{RAY_SKIP_ENV}={theirs!r} is not a regular expression ({e}): correct it or unset it"
            ) from e
    return "ray" not in sys.modules
