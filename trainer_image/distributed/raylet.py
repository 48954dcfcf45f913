"""Starting a pod's Ray processes in a real cluster: wait for the head, retry a raylet.

Seen on a real node: a job's head and mesh pods start at once; the mesh pods' raylets
try to register before the head's GCS listens, and five raylets starting together on
two busy cores miss Ray's fixed 30 s registration deadline ("node timed out during
startup"), failing attempt after attempt. So:

- :func:`wait_for_head` (a mesh pod's init container, ``alpajob wait-for-head``)
  returns once the head's GCS port accepts a connection, so no raylet starts before
  its head: ``kubectl get pods`` shows ``Init:0/1`` meanwhile;
- :func:`run_raylet` runs ``ray start --block`` in the foreground and, when it fails
  within :data:`STARTUP_WINDOW` seconds of a try (a registration that timed out),
  tries again after a growing, jittered pause (1, 2, 4, ... s), up to ``tries``
  times, so the raylets of one job spread out instead of colliding again. A raylet
  that fails later (its head gone), or any exit after SIGTERM, is final: the pod
  ends with its exit code. When the driver releases the host at the end of a job (a
  file appears), the raylet is stopped and the pod exits 0: a finished job's mesh pods
  end Succeeded, with their logs.

**A stop that saves.** Kueue preempts, and the operator suspends, by deleting every
pod of the attempt at once; each pod's main process gets SIGTERM at about the same
moment. The head's driver then finishes the step it is in and saves a checkpoint of
it, which needs every mesh host's actor (each holds its shards). A raylet stopped at
once would take its actor down with it, and the step (and its checkpoint) with it: the
next attempt would go back to the last interval checkpoint. So with a ``hold`` file,
:func:`run_raylet` does not pass a SIGTERM on at once: it waits up to
:data:`HOLD_WINDOW` seconds for the driver's word (the driver got SIGTERM too, and
its actor on this host wrote the file: ``MeshHost.hold``). Without it (this pod alone
was deleted: the driver replaces it) Ray stops after the window, the actor having
trained on meanwhile. With it, Ray stays up until the driver releases the host, the
head stops answering (its driver is done) or :data:`HOLD_LIMIT` seconds pass, well
within Kubernetes' default 30 s grace period. A second signal, or a head already gone,
stops Ray at once.
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from alpajob.api.errors import TransientError

#: A ``ray start`` that fails sooner than this after it began failed to start.
STARTUP_WINDOW = 120.0


class HeadUnreachable(TransientError):
    """The head's GCS did not accept a connection in time (exit 3: a restart may help)."""


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def wait_for_head(address: str, timeout: float, say: Callable[[str], None],
                  poll: float = 1.0, clock: Callable[[], float] = time.monotonic) -> float:
    """Wait until ``host:port`` accepts a TCP connection; the seconds waited. Raises
    :class:`HeadUnreachable` after ``timeout`` seconds."""
    host, port = _split(address)
    began = clock()
    said = False
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(poll * 2, 5.0)):
                return clock() - began
        except OSError as error:
            waited = clock() - began
            if waited >= timeout:
                raise HeadUnreachable(f"the Ray head at {address} did not answer within {timeout:.0f} s "
                                      f"({error}); is the head pod running?") from None
            if not said:
                say(f"waiting for the Ray head at {address} ({error})")
                said = True
        time.sleep(poll)


#: Seconds a mesh worker keeps Ray up after SIGTERM while it waits for the driver's
#: word that it stops too and saves (module docstring).
HOLD_WINDOW = 5.0
#: The most seconds a held worker keeps Ray up after its SIGTERM.
HOLD_LIMIT = 20.0


class _Stop:
    """What :func:`run_raylet` was asked by a signal, and when (module docstring)."""

    def __init__(self, hold: Path | None, head: str | None, window: float, limit: float) -> None:
        self.hold, self.head, self.window, self.limit = hold, head, window, limit
        self.signum: int | None = None
        self.since = 0.0
        self.forwarded = False
        self.said = False

    def asked(self, signum: int, child: subprocess.Popen | None) -> None:
        """The signal handler: pass a signal on at once unless this worker may be held
        (the first signal, with a hold file to wait for)."""
        first = self.signum is None
        self.signum, self.since = signum, (time.monotonic() if first else self.since)
        if child is not None and (self.hold is None or not first):
            self.forward(child)

    def forward(self, child: subprocess.Popen) -> None:
        if not self.forwarded and self.signum is not None:
            self.forwarded = True
            child.send_signal(self.signum)

    def due(self, say: Callable[[str], None]) -> bool:
        """Whether a signal waiting for the driver's word should reach Ray now; says why."""
        if self.signum is None or self.forwarded:
            return False
        name = signal.Signals(self.signum).name
        waited = time.monotonic() - self.since
        held = self.hold is not None and self.hold.exists()
        if held and not self.said:
            self.said = True
            say(f"{name} {waited:.1f} s ago: the driver is saving the step it is at; Ray stays up for it "
                f"(at most {self.limit:.0f} s)")
        if self.said and not held:
            say(f"{name} {waited:.1f} s ago: the driver has saved; stopping Ray")
        elif self.head is not None and not _answers(self.head):
            say(f"{name} {waited:.1f} s ago: the Ray head at {self.head} is gone; stopping Ray")
        elif held and waited >= self.limit:
            say(f"{name}: the driver did not finish saving within {self.limit:.0f} s; stopping Ray")
        elif not held and waited >= self.window:
            say(f"{name}: no word from a driver within {self.window:.0f} s (none saves with this host); "
                "stopping Ray")
        else:
            return False
        return True


def _answers(address: str) -> bool:
    try:
        with socket.create_connection(_split(address), timeout=1.0):
            return True
    except OSError:
        return False


def _wait(child: subprocess.Popen, released: Path | None, stop: _Stop, poll: float,
          say: Callable[[str], None]) -> int:
    """``child``'s exit code; once ``released`` appears, SIGTERM to it first (``ray
    start --block`` then stops this node's Ray processes), SIGKILL after 10 s. A
    signal held for the driver (:class:`_Stop`) is passed on once due."""
    if released is None and stop.hold is None:
        return child.wait()
    while True:
        try:
            return child.wait(poll)
        except subprocess.TimeoutExpired:
            if released is not None and released.exists():
                break
            if stop.due(say):
                stop.forward(child)
    say("released by the driver: the job is done; stopping Ray")
    child.send_signal(signal.SIGTERM)
    try:
        return child.wait(10)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()


def run_raylet(command: Sequence[str], env: dict[str, str], say: Callable[[str], None], tries: int = 5,
               window: float = STARTUP_WINDOW, pause: Callable[[int], float] | None = None,
               released: Path | None = None, poll: float = 0.5, hold: Path | None = None,
               head: str | None = None, hold_window: float = HOLD_WINDOW,
               hold_limit: float = HOLD_LIMIT) -> int:
    """Run ``command`` (``ray start ... --block``) in the foreground with retries (module
    docstring), passing SIGTERM and SIGINT on; its last exit code. Once the file
    ``released`` appears (the driver is done with this host, ``MeshHost.release``), Ray
    is stopped and the exit code is 0, however Ray's processes ended. With ``hold``
    (the file ``MeshHost.hold`` writes) and ``head`` (the Ray head's address), a
    signal waits for the driver's word first (module docstring)."""
    stop = _Stop(hold, head, hold_window, hold_limit)
    child: subprocess.Popen | None = None

    def forward(signum: int, _frame: object) -> None:
        stop.asked(signum, child)

    wait = pause or (lambda attempt: 2.0 ** attempt * (1.0 + random.random()))
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for attempt in range(tries):
            began = time.monotonic()
            child = subprocess.Popen(list(command), env=env)
            if stop.signum is not None:
                stop.forward(child)  # asked to stop between two tries
            code = _wait(child, released, stop, poll, say)
            if released is not None and released.exists():
                return 0
            lasted = time.monotonic() - began
            stopped = stop.signum is not None
            if code == 0 or stopped or lasted >= window or attempt == tries - 1:
                return code
            delay = wait(attempt)
            say(f"ray start exited {code} after {lasted:.0f} s (try {attempt + 1} of {tries}); "
                f"trying again in {delay:.1f} s")
            time.sleep(delay)
            if stop.signum is not None:
                return code
        return 1  # not reached: the last try returns
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
