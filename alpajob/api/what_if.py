"""What-if planning: the options a user compares before renting GPUs, their prices, and
one row of figures per option.

``alpajob plan JOB --what-if SPEC...`` (and :func:`alpajob.what_if`) plans the job on
every option from one trace of its model. A ``SPEC`` names a device preset and one or
more GPU counts: ``h100-80gb:8,16,32`` is three options, 8, 16 and 32 H100s. A count
fills whole nodes of :data:`NODE_GPUS` GPUs (every GPU preset's node), or is one node's
share of a power of two below it (1, 2 or 4 GPUs: one smaller machine). ``cpu:N`` is N
CPU devices of one host (a power of two up to 16). ``h100-80gb:8+a100-40gb:16`` is one
option across two GPU types (:class:`WhatIfMix`): 8 H100s and 16 A100s, each pipeline
stage on GPUs of one type (one count per type; GPU presets only).

Prices are the user's, never the code's: a small YAML file (``--prices FILE``)::

    date: 2026-12-01
    source: the provider's on-demand price list, region us-east
    perGpuHour:
      h100-80gb: 4.10
      a100-80gb: 2.50

Every preset an option names needs a positive price there. :class:`WhatIfRow` holds
an option's figures; the dollar fields are None without prices.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import Field, PositiveFloat, ValidationError

from alpajob.api.catalog import DevicePreset
from alpajob.api.errors import ManifestError
from alpajob.api.limits import GPUS_PER_NODE, NODES
from alpajob.api.schema import Contract

#: GPUs per node of every GPU preset (the planner's presets say the same; tested).
NODE_GPUS = 8
#: The most options one ``--what-if`` plans.
MAX_OPTIONS = 64
#: The most GPUs one option may name: spec.cluster's most nodes, full.
MAX_GPUS = NODES.most * NODE_GPUS


@dataclass(frozen=True)
class WhatIfOption:
    """``gpus`` devices of preset ``gpu``, on ``nodes`` nodes of ``gpus_per_node``."""

    gpu: DevicePreset
    gpus: int

    @property
    def gpus_per_node(self) -> int:
        if self.gpu is DevicePreset.CPU:
            return self.gpus
        return min(self.gpus, NODE_GPUS)

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def label(self) -> str:
        """``16 x h100-80gb``, as the table and the JSON name the option."""
        return f"{self.gpus} x {self.gpu.value}"


@dataclass(frozen=True)
class WhatIfMix:
    """One option across GPU types: the pools ``parts`` (one preset each, in the
    order given), planned together, each pipeline stage on GPUs of one type."""

    parts: tuple[WhatIfOption, ...]

    @property
    def gpus(self) -> int:
        return sum(part.gpus for part in self.parts)

    @property
    def nodes(self) -> int:
        return sum(part.nodes for part in self.parts)

    @property
    def label(self) -> str:
        """``8 x h100-80gb + 16 x a100-40gb``."""
        return " + ".join(part.label for part in self.parts)


#: What ``--what-if`` names: one GPU type, or several.
Choice = WhatIfOption | WhatIfMix


def parse_options(specs: Sequence[str]) -> list[Choice]:
    """The options ``--what-if`` names (module docstring), in order, each once; a bad
    ``SPEC`` is a :class:`ManifestError` naming ``--what-if`` and the fix."""
    presets = ", ".join(p.value for p in DevicePreset)
    if not specs:
        raise ManifestError("--what-if", f"give at least one PRESET:COUNT[,COUNT...], e.g. h100-80gb:8,16 ({presets})")
    options: list[Choice] = []
    for spec in specs:
        if "+" in spec:
            options.append(_mix(spec))
            continue
        gpu, counts = _preset(spec, spec)
        for word in counts.split(","):
            options.append(_option(spec, gpu, word.strip()))
    unique = list(dict.fromkeys(options))
    if len(unique) > MAX_OPTIONS:
        raise ManifestError("--what-if", f"{len(unique)} options; at most {MAX_OPTIONS} at a time")
    return unique


def _preset(spec: str, part: str) -> tuple[DevicePreset, str]:
    """``part``'s preset and its counts (``PRESET:COUNTS``)."""
    name, colon, counts = part.partition(":")
    if not colon or not counts.strip():
        raise ManifestError("--what-if", f"{spec!r}: write PRESET:COUNT[,COUNT...], e.g. h100-80gb:8,16")
    try:
        return DevicePreset(name.strip()), counts
    except ValueError:
        presets = ", ".join(p.value for p in DevicePreset)
        raise ManifestError("--what-if", f"{spec!r}: unknown preset {name.strip()!r}; use one of: {presets}") from None


def _mix(spec: str) -> WhatIfMix:
    """``PRESET:COUNT+PRESET:COUNT[+...]``: one option across GPU types."""
    parts = []
    for part in spec.split("+"):
        gpu, counts = _preset(spec, part.strip())
        if "," in counts:
            raise ManifestError("--what-if", (
                f"{spec!r}: a mixed option names one count per GPU type, e.g. h100-80gb:8+a100-40gb:16 "
                "(give each mix as its own option)"))
        if gpu is DevicePreset.CPU:
            raise ManifestError("--what-if", f"{spec!r}: a mixed option is of GPU presets (cpu devices share one host)")
        parts.append(_option(spec, gpu, counts.strip()))
    if len({part.gpu for part in parts}) < len(parts):
        raise ManifestError("--what-if", f"{spec!r}: names a GPU type twice; give its GPUs as one count")
    if sum(part.gpus for part in parts) > MAX_GPUS:
        raise ManifestError("--what-if", f"{spec!r}: {sum(p.gpus for p in parts)} GPUs; at most {MAX_GPUS} per option")
    return WhatIfMix(tuple(parts))


def _option(spec: str, gpu: DevicePreset, word: str) -> WhatIfOption:
    if not word.isdigit() or int(word) < 1:
        raise ManifestError("--what-if", f"{spec!r}: {word!r} is not a GPU count (a whole number, at least 1)")
    gpus = int(word)
    if gpus > MAX_GPUS:
        raise ManifestError("--what-if", f"{spec!r}: {gpus} GPUs; at most {MAX_GPUS} per option")
    if gpu is DevicePreset.CPU:
        if gpus > GPUS_PER_NODE.most or gpus & (gpus - 1):
            raise ManifestError("--what-if", (
                f"{spec!r}: {gpus} CPU devices; one host's devices are a power of two up to "
                f"{GPUS_PER_NODE.most} (1, 2, 4, 8, 16), as spec.cluster.gpusPerNode"))
    elif gpus % NODE_GPUS and NODE_GPUS % gpus:
        lower, upper = gpus // NODE_GPUS * NODE_GPUS, (gpus // NODE_GPUS + 1) * NODE_GPUS
        near = f"{lower} or {upper}" if lower else f"{upper}, or 1, 2 or 4"
        raise ManifestError("--what-if", (
            f"{spec!r}: {gpus} GPUs do not fill whole nodes of {NODE_GPUS}; give {near}"))
    return WhatIfOption(gpu, gpus)


class Prices(Contract):
    """The user's price list (module docstring): dollars per GPU-hour by preset."""

    date: dt.date | str = Field(description="when the prices were read")
    source: str = Field(min_length=1, description="where they come from (a provider's page, a contract)")
    per_gpu_hour: dict[DevicePreset, PositiveFloat] = Field(min_length=1, description="$ per GPU-hour")

    def of(self, gpu: DevicePreset) -> float:
        return self.per_gpu_hour[gpu]


def load_prices(path: str | Path, options: Sequence[Choice]) -> Prices:
    """The price file ``path``, with a price for every preset of ``options``; a missing
    file, a malformed one, a missing or non-positive price: one error naming the field."""
    where = f"--prices {path}"
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise ManifestError("--prices", f"cannot read {path}: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise ManifestError("--prices", f"{path} is not YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(doc, dict):
        raise ManifestError("--prices", f"{path}: expected date, source and perGpuHour (a mapping)")
    try:
        prices = Prices.model_validate(doc)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "perGpuHour"
        raise ManifestError(f"{where}: {field}", str(first["msg"])) from None
    for choice in options:
        for option in choice.parts if isinstance(choice, WhatIfMix) else (choice,):
            if option.gpu not in prices.per_gpu_hour:
                raise ManifestError(f"{where}: perGpuHour", (
                    f"no price for {option.gpu.value} (option {choice.label}); add `{option.gpu.value}: "
                    "<dollars per GPU-hour>`"))
    return prices


@dataclass(frozen=True)
class WhatIfRow:
    """One option's figures. Without a fitting plan the time fields are None and
    ``required_bytes`` says what a GPU would need."""

    option: Choice
    fits: bool
    step_seconds: float | None = None
    samples_per_second: float | None = None
    tokens_per_second: float | None = None  # None for a model that reads no tokens
    mfu: float | None = None
    peak_memory_bytes: float | None = None
    memory_bytes: int = 0  # what one GPU has
    required_bytes: float | None = None  # what one GPU would need, where nothing fits
    gpu_hours: float | None = None  # the whole job: spec.training.steps steps
    dollars_per_hour: float | None = None
    dollars_per_billion_tokens: float | None = None
    dollars: float | None = None  # the whole job
    plan_hash: str | None = None
    cached: bool = False
    #: A mixed option's plan: each stage's layers and GPUs, and any type left unused.
    layout: str | None = None

    def to_json(self) -> dict[str, object]:
        """The row as ``--json`` prints it (camelCase keys, as the manifest's)."""
        option = self.option
        kind: dict[str, object] = (
            {"pools": [{"gpu": p.gpu.value, "gpus": p.gpus, "nodes": p.nodes, "gpusPerNode": p.gpus_per_node}
                       for p in option.parts], "gpus": option.gpus, "nodes": option.nodes}
            if isinstance(option, WhatIfMix) else
            {"gpu": option.gpu.value, "gpus": option.gpus, "nodes": option.nodes, "gpusPerNode": option.gpus_per_node})
        return {"option": option.label, **kind, "fits": self.fits,
                "stepSeconds": self.step_seconds, "samplesPerSecond": self.samples_per_second,
                "tokensPerSecond": self.tokens_per_second, "mfu": self.mfu,
                "peakMemoryBytes": self.peak_memory_bytes, "memoryBytes": self.memory_bytes,
                "requiredBytes": self.required_bytes, "gpuHours": self.gpu_hours,
                "dollarsPerHour": self.dollars_per_hour, "dollarsPerBillionTokens": self.dollars_per_billion_tokens,
                "dollars": self.dollars, "planHash": self.plan_hash, "cached": self.cached,
                **({"layout": self.layout} if self.layout is not None else {})}
