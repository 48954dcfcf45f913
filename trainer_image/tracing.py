"""``alpajob run --trace FILE``: one measured step beside the plan's prediction.

The local runtime stamps every instruction of a timed step
(:func:`~alpajob.trainer_image.runtime.driver.stage_times`); its spans become the
"measured" timeline, the plan's :func:`~alpajob.planner.plan.timeline.
predicted_timeline` the "predicted" one, and both go into one Chrome trace
(:func:`~alpajob.api.timeline.chrome_trace`): two processes with one row per stage
each, so Perfetto shows the prediction right under what happened.

A run that trains on one device (``--method serial``, or a device trial that measured
one device faster than the plan) has no plan to show and no instructions to tell
apart: its trace is the step alone, one span, with the reason in ``otherData``
(:func:`write_one_device_trace`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from alpajob.api.plan import Plan
from alpajob.api.timeline import Span, SpanKind, Timeline, chrome_trace
from alpajob.planner.plan.timeline import predicted_timeline
from alpajob.trainer_image.runtime.executor import StageTimes


def measured_timeline(stages: Sequence[StageTimes], seconds: float) -> Timeline:
    """The spans of one timed step (``seconds`` long)."""
    return Timeline(len(stages), tuple(s for stage in stages for s in stage.spans), seconds)


def write_trace(path: str, plan: Plan, stages: Sequence[StageTimes], step: int,
                seconds: float) -> None:
    """Write step ``step``'s measured timeline and ``plan``'s predicted one to ``path``."""
    names = [f"stage {s.index} layers [{s.layers[0]}, {s.layers[1]}) "
             f"{s.submesh_shape[0]}x{s.submesh_shape[1]}" for s in plan.stages]
    document = chrome_trace([(f"measured: step {step}, {seconds * 1e3:.1f} ms",
                              measured_timeline(stages, seconds)),
                             (f"predicted: {plan.predicted_step_seconds * 1e3:.1f} ms",
                              predicted_timeline(plan))], names)
    document["otherData"] = {"plan_hash": plan.content_hash(), "step": step,
                             "measured_seconds": seconds,
                             "predicted_seconds": plan.predicted_step_seconds}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f)


def write_one_device_trace(path: str, step: int, seconds: float, reason: str) -> None:
    """Write step ``step`` of a run on one device (``seconds`` long) to ``path``: one
    row, one span, and why there is no plan (``reason``)."""
    timeline = Timeline(1, (Span(0, SpanKind.STEP, None, 0.0, seconds),), seconds)
    document = chrome_trace([(f"measured: step {step}, {seconds * 1e3:.1f} ms, one device", timeline)],
                            ["one device"])
    document["otherData"] = {"plan_hash": None, "step": step, "measured_seconds": seconds,
                             "one_device": reason}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f)
