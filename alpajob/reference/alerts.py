"""The alerts reference (``docs/reference/alerts.md``), from the chart's PrometheusRule.

The chart's ``templates/prometheusrule.yaml`` is rendered with helm-python-sdk (Helm's
own template engine, no ``helm`` binary) at the chart's default values with the rule
and the ServiceMonitor enabled (the operator's alert needs the latter), so each alert's expression shows the thresholds a default install uses. The
comment written under each ``- alert:`` line of the template (what the expression
means) is read from the template itself, since rendering drops comments.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from alpajob.api.errors import AlpaJobError
from alpajob.reference.helm_values import CHART
from alpajob.reference.markdown import cell, page

_TEMPLATE = "templates/prometheusrule.yaml"


def _rendered_rules(chart: Path) -> list[dict[str, Any]]:
    """The rules of the rendered PrometheusRule, in the template's order."""
    try:
        import helm_python
    except ImportError:
        raise AlpaJobError("the alerts reference renders the chart with helm-python-sdk: "
                           "pip install -e '.[docs]'") from None
    with helm_python.Chart.load(chart) as loaded:
        rendered = loaded.render({"prometheusRule": {"enabled": True}, "serviceMonitor": {"enabled": True}},
                                 name="alpajob",
                                 namespace="alpajob-system", is_install=True)
    rule = next(doc for path, text in rendered.items() if path.endswith("prometheusrule.yaml")
                for doc in yaml.safe_load_all(text) if doc)
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def template_comments(text: str) -> dict[str, str]:
    """Alert name -> the comment lines between its ``- alert:`` line and its ``expr:``."""
    found: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        match = re.match(r"\s*- alert:\s*(\S+)", line)
        if match:
            name = match[1]
            found[name] = ""
        elif name and line.strip().startswith("#"):
            found[name] = (found[name] + " " + line.strip().lstrip("#").strip()).strip()
        elif name:
            name = None
    return found


def _plain(text: str) -> str:
    """An annotation template as a reader sees it: ``{{ $labels.job }}`` -> ``<job>``."""
    text = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", r"<\1>", text)
    return re.sub(r"\{\{\s*\$value[^}]*\}\}", "<value>", text)


def render(chart: Path = CHART) -> str:
    """The whole page."""
    means = template_comments((chart / _TEMPLATE).read_text())
    body: list[str] = []
    for rule in _rendered_rules(chart):
        name = rule["alert"]
        annotations = rule.get("annotations", {})
        body += [f"## {name}", "",
                 f"**Severity** `{rule.get('labels', {}).get('severity', '')}`, "
                 f"**for** `{rule.get('for', '0m')}`.", ""]
        if means.get(name):
            body += [cell(means[name]), ""]
        body += ["```promql", rule["expr"].strip(), "```", "",
                 f"**Summary:** {cell(_plain(annotations.get('summary', '')))}", "",
                 f"**What to do:** {cell(_plain(annotations.get('description', '')))}", ""]
    intro = ("The alerts of the chart's PrometheusRule (`prometheusRule.enabled: true`), rendered "
             "at the default values with the ServiceMonitor on (`AlpaJobOperatorDown` is rendered "
             "only with `serviceMonitor.enabled: true`); `prometheusRule.stalledMinutes`, `restartsPerHour` and "
             "`stageIdleShare` move the thresholds ([Helm values](helm-values.md)). Each fires "
             "per AlpaJob (`namespace`, `job` labels) except the operator's own. The series they "
             "read are in the [metrics reference](metrics.md).")
    return page("Alerts reference", intro, body)
