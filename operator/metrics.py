"""The operator's own Prometheus metrics, on a registry of its own (no global state)::

    alpajob_operator_jobs{phase="Running"}            jobs by phase (this operator's view)
    alpajob_operator_reconcile_seconds                histogram of one reconciliation pass
    alpajob_operator_planning_seconds                 histogram: job start to plan ready
    alpajob_operator_restarts_total                   whole-job restarts it ordered
    alpajob_operator_reconcile_errors_total           passes that raised
    alpajob_operator_api_requests_total{verb,code}    its requests to the Kubernetes API (reads,
                                                      writes, events; kopf's watches not counted)
    alpajob_job_phase_seconds{namespace,job,phase}    a job's wall time by phase (status.time,
                                                      the phase in progress counted to now)
    alpajob_job_goodput{namespace,job}                its Running time over all of it but Queued and Suspended
    alpajob_job_phase{namespace,job,phase}            1 for the job's phase, 0 for the others
    alpajob_job_restarts{namespace,job}               its restarts (status.restarts + disruptions)

The per-job series carry the AlpaJob's own ``namespace`` and ``job`` labels (the
chart's ServiceMonitor honours them, as the trainers' PodMonitor does), and are
computed when Prometheus scrapes, from the status each pass saw: nothing is written
to the API server to keep them current.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from alpajob.api.errors import AlpaJobError
from alpajob.api.status import JobTime, Phase
from alpajob.operator.status import TIME_BUCKETS, close_phase


class JobTimes(Collector):
    """``alpajob_job_phase_seconds``, ``alpajob_job_goodput``, ``alpajob_job_phase`` and
    ``alpajob_job_restarts`` of every job, from the phase, the
    :class:`~alpajob.api.status.JobTime` and the restarts its last pass saw, the phase
    in progress counted up to the scrape."""

    def __init__(self) -> None:
        self.jobs: dict[tuple[str, str], tuple[Phase, JobTime, int]] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        seconds = GaugeMetricFamily("alpajob_job_phase_seconds", "an AlpaJob's wall time by phase",
                                    labels=["namespace", "job", "phase"])
        goodput = GaugeMetricFamily("alpajob_job_goodput", "an AlpaJob's Running time over its "
                                    "planning, starting, running and restarting time", labels=["namespace", "job"])
        phases = GaugeMetricFamily("alpajob_job_phase", "1 for an AlpaJob's phase, 0 for the others",
                                   labels=["namespace", "job", "phase"])
        restarts = GaugeMetricFamily("alpajob_job_restarts", "an AlpaJob's restarts, counted against "
                                     "backoffLimit or not", labels=["namespace", "job"])
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        buckets = sorted(set(TIME_BUCKETS.values()))
        for (namespace, job), (phase, books, restarted) in sorted(dict(self.jobs).items()):  # a copy
            for name in Phase:
                phases.add_metric([namespace, job, name.value], 1.0 if name is phase else 0.0)
            restarts.add_metric([namespace, job], restarted)
            so_far = books.model_copy()
            close_phase(so_far, phase, now)  # the phase in progress, counted up to now
            for bucket in buckets:
                seconds.add_metric([namespace, job, bucket.removesuffix("_seconds")], getattr(so_far, bucket))
            share = so_far.goodput()
            if share is not None:
                goodput.add_metric([namespace, job], share)
        yield seconds
        yield goodput
        yield phases
        yield restarts


class OperatorMetrics:
    """Gauges, histograms and counters of one operator process."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.jobs = Gauge("alpajob_operator_jobs", "AlpaJobs by phase", ["phase"], registry=r)
        self.reconcile = Histogram("alpajob_operator_reconcile_seconds", "one reconciliation pass", registry=r,
                                   buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        self.planning = Histogram("alpajob_operator_planning_seconds", "job start to plan ready", registry=r,
                                  buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800))
        self.restarts = Counter("alpajob_operator_restarts", "whole-job restarts ordered", registry=r)
        self.errors = Counter("alpajob_operator_reconcile_errors", "reconciliation passes that raised", registry=r)
        self.api_requests = Counter("alpajob_operator_api_requests", "requests to the Kubernetes API",
                                    ["verb", "code"], registry=r)
        self._phases: dict[str, str] = {}  # job key -> its phase
        self.times = JobTimes()
        r.register(self.times)
        for phase in Phase:
            self.jobs.labels(phase.value).set(0)
        self._server: Any = None

    def phase(self, key: str, phase: str | None) -> None:
        """Record job ``key``'s phase (None: the job is gone)."""
        if phase is None:
            self._phases.pop(key, None)
        else:
            self._phases[key] = phase
        for name in Phase:
            self.jobs.labels(name.value).set(sum(1 for p in self._phases.values() if p == name))

    def job_time(self, namespace: str, job: str, phase: Phase | None, books: JobTime | None,
                 restarts: int = 0) -> None:
        """Record the job's phase, ``status.time`` and restarts as a pass left them
        (None: the job is gone)."""
        if phase is None or books is None:
            self.times.jobs.pop((namespace, job), None)
        else:
            self.times.jobs[namespace, job] = (phase, books, restarts)

    def count_requests(self, api: Any) -> None:
        """Count every request the kubernetes client ``api`` sends, by HTTP verb and
        status code (0: no answer), in ``alpajob_operator_api_requests_total``."""
        from kubernetes.client.exceptions import ApiException

        send = api.rest_client.request

        def request(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
            try:
                response = send(method, url, *args, **kwargs)
            except ApiException as error:
                self.api_requests.labels(method, str(error.status or 0)).inc()
                raise
            except Exception:  # no answer: refused, timed out, reset
                self.api_requests.labels(method, "0").inc()
                raise
            self.api_requests.labels(method, str(response.status)).inc()
            return response

        api.rest_client.request = request

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` on ``address:port``; a port that cannot be had is an
        :class:`~alpajob.api.errors.AlpaJobError` naming ``--metrics-port``."""
        try:
            self._server, _ = start_http_server(port, addr=address, registry=self.registry)
        except OSError as error:
            raise AlpaJobError(f"--metrics-port: cannot serve on {address}:{port} ({error.strerror}); "
                               "choose a free port or another --metrics-bind-address") from None

    def close(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server = None
