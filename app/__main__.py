"""Command line: `python -m app train [--config FILE] [--resume PATH] [key=value ...]`, `python -m app config`."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from app.config import ConfigError, describe, load_config

log = logging.getLogger("app")


def _config_reference() -> str:
    lines = ["| key | default | what it does |", "|---|---|---|"]
    for key, default, doc in describe():
        lines.append(f"| `{key}` | `{json.dumps(default)}` | {doc} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app", description="Relay: async RL of LLMs on Ray")
    sub = p.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="run training (the embedded default with no arguments)")
    tr.add_argument("--config", help="a YAML file or a preset name from configs/")
    tr.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    tr.add_argument(
        "--resume",
        metavar="PATH",
        help="continue from a checkpoint (its directory, or a run directory: its newest checkpoint)",
    )
    tr.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=20")
    sub.add_parser("config", help="print the config reference (every key, default, meaning)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.cmd == "config":
        sys.stdout.write(_config_reference() + "\n")
        return 0
    try:
        overrides = list(args.overrides)
        if args.resume:
            overrides.append(f"train.resume={args.resume}")
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        log.error("config error: %s", e)
        return 2
    if args.print_config:
        from omegaconf import OmegaConf

        sys.stdout.write(OmegaConf.to_yaml(cfg))
        return 0
    from app.driver import run

    try:
        result = run(cfg)
    except Exception as e:
        log.exception("run failed: %s", e)
        sys.stdout.write("RESULT " + json.dumps({"ok": False, "error": str(e)[:2000]}) + "\n")
        return 1
    sys.stdout.write("RESULT " + json.dumps({"ok": True, **result}) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
