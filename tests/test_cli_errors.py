"""Every CLI mistake is one clear line naming the flag or field, and exit status 2:
checked before any work is done, so nothing is lost."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from alpajob.cli.main import main
from alpajob.trainer_image.checkpoint.lock import FolderLock

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "manifests" / "examples" / "local-gpt.yaml"


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def _manifest(tmp_path: Path, extra: str) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(JOB.read_text() + extra)
    return str(path)


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *expected: str, code: int = 2) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err  # one line (after what the run was doing, if it had started)
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(("flags", "expected"), [
    (["--metrics-port", "99999"], ["--metrics-port", "65535"]),
    (["--metrics-port", "0"], ["--metrics-port"]),
    (["--metrics-out", "/no/such/dir/m.json"], ["--metrics-out", "/no/such/dir", "does not exist"]),
    (["--metrics-out", "/tmp"], ["--metrics-out", "is a directory"]),
    (["--ilp-time-limit", "0"], ["--ilp-time-limit", "greater than 0"]),
    (["--ilp-time-limit", "-1"], ["--ilp-time-limit"]),
    (["--steps", "0"], ["--steps"]),
    (["--devices", "0"], ["--devices"]),
    (["--keep-last", "0"], ["--keep-last"]),
    (["--checkpoint-every", "0"], ["--checkpoint-every"]),
    (["--log-every", "0"], ["--log-every"]),
    (["--prefetch", "-1"], ["--prefetch"]),
    (["--stage-times-every", "0"], ["--stage-times-every"]),
    (["--resume"], ["--resume", "checkpoint directory"]),
    # Flags that would do nothing are refused, not ignored.
    (["--checkpoint-every", "5"], ["--checkpoint-every", "--checkpoint-dir", "nothing is saved"]),
    (["--keep-last", "2"], ["--keep-last", "--checkpoint-dir"]),
    (["--sync-checkpoints"], ["--sync-checkpoints", "--checkpoint-dir"]),
    (["--metrics-linger", "5"], ["--metrics-linger", "--metrics-port"]),
    (["--method", "serial", "--keep-plan"], ["--keep-plan", "a serial run", "ignored"]),
    (["--method", "serial", "--exact-stage-times"], ["--exact-stage-times", "no stages"]),
    (["--method", "serial", "--all-devices"], ["--all-devices", "a serial run"]),
    (["--method", "serial", "--calibration", str(JOB)], ["--calibration", "a serial run"]),
    (["--plan", str(JOB), "--keep-plan"], ["--keep-plan", "a plan file"]),
    (["--plan", "/no/such/plan.json"], ["/no/such/plan.json"]),
])
def test_bad_run_flags(capsys: pytest.CaptureFixture[str], flags: list[str], expected: list[str]) -> None:
    _refused(capsys, ["run", str(JOB), *flags], *expected)


def test_a_metrics_port_in_use(capsys: pytest.CaptureFixture[str], busy_port: int) -> None:
    _refused(capsys, ["run", str(JOB), "--metrics-port", str(busy_port)], "--metrics-port", str(busy_port), "in use")


def test_checkpoint_folders(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    _refused(capsys, ["run", str(JOB), "--checkpoint-dir", str(a_file)], "--checkpoint-dir", "is a file")
    empty = tmp_path / "empty"
    _refused(capsys, ["run", str(JOB), "--checkpoint-dir", str(empty), "--resume"],
             "--resume", "holds no checkpoint", "--resume=auto")
    with FolderLock(tmp_path / "busy"):
        # Busy is no usage error: it exits 3 (try again later), as the operator reads it.
        _refused(capsys, ["run", str(JOB), "--checkpoint-dir", str(tmp_path / "busy")],
                 "another run", "is writing checkpoints here", code=3)


@pytest.mark.parametrize(("extra", "expected"), [
    ("  runPolicy: {backoffLimit: -1}\n", ["spec.runPolicy.backoffLimit"]),
    ("  runPolicy: {activeDeadlineSeconds: 0}\n", ["spec.runPolicy.activeDeadlineSeconds"]),
    ("  checkpoint: {volume: ckpt, intervalSteps: 0}\n", ["spec.checkpoint.intervalSteps"]),
    ("  checkpoint: {volume: ckpt, keepLast: 0}\n", ["spec.checkpoint.keepLast"]),
    ("  checkpoint: {intervalSteps: 5}\n", ["spec.checkpoint.volume"]),
    ("  data: {train: '/no/such/*.txt'}\n", ["spec.data.train", "/no/such/*.txt"]),
    ("  data: {train: x.txt, format: csv}\n", ["spec.data.format"]),
    ("  data: {train: x.txt, tokenizer: /no/such/tokenizer.json}\n", ["spec.data.tokenizer"]),
])
def test_spec_fields_the_apiserver_refuses(capsys: pytest.CaptureFixture[str], tmp_path: Path, extra: str,
                                           expected: list[str]) -> None:
    _refused(capsys, ["run", _manifest(tmp_path, extra), "--steps", "1"], *expected)


def test_manifests_that_are_not_alpajobs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _refused(capsys, ["run", str(tmp_path / "missing.yaml")], "missing.yaml")
    deployment = tmp_path / "deploy.yaml"
    deployment.write_text("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\nspec: {}\n")
    _refused(capsys, ["run", str(deployment)], "kind", "Deployment", "AlpaJob")
    _refused(capsys, ["plan", str(deployment)], "kind", "Deployment")


@pytest.mark.parametrize(("flags", "expected"), [
    (["--output", "/no/such/dir/plan.json"], ["--output", "does not exist"]),
    (["--gpus-per-node", "0"], ["--gpus-per-node"]),
    (["--nodes", "0"], ["--nodes"]),
    (["--ilp-time-limit", "-1"], ["--ilp-time-limit"]),
])
def test_bad_plan_flags(capsys: pytest.CaptureFixture[str], flags: list[str], expected: list[str]) -> None:
    _refused(capsys, ["plan", str(JOB), *flags], *expected)


def test_an_error_message_with_brackets_prints_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Messages are plain text: a suggestion such as "[n, 8]" is not taken for markup."""
    import yaml

    doc = yaml.safe_load((Path(__file__).resolve().parent.parent / "manifests" / "examples" / "manual-gpt.yaml").read_text())
    doc["spec"]["cluster"] = {"gpu": "cpu", "nodes": 2, "gpusPerNode": 8}
    doc["spec"]["parallelism"]["stages"][1]["submeshShape"] = [2, 2]
    doc["spec"]["parallelism"]["stages"][1].pop("logicalMeshShape", None)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "or [n, 8] with n <= 2" in err and len(err.strip().splitlines()) == 1
