"""The operator's own Prometheus metrics, on a registry of its own (no global state)::

    alpajob_operator_jobs{phase="Running"}            jobs by phase (this operator's view)
    alpajob_operator_reconcile_seconds                histogram of one reconciliation pass
    alpajob_operator_planning_seconds                 histogram: job start to plan ready
    alpajob_operator_restarts_total                   whole-job restarts it ordered
    alpajob_operator_reconcile_errors_total           passes that raised
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from alpajob.api.errors import AlpaJobError
from alpajob.api.status import Phase


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
        self._phases: dict[str, str] = {}  # job key -> its phase
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
