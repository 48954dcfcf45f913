"""The AlpaJob CRD (manifests/crd.yaml), its admission webhook, RBAC and the operator's Deployment.

No API server runs here: ``tests/kube_schema.py`` models what one does with the CRD's
schema (structural rules, defaulting, OpenAPI validation, CEL). Each bad spec below is
refused by the CRD with the field named, and by the webhook
(:func:`~alpajob.operator.admission.validate_alpajob`) too wherever its pydantic model
can judge it; the webhook-only cases are accepted by the CRD and refused by the webhook.
"""

from __future__ import annotations

import argparse
import copy
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from kube_schema import (
    Violation,
    apply_defaults,
    cel_reference_problems,
    cel_violations,
    prune,
    schema_violations,
    structural_problems,
    to_json_schema,
    walk,
)

from alpajob.api.crd import crd_yaml
from alpajob.api.data import DataFormat
from alpajob.api.progress import Progress, TrainerPhase
from alpajob.api.resource import parse_job
from alpajob.api.spec import (
    DType,
    Method,
    NodePoolSpec,
    ParallelismSpec,
    Schedule,
    TrainingSpec,
)
from alpajob.api.status import Children, JobTime, MeshStatus, Phase, PlanSummary, Status
from alpajob.cli import operator as operator_main
from alpajob.operator.admission import validate_alpajob
from alpajob.operator.status import set_phase

MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"
EXAMPLES = sorted((MANIFESTS / "examples").glob("*.yaml"))
DELETE = object()


@cache
def crd() -> dict[str, Any]:
    return yaml.safe_load((MANIFESTS / "crd.yaml").read_text())


def schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def spec_schema(section: str) -> dict[str, Any]:
    return schema()["properties"]["spec"]["properties"][section]


def documents(name: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((MANIFESTS / name).read_text()))


def admit(document: dict[str, Any], old: dict[str, Any] | None = None) -> list[Violation]:
    """What the API server refuses: OpenAPI first, then CEL on a schema-valid object."""
    new = apply_defaults(copy.deepcopy(document), schema())
    refused = schema_violations(new, schema())
    if refused:
        return refused
    if old is None:
        return cel_violations(new, schema())
    return cel_violations(new, schema(), apply_defaults(copy.deepcopy(old), schema()))


def names(violations: list[Violation], field: str) -> bool:
    """Some violation is about ``field``: at it, below it, or naming it in its message."""
    return any(
        v.path == field or v.path.startswith((f"{field}.", f"{field}[")) or field in v.message
        for v in violations
    )


def changed(document: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of ``document`` with the dotted ``path`` set to ``value`` (or deleted)."""
    out = copy.deepcopy(document)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node.setdefault(key, {})
    if value is DELETE:
        node.pop(last, None)
    else:
        node[last] = value
    return out


BASE: dict[str, Any] = {
    "apiVersion": "alpajob.io/v1alpha1",
    "kind": "AlpaJob",
    "metadata": {"name": "tiny-gpt", "namespace": "ml"},
    "spec": {
        "model": {"zoo": "gpt", "config": "tiny"},
        "training": {"globalBatchSize": 32},
        "cluster": {"gpu": "cpu", "nodes": 2, "gpusPerNode": 8},
    },
}


def manual(stages: Any, num_layers: Any = 4, method: str = "manual") -> dict[str, Any]:
    return {"method": method, "numLayers": num_layers, "numMicroBatches": 4, "stages": stages}


GOOD_STAGES = [{"layers": [0, 2], "submeshShape": [1, 8]},
               {"layers": [2, 4], "submeshShape": [1, 8], "logicalMeshShape": [2, 4]}]
H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


# ------------------------------------------------------------------ (a) structure
CHART_CRD = MANIFESTS.parent / "charts" / "alpajob" / "crds" / "alpajob.io_alpajobs.yaml"


@pytest.mark.parametrize("path", [MANIFESTS / "crd.yaml", CHART_CRD], ids=["manifests", "chart"])
def test_every_committed_crd_is_the_generated_one(path: Path) -> None:
    """Both copies are `alpajob crd`'s output, byte for byte: regenerate them with
    ``alpajob crd -o manifests/crd.yaml -o charts/alpajob/crds/alpajob.io_alpajobs.yaml``."""
    assert path.read_text() == crd_yaml(), f"{path} is stale: regenerate it with `alpajob crd -o {path}`"


def test_the_crd_declares_every_status_field_the_operator_writes() -> None:
    """The API server prunes undeclared fields: a status written whole (every optional
    field set) survives pruning unchanged."""
    status = Status(
        phase=Phase.RUNNING, restarts=2, start_time="2026-11-24T10:00:00Z",
        completion_time="2026-11-24T11:00:00Z", observed_generation=3,
        plan=PlanSummary(config_map="j-plan", hash="abc", stages=2, meshes=2,
                         predicted_step_seconds=0.5, num_micro_batches=4),
        meshes=[MeshStatus(name="mesh-0", nodes=1, ready_pods=1, total_pods=1)],
        progress=Progress(phase=TrainerPhase.RUNNING, step=5, steps=10, loss=2.5,
                          samples_per_second=100.0, last_checkpoint_step=4, restarts=1,
                          message="x", updated=1.0),
        children=Children(attempt=1, config="c", plan="p", progress="q", planner="pl",
                          service="s", hosts_service="h", head="hd", pod_group="g",
                          mesh_pods=["m"], created=1),
        time=JobTime(phase_since="2026-11-24T10:00:00Z", planning_seconds=1.5, starting_seconds=2.0,
                     running_seconds=3.0, restarting_seconds=4.0, suspended_seconds=5.0),
    )
    set_phase(status, Phase.RUNNING, "Training", "running", 3, "2026-11-24T10:00:00Z", True)
    written = status.to_dict()
    assert prune(copy.deepcopy(written), schema()["properties"]["status"]) == written


def test_crd_names_scope_version_and_subresources() -> None:
    doc = crd()
    assert (doc["apiVersion"], doc["kind"]) == ("apiextensions.k8s.io/v1", "CustomResourceDefinition")
    assert doc["metadata"]["name"] == "alpajobs.alpajob.io"
    spec = doc["spec"]
    assert (spec["group"], spec["scope"]) == ("alpajob.io", "Namespaced")
    assert spec["names"] == {"kind": "AlpaJob", "listKind": "AlpaJobList", "plural": "alpajobs",
                             "singular": "alpajob", "shortNames": ["aj"], "categories": ["all", "alpajob"]}
    [version] = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}


def test_crd_schema_is_structural() -> None:
    assert structural_problems(schema()) == []


def test_structural_checker_catches_what_the_api_server_refuses() -> None:
    bad = {"type": "object", "properties": {
        "untyped": {"description": "no type"},
        "list": {"type": "array"},
        "both": {"type": "object", "properties": {"a": {"type": "string"}},
                 "additionalProperties": {"type": "string"}},
        "junctor": {"type": "string", "anyOf": [{"type": "string"}]},
        "rule": {"type": "string", "x-kubernetes-validations": [
            {"rule": "self == 'a'", "fieldPath": ".missing"}]},
        "items": {"type": "array", "items": {"type": "string", "x-kubernetes-validations": [
            {"rule": "self == oldSelf"}]}},
    }}
    found = "\n".join(structural_problems(bad))
    for where in ("untyped.type", "list.items", "both:", "junctor.anyOf[0].type",
                  "rule.x-kubernetes-validations[0].fieldPath", "oldSelf"):
        assert where in found


def test_kube_schema_converter_maps_the_kubernetes_dialect() -> None:
    node = {"type": "object", "properties": {
        "count": {"x-kubernetes-int-or-string": True},
        "rate": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "nullable": True},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                 "properties": {"a": {"type": "string"}}},
    }}
    validator = jsonschema.Draft202012Validator(to_json_schema(node))
    assert validator.is_valid({"count": 3, "rate": None, "free": {"a": "x", "b": 1}})
    assert validator.is_valid({"count": "auto", "rate": 0.5})
    assert not validator.is_valid({"count": 1.5})
    assert not validator.is_valid({"rate": 0})
    assert not validator.is_valid({"unknown": 1})


def test_cel_rules_only_name_fields_cel_can_see() -> None:
    assert cel_reference_problems(schema()) == []
    hidden = {"type": "object", "properties": {"free": {"x-kubernetes-preserve-unknown-fields": True}},
              "x-kubernetes-validations": [{"rule": "has(self.free)"}]}
    assert cel_reference_problems(hidden)


def test_every_default_is_valid_against_its_own_schema_and_rules() -> None:
    """As the API server checks a CRD's defaults: as written, against the node's schema
    and its CEL rules (transition rules with oldSelf = the default), and here also once
    the default's own fields are defaulted."""
    defaults = [(path, node) for path, node in walk(schema()) if "default" in node]
    assert len(defaults) >= 17
    for path, node in defaults:
        assert not path.startswith("metadata"), "no defaults in metadata"
        for value in (node["default"], apply_defaults(copy.deepcopy(node["default"]), node)):
            assert schema_violations(value, node) == [], path
            assert cel_violations(value, node) == [], path
            assert cel_violations(value, node, old=value) == [], path


def test_cel_rules_have_one_line_messages_naming_a_field() -> None:
    for path, node in walk(schema()):
        for rule in node.get("x-kubernetes-validations") or []:
            message = rule["message"]
            assert ("spec." in message or "metadata.name" in message), (path, message)
            if "oldSelf" in rule["rule"]:
                assert path.startswith("spec"), "transition rules guard spec only"


def test_sizes_bound_every_string_list_and_map_of_spec() -> None:
    """Bounded sizes keep the CEL cost estimate within the API server's budget."""
    for path, node in walk(schema()["properties"]["spec"], "spec"):
        kind = node.get("type")
        if kind == "string":
            assert "maxLength" in node or "enum" in node, path
        elif kind == "array":
            assert "maxItems" in node, path
        elif kind == "object" and "additionalProperties" in node:
            assert "maxProperties" in node, path


def test_enums_agree_with_the_pydantic_model() -> None:
    training, parallelism = spec_schema("training")["properties"], spec_schema("parallelism")["properties"]
    assert training["dtype"]["enum"] == [d.value for d in DType]
    assert training["optimizer"] == {**training["optimizer"], "x-kubernetes-preserve-unknown-fields": True}
    assert spec_schema("data")["properties"]["format"]["enum"] == [f.value for f in DataFormat]
    assert parallelism["schedule"]["enum"] == [s.value for s in Schedule]
    assert parallelism["method"]["enum"] == [m.value for m in Method]
    assert schema()["properties"]["status"]["properties"]["phase"]["enum"] == [p.value for p in Phase]


def test_printer_columns_point_into_the_schema() -> None:
    columns = {c["name"]: c for c in crd()["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert {"Phase", "Reason", "Stages", "Meshes", "Step", "Age"} <= set(columns)
    assert columns["Age"]["jsonPath"] == ".metadata.creationTimestamp"
    assert columns["Message"]["priority"] == 1  # -o wide
    for name, column in columns.items():
        if name == "Age":
            continue
        node = schema()
        path, _, field = column["jsonPath"].partition('[?(@.type=="Ready")].')
        for key in path.lstrip(".").split("."):
            node = node["properties"][key]
        if field:  # one condition's field: the conditions' items declare it
            node = node["items"]["properties"][field]
        assert node["type"] == column["type"], name


# ------------------------------------------------------------------ (b) examples
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_pass_the_schema_cel_and_webhook(path: Path) -> None:
    document = yaml.safe_load(path.read_text())
    assert admit(document) == []
    assert admit(document, old=document) == [], "an unchanged update passes the transition rules"
    assert validate_alpajob(document) == []
    assert validate_alpajob(document, old=document) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_defaulting_an_example_does_not_change_what_it_means(path: Path) -> None:
    document = yaml.safe_load(path.read_text())
    defaulted = apply_defaults(copy.deepcopy(document), schema())
    before, after = parse_job(document).spec, parse_job(defaulted).spec
    for section in ("model", "training", "cluster", "parallelism", "image"):
        assert getattr(before, section) == getattr(after, section), section


# ------------------------------------------------------------------ (c) defaults
def test_defaults_equal_the_pydantic_defaults() -> None:
    minimal = {"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob",
               "metadata": {"name": "minimal"}, "spec": {"model": {"zoo": "gpt"}}}
    defaulted = apply_defaults(copy.deepcopy(minimal), schema())
    ours = parse_job(minimal).spec
    dumped = ours.model_dump(by_alias=True, exclude_none=True, mode="json")
    for section in ("training", "parallelism", "cluster", "runPolicy", "scheduling"):
        expected = {k: v for k, v in dumped[section].items() if v != {}}  # no nodeSelector: {}
        assert defaulted["spec"][section] == expected, section
    assert parse_job(defaulted).spec == ours
    # Every pydantic default is in the schema, with the same value.
    for section, model in (("training", TrainingSpec), ("cluster", NodePoolSpec),
                           ("parallelism", ParallelismSpec)):
        props = spec_schema(section)["properties"]
        for name, info in model.model_fields.items():
            if info.default is None or info.default_factory is not None:
                continue
            assert props[info.alias or name]["default"] == info.default, (section, name)


# ------------------------------------------------------------------ (d) bad specs
# (field the refusal names, path changed in BASE, its new value, webhook refuses too)
CRD_REFUSES = [
    ("spec.model", "spec.model", DELETE, True),
    ("spec.model.zoo", "spec.model.zoo", 5, True),
    ("spec.model.zoo", "spec.model.zoo", "", True),
    ("spec.model", "spec.model.entrypoint", "pkg.train:make_model", True),
    ("spec.model", "spec.model", {"config": "tiny"}, True),
    ("spec.model.entrypoint", "spec.model", {"entrypoint": "make_model"}, True),
    ("spec.model.entrypoint", "spec.model", {"entrypoint": "pkg:make:model"}, True),
    ("spec.training.globalBatchSize", "spec.training.globalBatchSize", 0, True),
    ("spec.training.steps", "spec.training.steps", -5, True),
    ("spec.training.steps", "spec.training.steps", "10", False),
    ("spec.training.dtype", "spec.training.dtype", "int8", True),
    ("spec.training.learningRate", "spec.training.learningRate", 0, True),
    ("spec.training.batchSize", "spec.training.batchSize", 8, True),
    ("spec.cluster.nodes", "spec.cluster.nodes", 0, True),
    ("spec.cluster.gpusPerNode", "spec.cluster.gpusPerNode", -8, True),
    ("spec.cluster.nodeSelector.pool", "spec.cluster.nodeSelector", {"pool": 1}, True),
    ("spec.cluster.nodeSelector", "spec.cluster.nodeSelector", {f"k{i}": "v" for i in range(33)}, False),
    ("spec.cluster.gpu", "spec.cluster.gpu", "H100 80GB", True),
    ("spec.cluster.gpu", "spec.cluster.gpu", "h200", True),
    ("spec.parallelism.method", "spec.parallelism.method", "magic", True),
    ("spec.parallelism.schedule", "spec.parallelism.schedule", "zero-bubble", True),
    ("spec.parallelism.numMicroBatches", "spec.parallelism.numMicroBatches", 0, True),
    ("spec.parallelism.numMicroBatches", "spec.parallelism.numMicroBatches", "four", True),
    ("spec.parallelism.numMicroBatches", "spec.parallelism.numMicroBatches", 2.5, True),
    ("spec.parallelism.numMicroBatches", "spec.parallelism.numMicroBatches", 3, True),
    ("spec.parallelism.numLayers", "spec.parallelism.numLayers", -2, True),
    ("spec.parallelism.numLayers", "spec.parallelism.numLayers", "many", True),
    ("spec.image", "spec.image", 5, True),
    ("spec.image", "spec.image", "", False),
    ("spec.serviceAccountName", "spec.serviceAccountName", "Trainer_SA", False),
    ("spec.checkpoint.volume", "spec.checkpoint", {"intervalSteps": 100}, False),
    ("spec.checkpoint.volume", "spec.checkpoint", {"volume": "Shared_Ckpt"}, False),
    ("spec.checkpoint.intervalSteps", "spec.checkpoint", {"volume": "ckpt", "intervalSteps": 0}, False),
    ("spec.checkpoint.path", "spec.checkpoint", {"volume": "ckpt", "path": "../other-job"}, False),
    ("spec.checkpoint", "spec.checkpoint", "ckpt", True),
    ("spec.runPolicy.backoffLimit", "spec.runPolicy.backoffLimit", -1, False),
    ("spec.runPolicy.activeDeadlineSeconds", "spec.runPolicy.activeDeadlineSeconds", 0, False),
    ("spec.runPolicy.ttlSecondsAfterFinished", "spec.runPolicy.ttlSecondsAfterFinished", -1, False),
    ("spec.runPolicy.suspend", "spec.runPolicy.suspend", "yes", False),
    ("spec.runPolicy.restartPolicy", "spec.runPolicy.restartPolicy", "Always", False),
    ("spec.runPolicy.podFailurePolicy", "spec.runPolicy.podFailurePolicy", {"rules": [{"action": "FailJob"}]}, False),
    ("spec.runPolicy.podFailurePolicy.rules[0].action", "spec.runPolicy.podFailurePolicy",
     {"rules": [{"action": "Retry", "onExitCodes": {"operator": "In", "values": [3]}}]}, False),
    ("spec.runPolicy.podFailurePolicy.rules[0].onExitCodes.values[0]", "spec.runPolicy.podFailurePolicy",
     {"rules": [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [0]}}]}, False),
    ("spec.scheduling.gang", "spec.scheduling.gang", "kueue", False),
    ("spec.scheduling.priorityClassName", "spec.scheduling.priorityClassName", "High Priority", False),
    ("spec.scheduling.queue", "spec.scheduling.queue", "q" * 300, False),
    ("spec.podTemplate.mesh.resources.requests.cpu", "spec.podTemplate.mesh.resources",
     {"requests": {"cpu": "2 cores"}}, True),
    ("spec.podTemplate.head.securityContext.runAsUser", "spec.podTemplate.head.securityContext",
     {"runAsUser": 0}, True),
    ("spec.podTemplate.mesh.imagePullPolicy", "spec.podTemplate.mesh.imagePullPolicy", "Sometimes", True),
    ("spec.podTemplate.workers", "spec.podTemplate.workers", {}, True),
    ("spec.runPolicy.schedulingTimeoutSeconds", "spec.runPolicy.schedulingTimeoutSeconds", 0, True),
    ("spec.cluster.whenFewerNodes", "spec.cluster.whenFewerNodes", "Shrink", True),
    ("spec.parallelism.transport", "spec.parallelism.transport", "nccl", True),
    ("spec.planner.ilpTimeLimitSeconds", "spec.planner.ilpTimeLimitSeconds", 0, True),
    ("spec.planner.ilpTimeLimitSeconds", "spec.planner.ilpTimeLimitSeconds", 7200, True),
    ("spec.planner.calibration.configMap", "spec.planner.calibration", {"key": "a.json"}, True),
    ("spec.planner.calibration.key", "spec.planner.calibration", {"configMap": "c", "key": "a/b.json"}, True),
    ("spec.trainer", "spec.trainer", {"replicas": 2}, True),
    ("metadata.name", "metadata.name", "9-lives", True),
    ("metadata.name", "metadata.name", "a" * 50, True),
]


@pytest.mark.parametrize(("field", "path", "value", "webhook"), CRD_REFUSES,
                         ids=[f"{c[1]}={str(c[2])[:20]}" for c in CRD_REFUSES])
def test_crd_refuses_a_bad_spec_naming_the_field(field: str, path: str, value: Any, webhook: bool) -> None:
    document = changed(BASE, path, value)
    refused = admit(document)
    assert names(refused, field), refused
    if webhook:
        problems = validate_alpajob(document)
        assert any(field in p for p in problems), problems


def test_thirty_bad_specs_or_more() -> None:
    assert len(CRD_REFUSES) >= 30
    assert sum(1 for *_, webhook in CRD_REFUSES if webhook) >= 25


# What only the webhook can judge: a zoo lookup, the device presets, manual stages.
WEBHOOK_REFUSES = [
    ("spec.training.optimizer", "spec.training.optimizer", "lamb"),
    ("spec.training.optimizer.schedule", "spec.training.optimizer", {"name": "adamw", "schedule": "step"}),
    ("spec.training.optimizer.warmupSteps", "spec.training.optimizer", {"warmupSteps": -1}),
    ("spec.data.train", "spec.data", {"train": []}),
    ("spec.data.train", "spec.data", {"train": 5}),
    ("spec.model.zoo", "spec.model", {"zoo": "bert"}),
    ("spec.model.config", "spec.model", {"zoo": "gpt", "config": "9b"}),
    ("spec.model.zoo", "spec.model", {"zoo": "gpt-9b"}),
    ("spec.model.config", "spec.model", {"zoo": "gpt-2.6b", "config": "tiny"}),
    ("spec.model.config.depth", "spec.model", {"zoo": "gpt", "config": {"hidden": 64, "depth": 3}}),
    ("spec.model.config.hidden", "spec.model", {"zoo": "gpt", "config": {"hidden": -1}}),
    ("spec.model.config.capacityFactor", "spec.model", {"zoo": "moe", "config": {"capacityFactor": "x"}}),
    ("spec.cluster.nodeSelector", "spec.cluster",
     {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-B200"}, "nodes": 1}),
    ("spec.cluster.gpu", "spec.cluster", {"gpu": "v100-16gb", "nodeSelector": H100}),
    ("spec.parallelism.stages", "spec.parallelism", manual("auto")),
    ("spec.parallelism.stages", "spec.parallelism", manual(GOOD_STAGES, method="pipeshard")),
    ("spec.parallelism.stages", "spec.parallelism", {"stages": "manual"}),
    ("spec.parallelism.stages[0].layers", "spec.parallelism",
     manual([{"layers": [1, 2], "submeshShape": [1, 8]}, {"layers": [2, 4], "submeshShape": [1, 8]}])),
    ("spec.parallelism.stages[1].layers", "spec.parallelism",
     manual([{"layers": [0, 2], "submeshShape": [1, 8]}, {"layers": [3, 4], "submeshShape": [1, 8]}])),
    ("spec.parallelism.stages[0].layers", "spec.parallelism", manual([{"layers": [0, 0], "submeshShape": [1, 8]}])),
    ("spec.parallelism.stages", "spec.parallelism",
     manual([{"layers": [0, 2], "submeshShape": [1, 8]}, {"layers": [2, 3], "submeshShape": [1, 8]}])),
    ("spec.parallelism.stages[1].layers", "spec.parallelism",
     manual([{"layers": [0, 2], "submeshShape": [1, 8]}, {"layers": [2, 6], "submeshShape": [1, 8]}])),
    ("spec.parallelism.stages[0].submeshShape", "spec.parallelism",
     manual([{"layers": [0, 4], "submeshShape": [2, 4]}])),
    ("spec.parallelism.stages[0].submeshShape", "spec.parallelism",
     manual([{"layers": [0, 4], "submeshShape": [1, 16]}])),
    ("spec.parallelism.stages[0].submeshShape", "spec.parallelism",
     manual([{"layers": [0, 4], "submeshShape": [1, 3]}])),
    ("spec.parallelism.stages[0].submeshShape", "spec.parallelism",
     manual([{"layers": [0, 4], "submeshShape": [0, 8]}])),
    ("spec.parallelism.stages[0].submeshShape", "spec.parallelism",
     manual([{"layers": [0, 4], "submeshShape": [3, 8]}])),
    ("spec.parallelism.stages[1].logicalMeshShape", "spec.parallelism",
     manual([GOOD_STAGES[0], {**GOOD_STAGES[1], "logicalMeshShape": [2, 3]}])),
    ("spec.parallelism.stages", "spec.parallelism",
     manual([{"layers": [0, 2], "submeshShape": [2, 8]}, {"layers": [2, 4], "submeshShape": [2, 8]}])),
    ("spec.parallelism.stages[0].foo", "spec.parallelism",
     manual([{"layers": [0, 4], "submeshShape": [1, 8], "foo": 1}])),
    # What a pod template may not change: the runtime contract, the operator's labels
    # and volumes, and Pod Security "restricted".
    ("spec.podTemplate.mesh.env[0].name", "spec.podTemplate.mesh.env", [{"name": "ALPAJOB_MESH", "value": "1"}]),
    ("spec.podTemplate.head.metadata.labels", "spec.podTemplate.head.metadata", {"labels": {"alpajob.io/job": "x"}}),
    ("spec.podTemplate.mesh.volumes", "spec.podTemplate.mesh.volumes", [{"name": "data", "hostPath": {"path": "/"}}]),
    ("spec.podTemplate.mesh.volumes", "spec.podTemplate.mesh.volumes", [{"name": "dshm", "emptyDir": {}}]),
    ("spec.podTemplate.mesh.volumes", "spec.podTemplate.mesh.volumes", [{"emptyDir": {}}]),
]


@pytest.mark.parametrize(("field", "path", "value"), WEBHOOK_REFUSES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(WEBHOOK_REFUSES)])
def test_webhook_refuses_what_the_crd_cannot_judge(field: str, path: str, value: Any) -> None:
    document = changed(BASE, path, value)
    assert admit(document) == [], "the CRD cannot judge this one"
    problems = validate_alpajob(document)
    assert problems and all(p.startswith(("spec.", "metadata.")) for p in problems)
    assert any(field in p for p in problems), problems


def test_a_good_manual_plan_passes_both() -> None:
    document = changed(BASE, "spec.parallelism", manual(GOOD_STAGES))
    assert admit(document) == []
    assert validate_alpajob(document) == []


# ------------------------------------------------------------------ (e) updates
MUTABLE = [
    ("spec.runPolicy.suspend", True),
    ("spec.runPolicy.activeDeadlineSeconds", 3600),
    ("spec.runPolicy.ttlSecondsAfterFinished", 600),
    ("spec.scheduling.queue", "night"),
    ("spec.runPolicy.schedulingTimeoutSeconds", 120),
    ("spec.podTemplate.mesh", {"resources": {"requests": {"cpu": 1, "memory": "2Gi"}}}),
]
IMMUTABLE = [
    ("spec.model", "spec.model.zoo", "moe"),
    ("spec.training", "spec.training.steps", 5),
    ("spec.cluster", "spec.cluster.nodes", 1),
    ("spec.parallelism", "spec.parallelism.schedule", "gpipe"),
    ("spec.image", "spec.image", "registry.example/trainer:2"),
    ("spec.checkpoint", "spec.checkpoint", {"volume": "ckpt"}),
    ("spec.serviceAccountName", "spec.serviceAccountName", "other"),
    ("spec.runPolicy.backoffLimit", "spec.runPolicy.backoffLimit", 10),
    ("spec.scheduling.gang", "spec.scheduling.gang", "none"),
    ("spec.scheduling.schedulerName", "spec.scheduling.schedulerName", "volcano"),
    ("spec.scheduling.priorityClassName", "spec.scheduling.priorityClassName", "high"),
    ("spec.planner", "spec.planner.ilpTimeLimitSeconds", 30),
    ("spec.cluster", "spec.cluster.whenFewerNodes", "Wait"),
    ("spec.parallelism", "spec.parallelism.transport", "collective"),
]


@pytest.mark.parametrize(("path", "value"), MUTABLE, ids=[m[0] for m in MUTABLE])
def test_update_of_a_mutable_field_is_allowed(path: str, value: Any) -> None:
    new = changed(BASE, path, value)
    assert admit(new, old=BASE) == []
    assert validate_alpajob(new, old=BASE) == []


@pytest.mark.parametrize(("field", "path", "value"), IMMUTABLE, ids=[m[1] for m in IMMUTABLE])
def test_update_of_an_immutable_field_is_refused(field: str, path: str, value: Any) -> None:
    new = changed(BASE, path, value)
    assert admit(new) == [], "the value itself is fine"
    refused = admit(new, old=BASE)
    assert names(refused, field) and all("immutable" in v.message for v in refused), refused
    problems = validate_alpajob(new, old=BASE)
    assert any(p.startswith(field) and "immutable" in p for p in problems), problems


@pytest.mark.parametrize(("field", "path", "value"), [
    ("spec.model", "spec.model.config", {"hidden": 128}),
    ("spec.parallelism", "spec.parallelism", manual(GOOD_STAGES)),
])
def test_untyped_fields_are_immutable_too(field: str, path: str, value: Any) -> None:
    """No rule can name config or stages, but their parent's ``self == oldSelf`` compares them."""
    old = changed(BASE, "spec.parallelism", manual([{"layers": [0, 4], "submeshShape": [2, 8]}]))
    new = changed(old, path, value)
    assert names(admit(new, old=old), field)
    assert any(p.startswith(field) for p in validate_alpajob(new, old=old))


# ------------------------------------------------------------------ (f) RBAC, Deployment
#: What the operator does to each resource (operator/kube.py, kopf); read verbs on all it observes.
NEEDED_VERBS = {
    ("alpajob.io", "alpajobs"): {"get", "list", "watch", "patch", "delete"},
    ("alpajob.io", "alpajobs/status"): {"get", "patch"},
    ("alpajob.io", "alpajobs/finalizers"): {"update"},
    ("", "pods"): {"create", "get", "list", "watch", "delete", "patch"},  # patch: Kueue's retriable-in-group
    ("", "services"): {"create", "get", "list", "watch"},
    ("", "configmaps"): {"create", "get", "list", "watch", "patch"},  # patch: the plan cleared to plan again
    ("", "persistentvolumeclaims"): {"create", "get", "list", "watch"},
    ("", "secrets"): {"create", "delete"},  # the attempts' Ray tokens; never read
    ("", "serviceaccounts"): {"create"},  # the job's own identity, <job>-trainer
    ("rbac.authorization.k8s.io", "roles"): {"create"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"create"},
    ("authorization.k8s.io", "subjectaccessreviews"): {"create"},  # may a job's author create pods?
    ("kopf.dev", "clusterkopfpeerings"): {"get", "list", "watch", "patch"},  # the replicas' election
    ("kopf.dev", "kopfpeerings"): {"get", "list", "watch", "patch"},
    ("networking.k8s.io", "networkpolicies"): {"create"},
    ("", "events"): {"create"},
    ("", "nodes"): {"get", "list", "watch"},
    ("scheduling.volcano.sh", "podgroups"): {"create", "get", "list", "watch", "delete"},
    ("scheduling.x-k8s.io", "podgroups"): {"create", "get", "list", "watch", "delete"},
    ("kueue.x-k8s.io", "workloads"): {"get"},  # why an attempt is queued
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
    # kopf's managed webhook configurations (kopf/_core/engines/admission.py): a create
    # (a 409 for an existing one is fine), then merge patches; never a read.
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations"): {"create"},
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations"): {"create"},
}
#: Verbs granted on one named object only: kopf patches only the configurations it
#: manages, named by the operator (``settings.admission.managed``).
WEBHOOK_CONFIGURATION = "alpajobs.alpajob.io"
NEEDED_NAMED_VERBS = {
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations", WEBHOOK_CONFIGURATION): {"patch"},
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", WEBHOOK_CONFIGURATION): {"patch"},
}
CREATED = [("", "pods"), ("", "services"), ("", "configmaps"), ("", "persistentvolumeclaims"), ("", "events"),
           ("", "secrets"), ("", "serviceaccounts"), ("rbac.authorization.k8s.io", "roles"),
           ("rbac.authorization.k8s.io", "rolebindings"), ("networking.k8s.io", "networkpolicies"),
           ("scheduling.volcano.sh", "podgroups"), ("scheduling.x-k8s.io", "podgroups"),
           ("admissionregistration.k8s.io", "validatingwebhookconfigurations")]


def by_kind(name: str) -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in documents(name)}


def test_cluster_role_grants_exactly_the_verbs_needed() -> None:
    rbac = by_kind("rbac.yaml")
    granted: dict[tuple[str, str], set[str]] = {}
    named: dict[tuple[str, str, str], set[str]] = {}
    for rule in rbac["ClusterRole"]["rules"]:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], rule
        assert "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                if "resourceNames" in rule:
                    for name in rule["resourceNames"]:
                        named.setdefault((group, resource, name), set()).update(rule["verbs"])
                else:
                    granted.setdefault((group, resource), set()).update(rule["verbs"])
    assert granted == NEEDED_VERBS
    assert named == NEEDED_NAMED_VERBS
    for key in CREATED:
        assert "create" in granted[key], key


@pytest.mark.parametrize("install", ["rbac.yaml", "rbac-namespaced.yaml"])
def test_the_shipped_roles_may_hand_out_each_jobs_identity_and_nothing_more(install: str) -> None:
    """A real API server lets a user create a Role, or bind one, only with permissions
    it holds (RBAC's escalation check, which :mod:`rbac` applies as kube-apiserver
    does). Under each shipped install the operator may create a job's
    ``<job>-trainer`` Role and RoleBinding; with ``patch`` on ConfigMaps taken away it
    may not, and it may never bind a role it does not hold (``cluster-admin``)."""
    from rbac import Ask, User, escalation

    from alpajob.operator.children import identity
    from alpajob.operator.names import ChildNames

    job = {"metadata": {"name": "gpt", "namespace": "default", "uid": "u"}, "spec": {}}
    account, role, binding = identity(job, ChildNames("gpt", 0))
    operator = User.service_account("alpajob-system", "alpajob-operator")
    stored = [copy.deepcopy(d) for d in documents(install) if d["kind"] != "ServiceAccount"]
    admin = {"kind": "ClusterRole", "metadata": {"name": "cluster-admin"},
             "rules": [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}]}

    def objects(plural: str, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        kinds = {"clusterroles": "ClusterRole", "roles": "Role", "clusterrolebindings": "ClusterRoleBinding",
                 "rolebindings": "RoleBinding"}
        return [d for d in docs if d["kind"] == kinds[plural]]

    with_role = [*stored, admin, {**role, "metadata": {"name": "gpt-trainer", "namespace": "default"}}]
    make_role = Ask("create", "rbac.authorization.k8s.io", "roles", "default", None)
    make_binding = Ask("create", "rbac.authorization.k8s.io", "rolebindings", "default", None)
    assert escalation(operator, make_role, role, lambda p: objects(p, with_role)) is None
    assert escalation(operator, make_binding, binding, lambda p: objects(p, with_role)) is None
    to_admin = {**binding, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                       "name": "cluster-admin"}}
    refused = escalation(operator, make_binding, to_admin, lambda p: objects(p, with_role))
    assert refused is not None and "not currently held" in refused
    weaker = copy.deepcopy(with_role)
    for doc in weaker:
        for rule in doc.get("rules") or []:
            if doc["metadata"]["name"].startswith("alpajob-operator") and "configmaps" in rule["resources"]:
                rule["verbs"] = [v for v in rule["verbs"] if v != "patch"]
    refused = escalation(operator, make_role, role, lambda p: objects(p, weaker))
    assert refused is not None and "Verbs:['get', 'patch']" in refused and "gpt-progress" in refused
    assert account["automountServiceAccountToken"] is False


def test_the_service_account_is_bound_to_the_cluster_role() -> None:
    rbac = by_kind("rbac.yaml")
    account, binding = rbac["ServiceAccount"], rbac["ClusterRoleBinding"]
    assert account["metadata"] == {**account["metadata"], "name": "alpajob-operator", "namespace": "alpajob-system"}
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": rbac["ClusterRole"]["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "alpajob-operator",
                                    "namespace": "alpajob-system"}]


def test_the_managed_webhook_configuration_is_the_one_rbac_names() -> None:
    from alpajob.api.names import CRD_NAME

    assert CRD_NAME == WEBHOOK_CONFIGURATION  # settings.admission.managed


def test_operator_deployment_is_replicated_non_root_and_probed() -> None:
    deployment = by_kind("operator.yaml")["Deployment"]
    services = {d["metadata"]["name"]: d for d in documents("operator.yaml") if d["kind"] == "Service"}
    assert set(services) == {"alpajob-operator-metrics", "alpajob-operator-webhook"}
    service, webhook = services["alpajob-operator-metrics"], services["alpajob-operator-webhook"]
    namespace = by_kind("namespace.yaml")["Namespace"]
    assert namespace["metadata"]["name"] == deployment["metadata"]["namespace"] == "alpajob-system"
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    spec = deployment["spec"]
    # Two replicas, one of which reconciles (kopf's peering object alpajob); a rollout
    # starts the new pod before it stops an old one, and a drain keeps one.
    assert spec["replicas"] == 2 and spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    budget = by_kind("operator.yaml")["PodDisruptionBudget"]
    assert budget["spec"] == {"minAvailable": 1, "selector": spec["selector"]}
    command = spec["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--peering") + 1] == "alpajob"
    assert by_kind("operator.yaml")["ClusterKopfPeering"]["metadata"]["name"] == "alpajob"
    assert {d["metadata"]["name"] for d in documents("peering.yaml")} == \
        {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
    pod = spec["template"]["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert pod["serviceAccountName"] == "alpajob-operator"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    [container] = pod["containers"]
    assert container["image"] == "ghcr.io/alpajob/alpajob-operator:0.1.0"  # the operator target: no JAX
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": 8080}, probe
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == 9090 and ports["webhook"] == 9443
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind]), kind
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics"}]
    assert webhook["spec"]["selector"] == service["spec"]["selector"]
    # kopf registers https://<host>:<listening port>/<handler id>: the Service serves that port.
    assert webhook["spec"]["ports"] == [{"name": "webhook", "port": 9443, "targetPort": "webhook"}]


def test_operator_command_is_one_the_cli_accepts() -> None:
    [container] = by_kind("operator.yaml")["Deployment"]["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:2] == ["alpajob", "operator"]
    parser = argparse.ArgumentParser()
    operator_main.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(command[1:])
    assert args.all_namespaces and args.metrics_port == 9090
    assert args.liveness == "http://0.0.0.0:8080/healthz"
    assert (args.webhook_port, args.webhook_managed, args.webhook_insecure) == (9443, True, False)
    assert args.webhook_host == "alpajob-operator-webhook.alpajob-system.svc"
    assert args.webhook_cert is args.webhook_key is None  # kopf self-signs for the host


def _grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str, str]]:
    return {(group, resource, verb, name) for rule in rules for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"] for name in rule.get("resourceNames") or ["*"]}


def test_the_namespaced_install_grants_the_same_verbs_split_by_scope() -> None:
    """rbac-namespaced.yaml: the cluster-wide role's verbs, those on namespaced kinds
    in a role bound per watched namespace, the rest cluster-wide; the cluster-wide
    peering object is not needed (a KopfPeering per namespace)."""
    roles = {d["metadata"]["name"]: d for d in documents("rbac-namespaced.yaml") if d["kind"] == "ClusterRole"}
    namespaced = _grants(roles["alpajob-operator-namespaced"]["rules"])
    cluster = _grants(roles["alpajob-operator-cluster"]["rules"])
    everything = _grants(by_kind("rbac.yaml")["ClusterRole"]["rules"])
    assert namespaced | cluster == {g for g in everything if g[1] != "clusterkopfpeerings"}
    assert not namespaced & cluster
    scoped = {"nodes", "customresourcedefinitions", "subjectaccessreviews", "validatingwebhookconfigurations",
              "mutatingwebhookconfigurations"}
    assert {g[1] for g in cluster} == scoped
    bindings = [d for d in documents("rbac-namespaced.yaml") if d["kind"] == "RoleBinding"]
    assert [b["roleRef"]["name"] for b in bindings] == ["alpajob-operator-namespaced"]
