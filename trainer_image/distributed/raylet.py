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


def _wait(child: subprocess.Popen, released: Path | None, poll: float, say: Callable[[str], None]) -> int:
    """``child``'s exit code; once ``released`` appears, SIGTERM to it first (``ray
    start --block`` then stops this node's Ray processes), SIGKILL after 10 s."""
    if released is None:
        return child.wait()
    while True:
        try:
            return child.wait(poll)
        except subprocess.TimeoutExpired:
            if released.exists():
                break
    say("released by the driver: the job is done; stopping Ray")
    child.send_signal(signal.SIGTERM)
    try:
        return child.wait(10)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()


def run_raylet(command: Sequence[str], env: dict[str, str], say: Callable[[str], None], tries: int = 5,
               window: float = STARTUP_WINDOW, pause: Callable[[int], float] | None = None,
               released: Path | None = None, poll: float = 0.5) -> int:
    """Run ``command`` (``ray start ... --block``) in the foreground with retries (module
    docstring), passing SIGTERM and SIGINT on; its last exit code. Once the file
    ``released`` appears (the driver is done with this host, ``MeshHost.release``), Ray
    is stopped and the exit code is 0, however Ray's processes ended."""
    stopped = False
    child: subprocess.Popen | None = None

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopped
        stopped = True
        if child is not None:
            child.send_signal(signum)

    wait = pause or (lambda attempt: 2.0 ** attempt * (1.0 + random.random()))
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for attempt in range(tries):
            began = time.monotonic()
            child = subprocess.Popen(list(command), env=env)
            code = _wait(child, released, poll, say)
            if released is not None and released.exists():
                return 0
            lasted = time.monotonic() - began
            if code == 0 or stopped or lasted >= window or attempt == tries - 1:
                return code
            delay = wait(attempt)
            say(f"ray start exited {code} after {lasted:.0f} s (try {attempt + 1} of {tries}); "
                f"trying again in {delay:.1f} s")
            time.sleep(delay)
            if stopped:
                return code
        return 1  # not reached: the last try returns
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
