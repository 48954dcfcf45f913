"""Training metrics for Prometheus: per-stage compute, idle and communication seconds.

One :class:`TrainingMetrics` per run, on its own ``CollectorRegistry`` (no global
state), served on ``/metrics`` by :meth:`TrainingMetrics.serve`. Gauges hold the last
step's values, read from the trainer's :class:`~alpajob.api.progress.Progress` report
(the same document the job's status shows); counters add up over the run. Per-stage times come from the steps the
runtime timed (``alpajob run --stage-times-every``): their gauges hold the last timed
step and their counters add up the timed steps, so a ratio of their rates is the
timed steps' utilization::

    alpajob_step                                  last completed step
    alpajob_loss                                  its loss
    alpajob_eval_loss                             loss on spec.data.eval, last evaluation
    alpajob_step_seconds                          its wall time
    alpajob_last_step_timestamp_seconds           when it ended (Unix time; the run's start
                                                  before the first): a stalled run's alert
    alpajob_samples_per_second                    global batch / step seconds
    alpajob_tokens_per_second                     tokens of the batch / step seconds
    alpajob_mfu                                   model FLOPs utilization (trainer/throughput.py)
    alpajob_predicted_step_seconds                the plan's prediction
    alpajob_checkpoint_step                       the last complete checkpoint's step
    alpajob_last_checkpoint_timestamp_seconds     when the trainer first reported it (Unix time)
    alpajob_restarts_total                        restarts from a checkpoint (Ray runtime)
    alpajob_data_read_bytes_total{mesh="0",host="1"}  bytes of token ids each reader read
                                                  (a pipeline's middle stages read none)
    alpajob_data_source_rows_total{source="web"}  batch rows per training source (a mixture's
                                                  shares: rate of one over the rate of all)
    alpajob_goodput                               productive step time / wall time so far
    alpajob_badput_seconds{bucket="compile"}      the rest of the wall time, by bucket
                                                  (trainer/goodput.py: planning, compile, data,
                                                  eval, checkpoint, restore, other)
    alpajob_stage_step_compute_seconds{stage="0"}        per stage, last step
    alpajob_stage_step_idle_seconds{stage="0"}           (waiting: the bubble)
    alpajob_stage_step_communication_seconds{stage="0"}
    alpajob_stage_predicted_idle_share{stage="0"}        the plan's bubble: 1 - (its micro-batches'
                                                         fwd+bwd + its update) / predicted step
    alpajob_stage_compute_seconds_total{stage="0"}       running totals: a
    alpajob_stage_idle_seconds_total{stage="0"}          dashboard's utilization is
    alpajob_stage_communication_seconds_total{stage="0"} rate(compute) / rate(all three)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from alpajob.api.errors import AlpaJobError
from alpajob.api.plan import Plan
from alpajob.api.progress import Progress

_LABELS = ("job", "stage")


def predicted_idle_shares(plan: Plan) -> list[float]:
    """Each stage's predicted idle share of a step: what is left of the plan's step
    time after the stage's own work (forward and backward of every micro-batch, and
    its optimizer update); the pipeline's bubble as the cost model sees it."""
    step = plan.predicted_step_seconds
    if step <= 0:
        return [0.0 for _ in plan.stages]
    return [max(0.0, 1.0 - (s.predicted_seconds * plan.num_micro_batches + s.update_seconds) / step)
            for s in plan.stages]


def write_text_atomically(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a temp file renamed into place)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_metrics_json(path: str | Path, data: dict[str, Any]) -> None:
    """Write ``--metrics-out`` atomically."""
    write_text_atomically(path, json.dumps(data, indent=1) + "\n")


class TrainingMetrics:
    """The run's gauges and counters."""

    def __init__(self, job: str, predicted_step_seconds: float | None = None) -> None:
        self.job = job
        self.registry = CollectorRegistry()
        r = self.registry
        self.step = Gauge("alpajob_step", "last completed training step", ["job"], registry=r)
        self.loss = Gauge("alpajob_loss", "training loss of the last step", ["job"], registry=r)
        self.eval_loss = Gauge("alpajob_eval_loss", "loss on spec.data.eval, last evaluation", ["job"], registry=r)
        self.step_seconds = Gauge("alpajob_step_seconds", "wall seconds of the last step", ["job"], registry=r)
        self.stepped_at = Gauge("alpajob_last_step_timestamp_seconds", "Unix time the last step ended "
                                "(the run's start before the first)", ["job"], registry=r)
        self.stepped_at.labels(job).set_to_current_time()
        self.samples = Gauge("alpajob_samples_per_second", "samples per second, last step", ["job"], registry=r)
        self.tokens = Gauge("alpajob_tokens_per_second", "tokens per second, last step", ["job"], registry=r)
        self.mfu = Gauge("alpajob_mfu", "model FLOPs utilization of the last step (0..1)", ["job"], registry=r)
        self.predicted = Gauge("alpajob_predicted_step_seconds", "the plan's predicted step seconds (set beside alpajob_step_seconds)", ["job"], registry=r)
        self.compute = Gauge("alpajob_stage_step_compute_seconds", "stage compute seconds, last step", _LABELS, registry=r)
        self.idle = Gauge("alpajob_stage_step_idle_seconds", "stage idle (bubble) seconds, last step", _LABELS, registry=r)
        self.comm = Gauge("alpajob_stage_step_communication_seconds", "stage communication seconds, last step", _LABELS, registry=r)
        self.compute_total = Counter("alpajob_stage_compute_seconds", "stage compute seconds, summed over the timed steps", _LABELS, registry=r)
        self.idle_total = Counter("alpajob_stage_idle_seconds", "stage idle (bubble) seconds, summed over the timed steps", _LABELS, registry=r)
        self.comm_total = Counter("alpajob_stage_communication_seconds", "stage communication seconds, summed over the timed steps", _LABELS, registry=r)
        self.checkpoint = Gauge("alpajob_checkpoint_step", "step of the last complete checkpoint", ["job"], registry=r)
        self.checkpointed_at = Gauge("alpajob_last_checkpoint_timestamp_seconds", "Unix time the trainer "
                                     "first reported the last complete checkpoint", ["job"], registry=r)
        self._checkpoint_step: int | None = None
        self.restarts = Counter("alpajob_restarts", "restarts of every mesh from the last checkpoint", ["job"], registry=r)
        self.predicted_idle = Gauge("alpajob_stage_predicted_idle_share",
                                    "the plan's predicted idle (bubble) share of a step", _LABELS, registry=r)
        self.goodput = Gauge("alpajob_goodput", "productive step time over the run's wall time so far",
                             ["job"], registry=r)
        self.badput = Gauge("alpajob_badput_seconds", "wall seconds not training, by bucket",
                            ["job", "bucket"], registry=r)
        self.read_bytes = Counter("alpajob_data_read_bytes", "bytes of token ids read from spec.data, per "
                                  "reader (a mesh host; the local run is mesh all)", ["job", "mesh", "host"],
                                  registry=r)
        self.source_rows = Counter("alpajob_data_source_rows", "rows of the global batches taken from each "
                                   "training source (a mixture's realised shares)", ["job", "source"], registry=r)
        self.restarts.labels(job)
        if predicted_step_seconds is not None:
            self.predicted.labels(job).set(predicted_step_seconds)
        self._server: Any = None

    def plan(self, plan: Plan) -> None:
        """The plan's predictions: its step time, and each stage's idle share of it
        (:func:`predicted_idle_shares`), to set beside the measured ones."""
        self.predicted.labels(self.job).set(plan.predicted_step_seconds)
        for index, share in enumerate(predicted_idle_shares(plan)):
            self.predicted_idle.labels(self.job, str(index)).set(share)

    def books(self, summary: dict[str, float]) -> None:
        """Record :meth:`~.goodput.Goodput.summary`: goodput and each badput bucket."""
        self.goodput.labels(self.job).set(summary["goodput"])
        for key, value in summary.items():
            if key.endswith("_seconds") and key not in ("wall_seconds", "productive_seconds"):
                self.badput.labels(self.job, key[: -len("_seconds")]).set(value)

    def record(self, progress: Progress, seconds: float, stages: Any = ()) -> None:
        """Record one step: the trainer's ``progress`` report after it, its wall
        ``seconds``, and ``stages``, :class:`~.runtime.executor.StageTimes` (or empty)."""
        job = self.job
        self.step.labels(job).set(progress.step)
        if progress.loss is not None:
            self.loss.labels(job).set(progress.loss)
        if progress.eval_loss is not None:
            self.eval_loss.labels(job).set(progress.eval_loss)
        self.step_seconds.labels(job).set(seconds)
        self.stepped_at.labels(job).set_to_current_time()
        if progress.samples_per_second is not None:
            self.samples.labels(job).set(progress.samples_per_second)
        if progress.tokens_per_second is not None:
            self.tokens.labels(job).set(progress.tokens_per_second)
        if progress.mfu is not None:
            self.mfu.labels(job).set(progress.mfu)
        if progress.last_checkpoint_step is not None:
            self.checkpoint.labels(job).set(progress.last_checkpoint_step)
            if progress.last_checkpoint_step != self._checkpoint_step:
                self._checkpoint_step = progress.last_checkpoint_step
                self.checkpointed_at.labels(job).set_to_current_time()
        for index, times in enumerate(stages):
            labels = (job, str(index))
            self.compute.labels(*labels).set(times.compute)
            self.idle.labels(*labels).set(times.idle)
            self.comm.labels(*labels).set(times.communication)
            self.compute_total.labels(*labels).inc(times.compute)
            self.idle_total.labels(*labels).inc(times.idle)
            self.comm_total.labels(*labels).inc(times.communication)

    def data(self, read: dict[tuple[str, str], int], rows: dict[str, int]) -> None:
        """Record one step's reading: bytes per reader ``(mesh, host)``, and rows of its
        global batch per training source."""
        for (mesh, host), count in read.items():
            self.read_bytes.labels(self.job, mesh, host).inc(count)
        for source, count in rows.items():
            self.source_rows.labels(self.job, source).inc(count)

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` on ``port`` until :meth:`close`; a port that cannot be had
        is an :class:`~alpajob.api.errors.AlpaJobError` naming ``--metrics-port``."""
        try:
            self._server, _thread = start_http_server(port, addr=address, registry=self.registry)
        except OSError as error:
            raise AlpaJobError(f"--metrics-port: cannot serve on {address}:{port} ({error.strerror}); "
                               "choose a free port") from None

    def close(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server = None
