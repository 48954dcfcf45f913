"""A release, as a platform team installs it: one version, one name for each image,
and a release workflow that builds, tests and pushes exactly those (alpajob/api/release.py,
.github/workflows/release.yml)."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from alpajob.api import release

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
#: An image or chart of this project's registry, with its tag if it has one.
REFERENCE = re.compile(r"(?:oci://)?ghcr\.io/alpajob/[A-Za-z0-9._/-]*[A-Za-z0-9](?::[A-Za-z0-9_][A-Za-z0-9_.-]*)?")


def _tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = []
    for name in listed.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file() or path.suffix in {".png", ".svg", ".gz", ".whl", ".npy"}:
            continue
        files.append(path)
    return files


def test_one_version_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    """The package, ``alpajob --version``, the chart's version and appVersion all read
    ``alpajob/api/release.py``; pyproject.toml takes it as its dynamic version."""
    import alpajob
    from alpajob.cli.main import main

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "alpajob.api.release.VERSION"}
    assert alpajob.__version__ == release.VERSION == importlib.metadata.version("alpajob")
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"alpajob {release.VERSION}"
    chart = yaml.safe_load((ROOT / "charts" / "alpajob" / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == release.VERSION


def test_one_reference_for_each_image_everywhere() -> None:
    """Every mention of the project's registry in the repository (code, manifests, chart,
    Dockerfile, docs) is one of the release's names, at the release's version: no
    stale tag, no second spelling. The release workflow names none itself."""
    allowed = {release.TRAINER_IMAGE, release.CPU_TRAINER_IMAGE, release.OPERATOR_IMAGE,
               release.TRAINER_REPOSITORY, release.OPERATOR_REPOSITORY, release.CHART_REPOSITORY,
               f"{release.CHART_REPOSITORY}/alpajob"}
    found: dict[str, set[str]] = {}
    for path in _tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for match in REFERENCE.findall(text):
            found.setdefault(match, set()).add(str(path.relative_to(ROOT)))
    stray = {ref: sorted(paths) for ref, paths in found.items() if ref not in allowed}
    assert stray == {}, "names that are not alpajob/api/release.py's"
    assert release.OPERATOR_IMAGE in found and release.TRAINER_IMAGE in found
    assert not any(str(WORKFLOW.relative_to(ROOT)) in paths for paths in found.values())
    deployment = next(d for d in yaml.safe_load_all((ROOT / "manifests" / "operator.yaml").read_text())
                      if d and d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == release.OPERATOR_IMAGE


def _linter(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return found


def test_the_release_workflow_passes_its_linters() -> None:
    """GitHub's workflow schema (SchemaStore's, vendored in check-jsonschema) and zizmor's
    audits (pinned actions, template injection, permissions, credentials), offline, at
    zizmor's strictest persona."""
    schema = subprocess.run([_linter("check-jsonschema"), "--builtin-schema", "vendor.github-workflows",
                             str(WORKFLOW)], capture_output=True, text=True, timeout=120)
    assert schema.returncode == 0, schema.stdout + schema.stderr
    audit = subprocess.run([_linter("zizmor"), "--offline", "--persona", "pedantic", "--no-progress", str(WORKFLOW)],
                           capture_output=True, text=True, timeout=120)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "No findings" in audit.stdout + audit.stderr


def _steps(job: dict[str, Any]) -> list[dict[str, Any]]:
    return list(job["steps"])


def test_the_release_workflow_builds_tests_and_pushes_the_release_s_names() -> None:
    """What the workflow does, read from it: the names come from release_names.py (run
    here: the same names as the module), a tag that is not v+VERSION stops it, .ci/run
    passes before any image is built, each image is built from the Dockerfile's own
    target and lock, smoke-tested, then pushed for amd64 and arm64 only on a tag, and
    the chart is pushed to the release's OCI repository."""
    flow = yaml.safe_load(WORKFLOW.read_text())
    assert set(flow[True]) == {"push", "workflow_dispatch"} and flow[True]["push"] == {"tags": ["v*"]}
    assert flow["permissions"] == {}
    jobs = flow["jobs"]
    names = subprocess.run([sys.executable, str(ROOT / ".github" / "release_names.py")], capture_output=True,
                           text=True, check=True, env={"GITHUB_REF_TYPE": "tag", "PATH": "/usr/bin:/bin"}).stdout
    outputs = dict(line.split("=", 1) for line in names.split())
    assert outputs == {"version": release.VERSION, "trainer": release.TRAINER_IMAGE,
                       "cpu_trainer": release.CPU_TRAINER_IMAGE, "operator": release.OPERATOR_IMAGE,
                       "charts": release.CHART_REPOSITORY, "push": "true"}
    assert set(jobs["names"]["outputs"]) == set(outputs)
    tag_check = next(s for s in _steps(jobs["names"]) if s.get("if") == "github.ref_type == 'tag'")
    assert 'v$VERSION' in tag_check["run"] and "exit 1" in tag_check["run"]
    assert any(s.get("run", "").endswith(".ci/run") for s in _steps(jobs["test"]))
    images = jobs["images"]
    assert set(images["needs"]) == {"names", "test"}
    variants = {entry["variant"]: entry for entry in images["strategy"]["matrix"]["include"]}
    assert {v: e["image"] for v, e in variants.items()} == {
        "trainer": "${{ needs.names.outputs.trainer }}", "cpu-trainer": "${{ needs.names.outputs.cpu_trainer }}",
        "operator": "${{ needs.names.outputs.operator }}"}
    dockerfile = (ROOT / "trainer_image" / "Dockerfile").read_text()
    for entry in variants.values():
        assert re.search(rf"^FROM \S+ AS {entry['target']}$", dockerfile, re.M), entry["target"]
        for arg in entry["build-args"].split():
            key, _, value = arg.partition("=")
            assert re.search(rf"^ARG {key}=", dockerfile, re.M), key
            if key == "LOCK":
                assert (ROOT / value).is_file(), value
    builds = [s for s in _steps(images) if s.get("uses", "").startswith("docker/build-push-action@")]
    assert [b["with"].get("push", False) for b in builds] == [False, True]
    assert builds[0]["with"]["load"] and builds[0]["with"]["platforms"] == "linux/amd64"
    assert builds[1]["with"]["platforms"] == "linux/amd64,linux/arm64"
    assert builds[1]["if"] == "needs.names.outputs.push == 'true'"
    assert all(b["with"]["file"] == "trainer_image/Dockerfile" for b in builds)
    smoke = next(s for s in _steps(images) if s.get("name") == "smoke test")
    assert _steps(images).index(smoke) < _steps(images).index(builds[1])
    assert 'alpajob $VERSION' in smoke["run"]
    chart = jobs["chart"]
    assert set(chart["needs"]) == {"names", "images"}
    pushed = next(s for s in _steps(chart) if s.get("name") == "push the chart")
    assert '"$CHARTS"' in pushed["run"] and pushed["if"] == "needs.names.outputs.push == 'true'"
    assert chart["env"]["CHARTS"] == "${{ needs.names.outputs.charts }}"
    for job in jobs.values():  # every action pinned to a commit, the version in a comment
        for step in _steps(job):
            if "uses" in step:
                assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", step["uses"]), step["uses"]
