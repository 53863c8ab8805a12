"""Logging set-up shared by the driver and every role, and filters for known-harmless third-party warnings.

`configure_logging(level)` gives a process Relay's log format at `log_level` (the config key; Ray workers get
it as RELAY_LOG_LEVEL from the driver's runtime env, so a role can call `configure_logging()` bare).

`silence_vllm_reload_warnings()` runs inside the vLLM worker process (where the worker extension is imported):
on every weight push vLLM's layer-wise reload warns "RotaryEmbedding: Failed to load weights" once per
model. A rotary embedding holds only `cos_sin_cache`, a non-persistent buffer computed from the model config,
so no checkpoint or push contains it; vLLM then puts the layer's own tensors back (reload/layerwise.py,
`finalize_layerwise_reload`), which is exactly right. Only that layer type is silenced: the same warning for
any other layer means weights really went missing and still shows.

Imports nothing heavy (no torch, Ray or vLLM).
"""

from __future__ import annotations

import logging
import os

ENV = "RELAY_LOG_LEVEL"
FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
VLLM_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


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
