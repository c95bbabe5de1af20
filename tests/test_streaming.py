"""Streaming a layer stack from host memory (issue 48): `remat_scan(stream=True)` and the
train step over host-resident parameters, bit for bit the resident ones on CPU."""

import functools
import math
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import jaxga
from jaxga import layouts, meshes
from jaxga.memory import program_counts

DEVICE = jax.devices()[0]
HOST = jax.sharding.SingleDeviceSharding(DEVICE, memory_kind="pinned_host")
ON_DEVICE = HOST.with_memory_kind("device")
LAYERS, DIM = 4, 8


def assert_equal(actual, expected):
    """Every leaf equal bit for bit (numpy copies: host and device arrays alike)."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def assert_rounding(actual, expected):
    """Every float leaf equal to float32 rounding, every other leaf equal. The update a layer
    at a time is another program, which XLA may fuse otherwise: bit for bit on jax 0.10; on
    jax 0.12, with a schedule (`inject_hyperparams`), a few ulp in the first update, carried
    by 3 steps into every leaf (an Adam moment near 0 by cancellation: its leaf's scale)."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        if np.issubdtype(a.dtype, np.floating):
            np.testing.assert_allclose(a, e, rtol=2e-6, atol=1e-6 * np.abs(e).max())
        else:
            np.testing.assert_array_equal(a, e)


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


def test_a_stack_in_host_memory_without_stream_is_named():
    """remat_scan on a stack in host memory without stream=True: named (JAX would fail in
    the layer's first matmul, on operands in two memories), eagerly and differentiated."""
    host_stack = jax.device_put(stacked_params(), HOST)
    with pytest.raises(ValueError, match=r"`stacked_params`\['b'\] lives in host memory: pass"):
        jaxga.remat_scan(block, host_stack, carry())
    with pytest.raises(ValueError, match=r"lives in host memory: pass stream=True"):
        jax.grad(lambda s: jaxga.remat_scan(block, s, carry())["h"].sum())(host_stack)


def test_an_empty_stack_streams_to_the_carry_as_the_resident_scan_does():
    """No layers: stream=True returns the carry and a gradient of no layers, as the
    resident scan does."""
    empty = jax.tree.map(lambda x: x[:0], stacked_params())

    def total(stack, stream):
        return jaxga.remat_scan(block, stack, carry(), stream=stream)["h"].sum()

    host = jax.device_put(empty, HOST)
    grads = jax.grad(total)(host, True), jax.grad(total)(empty, False)
    assert_equal(total(host, True), total(empty, False))
    assert jax.tree.map(jnp.shape, grads[0]) == jax.tree.map(jnp.shape, grads[1])


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


# The train step over a stack in host memory: a small decoder-ish model, token-weighted.

VOCAB, WIDTH, SEQ, ROWS = 11, 8, 6, 8


def model_params():
    k1, k3 = jax.random.split(jax.random.key(2))
    return {
        "embed": jax.random.normal(k1, (VOCAB, WIDTH)) / 2,
        "layers": stacked_params(LAYERS, WIDTH),
        "head": jax.random.normal(k3, (WIDTH, VOCAB)) / math.sqrt(WIDTH),
    }


def batch_of(step):
    key = jax.random.key(10 + step)
    tokens = jax.random.randint(key, (ROWS, SEQ + 1), 0, VOCAB)
    lengths = jnp.arange(ROWS) % SEQ + 1  # every row a different count of tokens
    mask = jnp.arange(SEQ)[None, :] < lengths[:, None]
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def token_losses(params, batch, *, stream, policy):
    h = params["embed"][batch["inputs"]]
    x = {"h": h, "sum": jnp.zeros_like(h)}
    out = jaxga.remat_scan(block, params["layers"], x, policy=policy, stream=stream)
    logits = (out["h"] + 0.1 * out["sum"]) @ params["head"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]


def step_loss(params, batch, model_state, rng, *, stream, policy):
    losses = token_losses(params, batch, stream=stream, policy=policy)
    return jaxga.Mean.of(losses, where=batch["mask"]), model_state


def optimizer():
    return optax.adamw(0.05, weight_decay=0.1)


def streamed(state):
    """``state`` with its stacked layers in pinned host memory."""
    return state.replace(
        params=state.params | {"layers": jax.device_put(state.params["layers"], HOST)}
    )


def train(k, policy, *, stream, offload=False, steps=2, tx=None):
    loss = functools.partial(step_loss, stream=bool(stream), policy=policy)
    step = jaxga.make_train_step(loss, k, stream=stream, offload=offload)
    state = jaxga.TrainState.create(params=model_params(), tx=tx or optimizer())
    state = streamed(state) if stream else state
    for i in range(steps):
        state, metrics = step(state, batch_of(i))
    return state, metrics


def reference(steps=2):
    """`jax.value_and_grad` of the whole batch's token mean, and optax."""

    def loss(params, batch):
        losses = token_losses(params, batch, stream=False, policy=None)
        return jnp.sum(losses * batch["mask"]) / jnp.sum(batch["mask"])

    params, tx = model_params(), optimizer()
    opt_state = tx.init(params)
    for i in range(steps):
        grads = jax.grad(loss)(params, batch_of(i))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, opt_state


@pytest.mark.parametrize("k, policy", [(1, "full"), (4, "full"), (4, "dots")])
def test_streamed_train_step_is_the_resident_step_bit_for_bit(k, policy):
    with jax.default_matmul_precision("highest"):
        state, metrics = train(k, policy, stream=True)
        resident, resident_metrics = train(k, policy, stream=False)
        params, opt_state = reference()
    assert_equal((state.params, state.opt_state), (resident.params, resident.opt_state))
    assert_equal(metrics, resident_metrics)
    assert kinds(state.params["layers"]) == {"pinned_host"}
    assert kinds((state.params["embed"], state.params["head"], state.opt_state)) == {"device"}
    for got, want in zip(
        jax.tree.leaves((state.params, state.opt_state)), jax.tree.leaves((params, opt_state))
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


def test_a_streamed_state_restored_by_orbax_trains_on_as_without_a_stop(tmp_path):
    """Orbax restores the stack into pinned host memory typed as device memory, which JAX's
    jit aborted the process on; the step copies such a leaf where it lies, typed as placed."""
    ocp = pytest.importorskip("orbax.checkpoint")
    loss = functools.partial(step_loss, stream=True, policy="full")
    step = jaxga.make_train_step(loss, 2, stream=True)
    state = streamed(jaxga.TrainState.create(params=model_params(), tx=optimizer()))
    for i in range(2):
        state, _ = step(state, batch_of(i))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", state)
        checkpointer.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    assert kinds(restored.params["layers"]) == {"pinned_host"}
    assert any(map(jaxga.steps.mistyped, jax.tree.leaves(restored.params["layers"])))
    for i in range(2, 4):
        restored, _ = step(restored, batch_of(i))
        state, _ = step(state, batch_of(i))
    assert kinds(restored.params["layers"]) == {"pinned_host"}
    assert_equal(restored.params, state.params)
    assert_equal(restored.opt_state, state.opt_state)


def test_a_restored_stack_typed_as_device_memory_is_taken(tmp_path):
    """The smallest case JAX's jit aborted the process on (a new user's): a stack of one leaf,
    its restored copy in pinned host memory typed as device memory, the step donating it."""
    ocp = pytest.importorskip("orbax.checkpoint")

    def loss(params, batch, model_state, rng):
        h = jaxga.remat_scan(lambda w, h: jnp.tanh(h @ w), params["layers"], batch, stream=True)
        return jaxga.Mean.of((h @ params["head"]) ** 2), model_state

    params = {"layers": jax.device_put(jnp.full((4, 8, 8), 0.1), HOST), "head": jnp.ones((8, 1))}
    state = jaxga.TrainState.create(params=params, tx=optax.adam(1e-2))
    step = jaxga.make_train_step(loss, 2, stream=True)
    state, _ = step(state, jnp.ones((4, 8)))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", state)
        checkpointer.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    restored, _ = step(restored, jnp.ones((4, 8)))
    state, _ = step(state, jnp.ones((4, 8)))
    assert_equal(restored.params, state.params)


def test_streamed_train_step_with_offload_keeps_both_on_the_host():
    state, _ = train(4, "full", stream=True, offload=True)
    resident, _ = train(4, "full", stream=False)
    assert_equal((state.params, state.opt_state), (resident.params, resident.opt_state))
    assert kinds(state.params["layers"]) == {"pinned_host"}
    assert kinds(state.opt_state) == {"pinned_host"}


@pytest.mark.parametrize("offload", [False, True])
def test_a_state_created_with_its_stack_in_host_memory_trains_as_the_resident_one(offload):
    """jaxga.TrainState.create on parameters whose float32 stack lives in pinned host
    memory (an eager optax init cannot make host arrays): the optimiser state on the
    device, as optax.adamw initialises it, where the step keeps it (offload=True moves it
    to host memory); the state then trains as the resident one, bit for bit."""
    params = model_params() | {"layers": jax.device_put(model_params()["layers"], HOST)}
    assert all(not x.weak_type for x in jax.tree.leaves(params["layers"]))  # float32 as made
    tx = optimizer()
    state = jaxga.TrainState.create(params=params, tx=tx)
    assert kinds(state.params["layers"]) == {"pinned_host"} and kinds(state.opt_state) == {"device"}
    assert state.tx is tx  # the transformation given, not the one that jitted its init
    assert_equal(state.opt_state, optimizer().init(model_params()))
    loss = functools.partial(step_loss, stream=True, policy="full")
    step = jaxga.make_train_step(loss, 4, stream=True, offload=offload)
    with jax.default_matmul_precision("highest"):
        for i in range(2):
            state, _ = step(state, batch_of(i))
        resident, _ = train(4, "full", stream=False)
    assert_equal((state.params, state.opt_state), (resident.params, resident.opt_state))
    assert kinds(state.opt_state) == {"pinned_host" if offload else "device"}


def test_a_step_without_stream_names_host_resident_params():
    state = streamed(jaxga.TrainState.create(params=model_params(), tx=optimizer()))
    loss = functools.partial(step_loss, stream=True, policy="full")
    for offload in (False, True):
        step = jaxga.make_train_step(loss, 2, offload=offload)
        message = (
            r"`state`.params\['layers'\]\['b'\] is in host memory \(pinned_host\): pass stream=True"
        )
        with pytest.raises(ValueError, match=message):
            step(state, batch_of(0))
    with pytest.raises(TypeError, match=r"`stream`"):
        jaxga.make_train_step(loss, 2, stream="yes")


@pytest.mark.parametrize("mesh", [None, jax.make_mesh((1,), ("data",))], ids=["device", "mesh"])
def test_stream_names_a_stack_in_unpinned_host_memory(mesh):
    """JAX streams from pinned host memory: a stack in unpinned host memory would be moved
    whole to the device (on a mesh) or abort the process (without one)."""
    state = jaxga.TrainState.create(params=model_params(), tx=optimizer())
    unpinned = HOST.with_memory_kind("unpinned_host")
    layers = jax.device_put(state.params["layers"], unpinned)
    state = state.replace(params=state.params | {"layers": layers})
    loss = functools.partial(step_loss, stream=True, policy="full")
    step = jaxga.make_train_step(loss, 2, stream=True, mesh=mesh)
    message = (
        r"`state`.params\['layers'\]\['b'\] is in host memory \(unpinned_host\); `stream` takes"
    )
    with pytest.raises(ValueError, match=message):
        step(state, batch_of(0))


def test_a_parameter_in_host_memory_read_outside_a_streamed_scan_is_named():
    """A leaf the loss reads whole in host memory (here the embedding and the head) gets
    JAX's error with a note naming the leaves there and what reads a stack there."""
    loss = functools.partial(step_loss, stream=True, policy="full")
    step = jaxga.make_train_step(loss, 2, stream=True)
    state = jaxga.TrainState.create(params=jax.device_put(model_params(), HOST), tx=optimizer())
    with pytest.raises(ValueError) as raised:  # JAX's own error, a memory space mismatch
        step(state, batch_of(0))
    (note,) = [n for n in raised.value.__notes__ if n.startswith("jaxga:")]
    assert "these lie in host memory: args[0]['embed'], args[0]['head'], args[0]['layers']" in note
    assert "through jaxga.remat_scan(..., stream=True)" in note


def test_create_runs_an_init_that_reads_the_parameters_on_a_stack_in_host_memory():
    """DoG's ``init`` computes on the parameters (its first distances): `TrainState.create`
    of parameters in host memory fetches them for it inside its jit (it was JAX's refusal
    to add a host array to a device one), and the streamed step from that state is the
    resident step from one made on the device, bit for bit."""
    tx = optax.contrib.dog(1.0)
    params = model_params()
    on_host = params | {"layers": jax.device_put(params["layers"], HOST)}
    state = jaxga.TrainState.create(params=on_host, tx=tx)
    resident = jaxga.TrainState.create(params=params, tx=tx)
    assert_equal(state.opt_state, resident.opt_state)
    assert kinds(state.params["layers"]) == {"pinned_host"}
    streamed_loss = functools.partial(step_loss, stream=True, policy="full")
    resident_loss = functools.partial(step_loss, stream=False, policy="full")
    with jax.default_matmul_precision("highest"):
        state, metrics = jaxga.make_train_step(streamed_loss, 2, stream=True)(state, batch_of(0))
        resident, resident_metrics = jaxga.make_train_step(resident_loss, 2)(resident, batch_of(0))
    assert_equal((state.params, state.opt_state), (resident.params, resident.opt_state))
    assert_equal(metrics, resident_metrics)


def test_create_keeps_a_stack_in_the_host_memory_it_was_given():
    """`TrainState.create` copies each parameter in its own memory, as Flax's keeps it: a
    stack in unpinned host memory stays there (it was moved to the device, silently, and
    every step then ran it resident), and the step names it."""
    unpinned = HOST.with_memory_kind("unpinned_host")
    params = model_params()
    params = params | {"layers": jax.device_put(params["layers"], unpinned)}
    state = jaxga.TrainState.create(params=params, tx=optimizer())
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.params["layers"])}
    assert kinds == {"unpinned_host"}
    assert state.params["head"].sharding.memory_kind == "device"
    loss = functools.partial(step_loss, stream=True, policy="full")
    step = jaxga.make_train_step(loss, 2, stream=True)
    with pytest.raises(ValueError, match=r"\(unpinned_host\); `stream` takes pinned_host alone"):
        step(state, batch_of(0))


@pytest.mark.parametrize("stream, offload", [(True, True), ("layers", True), ("layers", False)])
def test_streamed_step_on_a_one_device_mesh_is_the_step_without_one(stream, offload):
    """On a mesh (here one device; eight in tests/multidevice/dp_checks.py) each device
    streams its own copy of the stack, kept in host memory, its sum reduced a layer at a time;
    the step lays the state out once (the stack, first of its leaves, in host memory)."""
    loss = functools.partial(step_loss, stream=True, policy="full")
    results = []
    with jax.default_matmul_precision("highest"):
        for mesh in (None, jax.make_mesh((1,), ("data",))):
            step = jaxga.make_train_step(loss, 4, stream=stream, offload=offload, mesh=mesh)
            state = streamed(jaxga.TrainState.create(params=model_params(), tx=optimizer()))
            for i in range(2):
                state, metrics = step(state, batch_of(i))
            assert kinds(state.params["layers"]) == {"pinned_host"}
            assert kinds(state.opt_state) == {"pinned_host" if offload else "device"}
            results.append((state.params, state.opt_state, metrics))
    assert_equal(*results)


def test_a_state_laid_out_on_a_mesh_with_a_stack_first_is_not_laid_out_again():
    """A step lays the state out unless every leaf is laid out already: a stack in host
    memory is, where it lies; a leaf moved off the mesh by hand is not, and goes back."""
    mesh = jax.make_mesh((1,), ("data",))
    host = jax.NamedSharding(mesh, jax.P(), memory_kind="pinned_host")
    state = jaxga.TrainState.create(
        params={"a": jnp.ones((4, 3)), "b": jnp.ones(3)}, tx=optimizer()
    )
    state = state.replace(params=state.params | {"a": jax.device_put(state.params["a"], host)})
    layout = layouts.MeshLayout(mesh, "data", "data_parallel")
    state = layouts.lay_out(state, layout, offload_state=False)
    assert kinds(state.params["a"]) == {"pinned_host"} and kinds(state.params["b"]) == {"device"}
    assert layouts.lay_out(state, layout, offload_state=False) is state
    b = jax.device_put(state.params["b"], jax.devices()[0])
    moved = state.replace(params=state.params | {"b": b})
    again = layouts.lay_out(moved, layout, offload_state=False)
    assert isinstance(moved.params["b"].sharding, jax.sharding.SingleDeviceSharding)
    assert again.params["b"].sharding == jax.NamedSharding(mesh, jax.P())
    assert kinds(again.params["a"]) == {"pinned_host"}
    # a host leaf laid out as wanted, its spec spelt otherwise (P(None) for P()), keeps its
    # own sharding: with_memory_kind cannot set a described device's memory kind
    spelt = jax.device_put(state.params["a"], host.update(spec=jax.P(None)))
    assert meshes.in_memory_of(jax.NamedSharding(mesh, jax.P()), spelt) is spelt.sharding


@pytest.mark.parametrize(
    "options, message",
    [
        ({"strategy": "fsdp"}, r"`stream`=True on a mesh with `strategy`='fsdp': not supported; "),
        (
            {"strategy": "zero1"},
            r"with `strategy`='zero1': not supported; expected 'data_parallel', or specs that",
        ),
        ({"strategy": "zero3"}, r"with `strategy`='zero3': not supported; expected 'data_par"),
        ({"reduce_once": False}, r"needs reduce_once=True \(each stack's gradient sum reduced"),
        (
            {  # an Explicit one streams each stage's layers (tests/test_pipeline_streaming.py)
                "mesh": jax.make_mesh(
                    (1, 1), ("data", "stage"), axis_types=(jax.sharding.AxisType.Auto,) * 2
                ),
                "pipeline_axis": "stage",
            },
            r"with `pipeline_axis`='stage' on an Auto axis: not supported; expected an Explicit",
        ),
        (
            {"mesh": jax.make_mesh((1, 1), ("data", "model"))},
            r"streams data parallel only; got the mesh's axes \['model'\] beside `axis_name`",
        ),
        (
            {"stream": "auto", "num_microbatches": "auto", "memory_budget": "1GiB"},
            r"`stream`='auto' on a mesh: the plan",
        ),
        (  # said before the budget a CPU's "auto" needs: no budget makes it work
            {"stream": "auto", "num_microbatches": "auto"},
            r"`stream`='auto' on a mesh: the plan",
        ),
    ],
)
def test_stream_on_a_mesh_refuses_what_it_does_not_take(options, message):
    loss = functools.partial(step_loss, stream=True, policy="full")
    options = {
        "stream": True,
        "num_microbatches": 2,
        "mesh": jax.make_mesh((1,), ("data",)),
    } | options
    with pytest.raises(ValueError, match=message):
        jaxga.make_train_step(loss, **options)


def test_stream_on_a_mesh_refuses_a_split_stack():
    loss = functools.partial(step_loss, stream=True, policy="full")
    state = streamed(jaxga.TrainState.create(params=model_params(), tx=optimizer()))
    specs = jax.tree.map(lambda _: jax.P(), state.params)
    specs["layers"]["w"] = jax.P(None, "data")
    step = jaxga.make_train_step(loss, 2, stream=True, strategy=specs, axis_name="data")
    message = (
        r"`stream`: a stack in host memory, \[0\]\['layers'\]\['w'\] of the differentiated "
        r"arguments \(the first: a train step's parameters or model\), is split over the mesh by "
        r"(P|PartitionSpec)\(None, 'data'\); expected it replicated, P\(\)"
    )
    with pytest.raises(ValueError, match=message):
        step(state, batch_of(0))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.scale = nnx.Param(jnp.ones(WIDTH))

    def __call__(self, x):
        return x + jnp.tanh(self.up(x)) * self.scale


class Stack(nnx.Module):
    """Blocks stacked by ``nnx.vmap`` (a leading layer axis on every ``nnx.Param``)."""

    def __init__(self, rngs, stream):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return Block(rngs)

        self.blocks = blocks(rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)
        self.stream = stream

    def __call__(self, x):
        graphdef, stack = nnx.split(self.blocks)

        def layer(params, h):
            return nnx.merge(graphdef, params)(h)

        return self.head(jaxga.remat_scan(layer, stack, x, policy="dots", stream=self.stream))


def nnx_loss(model, batch):
    x = jax.nn.one_hot(batch["inputs"], WIDTH)
    return jaxga.token_cross_entropy(model(x), batch["targets"], batch["mask"])


@pytest.mark.parametrize("k", [1, 4])
def test_an_nnx_stack_streams_bit_for_bit(k):
    """An NNX model's ``nnx.vmap``-stacked blocks in host memory, their gradient (and its sums
    over k micro-batches) in host memory: equal to the resident model's."""
    results = []
    for stream in (False, True):
        model = Stack(nnx.Rngs(0), stream)
        if stream:
            nnx.update(model.blocks, jax.device_put(nnx.state(model.blocks), HOST))
        grad = jaxga.value_and_grad(nnx_loss, num_microbatches=k)
        results.append(nnx.jit(grad)(model, batch_of(0)))
    (value, grads), (resident_value, resident_grads) = results[1], results[0]
    assert_equal(
        (value, nnx.to_pure_dict(grads)), (resident_value, nnx.to_pure_dict(resident_grads))
    )
    assert kinds(nnx.to_pure_dict(grads)["blocks"]) == {"pinned_host"}
    assert kinds(nnx.to_pure_dict(grads)["head"]) == {"device"}


def _scan_carries(eqn):
    """A ``scan`` equation's carried inputs (jax <= 0.10: counted; newer: a flat tree)."""
    if "num_carry" in eqn.params:
        start = eqn.params["num_consts"]
        return eqn.invars[start : start + eqn.params["num_carry"]]
    return list(eqn.params["ft_in"].update(eqn.invars).unpack()[1])


def _host_carries(jaxpr):
    """The shapes of the host-memory carries of every ``scan`` in ``jaxpr`` (and inside)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found += [v.aval.shape for v in _scan_carries(eqn) if "<host>" in str(v.aval)]
    for sub in jax.extend.core.subjaxprs(jaxpr):
        found += _host_carries(sub)
    return found


def test_the_gradient_sums_of_streamed_params_live_in_host_memory():
    """The micro-batch loop carries the stacked layers' gradient sums in host memory."""
    loss = functools.partial(step_loss, stream=True, policy="full")
    step = jaxga.make_train_step(loss, 4, stream=True)
    state = streamed(jaxga.TrainState.create(params=model_params(), tx=optimizer()))
    carries = _host_carries(step.trace(state, batch_of(0)).jaxpr.jaxpr)
    stack = {x.shape for x in jax.tree.leaves(state.params["layers"])}
    assert stack <= set(carries), (stack, carries)


# The optimiser's update a layer at a time (`stream="layers"`).

SCHEDULE = optax.linear_schedule(0.05, 0.01, 3)
OPTIMIZERS = {
    "adamw": optimizer,
    "inject_hyperparams": functools.partial(
        optax.inject_hyperparams(optax.adam), learning_rate=SCHEDULE
    ),
    "multisteps": functools.partial(jaxga.MultiSteps, optimizer(), every_k=2),
}


def _moments(opt_state):
    """Adam's moments of the stacked layers (`offload=True` moves them, not a MultiSteps' sums)."""
    paths = [
        (jax.tree_util.keystr(path), x)
        for path, x in jax.tree_util.tree_leaves_with_path(opt_state)
    ]
    return [x for path, x in paths if "['layers']" in path and (".mu" in path or ".nu" in path)]


@pytest.mark.parametrize("offload", [False, True], ids=["resident_state", "offload"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("k", [1, 4])
def test_the_update_by_layer_is_the_resident_update_to_rounding(k, name, offload):
    tx = OPTIMIZERS[name]()
    state, metrics = train(k, "full", stream="layers", offload=offload, steps=3, tx=tx)
    resident, resident_metrics = train(k, "full", stream=False, steps=3, tx=tx)
    assert_rounding((state.params, state.opt_state), (resident.params, resident.opt_state))
    norm = metrics.pop("grad_norm"), resident_metrics.pop("grad_norm")
    np.testing.assert_allclose(*norm, rtol=1e-6)  # the squares summed a layer at a time
    assert_rounding(metrics, resident_metrics)
    assert kinds(state.params["layers"]) == {"pinned_host"}
    assert kinds(_moments(state.opt_state)) == {"pinned_host" if offload else "device"}
    assert kinds((state.params["embed"], state.params["head"])) == {"device"}


def _by_path(params):
    """`_multi_transform`'s labels, a function of the parameters' paths."""

    def label(path, _):
        return "sgd" if jax.tree_util.keystr(path).startswith("['embed']") else "adam"

    return jax.tree_util.tree_map_with_path(label, params)


def _multi_transform():
    """Leaves the embedding out of Adam's state (an ``optax.MaskedNode`` there): sgd for it."""
    return optax.multi_transform({"adam": optax.adam(0.05), "sgd": optax.sgd(0.1)}, _by_path)


def _tree_mask():
    """Adam's scaling masked by a tree to all but the embedding (an ``optax.MaskedNode`` in
    its moments there), whose gradient is taken as it is: sgd."""
    adam = jax.tree.map(lambda _: True, model_params()) | {"embed": False}
    return optax.chain(optax.masked(optax.scale_by_adam(), adam), optax.scale(-0.05))


# optimisers that leave some parameters out of a state (``optax.MaskedNode`` there)
PARTIAL = {"multi_transform": _multi_transform, "tree_mask": _tree_mask}


@pytest.mark.parametrize("name", sorted(PARTIAL))
def test_the_update_by_layer_takes_an_optimiser_that_leaves_parameters_out(name):
    """A state whose ``MaskedNode``s stand where a parameter is left out: updated a layer at a
    time, the resident update to rounding, its moments of the stack kept in host memory."""
    tx = PARTIAL[name]()
    state, metrics = train(4, "full", stream="layers", offload=True, steps=2, tx=tx)
    resident, resident_metrics = train(4, "full", stream=False, steps=2, tx=tx)
    assert_rounding((state.params, state.opt_state), (resident.params, resident.opt_state))
    np.testing.assert_allclose(
        metrics.pop("grad_norm"), resident_metrics.pop("grad_norm"), rtol=1e-6
    )
    assert_rounding(metrics, resident_metrics)
    assert _moments(state.opt_state) and kinds(_moments(state.opt_state)) == {"pinned_host"}


@pytest.mark.parametrize(
    "tx",
    [
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
        optax.lamb(1e-3),
        jaxga.MultiSteps(optax.adam(1e-3), every_k=2, should_skip_update_fn=jaxga.skip_not_finite),
        optax.chain(optax.add_noise(0.01, 0.55, 0), optax.sgd(1e-3)),  # a layer's noise drawn
    ],
    ids=["clip_by_global_norm", "lamb", "multisteps_skip_not_finite", "add_noise"],
)
def test_the_update_by_layer_refuses_an_optimiser_that_reduces_across_leaves(tx):
    message = (
        r'`stream`="layers" updates a layer at a time, exact only for an optimiser that '
        r"updates each element .* got .* a layer at a time; expected the whole-tree .*"
        r"build the step with stream=True \(the whole-tree update\)"
    )
    with pytest.raises(ValueError, match=message):
        train(1, "full", stream="layers", tx=tx, steps=1)
    train(1, "full", stream=True, tx=tx, steps=1)  # the whole-tree update takes it


@pytest.mark.skipif(not hasattr(optax.contrib, "muon"), reason="optax without contrib.muon")
def test_the_update_by_layer_names_an_optimiser_that_fails_on_a_layer_arithmetically():
    tx = optax.contrib.muon(1e-3)  # divides by a dimension of a stand-in with no elements
    message = r'`stream`="layers": `tx` fails on one layer \(division by zero\)'
    with pytest.raises(ValueError, match=message):  # was optax's bare ZeroDivisionError
        train(1, "full", stream="layers", tx=tx, steps=1)
    train(1, "full", stream=True, tx=tx, steps=1)  # the whole-tree update takes it


def _by_size(threshold):
    """A mask of the leaves of more than ``threshold`` elements."""
    return lambda params: jax.tree.map(lambda x: x.size > threshold, params)


def _complementary(threshold):
    """Two masked scales: 0.1 over ``threshold`` elements, 10 at or under it."""
    at_most = optax.masked(
        optax.scale(10.0), lambda ps: jax.tree.map(lambda x: x.size <= threshold, ps)
    )
    return optax.chain(
        optax.adam(0.05), optax.masked(optax.scale(0.1), _by_size(threshold)), at_most
    )


# masks by size that change only values: the state's structure is the same either way
BY_SIZE = {
    "weight_decay": lambda threshold: optax.adamw(0.05, weight_decay=0.5, mask=_by_size(threshold)),
    "learning_rate": lambda threshold: optax.chain(
        optax.adam(0.05), optax.masked(optax.scale(0.1), _by_size(threshold))
    ),
    "freeze": lambda threshold: optax.chain(
        optax.adam(0.05), optax.masked(optax.set_to_zero(), _by_size(threshold))
    ),
    "complementary": _complementary,
}


@pytest.mark.parametrize("name", sorted(BY_SIZE))
def test_the_update_by_layer_refuses_a_mask_by_size_that_changes_only_values(name):
    """The decoder's stack ``w`` (256 elements) is masked in, a layer of it (64) out: the
    probes (size 3 on each axis) agree and the state's structure is the same, so the update
    a layer at a time ran and differed from the whole-tree one; traced at the real sizes,
    ``w``'s new value is computed by other operations (a decay, a scale, zeros, another
    factor) whole than on a layer, and the step names the leaf and the fix."""
    message = (
        r'`stream`="layers" updates a layer at a time, and `tx` computes the new '
        r"params\['layers'\]\['w'\] \(a stack of 4 layers\) otherwise than each of its layers "
        r"\(traced at their sizes, not run\): (the stack's computation|a layer's) has .* that "
        r"(a layer's|the stack's) lacks.*; expected the same computation for the stack as for "
        r"each layer\. .* a mask or labels by .* give them by the parameters' paths; or build "
        r"the step with stream=True"
    )
    with pytest.raises(ValueError, match=message):
        train(1, "full", stream="layers", tx=BY_SIZE[name](100), steps=1)


def test_the_update_by_layer_refuses_a_reduction_the_probes_do_not_reach():
    """A clip by global norm switched on after the tenth update: the probes' four updates
    never clip, so they agree; traced at the real sizes, its norm sums over each stack's
    layer axis (a layer's, over its own elements), and the step refuses it."""
    late = optax.transforms.conditionally_transform(
        optax.clip_by_global_norm(1.0), lambda step: step > 10
    )
    tx = optax.chain(late, optax.adam(0.05))
    message = (
        r"\(a stack of 4 layers\) otherwise than each of its layers .*reduce_sum along "
        r"\(-3, -2, -1\) ×1.* Either `tx` reduces across a stack's layers or across leaves"
    )
    with pytest.raises(ValueError, match=message):
        train(1, "full", stream="layers", tx=tx, steps=1)
    train(1, "full", stream=True, tx=tx, steps=1)  # the whole-tree update takes it


@pytest.mark.parametrize("name", ["adam", "adan", "rprop"])
def test_a_stack_of_one_scalar_a_layer_is_taken_for_an_elementwise_optimiser(name):
    """A stack of shape (4,), a scalar a layer: jnp lays a constant out by a broadcast for the
    stack and uses it as it is for a layer's scalar (rprop's and adan's ``jnp.where``); the
    trace compares them alike, and the update a layer at a time equals the whole-tree one."""
    from jaxga._layerwise import updated_by_layer

    tx = {"adam": optax.adam(0.1), "adan": optax.adan(0.1), "rprop": optax.rprop(0.1)}[name]
    params = {"s": jnp.linspace(1.0, 2.0, 4), "w": jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)}
    grads = jax.tree.map(lambda x: jnp.cos(3.0 * x), params)
    state = jaxga.TrainState.create(params=params, tx=tx)
    access = jaxga.train._Flax(None, None, None).optimizer(state)
    got, want = state.replace(params=jax.device_put(state.params, HOST)), state
    for _ in range(2):  # rprop's second update reads the first's sign
        got = jax.jit(functools.partial(updated_by_layer, access))(got, grads)
        want = jax.jit(access.update)(want, grads)
    assert kinds(got.params) == {"pinned_host"}
    assert_rounding((got.params, got.opt_state), (want.params, want.opt_state))


def test_the_update_by_layer_takes_adam_with_bfloat16_moments():
    """Adam's first moment in bfloat16: a layer's update rounds as the stack's to within the
    probe's few ulps (it was refused, compared bit for bit, NaNs of bfloat16 unequal); a
    layer at a time, the resident update to rounding."""
    tx = optax.adam(0.05, mu_dtype=jnp.bfloat16)
    state, metrics = train(4, "full", stream="layers", offload=True, steps=2, tx=tx)
    resident, resident_metrics = train(4, "full", stream=False, steps=2, tx=tx)
    assert {x.dtype for x in jax.tree.leaves(state.opt_state[0].mu)} == {jnp.dtype(jnp.bfloat16)}
    assert_rounding((state.params, state.opt_state), (resident.params, resident.opt_state))
    assert_rounding(metrics, resident_metrics)


def test_the_operations_are_compared_leaf_by_leaf():
    """A decay mask by a band of sizes that takes the stack ``w`` (256 elements) out and its
    layers (64) in, and the stack ``v`` (64) in and its layers (16) out: counted over the
    whole update the two differences cancel; leaf by leaf, ``v``'s is found."""
    from jaxga._layerwise import check_same_operations, leaf_kinds

    band = functools.partial(jax.tree.map, lambda x: 50 < x.size <= 200)
    tx = optax.adamw(0.05, weight_decay=0.5, mask=band)
    params = {"v": jnp.ones((4, 16)), "w": jnp.ones((4, 8, 8))}
    state = jaxga.TrainState.create(params=params, tx=tx)
    access = jaxga.train._Flax(None, None, None).optimizer(state)
    kinds = leaf_kinds(tx, jax.device_put(params, HOST), state.opt_state)
    with pytest.raises(ValueError, match=r"computes the new params\['v'\] \(a stack of 4 layers\)"):
        check_same_operations(access, state, params, kinds)


@pytest.mark.parametrize("name", sorted(BY_SIZE))
def test_the_update_by_layer_takes_a_mask_by_size_that_a_stack_and_its_layers_agree_on(name):
    """Over 50 elements: ``w``'s stack (256) and its layers (64) both masked in, the other
    stacks (32) and layers (8) both out: updated a layer at a time, the resident update to
    rounding."""
    tx = BY_SIZE[name](50)
    state, metrics = train(4, "full", stream="layers", offload=True, steps=2, tx=tx)
    resident, resident_metrics = train(4, "full", stream=False, steps=2, tx=tx)
    assert_rounding((state.params, state.opt_state), (resident.params, resident.opt_state))
    assert_rounding(metrics, resident_metrics)


def test_the_update_moves_one_layer_at_a_time():
    """Read from the traced step (with `offload=True`): every move between memories, in the
    loss, the micro-batch loop and the update, is one layer's slice or a resident leaf, none
    a stack's shape; from the compiled step: the stack and its two moments are host-memory
    (``S(5)``) arguments and results."""
    loss = functools.partial(step_loss, stream=True, policy="full")
    step = jaxga.make_train_step(loss, 2, stream="layers", offload=True)
    state = streamed(jaxga.TrainState.create(params=model_params(), tx=optimizer()))
    traced = step.trace(jaxga.sharding.offload(state), batch_of(0))
    stacks = {x.shape for x in jax.tree.leaves(state.params["layers"])}
    moves = {shape for shape, _ in _device_puts(traced.jaxpr.jaxpr)}
    assert {shape[1:] for shape in stacks} <= moves and not moves & stacks, (moves, stacks)
    layout = traced.lower().compile().as_text().splitlines()[0]
    layout = layout.split("entry_computation_layout=")[1].split(", allow_spmd")[0]
    for shape in stacks:  # the stack, mu and nu; in and out
        dims = ",".join(map(str, shape))
        assert (
            layout.count(f"f32[{dims}]{{{','.join(map(str, range(len(shape))[::-1]))}:S(5)}}") >= 6
        )


def test_the_probe_gives_each_leaf_its_rank():
    """The elementwise probe's stand-ins keep each leaf's rank: a scalar parameter stays a
    scalar, a stack gets 2 layers."""
    from jaxga._layerwise import probe_like as _probe

    probe = _probe({"t": jnp.float32(1.0), "w": jnp.ones((4, 8)), "b": jnp.ones(4)}, 0)
    assert jax.tree.map(jnp.shape, probe) == {"t": (), "w": (2, 3), "b": (2,)}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.complex64])
def test_the_streamed_norm_is_optaxs_for_narrow_and_complex_stacks(dtype):
    """The `grad_norm` of a host-memory stack, summed a layer at a time: the layers' sums
    kept in float32 (a bfloat16 total drifts by 7 % over 256 layers) and a complex leaf's
    squares |x|², as `optax.tree.norm` computes them on the whole leaf."""
    from jaxga._host_stacks import global_norm

    values = jax.random.normal(jax.random.key(0), (256, 64)) * 0.02
    stack = values * (1 + 1j) if jnp.issubdtype(dtype, jnp.complexfloating) else values
    stack = stack.astype(dtype)
    got = jax.jit(global_norm)({"w": jax.device_put(stack, HOST)})
    want = optax.tree.norm({"w": stack})
    assert got.dtype == want.dtype
    np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=1e-2)


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_prefetching_changes_no_bit_and_moves_one_layer_more(policy):
    """remat_scan(stream=True) fetches each layer one iteration ahead (the default) or where
    it is used (prefetch=False): the same loss and gradients bit for bit (the resident
    scan's); forward and back, prefetching moves the two stacks and one layer more (the
    backward's last fetch, with no layer left to use it), read from the traced program."""
    params, x, shift = jax.device_put(stacked_params(), HOST), carry(), jnp.full((DIM,), 0.01)

    def grad_of(prefetch):
        def of(params, x, shift):
            def layer(p, c):
                return block(p, {"h": c["h"] + shift, "sum": c["sum"]})

            out = jaxga.remat_scan(layer, params, x, policy=policy, stream=True, prefetch=prefetch)
            return jnp.mean(jnp.sin(out["h"])) + jnp.mean(out["sum"] ** 2)

        return jax.jit(jax.value_and_grad(of, argnums=(0, 1, 2)))

    expected = jax.jit(
        jax.value_and_grad(functools.partial(loss, stream=False, policy=policy), argnums=(0, 1, 2))
    )(stacked_params(), x, shift)
    stack = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    layer = stack // jax.tree.leaves(params)[0].shape[0]
    for prefetch, fetched in [(True, 2 * stack + layer), (False, 2 * stack)]:
        assert_equal(grad_of(prefetch)(params, x, shift), expected)
        counts = program_counts(jax.make_jaxpr(grad_of(prefetch))(params, x, shift))
        assert counts.moved_bytes == fetched + stack  # and each layer's gradient written home


def test_prefetch_false_needs_stream():
    with pytest.raises(ValueError, match=r"`prefetch`=False applies to stream=True"):
        jaxga.remat_scan(block, stacked_params(), carry(), prefetch=False)
