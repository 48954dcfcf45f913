"""A failure's first line is its cause: what a failing ``alpajob`` command writes to its
container's termination log, and the line the operator quotes from a pod's message
when the command wrote none (the log's tail, Ray's shutdown noise around the cause)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from alpajob.api.errors import ManifestError
from alpajob.api.runtime import TERMINATION_LOG, TrainerRuntime
from alpajob.cli.main import main
from alpajob.operator import children
from alpajob.operator.names import ChildNames
from alpajob.operator.pods import cause_line, ending

RAY_NOISE = """\
2026-12-01 10:00:01,123 INFO scripts.py:1234 -- Did not find any active Ray processes.
(raylet) [2026-12-01 10:00:02] Stopped only 0 out of 5 Ray processes within the grace period.
"""


def test_our_error_line_is_the_cause_wherever_it_is_in_the_tail() -> None:
    tail = RAY_NOISE + "error: checkpoint folder /checkpoints/x is not writable by uid 1000\n" + RAY_NOISE
    assert cause_line(tail) == "error: checkpoint folder /checkpoints/x is not writable by uid 1000"


def test_a_tracebacks_exception_line_is_the_cause_not_its_middle() -> None:
    tail = RAY_NOISE + """\
Traceback (most recent call last):
  File "/opt/alpajob/lib/python3.11/site-packages/urllib3/connectionpool.py", line 791, in urlopen
    response = self._make_request(
ConnectionRefusedError: [Errno 111] Connection refused

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/opt/alpajob/bin/alpajob", line 8, in <module>
    sys.exit(main())
urllib3.exceptions.MaxRetryError: HTTPSConnectionPool(host='10.96.0.1', port=443): Max retries exceeded
""" + "(raylet) shutting down\n"
    assert cause_line(tail).startswith("urllib3.exceptions.MaxRetryError: HTTPSConnectionPool")


def test_otherwise_the_last_line_and_a_one_liner_as_it_is() -> None:
    assert cause_line("starting\nKilled\n") == "Killed"
    assert cause_line("  error: one line  \n") == "error: one line"
    assert cause_line("\n\n") == ""


def test_a_failed_pods_ending_leads_with_the_cause() -> None:
    pod = {"metadata": {"name": "j-0-head"}, "status": {"phase": "Failed", "containerStatuses": [{"state": {
        "terminated": {"exitCode": 2, "message": RAY_NOISE * 30 + "error: spec.data.train: no file\n"}}}]}}
    assert ending("j-0-head", pod) == "j-0-head failed: error: spec.data.train: no file"


def test_every_trainer_pod_names_its_termination_log() -> None:
    job = {"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob",
           "metadata": {"name": "j", "namespace": "ml", "uid": "u-1"}, "spec": {"model": {"zoo": "gpt"}}}
    names = ChildNames("j", 0)
    for pod in (children.head_pod(job, names, None), children.mesh_pod(job, names, 0, 0, 1, "n", 8, False, None)):
        [container] = pod["spec"]["containers"]
        assert container["terminationMessagePath"] == TERMINATION_LOG
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"  # a crash still says something
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env[TrainerRuntime.env_name("termination_log")] == TERMINATION_LOG


@pytest.mark.parametrize(("args", "line"), [
    (["plan", "no-such-manifest.yaml"], "error: "),
    (["mesh-worker"], "error: --mesh"),
])
def test_a_failing_command_writes_its_one_line_to_the_termination_log(tmp_path: Path, args: list[str],
                                                                      line: str) -> None:
    log = tmp_path / "termination-log"
    env = {"PATH": "/usr/bin:/bin", TrainerRuntime.env_name("termination_log"): str(log)}
    done = subprocess.run([sys.executable, "-m", "alpajob", *args], capture_output=True, text=True, env=env,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    [written] = log.read_text().splitlines()
    assert written.startswith(line)
    assert written.split(": ", 1)[1][:30] in done.stderr  # the line the user saw



@pytest.fixture(scope="module")
def three_stages(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A manifest whose data is not in this pod, and its real plan of 3 stages."""
    folder = tmp_path_factory.mktemp("three")
    doc = {"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "j"},
           "spec": {"model": {"zoo": "gpt", "config": "tiny"}, "data": {"train": "/data/corpus/*.txt"},
                    "training": {"globalBatchSize": 32}, "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 8},
                    "parallelism": {"method": "manual", "numLayers": 6, "numMicroBatches": 4, "stages": [
                        {"layers": [2 * i, 2 * i + 2], "submeshShape": [1, 4 if i == 2 else 2]} for i in range(3)]}}}
    manifest, plan = folder / "manifest.yaml", folder / "plan.json"
    manifest.write_text(yaml.safe_dump(doc))
    assert main(["plan", str(manifest), "--output", str(plan)]) == 0
    return manifest, plan


@pytest.mark.parametrize("mesh", [0, 2])
def test_a_mesh_pod_whose_data_is_missing_fails_before_ray_naming_the_field(
        tmp_path: Path, three_stages: tuple[Path, Path], mesh: int) -> None:
    """The first and last stages' pods cannot see spec.data.train (a volume not
    mounted): each exits 2 within seconds, that field in its first line and its
    termination message, before any Ray process starts."""
    manifest, plan = three_stages
    log = tmp_path / "termination-log"
    env = {"PATH": os.environ["PATH"], TrainerRuntime.env_name("termination_log"): str(log),
           TrainerRuntime.env_name("manifest"): str(manifest), TrainerRuntime.env_name("plan"): str(plan),
           TrainerRuntime.env_name("mesh"): str(mesh), TrainerRuntime.env_name("ray_address"): "127.0.0.1:9"}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "alpajob", "mesh-worker"], capture_output=True, text=True,
                          env=env, timeout=180, cwd=tmp_path)
    said = done.stdout + done.stderr
    assert done.returncode == 2, said
    [written] = log.read_text().splitlines()
    assert written.startswith("error: spec.data.train: '/data/corpus/*.txt' matches nothing in this pod"), written
    assert "Ray" not in said and time.monotonic() - began < 30


def test_a_middle_stage_reads_no_data_and_checks_none(three_stages: tuple[Path, Path]) -> None:
    from rich.console import Console

    from alpajob.cli.ray import check_mesh_data

    manifest, plan = three_stages
    runtime = TrainerRuntime(manifest=str(manifest), plan=str(plan))
    check_mesh_data(runtime, 1, Console())  # no error: mesh 1 reads nothing
    with pytest.raises(ManifestError, match="spec.data.train"):
        check_mesh_data(runtime, 2, Console())


def test_a_container_a_signal_ended_says_which_and_what_it_was_doing() -> None:
    """An ``os.abort()`` in a model's code (SIGABRT) or the OOM killer (SIGKILL) leaves
    no error line: the last line of the log is what the planner was doing, not why."""
    aborted = {"exitCode": 134, "reason": "Error", "message": "reading data\ntracing my-model\n"}
    oom = {"exitCode": 137, "reason": "OOMKilled", "message": RAY_NOISE + "planning (3/20 parts)\n"}
    pods = [{"status": {"phase": "Failed", "containerStatuses": [{"state": {"terminated": t}}]}}
            for t in (aborted, oom, {"exitCode": 137, "reason": "OOMKilled"})]
    assert ending("j-planner", pods[0]) == "j-planner failed: killed by SIGABRT (exit code 134), its last line: tracing my-model"
    assert ending("j-planner", pods[1]) == ("j-planner failed: killed by SIGKILL (exit code 137, OOMKilled), its last "
                                            "line: planning (3/20 parts)")
    assert ending("j-planner", pods[2]) == "j-planner failed: killed by SIGKILL (exit code 137, OOMKilled)"
    stopped = {"exitCode": 143, "message": "tracing\nstopped by SIGTERM while planning: nothing was saved\n" + RAY_NOISE}
    pod = {"status": {"phase": "Failed", "containerStatuses": [{"state": {"terminated": stopped}}]}}
    assert ending("j-planner", pod) == "j-planner failed: stopped by SIGTERM while planning: nothing was saved"
