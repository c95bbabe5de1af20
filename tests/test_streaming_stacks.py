"""Streamed layer stacks of Equinox and Flax Linen modules (issue 48): the gradient of a
token-weighted loss over k micro-batches, the stack in pinned host memory, equals the
resident stack's bit for bit, and `jax.value_and_grad` of the whole batch to rounding."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxga

HOST = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
LAYERS, WIDTH, ROWS = 4, 8, 8


@pytest.fixture(autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def batch():
    x = jax.random.normal(jax.random.key(1), (ROWS, WIDTH))
    y = jax.random.normal(jax.random.key(2), (ROWS, WIDTH))
    weights = (jnp.arange(ROWS) % 3).astype(jnp.float32)  # rows of 0, 1 and 2 tokens
    return {"x": x, "y": y, "weights": weights}


def equinox_stack():
    """``LAYERS`` `eqx.nn.Linear` stacked by `eqx.filter_vmap`: (arrays, the static rest)."""
    keys = jax.random.split(jax.random.key(0), LAYERS)
    stack = eqx.filter_vmap(lambda key: eqx.nn.Linear(WIDTH, WIDTH, key=key))(keys)
    return eqx.partition(stack, eqx.is_array)


def linen_stack():
    """``LAYERS`` `nn.Dense` layers' params stacked on a leading axis, and the module."""
    dense = nn.Dense(WIDTH)
    keys = jax.random.split(jax.random.key(0), LAYERS)
    stacked = jax.vmap(lambda key: dense.init(key, jnp.ones(WIDTH))["params"])(keys)
    return stacked, dense


def loss_of(layer):
    """A token-weighted squared error after the stack, ``layer(params, h)`` each layer."""

    def loss(stack, batch, stream):
        h = jaxga.remat_scan(layer, stack, batch["x"], policy="full", stream=stream)
        errors = jnp.mean((h - batch["y"]) ** 2, axis=-1)
        return jaxga.Mean(jnp.sum(errors * batch["weights"]), jnp.sum(batch["weights"]))

    return loss


def equinox_layer(static):
    def layer(params, h):
        return jnp.tanh(jax.vmap(eqx.combine(params, static))(h))

    return layer


def linen_layer(dense):
    def layer(params, h):
        return jnp.tanh(dense.apply({"params": params}, h))

    return layer


@pytest.mark.parametrize("library", ["equinox", "linen"])
@pytest.mark.parametrize("k", [1, 4])
def test_a_streamed_stack_is_the_resident_stack_bit_for_bit(library, k):
    if library == "equinox":
        stack, static = equinox_stack()
        loss = loss_of(equinox_layer(static))
    else:
        stack, dense = linen_stack()
        loss = loss_of(linen_layer(dense))
    grad = jax.jit(jaxga.value_and_grad(loss, num_microbatches=k), static_argnums=2)
    value, grads = grad(jax.device_put(stack, HOST), batch(), True)
    resident_value, resident_grads = grad(stack, batch(), False)
    np.testing.assert_array_equal(np.asarray(value), np.asarray(resident_value))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(resident_grads), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert {x.sharding.memory_kind for x in jax.tree.leaves(grads)} == {"pinned_host"}

    def whole(stack):  # the reference: the whole batch's weighted mean, plain JAX
        mean = loss(stack, batch(), False)
        return mean.total / mean.count

    want_value, want_grads = jax.value_and_grad(whole)(stack)
    np.testing.assert_allclose(np.asarray(value), np.asarray(want_value), rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=1e-7)
