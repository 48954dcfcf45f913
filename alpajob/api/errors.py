"""The planner's error hierarchy.

Every error a user can cause derives from :class:`AlpaJobError` and carries a message
that names the offending value and the fix. The CLI prints the message (no traceback)
and exits with :attr:`AlpaJobError.exit_code`.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Problem(NamedTuple):
    """One thing wrong with a document: where (``spec.cluster.gpu``) and how to fix it."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class AlpaJobError(Exception):
    """Base class for errors caused by user input; ``exit_code`` is the CLI's exit status.

    Errors cross process boundaries (a planning child hands its error to the run), so
    they pickle whatever a subclass's ``__init__`` takes: rebuilt with the same
    message and attributes, without calling ``__init__`` again.
    """

    exit_code: int = 2

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


def _rebuild(kind: type[AlpaJobError], args: tuple[Any, ...], state: dict[str, Any]) -> AlpaJobError:
    error = kind.__new__(kind)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class ManifestError(AlpaJobError):
    """The AlpaJob manifest (or a CLI flag overriding it) is malformed.

    ``field`` is the dotted path of the offending field, e.g. ``spec.model.config.hidden``.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class ClusterError(AlpaJobError):
    """The cluster description is impossible (zero nodes, unknown GPU preset, ...)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class InfeasibleError(AlpaJobError):
    """The model cannot fit the cluster's device memory, even fully sharded.

    ``required_bytes`` is the smallest per-device memory any plan needs,
    ``available_bytes`` the device memory.
    """

    def __init__(self, message: str, required_bytes: float, available_bytes: float) -> None:
        self.required_bytes = required_bytes
        self.available_bytes = available_bytes
        super().__init__(message)


class PlanFormatError(AlpaJobError):
    """A Plan document could not be read (bad JSON, wrong version, missing field)."""


class TimeLimitError(AlpaJobError):
    """Planning (tracing included) went past its time limit (``--plan-time-limit``)."""


class SolverError(AlpaJobError):
    """The ILP solver failed for a reason other than infeasibility (e.g. its time limit)."""


class TransientError(AlpaJobError):
    """The run failed for a reason a restart may fix (a mesh host never joined, the
    driver's own restarts are spent). It exits 3, not 2: the operator's default
    ``podFailurePolicy`` fails a job at once on exit code 2 (a configuration error,
    which no restart fixes) and restarts it on anything else."""

    exit_code = 3
