"""The chart's PrometheusRule, unit-tested with promtool (Prometheus's own rule
evaluator): every alert fires on the series that should wake someone, and stays
quiet on the ones that should not.

The rules are the chart's own, rendered with the values a user sets; promtool takes
them from the rendered PrometheusRule. Series are what the trainer's PodMonitor and
the operator's ServiceMonitor scrape (honoured ``namespace`` and ``job`` labels, the
target's ``instance``), one sample a minute.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from test_chart import FULL_VALUES, NAMESPACE, exposed_metric_names, find, render  # noqa: E402

TRAINER = {"namespace": "ml", "job": "gpt", "instance": "10.0.0.5:9090"}


def _labels(labels: dict[str, str]) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


@pytest.fixture(scope="module")
def rules(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chart's alert rules (values: stalled after 10 minutes, 3 restarts an hour,
    idle above half), as a Prometheus rule file."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    helm = pytest.importorskip("helm_python")
    rule = find(render(helm, {"prometheusRule": {"enabled": True}, "serviceMonitor": {"enabled": True}}),
                "PrometheusRule", "alpajob-alerts", NAMESPACE)
    path = tmp_path_factory.mktemp("rules") / "alpajob-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return path


def promtool_test(rules: Path, series: dict[str, str], checks: list[dict[str, Any]]) -> None:
    """Run ``promtool test rules`` on ``series`` (name{labels} -> values) with the
    alert checks ``checks``; a failed expectation fails with promtool's report."""
    test = {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "alert_rule_test": checks}]}
    path = rules.parent / "test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    done = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_step_that_stops_fires_and_a_finished_job_does_not(rules: Path) -> None:
    """gpt's last step ended at minute 4 and its pod is still a target (up); done's
    last step also ended at 4, but its pod is gone (its up series ends with it).
    Stalled once 10 minutes have passed (after minute 14) for 1 minute: firing at 16,
    not yet at 14; done never."""
    done = {"namespace": "ml", "job": "done", "instance": "10.0.0.6:9090"}
    series = {
        f"alpajob_last_step_timestamp_seconds{_labels(TRAINER)}": "0 60 120 180 240x25",
        f'up{_labels({"instance": TRAINER["instance"], "job": "ml/alpajob-trainer"})}': "1x30",
        f"alpajob_last_step_timestamp_seconds{_labels(done)}": "0 60 120 180 240",
        f'up{_labels({"instance": done["instance"], "job": "ml/alpajob-trainer"})}': "1x4",
    }
    promtool_test(rules, series, [
        {"eval_time": "14m", "alertname": "AlpaJobStepStalled", "exp_alerts": []},
        {"eval_time": "16m", "alertname": "AlpaJobStepStalled", "exp_alerts": [{
            "exp_labels": {**TRAINER, "severity": "warning"},
            "exp_annotations": {
                "summary": "AlpaJob ml/gpt: no step for 10 minutes",
                "description": "The trainer last finished a step 12m 0s ago. Look at the head pod's log "
                               "and the job's events (kubectl describe aj gpt)."}}]},
    ])


def test_a_nan_or_infinite_loss_fires_at_once(rules: Path) -> None:
    nan = {**TRAINER, "job": "nan"}
    inf = {**TRAINER, "job": "inf"}
    series = {f"alpajob_loss{_labels(TRAINER)}": "3.2 3.1 3.0 2.9",
              f"alpajob_loss{_labels(nan)}": "3.2 3.1 NaN NaN",
              f"alpajob_loss{_labels(inf)}": "3.2 3.1 +Inf +Inf"}
    expected = [{"exp_labels": {**labels, "severity": "critical"},
                 "exp_annotations": {"summary": f"AlpaJob ml/{labels['job']}: the loss is {value}",
                                     "description": "Training diverged: lower the learning rate or use "
                                                    "float32/bfloat16 (spec.training), then resume from the "
                                                    "last finite checkpoint."}}
                for labels, value in ((inf, "+Inf"), (nan, "NaN"))]
    promtool_test(rules, series, [
        {"eval_time": "1m", "alertname": "AlpaJobLossNotFinite", "exp_alerts": []},
        {"eval_time": "3m", "alertname": "AlpaJobLossNotFinite", "exp_alerts": expected},
    ])


def test_three_restarts_in_an_hour_fire_and_two_do_not(rules: Path) -> None:
    looping = {"namespace": "ml", "job": "gpt"}
    unlucky = {"namespace": "ml", "job": "bert"}
    series = {f"alpajob_job_restarts{_labels(looping)}": "0 0 1 1 2 2 3 3 3 3",
              f"alpajob_job_restarts{_labels(unlucky)}": "0 0 1 1 2 2 2 2 2 2"}
    promtool_test(rules, series, [
        {"eval_time": "5m", "alertname": "AlpaJobRestartLoop", "exp_alerts": []},
        {"eval_time": "7m", "alertname": "AlpaJobRestartLoop", "exp_alerts": [{
            "exp_labels": {**looping, "severity": "warning"},
            "exp_annotations": {"summary": "AlpaJob ml/gpt: 3 restarts in an hour",
                                "description": "The job keeps restarting: its events say why each pod failed "
                                               "(kubectl describe aj gpt)."}}]},
    ])


def test_a_stage_idle_most_of_the_time_for_15_minutes_fires(rules: Path) -> None:
    """Stage 0 idles 40 s of every 60 (67%), stage 1 idles 20 (33%, under the 50%
    threshold): stage 0 fires once 15 minutes have passed, not before."""
    series = {}
    for stage, (compute, idle, comm) in {"0": (15, 40, 5), "1": (35, 20, 5)}.items():
        labels = _labels({"namespace": "ml", "job": "gpt", "stage": stage})
        for part, step in (("compute", compute), ("idle", idle), ("communication", comm)):
            series[f"alpajob_stage_{part}_seconds_total{labels}"] = f"0+{step}x40"
    expected = [{"exp_labels": {"namespace": "ml", "job": "gpt", "stage": "0", "severity": "info"},
                 "exp_annotations": {
                     "summary": "AlpaJob ml/gpt: stage 0 idle 66.67% of its time",
                     "description": "The pipeline's bubble is far above the plan's "
                                    "(alpajob_stage_predicted_idle_share): the plan is off for this cluster. "
                                    "Calibrate (alpajob calibrate) and re-plan with the constants: "
                                    "spec.planner.calibration on Kubernetes, alpajob plan --calibration on a "
                                    "machine; or check for a slow node."}}]
    promtool_test(rules, series, [
        {"eval_time": "15m", "alertname": "AlpaJobStageIdle", "exp_alerts": []},
        {"eval_time": "25m", "alertname": "AlpaJobStageIdle", "exp_alerts": expected},
    ])


def test_the_operator_down_for_5_minutes_fires(rules: Path) -> None:
    """The operator's target answers for 5 minutes, then fails: firing 5 minutes
    after (a restart of a minute or two does not page)."""
    target = {"job": "alpajob-operator-metrics", "namespace": "alpajob-system",
              "instance": "10.0.0.2:8080"}
    series = {f"up{_labels(target)}": "1x5 0x20"}
    expected = [{"exp_labels": {"severity": "critical"},
                 "exp_annotations": {"summary": "The AlpaJob operator is down",
                                     "description": "No AlpaJob is reconciled: jobs neither start, restart "
                                                    "nor finish. Look at the operator's Deployment."}}]
    promtool_test(rules, series, [
        {"eval_time": "5m", "alertname": "AlpaJobOperatorDown", "exp_alerts": []},
        {"eval_time": "9m", "alertname": "AlpaJobOperatorDown", "exp_alerts": []},
        {"eval_time": "12m", "alertname": "AlpaJobOperatorDown", "exp_alerts": expected},
    ])


def test_without_the_service_monitor_there_is_no_operator_down_alert() -> None:
    """Without the chart's ServiceMonitor nothing scrapes the operator, so an alert on
    its target would fire for ever: the rule is left out."""
    helm = pytest.importorskip("helm_python")
    rule = find(render(helm, {"prometheusRule": {"enabled": True}}), "PrometheusRule", "alpajob-alerts", NAMESPACE)
    names = [r["alert"] for r in rule["spec"]["groups"][0]["rules"]]
    assert "AlpaJobOperatorDown" not in names and "AlpaJobStepStalled" in names


def test_the_values_reach_the_rules_and_every_metric_exists() -> None:
    """The thresholds come from the values; the rules read only series that the
    trainer and the operator expose (or Prometheus's own ``up``)."""
    helm = pytest.importorskip("helm_python")
    rule = find(render(helm, dict(FULL_VALUES)), "PrometheusRule", "alpajob-alerts", NAMESPACE)
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    exprs = {r["alert"]: r["expr"] for r in rule["spec"]["groups"][0]["rules"]}
    assert "> 1200" in exprs["AlpaJobStepStalled"] and ">= 5" in exprs["AlpaJobRestartLoop"]
    assert "> 0.6" in exprs["AlpaJobStageIdle"]
    used = {name for expr in exprs.values() for name in re.findall(r"\balpajob_[a-z_]+\b", expr)}
    assert used and used <= exposed_metric_names(), sorted(used - exposed_metric_names())
