"""Relay from Python: `relay.train(...)` runs what `relay train` (`python -m app train`) runs, in this process,
and returns its RESULT record as a dict.

    import relay

    result = relay.train(
        "quick",                                   # a preset (configs/*.yaml) or a YAML file; None: defaults
        {"train.steps": 20, "train.lr": 1e-5},     # overrides, as a dict or ["key=value", ...]
        train_dataset=[{"prompt": "2+3=", "answer": "5"}, ...],   # list of dicts, pandas, HF Dataset
        reward_funcs=[lambda response, answer: float(response.strip() == answer)],
    )
    result["final_checkpoint"]  # the trained model, an HF folder

Datasets are written once, as JSON lines, under the run folder's root (`run_dir/inputs/<digest>/`), and named
as `data.train` / `data.val`: the rows take every form a data file takes (README "Data"). Reward functions
may be names (`"gsm8k"`, `"pkg.module:fn"`, `"path/reward.py:fn"`) or callables in any of the three styles
(app/rewards/styles.py: plain, verl, TRL). A callable is written with cloudpickle beside the data and loaded
by value in the scoring processes, so a lambda or a notebook's function works; on a cluster of several
machines `run_dir` must then be a folder every machine sees. Several functions are summed with
`reward_weights` (default 1 each), each logged as `reward/<name>`.

An input or config error raises `ConfigError` (or the user error naming the fix) before Ray starts; a failed
run raises what the CLI would report.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["train"]

Rows = Any  # a list of dicts, a pandas DataFrame, or a datasets.Dataset
RewardArg = str | Callable[..., Any]


def _import_app() -> None:
    """Import Relay's code, the package `app` beside this one, as `app`. A folder `app` of the user's own
    first on sys.path (the working directory of `python -c` or `python -m`, a script's folder) would be
    imported in its place, here and in every process spawned with this path: Relay's root is put ahead of
    it (the Ray workers: app/infra/import_path.py). An `app` already imported cannot be replaced."""
    import importlib.machinery
    import sys

    root = Path(__file__).resolve().parent.parent
    if "app" not in sys.modules:
        spec = importlib.machinery.PathFinder.find_spec("app")
        if spec is not None and (spec.origin is None or Path(spec.origin).resolve().parent != root / "app"):
            sys.path.insert(0, str(root))
    import app

    if Path(app.__file__).resolve().parent != root / "app":
        raise ImportError(
            f"the package 'app' imported from {Path(app.__file__).parent} is not Relay's ({root / 'app'}): "
            "import relay and call relay.train before importing a package 'app' of your own, or run from a "
            "folder without one"
        )


def _check_joined_ray() -> None:
    """Where this process already joined Ray (its own `ray.init`), the job's workers take the paths Ray gave
    them then: refused in one line if a user's `app` comes first on them (app/infra/import_path.py)."""
    import sys

    if "ray" not in sys.modules or not sys.modules["ray"].is_initialized():
        return
    from app.infra import import_path, ray_compat

    import_path.check_worker_paths(ray_compat.job_driver_paths())


def _rows(data: Rows, name: str) -> list[dict[str, Any]]:
    """Plain dicts from a list of mappings, a pandas DataFrame or an HF `datasets.Dataset`."""
    if hasattr(data, "to_list") and callable(data.to_list):  # datasets.Dataset
        rows = data.to_list()
    elif hasattr(data, "to_dict") and hasattr(data, "columns"):  # pandas.DataFrame
        rows = data.to_dict(orient="records")
    elif isinstance(data, Iterable) and not isinstance(data, str | bytes | Mapping):
        rows = list(data)
    else:
        raise TypeError(
            f"{name}: expected a list of dicts, a pandas DataFrame or a datasets.Dataset, got {type(data).__name__}"
        )
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(f"{name}: row {i} is a {type(row).__name__}, not a dict of columns")
    if not rows:
        raise ValueError(f"{name}: no rows")
    return [dict(r) for r in rows]


def _store(blob: bytes, folder: Path, filename: str) -> Path:
    """`blob` as `folder/<its digest>/filename`, written once (whole, or not at all): the same content, the
    same file, so a resume finds the inputs it started with."""
    path = folder / hashlib.sha256(blob).hexdigest()[:16] / filename
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(blob)
        tmp.replace(path)
    return path


def _write_rows(rows: list[dict[str, Any]], folder: Path, name: str) -> Path:
    text = "".join(json.dumps(r, default=str) + "\n" for r in rows)
    return _store(text.encode(), folder, f"{name}.jsonl")


def _reward_spec(fn: RewardArg, i: int, folder: Path) -> str:
    """A name as it is; a callable pickled by value into `folder` (named after the function)."""
    if isinstance(fn, str):
        return fn
    if not callable(fn):
        raise TypeError(f"reward_funcs[{i}]: expected a callable or a name, got {type(fn).__name__}")
    import cloudpickle

    name = getattr(fn, "__name__", "")
    name = name if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) else f"reward_{i}"
    return f"pickle:{_store(cloudpickle.dumps(fn), folder, f'{name}.pkl')}"


def _override_list(overrides: Mapping[str, Any] | Sequence[str] | None) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in overrides.items()]
    if isinstance(overrides, str):
        raise TypeError("overrides: expected a dict or a list of 'key=value' strings, got one string")
    return [str(o) for o in overrides]


def inputs_overrides(
    run_dir: str,
    train_dataset: Rows | None = None,
    val_dataset: Rows | None = None,
    reward_funcs: RewardArg | Sequence[RewardArg] | None = None,
    reward_weights: Sequence[float] | None = None,
) -> list[str]:
    """The `key=value` overrides that name the in-memory inputs, written under `run_dir/inputs/`."""
    from app.infra.storage import resolve_run_dir

    folder = Path(resolve_run_dir(run_dir)) / "inputs"
    out: list[str] = []
    if train_dataset is not None:
        out.append(f"data.train={_write_rows(_rows(train_dataset, 'train_dataset'), folder, 'train')}")
    if val_dataset is not None:
        out.append(f"data.val={_write_rows(_rows(val_dataset, 'val_dataset'), folder, 'val')}")
    if reward_funcs is not None:
        fns = (
            [reward_funcs] if isinstance(reward_funcs, str) or callable(reward_funcs) else list(reward_funcs)
        )
        specs = [_reward_spec(f, i, folder) for i, f in enumerate(fns)]
        out.append(f"reward.fn={specs[0]}" if len(specs) == 1 else f"reward.fns={json.dumps(specs)}")
    if reward_weights is not None:
        out.append(f"reward.weights={json.dumps([float(w) for w in reward_weights])}")
    return out


def train(
    config: str | None = None,
    overrides: Mapping[str, Any] | Sequence[str] | None = None,
    *,
    train_dataset: Rows | None = None,
    val_dataset: Rows | None = None,
    reward_funcs: RewardArg | Sequence[RewardArg] | None = None,
    reward_weights: Sequence[float] | None = None,
    resume: str | None = None,
) -> dict[str, Any]:
    """Run one training job as `relay train --config CONFIG key=value ...` would; the RESULT record."""
    _import_app()
    _check_joined_ray()
    from app.config import load_config  # the roles' checks run once, in `run` (app.driver.prepare)
    from app.infra.log_filters import configure_logging, quiet_ray_noise

    quiet_ray_noise()
    given = _override_list(overrides) + ([f"train.resume={resume}"] if resume else [])
    run_dir = str(load_config(config, given).run_dir)
    cfg = load_config(
        config, given + inputs_overrides(run_dir, train_dataset, val_dataset, reward_funcs, reward_weights)
    )
    configure_logging(cfg.log_level)
    from app.driver import run

    return {"ok": True, **run(cfg)}
