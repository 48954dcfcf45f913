"""The trainer image: trainer_image/Dockerfile read statically (no container engine
runs here), and the image's entry points run as plain processes, as the pods run them:
``alpajob plan`` (planner pod), ``alpajob driver`` (head pod), ``alpajob mesh-worker``
(mesh pods) and ``alpajob operator`` (the operator's Deployment).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "trainer_image" / "Dockerfile"
DOCKERIGNORE = ROOT / "trainer_image" / "Dockerfile.dockerignore"
EXAMPLE = ROOT / "manifests" / "examples" / "manual-gpt.yaml"


def instructions(stage: str = "trainer") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of one stage of the Dockerfile (``FROM ... AS stage``),
    after the ARGs declared before the first FROM; continuation lines joined."""
    logical, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    out, current_stage = [], None
    for line in logical:
        word, _, rest = line.strip().partition(" ")
        word, rest = word.upper(), rest.strip()
        if word == "FROM":
            current_stage = rest.split()[-1] if " AS " in f" {rest.upper()} " else ""
        if current_stage is None or current_stage == stage:
            out.append((word, rest))
    return out


def stages() -> list[str]:
    """The Dockerfile's stage names, in order (the last is what a plain build makes)."""
    return [line.split()[-1] for line in DOCKERFILE.read_text().splitlines() if line.startswith("FROM ")]


def sent(source: str) -> bool:
    """Whether the ignore file lets ``source`` (a COPY source) into the build context."""
    kept = {line[1:].rstrip("/") for line in DOCKERIGNORE.read_text().splitlines() if line.startswith("!")}
    return source in kept or any(source.startswith(k + "/") for k in kept)


def only(name: str, stage: str = "trainer") -> list[str]:
    return [args for word, args in instructions(stage) if word == name]


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def pinned(package: str) -> str:
    for requirement in pyproject()["project"]["dependencies"]:
        match = re.fullmatch(rf"{re.escape(package)}==([\w.]+)", requirement)
        if match:
            return match.group(1)
    raise AssertionError(f"pyproject.toml does not pin {package}")


# --- the Dockerfile --------------------------------------------------------------------

def test_base_is_a_pinned_cuda_12_runtime_on_ubuntu_lts_unless_told() -> None:
    (base,) = only("FROM")
    assert base == "${BASE_IMAGE} AS trainer"
    assert stages()[-1] == "trainer", "the trainer is the last stage: what a plain build makes"
    default = dict(arg.split("=", 1) for arg in only("ARG"))["BASE_IMAGE"]
    assert re.fullmatch(r"nvidia/cuda:12\.\d+\.\d+-runtime-ubuntu(22|24)\.04", default), default
    assert [word for word, _ in instructions()][0] == "ARG"  # declared before FROM, so FROM may use it


def test_python_is_3_11_in_a_virtual_environment() -> None:
    runs = " ".join(only("RUN"))
    assert "python3.11" in runs and "python3.11 -m venv" in runs
    assert pyproject()["project"]["requires-python"] == ">=3.11"


def test_gpu_jax_is_pinned_to_the_project_version() -> None:
    args = dict(arg.split("=", 1) for arg in only("ARG"))
    assert args["LOCK"] == "requirements/trainer-cuda.txt"  # the GPU build by default
    from test_locks import locked

    for lock in ("trainer-cuda.txt", "trainer-cpu.txt"):
        versions = {name: version for name, (version, _) in locked(lock).items()}
        assert versions["jax"] == versions["jaxlib"] == pinned("jax") == pinned("jaxlib")
        assert {"s3fs", "gcsfs"} <= set(versions)  # the cloud extra, for spec.data
    assert "jax-cuda12-plugin" in locked("trainer-cuda.txt")
    assert any('pip install --require-hashes --no-deps -r "${LOCK}"' in run for run in only("RUN"))


def test_every_package_folder_is_copied_and_sent() -> None:
    # The namespace, and the card's folders it links to: the build needs them all.
    links = [path for path in (ROOT / "alpajob").iterdir() if path.is_symlink()]
    folders = {"alpajob"} | {path.resolve().relative_to(ROOT).parts[0] for path in links}
    assert {"planner", "operator", "trainer_image"} <= folders
    copied = {args.split()[0] for args in only("COPY") if len(args.split()) == 2}
    sources = {source for args in only("COPY") for source in args.split()[:-1]}
    assert folders <= copied, sorted(folders - copied)
    assert {"pyproject.toml", pyproject()["project"]["readme"]} <= sources
    assert all((ROOT / source).exists() for source in sources)
    # The ignore file keeps everything out but what is copied.
    assert all(sent(source) for source in sources), sorted(s for s in sources if not sent(s))


def test_the_operator_target_holds_neither_jax_nor_tini_and_runs_the_operator() -> None:
    """``--target operator``: a slim base, the operator's lock only, the same uid as the
    operator Deployment's securityContext, ``alpajob`` as its entry point."""
    (base,) = only("FROM", "operator")
    assert base == "${OPERATOR_BASE_IMAGE} AS operator"
    args = dict(arg.split("=", 1) for arg in only("ARG", "operator"))
    assert args["OPERATOR_BASE_IMAGE"].startswith("debian:bookworm")
    runs = " ".join(only("RUN", "operator"))
    assert "-r requirements/operator.txt" in runs and "tini" not in runs and "LOCK" not in runs
    assert only("USER", "operator")[-1] == only("USER")[-1]
    assert [json.loads(a) for a in only("ENTRYPOINT", "operator")] == [["alpajob"]]
    assert [json.loads(a) for a in only("CMD", "operator")] == [["operator", "--help"]]
    sources = {source for args in only("COPY", "operator") for source in args.split()[:-1]}
    assert all(sent(source) for source in sources), sorted(s for s in sources if not sent(s))
    operator = yaml.safe_load_all((ROOT / "manifests" / "operator.yaml").read_text())
    deployment = next(d for d in operator if d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"].endswith("/alpajob-operator:0.1.0")


def test_runs_as_non_root_uid_1000_like_the_pods() -> None:
    from alpajob.operator.children import head_pod
    from alpajob.operator.names import ChildNames

    users = only("USER")
    assert users, "no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, "a numeric uid lets the kubelet check runAsNonRoot"
    assert gid == "" or (gid.isdigit() and int(gid) != 0)
    operator = yaml.safe_load_all((ROOT / "manifests" / "operator.yaml").read_text())
    deployment = next(d for d in operator if d["kind"] == "Deployment")
    assert int(uid) == deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    job = {"metadata": {"name": "demo", "namespace": "ml", "uid": "u-1"}, "spec": {"model": {"zoo": "gpt"}}}
    (driver,) = head_pod(job, ChildNames("demo", 0), None)["spec"]["containers"]
    assert int(uid) == driver["securityContext"]["runAsUser"]
    words = [word for word, _ in instructions()]
    assert "WORKDIR" in words[words.index("USER"):], "a WORKDIR after USER, owned by the user"


def test_entrypoint_is_the_alpajob_command_under_an_init_that_reaps() -> None:
    """The ENTRYPOINT, and the head's and mesh hosts' commands, run ``alpajob`` under
    tini (the image installs it from its apt packages): PID 1 reaps what Ray orphans."""
    from alpajob.api.runtime import INIT_COMMAND
    from alpajob.operator.children import head_pod, mesh_pod
    from alpajob.operator.names import ChildNames

    assert [json.loads(a) for a in only("ENTRYPOINT")] == [[*INIT_COMMAND, "alpajob"]]
    assert any("apt-get install" in a and " tini" in a for a in only("RUN"))
    job = {"metadata": {"name": "demo", "namespace": "ml", "uid": "u-1"}, "spec": {"model": {"zoo": "gpt"}}}
    for pod in (head_pod(job, ChildNames("demo", 0), None),
                mesh_pod(job, ChildNames("demo", 0), 0, 0, 1, "node-0", 8, False, None)):
        (container,) = pod["spec"]["containers"]
        assert container["command"][:3] == [*INIT_COMMAND, "alpajob"]
    assert [json.loads(a) for a in only("CMD")] == [["--help"]]
    assert pyproject()["project"]["scripts"]["alpajob"] == "alpajob.cli.main:entry"
    assert only("HEALTHCHECK") == []


# --- the entry points, as plain processes ----------------------------------------------

def alpajob(*args: str, timeout: float = 50) -> subprocess.CompletedProcess[str]:
    """``alpajob ARGS`` (the image's ENTRYPOINT) as ``python -m alpajob.cli.main``, without
    the ALPAJOB_* environment the operator would set; wide, so no line is wrapped."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ALPAJOB_")}
    env["COLUMNS"] = "500"
    return subprocess.run([sys.executable, "-m", "alpajob", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_plan_writes_a_plan(tmp_path: Path) -> None:
    from alpajob.api.plan import read_plan

    output = tmp_path / "plan.json"
    done = alpajob("plan", str(EXAMPLE.relative_to(ROOT)), "--output", str(output))
    assert done.returncode == 0, done.stdout + done.stderr
    plan = read_plan(output)
    assert len(plan.stages) == 2  # the example's two manual stages
    assert str(output) in done.stdout


def test_mesh_worker_without_a_mesh_names_the_flag() -> None:
    done = alpajob("mesh-worker")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--mesh" in done.stderr and "ALPAJOB_MESH" in done.stderr


def test_driver_with_a_missing_plan_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "plan.json"
    done = alpajob("driver", str(EXAMPLE), "--plan", str(missing))
    assert done.returncode == 2, done.stdout + done.stderr
    assert str(missing) in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("command", [["operator", "--help"], ["--help"]], ids=["operator", "cmd"])
def test_help_exits_zero(command: list[str]) -> None:
    done = alpajob(*command)
    assert done.returncode == 0, done.stderr
    assert "usage: alpajob" in done.stdout
    if command[0] == "operator":
        assert "--all-namespaces" in done.stdout and "--namespace" in done.stdout
