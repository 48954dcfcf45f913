"""What-if options as a picture: ``alpajob plan JOB --what-if SPEC... --svg FILE``.

One scatter plot: each option that fits is a point at (what the whole job costs, how
long it takes), the cost in dollars with ``--prices`` (else in GPU-hours) and the time
in hours of ``spec.training.steps`` predicted steps. An option is on the **Pareto
front** when no other option is at most as dear and at most as slow, and better in one
of the two; the front's points are filled and joined by a staircase, the others are
hollow. Every point is labelled with its option and carries a ``<title>`` (the
browser's tooltip) with its figures, and ``class="option"``, ``data-option`` and
``data-front`` so tests and scripts can read the picture back. Options that fit
nowhere are named below the plot. Built with :mod:`xml.etree.ElementTree`, so it is
well-formed whatever the labels hold.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence

from alpajob.api.what_if import WhatIfRow

SVG_NS = "http://www.w3.org/2000/svg"
WIDTH, HEIGHT = 900, 560
LEFT, RIGHT, TOP, BOTTOM = 90, 170, 50, 90
FRONT = "#e15759"
OTHER = "#4e79a7"


def _cost(row: WhatIfRow, priced: bool) -> float:
    value = row.dollars if priced else row.gpu_hours
    assert value is not None, "only fitting rows are drawn"
    return value


def _hours(row: WhatIfRow, steps: int) -> float:
    assert row.step_seconds is not None, "only fitting rows are drawn"
    return steps * row.step_seconds / 3600.0


def pareto_front(points: Sequence[tuple[float, float]]) -> list[bool]:
    """For each (cost, time), whether no other point is at most as dear and at most as
    slow and better in one; equal points are all on the front."""
    return [not any(c <= cost and t <= time and (c < cost or t < time) for c, t in points)
            for cost, time in points]


def _el(parent: ET.Element, tag: str, text: str | None = None, **attrs: object) -> ET.Element:
    node = ET.SubElement(parent, tag, {k.rstrip("_").replace("_", "-"): str(v) for k, v in attrs.items()})
    if text is not None:
        node.text = text
    return node


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """``count`` evenly spaced values from ``low`` to ``high``."""
    return [low + (high - low) * k / (count - 1) for k in range(count)]


def _span(values: Sequence[float]) -> tuple[float, float]:
    """An axis range holding ``values`` with a margin (from 0 where they are all near it)."""
    low, high = min(values), max(values)
    margin = (high - low) * 0.08 or abs(high) * 0.1 or 1.0
    return max(0.0, low - margin), high + margin


def pareto_svg(rows: Sequence[WhatIfRow], steps: int, priced: bool, title: str) -> str:
    """The picture of the module docstring for ``rows`` (:class:`WhatIfRow`)."""
    fitting = [row for row in rows if row.fits]
    points = [(_cost(row, priced), _hours(row, steps)) for row in fitting]
    front = pareto_front(points)
    ET.register_namespace("", SVG_NS)
    svg = ET.Element(f"{{{SVG_NS}}}svg", {"width": str(WIDTH), "height": str(HEIGHT),
                                            "viewBox": f"0 0 {WIDTH} {HEIGHT}", "font-family": "sans-serif",
                                            "font-size": "12"})
    _el(svg, "rect", x=0, y=0, width=WIDTH, height=HEIGHT, fill="white")
    _el(svg, "text", title, x=LEFT, y=24, font_size=15, font_weight="bold")
    unit = "dollars" if priced else "GPU-hours"
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    if points:
        (x0, x1), (y0, y1) = _span([p[0] for p in points]), _span([p[1] for p in points])
    else:
        (x0, x1), (y0, y1) = (0.0, 1.0), (0.0, 1.0)

    def at(cost: float, hours: float) -> tuple[float, float]:
        return (LEFT + (cost - x0) / (x1 - x0) * plot_w, TOP + plot_h - (hours - y0) / (y1 - y0) * plot_h)

    _el(svg, "rect", x=LEFT, y=TOP, width=plot_w, height=plot_h, fill="none", stroke="#999")
    for value in _ticks(x0, x1):
        x, _ = at(value, y0)
        _el(svg, "line", x1=f"{x:.1f}", y1=TOP + plot_h, x2=f"{x:.1f}", y2=TOP + plot_h + 5, stroke="#999")
        _el(svg, "text", f"{value:,.3g}", x=f"{x:.1f}", y=TOP + plot_h + 19, text_anchor="middle")
    for value in _ticks(y0, y1):
        _, y = at(x0, value)
        _el(svg, "line", x1=LEFT - 5, y1=f"{y:.1f}", x2=LEFT, y2=f"{y:.1f}", stroke="#999")
        _el(svg, "text", f"{value:,.3g}", x=LEFT - 8, y=f"{y + 4:.1f}", text_anchor="end")
    _el(svg, "text", f"the whole job, {unit} (cheaper to the left)", x=LEFT + plot_w / 2, y=TOP + plot_h + 40,
        text_anchor="middle")
    _el(svg, "text", f"hours for {steps:,} steps (faster below)", x=20, y=TOP + plot_h / 2,
        text_anchor="middle", transform=f"rotate(-90 20 {TOP + plot_h / 2:.1f})")
    stairs = sorted(p for p, on in zip(points, front, strict=True) if on)
    if len(stairs) > 1:
        path = []
        for k, (cost, hours) in enumerate(stairs):
            x, y = at(cost, hours)
            if k:
                path.append(f"H {x:.1f} V {y:.1f}")
            else:
                path.append(f"M {x:.1f} {y:.1f}")
        _el(svg, "path", d=" ".join(path), fill="none", stroke=FRONT, stroke_dasharray="4 3")
    for row, (cost, hours), on in zip(fitting, points, front, strict=True):
        x, y = at(cost, hours)
        group = _el(svg, "g", class_="option", data_option=row.option.label, data_front=str(on).lower())
        figures = (f"{row.option.label}: step {row.step_seconds:.4g} s, {hours:,.2f} h for the job, "
                   f"{cost:,.2f} {unit}" + (f", MFU {row.mfu:.1%}" if row.mfu is not None else ""))
        _el(group, "title", figures)
        colour = FRONT if on else OTHER
        _el(group, "circle", cx=f"{x:.1f}", cy=f"{y:.1f}", r=6, stroke=colour, stroke_width=2,
            fill=colour if on else "white")
        _el(group, "text", row.option.label, x=f"{x + 9:.1f}", y=f"{y - 7:.1f}", fill="#333")
    legend_x = LEFT + plot_w + 16
    _el(svg, "circle", cx=legend_x, cy=TOP + 10, r=6, fill=FRONT, stroke=FRONT)
    _el(svg, "text", "Pareto front", x=legend_x + 12, y=TOP + 14)
    _el(svg, "circle", cx=legend_x, cy=TOP + 32, r=6, fill="white", stroke=OTHER, stroke_width=2)
    _el(svg, "text", "dearer or slower", x=legend_x + 12, y=TOP + 36)
    missing = [row.option.label for row in rows if not row.fits]
    if missing:
        _el(svg, "text", f"no plan fits: {', '.join(missing)}", x=LEFT, y=HEIGHT - 18, fill="#a33")
    return ET.tostring(svg, encoding="unicode")
