"""The metrics reference (``docs/reference/metrics.md``), from the Prometheus registries.

The trainer (:class:`alpajob.trainer_image.metrics.TrainingMetrics`) and the operator
(:class:`alpajob.operator.metrics.OperatorMetrics`) each keep their series on a registry
of their own. This page builds both, fills them the way a run does where a label's
values are fixed by the code (the badput buckets of a run's books, the phases of a
job), and lists every family the registries expose: the series names Prometheus
scrapes (a counter's ``_total``, a histogram's ``_bucket``/``_sum``/``_count``), its type,
its labels with their values where the code fixes them, and its help text.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from alpajob.api.status import JobTime, Phase
from alpajob.operator.metrics import OperatorMetrics
from alpajob.reference.markdown import cell, code, page, table
from alpajob.trainer_image.goodput import Goodput
from alpajob.trainer_image.metrics import TrainingMetrics

#: Labels whose values are the job's own (names, indices): not listed.
_OPEN_LABELS = frozenset({"job", "namespace", "stage", "le", "instance"})


def _series(name: str, kind: str) -> list[str]:
    if kind == "counter":
        return [f"{name}_total"]
    if kind == "histogram":
        return [f"{name}_bucket", f"{name}_sum", f"{name}_count"]
    return [name]


def _label_names(owner: Any) -> dict[str, tuple[str, ...]]:
    """Family name -> label names, from the owner's metric objects (prometheus_client
    keeps them in ``_labelnames``; a family with no sample yet shows none)."""
    return {m._name: tuple(m._labelnames) for m in vars(owner).values() if isinstance(m, MetricWrapperBase)}


def _rows(registry: CollectorRegistry, labels: dict[str, tuple[str, ...]]) -> Iterable[list[str]]:
    for family in registry.collect():
        names = labels.get(family.name) or tuple(getattr(family, "_labelnames", ()))
        values: dict[str, set[str]] = {n: set() for n in names}
        for sample in family.samples:
            for key, value in sample.labels.items():
                values.setdefault(key, set()).add(value)
        shown = []
        for label in names:
            known = sorted(values.get(label, ())) if label not in _OPEN_LABELS else []
            shown.append(code(label) + (" (" + ", ".join(known) + ")" if known else ""))
        yield ["<br>".join(code(s) for s in _series(family.name, family.type)), family.type,
               ", ".join(shown), cell(family.documentation)]


def render() -> str:
    """The whole page."""
    trainer = TrainingMetrics("JOB")
    trainer.books(Goodput().summary([1.0], 0.0))
    operator = OperatorMetrics()
    operator.job_time("NAMESPACE", "JOB", Phase.RUNNING, JobTime())
    header = ["Series", "Type", "Labels", "Meaning"]
    body = [
        "## Trainer", "",
        "Served on `/metrics` by `alpajob run --metrics-port PORT` and by a job's head pod (the "
        "chart's PodMonitor scrapes it). Every series carries the job's name as `job`; the "
        "per-stage series carry the stage index as `stage`. A dashboard's stage utilization is "
        "`rate(compute) / rate(compute + idle + communication)` of the stage counters.", "",
        *table(header, _rows(trainer.registry, _label_names(trainer))), "",
        "## Operator", "",
        "Served by `alpajob operator --metrics-port PORT` (the chart's ServiceMonitor scrapes it). "
        "The `alpajob_job_*` series carry each AlpaJob's `namespace` and `job` and are computed "
        "at scrape time from the status the operator last saw.", "",
        *table(header, _rows(operator.registry, _label_names(operator))), "",
    ]
    intro = ("Every Prometheus series AlpaJob exposes, generated from the registries the trainer "
             "and the operator serve. Label values in parentheses are all the values the code "
             "uses. What the dashboard draws from them and which alerts watch them: "
             "[monitoring and alerts](../guides/monitoring.md), [alerts reference](alerts.md).")
    return page("Metrics reference", intro, body)
