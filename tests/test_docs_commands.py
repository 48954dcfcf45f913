"""Every command on every page of the site (and the README) is checked against the
code, so a page cannot drift from the CLI, the manifests or the chart it describes.

The commands are read out of each page's ``bash`` blocks, continuation lines joined,
and split at ``&&``, ``;``, ``|`` and ``&``. Each program has its check:

- ``alpajob``: the command line parses with the CLI's own parser (every subcommand
  and flag exists, every value is of its type) and every file of the repository it
  names exists; in the slow set each one that needs neither a cluster nor a GPU runs,
  and must end with exit 0;
- ``kubectl``: every ``-f`` file of the repository exists and is Kubernetes YAML;
  ``aj`` and ``alpajob`` resources are the CRD's names; ``--for=condition=X`` names
  one of the conditions the operator sets;
- ``helm``: the chart folder and every ``-f`` values file of the repository exist;
- ``docker``: every ``-f`` Dockerfile and ``--target`` stage exists;
- ``python``, ``pip``, ``bash``: their scripts and modules exist.

A program not listed fails the test: a new kind of command needs a check here.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from alpajob.api.crd import PLURAL, SHORT_NAMES, SINGULAR
from alpajob.api.status import ConditionType
from alpajob.cli.main import parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
#: Names a page uses for the reader's own files, not the repository's.
PLACEHOLDERS = {"job.yaml", "my-job.yaml", "my-values.yaml", "monitoring-values.yaml", "my-machine.json",
                "text-gpt.yaml", "plan.svg", "ckpt", "tokens/", "alpajob-dashboard.json",
                "text-gpt-metrics.json", "/tmp/plan.json", "/tmp/ckpt"}
#: Programs that only read what others print, or wait.
PLUMBING = {"less", "grep", "sleep", "curl", "export", "head", "jq"}


def _blocks(page: Path) -> list[str]:
    text = page.read_text()
    return [body for _, body in re.findall(r"^( *)```(?:bash|sh|shell|console)\n(.*?)^\1```", text, re.M | re.S)]


def commands() -> list[tuple[str, list[str]]]:
    """``(page, argv)`` for every command of every page (module docstring)."""
    found = []
    for page in PAGES:
        for block in _blocks(page):
            joined = re.sub(r"\\\n\s*", " ", block)
            for line in joined.splitlines():
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                words = shlex.split(line, comments=True)
                argv: list[str] = []
                for word in [*words, ";"]:
                    if word in ("&&", ";", "|", "&", "||") or word.endswith(";") and word != ";":
                        if word.endswith(";") and word != ";":
                            argv.append(word[:-1])
                        if argv:
                            found.append((str(page.relative_to(ROOT)), argv))
                        argv = []
                    elif word.endswith("&") and not word.startswith("&"):
                        argv.append(word[:-1])
                        found.append((str(page.relative_to(ROOT)), argv))
                        argv = []
                    else:
                        argv.append(word)
    return found


def _program(argv: list[str]) -> tuple[str, list[str]]:
    """The program and its arguments, past ``NAME=value`` environment settings."""
    at = 0
    while at < len(argv) and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[at]):
        at += 1
    return (argv[at], argv[at + 1:]) if at < len(argv) else ("export", [])


def _repository_file(word: str) -> Path | None:
    """The repository file a word names (None for a placeholder or a non-path)."""
    if word in PLACEHOLDERS or word.startswith(("-", "http", "$")) or "/" not in word and "." not in word:
        return None
    if word.startswith(("manifests/", "charts/", "benchmarks/", "trainer_image/", "requirements/", "docs/",
                        "tests/", "alpajob/")):
        return ROOT / word
    return None


def _check_alpajob(args: list[str]) -> None:
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            parser().parse_args(args)
    except SystemExit as stop:
        if stop.code:  # --help and --version exit 0
            raise AssertionError(f"alpajob {' '.join(args)}: {said.getvalue().strip().splitlines()[-1]}") from None


_CONDITIONS = {member.value for member in ConditionType}
_RESOURCES = {PLURAL, SINGULAR, *SHORT_NAMES, f"{PLURAL}.alpajob.io"}
_KUBERNETES = {"pods", "pod", "events", "namespace", "serviceaccount", "rolebinding", "crd", "deploy",
               "validatingwebhookconfiguration", "validatingwebhookconfiguration,mutatingwebhookconfiguration",
               "svc", "configmap"}


#: kubectl flags whose value is the next word.
_VALUED = {"-f", "-l", "--selector", "-n", "--namespace", "-o", "-p", "--type", "--timeout", "--field-selector",
           "--clusterrole", "--serviceaccount", "--for"}


def _check_kubectl(args: list[str]) -> None:
    if args[:1] == ["alpajob"]:  # our plugin (kubectl-alpajob): its own parser judges it
        from alpajob.cli.kubectl import parser as plugin

        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
                plugin().parse_args(args[1:])
        except SystemExit as stop:
            if stop.code:
                raise AssertionError(f"kubectl {' '.join(args)}: {said.getvalue().strip().splitlines()[-1]}") from None
        return
    verbs = [word for i, word in enumerate(args)
             if not word.startswith("-") and (i == 0 or args[i - 1] not in _VALUED)]
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "-f":
            path = _repository_file(value)
            if path is not None:
                assert path.is_file(), value
                assert list(yaml.safe_load_all(path.read_text())), value
    for word in args:
        if word.startswith("--for=condition="):
            assert word.removeprefix("--for=condition=") in _CONDITIONS | {"Established"}, word
    if verbs and verbs[0] in ("get", "describe", "delete", "patch", "wait"):
        named = [w.split("/")[0] for w in verbs[1:] if "/" in w and not w.startswith(("{", "'"))]
        plain = verbs[1] if len(verbs) > 1 and "/" not in verbs[1] else None
        for resource in [*named, *([plain] if plain else [])]:
            assert resource in _RESOURCES | _KUBERNETES, f"kubectl {' '.join(args)}: unknown resource {resource}"


def _check_files(args: list[str]) -> None:
    for word in args:
        path = _repository_file(word)
        if path is not None:
            assert path.exists(), word


def _check_docker(args: list[str]) -> None:
    _check_files(args)
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "--target":
            dockerfile = ROOT / args[args.index("-f") + 1]
            assert re.search(rf"^FROM .* AS {value}$", dockerfile.read_text(), re.M | re.I), value


def _check_python(args: list[str]) -> None:
    if args[:2] == ["-m", "pip"] or args[:1] == ["-m"] and args[1:2] == ["pytest"]:
        return
    _check_files(args)


CHECKS = {"alpajob": _check_alpajob, "kubectl": _check_kubectl, "helm": _check_files, "docker": _check_docker,
          "python": _check_python, "pip": _check_files, "bash": _check_files, "mkdocs": _check_files,
          "ruff": _check_files, "mypy": _check_files, "lint-imports": _check_files}


def test_every_command_of_every_page_is_checked() -> None:
    found = commands()
    assert len(found) > 100
    unknown = sorted({_program(argv)[0] for _, argv in found} - set(CHECKS) - PLUMBING)
    assert not unknown, f"commands without a check in this module: {unknown}"


@pytest.mark.parametrize(("page", "argv"), commands(), ids=lambda v: v if isinstance(v, str) else " ".join(v)[:60])
def test_a_pages_command_matches_the_code(page: str, argv: list[str]) -> None:
    program, args = _program(argv)
    if program in PLUMBING:
        return
    CHECKS[program](args)


# --- the local commands, run -----------------------------------------------------------

#: Local alpajob commands worth running (no cluster, no GPU, no reader's file).
_LOCAL = ("plan", "models", "schema", "crd", "dashboard")


def _runnable() -> list[tuple[str, list[str]]]:
    seen, runs = set(), []
    for page, argv in commands():
        program, args = _program(argv)
        if program != "alpajob" or not args or args[0] not in _LOCAL:
            continue
        if any(word in PLACEHOLDERS - {"plan.svg", "alpajob-dashboard.json"} for word in args):
            continue
        key = tuple(argv)
        if key not in seen:
            seen.add(key)
            runs.append((page, argv))
    return runs


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache folder for the module's runs, as one reader's machine has: the page's
    second command on a job reuses the first one's plan."""
    return tmp_path_factory.mktemp("cache")


def _run_ids() -> list[str]:
    """``own-model.md:1``: the page and the command's place among the page's runs."""
    ids, counts = [], dict[str, int]()
    for page, _ in _runnable():
        name = Path(page).name
        counts[name] = counts.get(name, 0) + 1
        ids.append(f"{name}:{counts[name]}")
    return ids


@pytest.mark.slow
@pytest.mark.parametrize(("page", "argv"), _runnable(), ids=_run_ids())
def test_a_pages_local_command_runs(tmp_path: Path, caches: Path, page: str, argv: list[str]) -> None:
    """Run in a scratch folder holding the repository's manifests, as a reader would from
    a checkout; ``PYTHONPATH=...`` settings are kept."""
    (tmp_path / "manifests").symlink_to(ROOT / "manifests")
    env_words = [word for word in argv if re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", word)]
    env = dict(word.split("=", 1) for word in env_words)
    _, args = _program(argv)
    done = subprocess.run([sys.executable, "-m", "alpajob", *args], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, **env, "XDG_CACHE_HOME": str(caches)}, timeout=600)
    assert done.returncode == 0, f"{page}: alpajob {' '.join(args)}\n{done.stderr[-2000:]}"


def test_the_image_story_is_the_same_true_sentence_wherever_it_is_told() -> None:
    """The default images are named, and said to be unpublished, in the same words on
    every page, and they are the images the operator, the manifests and the chart use."""
    from alpajob.operator.children import DEFAULT_IMAGE

    deployment = next(document for document in yaml.safe_load_all((ROOT / "manifests/operator.yaml").read_text())
                      if document and document.get("kind") == "Deployment")
    containers = deployment["spec"]["template"]["spec"]["containers"]
    chart = yaml.safe_load((ROOT / "charts/alpajob/Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts/alpajob/values.yaml").read_text())
    operator = f"{values['image']['repository']}:{chart['appVersion']}"
    assert containers[0]["image"] == operator
    sentence = (f"The manifests, the chart and the operator name the images `{DEFAULT_IMAGE}` (trainer) and "
                f"`{operator}` (operator), which are not published yet: build and push your own, and point "
                "the operator at them")
    told = [page for page in PAGES if sentence in " ".join(page.read_text().split())]
    assert told == [ROOT / "docs/guides/kubernetes.md"], told
    for page in PAGES:
        text = " ".join(page.read_text().split())
        assert not re.search(r"publishes no image|No image is published|image is published", text), page
