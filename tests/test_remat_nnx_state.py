"""`jaxga.remat_scan` over stacked NNX blocks whose own state changes (a Dropout's RNG count,
a BatchNorm's statistics): refused, where the loop dropped the change silently; eval mode and
a key in the carry against `nnx.value_and_grad` and a Python loop over the micro-batches."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxga

HOST = "pinned_host"


class DropBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, h):
        return self.drop(jnp.tanh(self.linear(h)))


class NormBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)

    def __call__(self, h):
        return self.norm(jnp.tanh(self.linear(h)))


class Stack(nnx.Module):
    def __init__(self, block, rngs, stream=False):
        self.blocks = nnx.split_rngs(splits=3)(nnx.vmap(block, in_axes=(0,), out_axes=0))(rngs)
        self.stream = stream

    def __call__(self, x):
        graphdef, stack = nnx.split(self.blocks)

        def layer(params, h):
            return nnx.merge(graphdef, params)(h)

        return jaxga.remat_scan(layer, stack, x, stream=self.stream)


def loss(model, batch):
    return jaxga.Mean.of(model(batch) ** 2)


def on_host(model):  # the stack's parameters alone: JAX cannot donate PRNG keys in host memory
    where = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=HOST)
    nnx.update(model.blocks, jax.device_put(nnx.state(model.blocks, nnx.Param), where))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "block, variable",
    [
        (DropBlock, r"\['drop'\]\['rngs'\]\['count'\], an nnx.RngCount"),
        (NormBlock, r"\['norm'\]\['mean'\], an nnx.BatchStat"),
    ],
)
def test_a_layer_state_the_loop_would_drop_is_refused_naming_it(block, variable, stream):
    model = Stack(block, nnx.Rngs(0), stream=stream)
    if stream:
        on_host(model)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = jaxga.nnx_train_step(loss, 2, stream=stream)
    with pytest.raises(ValueError, match=rf"`layer_fn` updates stacked_params{variable}, which"):
        step(model, optimizer, jnp.ones((4, 8)))


@pytest.mark.parametrize("block", [DropBlock, NormBlock])
def test_in_eval_mode_the_stack_runs_and_equals_the_whole_batch(block):
    model = Stack(block, nnx.Rngs(0))
    model.eval()  # no draw, no statistics updated: nothing for the loop to carry
    batch = jax.random.normal(jax.random.key(1), (8, 8))
    with jax.default_matmul_precision("highest"):
        value, grads = jaxga.value_and_grad(loss, num_microbatches=4)(model, batch)
        expected, expected_grads = nnx.value_and_grad(lambda m, b: loss(m, b).value)(model, batch)
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


class KeyStack(nnx.Module):  # docs/batchnorm-dropout.md: dropout from a key in the carry
    def __init__(self, rngs):
        self.blocks = nnx.split_rngs(splits=3)(
            nnx.vmap(lambda r: nnx.Linear(8, 8, rngs=r), in_axes=(0,), out_axes=0)
        )(rngs)

    def __call__(self, x, key):
        graphdef, stack = nnx.split(self.blocks)

        def layer(params, carry):
            h, key = carry
            key, draw = jax.random.split(key)
            h = jnp.tanh(nnx.merge(graphdef, params)(h))
            return jnp.where(jax.random.bernoulli(draw, 0.5, h.shape), h / 0.5, 0.0), key

        return jaxga.remat_scan(layer, stack, (x, key))[0]


def test_a_key_in_the_carry_draws_each_micro_batch_its_own_mask():
    def key_loss(model, batch, key):
        return jaxga.Mean.of(model(batch, key) ** 2)

    model, key, k = KeyStack(nnx.Rngs(0)), jax.random.key(3), 4
    batch = jnp.tile(jax.random.normal(jax.random.key(1), (1, 8)), (8, 1))  # 8 equal rows
    with jax.default_matmul_precision("highest"):
        value, grads = jaxga.value_and_grad(key_loss, num_microbatches=k)(model, batch, key)
        reference = nnx.value_and_grad(lambda m, b, r: key_loss(m, b, r).value)
        parts = jaxga.split_microbatches(batch, k)
        refs = [reference(model, parts[i], jax.random.fold_in(key, i)) for i in range(k)]
    np.testing.assert_allclose(value, sum(r[0] for r in refs) / k, rtol=1e-6)
    for got, *want in zip(jax.tree.leaves(grads), *(jax.tree.leaves(r[1]) for r in refs)):
        np.testing.assert_allclose(got, sum(want) / k, rtol=1e-5, atol=1e-7)
    assert len({float(r[0]) for r in refs}) == k  # equal rows, a mask of its own each


def test_a_prng_key_moved_to_host_memory_is_refused_naming_it():
    model = Stack(DropBlock, nnx.Rngs(0), stream=True)
    where = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=HOST)
    nnx.update(model.blocks, jax.device_put(nnx.state(model.blocks), where))  # keys too
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = jaxga.nnx_train_step(loss, 2, stream=True)
    where = r"`model`\['blocks'\]\['drop'\]\['rngs'\]\['key'\]"
    message = where + r" is in host memory \(pinned_host\), a PRNG key"
    with pytest.raises(ValueError, match=message):  # JAX aborted the process on it
        step(model, optimizer, jnp.ones((4, 8)))


class EvalBlock(nnx.Module):  # frozen statistics, no dropout, and a dict-valued variable
    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, use_running_average=True, rngs=rngs)
        self.drop = nnx.Dropout(0.5, deterministic=True, rngs=rngs)
        self.extra = nnx.Variable({"scale": jnp.full(8, 0.5)})

    def __call__(self, h):
        return self.drop(self.norm(jnp.tanh(self.linear(h)))) * self.extra.get_value()["scale"]


@nnx.remat
def _remat_call(block, h):
    return block(h)


@nnx.jit
def _jit_call(block, h):
    return block(h)


@pytest.mark.parametrize("wrap", ["plain", "nnx.remat", "nnx.jit"])
def test_a_layer_an_nnx_transform_sets_anew_unchanged_is_taken(wrap):
    """``nnx.remat`` and ``nnx.jit`` set every variable anew, as it was: no change."""
    blocks = nnx.split_rngs(splits=3)(nnx.vmap(EvalBlock, in_axes=(0,), out_axes=0))(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(blocks, nnx.Param, ...)
    call = {"plain": lambda m, h: m(h), "nnx.remat": _remat_call, "nnx.jit": _jit_call}[wrap]

    def total(params, x, scanned):
        if scanned:
            layer = lambda p, h: call(nnx.merge(graphdef, *p), h)  # noqa: E731
            return jnp.sum(jaxga.remat_scan(layer, (params, rest), x))
        for i in range(3):  # the reference: a Python loop over the layers
            layer = jax.tree.map(lambda a, i=i: a[i], (params, rest))
            x = nnx.merge(graphdef, *layer)(x)
        return jnp.sum(x)

    x = jax.random.normal(jax.random.key(1), (4, 8))
    with jax.default_matmul_precision("highest"):
        got, want = jax.grad(total)(params, x, True), jax.grad(total)(params, x, False)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_changing_layer_under_an_nnx_transform_is_refused_still():
    blocks = nnx.split_rngs(splits=3)(nnx.vmap(DropBlock, in_axes=(0,), out_axes=0))(nnx.Rngs(0))
    graphdef, stack = nnx.split(blocks)
    with pytest.raises(ValueError, match=r"\['drop'\]\['rngs'\]\['count'\], an nnx.RngCount"):
        layer = lambda p, h: _remat_call(nnx.merge(graphdef, p), h)  # noqa: E731
        jaxga.remat_scan(layer, stack, jnp.ones((4, 8)))


def test_a_stacked_batchnorm_in_training_is_told_its_statistics_would_not_move():
    blocks = nnx.split_rngs(splits=3)(nnx.vmap(NormBlock, in_axes=(0,), out_axes=0))(nnx.Rngs(0))
    graphdef, stack = nnx.split(blocks)
    with pytest.raises(ValueError, match=r"the batch statistics would never move"):
        jaxga.remat_scan(lambda p, h: nnx.merge(graphdef, p)(h), stack, jnp.ones((4, 8)))
