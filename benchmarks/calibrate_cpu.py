"""Store a calibration of this machine as the planner's shipped ``cpu`` preset.

``alpajob calibrate`` measures the machine at hand and writes the constants to a file
that ``alpajob plan|run --calibration FILE`` applies (see
:mod:`alpajob.trainer_image.calibration` for what each step measures and fits). This
script runs the same steps and, with ``--write``, stores the fit as the ``cpu``
entries of ``planner/cost/data/presets.json`` and ``calibration.json`` (the other
presets' text is left as it is), so every plan made without ``--calibration`` uses it.

    python benchmarks/calibrate_cpu.py                       # print the fit
    python benchmarks/calibrate_cpu.py --write               # and store it
    python benchmarks/calibrate_cpu.py --steps matmul --write   # one step, on the stored rest

The steps run in the order kernels, matmul, host, update, instructions, fusion: each fits what the
ones before it leave unexplained, on the constants found so far.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

DATA = Path(__file__).resolve().parent.parent / "planner" / "cost" / "data"


def _number(value: Any) -> str:
    return format(value, ".4g") if isinstance(value, float) else json.dumps(value)


def _entry(entry: dict[str, Any]) -> str:
    """One preset entry in the files' style: a field per line, dicts on one line."""
    lines = []
    for key, value in entry.items():
        if isinstance(value, dict):
            text = "{" + ", ".join(f"{json.dumps(k)}: {_number(v)}" for k, v in value.items()) + "}"
        else:
            text = _number(value)
        lines.append(f"    {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(lines) + "\n  }"


def write(result: dict[str, Any]) -> None:
    """Replace the ``cpu`` entries of planner/cost/data/presets.json and calibration.json
    that ``result`` holds (the other presets' text is left as it is)."""
    for name, key in (("presets.json", "preset"), ("calibration.json", "calibration")):
        if key not in result:
            continue
        path = DATA / name
        text = path.read_text()
        entry = json.loads(text)["cpu"]
        for field, value in result[key].items():  # a dict (peak_flops) merged, not replaced
            entry[field] = {**entry.get(field, {}), **value} if isinstance(value, dict) else value
        start = text.index('"cpu": {') + len('"cpu": ')
        end = text.index("\n  }", start) + len("\n  }")
        path.write_text(text[:start] + _entry(entry) + text[end:])
        json.loads(path.read_text())  # still valid


def main() -> None:
    from alpajob.trainer_image.calibration import STEPS, calibrate

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="store the fit in planner/cost/data/")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"comma-separated steps (default all: {','.join(STEPS)})")
    args = parser.parse_args()
    measured = calibrate(tuple(args.steps.split(",")))
    result = {"preset": measured.device, "calibration": measured.calibration}
    print(json.dumps({**result, "machine": measured.machine.describe(),
                      "measurements": measured.measurements}, indent=1))
    if args.write:
        write(result)
        print(f"written to {DATA}/presets.json and calibration.json ('cpu' entries)")


if __name__ == "__main__":
    main()
