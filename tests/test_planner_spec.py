"""The planner's and runtime's knobs in the spec: ``spec.planner.ilpTimeLimitSeconds``,
``spec.planner.calibration`` (a ConfigMap key mounted in the planner pod) and
``spec.parallelism.transport``; what the CLI's flags do locally, a job says on Kubernetes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from alpajob.api.options import PlanOptions
from alpajob.api.runtime import CALIBRATION_PATH, TrainerRuntime, Transport
from alpajob.api.spec import ParallelismSpec, PlannerSpec, Spec
from alpajob.cli.main import main, parser
from alpajob.cli.ray import driver_run
from alpajob.operator import children
from alpajob.operator.names import ChildNames
from alpajob.operator.pool import PoolCluster
from alpajob.planner.plan.make import search_options

ROOT = Path(__file__).resolve().parent.parent
LOCAL = ROOT / "manifests" / "examples" / "local-gpt.yaml"
JOB: dict[str, Any] = {
    "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob",
    "metadata": {"name": "gpt", "namespace": "ml", "uid": "u-1"},
    "spec": {"model": {"zoo": "gpt", "config": "tiny"},
             "planner": {"calibration": {"configMap": "gpu-constants", "key": "h100.json"}}},
}


def _manifest(tmp_path: Path, **spec: Any) -> Path:
    doc = yaml.safe_load(LOCAL.read_text())
    doc["spec"].update(spec)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_ilp_time_limit_comes_from_the_spec_unless_a_flag_overrides_it() -> None:
    parallelism = ParallelismSpec()
    assert search_options(parallelism).ilp_time_limit_s == 10.0
    assert search_options(parallelism, None, PlannerSpec(ilp_time_limit_seconds=3.5)).ilp_time_limit_s == 3.5
    flagged = PlanOptions(ilp_time_limit=1.0)
    assert search_options(parallelism, flagged, PlannerSpec(ilp_time_limit_seconds=3.5)).ilp_time_limit_s == 1.0


@pytest.mark.parametrize(("planner", "field"), [
    ({"ilpTimeLimitSeconds": 0}, "ilpTimeLimitSeconds"),
    ({"ilpTimeLimitSeconds": 7200}, "ilpTimeLimitSeconds"),
    ({"ilpTimeLimitSeconds": float("inf")}, "ilpTimeLimitSeconds"),
    ({"calibration": {"key": "a.json"}}, "configMap"),
    ({"calibration": {"configMap": "c", "key": "a/b.json"}}, "key"),
    ({"calibration": {"configMap": "Not_A_Name"}}, "configMap"),
])
def test_bad_planner_knobs_are_refused_naming_the_field(planner: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as refused:
        Spec.model_validate({"model": {"zoo": "mlp"}, "planner": planner})
    assert field in str(refused.value)


def test_the_planner_pod_mounts_the_calibration_key_and_is_told_where() -> None:
    from pod_security import restricted_violations

    pod = children.planner_pod(JOB, ChildNames("gpt", 0), (PoolCluster("h100-80gb", 2, 8),))
    [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == "calibration"]
    assert volume["configMap"] == {"name": "gpu-constants", "optional": True,
                                   "items": [{"key": "h100.json", "path": "calibration.json"}]}
    [container] = pod["spec"]["containers"]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "calibration"]
    assert f"{mount['mountPath']}/calibration.json" == CALIBRATION_PATH and mount["readOnly"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert TrainerRuntime.from_env(env).calibration == CALIBRATION_PATH
    assert restricted_violations(pod) == []
    bare = copy.deepcopy(JOB)
    del bare["spec"]["planner"]
    plain = children.planner_pod(bare, ChildNames("gpt", 0), (PoolCluster("h100-80gb", 2, 8),))
    assert "calibration" not in {v["name"] for v in plain["spec"]["volumes"]}
    assert TrainerRuntime.from_env({e["name"]: e["value"] for e in plain["spec"]["containers"][0]["env"]}
                                   ).calibration is None


def test_the_planner_plans_with_the_mounted_calibration_and_names_the_field_when_it_is_missing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """In the planner pod (``ALPAJOB_CALIBRATION``) the mounted file is used; a ConfigMap
    or key that is not there (the volume is optional) is one line naming
    ``spec.planner.calibration`` and how to make it; outside a pod, a note says the
    ConfigMap is read on Kubernetes only."""
    from test_calibrate import _stored_as_measured

    manifest = _manifest(tmp_path, planner={"calibration": {"configMap": "gpu-constants", "key": "cpu.json"}})
    calibration = tmp_path / "calibration.json"
    calibration.write_text(_stored_as_measured(2.0).to_json())
    monkeypatch.setenv("ALPAJOB_CALIBRATION", str(calibration))
    assert main(["plan", str(manifest), "--no-plan-cache"]) == 0
    assert f"cost-model constants from {calibration}" in capsys.readouterr().out
    monkeypatch.setenv("ALPAJOB_CALIBRATION", str(tmp_path / "not-mounted.json"))
    assert main(["plan", str(manifest), "--no-plan-cache"]) == 2
    err = capsys.readouterr().err
    assert "spec.planner.calibration" in err and "ConfigMap gpu-constants key cpu.json is not there" in err
    assert "kubectl create configmap gpu-constants --from-file=cpu.json=" in err and "Traceback" not in err
    monkeypatch.delenv("ALPAJOB_CALIBRATION")
    assert main(["plan", str(manifest), "--no-plan-cache"]) == 0
    captured = capsys.readouterr()
    assert "note: spec.planner.calibration (ConfigMap gpu-constants, key cpu.json) is read in the planner pod" \
        in captured.err and "cost-model constants from" not in captured.out


@pytest.mark.parametrize(("transport", "env", "flag", "expected"), [
    ("objectStore", None, None, Transport.OBJECT_STORE),
    ("collective", None, None, Transport.COLLECTIVE),
    ("auto", None, None, Transport.OBJECT_STORE),  # a CPU pool's default
    ("collective", "object-store", None, Transport.OBJECT_STORE),  # the operator's variable wins
    ("collective", None, "object-store", Transport.OBJECT_STORE),  # and the flag over both
])
def test_the_driver_takes_the_transport_the_spec_names(tmp_path: Path, transport: str, env: str | None,
                                                       flag: str | None, expected: Transport) -> None:
    manifest = _manifest(tmp_path, parallelism={**yaml.safe_load(LOCAL.read_text())["spec"].get("parallelism", {}),
                                                "transport": transport})
    plan = tmp_path / "plan.json"
    assert main(["plan", str(manifest), "--output", str(plan)]) == 0
    args = ["driver", str(manifest), "--plan", str(plan), "--address", "127.0.0.1:1"]
    runtime = TrainerRuntime(transport=Transport(env)) if env else TrainerRuntime()
    run = driver_run(parser().parse_args(args + (["--transport", flag] if flag else [])), runtime)
    assert run.options.transport is expected
