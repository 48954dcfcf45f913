"""The runtime contract (``alpajob.api.runtime``) in both directions: the operator builds
each kind of pod with ``to_env()``, and the trainer's commands, run with that pod's
command line and environment, read every variable back (``from_env()``) and act on it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from alpajob.api.errors import ManifestError
from alpajob.api.names import LABEL_ROLE, Role
from alpajob.api.pools import GpuPool
from alpajob.api.runtime import ENV_PREFIX, INIT_COMMAND, RAY_TOKEN_PATH, TrainerRuntime, Transport
from alpajob.cli.main import main, parser
from alpajob.cli.planning import plan_options
from alpajob.cli.ray import driver_run, worker_settings
from alpajob.operator import children
from alpajob.operator.names import ChildNames
from alpajob.operator.pool import PoolCluster

EXAMPLE = Path(__file__).parent.parent / "manifests" / "examples" / "manual-gpt.yaml"
JOB: dict[str, Any] = {
    "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob",
    "metadata": {"name": "gpt", "namespace": "ml", "uid": "u-1"},
    "spec": {"model": {"zoo": "gpt", "config": "tiny"},
             "checkpoint": {"volume": "shared", "intervalSteps": 50, "path": "runs/gpt"}},
}
NAMES = ChildNames("gpt", 2)


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    [container] = pod["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"]}


def command_of(pod: dict[str, Any]) -> argparse.Namespace:
    """The pod's command line, parsed by the ``alpajob`` CLI it runs (the head and mesh
    hosts under the image's init, which reaps what Ray orphans)."""
    [container] = pod["spec"]["containers"]
    command = container["command"]
    if pod["metadata"]["labels"][LABEL_ROLE] in (Role.HEAD, Role.MESH):
        assert tuple(command[:len(INIT_COMMAND)]) == INIT_COMMAND
        command = command[len(INIT_COMMAND):]
    assert command[0] == "alpajob"
    return parser().parse_args(command[1:])


PODS = {
    "planner": lambda: children.planner_pod(JOB, NAMES, (PoolCluster("h100-80gb", 4, 8),)),
    "head": lambda: children.head_pod(JOB, NAMES, None),
    "mesh": lambda: children.mesh_pod(JOB, NAMES, 1, 1, 2, "node-3", 8, False, None),
    "cpu-mesh": lambda: children.mesh_pod(JOB, NAMES, 0, 0, 1, "node-0", 4, True, None),
}


@pytest.mark.parametrize("kind", list(PODS))
def test_every_variable_a_pod_gets_is_part_of_the_contract_and_reads_back(kind: str) -> None:
    env = env_of(PODS[kind]())
    assert TrainerRuntime.unknown_variables(env) == []
    runtime = TrainerRuntime.from_env(env)
    ours = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}
    assert runtime.to_env() == ours, "nothing is lost or added on the way back"
    # The rest is Ray's own: token authentication, in the pods that run Ray only.
    ray = {k: v for k, v in env.items() if k not in ours}
    expected = {} if kind == "planner" else {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": RAY_TOKEN_PATH}
    assert ray == expected
    assert (runtime.job, runtime.namespace, runtime.attempt) == ("gpt", "ml", 2)
    assert runtime.manifest == "/etc/alpajob/manifest.yaml"


def test_the_planner_pod_plans_for_the_pool_and_writes_the_plan_configmap() -> None:
    pod = PODS["planner"]()
    runtime = TrainerRuntime.from_env(env_of(pod))
    args = command_of(pod)
    assert args.command == "plan" and args.manifest is None and runtime.role is Role.PLANNER
    options = plan_options(args, runtime)
    assert (options.gpu, options.nodes, options.gpus_per_node) == ("h100-80gb", 4, 8)
    assert runtime.plan_configmap == "ml/gpt-plan"
    # Plans are cached on the job's checkpoint volume, which the planner pod mounts.
    assert options.cache_dir == "/checkpoints/.alpajob/plans"
    [mount] = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "checkpoints"]
    assert options.cache_dir.startswith(mount["mountPath"] + "/")
    assert plan_options(parser().parse_args(["plan", "--no-plan-cache"]), runtime).cache_dir is None


def test_without_a_checkpoint_volume_the_planner_caches_in_its_own_home() -> None:
    job = {**JOB, "spec": {"model": JOB["spec"]["model"]}}
    runtime = TrainerRuntime.from_env(env_of(children.planner_pod(job, NAMES, (PoolCluster("h100-80gb", 4, 8),))))
    assert runtime.plan_cache is None
    assert plan_options(parser().parse_args(["plan"]), runtime).cache_dir.endswith("alpajob/plans")


def test_mesh_pods_keep_compiled_executables_on_the_job_s_volume(tmp_path: Path) -> None:
    """With a checkpoint volume, a mesh pod is told where JAX keeps its executables
    (on the volume, so a new attempt or a replaced pod reads them back) and its raylet,
    whose workers compile, gets JAX's variables for it; without a volume, neither."""
    from alpajob.api.runtime import COMPILE_CACHE_DIR
    from alpajob.trainer_image.compile_cache import compile_cache_env

    runtime = TrainerRuntime.from_env(env_of(PODS["mesh"]()))
    assert runtime.compile_cache == COMPILE_CACHE_DIR and COMPILE_CACHE_DIR.startswith("/checkpoints/")
    bare = {**JOB, "spec": {"model": JOB["spec"]["model"]}}
    assert TrainerRuntime.from_env(env_of(children.mesh_pod(bare, NAMES, 0, 0, 1, "n", 4, True, None))
                                   ).compile_cache is None
    assert TrainerRuntime.from_env(env_of(PODS["head"]())).compile_cache is None  # the head compiles nothing
    warned: list[str] = []
    env = compile_cache_env(str(tmp_path / "xla"), warned.append)
    assert env == {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"),
                   "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"} and not warned
    (tmp_path / "file").write_text("x")
    assert compile_cache_env(str(tmp_path / "file" / "xla"), warned.append) == {}
    assert len(warned) == 1 and "cannot be written" in warned[0]
    assert compile_cache_env(None, warned.append) == {}


def test_a_planner_pod_reads_back_the_plan_its_earlier_attempt_cached(tmp_path: Path, capsys) -> None:
    """Two planner pods of the job on the same volume: the second reads the plan."""
    env = {"ALPAJOB_ROLE": "planner", "ALPAJOB_MANIFEST": str(EXAMPLE), "ALPAJOB_PLAN_CACHE": str(tmp_path / "plans")}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        assert main(["plan"]) == 0
        assert "plan: cached" not in capsys.readouterr().err
        assert main(["plan"]) == 0
        assert "plan: cached (" in capsys.readouterr().err
    assert any((tmp_path / "plans").iterdir())


def test_the_head_pod_starts_its_ray_head_and_drives_with_checkpoints_and_progress(tmp_path: Path) -> None:
    pod = PODS["head"]()
    env = env_of(pod)
    # The pod mounts the job's ConfigMaps at these paths; here they are local files.
    env["ALPAJOB_MANIFEST"] = str(EXAMPLE)
    env["ALPAJOB_PLAN"] = str(tmp_path / "plan.json")
    assert main(["plan", str(EXAMPLE), "--output", env["ALPAJOB_PLAN"]]) == 0
    run = driver_run(command_of(pod), TrainerRuntime.from_env(env))
    assert run.manifest == str(EXAMPLE) and run.plan.model.name == "gpt-tiny"
    assert run.head_port == 6379 and run.options.address == "127.0.0.1:6379"
    options = run.options
    assert options.checkpoint_dir == "/checkpoints/runs/gpt" and options.checkpoint_every == 50
    assert options.status_configmap == "ml/gpt-progress" and options.metrics_port == 9090
    assert options.max_restarts == 3  # restartScope FailedPods (default): in place, up to backoffLimit
    assert options.transport is Transport.OBJECT_STORE


def test_host_0_of_a_mesh_coordinates_at_the_address_its_pod_was_given() -> None:
    """The mesh actor on host 0 of the pod's own mesh uses the contract's coordinator
    (the headless Service's name, the port the pod declares); the other hosts, other
    meshes' actors, the collective transport's job-wide group and actors outside such a
    pod choose an address at run time."""
    pytest.importorskip("ray")
    from alpajob.trainer_image.distributed.mesh_host import contract_coordinator

    env = env_of(PODS["mesh"]())  # mesh 1, host 1 of 2
    host0 = {**env, "ALPAJOB_HOST": "0", "ALPAJOB_PROCESS_ID": "0"}
    assert contract_coordinator(host0, Transport.OBJECT_STORE, 1, 0) == "m1-h0.gpt-hosts.ml.svc:8476"
    assert contract_coordinator(env, Transport.OBJECT_STORE, 1, 1) is None  # not host 0
    assert contract_coordinator(host0, Transport.OBJECT_STORE, 0, 0) is None  # another mesh's actor
    assert contract_coordinator(host0, Transport.COLLECTIVE, 1, 0) is None
    assert contract_coordinator({}, Transport.OBJECT_STORE, 1, 0) is None


@pytest.mark.parametrize(("kind", "mesh", "host", "devices"), [("mesh", 1, 1, None), ("cpu-mesh", 0, 0, 4)])
def test_a_mesh_pod_joins_its_mesh_at_the_head(kind: str, mesh: int, host: int, devices: int | None) -> None:
    pod = PODS[kind]()
    runtime = TrainerRuntime.from_env(env_of(pod))
    assert worker_settings(command_of(pod), runtime) == ("gpt-head.ml.svc:6379", mesh, host, devices)
    # The mesh's JAX process group: host 0 of the mesh coordinates, every host is one process.
    assert runtime.coordinator == f"m{mesh}-h0.gpt-hosts.ml.svc:8476"
    assert runtime.process_id == host and runtime.process_count == (2 if kind == "mesh" else 1)
    assert runtime.plan == "/etc/alpajob/plan/plan.json"
    assert pod["spec"]["hostname"] == f"m{mesh}-h{host}" and pod["spec"]["subdomain"] == "gpt-hosts"


def test_a_full_runtime_goes_through_the_environment_unchanged() -> None:
    runtime = TrainerRuntime(
        role=Role.MESH, job="j", namespace="n", attempt=3, manifest="/m", plan="/p",
        plan_configmap="n/p", progress_configmap="n/q", gpu="a100-80gb", nodes=2, gpus_per_node=4,
        pools=[GpuPool(gpu="h100-80gb", nodes=1, gpus_per_node=2), GpuPool(gpu="a100-80gb", nodes=3)],
        plan_cache="/c/.alpajob/plans", calibration="/etc/alpajob/calibration/calibration.json",
        ray_address="h:1", ray_port=2, metrics_port=3, mesh=1, host=0, process_id=0,
        process_count=2, coordinator="c:4", devices=4, checkpoint_dir="/c", checkpoint_every=7,
        checkpoint_volume="PersistentVolumeClaim c at /c", object_store_bytes=2**28,
        join_timeout=9.5, transport=Transport.COLLECTIVE, termination_log="/dev/termination-log",
        compile_cache="/c/.alpajob/xla")
    env = runtime.to_env()
    assert len(env) == len(TrainerRuntime.model_fields), "every field has a variable"
    assert TrainerRuntime.from_env(env) == runtime


@pytest.mark.parametrize(("name", "value"), [("ALPAJOB_MESH", "one"), ("ALPAJOB_DEVICES", "0"),
                                             ("ALPAJOB_ROLE", "worker"), ("ALPAJOB_GPU", "h200"),
                                             ("ALPAJOB_POOLS", "[{gpu: h100-80gb}]"),
                                             ("ALPAJOB_POOLS", '[{"gpu": "cpu"}]')])
def test_a_malformed_variable_is_an_error_naming_it(name: str, value: str) -> None:
    with pytest.raises(ManifestError) as info:
        TrainerRuntime.from_env({name: value})
    assert info.value.field == name and repr(value) in str(info.value)


@pytest.mark.parametrize(("gpu", "flag", "expected"), [
    ("cpu", None, Transport.OBJECT_STORE),
    ("h100-80gb", None, Transport.COLLECTIVE),
    ("h100-80gb", "object-store", Transport.OBJECT_STORE),
    ("cpu", "collective", Transport.COLLECTIVE),
])
def test_the_driver_s_transport_defaults_by_device(tmp_path: Path, gpu: str, flag: str | None,
                                                   expected: Transport) -> None:
    """With no ``--transport`` and no ``ALPAJOB_TRANSPORT``, a GPU pool's plan moves its
    messages with collectives (NCCL) and a CPU job through the object store (no
    slower there: benchmarks/ray_runtime.py); a flag names either."""
    import yaml

    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["cluster"]["gpu"] = gpu
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    plan = tmp_path / "plan.json"
    assert main(["plan", str(manifest), "--output", str(plan)]) == 0  # the plan names the device too
    args = ["driver", str(manifest), "--plan", str(plan), "--address", "127.0.0.1:1"]
    run = driver_run(parser().parse_args(args + (["--transport", flag] if flag else [])), TrainerRuntime())
    assert run.options.transport is expected
