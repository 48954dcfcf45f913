"""A real Prometheus (the Debian package ``prometheus``) scrapes a real ``alpajob run``
as the chart's PodMonitor scrapes a head pod (``honor_labels``, a ``namespace``
label): every dashboard query and every alert expression is evaluated through its
HTTP API; every training panel has data; and the stalled-step alert fires while the
run is paused (SIGSTOP) and clears once it goes on (SIGCONT).

The alert rules are the chart's, rendered; only the stalled-step alert's threshold
and ``for`` are cut from minutes to seconds, so the test pauses the run for seconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from test_chart import NAMESPACE, dashboard, find, grafana_to_promql, render  # noqa: E402

from alpajob.trainer_image.distributed.loopback import free_port  # noqa: E402

#: About 40 s (a run's start and a minute of scrapes): `.ci/run` runs it with the slow ones.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
#: Series only the operator exposes: their panels are empty without one.
OPERATOR_ONLY = re.compile(r"alpajob_operator_|alpajob_job_")
#: The stalled-step alert cut to seconds: older than 6 s, for 2 s.
STALLED_AFTER, STALLED_FOR = 6, "2s"


def _wait(what: str, check: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _rules(directory: Path) -> Path:
    """The chart's alert rules, the stalled-step alert cut to seconds."""
    helm = pytest.importorskip("helm_python")
    rule = find(render(helm, {"prometheusRule": {"enabled": True, "stalledMinutes": 1}}),
                "PrometheusRule", "alpajob-alerts", NAMESPACE)
    groups = rule["spec"]["groups"]
    for r in groups[0]["rules"]:
        if r["alert"] == "AlpaJobStepStalled":
            assert "> 60" in r["expr"]
            r["expr"], r["for"] = r["expr"].replace("> 60", f"> {STALLED_AFTER}"), STALLED_FOR
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return path


class Prometheus:
    """``prometheus`` on loopback, scraping one target every second."""

    def __init__(self, directory: Path, target: str, rules: Path) -> None:
        self.port, self.rules = free_port(), rules
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{
                "job_name": "alpajob-trainer", "honor_labels": True,
                "static_configs": [{"targets": [target], "labels": {"namespace": "ml"}}]}],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(directory / "prometheus.log", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={directory / 'prometheus.yml'}",
             f"--storage.tsdb.path={directory / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        _wait("Prometheus ready", self.ready, 60)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def get(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.get("query", query=expr)["result"]

    def firing(self, name: str) -> list[dict[str, Any]]:
        return [a for a in self.get("alerts")["alerts"] if a["labels"]["alertname"] == name and a["state"] == "firing"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, subprocess.Popen]]:
    """A real ``alpajob run`` of the README's job (its plan on 2 forced devices, kept even
    where one device times faster, so every stage series exists; checkpointing,
    every step timed per stage), scraped by a real Prometheus."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus not installed (Debian package prometheus)")
    directory = Path(str(tmp_path_factory.mktemp("prometheus")))
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    run_log = open(directory / "run.log", "w")  # noqa: SIM115 (closed below)
    run = subprocess.Popen(
        [sys.executable, "-m", "alpajob", "run", "manifests/examples/text-gpt.yaml", "--steps", "100000",
         "--devices", "2", "--keep-plan", "--metrics-port", str(port), "--stage-times-every", "1",
         "--checkpoint-dir", str(directory / "ckpt"), "--checkpoint-every", "10", "--keep-last", "1"],
        cwd=ROOT, env=env, stdout=run_log, stderr=subprocess.STDOUT, start_new_session=True)
    prometheus = Prometheus(directory, f"127.0.0.1:{port}", _rules(directory))
    try:
        yield prometheus, run
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGCONT)
            os.killpg(run.pid, signal.SIGTERM)
            try:
                run.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(run.pid, signal.SIGKILL)
        run_log.close()
        prometheus.stop()


def test_every_training_panel_has_data_and_every_query_is_valid(live: tuple[Prometheus, subprocess.Popen]) -> None:
    prometheus, run = live
    # Training has begun, a checkpoint is complete and the first evaluation (step 50)
    # is done: the slowest panels' series.
    _wait("a checkpoint and an evaluation scraped", lambda: run.poll() is None and prometheus.query(
        'alpajob_checkpoint_step{namespace="ml", job="text-gpt"} > 0') and prometheus.query(
        'alpajob_eval_loss{namespace="ml", job="text-gpt"}'), 300)
    _wait("two scrapes of the stage counters, for rate()", lambda: prometheus.query(
        "count_over_time(alpajob_stage_compute_seconds_total[1m]) >= 2"), 60)
    empty = []
    # The dashboard's rate windows (5 and 30 minutes) cut to one: the run is minutes old.
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            expr = grafana_to_promql(target["expr"]).replace("[5m]", "[1m]").replace("[30m]", "[1m]")
            result = prometheus.query(expr)  # a query Prometheus refuses fails here
            if not OPERATOR_ONLY.search(expr) and not result:
                empty.append(panel["title"])
    assert not empty, f"training panels without data: {empty}"
    for rule in yaml.safe_load(prometheus.rules.read_text())["groups"][0]["rules"]:
        prometheus.query(rule["expr"])  # every alert expression evaluates on live data
    labels = prometheus.query('alpajob_step{job="text-gpt"}')[0]["metric"]
    assert labels["namespace"] == "ml" and labels["job"] == "text-gpt"  # honor_labels kept the job's name


def test_the_stalled_step_alert_fires_while_paused_and_clears_after(live: tuple[Prometheus, subprocess.Popen]) -> None:
    prometheus, run = live
    _wait("training", lambda: prometheus.query('alpajob_step{job="text-gpt"} > 0'), 300)
    assert not prometheus.firing("AlpaJobStepStalled")
    os.killpg(run.pid, signal.SIGSTOP)
    try:
        alerts = _wait("AlpaJobStepStalled firing", lambda: prometheus.firing("AlpaJobStepStalled"), 60)
        assert alerts[0]["labels"]["job"] == "text-gpt" and alerts[0]["labels"]["namespace"] == "ml"
        assert prometheus.query('up{job="alpajob-trainer"} == 0')  # a paused trainer answers no scrape
    finally:
        os.killpg(run.pid, signal.SIGCONT)
    _wait("AlpaJobStepStalled cleared", lambda: not prometheus.firing("AlpaJobStepStalled"), 60)
    assert run.poll() is None
