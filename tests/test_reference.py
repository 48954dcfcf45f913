"""The documentation's reference pages (docs/reference/) are generated from the code
and committed; these tests fail when one is stale, and check each generator against
an independent reading of its source, so a page cannot silently leave something out.

Regenerate with ``python -m alpajob.reference``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from alpajob.api.crd import crd
from alpajob.api.errors import AlpaJobError
from alpajob.cli.main import parser
from alpajob.reference import alerts, api, cli, helm_values, metrics
from alpajob.reference.pages import PAGES, REFERENCE, stale, write

sys.path.insert(0, str(Path(__file__).parent))
from test_chart import exposed_metric_names  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "alpajob"
#: Pages rendered with helm-python-sdk (the chart's templates).
NEEDS_HELM = {"alerts.md"}


@pytest.mark.parametrize("name", sorted(PAGES))
def test_the_committed_page_is_what_the_code_generates(name: str) -> None:
    if name in NEEDS_HELM:
        pytest.importorskip("helm_python")
    committed = (REFERENCE / name).read_text()
    assert committed == PAGES[name](), (
        f"docs/reference/{name} is stale: run `python -m alpajob.reference` and commit it")


def test_a_changed_page_is_named_stale_and_rewritten(tmp_path: Path) -> None:
    pytest.importorskip("helm_python")
    assert sorted(write(tmp_path)) == sorted(PAGES)
    assert stale(tmp_path) == []
    (tmp_path / "cli.md").write_text((tmp_path / "cli.md").read_text().replace("--steps", "--stepz"))
    (tmp_path / "metrics.md").unlink()
    assert stale(tmp_path) == ["cli.md", "metrics.md"]
    assert sorted(write(tmp_path)) == ["cli.md", "metrics.md"]
    assert stale(tmp_path) == []


def test_the_check_command_exits_1_naming_a_stale_page(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from alpajob.reference import __main__ as command

    monkeypatch.setattr(command, "stale", lambda: ["api.md"])
    assert command.main(["--check"]) == 1
    assert "docs/reference/api.md is stale" in capsys.readouterr().err


# --- each page against its source --------------------------------------------------------

def _fields(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every (path, schema) of a field under ``node``, lists' items and maps' values included."""
    found = []
    for name, field in (node.get("properties") or {}).items():
        where = f"{path}.{name}" if path else name
        found.append((where, field))
        found += _fields(field, where)
    if isinstance(node.get("items"), dict):
        found += _fields(node["items"], path + "[]")
    if isinstance(node.get("additionalProperties"), dict):
        found += _fields(node["additionalProperties"], path + "{}")
    return found


def _schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_the_api_page_has_a_row_for_every_field_and_every_cel_rule() -> None:
    page = api.render()
    fields = _fields(_schema())
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) == len(fields)
    for path, field in fields:
        parent, _, name = path.rpartition(".")
        section = page.split(f"{{#{api.anchor(parent) or 'alpajob'}}}", 1)[1].split("\n## ", 1)[0]
        row = next((r for r in section.splitlines() if r.startswith(f"| `{name}`")), None)
        assert row is not None, path
        if "default" in field:
            assert json.dumps(field["default"]) in row, path
        for value in field.get("enum", []):
            assert f"`{value}`" in row, path
        if "maxLength" in field:
            assert f"length ≤ {field['maxLength']}" in row, path
        for rule in field.get("x-kubernetes-validations", []):
            assert rule["rule"] in page and rule["message"].split(";")[0] in page, path


def test_every_spec_and_status_field_is_described() -> None:
    """The API reference is only as good as the models' descriptions."""
    silent = [path for path, field in _fields(_schema())
              if path.split(".")[0].split("[")[0] in ("spec", "status") and not field.get("description")]
    assert silent == []


def test_the_cli_page_has_every_command_and_flag() -> None:
    page = cli.render()

    def walk(command: argparse.ArgumentParser, name: str) -> int:
        assert f"## {name} {{#{name.replace(' ', '-')}}}" in page
        count = 0
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child, sub in action.choices.items():
                    count += walk(sub, f"{name} {child}")
            elif action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
                for flag in action.option_strings or [action.dest]:
                    assert f"`{flag}`" in page, (name, flag)
                count += 1
        return count

    arguments = walk(parser(), "alpajob")
    assert arguments == sum(1 for line in page.splitlines() if line.startswith("| `"))
    assert "`--checkpoint-dir`" in page and "`--transport`" in page  # the walk reached run and driver


def test_the_metrics_page_has_every_series_the_registries_expose() -> None:
    page = metrics.render()
    names = {n for n in exposed_metric_names() if not n.endswith("_created")}
    assert names and {n for n in names if f"`{n}`" not in page} == set()
    listed = set(re.findall(r"`(alpajob_[a-z_]+)`", page))
    assert listed <= names  # and no series the registries do not expose


def test_the_metrics_page_has_every_series_the_dashboard_and_the_alerts_read() -> None:
    page = metrics.render()
    dashboard = (CHART / "files" / "grafana-dashboard.json").read_text()
    rules = (CHART / "templates" / "prometheusrule.yaml").read_text()
    read = set(re.findall(r"\balpajob_[a-z_]+", dashboard + rules))
    assert read and {n for n in read if f"`{n}`" not in page} == set()


def test_the_alerts_page_has_every_alert_of_the_template_with_its_meaning() -> None:
    pytest.importorskip("helm_python")
    template = (CHART / "templates" / "prometheusrule.yaml").read_text()
    names = re.findall(r"- alert:\s*(\S+)", template)
    page = alerts.render()
    assert names and re.findall(r"^## (\S+)$", page, flags=re.M) == names
    assert "> 600" in page  # prometheusRule.stalledMinutes: 10 at the defaults, in seconds
    stalled = alerts.template_comments(template)["AlpaJobStepStalled"]
    assert stalled.startswith("The last step ended") and stalled in page


def test_the_helm_values_page_has_every_key_of_values_yaml_described() -> None:
    page = helm_values.render()
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def keys(node: Any, path: str = "") -> list[str]:
        if not isinstance(node, dict) or (path and not node):
            return []
        out = []
        for key, child in node.items():
            where = f"{path}.{key}" if path else key
            out += [where, *keys(child, where)] if isinstance(child, dict) and child and \
                where not in ("resources", "podSecurityContext") else [where]
        return out

    rows = {line.split("`")[1]: line for line in page.splitlines() if line.startswith("| `")}
    assert set(keys(values)) <= set(rows)
    undescribed = [key for key, row in rows.items() if row.rstrip().endswith("|  |")]
    assert undescribed == []


def test_a_values_comment_is_read_from_the_lines_right_above_its_key() -> None:
    text = ("# header\n\n# -- top\nfirst: 1\n# section\nsecond:\n  # -- leaf, with a\n"
            "  # --flag inside\n  inner: 2\n  bare: 3\nthird: 4\n")
    assert helm_values.comments(text) == {"first": "top", "second": "section",
                                          "second.inner": "leaf, with a --flag inside"}


def test_every_error_class_has_a_troubleshooting_section() -> None:
    """The troubleshooting guide names every user-facing error class with its fix."""
    import alpajob.operator.pool  # noqa: F401  (the classes below register on import)
    import alpajob.trainer_image.checkpoint.store  # noqa: F401
    import alpajob.trainer_image.data.remote  # noqa: F401
    import alpajob.trainer_image.distributed.driver  # noqa: F401
    import alpajob.trainer_image.distributed.raylet  # noqa: F401
    import alpajob.trainer_image.runtime.meshes  # noqa: F401

    def every(cls: type) -> list[type]:
        return [cls] + [c for sub in cls.__subclasses__() for c in every(sub)]

    guide = (ROOT / "docs" / "guides" / "troubleshooting.md").read_text()
    sections = set(re.findall(r"^## (\w+)", guide, flags=re.M))
    missing = sorted({c.__name__ for c in every(AlpaJobError)[1:]} - sections)
    assert missing == []
