"""The lock files (``requirements/*.txt``, made by ``requirements/lock.sh``): every
package an image or CI installs, transitive ones included, at one version with its
sha256 hashes; the direct pins equal pyproject.toml's; the images and CI install from
them with ``--require-hashes``, so a file that changed on the index fails the build."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "requirements"
#: Each lock, and what it is made from (the requirements/lock.sh lines).
SOURCES = {
    "trainer-cuda.txt": ("dependencies", "cloud", "cuda.in", "build.in"),
    "trainer-cpu.txt": ("dependencies", "cloud", "build.in"),
    "operator.txt": ("operator.in",),
    "ci.txt": ("dependencies", "test", "docs", "build.in"),
}
#: What the operator image must never hold (the operator imports none of it).
HEAVY = {"jax", "jaxlib", "ray", "numpy", "scipy", "optax", "orbax-checkpoint", "grain"}


def locked(name: str) -> dict[str, tuple[str, list[str]]]:
    """package -> (version, hashes) of one lock file; each entry must be ``name==version``
    followed by at least one ``--hash=sha256:...``."""
    text = (LOCKS / name).read_text()
    entries: dict[str, tuple[str, list[str]]] = {}
    for block in re.split(r"\n(?=\S)", text):
        line = block.split("\n", 1)[0]
        if not line or line.startswith("#"):
            continue
        found = re.fullmatch(r"([A-Za-z0-9._-]+)(\[[^\]]*\])?==([^\s;\\]+)( ;[^\\]*)? \\", line)
        assert found, f"{name}: not a pinned, hashed requirement: {line!r}"
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})", block)
        assert hashes, f"{name}: {found.group(1)} has no sha256 hash"
        entries[str(canonicalize_name(found.group(1)))] = (found.group(3), hashes)
    return entries


def pinned_requirements(source: str) -> list[Requirement]:
    """The requirements of one source: pyproject's dependencies or one of its extras, or
    a requirements/*.in file (``-r`` lines followed)."""
    if source.endswith(".in"):
        out = []
        for line in (LOCKS / source).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("-r "):
                out += pinned_requirements(line[3:].strip())
            elif line:
                out.append(Requirement(line))
        return out
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = project["dependencies"] if source == "dependencies" else project["optional-dependencies"][source]
    return [Requirement(r) for r in listed if not r.startswith("alpajob[")]


@pytest.mark.parametrize("lock", list(SOURCES))
def test_every_pin_is_locked_at_its_version_and_everything_is_hashed(lock: str) -> None:
    entries = locked(lock)
    assert len(entries) > 20
    env = {"platform_machine": "x86_64", "sys_platform": "linux", "python_version": "3.11",
           "python_full_version": "3.11.7", "extra": ""}
    for source in SOURCES[lock]:
        for requirement in pinned_requirements(source):
            if requirement.marker is not None and not requirement.marker.evaluate(env):
                continue
            name = str(canonicalize_name(requirement.name))
            assert name in entries, f"{lock} lacks {name} (run requirements/lock.sh)"
            version = entries[name][0]
            assert requirement.specifier.contains(version, prereleases=True), (
                f"{lock} holds {name}=={version}, {source} asks {requirement.specifier} (run requirements/lock.sh)")


def test_one_pin_agrees_across_the_locks() -> None:
    """A package in two locks has one version, so the CI suite tests what the images run."""
    versions: dict[str, dict[str, str]] = {}
    for lock in SOURCES:
        for name, (version, _) in locked(lock).items():
            versions.setdefault(name, {})[lock] = version
    split = {name: by for name, by in versions.items() if len(set(by.values())) > 1}
    assert split == {}, f"versions differ between locks: {split}"


def test_the_operator_lock_holds_no_jax_ray_or_numpy_and_the_gpu_lock_the_cuda_wheels() -> None:
    operator = set(locked("operator.txt"))
    assert operator & HEAVY == set()
    assert {"kopf", "kubernetes", "pydantic", "cryptography", "prometheus-client"} <= operator
    cuda = set(locked("trainer-cuda.txt"))
    assert any(name.startswith("jax-cuda12-plugin") for name in cuda)
    assert any(name.startswith("nvidia-") for name in cuda)
    assert not any(name.startswith("jax-cuda") or name.startswith("nvidia-") for name in locked("trainer-cpu.txt"))


def _install_lines(dockerfile: Path) -> list[str]:
    """The Dockerfile's ``pip install`` RUN lines, continuations joined and each ARG's
    default put in for ``${NAME}``."""
    text = dockerfile.read_text().replace("\\\n", " ")
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))
    text = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), text)
    return [line for line in text.splitlines() if line.startswith("RUN") and "pip install" in line]


def test_the_images_install_only_from_a_lock_with_hashes_checked() -> None:
    dockerfile = "trainer_image/Dockerfile"  # both targets: trainer and operator
    installs = [command for line in _install_lines(ROOT / dockerfile)
                for command in re.split(r"&&|;", line) if "pip install" in command]
    assert len(installs) == 4, f"{dockerfile}: {installs}"  # per target: the lock, then the project
    for command in installs:
        if "--require-hashes" in command:
            assert re.search(r"-r \S*requirements/", command) and "--no-deps" in command, command
        else:  # the project itself, from the context, with nothing fetched
            assert "--no-deps" in command and "--no-build-isolation" in command and "--no-index" in command, command


def test_ci_installs_the_lock_with_hashes_before_the_readme_commands() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    [install] = [line for line in ci.splitlines() if "pip install" in line and "requirements/ci.txt" in line]
    assert "--require-hashes" in install and "--no-deps" in install
    assert ci.index(install) < ci.index("The README's first two")


@pytest.mark.parametrize("lock", ["trainer-cuda", "trainer-cpu", "operator"])
def test_each_image_s_sbom_lists_exactly_its_lock(lock: str) -> None:
    """requirements/sbom/<lock>.cdx.json (CycloneDX, made from the lock by lock.sh; the
    image carries it): every locked package at its version with its hashes, nothing
    else, so an SBOM left behind by a lock that moved fails here."""
    import json
    from urllib.parse import unquote

    sbom = json.loads((LOCKS / "sbom" / f"{lock}.cdx.json").read_text())
    assert sbom["bomFormat"] == "CycloneDX" and sbom["specVersion"] == "1.6"
    assert sbom["metadata"]["component"]["name"] == "alpajob"
    listed = {}
    for component in sbom["components"]:
        hashes = sorted(h["content"] for ref in component.get("externalReferences", [])
                        for h in ref.get("hashes", []))
        listed[str(canonicalize_name(component["name"]))] = (component["version"], hashes)
        purl_name, _, purl_version = component["purl"].removeprefix("pkg:pypi/").partition("@")
        assert (purl_name, unquote(purl_version)) == (component["name"], component["version"])
    assert listed == {name: (version, sorted(hashes)) for name, (version, hashes) in locked(f"{lock}.txt").items()}
