"""Liveness that tells the truth: is the operator still in touch with its API server?

kopf's liveness endpoint answers 200 while its event loop runs, even when every watch
and every call fails (seen on a real cluster: ``/healthz`` 200 while kopf logged
``Connect call failed``). A probe handler (kopf runs them when the endpoint is asked,
at most every 10 s) makes the answer depend on the API server:

- each probe asks the API server for its core resource list (``GET /api/v1``: any
  authenticated client may, it is small, and it needs no RBAC of its own) with a
  short timeout, and remembers when it last succeeded;
- a probe failing for less than :attr:`ApiContact.threshold` seconds still passes (a
  restarting API server, one slow answer); past it the probe raises, kopf answers
  the endpoint with 500, and the kubelet restarts the operator after its
  ``failureThreshold``, which re-establishes every watch from scratch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class LostApiServer(Exception):
    """The API server has not answered for longer than the threshold."""


@dataclass
class ApiContact:
    """When the API server last answered, and how long silence is tolerated.

    ``ask`` is a blocking call to the API server (run in a worker thread); it raises
    on failure. ``clock`` is injectable for tests.
    """

    ask: Callable[[], object]
    threshold: float = 60.0
    timeout: float = 5.0
    clock: Callable[[], float] = time.monotonic
    last_ok: float = field(default=0.0)
    last_error: str = ""

    def __post_init__(self) -> None:
        self.last_ok = self.clock()  # the operator has just logged in

    async def check(self) -> dict[str, float]:
        """One probe: ``{"apiServerSilentSeconds": s}``; raises :class:`LostApiServer`
        past the threshold."""
        try:
            await asyncio.wait_for(asyncio.to_thread(self.ask), self.timeout)
        except Exception as error:  # noqa: BLE001 (any failure to reach the API is the same to a probe)
            self.last_error = f"{type(error).__name__}: {error}".strip()[:300]
        else:
            self.last_ok = self.clock()
            self.last_error = ""
        silent = self.clock() - self.last_ok
        if silent > self.threshold:
            raise LostApiServer(f"no answer from the API server for {silent:.0f} s (threshold "
                                f"{self.threshold:.0f} s): {self.last_error}")
        return {"apiServerSilentSeconds": round(silent, 1)}
