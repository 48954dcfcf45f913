"""A job's Ray cluster as processes of one machine: the head and one worker per mesh host.

Used by the tests and the benchmarks (and handy for trying the Ray runtime): it runs
the same entry points a cluster's pods run, ``alpajob ray-head`` and ``alpajob
mesh-worker``, each worker with its own forced CPU devices, and can kill a worker
with everything below it (a lost node) and start it again (its pod restarted).
Workers start one at a time: raylets started together time out on a small machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ALPAJOB = [sys.executable, "-m", "alpajob"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pids: list[int]) -> set[int]:
    """Every live process below ``pids`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    stack = list(pids)
    while stack:
        pid = stack.pop()
        for child in children.get(pid, []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class LoopbackCluster:
    """A Ray head and mesh workers as processes of this machine."""

    def __init__(self, root: Path, hosts: list[tuple[int, int, int]]) -> None:
        """``hosts``: the mesh hosts to start, as (mesh, host, devices)."""
        self.hosts = list(hosts)
        self.root = root
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        self.env.pop("XLA_FLAGS", None)  # each worker forces its own device count
        self.procs: list[subprocess.Popen] = []
        self.workers: dict[tuple[int, int], subprocess.Popen] = {}
        self.tracked: set[int] = set()
        self.head: subprocess.Popen | None = None

    def _start(self, args: list[str], log: str, ready: str = "block forever", timeout: float = 90) -> subprocess.Popen:
        out = open(self.root / log, "a")  # noqa: SIM115 (closed with the process)
        begin = (self.root / log).stat().st_size
        proc = subprocess.Popen(ALPAJOB + args, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        self.procs.append(proc)
        deadline = time.monotonic() + timeout
        while ready not in (self.root / log).read_text()[begin:]:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{log} did not start:\n{(self.root / log).read_text()[-3000:]}")
            time.sleep(0.5)
        return proc

    def start_worker(self, mesh: int, host: int, devices: int) -> None:
        self.workers[mesh, host] = self._start(
            ["mesh-worker", "--address", self.address, "--mesh", str(mesh), "--host", str(host),
             "--devices", str(devices)], f"mesh{mesh}-host{host}.log")

    def start(self) -> None:
        self.head = self._start(["ray-head", "--port", str(self.port), "--temp-dir", str(self.root / "ray")],
                                "head.log")
        for mesh, host, devices in self.hosts:  # one at a time: raylets started together time out
            self.start_worker(mesh, host, devices)

    def kill_worker(self, mesh: int, host: int) -> None:
        """SIGKILL a mesh worker and everything below it (the node is lost)."""
        proc = self.workers.pop((mesh, host))
        tree = descendants([proc.pid]) | {proc.pid}
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
        self.procs.remove(proc)
        deadline = time.monotonic() + 30
        while any(alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop(self) -> set[int]:
        """Stop every process, the workers first (a worker stopped after its head leaves
        Ray's agents behind; each gets SIGTERM twice, as a second signal stops a worker
        at once instead of after :data:`~.raylet.HOLD_WINDOW` seconds of waiting for a
        driver's word); return those still alive afterwards."""
        self.tracked |= descendants([p.pid for p in self.procs]) | {p.pid for p in self.procs}
        deadline = time.monotonic() + 60
        workers = [proc for proc in self.procs if proc is not self.head]
        for again in (False, True):
            if again:
                time.sleep(0.3)  # the first signal handled: the second is passed on to Ray
            for proc in workers:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
        for proc in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(1, deadline - 30 - time.monotonic()))
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        while time.monotonic() < deadline and any(alive(p) for p in self.tracked):
            time.sleep(0.5)
        self.procs = []
        return {p for p in self.tracked if alive(p)}
