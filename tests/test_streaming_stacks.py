"""Streamed layer stacks of Equinox and Flax Linen modules (issue 48): the gradient of a
token-weighted loss over k micro-batches, the stack in pinned host memory, equals the
resident stack's bit for bit, and `jax.value_and_grad` of the whole batch to rounding."""

import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
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


class EquinoxModel(eqx.Module):
    layers: eqx.nn.Linear  # LAYERS of them, stacked by `eqx.filter_vmap`
    head: eqx.nn.Linear

    def __init__(self, key):
        stack, head = jax.random.split(key)
        linear = eqx.filter_vmap(lambda k: eqx.nn.Linear(WIDTH, WIDTH, key=k))
        self.layers = linear(jax.random.split(stack, LAYERS))
        self.head = eqx.nn.Linear(WIDTH, 1, key=head)


def equinox_loss(model, batch, *, stream):
    """A token-weighted mean through the stack (``remat_scan``) and the head."""
    arrays, static = eqx.partition(model.layers, eqx.is_array)

    def layer(params, h):
        return jax.vmap(lambda row: jnp.tanh(eqx.combine(params, static)(row)))(h)

    h = jaxga.remat_scan(layer, arrays, batch["x"], stream=stream)
    losses = (jax.vmap(model.head)(h)[:, 0] - batch["y"][:, 0]) ** 2
    return jaxga.Mean(jnp.sum(losses * batch["weights"]), jnp.sum(batch["weights"]))


@pytest.mark.parametrize("stream", [False, True, "layers"])
def test_an_equinox_model_trains_streamed_through_make_train_step(stream):
    """The arrays of an Equinox model as a TrainState's params (``eqx.filter``), combined
    with the rest in the loss: 2 steps equal `eqx.filter_value_and_grad` of the whole batch
    and optax; ``stream=True`` the resident step bit for bit, ``"layers"`` to rounding."""
    model = EquinoxModel(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    tx = optax.adamw(0.05, weight_decay=0.1)

    def step_loss(params, batch, model_state, rng, *, stream):
        return equinox_loss(eqx.combine(params, static), batch, stream=stream), model_state

    def train(stream):
        state = params
        if stream:  # the stack in pinned host memory
            state = eqx.tree_at(lambda p: p.layers, params, jax.device_put(params.layers, HOST))
        state = jaxga.TrainState.create(params=state, tx=tx)
        loss = functools.partial(step_loss, stream=bool(stream))
        step = jaxga.make_train_step(loss, 4, stream=stream, offload=stream == "layers")
        for _ in range(2):
            state, _ = step(state, batch())
        return state.params

    got = train(stream)
    if stream:
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(got.layers)}
        assert kinds == {"pinned_host"}
    reference, opt_state = model, tx.init(params)
    for _ in range(2):
        grads = eqx.filter_grad(lambda m, b: equinox_loss(m, b, stream=False).value)(
            reference, batch()
        )
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(reference, eqx.is_array))
        reference = eqx.apply_updates(reference, updates)
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(eqx.filter(reference, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-5, atol=1e-6)
    if stream is True:
        resident = train(False)
        for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(resident)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def test_an_equinox_module_with_other_leaves_is_refused_naming_the_filter():
    mlp = eqx.nn.MLP(4, 1, width_size=8, depth=1, key=jax.random.key(0))  # holds functions
    message = r"holds an Equinox module .*eqx.filter\(model, eqx.is_inexact_array\)"
    with pytest.raises(TypeError, match=message):
        jaxga.TrainState.create(params=mlp, tx=optax.sgd(0.1))
    state = jaxga.TrainState.create(params=eqx.filter(mlp, eqx.is_inexact_array), tx=optax.sgd(0.1))
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(
        optax.sgd(0.1).init(state.params)
    )
