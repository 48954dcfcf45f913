"""A pod's Ray processes in a real cluster: the mesh pod waits for its head, and a raylet
that fails to start (five raylets on two busy cores miss Ray's 30 s registration) is
started again, spread out; one that fails later, or after SIGTERM, is not."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from alpajob.cli.main import main
from alpajob.trainer_image.distributed.loopback import free_port
from alpajob.trainer_image.distributed.raylet import HeadUnreachable, run_raylet, wait_for_head


def test_the_init_container_waits_until_the_head_listens() -> None:
    port = free_port()
    said: list[str] = []
    server = socket.socket()

    def listen_later() -> None:
        time.sleep(1.5)
        server.bind(("127.0.0.1", port))
        server.listen()

    threading.Thread(target=listen_later, daemon=True).start()
    try:
        waited = wait_for_head(f"127.0.0.1:{port}", 30.0, said.append, poll=0.2)
    finally:
        server.close()
    assert waited >= 1.4 and said == [f"waiting for the Ray head at 127.0.0.1:{port} "
                                      f"([Errno 111] Connection refused)"]


def test_a_head_that_never_answers_is_a_transient_failure(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(HeadUnreachable) as error:
        wait_for_head(f"127.0.0.1:{free_port()}", 0.5, lambda _: None, poll=0.1)
    assert error.value.exit_code == 3 and "is the head pod running?" in str(error.value)
    monkeypatch.setenv("ALPAJOB_RAY_ADDRESS", f"127.0.0.1:{free_port()}")
    assert main(["wait-for-head", "--timeout", "0.5"]) == 3  # the pod's command, from its env
    assert "did not answer within 0 s" in capsys.readouterr().err


def _flaky(tmp_path: Path, fails: int, seconds: float = 0.0) -> list[str]:
    """A command that fails its first ``fails`` runs (after ``seconds``), then succeeds."""
    script = (f"import pathlib, sys, time\np = pathlib.Path({str(tmp_path / 'runs')!r})\n"
              "n = int(p.read_text()) if p.exists() else 0\np.write_text(str(n + 1))\n"
              f"time.sleep({seconds})\nsys.exit(1 if n < {fails} else 0)\n")
    return [sys.executable, "-c", script]


def test_a_raylet_that_fails_to_start_is_started_again(tmp_path: Path) -> None:
    said: list[str] = []
    code = run_raylet(_flaky(tmp_path, 2), dict(os.environ), said.append, tries=5, pause=lambda n: 0.1)
    assert code == 0 and (tmp_path / "runs").read_text() == "3"
    assert said[0].startswith("ray start exited 1 after 0 s (try 1 of 5); trying again in 0.1 s")
    (tmp_path / "x").mkdir()
    code = run_raylet(_flaky(tmp_path / "x", 9), dict(os.environ), said.append, tries=3, pause=lambda n: 0.0)
    assert code == 1 and (tmp_path / "x" / "runs").read_text() == "3"  # gives up after its tries


def test_a_raylet_that_ran_a_while_is_not_restarted(tmp_path: Path) -> None:
    code = run_raylet(_flaky(tmp_path, 5, seconds=0.3), dict(os.environ), lambda _: None, tries=5,
                      window=0.2, pause=lambda n: 0.0)
    assert code == 1 and (tmp_path / "runs").read_text() == "1"  # its head went: the pod fails


def test_sigterm_stops_the_raylet_and_no_retry_follows(tmp_path: Path) -> None:
    """As a pod's main process: SIGTERM reaches ``ray start`` and nothing starts again."""
    runs = tmp_path / "runs"
    code = (f"import pathlib, time\np = pathlib.Path({str(runs)!r})\n"
            "p.write_text(str(int(p.read_text()) + 1 if p.exists() else 1))\ntime.sleep(60)\n")
    worker = ("import os, sys\nfrom alpajob.trainer_image.distributed.raylet import run_raylet\n"
              f"sys.exit(run_raylet([sys.executable, '-c', {code!r}], dict(os.environ), print, "
              "pause=lambda n: 0.0))\n")
    process = subprocess.Popen([sys.executable, "-c", worker])
    deadline = time.monotonic() + 30
    while not runs.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) != 0
    time.sleep(0.5)
    assert runs.read_text() == "1"


def _held_worker(tmp_path: Path, head: str, window: float, limit: float) -> tuple[subprocess.Popen, Path]:
    """``run_raylet`` as a mesh pod's main process, with a hold file and the head's
    address; its "raylet" writes ``ran`` when it starts and ``signalled`` when a signal
    reaches it, then exits 143."""
    child = (f"import pathlib, signal, sys, time\nd = pathlib.Path({str(tmp_path)!r})\n"
             "def on(n, f):\n    (d / 'signalled').write_text(str(time.monotonic()))\n    sys.exit(143)\n"
             "signal.signal(signal.SIGTERM, on)\n(d / 'ran').write_text('1')\ntime.sleep(60)\n")
    worker = ("import os, pathlib, sys\nfrom alpajob.trainer_image.distributed.raylet import run_raylet\n"
              f"sys.exit(run_raylet([sys.executable, '-c', {child!r}], dict(os.environ), print, poll=0.1, "
              f"hold=pathlib.Path({str(tmp_path / 'hold')!r}), head={head!r}, hold_window={window}, "
              f"hold_limit={limit}))\n")
    process = subprocess.Popen([sys.executable, "-c", worker], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "ran").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return process, tmp_path / "signalled"


def test_a_worker_the_driver_holds_keeps_ray_up_after_sigterm_until_the_head_is_gone(tmp_path: Path) -> None:
    """Every pod of the attempt deleted at once (a preemption): the driver, which got
    SIGTERM too, holds the mesh hosts (the file appears) and saves the step it is at.
    The worker keeps Ray up past its own SIGTERM until the head stops answering, then
    passes the signal on; held or not, the pod ends with Ray's exit code."""
    head = socket.socket()
    head.bind(("127.0.0.1", 0))
    head.listen()
    address = f"127.0.0.1:{head.getsockname()[1]}"
    process, signalled = _held_worker(tmp_path, address, window=1.0, limit=30.0)
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    (tmp_path / "hold").write_text("held")  # the driver's word, within the window
    time.sleep(3.0)
    assert not signalled.exists() and process.poll() is None  # held: Ray (and its actor) still up
    head.close()  # the driver is done: the head's GCS stops
    assert process.wait(30) == 143
    waited = float(signalled.read_text()) - sent
    assert 3.0 <= waited < 10.0
    said = process.stdout.read()
    assert re.search(r"SIGTERM 0\.\d s ago: the driver is saving the step it is at; Ray stays up for it "
                     r"\(at most 30 s\)", said), said
    assert re.search(r"SIGTERM [3-9]\.\d s ago: the Ray head at 127\.0\.0\.1:\d+ is gone", said), said


def test_a_worker_deleted_alone_stops_after_the_window_and_a_held_one_after_the_limit(tmp_path: Path) -> None:
    """No word from the driver (this pod alone was deleted; the driver replaces it):
    Ray stops after the window. Held, with the head still up: after the limit. A second
    SIGTERM passes on at once."""
    head = socket.socket()
    head.bind(("127.0.0.1", 0))
    head.listen()
    address = f"127.0.0.1:{head.getsockname()[1]}"
    try:
        for case, hold, window, limit, low, high in (("alone", False, 1.5, 30.0, 1.4, 8.0),
                                                     ("held", True, 0.5, 2.5, 2.4, 9.0)):
            (tmp_path / case).mkdir()
            process, signalled = _held_worker(tmp_path / case, address, window, limit)
            sent = time.monotonic()
            process.send_signal(signal.SIGTERM)
            if hold:
                (tmp_path / case / "hold").write_text("held")
            assert process.wait(30) == 143, case
            assert low <= float(signalled.read_text()) - sent < high, case
        (tmp_path / "twice").mkdir()
        process, signalled = _held_worker(tmp_path / "twice", address, window=30.0, limit=30.0)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 143 and float(signalled.read_text()) - sent < 5.0
    finally:
        head.close()


def test_the_mesh_host_holds_its_worker_through_the_file_it_named(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from alpajob.api.runtime import HOLD_FILE_ENV
    from alpajob.trainer_image.distributed.mesh_host import MeshHost

    host = MeshHost.__new__(MeshHost)  # hold needs none of the actor's state
    monkeypatch.delenv(HOLD_FILE_ENV, raising=False)
    assert host.hold() is False
    monkeypatch.setenv(HOLD_FILE_ENV, str(tmp_path / "hold"))
    assert host.hold() is True and (tmp_path / "hold").exists()


def test_a_released_host_stops_its_raylet_and_exits_0(tmp_path: Path) -> None:
    """The driver releases the host at the end of the job (the file appears): the raylet
    gets SIGTERM, and the pod's exit code is 0 whatever Ray's was (here 143), so the
    finished job's mesh pods are Succeeded with their logs."""
    released = tmp_path / "released"
    said: list[str] = []
    raylet = [sys.executable, "-c", "import time; time.sleep(60)"]
    threading.Timer(0.5, released.write_text, ("done",)).start()
    began = time.monotonic()
    code = run_raylet(raylet, dict(os.environ), said.append, released=released, poll=0.1)
    assert code == 0 and time.monotonic() - began < 10
    assert said == ["released by the driver: the job is done; stopping Ray"]
    # Not released: the raylet's own exit code, as before (its head went: the pod fails).
    code = run_raylet([sys.executable, "-c", "raise SystemExit(1)"], dict(os.environ), lambda _: None,
                      tries=1, released=tmp_path / "never", poll=0.1)
    assert code == 1


def test_the_mesh_host_releases_its_worker_through_the_file_it_named(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from alpajob.api.runtime import RELEASE_FILE_ENV
    from alpajob.trainer_image.distributed.mesh_host import MeshHost

    host = MeshHost.__new__(MeshHost)  # release needs none of the actor's state
    monkeypatch.delenv(RELEASE_FILE_ENV, raising=False)
    assert host.release() is False  # a worker not started by `alpajob mesh-worker`
    monkeypatch.setenv(RELEASE_FILE_ENV, str(tmp_path / "released"))
    assert host.release() is True and (tmp_path / "released").exists()


def test_a_deleted_pod_s_node_stops_at_once_unless_the_user_asks_for_a_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray drains a node for 30 s on SIGTERM (for Serve's replicas); a busy mesh actor
    never finishes draining, so a deleted mesh pod held its restart 30 s. Our nodes
    stop at once; a user's own setting stands."""
    from alpajob.trainer_image.distributed.cluster import ray_env

    monkeypatch.delenv("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", raising=False)
    assert ray_env()["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "0"
    monkeypatch.setenv("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "5")
    assert ray_env(4)["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "5"


def _node(node_id: str, resource: str, port: int, alive: bool = True) -> dict[str, Any]:
    """One entry of ``ray.nodes()``, as Ray 2 writes it."""
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": port,
            "Resources": {resource: 1.0, "CPU": 1.0}}


def test_a_replaced_host_goes_to_the_node_that_joined_not_the_lost_one() -> None:
    """A killed pod's node stays Alive for the GCS until its health checks fail; the
    replacement actor waits for the new pod's node instead of landing on the lost
    one (where it died a few seconds later)."""
    from alpajob.trainer_image.distributed.cluster import host_node

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there any more: the killed raylet's port
    res = "alpajob-mesh-1-host-0"
    polls: list[int] = []

    def nodes() -> list[dict[str, Any]]:
        polls.append(1)
        joined = [_node("new", res, port + 1)] if len(polls) >= 3 else []
        return [_node("old", res, port), _node("gone", res, port, alive=False), *joined]

    assert host_node(res, {"old"}, nodes, timeout=10, poll=0.01) == "new"
    assert len(polls) == 3  # it waited for the new node


def test_a_replaced_host_stays_on_its_node_when_only_its_actor_died() -> None:
    """The mesh's actor died (a hung or killed worker process) but its raylet answers:
    the replacement goes there at once."""
    from alpajob.trainer_image.distributed.cluster import JoinTimeoutError, host_node

    res = "alpajob-mesh-0-host-0"
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert host_node(res, {"old"}, lambda: [_node("old", res, port)], timeout=5, poll=0.01) == "old"
    with pytest.raises(JoinTimeoutError, match="no live Ray node offers alpajob-mesh-0-host-0 within 0.2 s"):
        host_node(res, {"old"}, lambda: [_node("old", res, port)], timeout=0.2, poll=0.01)


def test_the_gcs_gives_a_lost_node_up_in_seconds_unless_the_user_says_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's defaults took 10-14 s to declare a killed pod's node dead; the head's GCS
    runs with checks every second (5 misses), and a user's own setting stands."""
    from alpajob.trainer_image.distributed.cluster import HEALTH_CHECK, ray_env

    for name in HEALTH_CHECK:
        monkeypatch.delenv(name, raising=False)
    env = ray_env()
    assert int(env["RAY_health_check_period_ms"]) * int(env["RAY_health_check_failure_threshold"]) <= 5000
    monkeypatch.setenv("RAY_health_check_failure_threshold", "20")
    assert ray_env()["RAY_health_check_failure_threshold"] == "20"
