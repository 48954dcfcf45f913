"""Reading an AlpaJob manifest (``alpajob.api.resource``): errors name the field, every
example loads."""

import copy
from pathlib import Path

import pytest

from alpajob.api.errors import ManifestError
from alpajob.api.resource import load_job, parse_job
from alpajob.api.spec import Method

EXAMPLES = sorted((Path(__file__).parent.parent / "manifests" / "examples").glob("*.yaml"))
BASE = {
    "apiVersion": "alpajob.io/v1alpha1",
    "kind": "AlpaJob",
    "metadata": {"name": "t"},
    "spec": {"model": {"zoo": "gpt", "config": "tiny"}},
}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_load(path):
    manifest = load_job(path)
    assert manifest.kind == "AlpaJob"


def test_defaults():
    manifest = parse_job(BASE)
    assert manifest.spec.parallelism.method is Method.AUTO
    assert manifest.spec.parallelism.schedule == "1f1b"
    assert manifest.spec.training.global_batch_size == 1024


def test_gpu_preset_from_node_selector():
    data = copy.deepcopy(BASE)
    data["spec"]["cluster"] = {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}
    assert parse_job(data).spec.cluster.preset() == "h100-80gb"


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("spec", "training"), {"globalBatchSize": 0}, "spec.training.globalBatchSize"),
        (("spec", "training"), {"globalBatchSiz": 8}, "spec.training.globalBatchSiz"),
        (("spec", "training"), {"dtype": "float8"}, "spec.training.dtype"),
        (("spec", "cluster"), {"nodes": 0}, "spec.cluster.nodes"),
        (("spec", "parallelism"), {"method": "magic"}, "spec.parallelism.method"),
        (("spec", "parallelism"), {"numMicroBatches": "many"}, "spec.parallelism.numMicroBatches"),
        (("spec", "parallelism"), {"method": "manual"}, "spec.parallelism.stages"),
        (
            ("spec", "parallelism"),
            {"method": "manual", "stages": [{"layers": [2, 2], "submeshShape": [1, 1]}]},
            "spec.parallelism.stages[0].layers",
        ),
        (("spec", "model"), {"zoo": "gpt", "entrypoint": "a:b"}, "spec.model"),
        (("spec", "model"), {"entrypoint": "no_colon"}, "spec.model.entrypoint"),
        (("apiVersion",), "v1", "apiVersion"),
        (("kind",), "TFJob", "kind"),
    ],
)
def test_errors_name_the_field(path, value, field):
    data = copy.deepcopy(BASE)
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ManifestError) as info:
        parse_job(data)
    assert info.value.field == field, str(info.value)
    assert str(info.value).startswith(field)


def test_missing_spec():
    with pytest.raises(ManifestError) as info:
        parse_job({"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob"})
    assert info.value.field == "spec"


def test_load_errors(tmp_path):
    with pytest.raises(ManifestError, match="cannot read"):
        load_job(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [unclosed")
    with pytest.raises(ManifestError, match="not valid YAML"):
        load_job(bad)
    two = tmp_path / "two.yaml"
    two.write_text("kind: ConfigMap\n---\nkind: Service\n")
    with pytest.raises(ManifestError, match="exactly one document of kind AlpaJob"):
        load_job(two)
    other = tmp_path / "deployment.yaml"
    other.write_text("apiVersion: apps/v1\nkind: Deployment\nspec: {}\n")
    with pytest.raises(ManifestError, match="'Deployment', not AlpaJob"):
        load_job(other)
