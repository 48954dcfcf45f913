"""``kubectl alpajob``: a kubectl plugin (the ``kubectl-alpajob`` command the package
installs; kubectl runs any ``kubectl-<name>`` on the PATH as ``kubectl <name>``) that
shows one AlpaJob the way its operator sees it, through the API server alone::

    kubectl alpajob plan JOB [--svg FILE]   the plan table, from the plan ConfigMap
    kubectl alpajob pods JOB                 the attempts, and every pod with its phase
    kubectl alpajob top JOB                  per-stage step, compute and idle time
    kubectl alpajob logs JOB [-f]            every pod of the attempt, interleaved
    kubectl alpajob suspend|resume JOB       spec.runPolicy.suspend

``top`` reads the head pod's Prometheus metrics through the API server's pod proxy
(``pods/proxy``, as ``kubectl get --raw`` does), so it needs no port-forward and no
network path to the pod; ``logs`` follows each pod's log stream in a thread of its
own and prints every line after its pod's name. ``-n``, ``--context`` and
``--kubeconfig`` mean what they mean to kubectl (kubectl passes them on to a plugin).
The caller needs read access to the job, its ConfigMaps and pods, and for ``top``
``get`` on ``pods/proxy``, for ``logs`` on ``pods/log``.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from alpajob.api.names import (
    GROUP,
    KUEUE_ADMISSION_GATE,
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_ROLE,
    PLAN_KEY,
    PLURAL,
    VERSION,
)
from alpajob.api.runtime import METRICS_PORT
from alpajob.api.status import ConditionStatus, ConditionType, Status

#: The per-stage series of the trainer's metrics (trainer_image/metrics.py) ``top`` shows.
STAGE_SERIES = {"compute": "alpajob_stage_step_compute_seconds", "idle": "alpajob_stage_step_idle_seconds",
                "communication": "alpajob_stage_step_communication_seconds",
                "planned idle": "alpajob_stage_predicted_idle_share"}
#: The job-wide series ``top`` shows above the table.
JOB_SERIES = {"step": "alpajob_step", "loss": "alpajob_loss", "step seconds": "alpajob_step_seconds",
              "predicted step seconds": "alpajob_predicted_step_seconds",
              "tokens/s": "alpajob_tokens_per_second", "MFU": "alpajob_mfu"}


class PluginError(Exception):
    """A one-line answer for the user (exit 1)."""


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="kubectl alpajob", description=(
        "Show an AlpaJob's plan, pods, per-stage utilization and logs; suspend or resume it."))
    top.add_argument("-n", "--namespace", help="the job's namespace (default: the context's)")
    top.add_argument("--context", help="the kubeconfig context to use")
    top.add_argument("--kubeconfig", help="the kubeconfig file (default $KUBECONFIG, else ~/.kube/config)")
    sub = top.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="the plan table, from the job's plan ConfigMap")
    plan.add_argument("--svg", metavar="FILE", help="also draw the plan's predicted pipeline into FILE")
    sub.add_parser("pods", help="the job's attempts and every pod with its phase and node")
    sub.add_parser("top", help="per-stage compute, idle and communication seconds of the last step "
                               "(the head's metrics, through the API server)")
    logs = sub.add_parser("logs", help="the logs of every pod of the current attempt, each line after its pod's name")
    logs.add_argument("-f", "--follow", action="store_true", help="keep following until every pod ends (Ctrl-C stops)")
    logs.add_argument("--tail", type=int, metavar="N", help="only the last N lines of each pod")
    sub.add_parser("suspend", help="stop the job's pods; resume starts a new attempt from the last checkpoint")
    sub.add_parser("resume", help="resume a suspended job")
    for each in sub.choices.values():
        each.add_argument("job", metavar="JOB", help="the AlpaJob's name")
    return top


def _client(args: argparse.Namespace) -> tuple[Any, str]:
    """An API client of the kubeconfig's context, and the namespace to use."""
    from kubernetes import config

    try:
        api = config.new_client_from_config(config_file=args.kubeconfig, context=args.context)
        _, active = config.list_kube_config_contexts(config_file=args.kubeconfig)
    except (config.ConfigException, OSError) as error:
        raise PluginError(f"no usable kubeconfig ({error}); set --kubeconfig or $KUBECONFIG") from None
    if args.context:
        contexts, _ = config.list_kube_config_contexts(config_file=args.kubeconfig)
        active = next((c for c in contexts if c["name"] == args.context), active)
    namespace = args.namespace or (active.get("context") or {}).get("namespace") or "default"
    return api, namespace


class JobView:
    """One AlpaJob and its children, read through the API."""

    def __init__(self, api: Any, namespace: str, name: str) -> None:
        from kubernetes import client

        self.namespace, self.name = namespace, name
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.job = self.call(self.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name,
                              missing=f"AlpaJob {namespace}/{name} not found (kubectl get aj -n {namespace})")
        self.status = Status.model_validate(self.job.get("status") or {})

    def call(self, method: Any, *args: Any, missing: str, **kwargs: Any) -> Any:
        from kubernetes import client
        from urllib3.exceptions import HTTPError

        try:
            return method(*args, **kwargs)
        except client.ApiException as error:
            if error.status == 404:
                raise PluginError(missing) from None
            if error.status == 403:
                raise PluginError(f"forbidden: {_message(error)}") from None
            raise PluginError(f"the API server answered {error.status}: {_message(error)}") from None
        except (HTTPError, OSError) as error:
            raise PluginError(f"cannot reach the API server: {error}") from None

    def pods(self) -> list[Any]:
        listed = self.call(self.core.list_namespaced_pod, self.namespace, label_selector=f"{LABEL_JOB}={self.name}",
                            missing=f"namespace {self.namespace} not found")
        return sorted(listed.items, key=lambda p: p.metadata.name)

    def attempt_pods(self) -> list[str]:
        """The pods of the current attempt, head first (the planner while planning)."""
        children = self.status.children
        names = [n for n in (children.head, *children.mesh_pods) if n]
        return names or [n for n in (children.planner,) if n]


def _message(error: Any) -> str:
    import json

    try:
        return str(json.loads(error.body).get("message") or error.reason)
    except (TypeError, ValueError, AttributeError):
        return str(error.reason)


def show_plan(view: JobView, args: argparse.Namespace, out: Console) -> int:
    from alpajob.api.errors import PlanFormatError
    from alpajob.api.plan import plan_from_json
    from alpajob.cli.tables import plan_summary, plan_table

    summary = view.status.plan
    if summary is None:
        raise PluginError(f"{view.name} has no plan yet (phase {view.status.phase}); the planner's output: "
                          f"kubectl logs -n {view.namespace} {view.status.children.planner or view.name + '-planner'}")
    configmap = view.call(view.core.read_namespaced_config_map, summary.config_map, view.namespace,
                           missing=f"the plan ConfigMap {summary.config_map} is gone")
    text = (configmap.data or {}).get(PLAN_KEY)
    if not text:
        raise PluginError(f"ConfigMap {summary.config_map} holds no {PLAN_KEY} (the job is being planned again?)")
    try:
        plan = plan_from_json(text, f"ConfigMap {summary.config_map}")
    except PlanFormatError as error:
        raise PluginError(str(error)) from None
    out.print(plan_table(plan))
    out.print(plan_summary(plan), highlight=False)
    out.print(f"plan hash {plan.content_hash()}, ConfigMap {view.namespace}/{summary.config_map}", highlight=False)
    if args.svg:
        from alpajob.cli.picture import plan_svg
        from alpajob.planner.plan.timeline import predicted_timeline

        with open(args.svg, "w", encoding="utf-8") as file:
            file.write(plan_svg(plan, predicted_timeline(plan)))
        out.print(f"picture written to {args.svg}", highlight=False)
    return 0


def show_pods(view: JobView, out: Console) -> int:
    status = view.status
    reason = next((c.reason for c in status.conditions
                   if c.type is ConditionType.RECONCILING and c.status is ConditionStatus.TRUE), "")
    out.print(f"{view.namespace}/{view.name}: {status.phase}{f' ({reason})' if reason else ''}, attempt "
              f"{status.children.attempt}, restarts {status.restarts}, disruptions {status.disruptions}",
              highlight=False)
    table = Table("pod", "role", "attempt", "phase", "node", "restarts", "why", box=None, pad_edge=False)
    current = set(view.attempt_pods()) | {status.children.planner or ""}
    for pod in view.pods():
        labels = pod.metadata.labels or {}
        phase = (pod.status.phase if pod.status else None) or "Pending"
        if pod.metadata.deletion_timestamp is not None:
            phase = "Terminating"
        elif any(g.name == KUEUE_ADMISSION_GATE for g in pod.spec.scheduling_gates or []):
            phase = "Queued"  # Kueue's gate: waiting for its ClusterQueue's quota
        waiting = [s.state.waiting.reason for s in (pod.status.container_statuses or []) if s.state and s.state.waiting] \
            if pod.status else []
        unplaced = [c.message or c.reason for c in (pod.status.conditions or []) if c.type == "PodScheduled"
                    and c.status == "False"] if pod.status else []
        restarts = sum(s.restart_count or 0 for s in (pod.status.container_statuses or [])) if pod.status else 0
        name = pod.metadata.name + (" *" if pod.metadata.name in current else "")
        table.add_row(name, labels.get(LABEL_ROLE, ""), labels.get(LABEL_ATTEMPT, ""), phase,
                      pod.spec.node_name or "", str(restarts), "; ".join([*waiting, *unplaced]))
    out.print(table)
    out.print("* the current attempt's pods", highlight=False)
    return 0


def _samples(text: str) -> list[tuple[str, Mapping[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def show_top(view: JobView, out: Console) -> int:
    head = view.status.children.head
    if not head or view.status.phase.value not in ("Running", "Starting", "Succeeded"):
        raise PluginError(f"{view.name} has no running head pod (phase {view.status.phase}): nothing reports metrics")
    pod = view.call(view.core.read_namespaced_pod, head, view.namespace, missing=f"pod {head} is gone")
    ports = [p.container_port for c in pod.spec.containers for p in (c.ports or []) if p.name == "metrics"]
    # unparsed: the client would turn the bytes of a text answer into their repr
    answer = view.call(view.core.connect_get_namespaced_pod_proxy_with_path, f"{head}:{(ports or [METRICS_PORT])[0]}",
                        view.namespace, "metrics", _preload_content=False, missing=f"pod {head} is gone")
    samples = _samples(answer.data.decode(errors="replace"))
    job = {name: value for name, labels, value in samples if name in JOB_SERIES.values()}
    line = ", ".join(f"{label} {_number(job[series])}" for label, series in JOB_SERIES.items() if series in job)
    out.print(f"{view.namespace}/{view.name} (head {head}): {line or 'no step reported yet'}", highlight=False)
    stages: dict[int, dict[str, float]] = {}
    for name, labels, value in samples:
        for column, series in STAGE_SERIES.items():
            if name == series and "stage" in labels:
                stages.setdefault(int(labels["stage"]), {})[column] = value
    if not stages:
        out.print("no per-stage times yet (the first steps are compiling)", highlight=False)
        return 0
    table = Table("stage", "compute s", "idle s", "communication s", "idle share", "planned idle", box=None,
                  pad_edge=False)
    for stage in sorted(stages):
        row = stages[stage]
        total = sum(row.get(k, 0.0) for k in ("compute", "idle", "communication"))
        share = row.get("idle", 0.0) / total if total > 0 else None
        table.add_row(str(stage), *(_number(row.get(k)) for k in ("compute", "idle", "communication")),
                      "-" if share is None else f"{share:.1%}",
                      "-" if "planned idle" not in row else f"{row['planned idle']:.1%}")
    out.print(table)
    out.print("the last step's seconds, as the head's driver measured them", highlight=False)
    return 0


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def follow_logs(view: JobView, args: argparse.Namespace, out: Console) -> int:
    pods = view.attempt_pods()
    if not pods:
        raise PluginError(f"{view.name} has no pods yet (phase {view.status.phase})")
    width = max(len(p) for p in pods)
    lock = threading.Lock()
    failures: list[str] = []

    def stream(pod: str) -> None:
        from kubernetes import client

        try:
            response = view.core.read_namespaced_pod_log(pod, view.namespace, follow=args.follow,
                                                         tail_lines=args.tail, _preload_content=False)
            pending = b""
            for chunk in response.stream(4096):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                with lock:
                    for line in lines:
                        out.print(f"[bold]{pod:<{width}}[/bold] | {line.decode(errors='replace')}",
                                  highlight=False, soft_wrap=True, markup=True)
            if pending:
                with lock:
                    out.print(f"[bold]{pod:<{width}}[/bold] | {pending.decode(errors='replace')}", highlight=False,
                              soft_wrap=True)
        except client.ApiException as error:
            failures.append(f"{pod}: {_message(error)}")
        except Exception as error:  # noqa: BLE001  (a broken stream ends that pod's lines, not the others')
            failures.append(f"{pod}: {error}")

    threads = [threading.Thread(target=stream, args=(pod,), daemon=True, name=f"logs-{pod}") for pod in pods]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(0.2)
    for failure in failures:
        print(f"kubectl alpajob: no log from {failure}", file=sys.stderr)
    return 1 if failures and len(failures) == len(pods) else 0


def set_suspend(view: JobView, suspend: bool, out: Console) -> int:
    view.call(view.custom.patch_namespaced_custom_object, GROUP, VERSION, view.namespace, PLURAL, view.name,
               {"spec": {"runPolicy": {"suspend": suspend}}}, missing=f"AlpaJob {view.name} is gone")
    out.print(f"alpajob.io/{view.name} {'suspended' if suspend else 'resumed'}", highlight=False)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The plugin's entry point: 0 done, 1 a failure it names, 2 a usage error, 130 Ctrl-C."""
    args = parser().parse_args(argv)
    out = Console(soft_wrap=False)
    try:
        api, namespace = _client(args)
        view = JobView(api, namespace, args.job)
        if args.command == "plan":
            return show_plan(view, args, out)
        if args.command == "pods":
            return show_pods(view, out)
        if args.command == "top":
            return show_top(view, out)
        if args.command == "logs":
            return follow_logs(view, args, out)
        return set_suspend(view, args.command == "suspend", out)
    except PluginError as error:
        print(f"kubectl alpajob: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    """The ``kubectl-alpajob`` console script."""
    sys.exit(main())
