"""The admission webhook's own contract (``alpajob.operator.admission``).

Which bad specs it refuses, beside the CRD, is in ``tests/test_crd.py``; here: it
imports neither JAX nor kopf, it reports every problem it finds, and it never raises
on a malformed body.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from alpajob.operator.admission import validate_alpajob

BASE: dict[str, Any] = {
    "apiVersion": "alpajob.io/v1alpha1",
    "kind": "AlpaJob",
    "metadata": {"name": "tiny-gpt"},
    "spec": {"model": {"zoo": "gpt", "config": "tiny"}, "cluster": {"gpu": "cpu"}},
}


def test_importing_admission_imports_neither_jax_nor_kopf() -> None:
    code = ("import sys, alpajob.operator.admission; "
            "print(sorted(m for m in ('jax', 'kopf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_problem_is_reported_at_once() -> None:
    body = copy.deepcopy(BASE)
    body["spec"]["cluster"] = {"gpu": "cpu", "nodes": 1, "gpusPerNode": 8}
    body["spec"]["training"] = {"globalBatchSize": 32}
    body["spec"]["parallelism"] = {"method": "manual", "numLayers": 4, "numMicroBatches": 3, "stages": [
        {"layers": [1, 2], "submeshShape": [1, 3]},
        {"layers": [2, 3], "submeshShape": [1, 8], "logicalMeshShape": [3, 3]},
    ]}
    problems = validate_alpajob(body)
    fields = [p.split(":")[0] for p in problems]
    assert fields == [
        "spec.parallelism.numMicroBatches",
        "spec.parallelism.stages[0].layers",
        "spec.parallelism.stages[0].submeshShape",
        "spec.parallelism.stages[1].logicalMeshShape",
        "spec.parallelism.stages",
        "spec.parallelism.stages",
    ]


def test_zoo_names_are_case_insensitive_like_the_zoo() -> None:
    body = copy.deepcopy(BASE)
    body["spec"]["model"] = {"zoo": "GPT-2.6B"}
    body["spec"]["cluster"] = {"gpu": "v100-16gb"}
    assert validate_alpajob(body) == []
    body["spec"]["model"] = {"zoo": "moe", "config": {"experts": 8, "capacityFactor": 1.5}}
    assert validate_alpajob(body) == []


def test_without_old_no_field_is_judged_immutable() -> None:
    new = copy.deepcopy(BASE)
    new["spec"]["model"]["config"] = "350m"
    assert validate_alpajob(new) == []
    assert validate_alpajob(new, old=BASE)[0].startswith("spec.model: is immutable")


@pytest.mark.parametrize("body", [
    {},
    {"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "spec": None},
    {"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "spec": {"model": "gpt"}},
    {"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": 5},
     "spec": {"model": {"zoo": "gpt"}, "parallelism": ["auto"]}},
])
def test_a_malformed_body_gets_messages_not_an_exception(body: dict[str, Any]) -> None:
    problems = validate_alpajob(body)
    assert problems and all(isinstance(p, str) and ": " in p for p in problems)


OBSERVED = sorted((Path(__file__).parent / "data" / "apiserver-observed").glob("admission-*.json"))


@pytest.mark.parametrize("path", OBSERVED, ids=lambda p: p.stem)
def test_what_a_real_apiserver_sends_is_allowed(path: Path) -> None:
    """Status writes, finalizers added and removed (06: while the job is being deleted),
    a suspend: the webhook judges ``spec`` only and never holds a job up."""
    request = json.loads(path.read_text())["request"]
    if request["operation"] not in ("CREATE", "UPDATE"):
        return  # kopf's handler is registered for these two only
    old = request.get("oldObject") if request["operation"] == "UPDATE" else None
    assert request["object"].get("status") or request["operation"] == "CREATE"
    assert validate_alpajob(request["object"], old=old) == []


def test_an_update_that_changes_spec_is_still_judged_whole() -> None:
    request = json.loads(OBSERVED[3].read_text())["request"]  # 04: the suspend
    new = copy.deepcopy(request["object"])
    new["spec"]["training"]["steps"] = 7
    new["spec"]["cluster"]["gpusPerNode"] = 16
    problems = validate_alpajob(new, old=request["oldObject"])
    assert any(p.startswith("spec.training: is immutable") for p in problems), problems


@pytest.mark.parametrize(("data", "refused"), [
    ({"train": "/data/corpus/*.txt"}, []),
    ({"train": "s3://team/corpus/*.bin", "eval": "gs://team/eval.txt", "format": "tokens"}, []),
    ({"train": "https://example.com/corpus.txt"}, ["spec.data.train"]),
    ({"train": [{"name": "web", "path": "http://example.com/a.txt", "weight": 1},
                {"name": "code", "path": "s3://team/code.txt", "weight": 1}]}, ["spec.data.train[0].path"]),
    ({"train": "/data/a.txt", "eval": ["ftp://host/e.txt"], "tokenizer": "https://hf.co/tokenizer.json"},
     ["spec.data.eval", "spec.data.tokenizer"]),
])
def test_data_urls_over_a_scheme_the_cluster_does_not_allow_are_refused(
        data: dict[str, Any], refused: list[str]) -> None:
    body = copy.deepcopy(BASE)
    body["spec"]["data"] = data
    problems = validate_alpajob(body)
    assert [p.split(":", 1)[0] for p in problems] == refused
    assert all("--data-schemes" in p and "\n" not in p for p in problems)
    allowed = ("file", "s3", "gcs", "http", "https", "ftp")  # gcs: fsspec's other name for gs
    assert validate_alpajob(body, data_schemes=allowed) == []


@pytest.mark.parametrize(("env", "refused"), [
    ({"name": "HF_TOKEN", "value": "hf_abcdefghijklmnop"}, True),
    ({"name": "WANDB_API_KEY", "value": "0123456789abcdef"}, True),
    ({"name": "AWS_SECRET_ACCESS_KEY", "value": "x"}, True),
    ({"name": "SETTINGS", "value": "key=AKIAIOSFODNN7EXAMPLE"}, True),  # an AWS key id, whatever the name
    ({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}, False),
    ({"name": "TOKENIZERS_PARALLELISM", "value": "false"}, False),
    ({"name": "MAX_TOKENS", "value": "4096"}, False),
    ({"name": "NCCL_DEBUG", "value": "INFO"}, False),
])
def test_a_literal_credential_in_the_pod_template_is_refused_with_the_fix(env: dict[str, Any], refused: bool) -> None:
    body = copy.deepcopy(BASE)
    body["spec"]["podTemplate"] = {"head": {"env": [{"name": "NCCL_DEBUG", "value": "WARN"}, env]}}
    problems = validate_alpajob(body)
    if not refused:
        assert problems == []
        return
    [problem] = problems
    assert problem.startswith(f"spec.podTemplate.head.env[1] ({env['name']}):") and "secretKeyRef" in problem
