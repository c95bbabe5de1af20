"""Convolutions rewritten to NHWC/HWIO/NHWC (jaxga.convolution): same values, canonical programs."""

import re

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxga
from jaxga import convolution

# (dimension numbers, input shape, kernel shape, conv_general_dilated's keyword arguments)
CONFIGS = {
    "nhwc": (("NHWC", "HWIO", "NHWC"), (2, 9, 9, 4), (3, 3, 4, 6), {}),
    "nchw strided valid": (
        ("NCHW", "OIHW", "NCHW"),
        (2, 4, 9, 9),
        (6, 4, 3, 3),
        {"window_strides": (2, 2), "padding": "VALID"},
    ),
    "groups, dilated kernel, uneven padding": (
        ("NHWC", "HWIO", "NHWC"),
        (2, 9, 9, 4),
        (3, 3, 2, 6),
        {"window_strides": (2, 1), "padding": ((1, 2), (0, 1)), "rhs_dilation": (2, 2)},
    ),
    "depthwise, dilated input": (
        ("NHWC", "HWIO", "NHWC"),
        (2, 9, 9, 4),
        (3, 3, 1, 4),
        {"padding": ((1, 1), (2, 0)), "lhs_dilation": (2, 1)},
    ),
    "mixed layouts": (("NCHW", "HWIO", "NHWC"), (2, 4, 7, 9), (2, 3, 4, 5), {"padding": "SAME"}),
    "1d": (("NWC", "WIO", "NWC"), (2, 9, 4), (3, 4, 6), {"window_strides": (2,)}),
    "3d ncdhw": (("NCDHW", "OIDHW", "NCDHW"), (2, 3, 5, 6, 7), (4, 3, 2, 3, 2), {}),
}
GROUPS = {"groups, dilated kernel, uneven padding": 2, "depthwise, dilated input": 4}


def conv_value_and_grad(name):
    numbers, lhs_shape, rhs_shape, kwargs = CONFIGS[name]
    kwargs = {"window_strides": (1,) * (len(lhs_shape) - 2), "padding": "SAME", **kwargs}
    groups = GROUPS.get(name, 1)

    def loss(w, x):
        y = jax.lax.conv_general_dilated(
            x, w, dimension_numbers=numbers, feature_group_count=groups, **kwargs
        )
        return jnp.sum(jnp.sin(y)), y

    keys = jax.random.split(jax.random.key(0))
    w = jax.random.normal(keys[0], rhs_shape)
    x = jax.random.normal(keys[1], lhs_shape)
    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), (w, x)


def convolutions(jaxpr):
    """Every conv_general_dilated equation of ``jaxpr`` and of the jaxprs in its parameters."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "conv_general_dilated":
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found.extend(convolutions(sub))
    return found


# StableHLO's convolution layouts: [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f] is NHWC/HWIO/NHWC
HLO_LAYOUT = re.compile(r"dim_numbers = \[([^\]]*)\]x\[([^\]]*)\]->\[([^\]]*)\]")


def hlo_layouts(lowered):
    return HLO_LAYOUT.findall(lowered.as_text())


def is_canonical_hlo(layout):
    lhs, rhs, out = ([axis.strip() for axis in part.split(",")] for part in layout)
    spatial = [str(i) for i in range(len(lhs) - 2)]
    return lhs == out == ["b", *spatial, "f"] and rhs == [*spatial, "i", "o"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rewritten_convolutions_give_the_same_values_and_gradients(name):
    fun, args = conv_value_and_grad(name)
    rewritten = jaxga.canonical_convolutions(fun)
    chex.assert_trees_all_close(
        jax.jit(rewritten)(*args), jax.jit(fun)(*args), rtol=1e-5, atol=1e-5
    )
    found = convolutions(jax.make_jaxpr(rewritten)(*args).jaxpr)
    assert len(found) == 3 and all(map(convolution.is_canonical, found))
    assert all(map(is_canonical_hlo, hlo_layouts(jax.jit(rewritten).lower(*args))))


def test_convolutions_in_loops_jits_and_checkpoints_are_rewritten():
    def layer(x, w):
        y = jax.lax.conv(x, w, (1, 1), "SAME")  # NCHW, OIHW
        return jnp.tanh(y), None

    def loss(ws, x):
        body = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)
        x, _ = jax.lax.scan(jax.jit(body), x, ws)
        return jnp.mean(x**2)

    ws = 0.1 * jax.random.normal(jax.random.key(0), (3, 4, 4, 3, 3))
    x = jax.random.normal(jax.random.key(1), (2, 4, 8, 8))
    fun = jax.value_and_grad(loss, argnums=(0, 1))
    rewritten = jaxga.canonical_convolutions(fun)
    assert not all(map(convolution.is_canonical, convolutions(jax.make_jaxpr(fun)(ws, x).jaxpr)))
    found = convolutions(jax.make_jaxpr(rewritten)(ws, x).jaxpr)
    assert len(found) >= 3 and all(map(convolution.is_canonical, found))
    chex.assert_trees_all_close(
        jax.jit(rewritten)(ws, x), jax.jit(fun)(ws, x), rtol=1e-5, atol=1e-6
    )


def test_a_program_without_convolutions_is_left_as_it_is():
    jaxpr = jax.make_jaxpr(jax.grad(lambda w: jnp.sum(jnp.tanh(w) ** 2)))(jnp.ones(3)).jaxpr
    assert convolution.rewrite_jaxpr(jaxpr) is jaxpr


class CNN(nnx.Module):  # Flax's NNX MNIST tutorial model, as benchmarks/cnn_cpu.py
    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, (3, 3), rngs=rngs)
        self.linear = nnx.Linear(16 * 7 * 7, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.avg_pool(nnx.relu(self.conv1(x)), (2, 2), (2, 2))
        x = nnx.avg_pool(nnx.relu(self.conv2(x)), (2, 2), (2, 2))
        return self.linear(x.reshape(x.shape[0], -1))


def cnn_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@pytest.mark.parametrize("option", ["auto", True, False])
def test_nnx_cnn_in_four_microbatches_equals_the_whole_batch(option):
    model = CNN(nnx.Rngs(0))
    batch = {
        "x": jax.random.normal(jax.random.key(1), (16, 28, 28, 1)),
        "y": jax.random.randint(jax.random.key(2), (16,), 0, 10),
    }
    step = jaxga.value_and_grad(cnn_loss, num_microbatches=4, canonical_convolutions=option)
    expected = nnx.jit(nnx.value_and_grad(cnn_loss))(model, batch)
    chex.assert_trees_all_close(nnx.jit(step)(model, batch), expected, rtol=2e-5, atol=1e-6)
    layouts = hlo_layouts(jax.jit(step).lower(model, batch))
    rewritten = convolution.rewrites(option)
    assert len(layouts) == 5 and all(map(is_canonical_hlo, layouts)) == rewritten  # 2 + 3 back


def test_the_micro_batch_rewrite_reaches_a_remat_scan_in_the_loss():
    def loss(ws, x):
        def layer(w, x):
            return jnp.tanh(jax.lax.conv(x, w, (1, 1), "SAME"))  # NCHW, OIHW

        return jnp.mean(jaxga.remat_scan(layer, ws, x, policy="full") ** 2)

    ws = 0.1 * jax.random.normal(jax.random.key(0), (3, 4, 4, 3, 3))
    x = jax.random.normal(jax.random.key(1), (8, 4, 8, 8))
    step = jaxga.value_and_grad(loss, num_microbatches=2, canonical_convolutions=True)
    found = convolutions(jax.make_jaxpr(step)(ws, x).jaxpr)
    assert len(found) >= 3 and all(map(convolution.is_canonical, found))
    chex.assert_trees_all_close(
        jax.jit(step)(ws, x), jax.value_and_grad(loss)(ws, x), rtol=2e-5, atol=1e-6
    )


def test_remat_scan_can_rewrite_its_backward_convolutions():
    def loss(ws, x, scale, **options):
        def layer(w, x):  # closes over scale, which is differentiated
            return jnp.tanh(jax.lax.conv(x, w, (1, 1), "SAME")) * scale

        return jnp.mean(jaxga.remat_scan(layer, ws, x, segments=2, **options) ** 2)

    scale = jnp.float32(0.9)
    ws = 0.1 * jax.random.normal(jax.random.key(0), (4, 4, 4, 3, 3))
    x = jax.random.normal(jax.random.key(1), (2, 4, 8, 8))
    grad = jax.grad(loss, argnums=(0, 1, 2))
    rewritten = jax.grad(lambda *a: loss(*a, canonical_convolutions=True), argnums=(0, 1, 2))
    found = convolutions(jax.make_jaxpr(rewritten)(ws, x, scale).jaxpr)
    backward = [eqn for eqn in found if not convolution.is_canonical(eqn)]
    assert len(found) > 3 and not backward
    chex.assert_trees_all_close(rewritten(ws, x, scale), grad(ws, x, scale), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", ["cpu", None, 1, "yes"])
def test_the_option_is_true_false_or_auto(value):
    with pytest.raises(ValueError, match=r"`canonical_convolutions` must be True, False or 'auto'"):
        jaxga.accumulate(jnp.vdot, num_microbatches=2, canonical_convolutions=value)


def test_auto_rewrites_on_cpu_backends_only():
    assert convolution.rewrites("auto") == (jax.default_backend() == "cpu")
    assert [convolution.rewrites("auto", b) for b in ("cpu", "gpu", "tpu")] == [True, False, False]
    options = jaxga.accumulate(jnp.vdot, num_microbatches=2).options
    assert options.canonical_convolutions == "auto"


@pytest.mark.parametrize(
    "rewrite", [convolution.canonical_convolutions, convolution.canonical_backward]
)
def test_a_rewritten_function_keeps_its_name_and_a_jit_of_it_is_named_so(rewrite):
    def conv_loss(w, x):
        return jnp.sum(jax.lax.conv(x, w, (1, 1), "SAME") ** 2)

    rewritten = rewrite(conv_loss)
    assert rewritten.__name__ == "conv_loss" and rewritten.__wrapped__ is conv_loss
    lowered = jax.jit(rewritten).lower(jnp.ones((4, 3, 3, 3)), jnp.ones((2, 3, 8, 8)))
    assert re.search(r"module @jit_conv_loss\b", lowered.as_text())


def test_a_constant_output_comes_back_as_an_array():
    def constant(w):
        return 1.0

    value, grad = jaxga.canonical_convolutions(jax.value_and_grad(constant))(jnp.float32(2.0))
    assert isinstance(value, jax.Array) and float(value) == 1.0 and float(grad) == 0.0


def test_the_train_steps_take_the_option():
    def loss(params, batch, model_state, rng):
        return jnp.mean(batch * params), model_state

    assert jaxga.make_train_step(loss, 2).options.canonical_convolutions == "auto"
    step = jaxga.nnx_train_step(lambda m, x: m(x).mean(), 2, canonical_convolutions=False)
    assert step.options.canonical_convolutions is False
    with pytest.raises(ValueError, match="`canonical_convolutions` must be True, False or 'auto'"):
        jaxga.make_train_step(loss, 2, canonical_convolutions="yes")
