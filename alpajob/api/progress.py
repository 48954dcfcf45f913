"""Progress: what a running trainer reports, in one shape for every reader.

The trainer (``alpajob run`` and the Ray driver of a job's head pod) fills a
:class:`Progress` after every step. The same document is

- written to ``--status-file`` and into the job's ``<job>-progress`` ConfigMap
  (key :data:`~alpajob.api.names.PROGRESS_KEY`), camelCase JSON;
- copied by the operator into ``status.progress`` (the CRD declares exactly these
  fields, generated from this model, so nothing the operator writes is pruned);
- the source of the trainer's Prometheus gauges and the CLI's summary line.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, ValidationError

from alpajob.api.errors import AlpaJobError
from alpajob.api.schema import Contract, k8s


class TrainerPhase(StrEnum):
    """Where the trainer is (the job's phase is the operator's, :class:`~.status.Phase`)."""

    STARTING = "Starting"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUCCEEDED = "Succeeded"
    STOPPED = "Stopped"  # by SIGTERM, after saving a checkpoint: resumes when started again
    FAILED = "Failed"


class Progress(Contract):
    """One report of a trainer's progress (every field optional but ``step``)."""

    phase: TrainerPhase | None = Field(None, description="The trainer's phase.")
    step: int = Field(0, ge=0, json_schema_extra=k8s(format="int64"),
                      description="Steps completed.")
    steps: int | None = Field(None, ge=0, json_schema_extra=k8s(format="int64"),
                              description="Steps the run will train.")
    loss: float | None = Field(None, description="Training loss of the last step.")
    eval_loss: float | None = Field(None, description="Loss on spec.data.eval at the last evaluation.")
    samples_per_second: float | None = Field(None, ge=0, description="Samples per second, last step.")
    tokens_per_second: float | None = Field(None, ge=0, description="Tokens per second, last step.")
    goodput: float | None = Field(None, ge=0, le=1, description=(
        "Productive step time over the run's wall time so far (the rest: planning, compiling, data, "
        "evaluation, checkpoints)."))
    mfu: float | None = Field(None, ge=0, description=(
        "Model FLOPs utilization of the last step: the model's FLOPs over the devices' peak."))
    last_checkpoint_step: int | None = Field(None, ge=0, json_schema_extra=k8s(format="int64"),
                                             description="Step of the last complete checkpoint.")
    skipped_steps: int | None = Field(None, ge=0, json_schema_extra=k8s(format="int64"), description=(
        "float16: steps skipped because their gradients overflowed (dynamic loss scaling)."))
    restarts: int = Field(0, ge=0, json_schema_extra=k8s(format="int32"),
                          description="Restarts of every mesh from a checkpoint: the trainer's own "
                                      "in its report; in an AlpaJob's status, every restart of the "
                                      "job (status.restarts + status.disruptions).")
    message: str | None = Field(None, max_length=4096,
                                description="Why the trainer restarted or failed.")
    data: str | None = Field(None, max_length=1024, description=(
        "What the trainer reads: 'synthetic' (no spec.data), or the files and tokens of spec.data.train."))
    updated: float | None = Field(None, description="When this report was made (Unix seconds).")

    def to_json(self) -> str:
        """The document as compact camelCase JSON (None fields left out)."""
        return self.model_dump_json(by_alias=True, exclude_none=True)


def progress_from_json(text: str, source: str = "progress") -> Progress:
    """Parse a progress document; :class:`~alpajob.api.errors.AlpaJobError` names the
    problem."""
    try:
        return Progress.model_validate_json(text)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "document"
        raise AlpaJobError(f"{source}: {where}: {first['msg']}") from None
