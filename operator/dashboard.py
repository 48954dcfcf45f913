"""The AlpaJob Grafana dashboard, built with Grafana's typed builders
(grafana-foundation-sdk): the chart's ``files/grafana-dashboard.json`` is this module's
output (``alpajob dashboard -o charts/alpajob/files/grafana-dashboard.json``), and a
test fails when the two differ.

Four rows, each panel reading series that the trainer (the chart's PodMonitor) or the
operator (its ServiceMonitor) exposes, selected by the ``namespace`` and ``job``
variables (an AlpaJob's own labels, which both monitors honour):

- **Training**: step, tokens/s, MFU, checkpoint age, restarts; train and eval loss;
  throughput; step time measured beside the plan's prediction; step and checkpoint.
- **Pipeline**: per-stage utilization; per-stage bubble share measured beside the
  plan's prediction; the last timed step's split.
- **Goodput**: goodput (the trainer's and the operator's); badput by bucket; the
  share of wall time spent waiting for data.
- **Operator**: jobs by phase; reconcile and planning latency; API requests.
"""

from __future__ import annotations

from typing import Any

#: The datasource every panel and variable queries (the ``datasource`` variable).
DATASOURCE_UID = "${datasource}"
#: The selector of one AlpaJob's series, by the dashboard's variables.
JOB = 'namespace=~"$namespace", job=~"$job"'
#: Stages' time counters: utilization is compute over all three.
STAGE_PARTS = ("compute", "idle", "communication")


def _stage_rate(part: str) -> str:
    return f"sum by (namespace, job, stage) (rate(alpajob_stage_{part}_seconds_total{{{JOB}}}[5m]))"


def _stage_share(part: str) -> str:
    """The share of the stages' timed seconds spent in ``part``."""
    total = "\n+ ".join(_stage_rate(p) for p in STAGE_PARTS)
    return f"{_stage_rate(part)}\n/\n({total})"


def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    import itertools
    import json

    from grafana_foundation_sdk.builders import dashboard as board
    from grafana_foundation_sdk.builders import prometheus, stat, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import dashboard as model

    source = model.DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)
    ids = itertools.count(1)  # panel ids, in the order the panels are laid out

    def row(title: str) -> board.Row:
        return board.Row(title).id(next(ids))

    def query(expr: str, legend: str, ref: str) -> prometheus.Dataquery:
        return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(source)

    def panel(kind: Any, title: str, description: str, unit: str, width: int, height: int,
              *queries: tuple[str, str]) -> Any:
        built = kind().id(next(ids)).title(title).description(description).unit(unit).span(width).height(height)
        built = built.datasource(source)
        for i, (expr, legend) in enumerate(queries):
            built = built.with_target(query(expr, legend, chr(ord("A") + i)))
        return built

    def figure(title: str, description: str, unit: str, *queries: tuple[str, str]) -> Any:
        return panel(stat.Panel, title, description, unit, 4, 4, *queries)

    def chart(title: str, description: str, unit: str, *queries: tuple[str, str], width: int = 12) -> Any:
        return panel(timeseries.Panel, title, description, unit, width, 8, *queries)

    def variable(name: str, label: str, values: str) -> board.QueryVariable:
        return (board.QueryVariable(name).label(label).datasource(source)
                .query(values).refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
                .sort(model.VariableSort.ALPHABETICAL_ASC).multi(True).include_all(True).all_value(".*"))

    per_job = "{{namespace}}/{{job}}"
    per_stage = "{{job}} stage {{stage}}"
    built = (
        board.Dashboard("AlpaJob")
        .uid("alpajob-training")
        .description("AlpaJob training: progress, throughput and MFU, loss, goodput and badput, "
                     "each pipeline stage's utilization and bubble beside the plan's, and the operator.")
        .tags(["alpajob", "training", "jax"])
        .editable()
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .time("now-6h", "now")
        .timezone("browser")
        .with_variable(board.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(variable("namespace", "Namespace", "label_values(alpajob_step, namespace)"))
        .with_variable(variable("job", "AlpaJob", 'label_values(alpajob_step{namespace=~"$namespace"}, job)'))
        .with_row(row("Training"))
        .with_panel(figure("Step", "The last completed training step.", "short",
                           (f"max by (namespace, job) (alpajob_step{{{JOB}}})", per_job)))
        .with_panel(figure("Tokens / s", "Tokens trained per second over the last step.", "short",
                           (f"sum by (namespace, job) (alpajob_tokens_per_second{{{JOB}}})", per_job)))
        .with_panel(figure("MFU", "Model FLOPs utilization of the last step: the model's FLOPs "
                           "over the devices' peak.", "percentunit",
                           (f"max by (namespace, job) (alpajob_mfu{{{JOB}}})", per_job)))
        .with_panel(figure("Checkpoint age", "Time since the last complete checkpoint: what a "
                           "failure now would cost.", "s",
                           (f"time() - max by (namespace, job) (alpajob_last_checkpoint_timestamp_seconds{{{JOB}}})",
                            per_job)))
        .with_panel(figure("Restarts", "Restarts of the job: the operator's count (disruptions "
                           "included), or the trainer's own where no operator runs.", "short",
                           (f"max by (namespace, job) (alpajob_job_restarts{{{JOB}}})", per_job),
                           (f"sum by (namespace, job) (alpajob_restarts_total{{{JOB}}})", f"{per_job} (trainer)")))
        .with_panel(figure("Step time", "Wall seconds of the last step.", "s",
                           (f"max by (namespace, job) (alpajob_step_seconds{{{JOB}}})", per_job)))
        .with_panel(chart("Loss", "Training loss of each step, and the loss on spec.data.eval at each "
                          "evaluation.", "short",
                          (f"max by (namespace, job) (alpajob_loss{{{JOB}}})", f"{per_job} train"),
                          (f"max by (namespace, job) (alpajob_eval_loss{{{JOB}}})", f"{per_job} eval")))
        .with_panel(chart("Throughput", "Tokens and samples per second.", "short",
                          (f"sum by (namespace, job) (alpajob_tokens_per_second{{{JOB}}})", f"{per_job} tokens/s"),
                          (f"sum by (namespace, job) (alpajob_samples_per_second{{{JOB}}})",
                           f"{per_job} samples/s")))
        .with_panel(chart("Step seconds, measured and predicted", "The last step's wall time beside the "
                          "plan's prediction for it.", "s",
                          (f"max by (namespace, job) (alpajob_step_seconds{{{JOB}}})", f"{per_job} measured"),
                          (f"max by (namespace, job) (alpajob_predicted_step_seconds{{{JOB}}})",
                           f"{per_job} predicted")))
        .with_panel(chart("MFU over time", "Model FLOPs utilization of each step.", "percentunit",
                          (f"max by (namespace, job) (alpajob_mfu{{{JOB}}})", per_job)))
        .with_panel(chart("Step and last checkpoint step", "Training progress and what a restart "
                          "resumes from.", "short",
                          (f"max by (namespace, job) (alpajob_step{{{JOB}}})", f"{per_job} step"),
                          (f"max by (namespace, job) (alpajob_checkpoint_step{{{JOB}}})",
                           f"{per_job} checkpoint")))
        .with_row(row("Pipeline"))
        .with_panel(chart("Per-stage utilization", "Each stage's compute over its compute, idle and "
                          "communication time, over the timed steps.", "percentunit",
                          (_stage_share("compute"), per_stage), width=8))
        .with_panel(chart("Bubble share per stage, measured and predicted", "Each stage's idle share "
                          "(the pipeline bubble) beside the plan's prediction: far apart, the plan is "
                          "off for this cluster.", "percentunit",
                          (_stage_share("idle"), f"{per_stage} measured"),
                          (f"max by (namespace, job, stage) (alpajob_stage_predicted_idle_share{{{JOB}}})",
                           f"{per_stage} predicted"), width=8))
        .with_panel(chart("Per-stage time split, last timed step", "Compute, idle and communication "
                          "seconds of each stage in the last timed step.", "s",
                          *[(f"sum by (namespace, job, stage) (alpajob_stage_step_{part}_seconds{{{JOB}}})",
                             f"{per_stage} {part}") for part in STAGE_PARTS], width=8))
        .with_row(row("Goodput"))
        .with_panel(chart("Goodput", "Productive step time over wall time: the trainer's (its run) "
                          "and the operator's (the job's Running time over all of it).", "percentunit",
                          (f"max by (namespace, job) (alpajob_goodput{{{JOB}}})", f"{per_job} trainer"),
                          (f"max by (namespace, job) (alpajob_job_goodput{{{JOB}}})", f"{per_job} job"),
                          width=8))
        .with_panel(chart("Badput by bucket", "Wall seconds not training: the trainer's buckets "
                          "(compile, data, eval, checkpoint, restore, ...) and the job's phases "
                          "(planning, starting, restarting).", "s",
                          (f"sum by (namespace, job, bucket) (alpajob_badput_seconds{{{JOB}}})",
                           "{{job}} {{bucket}}"),
                          (f'sum by (namespace, job, phase) (alpajob_job_phase_seconds{{{JOB}, phase!="running"}})',
                           "{{job}} {{phase}}"), width=8))
        .with_panel(chart("Data wait", "The share of wall time the trainer waited for its next "
                          "batch: above a few percent, the input pipeline is the bottleneck.", "percentunit",
                          (f'max by (namespace, job) (deriv(alpajob_badput_seconds{{{JOB}, bucket="data"}}[5m]))',
                           per_job), width=8))
        .with_row(row("Operator"))
        .with_panel(chart("AlpaJobs by phase", "Jobs the operator reconciles, by phase.", "short",
                          ("sum by (phase) (alpajob_operator_jobs)", "{{phase}}"), width=8))
        .with_panel(chart("Reconcile and planning seconds", "95th percentiles of one reconciliation "
                          "pass and of a job's start to its plan; reconcile errors per second.", "s",
                          ("histogram_quantile(0.95, sum by (le) (rate(alpajob_operator_reconcile_seconds_bucket[5m])))",
                           "reconcile p95"),
                          ("histogram_quantile(0.95, sum by (le) (rate(alpajob_operator_planning_seconds_bucket[30m])))",
                           "planning p95"),
                          ("sum(rate(alpajob_operator_reconcile_errors_total[5m]))", "errors/s"), width=8))
        .with_panel(chart("API requests", "The operator's requests to the Kubernetes API per second, "
                          "by verb and status code.", "reqps",
                          ("sum by (verb, code) (rate(alpajob_operator_api_requests_total[5m]))",
                           "{{verb}} {{code}}"), width=8))
    )
    return json.loads(JSONEncoder(sort_keys=True, indent=1).encode(built.build()))


def dashboard_json() -> str:
    """The dashboard as the chart stores it."""
    import json

    return json.dumps(build(), indent=1, sort_keys=True) + "\n"
