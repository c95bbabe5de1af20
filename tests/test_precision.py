"""Mixed precision: bfloat16 compute, float32 parameters, float32 accumulation.

The references are float32 computations at full precision on the whole batch; the
tolerances are bfloat16's (8 bits of mantissa: a relative rounding of 2⁻⁹ per operation).
At these sizes a bfloat16 sum stays within those tolerances too, so the tests that would
fail if a sum were silently kept in bfloat16 are the ``SMALL_STEPS`` ones at the end, one
per entry point, each with a bfloat16 accumulator as the control that does fail.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxga

BATCH, FEATURES, HIDDEN, CLASSES = 32, 16, 32, 8


def init():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (FEATURES, HIDDEN)) / np.sqrt(FEATURES),
        "w2": jax.random.normal(k2, (HIDDEN, CLASSES)) / np.sqrt(HIDDEN),
    }


def data(seed=1):
    kx, ky, kw = jax.random.split(jax.random.key(seed), 3)
    return {
        "x": jax.random.normal(kx, (BATCH, FEATURES)),
        "y": jax.random.randint(ky, (BATCH,), 0, CLASSES),
        # variable numbers of items per example, as padded tokens would give
        "w": jax.random.randint(kw, (BATCH,), 0, 4).astype(jnp.float32),
    }


def loss_in(dtype):
    """A weighted cross-entropy whose matrix products run in ``dtype``."""

    def loss(params, batch):
        h = jax.nn.gelu(batch["x"].astype(dtype) @ params["w1"].astype(dtype))
        logits = (h @ params["w2"].astype(dtype)).astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return jaxga.Mean.of(ce, where=batch["w"])

    return loss


def reference(params, batch):
    """float32 at full precision on the whole batch: the mathematics being approximated."""
    with jax.default_matmul_precision("highest"):
        return jax.value_and_grad(lambda p: loss_in(jnp.float32)(p, batch).value)(params)


def assert_close_at_bfloat16(actual, expected):
    """Within a few bfloat16 roundings of the float32 result, relative to each leaf's scale."""
    chex.assert_trees_all_equal_structs(actual, expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        scale = float(jnp.max(jnp.abs(e)))
        chex.assert_trees_all_close(np.asarray(a, np.float32), e, atol=2e-2 * scale, rtol=0)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_value_and_grad_in_bfloat16_matches_the_float32_full_batch(k):
    params, batch = init(), data()
    value, grads = jaxga.value_and_grad(loss_in(jnp.bfloat16), num_microbatches=k)(params, batch)
    expected_value, expected_grads = reference(params, batch)
    chex.assert_trees_all_equal_dtypes(grads, params)  # float32 master gradients
    assert_close_at_bfloat16(value, expected_value)
    assert_close_at_bfloat16(grads, expected_grads)


def test_multisteps_in_bfloat16_matches_the_float32_full_batch():
    params, batch = init(), data()
    k = 4
    micro = [jax.tree.map(lambda x, i=i: x[i::k], batch) for i in range(k)]
    tx = jaxga.MultiSteps(optax.sgd(1.0), every_k=k)
    state = tx.init(params)
    for b in micro:
        grads = jaxga.grad(loss_in(jnp.bfloat16), num_microbatches=1)(params, b)
        updates, state = tx.update(grads, state, params, weight=jnp.sum(b["w"]))
    _, expected_grads = reference(params, batch)
    assert_close_at_bfloat16(updates, jax.tree.map(jnp.negative, expected_grads))


def test_train_step_in_bfloat16_matches_the_float32_full_batch():
    params, batch = init(), data()

    def loss(params, batch, model_state, rng):
        return loss_in(jnp.bfloat16)(params, batch), model_state

    tx = optax.sgd(1.0)
    state = jaxga.TrainState.create(params=params, tx=tx)
    state, metrics = jaxga.make_train_step(loss, num_microbatches=4)(state, batch)
    expected_value, expected_grads = reference(params, batch)
    chex.assert_trees_all_equal_dtypes(state.params, params)
    assert_close_at_bfloat16(metrics["loss"], expected_value)
    assert_close_at_bfloat16(state.params, jax.tree.map(lambda p, g: p - g, params, expected_grads))


# One gradient of 1, then 63 of 1e-3, in bfloat16: a bfloat16 running sum stays at 1 (its
# spacing at 1 is 2⁻⁷), a float32 one reaches 1.063. The mean of the 64:
SMALL_STEPS = jnp.concatenate([jnp.ones(1), jnp.full(63, 1e-3)]).astype(jnp.bfloat16)
SMALL_STEPS_MEAN = (1.0 + 63e-3) / 64


def test_multisteps_accumulates_bfloat16_gradients_in_float32_by_default():
    def accumulate(**options):
        params = jnp.zeros((4,), jnp.bfloat16)
        tx = jaxga.MultiSteps(optax.sgd(-1.0), every_k=len(SMALL_STEPS), **options)
        state = tx.init(params)
        for g in SMALL_STEPS:
            updates, state = tx.update(jnp.full((4,), g), state, params)
        return state.acc_grads, updates

    # MultiSteps keeps a running mean, whose steps shrink as 1/n: in bfloat16 they fall
    # below its spacing long before the 64th call.
    exact = float(jnp.mean(SMALL_STEPS.astype(jnp.float32)))
    acc, mean = accumulate()
    assert acc.dtype == jnp.float32 and mean.dtype == jnp.bfloat16
    np.testing.assert_allclose(acc, exact, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(mean, np.float32), exact, rtol=2**-8)
    # An explicit bfloat16 accumulator is taken at its word, and loses the small steps:
    # the same check fails on it, which is what makes the one above mean something.
    lossy, _ = accumulate(accumulator_dtype=jnp.bfloat16)
    assert abs(float(lossy[0]) - exact) > 1e-3 * exact


def test_value_and_grad_accumulates_bfloat16_gradients_in_float32_by_default():
    def loss(w, batch):  # the gradient of micro-batch i is SMALL_STEPS[i]
        return jaxga.Mean(jnp.sum(w * batch[0]), jnp.ones((), jnp.float32))

    w = jnp.zeros((), jnp.bfloat16)
    grad = jaxga.grad(loss, num_microbatches=64)(w, SMALL_STEPS)
    np.testing.assert_allclose(float(grad), SMALL_STEPS_MEAN, rtol=1e-2)
    lossy = jaxga.grad(loss, num_microbatches=64, accumulator_dtype=jnp.bfloat16)(w, SMALL_STEPS)
    assert abs(float(lossy) - SMALL_STEPS_MEAN) > 0.05 * SMALL_STEPS_MEAN


def test_train_step_accumulates_bfloat16_gradients_in_float32_by_default():
    def loss(w, batch, model_state, rng):  # the gradient of micro-batch i is SMALL_STEPS[i]
        return jaxga.Mean(jnp.sum(w * batch[0]), jnp.ones((), jnp.float32)), model_state

    def trained(**options):
        params = jnp.zeros((), jnp.bfloat16)
        state = jaxga.TrainState.create(params=params, tx=optax.sgd(-1.0))
        step = jaxga.make_train_step(loss, num_microbatches=len(SMALL_STEPS), **options)
        state, _ = step(state, SMALL_STEPS)
        return float(state.params)

    np.testing.assert_allclose(trained(), SMALL_STEPS_MEAN, rtol=1e-2)
    lossy = trained(accumulator_dtype=jnp.bfloat16)
    assert abs(lossy - SMALL_STEPS_MEAN) > 0.05 * SMALL_STEPS_MEAN
