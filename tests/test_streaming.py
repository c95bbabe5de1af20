"""Streaming a layer stack from host memory (issue 48): `remat_scan(stream=True)` and the
train step over host-resident parameters, bit for bit the resident ones on CPU."""

import functools
import math
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import jaxga

DEVICE = jax.devices()[0]
HOST = jax.sharding.SingleDeviceSharding(DEVICE, memory_kind="pinned_host")
ON_DEVICE = HOST.with_memory_kind("device")
LAYERS, DIM = 4, 8


def assert_equal(actual, expected):
    """Every leaf equal bit for bit (numpy copies: host and device arrays alike)."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def stacked_params(layers=LAYERS, dim=DIM):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return {
        "w": jax.random.normal(k1, (layers, dim, dim)) / math.sqrt(dim),
        "norm": {"g": 1 + 0.1 * jax.random.normal(k2, (layers, dim))},
        "b": 0.1 * jax.random.normal(k3, (layers, dim)),
    }


def block(p, carry):
    """A residual block with a pytree carry: the stream and a running sum of its outputs."""
    h = checkpoint_name(carry["h"] @ p["w"], "proj") + p["b"]
    h = carry["h"] + jnp.tanh(h) * p["norm"]["g"]
    return {"h": h, "sum": carry["sum"] + h}


def carry():
    h = jax.random.normal(jax.random.key(1), (3, 5, DIM))
    return {"h": h, "sum": jnp.zeros_like(h)}


def loss(params, x, shift, *, stream, policy):
    def layer(p, c):  # closes over `shift`, differentiated
        return block(p, {"h": c["h"] + shift, "sum": c["sum"]})

    out = jaxga.remat_scan(layer, params, x, policy=policy, stream=stream)
    return jnp.mean(jnp.sin(out["h"])) + jnp.mean(out["sum"] ** 2)


POLICIES = ["full", "dots", None, ["proj"], "offload_dots"]


@pytest.mark.parametrize("policy", POLICIES, ids=str)
@pytest.mark.parametrize("where", ["device", "pinned_host"])
def test_streamed_scan_is_the_resident_scan_bit_for_bit(policy, where):
    params, x, shift = stacked_params(), carry(), jnp.full((DIM,), 0.01)
    grad = functools.partial(jax.value_and_grad(loss, argnums=(0, 1, 2)), policy=policy)
    expected = jax.jit(functools.partial(grad, stream=False))(params, x, shift)
    placed = jax.device_put(params, HOST if where == "pinned_host" else ON_DEVICE)
    value, (g_params, g_x, g_shift) = jax.jit(functools.partial(grad, stream=True))(
        placed, x, shift
    )
    assert_equal((value, (g_params, g_x, g_shift)), expected)
    assert kinds(g_params) == {where}  # each layer's gradient written where its layer lives
    assert kinds((g_x, g_shift)) == {"device"}


def test_streamed_forward_alone_and_eagerly():
    params, x = stacked_params(), carry()
    expected = jaxga.remat_scan(block, params, x)
    assert_equal(jaxga.remat_scan(block, jax.device_put(params, HOST), x, stream=True), expected)
    run = jax.jit(functools.partial(jaxga.remat_scan, block, stream=True))
    out = run(jax.device_put(params, HOST), x)
    assert_equal(out, expected)
    assert kinds(out) == {"device"}


@pytest.mark.parametrize(
    "option, message",
    [
        ({"segments": 2}, r"`segments`=2 with stream=True: not supported; expected segments=1"),
        ({"segments": "sqrt"}, r"`segments`='sqrt' with stream=True: .* expected segments=1"),
        ({"unroll": True, "policy": None}, r"`unroll`=True with stream=True: .*unroll=False"),
        ({"canonical_convolutions": "auto"}, r"`canonical_convolutions`='auto' with stream"),
        ({"stream": 1}, r"`stream`"),
    ],
)
def test_stream_refuses_what_it_does_not_take(option, message):
    options = {"stream": True} | option
    with pytest.raises((ValueError, TypeError), match=message):
        jaxga.remat_scan(block, stacked_params(), carry(), **options)


def _device_puts(jaxpr):
    """Every ``device_put`` in ``jaxpr`` and its sub-jaxprs: (shape, destination)."""
    found = [
        (v.aval.shape, str(d))
        for eqn in jaxpr.eqns
        if eqn.primitive.name == "device_put"
        for v, d in zip(eqn.invars, eqn.params["devices"])
    ]
    for sub in jax.extend.core.subjaxprs(jaxpr):
        found += _device_puts(sub)
    return found


def test_the_stack_is_moved_a_layer_at_a_time_and_stays_in_host_memory():
    """Read from the traced program (each move is a layer's slice), the lowered program
    (the stack and its gradient are host-memory arguments and results), the compiled
    program (host memory space ``S(5)``) and its memory report (device temporaries below
    the stack's bytes)."""
    layers, dim = 16, 64
    params = jax.device_put(stacked_params(layers, dim), HOST)
    x = {"h": jnp.ones((2, 1, dim)), "sum": jnp.zeros((2, 1, dim))}
    grad = jax.jit(jax.grad(functools.partial(loss, stream=True, policy="full")))
    moves = _device_puts(jax.make_jaxpr(grad)(params, x, jnp.zeros(dim)).jaxpr)
    assert moves and {shape for shape, _ in moves} <= {(dim, dim), (dim,)}, moves
    assert {where for _, where in moves} == {"MemorySpace.Device", "MemorySpace.Host"}
    lowered = grad.lower(params, x, jnp.zeros(dim))
    head = re.search(r"func\.func public @main\((.*)", lowered.as_text()).group(1)
    assert head.count('mhlo.memory_kind = "pinned_host"') == 2 * len(jax.tree.leaves(params))
    compiled = lowered.compile()
    layout = compiled.as_text().splitlines()[0].split("entry_computation_layout=")[1]
    layout = layout.split(", allow_spmd")[0]
    assert layout.count("S(5)") == 2 * len(jax.tree.leaves(params)), layout
    stack = sum(x.nbytes for x in jax.tree.leaves(params))
    assert compiled.memory_analysis().temp_size_in_bytes < stack / 4
