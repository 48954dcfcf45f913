"""Liveness that tells the truth, at once: is the operator still in touch with its API server?

kopf's liveness endpoint answers 200 while its event loop runs, even when every watch
and every call fails (seen on a real cluster: ``/healthz`` 200 while kopf logged
``Connect call failed``). And a probe that asks the API server itself answers only
as fast as the API server does: on a real node, once the server was away for its
threshold, ``/healthz`` stopped answering at all (calls to an unreachable server
wait for their timeouts and retries), so the kubelet restarted the operator for
probe timeouts rather than a clear failure. Hence two halves:

- a thread of its own asks the API server for its core resource list every
  ``period`` seconds (``GET /api/v1``: any authenticated client may, it is small, and
  it needs no RBAC of its own), with a short request timeout, and remembers when it
  last succeeded. It never shares a worker pool with the reconciliation, so a slow
  or hung call delays nothing else;
- the probe handler (kopf runs it when the endpoint is asked, at most every 10 s)
  only reads that time: it answers within milliseconds whatever the API server does.
  Silence shorter than :attr:`ApiContact.threshold` still passes (a restarting API
  server, one slow answer); past it the probe raises, kopf answers the endpoint with
  500, and the kubelet restarts the operator after its ``failureThreshold``, which
  re-establishes every watch from scratch.

Each return of the server after a failed check is counted in :attr:`ApiContact.gaps`:
kopf's watches list again when they reconnect, but an index keeps an object that was
deleted while the watch was down (a re-list brings no DELETED event), so after a gap
each job's pass audits its children once (:meth:`~.kube.Kube.vanished`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class LostApiServer(Exception):
    """The API server has not answered for longer than the threshold."""


@dataclass
class ApiContact:
    """When the API server last answered, and how long silence is tolerated.

    ``ask`` is a blocking call to the API server; it raises on failure. :meth:`start`
    runs it every ``period`` seconds in a daemon thread; :meth:`ping` runs it once
    (tests). ``clock`` is injectable for tests.
    """

    ask: Callable[[], object]
    threshold: float = 60.0
    period: float = 5.0
    clock: Callable[[], float] = time.monotonic
    last_ok: float = field(default=0.0)
    last_error: str = ""
    gaps: int = 0  # times the server answered again after failing: the watches had a gap
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)

    def __post_init__(self) -> None:
        self.last_ok = self.clock()  # the operator has just logged in

    def ping(self) -> None:
        """Ask the API server once; remember when it answered, or why not."""
        try:
            self.ask()
        except Exception as error:  # noqa: BLE001 (any failure to reach the API is the same to a probe)
            self.last_error = f"{type(error).__name__}: {error}".strip()[:300]
        else:
            self.last_ok = self.clock()
            if self.last_error:
                self.gaps += 1
            self.last_error = ""

    def start(self) -> ApiContact:
        """Ping every ``period`` seconds from a daemon thread until :meth:`stop`."""

        def watch() -> None:
            while not self._stop.is_set():
                self.ping()
                self._stop.wait(self.period)

        threading.Thread(target=watch, name="api-contact", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def state(self) -> dict[str, float]:
        """The probe's answer, without a call: ``{"apiServerSilentSeconds": s}``; raises
        :class:`LostApiServer` past the threshold."""
        silent = max(0.0, self.clock() - self.last_ok)
        if silent > self.threshold:
            raise LostApiServer(f"no answer from the API server for {silent:.0f} s (threshold "
                                f"{self.threshold:.0f} s): {self.last_error}")
        return {"apiServerSilentSeconds": round(silent, 1)}
