"""`jaxga.sharding.init_offloaded(tx)`: the optimiser state made in pinned host memory, the
copies of a layer stack in host memory made a layer at a time, never whole on the device;
equal to `tx.init` bit for bit, and a state so made trains as one made on the device."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxga
from tests import test_streaming_nnx
from tests.test_streaming import (
    HOST,
    ON_DEVICE,
    OPTIMIZERS,
    _device_puts,
    assert_equal,
    batch_of,
    kinds,
    model_params,
    nnx_loss,
    step_loss,
)

INITS = OPTIMIZERS | {"schedule_free": lambda: optax.contrib.schedule_free_adamw(0.05)}


def host_params():
    """The test decoder's parameters, its layer stack in pinned host memory."""
    params = model_params()
    return params | {"layers": jax.device_put(params["layers"], HOST)}


def stack_paths(tree):
    """Whether each leaf of an optimiser state is a copy of the stack (its path names it)."""
    paths = jax.tree_util.tree_leaves_with_path(tree)
    return ["['layers']" in jax.tree_util.keystr(path) for path, _ in paths]


@pytest.mark.parametrize("select", [True, False])
@pytest.mark.parametrize("name", sorted(INITS))
def test_the_state_made_by_layer_is_txs_init_bit_for_bit(name, select):
    tx = INITS[name]()
    state = jaxga.sharding.init_offloaded(tx, select=select).init(host_params())
    want = tx.init(model_params())
    assert_equal(state, want)
    # each copy of the stack in host memory; the other leaves where `offload` puts them
    moved = jaxga.sharding.offload(want, select=select)
    expected = [
        "pinned_host" if stack else x.sharding.memory_kind
        for stack, x in zip(stack_paths(want), jax.tree.leaves(moved))
    ]
    assert [x.sharding.memory_kind for x in jax.tree.leaves(state)] == expected
    assert any(stack_paths(want))


def test_the_state_is_made_a_layer_at_a_time():
    """Read from the traced init (every move between memories one layer's slice or a leaf
    on the device, none of a stack's shape) and the compiled one (the moments of the stack
    host-memory results, ``S(5)``; its temporaries under a quarter of one stack)."""
    params = {"w": jax.device_put(jnp.ones((16, 64, 64)), HOST), "head": jnp.ones((64, 3))}
    init = jax.jit(jaxga.sharding.init_offloaded(optax.adam(0.1)).init)
    moves = {shape for shape, _ in _device_puts(jax.make_jaxpr(init)(params).jaxpr)}
    assert (64, 64) in moves and (16, 64, 64) not in moves, moves
    compiled = init.lower(params).compile()
    layout = compiled.as_text().splitlines()[0].split("->")[1]
    assert layout.count("f32[16,64,64]{2,1,0:S(5)}") == 2, layout  # mu and nu
    assert compiled.memory_analysis().temp_size_in_bytes < params["w"].nbytes / 4


@pytest.mark.parametrize("name", ["adamw", "multisteps"])
def test_a_state_made_in_host_memory_trains_as_one_made_on_the_device(name):
    """Three steps with `stream="layers"` and `offload=True` from a state made by
    `init_offloaded`, and from one made on the device with its stack moved after:
    equal bit for bit; the copies of the stack stay in host memory."""
    tx = OPTIMIZERS[name]()
    loss = functools.partial(step_loss, stream=True, policy="full")
    step = jaxga.make_train_step(loss, 4, stream="layers", offload=True)
    made = jaxga.TrainState.create(params=host_params(), tx=jaxga.sharding.init_offloaded(tx))
    moved = jaxga.TrainState.create(params=model_params(), tx=tx)
    moved = moved.replace(params=host_params())
    with jax.default_matmul_precision("highest"):
        for i in range(3):
            made, metrics = step(made, batch_of(i))
            moved, want = step(moved, batch_of(i))
    assert_equal((made.params, made.opt_state, metrics), (moved.params, moved.opt_state, want))
    copies = [x for s, x in zip(stack_paths(made.opt_state), jax.tree.leaves(made.opt_state)) if s]
    assert copies and kinds(copies) == {"pinned_host"}


def test_an_nnx_optimizer_is_made_in_host_memory_and_trains_as_one_made_on_the_device():
    """`nnx.Optimizer` runs `tx.init` eagerly, which JAX refuses on parameters in host
    memory; with `init_offloaded(tx)` it makes the moments there, and trains as the
    optimizer made before the blocks moved, bit for bit."""
    model = test_streaming_nnx.Stack(nnx.Rngs(0), stream=True)
    nnx.update(model.blocks, jax.device_put(nnx.state(model.blocks), HOST))
    tx = test_streaming_nnx.optimizer()
    opt = nnx.Optimizer(model, jaxga.sharding.init_offloaded(tx), wrt=nnx.Param)
    assert kinds(nnx.as_pure(opt.opt_state)) == {"pinned_host"}
    made, moved = (model, opt), test_streaming_nnx.model_and_optimizer("layers")
    step = jaxga.nnx_train_step(nnx_loss, 4, stream="layers", offload=True)
    with jax.default_matmul_precision("highest"):
        for i in range(2):
            got, want = step(*made, batch_of(i)), step(*moved, batch_of(i))
    states = [(nnx.state(m), nnx.as_pure(o.opt_state)) for m, o in (made, moved)]
    assert_equal((*states[0], got), (*states[1], want))
    assert kinds(test_streaming_nnx.moments(nnx.as_pure(opt.opt_state))) == {"pinned_host"}


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_the_state_of_a_stack_replicated_on_a_mesh_is_made_on_every_device(axis_type):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    replicated = jax.NamedSharding(mesh, jax.P(), memory_kind="pinned_host")
    params = jax.device_put(host_params(), replicated)
    state = jaxga.sharding.init_offloaded(optimizer_of("adamw")).init(params)
    assert_equal(state, optimizer_of("adamw").init(model_params()))
    for x in jax.tree.leaves(state):
        assert x.sharding.memory_kind == "pinned_host" and x.sharding.mesh == mesh
        assert x.sharding.is_fully_replicated


def optimizer_of(name):
    return OPTIMIZERS[name]()


def _centred(params):
    """A state made from all of a leaf's elements: each minus its leaf's mean."""
    return jax.tree.map(lambda x: x - jnp.mean(x), params)


@pytest.mark.parametrize(
    "tx, message",
    [
        (
            optax.GradientTransformation(_centred, optax.identity().update),
            r"jaxga.sharding.init_offloaded\(tx\) makes the state a layer at a time, exact "
            r"only .* `tx.init` is not: on a probe, the state's \['layers'\]\['b'\] got .* "
            r"expected the whole tree's .*: make it whole on the device",
        ),
        (
            optax.adafactor(1e-3),
            r"jaxga.sharding.init_offloaded\(tx\): optax.tree_utils.tree_map_params cannot "
            r"find the copies .* expected an optimiser whose state holds parameter-shaped",
        ),
    ],
    ids=["cross_layer", "factored"],
)
def test_init_offloaded_refuses_a_state_not_made_element_by_element(tx, message):
    with pytest.raises(ValueError, match=message):
        jaxga.sharding.init_offloaded(tx).init(host_params())
    on_device = jax.device_put(host_params(), ON_DEVICE)  # nothing to make by layer: offloaded
    assert kinds(jaxga.sharding.init_offloaded(tx).init(on_device)) == {"pinned_host"}


@pytest.mark.parametrize(
    "args, message",
    [
        ((3,), r"`tx` must be an optax GradientTransformation .* got 3"),
        ((optax.adam(0.1), "yes"), r"`select` must be a bool or a function of \(path, leaf\)"),
    ],
)
def test_init_offloaded_names_a_bad_argument(args, message):
    tx, *select = args
    with pytest.raises(TypeError, match=message):
        jaxga.sharding.init_offloaded(tx, **dict(zip(["select"], select)))
