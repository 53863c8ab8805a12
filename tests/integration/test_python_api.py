"""`relay.train(...)` from a Python program: an in-memory dataset and a lambda reward, on the shared cluster,
to a RESULT (its inputs' conversion: tests/test_python_api.py). The program runs in a folder with a package
`app` of its own that fails when imported: the driver and the run's workers import Relay's
(app/infra/import_path.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent(
    """
    import json, pathlib, sys
    import relay

    address, run_dir, cache, data = sys.argv[1:5]
    rows = [json.loads(x) for x in pathlib.Path(data).read_text().splitlines() if x.strip()]
    result = relay.train(
        "quick",
        {"train.steps": 2, "train.workers": 1, "algorithm.val_every": 2, "ray.address": address,
         "ray.name": "pyapi", "run_dir": run_dir, "model.cache_dir": cache, "tracking.run_name": "pyapi"},
        train_dataset=rows[:64],
        val_dataset=rows[64:80],
        reward_funcs=[lambda response, answer: float(response.strip() == answer.strip())],
    )
    print("API_RESULT " + json.dumps(result, default=str))
    """
)


def test_relay_train_from_python_with_rows_and_a_lambda(ray_cluster, cache_dir, tmp_path):
    from app.tasks.tiny import ensure_builtin

    data = ensure_builtin(str(cache_dir)) / "train.jsonl"
    (tmp_path / "app").mkdir()  # the user's own package `app`, first on the program's path (`-c`: its folder)
    (tmp_path / "app" / "__init__.py").write_text('raise RuntimeError("user app imported")\n')
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, ray_cluster["address"], str(tmp_path), str(cache_dir), str(data)],
        cwd=tmp_path,  # not the repository: the installed package is what a user imports
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "user app imported" not in proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("API_RESULT ")]
    res = json.loads(line[len("API_RESULT ") :])
    assert res["ok"] is True and res["steps"] == 2, res
    assert (tmp_path / "pyapi" / "final" / "config.json").exists() or res["final_checkpoint"]
    config = (tmp_path / "pyapi" / "config.yaml").read_text()
    assert "pickle:" in config and str(tmp_path / "inputs") in config
