"""The operator's per-job goodput series, computed at scrape time from status.time."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from prometheus_client import generate_latest

from alpajob.api.status import JobTime, Phase
from alpajob.operator.metrics import OperatorMetrics


def _samples(metrics: OperatorMetrics) -> dict[str, float]:
    out = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("alpajob_job_"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def test_a_running_jobs_time_counts_up_to_the_scrape_without_a_status_write() -> None:
    """Planning took 30 s and starting 10 s; the job has been Running for 60 s since
    its last phase change, which is the last time the operator wrote status.time."""
    since = (datetime.now(UTC) - timedelta(seconds=60)).strftime("%Y-%m-%dT%H:%M:%SZ")
    metrics = OperatorMetrics()
    metrics.job_time("ml", "gpt", Phase.RUNNING, JobTime(phase_since=since, planning_seconds=30.0,
                                                         starting_seconds=10.0))
    samples = _samples(metrics)
    label = 'job="gpt",namespace="ml"'
    assert samples[f'alpajob_job_phase_seconds{{{label},phase="planning"}}'] == 30.0
    running = samples[f'alpajob_job_phase_seconds{{{label},phase="running"}}']
    assert 59.0 <= running <= 62.0
    assert samples[f"alpajob_job_goodput{{{label}}}"] == running / (running + 40.0)


def test_a_finished_job_stops_counting_and_a_deleted_one_disappears() -> None:
    metrics = OperatorMetrics()
    books = JobTime(phase_since="2026-11-26T10:00:00Z", planning_seconds=20.0, running_seconds=60.0,
                    restarting_seconds=20.0)
    metrics.job_time("ml", "done", Phase.SUCCEEDED, books)
    samples = _samples(metrics)
    assert samples['alpajob_job_phase_seconds{job="done",namespace="ml",phase="running"}'] == 60.0
    assert samples['alpajob_job_goodput{job="done",namespace="ml"}'] == 0.6
    metrics.job_time("ml", "done", None, None)
    assert not [s for s in _samples(metrics) if re.search(r'job="done"', s)]


def test_each_job_has_its_phase_and_restarts_for_the_alerts() -> None:
    """The alerts' per-job series: ``alpajob_job_phase`` is 1 for the job's phase only
    (the stalled-step alert reads the Running ones) and ``alpajob_job_restarts`` its
    restarts, disruptions included (the restart-loop alert)."""
    metrics = OperatorMetrics()
    metrics.job_time("ml", "gpt", Phase.RESTARTING, JobTime(phase_since="2026-11-26T10:00:00Z"), 4)
    samples = _samples(metrics)
    phases = {p.value: samples[f'alpajob_job_phase{{job="gpt",namespace="ml",phase="{p.value}"}}'] for p in Phase}
    assert phases == {p.value: float(p is Phase.RESTARTING) for p in Phase}
    assert samples['alpajob_job_restarts{job="gpt",namespace="ml"}'] == 4.0
