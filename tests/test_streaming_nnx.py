"""`jaxga.nnx_train_step(stream=...)`: an NNX model whose `nnx.vmap`-stacked blocks live in
pinned host memory trains as the resident model does (`True`: bit for bit; `"layers"`: to
float rounding), the streamed leaves kept in host memory."""

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxga
from jaxga import _layerwise
from tests.test_streaming import (
    HOST,
    Stack,
    _device_puts,
    assert_equal,
    assert_rounding,
    batch_of,
    kinds,
    nnx_loss,
    optimizer,
)


@pytest.fixture(autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def model_and_optimizer(stream, tx=None):
    """The test model (its blocks in pinned host memory if ``stream``) and its optimizer."""
    model = Stack(nnx.Rngs(0), stream=bool(stream))
    opt = nnx.Optimizer(model, tx or optimizer(), wrt=nnx.Param)
    if stream:
        nnx.update(model.blocks, jax.device_put(nnx.state(model.blocks), HOST))
    return model, opt


def train(k, *, stream, offload=False, steps=2, tx=None, mesh=None):
    model, opt = model_and_optimizer(stream, tx)
    step = jaxga.nnx_train_step(nnx_loss, k, stream=stream, offload=offload, mesh=mesh)
    for i in range(steps):
        metrics = step(model, opt, batch_of(i))
    return nnx.to_pure_dict(nnx.state(model)), nnx.as_pure(opt.opt_state), metrics


def reference(steps=2):
    """`nnx.value_and_grad` of the whole batch's token mean, and `nnx.Optimizer`."""
    model, opt = model_and_optimizer(False)
    for i in range(steps):
        grads = nnx.grad(lambda m, b: nnx_loss(m, b).value)(model, batch_of(i))
        opt.update(model, grads)
    return nnx.to_pure_dict(nnx.state(model)), nnx.as_pure(opt.opt_state)


def moments(opt_state):
    """Adam's moments of the stacked blocks."""
    paths = jax.tree_util.tree_leaves_with_path(opt_state)
    found = [x for p, x in paths if "'blocks'" in jax.tree_util.keystr(p)]
    return [x for x in found if x.ndim > 1]


@pytest.mark.parametrize("k, offload", [(1, False), (4, True)])
def test_stream_true_is_the_resident_step_bit_for_bit(k, offload):
    params, opt_state, metrics = train(k, stream=True, offload=offload)
    resident = train(k, stream=False)
    assert_equal((params, opt_state, metrics), resident)
    assert kinds(params["blocks"]) == {"pinned_host"}
    assert kinds(params["head"]) == {"device"}
    assert kinds(moments(opt_state)) == {"pinned_host" if offload else "device"}
    assert moments(opt_state) and int(metrics["count"]) == int(batch_of(1)["mask"].sum())
    want = reference()
    for got, expected in zip(jax.tree.leaves((params, opt_state)), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("k", [1, 4])
def test_stream_layers_is_the_resident_step_to_rounding(k, monkeypatch):
    probed = []
    check_same = _layerwise._check_same
    monkeypatch.setattr(_layerwise, "_check_same", lambda *a: probed.append(check_same(*a)))
    _layerwise._PROBED.clear()
    tx = optimizer()
    params, opt_state, metrics = train(k, stream="layers", offload=True, tx=tx)
    resident_params, resident_opt, resident_metrics = train(k, stream=False)
    assert_rounding((params, opt_state), (resident_params, resident_opt))
    norms = metrics.pop("grad_norm"), resident_metrics.pop("grad_norm")
    np.testing.assert_allclose(*norms, rtol=1e-6)  # the squares summed a layer at a time
    assert_rounding(metrics, resident_metrics)
    assert kinds(params["blocks"]) == kinds(moments(opt_state)) == {"pinned_host"}
    assert len(probed) == 8  # the probe's four updates from each start, at the one trace
    # A new step of the same `tx`, traced again: the probe is not rerun; no stack moves whole.
    model, opt = model_and_optimizer("layers", tx)
    step = jaxga.nnx_train_step(nnx_loss, 2, stream="layers", offload=True)
    traced = step.trace(model, opt, batch_of(0))
    assert len(probed) == 8
    stacks = {x.shape for x in jax.tree.leaves(nnx.state(model.blocks))}
    moves = {shape for shape, _ in _device_puts(traced.jaxpr.jaxpr)}
    assert {shape[1:] for shape in stacks} <= moves and not moves & stacks, (moves, stacks)


def test_stream_layers_takes_a_multi_transform_by_path():
    """Adam for the blocks, sgd for the rest (labels by path: an ``optax.MaskedNode`` in
    each group's state where the other's parameters are): a layer at a time, the resident
    step to rounding, the blocks' moments kept in host memory."""

    def labels(state):
        def label(path, _):
            return "adam" if "'blocks'" in jax.tree_util.keystr(path) else "sgd"

        return jax.tree_util.tree_map_with_path(label, state)

    tx = optax.multi_transform({"adam": optax.adam(0.05), "sgd": optax.sgd(0.1)}, labels)
    params, opt_state, metrics = train(4, stream="layers", offload=True, tx=tx)
    resident = train(4, stream=False, tx=tx)
    assert_rounding((params, opt_state, metrics), resident)
    assert moments(opt_state) and kinds(moments(opt_state)) == {"pinned_host"}


def test_stream_layers_refuses_a_weight_decay_mask_by_size():
    """The blocks' kernel stack (256 elements) decayed, a layer of it (64) not: the step
    names the stack and the fix, where it used to update a layer at a time otherwise than
    the resident step."""
    by_size = functools.partial(jax.tree.map, lambda x: x.size > 100)
    tx = optax.adamw(0.05, weight_decay=0.5, mask=by_size)
    message = (
        r"`tx` computes the new params\['blocks'\]\['up'\]\['kernel'\] \(a stack of 4 "
        r"layers\) otherwise than each of its layers .* give them by the parameters' paths; or "
        r"build the step"
    )
    with pytest.raises(ValueError, match=message):
        train(1, stream="layers", offload=True, tx=tx, steps=1)


def test_stream_true_on_a_one_device_mesh_is_the_step_without_one():
    """On a mesh (eight devices: tests/multidevice/dp_checks.py) each device streams its own
    copy of the blocks, kept in host memory, and reduces their sums a layer at a time."""
    params, opt_state, metrics = train(4, stream=True, offload=True, mesh=MESH)
    assert_equal((params, opt_state, metrics), train(4, stream=True, offload=True))
    assert kinds(params["blocks"]) == kinds(moments(opt_state)) == {"pinned_host"}


MESH = jax.make_mesh((1,), ("data",))


def test_stream_refuses_what_it_does_not_take():
    model, opt = model_and_optimizer(True)
    for offload in (False, True):
        step = jaxga.nnx_train_step(nnx_loss, 2, offload=offload)
        message = (
            r"`model`\['blocks'\]\['scale'\] is in host memory \(pinned_host\); expected on "
            r"the device: pass stream=True"
        )
        with pytest.raises(ValueError, match=message):
            step(model, opt, batch_of(0))
    with pytest.raises(ValueError, match=r"`stream`=True on a mesh with `strategy`='fsdp': not"):
        jaxga.nnx_train_step(
            nnx_loss, 2, stream=True, mesh=jax.make_mesh((1,), ("data",)), strategy="fsdp"
        )
    with pytest.raises(
        TypeError, match=r"`stream` must be False, True, 'layers' or 'auto'; got 'yes'"
    ):
        jaxga.nnx_train_step(nnx_loss, 2, stream="yes")
    model, opt = model_and_optimizer(True, optax.chain(optax.clip_by_global_norm(1.0), optimizer()))
    step = jaxga.nnx_train_step(nnx_loss, 1, stream="layers")
    with pytest.raises(ValueError, match=r"`stream`=\"layers\" updates a layer at a time, exact"):
        step.trace(model, opt, batch_of(0))
