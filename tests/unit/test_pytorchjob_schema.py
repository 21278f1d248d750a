"""The PyTorchJobs `shoal launch --target kubernetes` writes, checked against the real schema: Kubeflow
training-operator v1.9.0's PyTorchJob CRD (tests/fixtures/kubeflow, unchanged; its SOURCE.md says where
from). Its openAPIV3Schema holds the pod template as Kubernetes' own PodTemplateSpec schema, generated
from k8s.io/api v0.31.3 (Kubernetes 1.31). Checked strictly: a field the schema does not know is refused,
as `kubectl apply` does by default (strict field validation). Not checked here: `metadata` (the API
server's ObjectMeta rules; the name's DNS-1123 form is checked in test_launch_targets.py) and the one
CEL rule (x-kubernetes-validations) the CRD carries."""

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

from shoal.launch.jobs import JobSpec, render

CRD = Path(__file__).parent.parent / "fixtures" / "kubeflow" / "kubeflow.org_pytorchjobs.yaml"
CONFIG = Path(__file__).parent.parent.parent / "configs" / "gpt-tiny.toml"


def strict(schema):
    """The schema with every object that lists its properties closed to others (unless it keeps unknown
    fields on purpose), as the API server's strict field validation treats them."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def validator():
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = crd["spec"]["versions"]
    assert (crd["spec"]["group"], crd["spec"]["names"]["kind"], version["name"]) == ("kubeflow.org", "PyTorchJob", "v1")
    return jsonschema.Draft4Validator(strict(version["schema"]["openAPIV3Schema"]))


def job(nodes: int, min_nodes: int | None = None, **kw) -> dict:
    spec = JobSpec("kubernetes", str(CONFIG), CONFIG.read_text(), ("train.steps=50",), nodes, kw.pop("nproc", 2),
                   "registry.example.com/shoal:0.1", kw.pop("gpus", 0), kw.pop("cpus", None), "ml.g5.xlarge",
                   kw.pop("pvc", None), min_nodes=min_nodes)
    config_map, pytorchjob = yaml.safe_load_all(render(spec))
    assert config_map["kind"] == "ConfigMap" and set(config_map) == {"apiVersion", "kind", "metadata", "data"}
    return pytorchjob


def errors(validator, manifest: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]


@pytest.mark.parametrize("nodes, min_nodes, kw", [
    (3, None, {"gpus": 2, "pvc": "shared-runs"}),  # Master + 2 Workers, GPUs, a claim for the runs
    (1, None, {"nproc": 1, "cpus": 4}),  # Master only, CPUs asked for
    (4, 2, {}),  # elastic: Workers only and an elasticPolicy
])
def test_each_manifest_is_valid_under_the_operators_own_schema(validator, nodes, min_nodes, kw):
    assert errors(validator, job(nodes, min_nodes, **kw)) == []


@pytest.mark.parametrize("path, key", [
    (("spec",), "pytorchReplicaSpecs"),  # required by the CRD
    (("spec", "pytorchReplicaSpecs", "Master", "template", "spec"), "containers"),  # required by PodSpec
    (("spec", "pytorchReplicaSpecs", "Master", "template", "spec", "containers", 0), "name"),  # by Container
])
def test_removing_a_required_field_fails(validator, path, key):
    manifest = job(2)
    assert errors(validator, manifest) == []
    broken = copy.deepcopy(manifest)
    parent = broken
    for step in path:
        parent = parent[step]
    del parent[key]
    assert any(f"'{key}' is a required property" in e for e in errors(validator, broken)), errors(validator, broken)


def test_a_field_the_schema_does_not_know_is_refused(validator):
    broken = job(2)
    broken["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicyy"] = "OnFailure"
    assert any("'restartPolicyy' was unexpected" in e for e in errors(validator, broken))
    wrong_type = job(2)
    wrong_type["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "1"
    assert any("is not of type 'integer'" in e for e in errors(validator, wrong_type))
