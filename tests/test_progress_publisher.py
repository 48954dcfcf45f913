"""The driver's progress survives an API server outage: writes go through a thread of
their own, training never waits for them, the newest report is written once the server
is back, and a refusal retrying cannot fix is said once.

The API server is the test's (KMock) behind a gate that is closed for the outage: a
closed port refuses connections, as a restarting kube-apiserver's did on the real node
(urllib3's MaxRetryError, Connection refused)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kmock")

from kubernetes import client  # noqa: E402
from outage import Gate  # noqa: E402

from alpajob.api.names import PROGRESS_KEY  # noqa: E402
from alpajob.api.progress import Progress, TrainerPhase  # noqa: E402
from alpajob.trainer_image.publish import ProgressPublisher  # noqa: E402


@pytest.fixture
def api_behind_gate(tmp_path: Path) -> Iterator[tuple[Any, Gate, client.CoreV1Api]]:
    from kube_emulator import Emulator

    emu = Emulator(tmp_path).start()
    try:
        emu.create_namespace("ml", restricted=False)
        direct = client.CoreV1Api(emu.api())
        direct.create_namespaced_config_map("ml", {"metadata": {"name": "j-progress"}, "data": {}})
        gate = Gate(int(emu.url.rsplit(":", 1)[1]))
        gated = emu.api()
        gated.configuration.host = f"http://127.0.0.1:{gate.port}"
        yield gated, gate, direct
        gate.down()
    finally:
        emu.stop()


def _until(what: str, check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _step(direct: client.CoreV1Api) -> int | None:
    data = direct.read_namespaced_config_map("j-progress", "ml").data or {}
    return json.loads(data[PROGRESS_KEY])["step"] if PROGRESS_KEY in data else None


def test_an_outage_delays_progress_and_never_training(api_behind_gate: tuple[Any, Gate, client.CoreV1Api]) -> None:
    api, gate, direct = api_behind_gate
    said: list[str] = []
    publisher = ProgressPublisher("ml/j-progress", said.append, api=api, timeout=2.0, backoff=0.1, longest=0.4)
    publisher.publish(Progress(phase=TrainerPhase.RUNNING, step=1))
    _until("step 1 written", lambda: _step(direct) == 1)

    gate.down()  # the API server restarts
    slowest = 0.0
    for step in range(2, 41):
        began = time.monotonic()
        publisher.publish(Progress(phase=TrainerPhase.RUNNING, step=step))
        slowest = max(slowest, time.monotonic() - began)
        time.sleep(0.03)
    assert slowest < 0.05  # training never waited for the API server
    _until("a failed write", lambda: publisher.failures >= 2)
    assert _step(direct) == 1
    assert sum("the API server is unreachable" in s for s in said) == 1, said  # said once per outage

    gate.up()  # back: the newest report is written, none of the ones in between
    _until("step 40 written", lambda: _step(direct) == 40)
    # said right after the write returns, in the publisher's thread: a moment after the
    # server has stored it
    _until("the return said", lambda: any(s.startswith("the API server is back after") for s in said))
    publisher.publish(Progress(phase=TrainerPhase.SUCCEEDED, step=40))
    assert publisher.close(flush=5.0)


def test_the_last_report_is_flushed_within_its_bound(api_behind_gate: tuple[Any, Gate, client.CoreV1Api]) -> None:
    api, gate, direct = api_behind_gate
    said: list[str] = []
    publisher = ProgressPublisher("ml/j-progress", said.append, api=api, timeout=1.0, backoff=0.1, longest=0.2)
    gate.down()
    publisher.publish(Progress(phase=TrainerPhase.SUCCEEDED, step=9))
    began = time.monotonic()
    assert publisher.close(flush=1.0) is False  # bounded: the job's end never waits out the outage
    assert time.monotonic() - began < 2.5
    assert "the last progress report was not written" in said[-1]


def test_a_refusal_retrying_cannot_fix_is_said_once(api_behind_gate: tuple[Any, Gate, client.CoreV1Api]) -> None:
    api, _gate, _direct = api_behind_gate
    said: list[str] = []
    publisher = ProgressPublisher("ml/missing", said.append, api=api, backoff=0.05)
    for step in range(5):
        publisher.publish(Progress(phase=TrainerPhase.RUNNING, step=step))
        time.sleep(0.1)
    _until("the refusals", lambda: publisher.failures >= 1)
    assert [s for s in said if "404" in s] == [said[0]] and "cannot write progress to ConfigMap ml/missing" in said[0]
    publisher.close(flush=2.0)


def test_a_malformed_target_fails_at_once() -> None:
    from alpajob.api.errors import AlpaJobError

    with pytest.raises(AlpaJobError, match="NAMESPACE/NAME"):
        ProgressPublisher("no-slash", print)


def test_the_drivers_reporter_goes_on_while_the_api_server_is_away(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's Reporter, as a pod's driver builds it: with its API server away
    (a port nobody listens on), a report returns at once and a final one waits only
    its flush bound; before, the first PATCH raised MaxRetryError and the driver exited."""
    from alpajob.trainer_image.distributed.driver import DriverOptions, DriverResult, Reporter

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "away",
        "clusters": [{"name": "away", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "away", "context": {"cluster": "away", "user": "u"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    said: list[str] = []
    reporter = Reporter(DriverOptions(address="unused", steps=3, status_configmap="ml/j-progress"), 8,
                        say=said.append, flush=0.5)
    result = DriverResult()
    began = time.monotonic()
    for phase in (TrainerPhase.STARTING, TrainerPhase.RUNNING, TrainerPhase.RUNNING):
        reporter(result, phase)
    assert time.monotonic() - began < 0.5
    reporter(result, TrainerPhase.SUCCEEDED)
    assert time.monotonic() - began < 3.0
    assert any("the API server is unreachable" in s for s in said), said


def test_a_final_report_fits_the_termination_message_and_stays_parseable() -> None:
    """A kubelet keeps 4096 bytes of a termination message: a report with a long
    message loses its free text, never its numbers, and parses back."""
    from alpajob.api.progress import Progress, TrainerPhase, progress_from_json
    from alpajob.trainer_image.publish import TERMINATION_LIMIT, final_report_message

    report = Progress(phase=TrainerPhase.SUCCEEDED, step=400, steps=400, loss=2.5, message="x" * 4096,
                      data="d" * 1024, updated=1.0)
    text = final_report_message(report)
    assert len(text.encode()) <= TERMINATION_LIMIT - 96
    back = progress_from_json(text)
    assert (back.step, back.loss, back.message) == (400, 2.5, None)
    short = report.model_copy(update={"message": "done", "data": None})
    assert progress_from_json(final_report_message(short)) == short


def test_the_plan_waits_for_an_api_server_that_is_away(api_behind_gate: tuple[Any, Gate, client.CoreV1Api]) -> None:
    """The planning pod's one write waits out an outage (the plan took minutes to make)
    and lands once the server is back; a refusal still fails at once, naming the fix;
    past its patience it fails as transient (the pod is retried)."""
    import threading

    from alpajob.api.errors import AlpaJobError, TransientError
    from alpajob.api.names import PLAN_KEY
    from alpajob.trainer_image.publish import write_plan_configmap

    api, gate, direct = api_behind_gate
    direct.create_namespaced_config_map("ml", {"metadata": {"name": "j-plan"}, "data": {}})
    said: list[str] = []
    gate.down()
    threading.Timer(2.5, gate.up).start()
    began = time.monotonic()
    write_plan_configmap('{"plan": 1}', "ml/j-plan", api=api, say=said.append)
    assert 2.0 < time.monotonic() - began < 10
    assert (direct.read_namespaced_config_map("j-plan", "ml").data or {})[PLAN_KEY] == '{"plan": 1}'
    assert len(said) == 1 and "the API server is unreachable" in said[0], said
    with pytest.raises(AlpaJobError, match=r"cannot write ConfigMap ml/nope \(404 .*needs get and patch"):
        write_plan_configmap("{}", "ml/nope", api=api, say=said.append)
    gate.down()
    with pytest.raises(TransientError, match=r"did not take the plan for \d+ s \(MaxRetryError"):
        write_plan_configmap("{}", "ml/j-plan", api=api, patience=2.0, say=said.append)
