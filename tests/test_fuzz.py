"""Every generated manifest gets an answer: a job, or one line naming the field.

The manifests come from the CRD's own schema (``fuzz_manifests.py``): valid, boundary
and invalid values for every field, deletions, wrong-typed sections, and attacks on the
YAML text itself. Each goes through the same front doors a user's does: the webhook
(:func:`~alpajob.operator.admission.validate_alpajob`), the loader of ``alpajob.load``
and the CLI (:func:`~alpajob.api.resource.load_job`), and for those accepted,
``alpajob plan``. The properties:

- no exception but a :class:`ManifestError`; every problem is one line that names a
  field; an answer within seconds;
- the webhook and the loader agree on what is a job;
- what is accepted, the CRD's schema accepts too (the API server would refuse a job
  that the webhook lets in otherwise), and it reads back the same from its YAML;
- ``alpajob plan`` of an accepted job ends in a plan or one line, exit 0 or 2.

The default suite runs a small budget; ``-m slow`` a larger one; both replay the same
examples every run unless ``ALPAJOB_FUZZ_EXPLORE=1`` is set. Each case the fuzzer found
is kept in ``tests/fuzz_corpus/`` (a manifest whose first line, ``# says: ...``, is
part of the line it must get) and replayed by :func:`test_the_corpus`.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from fuzz_manifests import BASE, leaves, manifests, texts, valid
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from alpajob.api.crd import crd
from alpajob.api.errors import ManifestError
from alpajob.api.resource import dump_job, load_job, parse_job
from alpajob.operator.admission import validate_alpajob

CORPUS = Path(__file__).parent / "fuzz_corpus"
#: Seconds one manifest may take to be answered by the webhook or the loader.
ANSWER_SECONDS = 5.0
#: A problem line starts with the field it is about.
FIELD = re.compile(r"^(spec|metadata|status|kind|apiVersion|manifest|/)[^\n]*$")

QUICK = settings(max_examples=400, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                        HealthCheck.function_scoped_fixture])
#: CI replays the same examples every run (a new one could fail a change that did not
#: cause it); ``ALPAJOB_FUZZ_EXPLORE=1`` draws new ones, to look for new cases.
THOROUGH = settings(QUICK, max_examples=2500, derandomize="ALPAJOB_FUZZ_EXPLORE" not in os.environ)


@functools.cache
def _schema() -> jsonschema.Draft4Validator:
    """The CRD's structural schema (OpenAPI v3: draft 4's boolean exclusiveMinimum)."""
    return jsonschema.Draft4Validator(crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def _one_line(text: str) -> None:
    assert "\n" not in text and text.strip() == text and text, repr(text)
    assert "Traceback" not in text and "ValidationError" not in text, text


def answer(body: Any) -> None:
    """The properties of the module docstring for one manifest, without planning."""
    started = time.monotonic()
    problems = validate_alpajob(body) if isinstance(body, dict) else None
    try:
        job = parse_job(body)
    except ManifestError as error:
        job = None
        _one_line(str(error))
    assert time.monotonic() - started < ANSWER_SECONDS
    if problems is not None:
        for problem in problems:
            _one_line(problem)
            assert FIELD.match(problem), problem
        if job is None:
            assert problems, "the loader refused what the webhook let in"
    if job is None:
        return
    data = yaml.safe_load(dump_job(job))
    assert parse_job(data) == job.model_copy(update={"status": None}) or job.status is not None
    errors = sorted(_schema().iter_errors(data), key=str)
    assert not errors, f"accepted, but the CRD's schema refuses {errors[0].json_path}: {errors[0].message}"


@QUICK
@given(manifests())
def test_every_manifest_is_a_job_or_one_line(body: dict[str, Any]) -> None:
    answer(body)


@pytest.mark.slow
@THOROUGH
@given(manifests(most=5))
def test_every_manifest_is_a_job_or_one_line_thoroughly(body: dict[str, Any]) -> None:
    answer(body)


def answer_text(tmp_path: Path, text: bytes) -> None:
    """A file of ``text`` is a job or one line, within seconds."""
    path = tmp_path / "job.yaml"
    path.write_bytes(text)
    started = time.monotonic()
    try:
        load_job(path)
    except ManifestError as error:
        _one_line(str(error))
    assert time.monotonic() - started < ANSWER_SECONDS


@settings(QUICK, max_examples=150)  # each one a file
@given(texts())
def test_every_text_is_a_job_or_one_line(tmp_path_factory: pytest.TempPathFactory, text: bytes) -> None:
    answer_text(tmp_path_factory.mktemp("text"), text)


@pytest.mark.slow
@THOROUGH
@given(texts())
def test_every_text_is_a_job_or_one_line_thoroughly(tmp_path_factory: pytest.TempPathFactory, text: bytes) -> None:
    answer_text(tmp_path_factory.mktemp("text"), text)


# --- alpajob plan of what is accepted ------------------------------------------------

#: The fields that change what the planner does, with values small enough to plan in
#: seconds on two cores (the schema's own ranges reach pools that take minutes).
PLANNED: dict[str, st.SearchStrategy[Any]] = {
    "spec.model.zoo": st.sampled_from(["gpt", "mlp", "moe", "wresnet"]),
    "spec.training.globalBatchSize": st.sampled_from([1, 2, 3, 8, 16, 24, 64]),
    "spec.training.dtype": st.none(),  # drawn from the schema's enum below
    "spec.training.optimizer": st.sampled_from(["adam", "adamw", "sgd", {"name": "sgd", "clipNorm": 1.0}]),
    "spec.cluster.nodes": st.integers(1, 2),
    "spec.cluster.gpusPerNode": st.sampled_from([1, 2, 4]),
    "spec.parallelism.method": st.none(),
    "spec.parallelism.numMicroBatches": st.sampled_from(["auto", 1, 2, 3, 4, 8]),
    "spec.parallelism.numLayers": st.sampled_from(["auto", 1, 2, 3]),
}


@st.composite
def plannable(draw: st.DrawFn) -> dict[str, Any]:
    """:data:`BASE` with one to four of :data:`PLANNED` changed, accepted by the webhook."""
    body = json.loads(json.dumps(BASE))
    chosen = draw(st.lists(st.sampled_from([leaf for leaf in leaves() if leaf.name in PLANNED]),
                           min_size=1, max_size=4, unique_by=lambda leaf: leaf.path))
    for leaf in chosen:
        value = draw(PLANNED[leaf.name])
        value = draw(valid(leaf.node)) if value is None else value  # the enums: every member
        here = body
        for key in leaf.path[:-1]:
            here = here.setdefault(key, {})
        here[leaf.path[-1]] = value
    assume(not validate_alpajob(body))
    return body


def answer_plan(tmp_path: Path, body: dict[str, Any]) -> None:
    from alpajob.cli.main import main

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(body))
    code = main(["plan", str(path), "--no-plan-cache", "--plan-time-limit", "120"])
    assert code in (0, 2), code


@settings(QUICK, max_examples=2)
@given(plannable())
def test_an_accepted_manifest_plans_or_says_why(tmp_path_factory: pytest.TempPathFactory,
                                                capsys: pytest.CaptureFixture[str], body: dict[str, Any]) -> None:
    answer_plan(tmp_path_factory.mktemp("plan"), body)
    err = capsys.readouterr().err.strip()
    if err:
        _one_line(err.splitlines()[-1])
        assert "Traceback" not in err, err


@pytest.mark.slow
@settings(THOROUGH, max_examples=40)
@given(plannable())
def test_an_accepted_manifest_plans_or_says_why_thoroughly(
        tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str], body: dict[str, Any]) -> None:
    answer_plan(tmp_path_factory.mktemp("plan"), body)
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err


# --- the corpus ------------------------------------------------------------------------

def _corpus() -> list[Path]:
    return sorted(CORPUS.glob("*.yaml"))


@pytest.mark.parametrize("case", _corpus(), ids=lambda path: path.stem)
def test_the_corpus(tmp_path: Path, case: Path) -> None:
    """Each case the fuzzer found, with the line it must now get (its first comment:
    ``# says: <part of the line>``, or ``# says: a job``)."""
    text = case.read_bytes()
    says = re.search(rb"^# says: (.*)$", text, re.M)
    assert says, f"{case.name} needs a '# says: ...' line"
    expected = says.group(1).decode()
    path = tmp_path / case.name
    path.write_bytes(text)
    try:
        load_job(path)
        outcome = "a job"
    except ManifestError as error:
        _one_line(str(error))
        outcome = str(error)
    assert expected in outcome, outcome
    try:
        body = yaml.safe_load(text)
    except yaml.YAMLError:
        return
    if isinstance(body, dict):
        answer(body)
