"""On one host whose devices share its cores: the plan, or the same step on one device?

XLA's forced CPU devices (``--xla_force_host_platform_device_count``) are one host's
cores shared out: a plan over 8 of them does the same work as one device, plus its
collectives, moves and per-device overheads, and gains only where one device alone
would leave cores idle. The planner weighs that (it costs the plan on all the devices
and on one, by the host share one device reaches alone: ``lone_device_share``, which
``alpajob calibrate`` measures), but the two are often within its error (a one-stage plan
and the serial step are each one program now, :mod:`.runtime.fused`; the README's
byte-level GPT ran 17% faster on its 8-device plan than serial). So ``alpajob run``
checks by measuring: for an ``auto`` job on a shared host of more than one device,
without a plan file, it times a few steps of the plan and of the serial step on the
same batch (after a warm-up: a pipeline's first steps run slower), from the same
initial state, and keeps the faster. Both runners are put back to that state
afterwards, so training is the same as if the winner had been the only candidate
(the trial's steps do not count). ``--keep-plan`` skips the trial.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

#: Untimed steps per candidate first: the first compiles, and a pipeline's next few run
#: slower while it settles (the README job's plan: 380, 346, 323 ms, then about 305).
WARMUP_STEPS = 3
#: Timed steps per candidate, after the warm-up.
TRIAL_STEPS = 5


class Runner(Protocol):
    """What a trial needs of a runner (``runners.SerialRunner``, ``PipelineRunner``)."""

    def step(self, batch: list[np.ndarray], timed: bool) -> tuple[float, Any]: ...

    def named_arrays(self) -> dict[str, Any]: ...

    def load(self, arrays: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class TrialResult:
    """Median seconds per step of the plan and of one device; which one won."""

    plan_seconds: float
    one_device_seconds: float

    @property
    def one_device_wins(self) -> bool:
        return self.one_device_seconds < self.plan_seconds

    def line(self) -> str:
        """What the run says about it, in one line."""
        plan, one = self.plan_seconds * 1e3, self.one_device_seconds * 1e3
        if self.one_device_wins:
            return (f"one device measured faster than the plan ({one:.1f} against {plan:.1f} ms "
                    "per step): training on one device (--keep-plan runs the plan)")
        return f"the plan measured faster than one device ({plan:.1f} against {one:.1f} ms per step)"


def median_step_seconds(runner: Runner, batch: list[np.ndarray], steps: int = TRIAL_STEPS,
                        warmup: int = WARMUP_STEPS) -> float:
    """Median wall seconds of ``steps`` steps on ``batch`` after ``warmup`` untimed ones;
    the runner's parameters and optimizer state are restored afterwards."""
    # Copies on the arrays' own devices and shardings: a step donates the originals.
    snapshot = {name: value.copy() for name, value in runner.named_arrays().items()}
    for _ in range(warmup):
        runner.step(batch, False)
    seconds = []
    for _ in range(steps):
        began = time.perf_counter()
        runner.step(batch, False)  # returns the loss as a float: the step is done
        seconds.append(time.perf_counter() - began)
    runner.load(snapshot)
    return statistics.median(seconds)


def trial(plan_runner: Runner, one_device: Runner, batch: list[np.ndarray]) -> TrialResult:
    """Time both runners on ``batch`` (module docstring)."""
    return TrialResult(median_step_seconds(plan_runner, batch), median_step_seconds(one_device, batch))
