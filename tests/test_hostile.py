"""Hostile and careless inputs get one clear line, at once, from the same checks
everywhere: counts past their sane range, a missing ``kind``, zoo configs the model
cannot be, a model that cannot fit the pool, pod template parts the API server would
refuse on the first pod, entrypoints that exit or raise, data globs that walk the
filesystem, planning that runs for ever. Each case here was a traceback, a hang or a
silent acceptance before (the cases of ``tests/test_documents.py`` are the YAML's)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from alpajob.api import limits
from alpajob.api.errors import ManifestError, TimeLimitError
from alpajob.api.resource import document_problems, parse_job
from alpajob.operator.admission import validate_alpajob

ROOT = Path(__file__).resolve().parent.parent
BASE: dict[str, Any] = {
    "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "hostile"},
    "spec": {"model": {"zoo": "gpt", "config": "tiny"}, "training": {"globalBatchSize": 16, "steps": 4},
             "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 2}},
}


def with_spec(**sections: Any) -> dict[str, Any]:
    body = copy.deepcopy(BASE)
    for key, value in sections.items():
        body["spec"][key] = value
    return body


def one_problem(body: dict[str, Any]) -> str:
    problems = validate_alpajob(body)
    assert len(problems) == 1 and "\n" not in problems[0], problems
    return problems[0]


@pytest.mark.parametrize(("section", "value", "field", "says"), [
    ("cluster", {"gpu": "cpu", "nodes": 1_000_000}, "spec.cluster.nodes", "above 1,024"),
    ("cluster", {"gpu": "cpu", "gpusPerNode": 3}, "spec.cluster.gpusPerNode", "power of two"),
    ("cluster", {"gpu": "cpu", "gpusPerNode": 32}, "spec.cluster.gpusPerNode", "above 16"),
    ("model", {"zoo": "gpt", "config": {"layers": 1_000_000}}, "spec.model.config.layers", "above 256"),
    ("model", {"zoo": "gpt", "config": {"vocab": 1}}, "spec.model.config.vocab", "nothing to predict"),
    ("model", {"zoo": "gpt", "config": {"numLayers": 4}}, "spec.model.config.numLayers",
     "the model reads only heads, hidden, layers, seqLen, vocab"),
    ("model", {"zoo": "gpt", "config": {"heads": 5}}, "spec.model.config.heads", "must divide hidden=64"),
    ("model", {"zoo": "moe", "config": {"experts": 1}}, "spec.model.config.experts", "top-2 gating"),
    ("model", {"zoo": "moe", "config": {"capacityFactor": float("inf")}}, "spec.model.config.capacityFactor",
     "positive number"),
    ("model", {"zoo": "moe", "config": {"expertGroupSize": 3000}}, "spec.training.globalBatchSize",
     "do not fill whole expert groups of expertGroupSize=3000; make the batch a multiple of 375"),
    ("model", {"zoo": "wresnet", "config": {"imageSize": 16}}, "spec.model.config.imageSize", "stride is 32"),
    ("model", {"zoo": "wresnet", "config": {"layers": 51}}, "spec.model.config.layers", "unsupported depth"),
    ("training", {"globalBatchSize": 10**12}, "spec.training.globalBatchSize", "above 16,777,216"),
    ("training", {"steps": 10**12}, "spec.training.steps", "above 1,000,000,000"),
    ("training", {"steps": 10, "optimizer": {"name": "adamw", "warmupSteps": 100}},
     "spec.training.optimizer.warmupSteps", "never reach its peak"),
    ("parallelism", {"numMicroBatches": 2**20}, "spec.parallelism.numMicroBatches", "above 16,384"),
    ("image", "trainer\nlatest", "spec.image", "is not an image reference"),
])
def test_a_value_past_its_range_is_one_line_with_the_reason(section: str, value: Any, field: str,
                                                            says: str) -> None:
    problem = one_problem(with_spec(**{section: value}))
    assert problem.startswith(field + ":") and says in problem, problem


def test_every_sane_range_is_in_the_crd_so_the_api_server_refuses_it_at_once() -> None:
    from alpajob.api.crd import crd

    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["cluster"]["properties"]["nodes"]["maximum"] == limits.NODES.most
    assert spec["training"]["properties"]["globalBatchSize"]["maximum"] == limits.GLOBAL_BATCH_SIZE.most
    rules = [r["rule"] for r in spec["parallelism"]["properties"]["numMicroBatches"]["x-kubernetes-validations"]]
    assert any(str(limits.MICRO_BATCHES.most) in rule for rule in rules)
    rules = [r["rule"] for r in spec["cluster"]["properties"]["gpusPerNode"]["x-kubernetes-validations"]]
    assert rules == ["self in [1, 2, 4, 8, 16]"]


def test_a_manifest_without_kind_or_api_version_is_refused() -> None:
    for key, says in (("kind", "kind: is required; add kind: AlpaJob"),
                      ("apiVersion", "apiVersion: is required; add apiVersion: alpajob.io/v1alpha1")):
        body = copy.deepcopy(BASE)
        del body[key]
        assert [str(p) for p in document_problems(body)] == [says]


def test_a_malformed_status_is_one_line_naming_its_field() -> None:
    body = copy.deepcopy(BASE)
    body["status"] = {"phase": "Running", "conditions": 7}
    with pytest.raises(ManifestError, match=r"^status.conditions: Input should be a valid list \(the status"):
        parse_job(body)


def test_a_model_that_cannot_fit_the_pool_is_refused_before_tracing() -> None:
    problem = one_problem(with_spec(model={"zoo": "gpt-39b"}, cluster={"gpu": "v100-16gb", "nodes": 1}))
    assert problem.startswith("spec.cluster: gpt-39b cannot fit") and "at least 37 devices" in problem, problem
    assert validate_alpajob(with_spec(model={"zoo": "gpt-39b"}, cluster={"gpu": "v100-16gb", "nodes": 8})) == []
    sgd = with_spec(model={"zoo": "gpt-39b"}, cluster={"gpu": "v100-16gb", "nodes": 4},
                    training={"optimizer": "sgd"})
    assert validate_alpajob(sgd) == []  # 8 bytes a parameter: 32 V100s hold 39B


def test_the_catalogues_device_memory_is_the_planners() -> None:
    import json

    from alpajob.api.catalog import DEVICE_MEMORY_BYTES

    presets = json.loads((ROOT / "planner" / "cost" / "data" / "presets.json").read_text())
    assert {p.value: b for p, b in DEVICE_MEMORY_BYTES.items()} == {
        name: preset["memory_bytes"] for name, preset in presets.items() if name != "_doc"}


@pytest.mark.parametrize(("zoo", "config"), [
    ("gpt", "tiny"), ("gpt", "2.6b"), ("moe", "tiny"), ("moe", "380m"), ("wresnet", "tiny"),
    ("wresnet", "13b"), ("mlp", "tiny"), ("gpt", {"layers": 3, "hidden": 96, "heads": 3, "vocab": 300}),
    ("moe", {"layers": 3, "experts": 6}),
])
def test_the_parameter_count_from_the_config_is_the_built_models(zoo: str, config: Any) -> None:
    """The memory bound rests on it: counted from the config, without JAX, equal to the
    parameters the zoo builds (an odd MoE depth has one dense layer more)."""
    import jax
    import numpy as np

    from alpajob.api.zoo import resolve_zoo
    from alpajob.trainer_image.zoo import resolve_model

    shapes = jax.eval_shape(resolve_model(zoo, config).init, jax.random.key(0))
    built = sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(shapes))
    assert resolve_zoo(zoo, config).parameters == built


def test_the_memory_bound_is_below_what_the_planner_finds() -> None:
    """Every stage's devices hold its share of the weights, gradients and Adam's moments,
    so the plan's memory over all devices is at least the bound's total."""
    import alpajob
    from alpajob.api.spec import Optimizer
    from alpajob.api.validation import BYTES_PER_PARAMETER
    from alpajob.api.zoo import resolve_zoo

    plan = alpajob.plan(with_spec())
    held = sum(s.peak_memory_bytes * s.submesh_shape[0] * s.submesh_shape[1] for s in plan.stages)
    assert held >= resolve_zoo("gpt", "tiny").parameters * BYTES_PER_PARAMETER[Optimizer.ADAM]


@pytest.mark.parametrize(("template", "field", "says"), [
    ({"mesh": {"affinity": {"nodeAffinity": 7}}}, "spec.podTemplate.mesh.affinity.nodeAffinity",
     "must be a NodeAffinity object"),
    ({"mesh": {"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"app": "x"}}}]}}}},
     "spec.podTemplate.mesh.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0]"
     ".topologyKey", "is required"),
    ({"head": {"volumes": [{"name": "scratch", "emptyDir": {"sizeLimt": "1Gi"}}]}},
     "spec.podTemplate.head.volumes[0].emptyDir.sizeLimt", "unknown field of EmptyDirVolumeSource"),
    ({"head": {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s"}}}]}},
     "spec.podTemplate.head.env[0].valueFrom.secretKeyRef.key", "is required"),
    ({"head": {"resources": {"requests": {"cpu": "4"}, "limits": {"cpu": "500m"}}}},
     "spec.podTemplate.head.resources.requests.cpu", "above its limit"),
    ({"head": {"resources": {"requests": {"memory": "-1Gi"}}}}, "spec.podTemplate.head.resources.requests.memory",
     "is negative"),
    ({"mesh": {"shmSize": -5}}, "spec.podTemplate.mesh.shmSize", "is negative"),
    ({"head": {"volumeMounts": [{"name": "v", "mountPath": "/x", "subPath": "../.."}]}},
     "spec.podTemplate.head.volumeMounts[0].subPath", "without '..'"),
    ({"head": {"metadata": {"labels": {"bad key!": "x"}}}}, "spec.podTemplate.head.metadata.labels",
     "not a valid label key"),
    ({"head": {"nodeSelector": {"pool": "a b"}}}, "spec.podTemplate.head.nodeSelector.pool",
     "is not a label value"),
])
def test_pod_template_parts_the_api_server_would_refuse_are_refused_by_the_webhook(
        template: dict[str, Any], field: str, says: str) -> None:
    problem = one_problem(with_spec(podTemplate=template))
    assert problem.startswith(field + ":") and says in problem, problem


def test_alpajob_plan_refuses_what_the_webhook_refuses_of_a_pod_template() -> None:
    from alpajob.cli.planning import pod_template_check

    job = parse_job(with_spec(podTemplate={"mesh": {"affinity": {"nodeAffinity": 7}}}))
    with pytest.raises(ManifestError, match=r"^spec.podTemplate.mesh.affinity.nodeAffinity: must be a NodeAffinity"):
        pod_template_check(job)
    pod_template_check(parse_job(with_spec()))


def test_real_affinities_volumes_and_value_sources_still_pass() -> None:
    template = {"mesh": {
        "affinity": {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]}]}},
            "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 10, "podAffinityTerm": {
                "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "x"}}}}]}},
        "volumes": [{"name": "scratch", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
                    {"name": "creds", "secret": {"secretName": "s", "items": [{"key": "k", "path": "k"}]}}],
        "env": [{"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}],
        "resources": {"requests": {"cpu": "500m"}, "limits": {"cpu": 1}},
        "metadata": {"labels": {"example.com/team": "ml", "tier": ""}},
    }}
    assert validate_alpajob(with_spec(podTemplate=template)) == []


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, code: str) -> str:
    (tmp_path / f"{name}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.parametrize(("code", "says"), [
    ("import sys\ndef make():\n    sys.exit(0)\n", "called sys.exit(0)"),
    ("def make():\n    raise RuntimeError('no weights here')\n", "raised RuntimeError: no weights here"),
    ("def make(size):\n    return None\n", "takes arguments (size)"),
    ("def make():\n    return 42\n", "returned int"),
    ("raise ValueError('broken at import')\ndef make():\n    pass\n", "importing your model's module"),
])
def test_an_entrypoint_that_misbehaves_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str,
                                                   says: str) -> None:
    from alpajob.api.spec import ModelSpec
    from alpajob.trainer_image.entrypoint import load_model

    name = _module(tmp_path, monkeypatch, f"hostile_{abs(hash(code))}", code)
    with pytest.raises(ManifestError) as refused:
        load_model(ModelSpec(entrypoint=f"{name}:make"), "float32")
    message = str(refused.value)
    assert message.startswith("spec.model.entrypoint:") and says in message and "\n" not in message, message


def test_a_loss_that_raises_while_traced_is_named_as_the_users(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from alpajob.trainer_image.planning import job_graph

    code = ("import jax, jax.numpy as jnp\n"
            "def make():\n"
            "    def loss(params, batch):\n"
            "        raise KeyError('labels')\n"
            "    return (lambda key: {'w': jnp.zeros(3)}, loss,\n"
            "            lambda b: {'x': jax.ShapeDtypeStruct((b, 3), jnp.float32)})\n")
    name = _module(tmp_path, monkeypatch, "hostile_loss", code)
    job = parse_job(with_spec(model={"entrypoint": f"{name}:make"}))
    with pytest.raises(ManifestError, match="tracing your model's training step raised KeyError: 'labels'"):
        job_graph(job)


def test_a_global_batch_of_one_plans() -> None:
    """Traced at 1 and 2 the step was two programs (a traceback); now it is traced at 2
    and rescaled."""
    from alpajob.trainer_image.planning import job_graph

    graph = job_graph(parse_job(with_spec(model={"zoo": "mlp"}, training={"globalBatchSize": 1})))
    assert graph.batch_size == 1


def test_planning_past_its_time_limit_stops_with_one_line_and_plans_again_after() -> None:
    import alpajob

    with pytest.raises(TimeLimitError) as stopped:
        alpajob.plan(with_spec(), plan_time_limit=0.05)
    assert "did not end within plan_time_limit 0.05 s" in str(stopped.value)
    assert alpajob.plan(with_spec(model={"zoo": "mlp"})).stages  # the pool and the timer are gone


def test_a_time_limit_never_stops_an_import_half_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deadline that falls while a module is being imported waits for the import to
    end, then stops the block: a half-executed module would stay broken in a process
    that lives on (the Python API), as JAX's MLIR dialects were."""
    import importlib
    import time

    from alpajob.trainer_image.stopping import Deadline

    (tmp_path / "slow_module_for_deadline.py").write_text(
        "import time\nstarted = time.monotonic()\nwhile time.monotonic() - started < 0.3:\n    pass\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    began = time.monotonic()
    with pytest.raises(TimeLimitError), Deadline(0.05, "--plan-time-limit", lambda: "importing"):
        importlib.import_module("slow_module_for_deadline")
        while True:  # the deadline, tried again after the import, ends this
            time.sleep(0.01)
    assert 0.3 <= time.monotonic() - began < 2.0
    assert sys.modules["slow_module_for_deadline"].DONE


def test_a_glob_that_walks_too_far_is_refused_naming_the_pattern(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from alpajob.trainer_image.data import sources

    for index in range(12):
        (tmp_path / f"{index}.txt").write_text("x")
    monkeypatch.setattr(sources, "GLOB_FILES", limits.Limit(10, "ten is plenty here"))
    with pytest.raises(ManifestError, match=r"matches more than 10 paths .*ten is plenty here"):
        sources.expand([str(tmp_path / "**" / "*")], "spec.data.train")
    assert len(sources.expand([str(tmp_path / "1*.txt")], "spec.data.train")) == 3


@pytest.mark.parametrize(("argv", "says"), [
    (["plan", "{job}", "--nodes", "99999999999999999999"], "--nodes: 99999999999999999999 is above 1,024"),
    (["run", "{job}", "--devices", "100000"], "--devices: 100000 is above 256"),
    (["plan", "{job}", "--plan-time-limit=-1"], "--plan-time-limit: Input should be greater than 0"),
    (["run", "{job}", "--plan-time-limit", "nan"], "--plan-time-limit: Input should be a finite number"),
])
def test_cli_counts_past_their_range_are_one_line_and_exit_2(tmp_path: Path, argv: list[str], says: str) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(BASE))
    done = subprocess.run([sys.executable, "-m", "alpajob", *[a.format(job=job) for a in argv]],
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and says in lines[0], done.stderr



@pytest.mark.parametrize("where", ["/proc/alpajob-checkpoints", "{file}/checkpoints"])
def test_a_checkpoint_folder_that_cannot_be_made_is_one_line(tmp_path: Path, where: str) -> None:
    """Under /proc or under a file, the run trained and then died in orbax's save."""
    from alpajob.cli.paths import directory

    (tmp_path / "file").write_text("x")
    with pytest.raises(ManifestError, match=r"^--checkpoint-dir: cannot make the directory"):
        directory(where.format(file=tmp_path / "file"), "--checkpoint-dir")
    assert directory(str(tmp_path / "a" / "b"), "--checkpoint-dir").is_dir()
