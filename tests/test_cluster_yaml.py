"""cluster.yaml against the autoscaler schema that ships inside the installed `ray` package."""

import json
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parent.parent


def _schema() -> dict:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def test_cluster_yaml_matches_ray_autoscaler_schema():
    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    jsonschema.validate(cfg, _schema())
    assert cfg["head_node_type"] in cfg["available_node_types"]
    assert cfg["provider"]["type"] == "aws"
    gpu_types = [t for t in cfg["available_node_types"].values() if "InstanceType" in t["node_config"]]
    assert len(gpu_types) >= 3


def test_cluster_yaml_with_defaults_passes_ray_validation():
    from app.infra.ray_compat import validate_cluster_config

    validate_cluster_config(yaml.safe_load((ROOT / "cluster.yaml").read_text()))


def test_schema_catches_a_typo():
    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    cfg["max_wrokers"] = 3
    try:
        jsonschema.validate(cfg, _schema())
    except jsonschema.ValidationError as e:
        assert "max_wrokers" in str(e)
    else:
        raise AssertionError("the schema accepted an unknown top-level key")
