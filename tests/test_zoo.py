"""The model zoo: named configs, parameter counts, tiny models that train, errors."""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpajob.api.errors import ManifestError
from alpajob.trainer_image.zoo import ModelDef, list_models, resolve_model
from alpajob.trainer_image.zoo.model import synthetic_batch

#: Nominal parameter counts of the named configs (the number in the name).
NOMINAL = {
    "gpt-350m": 350e6,
    "gpt-1.3b": 1.3e9,
    "gpt-2.6b": 2.6e9,
    "gpt-6.7b": 6.7e9,
    "gpt-15b": 15e9,
    "gpt-39b": 39e9,
    "moe-380m": 380e6,
    "moe-690m": 690e6,
    "moe-1.3b": 1.3e9,
    "moe-2.4b": 2.4e9,
    "moe-10b": 10e9,
    "moe-27b": 27e9,
    "moe-70b": 70e9,
    "wresnet-250m": 250e6,
    "wresnet-500m": 500e6,
    "wresnet-1b": 1e9,
    "wresnet-2b": 2e9,
    "wresnet-4b": 4e9,
    "wresnet-6.8b": 6.8e9,
    "wresnet-13b": 13e9,
}
#: The largest config of each family: traced only in the slow suite.
LARGEST = {"gpt-39b", "moe-70b", "wresnet-13b"}
FAMILIES = ("gpt", "moe", "wresnet", "mlp")


def _named(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in LARGEST else n for n in names]


def test_list_models_names_every_size():
    names = list_models()
    assert set(NOMINAL) <= set(names)
    assert {f"{family}-tiny" for family in FAMILIES} <= set(names)
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name", sorted(NOMINAL))
def test_parameter_count_is_close_to_the_name(name):
    count = resolve_model(name).num_parameters()
    assert abs(count / NOMINAL[name] - 1) < 0.15, f"{name}: {count:.3e}"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("gpt-2.6b", {"hidden": 2560, "layers": 32, "heads": 32, "seqLen": 1024, "vocab": 51200}),
        ("gpt-39b", {"hidden": 8192, "layers": 48, "heads": 64, "seqLen": 1024, "vocab": 51200}),
        (
            "moe-10b",
            {"hidden": 1536, "layers": 16, "heads": 16, "experts": 32, "expertGroupSize": 2048,
             "seqLen": 1024, "vocab": 32000},
        ),
        ("wresnet-13b", {"layers": 101, "channels": 320, "widthFactor": 16, "imageSize": 224}),
    ],
)
def test_named_configs_match_the_benchmark_tables(name, expected):
    config = resolve_model(name).config
    assert {k: config[k] for k in expected} == expected


@pytest.mark.parametrize("name", _named(sorted(NOMINAL)))
def test_named_config_traces_abstractly(name):
    model = resolve_model(name)
    params = jax.eval_shape(model.init, jax.random.key(0))
    loss = jax.eval_shape(model.loss, params, model.batch_shapes(2))
    assert loss.shape == () and loss.dtype == jnp.float32


#: XLA CPU options for a step compiled to run once: skip the expensive LLVM passes.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_runs_one_training_step(family):
    model = resolve_model(family, "tiny")
    batch = synthetic_batch(model, 4, seed=1)
    # A real key; RBG compiles much faster than threefry on CPU.
    key = jax.random.key(0, impl="rbg")

    def init_and_grad(key, batch):
        return jax.value_and_grad(model.loss)(model.init(key), batch)

    compiled = jax.jit(init_and_grad).lower(key, batch).compile(compiler_options=FAST_COMPILE)
    loss, grads = compiled(key, batch)
    assert math.isfinite(float(loss))
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    assert any(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(grads))


def test_family_default_is_tiny_and_dict_overrides_apply():
    assert resolve_model("gpt").config == resolve_model("gpt", "tiny").config
    model = resolve_model("gpt", {"hidden": 128, "layers": 3})
    assert model.config["hidden"] == 128 and model.config["layers"] == 3
    assert model.config["heads"] == resolve_model("gpt").config["heads"]
    assert model.name == "gpt-tiny-custom" and model.family == "gpt"


def test_combined_names_and_case():
    a = resolve_model("GPT-2.6B")
    b = resolve_model("gpt", "2.6b")
    assert a.config == b.config and a.name == b.name == "gpt-2.6b"
    c = resolve_model("moe-380m", {"layers": 2})
    assert c.config["layers"] == 2 and c.config["experts"] == 8


def test_dtype_is_applied_to_parameters():
    model = resolve_model("mlp", None, dtype="bfloat16")
    leaves = jax.tree.leaves(model.param_shapes())
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.bfloat16)}
    assert model.dtype == "bfloat16"


def test_model_def_is_a_frozen_dataclass():
    model = resolve_model("mlp")
    assert isinstance(model, ModelDef)
    with pytest.raises(AttributeError):
        model.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("zoo", "config", "field", "mentions"),
    [
        ("bert", None, "spec.model.zoo", "gpt"),
        ("gpt-3b", None, "spec.model.zoo", "2.6b"),
        ("gpt", "3b", "spec.model.config", "2.6b"),
        ("gpt", {"width": 3}, "spec.model.config.width", "hidden"),
        ("gpt", {"hidden": -4}, "spec.model.config.hidden", "positive"),
        ("gpt", {"layers": 2.5}, "spec.model.config.layers", "positive"),
        ("gpt", {"layers": True}, "spec.model.config.layers", "positive"),
        ("gpt", {"hidden": 100, "heads": 3}, "spec.model.config.heads", "divide"),
        ("moe", {"capacityFactor": 0}, "spec.model.config.capacityFactor", "positive"),
        ("moe", {"experts": 1}, "spec.model.config.experts", "experts"),
        ("wresnet", {"layers": 51}, "spec.model.config.layers", "101"),
        ("gpt-2.6b", "350m", "spec.model.config", "already"),
        ("gpt", 7, "spec.model.config", "size"),
        ("", None, "spec.model.zoo", "gpt"),
    ],
)
def test_bad_model_specs_name_the_field(zoo, config, field, mentions):
    with pytest.raises(ManifestError) as info:
        resolve_model(zoo, config)
    assert info.value.field == field
    assert mentions in str(info.value)


def test_bad_dtype_names_the_field():
    with pytest.raises(ManifestError) as info:
        resolve_model("gpt", None, dtype="float8")
    assert info.value.field == "spec.training.dtype"


def test_moe_refuses_batches_that_do_not_fill_groups():
    model = resolve_model("moe", {"seqLen": 8, "expertGroupSize": 32})
    params = model.param_shapes()
    with pytest.raises(ValueError, match="expertGroupSize"):
        jax.eval_shape(model.loss, params, model.batch_shapes(3))


@pytest.mark.parametrize("name", ["relu", "gelu", "softmax_as", "normalize"])
def test_the_zoos_lean_derivatives_equal_the_formulas(name):
    """The zoo's activations and normalisation keep fewer residuals than their
    formulas differentiated as written (custom VJP/JVP rules); their gradients must be
    the formulas' all the same."""
    import numpy as np

    from alpajob.trainer_image.zoo import model as zoo

    def plain_normalize(x):
        mean = jnp.mean(x, axis=(0, 1), keepdims=True)
        var = jnp.mean((x - mean) ** 2, axis=(0, 1), keepdims=True)
        return (x - mean) / jnp.sqrt(var + 1e-5)

    lean, plain = {
        "relu": (zoo.relu, jax.nn.relu),
        "gelu": (zoo.gelu, lambda x: jax.nn.gelu(x, approximate=True)),
        "softmax_as": (lambda x: zoo.softmax_as(x, jnp.float32), lambda x: jax.nn.softmax(x, axis=-1)),
        "normalize": (lambda x: zoo.normalize(x, (0, 1)), plain_normalize),
    }[name]
    x = jax.random.normal(jax.random.key(0), (4, 6, 8), jnp.float32)
    weights = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)
    np.testing.assert_allclose(lean(x), plain(x), rtol=1e-5, atol=1e-6)
    grad_lean = jax.grad(lambda v: jnp.sum(lean(v) * weights))(x)
    grad_plain = jax.grad(lambda v: jnp.sum(plain(v) * weights))(x)
    np.testing.assert_allclose(grad_lean, grad_plain, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt", pytest.param("moe", marks=pytest.mark.slow)])
def test_per_part_init_equals_one_compiled_init_and_compiles_each_kind_of_layer_once(family):
    model = resolve_model(family, {"layers": 4})
    key = jax.random.key(3)
    per_part = model.init(key)
    whole = jax.jit(model.init)(key)  # every part traced into one program
    for a, b in zip(jax.tree.leaves(per_part), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    compiled = []

    class Count(logging.Handler):
        def emit(self, record):
            if "Finished XLA compilation of jit(" in record.getMessage():
                compiled.append(record.getMessage().split("jit(")[1].split(")")[0])

    handler = Count()
    logging.getLogger("jax").addHandler(handler)
    try:
        with jax.log_compiles():
            resolve_model(family, {"layers": 4}).init(jax.random.key(4))
    finally:
        logging.getLogger("jax").removeHandler(handler)
    kinds = {"gpt": 1, "moe": 2}[family]
    assert compiled.count("block_init" if family == "gpt" else "one") == kinds, compiled


def test_fused_attention_equals_the_written_out_one_values_and_gradients():
    from alpajob.trainer_image.zoo.gpt import attention_core

    q, k, v = (jax.random.normal(jax.random.key(i), (2, 16, 4, 8)) for i in range(3))

    def total(fused):
        return lambda q, k, v: (attention_core(q, k, v, fused=fused) ** 2).sum()

    np.testing.assert_allclose(attention_core(q, k, v, fused=True), attention_core(q, k, v, fused=False),
                               rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.grad(total(True), (0, 1, 2))(q, k, v), jax.grad(total(False), (0, 1, 2))(q, k, v),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
