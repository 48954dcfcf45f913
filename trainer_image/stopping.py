"""A polite stop: SIGTERM (how Kubernetes stops a pod) or Ctrl-C, between two steps.

Kubernetes sends SIGTERM and waits ``terminationGracePeriodSeconds`` (30 s by default)
before SIGKILL. Dying at once would lose every step since the last checkpoint, so
inside a :class:`StopRequest` block the signal only raises a flag; the training loop
reads it after each step, saves a checkpoint, waits for it, and exits with status 143
(128 + SIGTERM), which a pod's restart policy and the operator read as "stopped,
resume me". A second Ctrl-C gives up at once (``KeyboardInterrupt``).

Signal handlers belong to the main thread: elsewhere (a test's thread, a notebook's
worker) the block installs nothing and ``requested`` stays None.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

#: The exit status of a run stopped by a signal (128 + SIGTERM), as a shell reports it.
STOPPED_EXIT_CODE = 128 + signal.SIGTERM


class StopRequest:
    """``requested`` names the signal once one arrived (module docstring)."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.requested is not None:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self.requested = signal.Signals(signum).name

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
