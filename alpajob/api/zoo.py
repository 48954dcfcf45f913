"""The zoo as a spec names it: each family's sizes, config keys and their ranges, and
its parameter count, without JAX.

``spec.model`` names a zoo model three ways: a family (``zoo: gpt``, its ``tiny``
size), a family and size (``zoo: gpt-2.6b``, or ``zoo: gpt`` with ``config: 2.6b``),
or either of those with a mapping of overrides (``config: {layers: 4}``).
:func:`resolve_zoo` turns that into a :class:`ZooModel`: the family, the name the
plan and the metrics show (``gpt-2.6b``, ``gpt-2.6b-custom`` when overridden) and the
whole config. Every key of an override is checked against its family: a key the
model does not read is refused, a value must be a number of the key's kind inside
its range (:mod:`alpajob.api.limits` says why each range ends where it does), and the
family's rules across keys hold (heads divide hidden; a Wide-ResNet depth the network
has blocks for). The CLI, the Python API, the webhook and the trainer's zoo
(:mod:`alpajob.trainer_image.zoo`, which builds the JAX model from the config) all
read the zoo from here, so they refuse the same configs with the same words.

:meth:`ZooModel.parameters` counts the model's parameters from its config, exactly
(the tests compare it with the built model's), which lets a spec's memory be bounded
before anything is traced (:func:`alpajob.api.validation.spec_problems`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from alpajob.api import limits
from alpajob.api.errors import ManifestError, Problem
from alpajob.api.limits import Limit

Config = Mapping[str, Any]


@dataclass(frozen=True)
class Key:
    """One config key: its kind, its smallest value (and why, when above 1), its limit."""

    limit: Limit
    least: float = 1
    why_least: str = ""
    real: bool = False  # a positive number (else a positive integer)

    def problem(self, field: str, value: Any) -> Problem | None:
        """What is wrong with ``value`` for this key, if anything."""
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if self.real and not (number and math.isfinite(value) and value > 0):
            return Problem(field, f"must be a positive number, got {value!r}")
        if not self.real and not (number and isinstance(value, int) and value > 0):
            return Problem(field, f"must be a positive integer, got {value!r}")
        if value < self.least:
            return Problem(field, f"must be at least {self.least:g} ({self.why_least}), got {value!r}")
        if value > self.limit.most:
            return Problem(field, self.limit.message(value))
        return None


@dataclass(frozen=True)
class ZooFamily:
    """A zoo family: its named sizes (``tiny`` the default), keys, rules and size."""

    name: str
    sizes: Mapping[str, Config]
    keys: Mapping[str, Key]
    rules: Callable[[Config], list[Problem]]
    count: Callable[[Config], int]

    @property
    def default(self) -> Config:
        """The family default: its ``tiny`` config."""
        return self.sizes["tiny"]


@dataclass(frozen=True)
class ZooModel:
    """A resolved zoo model: its family, the name it is shown by, its whole config."""

    family: ZooFamily
    name: str
    config: dict[str, Any]

    @property
    def parameters(self) -> int:
        """Its parameter count, from the config alone."""
        return self.family.count(self.config)


# --- GPT and MoE -------------------------------------------------------------------

#: Ratio of the MLP's inner width to ``hidden``: GPT's 4, the MoE suite's 8 (Alpa's).
GPT_MLP_FACTOR = 4
MOE_MLP_FACTOR = 8

_GPT_COMMON = {"seqLen": 1024, "vocab": 51200}
GPT_SIZES: dict[str, Config] = {
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "seqLen": 32, "vocab": 256},
    "350m": {"hidden": 1024, "layers": 24, "heads": 16, **_GPT_COMMON},
    "1.3b": {"hidden": 2048, "layers": 24, "heads": 32, **_GPT_COMMON},
    "2.6b": {"hidden": 2560, "layers": 32, "heads": 32, **_GPT_COMMON},
    "6.7b": {"hidden": 4096, "layers": 32, "heads": 32, **_GPT_COMMON},
    "15b": {"hidden": 5120, "layers": 48, "heads": 40, **_GPT_COMMON},
    "39b": {"hidden": 8192, "layers": 48, "heads": 64, **_GPT_COMMON},
}

_MOE_COMMON = {"seqLen": 1024, "vocab": 32000, "heads": 16, "expertGroupSize": 2048,
               "capacityFactor": 2.0}
MOE_SIZES: dict[str, Config] = {
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "seqLen": 32, "vocab": 256, "experts": 4,
             "expertGroupSize": 32, "capacityFactor": 2.0},
    "380m": {"hidden": 768, "layers": 8, "experts": 8, **_MOE_COMMON},
    "690m": {"hidden": 768, "layers": 8, "experts": 16, **_MOE_COMMON},
    "1.3b": {"hidden": 768, "layers": 16, "experts": 16, **_MOE_COMMON},
    "2.4b": {"hidden": 1024, "layers": 16, "experts": 16, **_MOE_COMMON},
    "10b": {"hidden": 1536, "layers": 16, "experts": 32, **_MOE_COMMON},
    "27b": {"hidden": 2048, "layers": 16, "experts": 48, **_MOE_COMMON},
    "70b": {"hidden": 2048, "layers": 32, "experts": 64, **_MOE_COMMON},
}

_TRANSFORMER_KEYS = {
    "hidden": Key(limits.WIDTH),
    "layers": Key(limits.LAYERS),
    "heads": Key(limits.HEADS),
    "seqLen": Key(limits.SEQ_LEN),
    "vocab": Key(limits.VOCAB, 2, "a vocabulary of one token leaves nothing to predict"),
}
_MOE_KEYS = {
    **_TRANSFORMER_KEYS,
    "experts": Key(limits.EXPERTS, 2, "top-2 gating picks two experts per token"),
    "expertGroupSize": Key(limits.GROUP_SIZE),
    "capacityFactor": Key(limits.CAPACITY_FACTOR, real=True),
}


def _heads_divide_hidden(config: Config) -> list[Problem]:
    hidden, heads = config["hidden"], config["heads"]
    if hidden % heads:
        return [Problem("spec.model.config.heads", f"heads={heads} must divide hidden={hidden}; "
                                                   "choose a divisor of hidden")]
    return []


def _embedding(config: Config) -> int:
    """Token and position embeddings (the LM head is tied to the first) and the final norm."""
    return (config["vocab"] + config["seqLen"]) * config["hidden"] + 2 * config["hidden"]


def _attention_and_norms(h: int) -> int:
    """q, k, v, o ``[h, h]`` with biases, and two layer norms."""
    return 4 * (h * h + h) + 2 * 2 * h


def _gpt_count(config: Config) -> int:
    """``layers * (12 h^2 + 13 h) + (vocab + seqLen) h + 2 h``."""
    h, f = config["hidden"], GPT_MLP_FACTOR * config["hidden"]
    layer = _attention_and_norms(h) + (h * f + f) + (f * h + h)
    return config["layers"] * layer + _embedding(config)


def _moe_count(config: Config) -> int:
    """Even layers are GPT layers of MLP width ``8 h``; odd ones replace the MLP by a
    gate ``[h, e]`` and ``e`` experts of that MLP."""
    h, e, f = config["hidden"], config["experts"], MOE_MLP_FACTOR * config["hidden"]
    mlp = (h * f + f) + (f * h + h)
    dense, sparse = (config["layers"] + 1) // 2, config["layers"] // 2
    return (dense * (_attention_and_norms(h) + mlp)
            + sparse * (_attention_and_norms(h) + h * e + e * mlp) + _embedding(config))


# --- Wide-ResNet ---------------------------------------------------------------------

#: Bottleneck blocks per stage of each depth the network is built for.
STAGE_BLOCKS: dict[int, tuple[int, int, int, int]] = {
    14: (1, 1, 1, 1),
    26: (2, 2, 2, 2),
    38: (3, 3, 3, 3),
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
    200: (3, 24, 36, 3),
}

_WRESNET_COMMON = {"imageSize": 224, "numClasses": 1024}
WRESNET_SIZES: dict[str, Config] = {
    "tiny": {"layers": 14, "channels": 8, "widthFactor": 2, "imageSize": 32, "numClasses": 10},
    "250m": {"layers": 50, "channels": 160, "widthFactor": 2, **_WRESNET_COMMON},
    "500m": {"layers": 50, "channels": 224, "widthFactor": 2, **_WRESNET_COMMON},
    "1b": {"layers": 50, "channels": 320, "widthFactor": 2, **_WRESNET_COMMON},
    "2b": {"layers": 50, "channels": 448, "widthFactor": 2, **_WRESNET_COMMON},
    "4b": {"layers": 50, "channels": 640, "widthFactor": 2, **_WRESNET_COMMON},
    "6.8b": {"layers": 50, "channels": 320, "widthFactor": 16, **_WRESNET_COMMON},
    "13b": {"layers": 101, "channels": 320, "widthFactor": 16, **_WRESNET_COMMON},
}
_WRESNET_KEYS = {
    "layers": Key(Limit(max(STAGE_BLOCKS), "the deepest Wide-ResNet the zoo has blocks for")),
    "channels": Key(limits.CHANNELS),
    "widthFactor": Key(limits.WIDTH_FACTOR),
    "imageSize": Key(limits.IMAGE_SIZE, 32, "the network's total stride is 32"),
    "numClasses": Key(limits.CLASSES, 2, "one class leaves nothing to classify"),
}


def block_specs(config: Config) -> list[tuple[int, int, int]]:
    """``(in_channels, filters, stride)`` of every bottleneck block, in order: stage
    ``i`` has ``channels * 2**i`` filters and widens them 4 times on its way out; its
    first block strides 2 (but the first stage's)."""
    specs = []
    c_in = config["channels"]
    for stage, blocks in enumerate(STAGE_BLOCKS[config["layers"]]):
        filters = config["channels"] * 2**stage
        for j in range(blocks):
            specs.append((c_in, filters, 2 if stage > 0 and j == 0 else 1))
            c_in = 4 * filters
    return specs


def _wresnet_rules(config: Config) -> list[Problem]:
    if config["layers"] not in STAGE_BLOCKS:
        return [Problem("spec.model.config.layers", f"unsupported depth {config['layers']}; "
                                                    f"choose one of {', '.join(map(str, STAGE_BLOCKS))}")]
    return []


def _wresnet_count(config: Config) -> int:
    """A 7x7 stem, bottleneck blocks (1x1, 3x3 widened, 1x1 to 4x; a 1x1 projection
    where the shape changes), each conv followed by a norm, and a dense head."""
    width, c = config["widthFactor"], config["channels"]
    total = 7 * 7 * 3 * c + 2 * c
    for c_in, filters, _ in block_specs(config):
        mid, out = filters * width, 4 * filters
        total += c_in * filters + 2 * filters + 9 * filters * mid + 2 * mid + mid * out + 2 * out
        if c_in != out:
            total += c_in * out + 2 * out
    last = 4 * block_specs(config)[-1][1]
    return total + last * config["numClasses"] + config["numClasses"]


# --- MLP ---------------------------------------------------------------------------------

MLP_SIZES: dict[str, Config] = {"tiny": {"hidden": 32, "layers": 4, "inputDim": 16, "outputDim": 8}}
_MLP_KEYS = {"hidden": Key(limits.FEATURES), "layers": Key(limits.LAYERS),
             "inputDim": Key(limits.FEATURES), "outputDim": Key(limits.FEATURES)}


def mlp_layer_dims(config: Config) -> list[tuple[int, int]]:
    """The ``(d_in, d_out)`` of each dense layer: ``inputDim -> hidden ... -> outputDim``."""
    widths = [config["inputDim"]] + [config["hidden"]] * (config["layers"] - 1) + [config["outputDim"]]
    return list(zip(widths[:-1], widths[1:], strict=True))


def _mlp_count(config: Config) -> int:
    return sum(d_in * d_out + d_out for d_in, d_out in mlp_layer_dims(config))


def _no_rules(config: Config) -> list[Problem]:
    return []


#: The zoo (``alpajob models``): family name -> its sizes, keys, rules and size.
ZOO: dict[str, ZooFamily] = {
    "gpt": ZooFamily("gpt", GPT_SIZES, _TRANSFORMER_KEYS, _heads_divide_hidden, _gpt_count),
    "moe": ZooFamily("moe", MOE_SIZES, _MOE_KEYS, _heads_divide_hidden, _moe_count),
    "wresnet": ZooFamily("wresnet", WRESNET_SIZES, _WRESNET_KEYS, _wresnet_rules, _wresnet_count),
    "mlp": ZooFamily("mlp", MLP_SIZES, _MLP_KEYS, _no_rules, _mlp_count),
}


def _choices(values: Any) -> str:
    return ", ".join(str(v) for v in values)


def zoo_problems(zoo: Any, config: Any) -> tuple[ZooModel | None, list[Problem]]:
    """The model ``zoo`` and ``config`` name, or the problems that keep it from one."""
    if not isinstance(zoo, str) or not zoo.strip():
        return None, [Problem("spec.model.zoo", f"must be a family name: one of {_choices(ZOO)}")]
    family_name, _, size = zoo.strip().lower().partition("-")
    family = ZOO.get(family_name)
    if family is None:
        return None, [Problem("spec.model.zoo", f"unknown model family {family_name!r}; choose one "
                                                f"of {_choices(ZOO)}")]
    name, field = f"{family.name}-tiny", "spec.model.zoo"
    if size:
        name = f"{family.name}-{size}"
        if isinstance(config, str):
            return None, [Problem("spec.model.config", f"zoo {zoo!r} already names a size; drop config "
                                                       f"{config!r} or set zoo to {family.name!r}")]
    elif isinstance(config, str):
        size, field = config.strip().lower(), "spec.model.config"
        name = f"{family.name}-{size}"
    if size and size not in family.sizes:
        return None, [Problem(field, f"unknown {family.name} size {size!r}; choose one of "
                                     f"{_choices(family.sizes)}")]
    base = dict(family.sizes[size or "tiny"])
    if config is None or isinstance(config, str):
        return ZooModel(family, name, base), []
    if not isinstance(config, Mapping):
        return None, [Problem("spec.model.config", f"must be a size name ({_choices(family.sizes)}) or a "
                                                   f"mapping of overrides, got {type(config).__name__}")]
    problems = []
    for key, value in config.items():
        where = f"spec.model.config.{key}"
        spec = family.keys.get(key)
        if spec is None:
            problems.append(Problem(where, f"unknown {family.name} config key (the model reads only "
                                           f"{_choices(sorted(family.keys))}); remove it or check its spelling"))
        elif (problem := spec.problem(where, value)) is not None:
            problems.append(problem)
        else:
            base[key] = float(value) if spec.real else value
    if problems:
        return None, problems
    problems = family.rules(base)
    resolved = ZooModel(family, name if base == family.sizes[size or "tiny"] else f"{name}-custom", base)
    return (None, problems) if problems else (resolved, [])


def resolve_zoo(zoo: Any, config: Any = None) -> ZooModel:
    """The model ``zoo`` and ``config`` name; :class:`ManifestError` for its first problem."""
    model, problems = zoo_problems(zoo, config)
    if model is None:
        raise ManifestError(problems[0].field, problems[0].message)
    return model


def batch_problems(model: ZooModel, global_batch_size: int) -> list[Problem]:
    """What keeps ``model`` from a batch of ``global_batch_size``: a mixture of experts
    routes its tokens in groups of ``expertGroupSize``, so the batch's tokens (batch x
    seqLen) must fill whole groups. (The planner keeps only micro-batch counts whose
    micro-batches fill whole groups too; the whole batch is the one it cannot change.)"""
    group = model.config.get("expertGroupSize")
    if group is None:
        return []
    tokens = global_batch_size * model.config["seqLen"]
    if tokens % group == 0:
        return []
    fitting = group // math.gcd(group, model.config["seqLen"])  # the smallest batch that fills whole groups
    return [Problem("spec.training.globalBatchSize", (
        f"{global_batch_size} x seqLen {model.config['seqLen']} = {tokens:,} tokens do not fill whole "
        f"expert groups of expertGroupSize={group}; make the batch a multiple of {fitting}, or "
        "choose an expertGroupSize that divides the batch's tokens"))]
