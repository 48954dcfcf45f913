"""A polite stop: SIGTERM (how Kubernetes stops a pod) or Ctrl-C, between two steps.

Kubernetes sends SIGTERM and waits ``terminationGracePeriodSeconds`` (30 s by default)
before SIGKILL. Dying at once would lose every step since the last checkpoint, so
inside a :class:`StopRequest` block the signal only raises a flag; the training loop
reads it after each step, saves a checkpoint, waits for it, and exits with status 143
(128 + SIGTERM; 130, 128 + SIGINT, for Ctrl-C), which a pod's restart policy and the operator read as "stopped,
resume me". A second Ctrl-C gives up at once (``KeyboardInterrupt``).

Signal handlers belong to the main thread: elsewhere (a test's thread, a notebook's
worker) the block installs nothing and ``requested`` stays None.

Outside the training loop there is nothing to save, and a stop must not wait for a
plan or a compile to finish: there, under :class:`SignalsRaise` (the CLI's whole
command), SIGTERM raises :class:`Interrupted` in the main thread as Ctrl-C raises
``KeyboardInterrupt``. Both unwind the stack, so every ``with`` on the way closes what
it opened (the planner's worker pool is terminated and joined, a child process is
stopped) and the command ends with one line, :meth:`Interrupted.line`, saying what was
interrupted, and exit status 143 (130 for Ctrl-C). The default SIGTERM action would
kill the process where it stands: its pool workers then die writing to a closed pipe
(a traceback each) and its semaphores leak.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from alpajob.api.errors import TimeLimitError


def exit_code(signal_name: str) -> int:
    """128 + the signal's number, as a shell reports a process the signal stopped:
    143 for ``SIGTERM``, 130 for ``SIGINT`` (Ctrl-C)."""
    return 128 + signal.Signals[signal_name].value


class StopRequest:
    """``requested`` names the signal once one arrived (module docstring);
    ``on_request`` is called with its name when the first arrives (in the signal
    handler: it should only start something, a thread, and return)."""

    def __init__(self, on_request: Callable[[str], None] | None = None) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}
        self._on_request = on_request

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.requested is not None:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        first = self.requested is None
        self.requested = signal.Signals(signum).name
        if first and self._on_request is not None:
            self._on_request(self.requested)

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


class Interrupted(BaseException):
    """A stop signal outside the training loop (module docstring): ``signal_name``
    (``SIGTERM``, ``SIGINT``), and ``during``, what the command was doing."""

    def __init__(self, signal_name: str, during: str = "") -> None:
        super().__init__(signal_name, during)
        self.signal_name, self.during = signal_name, during

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process it stopped."""
        return exit_code(self.signal_name)

    def line(self) -> str:
        """The one line the command ends with."""
        where = f" while {self.during}" if self.during else ""
        return f"stopped by {self.signal_name}{where}: nothing was saved"


class SignalsRaise:
    """A block in which SIGTERM raises :class:`Interrupted` in the main thread (Ctrl-C
    raises ``KeyboardInterrupt`` anyway); elsewhere it installs nothing."""

    def __init__(self) -> None:
        self._previous: Any = None

    @staticmethod
    def _raise(signum: int, _frame: FrameType | None) -> None:
        raise Interrupted(signal.Signals(signum).name)

    def __enter__(self) -> SignalsRaise:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._raise)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


#: How soon a deadline that fell inside an import is tried again.
IMPORT_RETRY_SECONDS = 0.05


class Deadline:
    """A block that stops with :class:`~alpajob.api.errors.TimeLimitError` once
    ``seconds`` have passed (an interval timer's SIGALRM raises it in the main thread,
    which unwinds the block as SIGTERM does: the planner's pool is closed on the way).
    ``doing()`` says what was running then. Outside the main thread, or with ``seconds``
    None, it sets no timer.

    It never stops an import half-way: a module left half-executed stays broken for
    the rest of the process (JAX's lazily imported MLIR dialects then refuse to
    register again), which matters where the process lives on, as with the Python
    API. A deadline that falls inside an import (a frame of ``importlib._bootstrap``
    on the stack) is tried again :data:`IMPORT_RETRY_SECONDS` later."""

    def __init__(self, seconds: float | None, flag: str, doing: Callable[[], str]) -> None:
        self.seconds, self.flag, self.doing = seconds, flag, doing
        self._previous: Any = None

    def _raise(self, _signum: int, frame: FrameType | None) -> None:
        while frame is not None:
            if frame.f_code.co_filename.startswith("<frozen importlib."):
                signal.setitimer(signal.ITIMER_REAL, IMPORT_RETRY_SECONDS)
                return
            frame = frame.f_back
        raise TimeLimitError(f"planning did not end within {self.flag} {self.seconds:g} s (last progress: "
                             f"{self.doing()}); plan a smaller model or pool, or raise {self.flag}")

    def __enter__(self) -> Deadline:
        if self.seconds is not None and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGALRM, self._raise)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._previous is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous)
            self._previous = None


def interrupted(error: BaseException, during: str) -> Interrupted:
    """``error`` (an :class:`Interrupted` or a ``KeyboardInterrupt``) as an
    :class:`Interrupted` that says what the command was ``during``."""
    if isinstance(error, Interrupted):
        return Interrupted(error.signal_name, error.during or during)
    return Interrupted("SIGINT", during)
