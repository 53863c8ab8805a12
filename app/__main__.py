"""Command line: `python -m app train [--config FILE] [--resume PATH] [key=value ...]`,
`python -m app eval [--checkpoint PATH] [--data FILE] [--config FILE] [--print-config] [key=value ...]`,
`python -m app config`.

`train` and `eval` print one line `RESULT {json}` as the very last line of their stdout (a program reads the run's
outcome from it): Ray is disconnected first, so no worker log line or progress bar can follow it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from app.config import REFERENCE_PATH, ConfigError, reference_markdown
from app.errors import user_error
from app.infra.log_filters import configure_logging, quiet_ray_noise
from app.preflight import load_config

log = logging.getLogger("app")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m app", description="Relay: async RL of LLMs on Ray")
    sub = p.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="run training (the embedded default with no arguments)")
    tr.add_argument(
        "--config",
        action="append",
        help="a YAML file or a preset name from configs/; several merge left to right "
        "(--config gsm8k --config lora)",
    )
    tr.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    tr.add_argument(
        "--resume",
        metavar="PATH",
        help="continue from a checkpoint (its directory, or a run directory: its newest checkpoint)",
    )
    tr.add_argument(
        "--resume-with-new-data",
        action="store_true",
        help="with --resume: allow other training data (data.train) than the checkpoint's; its prompt queue "
        "is dropped and the new data starts its first epoch",
    )
    tr.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=20")
    ev = sub.add_parser(
        "eval", help="mean@n and pass@k per data source of a checkpoint on a prompt file (eval.* keys)"
    )
    ev.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="an HF model folder, a run directory (its newest weights) or one of its checkpoints "
        "(eval.checkpoint; none: model.path)",
    )
    ev.add_argument("--data", metavar="FILE", help="the prompt file (eval.data; none: data.val)")
    ev.add_argument(
        "--config",
        action="append",
        help="a YAML file or a preset name, several merge left to right (default: the settings of the run "
        "that wrote the weights)",
    )
    ev.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    ev.add_argument("overrides", nargs="*", help="key=value overrides, e.g. eval.n=8 eval.k=[1,8]")
    ref = sub.add_parser(
        "config", help="print the config reference (every key, default, valid values, meaning)"
    )
    ref.add_argument("--write", action="store_true", help=f"write it to {REFERENCE_PATH.name} under docs/")
    return p


def _quiet_progress_bars() -> None:
    """No progress bars in logs: where stderr is not a terminal, tqdm (the trainer's tqdm_ray bar that the
    driver draws, vLLM's and HF's bars in the workers, which inherit this environment) stays off. Ray's driver
    redraws such a bar after every worker log line, so in a log file each line ended in the bar's text."""
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")


def _emit_result(payload: dict[str, Any]) -> None:
    """`RESULT {json}` as the last line of stdout, on a line of its own."""
    if "ray" in sys.modules:  # stop the log monitor: nothing a worker prints may follow RESULT
        import ray

        if ray.is_initialized():
            ray.shutdown()
    sys.stderr.flush()
    # on a terminal a progress bar may have left the cursor mid-line
    sys.stdout.write(("\n" if sys.stdout.isatty() else "") + "RESULT " + json.dumps(payload) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging("INFO")
    if args.cmd == "config":
        if args.write:
            REFERENCE_PATH.parent.mkdir(parents=True, exist_ok=True)
            REFERENCE_PATH.write_text(reference_markdown())
            log.info("wrote %s", REFERENCE_PATH)
        else:
            sys.stdout.write(reference_markdown())
        return 0
    if args.cmd == "eval":
        return _evaluate(args)
    cfg = _loaded(args, lambda: load_config(args.config, _train_overrides(args)))
    if isinstance(cfg, int):
        return cfg
    from app.driver import launch, prepare

    try:
        prepared = prepare(cfg, resume_with_new_data=args.resume_with_new_data)
    except Exception as e:  # an input error, found before anything started: the user's to fix (exit 2)
        return _failed(e, 2 if user_error(e) is not None else 1)
    try:
        result = launch(cfg, prepared)
    except Exception as e:
        return _failed(e, 1)
    _emit_result({"ok": True, **result})
    return 0


def _train_overrides(args: argparse.Namespace) -> list[str]:
    """The command line's overrides, with `--resume PATH` as `train.resume=PATH`."""
    if args.resume_with_new_data and not args.resume:
        raise ConfigError("--resume-with-new-data applies to a resume: give --resume PATH too, or drop it")
    return [*args.overrides, *([f"train.resume={args.resume}"] if args.resume else [])]


def _loaded(args: argparse.Namespace, load: Callable[[], Any]) -> Any:
    """`load()`'s config, with the run's log level and quiet bars; or the exit code: 2 after one "config error:"
    line (and its RESULT line), 0 after `--print-config` wrote the config."""
    try:
        quiet_ray_noise()  # before Ray is imported: a clean run's shutdown lines are not printed as failures
        cfg = load()
    except (ConfigError, ValueError) as e:
        log.error("config error: %s", e)
        _emit_result({"ok": False, "error": f"config error: {e}"[:2000]})
        return 2
    configure_logging(cfg.log_level)
    if args.print_config:
        from omegaconf import OmegaConf

        sys.stdout.write(OmegaConf.to_yaml(cfg))
        return 0
    _quiet_progress_bars()
    return cfg


def _failed(e: Exception, code: int) -> int:
    """Report `e` (`_report_failure`), print its RESULT line; `code`."""
    _report_failure(e)
    _emit_result({"ok": False, "error": str(user_error(e) or e)[:2000]})
    return code


def _report_failure(e: Exception) -> None:
    """A user error (a missing data file, a model path, a checkpoint that does not fit: app/errors.py) is one
    line that names the fix, its traceback only at log_level=DEBUG; anything else is a crash, with its
    traceback."""
    found = user_error(e)
    if found is None:
        log.exception("run failed: %s", e)
        return
    log.error("%s", found)
    log.debug("traceback of the error above (log_level=DEBUG)", exc_info=e)


def _evaluate(args: argparse.Namespace) -> int:
    """`python -m app eval` (app/evaluation/command.py): RESULT {json} with the scores per data source."""
    from app.evaluation import command

    overrides = list(args.overrides)
    overrides += [f"eval.checkpoint={args.checkpoint}"] if args.checkpoint else []
    overrides += [f"eval.data={args.data}"] if args.data else []
    cfg = _loaded(args, lambda: command.load(args.config, overrides))
    if isinstance(cfg, int):
        return cfg
    try:
        result = command.run(cfg)
    except (
        FileNotFoundError
    ) as e:  # a checkpoint, model or prompt file that is not there: the message says it
        log.error("%s", e)
        _emit_result({"ok": False, "error": str(e)[:2000]})
        return 1
    except Exception as e:
        return _failed(e, 1)
    _emit_result({"ok": True, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
