"""A plan as a picture: ``alpajob plan --svg FILE``.

One SVG with two panels, drawn from the Plan document and its predicted timeline
(:func:`~alpajob.planner.plan.timeline.predicted_timeline`):

- **submesh map**: one row per node, one cell per device, coloured by the stage
  that owns it (which GPUs of which node each stage gets);
- **timeline of one step**: one row per stage, one box per forward (``F``),
  backward (``B``), the communication the plan predicts at the end of each pass,
  and the update (``U``); the grey behind the boxes is idle time, and each row's
  label gives its share of the step. The heading gives the pipeline bubble the plan
  summary reports, ``(p - 1) / (m + p - 1)``: what every stage would idle were the
  stages equal. A row idles that much in filling and draining the pipeline, and the
  rest of its idle share waiting for slower stages (its tooltip gives the split).

With many micro-batches (a 64-stage, 1,024-micro-batch step has 200,000 spans) the
boxes would be narrower than a pixel and draw as a barcode: they are merged into
columns a few pixels wide, one colour per column (``computing``, brown, where forwards
and backwards interleave, as in 1F1B's steady state) and a bar whose height is the
share of that column the stage is busy, so a stage that waits draws lower.

Every cell and box carries a ``<title>`` (the browser's tooltip) with the exact
figures; rows carry ``class="stage-row"`` and ``data-stage`` so tests and scripts
can read the picture back. The SVG is built with :mod:`xml.etree.ElementTree`, so it
is well-formed whatever the model's name holds.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence

from alpajob.api.plan import Plan
from alpajob.api.timeline import Span, SpanKind, Timeline
from alpajob.api.wording import counted

SVG_NS = "http://www.w3.org/2000/svg"
WIDTH = 1200
LEFT = 190  # room for the row labels
RIGHT = 20
#: One colour per stage (cycled; ColorBrewer Set3, unlike the span colours below).
STAGE_COLOURS = ("#8dd3c7", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69",
                 "#fccde5", "#bc80bd", "#ccebc5", "#ffed6f")
KIND_COLOURS = {SpanKind.FORWARD: "#4e79a7", SpanKind.BACKWARD: "#f28e2b",
                SpanKind.COMMUNICATION: "#e15759", SpanKind.UPDATE: "#59a14f",
                SpanKind.STEP: "#76b7b2", SpanKind.FORWARD_BACKWARD: "#b07aa1"}
BUBBLE = "#e6e6e6"
#: Columns where forwards and backwards interleave, too narrow to draw one by one.
MERGED = "#9c755f"


def _seconds(value: float, unit_of: float | None = None) -> str:
    """``value`` in ms below a second (or when ``unit_of``, the scale, is), else in s."""
    scale = value if unit_of is None else unit_of
    return f"{value * 1e3:.3g} ms" if scale < 1 else f"{value:.3g} s"


def _el(parent: ET.Element, tag: str, text: str | None = None, **attrs: object) -> ET.Element:
    node = ET.SubElement(parent, tag, {k.rstrip("_").replace("_", "-"): str(v)
                                       for k, v in attrs.items()})
    if text is not None:
        node.text = text
    return node


def _tip(node: ET.Element, text: str) -> None:
    _el(node, "title", text)


def _submesh_map(svg: ET.Element, plan: Plan, top: float) -> float:
    """Draw the device grid from ``top``; returns the y below it."""
    counts = plan.node_devices()  # a plan across GPU types: each node its pool's devices
    nodes, per_node = len(counts), max(counts)
    owner: dict[tuple[int, int], int] = {}
    for stage_plan in plan.stages:
        for node, gpu in stage_plan.device_slots:
            owner[(node, gpu)] = stage_plan.index
    cell = max(4.0, min(36.0, (WIDTH - LEFT - RIGHT) / per_node, 480.0 / nodes))
    _el(svg, "text", "submesh map: which devices of which node each stage gets",
        x=10, y=top + 14, font_weight="bold")
    top += 24
    group = _el(svg, "g", class_="submesh-map")
    for node in range(nodes):
        y = top + node * cell
        if cell >= 10:
            _el(group, "text", f"node {node}", x=LEFT - 8, y=y + cell * 0.7,
                text_anchor="end", font_size=min(12.0, cell * 0.7))
        for gpu in range(counts[node]):
            x = LEFT + gpu * cell
            stage = owner.get((node, gpu))
            colour = STAGE_COLOURS[stage % len(STAGE_COLOURS)] if stage is not None else "#ffffff"
            rect = _el(group, "rect", x=x, y=y, width=cell - 1, height=cell - 1, fill=colour,
                       stroke="#999999", stroke_width=0.5, class_="device",
                       data_stage="" if stage is None else stage)
            what = (f"stage {stage}: layers [{plan.stages[stage].layers[0]}, "
                    f"{plan.stages[stage].layers[1]})" if stage is not None else "unused")
            _tip(rect, f"node {node}, device {gpu}: {what}")
            if stage is not None and cell >= 20:
                _el(group, "text", f"S{stage}", x=x + cell / 2, y=y + cell * 0.65,
                    text_anchor="middle", font_size=min(11.0, cell * 0.4), fill="#222222")
    return top + nodes * cell + 16


def _timeline(svg: ET.Element, plan: Plan, timeline: Timeline, top: float) -> float:
    """Draw one row per stage from ``top``; returns the y below the axis."""
    p = timeline.num_stages
    row = max(6.0, min(26.0, 640.0 / p))
    span = timeline.seconds or 1.0
    scale = (WIDTH - LEFT - RIGHT) / span
    _el(svg, "text", f"timeline of one step ({plan.schedule}, {plan.num_micro_batches} "
        f"micro-batches): predicted {_seconds(plan.predicted_step_seconds)}, pipeline bubble "
        f"{_share(plan.bubble_fraction)}", x=10, y=top + 14, font_weight="bold")
    top += 24
    by_stage: dict[int, list[Span]] = {i: [] for i in range(p)}
    for s in timeline.spans:
        by_stage[s.stage].append(s)
    for i in range(p):
        stage = plan.stages[i]
        y = top + i * row
        group = _el(svg, "g", class_="stage-row", data_stage=i)
        spans = by_stage[i]
        idle = timeline.bubble(i) / span
        bubble = min(idle, plan.bubble_fraction)
        _el(group, "rect", x=LEFT - 6, y=y, width=5, height=row - 1,
            fill=STAGE_COLOURS[i % len(STAGE_COLOURS)])
        if row >= 9:
            _el(group, "text", f"stage {i} ({stage.submesh_shape[0]}x{stage.submesh_shape[1]}) "
                f"idle {_share(idle)}", x=LEFT - 10, y=y + row * 0.7, text_anchor="end",
                font_size=min(12.0, row * 0.7))
        back = _el(group, "rect", x=LEFT, y=y, width=span * scale, height=row - 1, fill=BUBBLE,
                   class_="idle", data_idle=f"{idle:.6f}")
        _tip(back, f"stage {i}: layers [{stage.layers[0]}, {stage.layers[1]}), idle "
             f"{_seconds(timeline.bubble(i))} of {_seconds(span)} ({idle:.1%}): about {bubble:.1%} "
             f"the pipeline's bubble, {idle - bubble:.1%} waiting for slower stages")
        passes = [s for s in spans if s.kind is not SpanKind.COMMUNICATION]  # a thin one draws thin
        if all((s.end - s.start) * scale >= MIN_BOX_PX for s in passes):
            for s in spans:
                _box(group, s.kind, s.start, s.end, scale, row, y,
                     f"stage {i} {s.kind.value}"
                     f"{'' if s.micro_batch is None else f' micro-batch {s.micro_batch}'}: "
                     f"{_seconds(s.start)} to {_seconds(s.end)}", s.label)
        else:
            for kind, start, end, count, busy in _pixel_runs(spans, scale, span):
                height = (row - 1) * busy
                doing = "computing (forwards and backwards)" if kind is None else kind.value
                _box(group, kind, start, end, scale, height + 1, y + (row - 1) - height,
                     f"stage {i} {doing}, busy {busy:.0%}: {count} spans from "
                     f"{_seconds(start)} to {_seconds(end)} (merged: boxes this narrow "
                     "would not show)", None)
    axis_y = top + p * row + 4
    _el(svg, "line", x1=LEFT, y1=axis_y, x2=LEFT + span * scale, y2=axis_y, stroke="#333333")
    for k in range(6):
        t = span * k / 5
        x = LEFT + t * scale
        _el(svg, "line", x1=x, y1=axis_y, x2=x, y2=axis_y + 4, stroke="#333333")
        _el(svg, "text", _seconds(t, span), x=x, y=axis_y + 16, text_anchor="middle",
            font_size=11)
    legend_y = axis_y + 34
    x = LEFT
    drawn = {s.kind for s in timeline.spans}
    legend = [(kind.value, colour) for kind, colour in KIND_COLOURS.items() if kind in drawn]
    merged = svg.find(f".//*[@fill='{MERGED}']") is not None
    for name, colour in (*legend, *([("computing (merged)", MERGED)] if merged else []), ("idle", BUBBLE)):
        _el(svg, "rect", x=x, y=legend_y - 10, width=12, height=12, fill=colour)
        _el(svg, "text", name, x=x + 16, y=legend_y, font_size=12)
        x += 24 + 7 * len(name)
    notes = [f"Idle: the pipeline bubble, {_share(plan.bubble_fraction)} of the step for every stage "
             "(what equal stages would idle), plus waiting for slower stages; hover a row for the split."]
    if merged:
        notes.append("Micro-batches too narrow to draw one by one are merged: a bar's height is "
                     "the share of the time the stage is busy.")
    for k, note in enumerate(notes):
        _el(svg, "text", note, x=LEFT, y=legend_y + 20 + 16 * k, font_size=11, fill="#555555")
    return legend_y + 20 + 16 * len(notes)


def _share(fraction: float) -> str:
    """A share of the step: ``31%``, or ``0.6%`` below 10% (so a small bubble is not 1%)."""
    return f"{fraction:.0%}" if fraction >= 0.1 else f"{fraction:.1%}"


#: Spans narrower (in pixels) are merged into columns (module docstring; drawn one by one, a
#: 200,000-span step would be a file of tens of megabytes).
MIN_BOX_PX = 4.0
#: The merged columns' width in pixels.
COLUMN_PX = 3


def _box(group: ET.Element, kind: SpanKind | None, start: float, end: float, scale: float, row: float,
         y: float, tip: str, label: str | None) -> None:
    """One span's box, or (``kind`` None) a merged run of interleaved passes."""
    width = max(0.5, (end - start) * scale)
    box = _el(group, "rect", x=LEFT + start * scale, y=y, width=width, height=row - 1,
              fill=MERGED if kind is None else KIND_COLOURS[kind],
              class_=f"span {'merged' if kind is None else kind.value}")
    _tip(box, tip)
    if label and width >= 22 and row >= 12 and kind is not SpanKind.COMMUNICATION:
        _el(group, "text", label, x=LEFT + start * scale + width / 2, y=y + row * 0.7,
            text_anchor="middle", font_size=min(10.0, row * 0.55), fill="#ffffff")


def _pixel_runs(spans: Sequence[Span], scale: float,
                total: float) -> list[tuple[SpanKind | None, float, float, int, float]]:
    """Spans merged into columns :data:`COLUMN_PX` wide, or two passes wide where a
    pass is wider (so that every column holds whole passes and their gaps, and its
    share does not swing with where a gap falls): a column takes the kind that
    covers it, or None where forwards and backwards both do (1F1B's steady state
    alternates them faster than a pixel), and the share of it that spans cover (to a
    tenth; under a twentieth it shows as idle); neighbouring columns of one kind whose
    shares differ by at most a tenth join into one run ``(kind, start, end, spans
    starting in it, busy share)``, its share their mean (a steady 95% would otherwise
    flicker between 90% and 100%): a stage busy 58% of the time draws 58% high."""
    passes = sorted(s.end - s.start for s in spans if s.kind is not SpanKind.COMMUNICATION)
    width = max(COLUMN_PX / scale, 2 * passes[len(passes) // 2] if passes else 0.0)
    columns = max(1, int(total / width) + 1)
    cover = [dict.fromkeys(SpanKind, 0.0) for _ in range(columns)]
    starts = [0] * columns
    for s in spans:
        first, last = int(s.start / width), min(columns - 1, int(s.end / width))
        starts[min(first, columns - 1)] += 1
        for c in range(first, last + 1):
            overlap = min(s.end, (c + 1) * width) - max(s.start, c * width)
            if overlap > 0:
                cover[c][s.kind] += overlap
    runs: list[tuple[SpanKind | None, float, float, int, float]] = []
    for c in range(columns):
        covered = sum(cover[c].values())
        busy = round(min(1.0, covered / width), 1)
        if busy < 0.05:
            continue
        both = cover[c][SpanKind.FORWARD], cover[c][SpanKind.BACKWARD]
        kind: SpanKind | None
        if min(both) > 0.1 * covered:
            kind = None
        else:
            kind = max(cover[c].items(), key=lambda item: item[1])[0]
        if (runs and runs[-1][0] is kind and abs(runs[-1][4] - busy) <= 0.1 + 1e-9
                and abs(runs[-1][2] - c * width) < width / 2):
            k, start, end, count, share = runs[-1]
            joined = (end - start) / width
            runs[-1] = (k, start, (c + 1) * width, count + starts[c], (share * joined + busy) / (joined + 1))
        else:
            runs.append((kind, c * width, (c + 1) * width, starts[c], busy))
    return runs


def plan_svg(plan: Plan, timeline: Timeline) -> str:
    """The SVG document of ``plan`` and its predicted ``timeline`` (module docstring)."""
    svg = ET.Element("svg", {"xmlns": SVG_NS, "width": str(WIDTH), "font-family": "sans-serif",
                             "font-size": "13"})
    _el(svg, "text", f"{plan.model.name} on {plan.cluster_label()}: {counted(len(plan.stages), 'stage')}, "
        f"predicted step {_seconds(plan.predicted_step_seconds)}, plan {plan.content_hash()}",
        x=10, y=20, font_size=15, font_weight="bold")
    y = _submesh_map(svg, plan, 34)
    y = _timeline(svg, plan, timeline, y)
    svg.set("height", str(int(y + 10)))
    svg.set("viewBox", f"0 0 {WIDTH} {int(y + 10)}")
    return ET.tostring(svg, encoding="unicode", xml_declaration=True)
