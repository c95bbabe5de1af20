"""`jaxga.sharding.with_offloaded_init(tx)`: the optimiser state made in pinned host memory, the
copies of a layer stack in host memory made a layer at a time, never whole on the device;
equal to `tx.init` bit for bit, and a state so made trains as one made on the device. And
`jaxga.sharding.stacked_on_host`: a stack's parameters made there a layer at a time."""

import functools

import equinox
import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxga
from tests import test_streaming_nnx
from tests.test_streaming import (
    HOST,
    ON_DEVICE,
    OPTIMIZERS,
    PARTIAL,
    Block,
    Stack,
    _device_puts,
    assert_equal,
    batch_of,
    kinds,
    model_params,
    nnx_loss,
    step_loss,
    train,
)

INITS = OPTIMIZERS | {"schedule_free": lambda: optax.contrib.schedule_free_adamw(0.05)}
INITS |= PARTIAL


def host_params():
    """The test decoder's parameters, its layer stack in pinned host memory."""
    params = model_params()
    return params | {"layers": jax.device_put(params["layers"], HOST)}


def stack_paths(tree):
    """Whether each leaf of an optimiser state is a copy of the stack (its path names it)."""
    paths = jax.tree_util.tree_leaves_with_path(tree)
    return ["['layers']" in jax.tree_util.keystr(path) for path, _ in paths]


@pytest.mark.parametrize("name", sorted(INITS))
def test_the_state_made_by_layer_is_txs_init_bit_for_bit(name):
    tx = INITS[name]()
    state = jaxga.sharding.with_offloaded_init(tx).init(host_params())
    want = tx.init(model_params())
    assert_equal(state, want)
    # each copy of the stack in host memory; the other leaves where `offload` puts them
    moved = jaxga.sharding.offload(want)
    expected = [
        "pinned_host" if stack else x.sharding.memory_kind
        for stack, x in zip(stack_paths(want), jax.tree.leaves(moved))
    ]
    assert [x.sharding.memory_kind for x in jax.tree.leaves(state)] == expected
    assert any(stack_paths(want))
    if name == "multisteps":  # its sums, which `offload` leaves on the device
        assert "device" in expected


def test_the_state_is_made_a_layer_at_a_time():
    """Read from the traced init (every move between memories one layer's slice or a leaf
    on the device, none of a stack's shape) and the compiled one (the moments of the stack
    host-memory results, ``S(5)``; its temporaries under a quarter of one stack)."""
    params = {"w": jax.device_put(jnp.ones((16, 64, 64)), HOST), "head": jnp.ones((64, 3))}
    init = jax.jit(jaxga.sharding.with_offloaded_init(optax.adam(0.1)).init)
    moves = {shape for shape, _ in _device_puts(jax.make_jaxpr(init)(params).jaxpr)}
    assert (64, 64) in moves and (16, 64, 64) not in moves, moves
    compiled = init.lower(params).compile()
    layout = compiled.as_text().splitlines()[0].split("->")[1]
    assert layout.count("f32[16,64,64]{2,1,0:S(5)}") == 2, layout  # mu and nu
    assert compiled.memory_analysis().temp_size_in_bytes < params["w"].nbytes / 4


@pytest.mark.parametrize("name", ["adamw", "multisteps"])
def test_a_state_made_in_host_memory_trains_as_one_made_on_the_device(name):
    """Three steps with `stream="layers"` and `offload=True` from a state made by
    `with_offloaded_init`, and from one made on the device with its stack moved after:
    equal bit for bit; the copies of the stack stay in host memory."""
    tx = OPTIMIZERS[name]()
    loss = functools.partial(step_loss, stream=True, policy="full")
    step = jaxga.make_train_step(loss, 4, stream="layers", offload=True)
    made = jaxga.TrainState.create(params=host_params(), tx=jaxga.sharding.with_offloaded_init(tx))
    made_copies = [
        x for s, x in zip(stack_paths(made.opt_state), jax.tree.leaves(made.opt_state)) if s
    ]
    assert made_copies and kinds(made_copies) == {"pinned_host"}  # made there by `create`
    moved = jaxga.TrainState.create(params=model_params(), tx=tx)
    moved = moved.replace(params=host_params())
    with jax.default_matmul_precision("highest"):
        for i in range(3):
            made, metrics = step(made, batch_of(i))
            moved, want = step(moved, batch_of(i))
    assert_equal((made.params, made.opt_state, metrics), (moved.params, moved.opt_state, want))
    copies = [x for s, x in zip(stack_paths(made.opt_state), jax.tree.leaves(made.opt_state)) if s]
    assert copies and kinds(copies) == {"pinned_host"}


@pytest.mark.parametrize("jitted", [False, True], ids=["called", "inside_a_jit"])
@pytest.mark.parametrize("kind", ["flax", "nnx"])
def test_both_steps_name_a_state_in_host_memory_without_offload(kind, jitted):
    """The state `with_offloaded_init` makes needs `offload=True`: both steps say so, inside
    an enclosing `jax.jit` / `nnx.jit` too (the traced types say host memory)."""
    tx = jaxga.sharding.with_offloaded_init(OPTIMIZERS["adamw"]())
    if kind == "flax":
        state = jaxga.TrainState.create(params=host_params(), tx=tx)
        loss = functools.partial(step_loss, stream=True, policy="full")
        run = jaxga.make_train_step(loss, 2, stream="layers")
        run, args, where = jax.jit(run) if jitted else run, (state,), r"`state`.opt_state\[0\]"
    else:
        model = Stack(nnx.Rngs(0), stream=True)
        nnx.update(model.blocks, jax.device_put(nnx.state(model.blocks), HOST))
        run = jaxga.nnx_train_step(nnx_loss, 2, stream="layers")
        run = nnx.jit(run) if jitted else run
        args = (model, nnx.Optimizer(model, tx, wrt=nnx.Param))
        where = r"`optimizer.opt_state`\[0\]"
    with pytest.raises(ValueError, match=where + r".* is in host memory .*: pass offload=True"):
        run(*args, batch_of(0))


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_the_state_of_a_stack_replicated_on_a_mesh_is_made_on_every_device(axis_type):
    """Through `TrainState.create` (which jits `init`) as through `init` itself."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    replicated = jax.NamedSharding(mesh, jax.P(), memory_kind="pinned_host")
    params = jax.device_put(host_params(), replicated)
    tx = jaxga.sharding.with_offloaded_init(OPTIMIZERS["adamw"]())
    made = jaxga.TrainState.create(params=params, tx=tx).opt_state
    for state in (tx.init(params), made):
        assert_equal(state, OPTIMIZERS["adamw"]().init(model_params()))
        for x in jax.tree.leaves(state):
            assert x.sharding.memory_kind == "pinned_host" and x.sharding.mesh == mesh
            assert x.sharding.is_fully_replicated
    # a plain `tx`: `create` makes its state on the mesh's devices (it failed on Explicit
    # axes and made it on one device on Auto ones)
    plain = jaxga.TrainState.create(params=params, tx=OPTIMIZERS["adamw"]()).opt_state
    for x in jax.tree.leaves(plain):
        assert x.sharding.memory_kind == "device" and x.sharding.mesh == mesh


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_the_state_of_a_split_parameter_is_split_as_it(axis_type):
    """The embedding split over the mesh, the stack replicated in host memory: `create` and
    `with_offloaded_init` lay out the embedding's moments as the embedding (on Auto axes,
    where XLA would make them replicated, too), as eager optax does, in the memory each is
    made in; the values are `tx.init`'s bit for bit."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    on_mesh = functools.partial(jax.NamedSharding, mesh)
    params = host_params()
    where = {"embed": on_mesh(jax.P(None, "data")), "head": on_mesh(jax.P())}
    params = jax.device_put(params, where | {"layers": on_mesh(jax.P(), memory_kind="pinned_host")})
    tx = OPTIMIZERS["adamw"]()
    eager = tx.init({"embed": params["embed"]})[0].mu["embed"].sharding
    assert not eager.is_fully_replicated
    offloaded = jaxga.sharding.with_offloaded_init(tx).init(params)
    created = jaxga.TrainState.create(params=params, tx=tx).opt_state
    for state, kind in ((offloaded, "pinned_host"), (created, "device")):
        assert_equal(state, tx.init(model_params()))
        for moment in (state[0].mu, state[0].nu):
            assert moment["embed"].sharding.is_equivalent_to(eager.with_memory_kind(kind), 2)
            assert moment["head"].sharding.is_fully_replicated
            assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(moment["layers"]))


@pytest.mark.parametrize(
    "tx, split_copies",
    [
        (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1)), 2),  # mu, nu
        (optax.adafactor(1e-3), 0),  # its moments of the parameter: factored
        (optax.lbfgs(), 0),  # 2 copies and 2 histories, unmapped
    ],
    ids=["clipped_adam", "adafactor", "lbfgs"],
)
def test_create_on_auto_axes_lays_out_only_the_copies_of_a_parameter(tx, split_copies):
    """A split parameter on Auto axes beside a stack in host memory: `create` constrains a
    state leaf to the parameter's spec only where it is shaped as the parameter (not
    adafactor's factored moments), and leaves as XLA lays it out a state optax's
    ``tree_map_params`` cannot map (L-BFGS's); the values are `tx.init`'s either way."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    split = jax.NamedSharding(mesh, jax.P("data"))
    host = jax.NamedSharding(mesh, jax.P(), memory_kind="pinned_host")
    params = {"w": jnp.arange(128 * 256.0).reshape(128, 256) / 1e4, "stack": jnp.ones((2, 4, 4))}
    placed = jax.device_put(params, {"w": split, "stack": host})
    state = jaxga.TrainState.create(params=placed, tx=tx).opt_state
    assert_equal(state, tx.init(params))
    laid_out = [x for x in jax.tree.leaves(state) if x.sharding.is_equivalent_to(split, 2)]
    assert len(laid_out) == split_copies and all(x.shape == (128, 256) for x in laid_out)
    others = [x for x in jax.tree.leaves(state) if x.ndim and id(x) not in set(map(id, laid_out))]
    assert others and all(x.sharding.is_fully_replicated for x in others)


def test_a_mask_by_size_that_a_layer_falls_under_is_named_with_the_fix():
    """The decoder's stack of ``w`` (256 elements) is masked in, a layer of it (64) out: the
    probes (size 3 on each axis) pass, the step's update and `init` fail on a layer at the
    real sizes, and both errors say what to do (labels by path; the whole-tree update)."""
    tx = optax.masked(optax.adam(0.05), lambda ps: jax.tree.map(lambda x: x.size > 100, ps))
    fix = r"treat a layer.* unlike its stack: give them by the parameters' paths"
    with pytest.raises(
        ValueError, match=r'(?s)`stream`="layers": `tx` fails on one layer .*' + fix
    ):
        train(1, "full", stream="layers", tx=tx, steps=1)
    with pytest.raises(ValueError, match=r"(?s)layers apart .*stream=True; a mask .*" + fix):
        jaxga.sharding.with_offloaded_init(tx).init(host_params())


def test_with_offloaded_init_refuses_a_stack_split_over_a_mesh():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    params = jax.device_put(
        host_params(), jax.NamedSharding(mesh, jax.P(), memory_kind="pinned_host")
    )
    split = jax.NamedSharding(mesh, jax.P(None, "data"), memory_kind="pinned_host")
    params["layers"]["w"] = jax.device_put(params["layers"]["w"], split)
    message = (
        r"`params`\['layers'\]\['w'\], a stack in host memory, is split over the mesh by "
        r"(P|PartitionSpec)\(None, 'data'\); expected it replicated, P\(\)"
    )
    with pytest.raises(ValueError, match=message):
        jaxga.sharding.with_offloaded_init(optax.adam(0.1)).init(params)


def test_a_stack_of_no_layers_is_made_as_tx_init_makes_it():
    params = {"w": jax.device_put(jnp.ones((0, 3)), HOST), "h": jnp.ones(2)}
    state = jaxga.sharding.with_offloaded_init(optax.adam(0.1)).init(params)
    assert_equal(state, optax.adam(0.1).init(jax.device_put(params, ON_DEVICE)))
    assert kinds(state) == {"pinned_host"}


def _centred(params):
    """A state made from all of a leaf's elements: each minus its leaf's mean."""
    return jax.tree.map(lambda x: x - jnp.mean(x), params)


@pytest.mark.parametrize(
    "tx, message",
    [
        (
            optax.GradientTransformation(_centred, optax.identity().update),
            r"jaxga.sharding.with_offloaded_init\(tx\) makes the state a layer at a time, exact "
            r"only .* `tx.init` is not: on a probe, the state's \['layers'\]\['b'\] got .* "
            r"expected the whole tree's .*: make it whole on the device",
        ),
        (
            optax.adafactor(1e-3),
            r"jaxga.sharding.with_offloaded_init\(tx\): optax.tree_utils.tree_map_params cannot "
            r"find the copies .* expected an optimiser whose state holds parameter-shaped",
        ),
    ],
    ids=["cross_layer", "factored"],
)
def test_with_offloaded_init_refuses_a_state_not_made_element_by_element(tx, message):
    with pytest.raises(ValueError, match=message):
        jaxga.sharding.with_offloaded_init(tx).init(host_params())
    on_device = jax.device_put(host_params(), ON_DEVICE)  # nothing to make by layer: offloaded
    assert kinds(jaxga.sharding.with_offloaded_init(tx).init(on_device)) == {"pinned_host"}


def test_with_offloaded_init_refuses_a_state_whose_structure_follows_the_ranks():
    """A mask by rank: one layer of a stack (an axis fewer) gets another state's structure."""
    tx = optax.masked(optax.adam(0.1), lambda ps: jax.tree.map(lambda x: x.ndim > 1, ps))
    params = {
        "w": jax.device_put(jnp.ones((4, 6)), HOST),
        "b": jax.device_put(jnp.ones((4, 3)), HOST),
    }
    message = (
        r"with_offloaded_init\(tx\) makes the state a layer at a time; `tx.init` fails on a "
        r"stack's layers apart \(`tx.init` makes a state of another structure for one "
        r"layer .*\): make it whole on the device"
    )
    with pytest.raises(ValueError, match=message):
        jaxga.sharding.with_offloaded_init(tx).init(params)


def test_with_offloaded_init_names_a_bad_argument():
    with pytest.raises(TypeError, match=r"`tx` must be an optax GradientTransformation .* got 3"):
        jaxga.sharding.with_offloaded_init(3)
    init = jaxga.sharding.with_offloaded_init(optax.adam(0.1)).init
    message = r"`params\['w'\]` is 'hello' of type str; expected an array or a number"
    with pytest.raises(TypeError, match=message):
        init({"w": "hello"})


# `jaxga.sharding.stacked_on_host`: a stack's parameters made in host memory, by layer.


def _random_layer(key):
    k1, k2 = jax.random.split(key)
    return {
        "w": jax.random.normal(k1, (16, 16)) / 4,
        "u": jax.random.uniform(k2, (3,), jnp.bfloat16),
        "b": jnp.zeros(16),
    }


def _dense_layer(key):
    return flax.linen.Dense(16).init(key, jnp.ones((1, 16)))["params"]


def _equinox_layer(key):
    return equinox.filter(equinox.nn.Linear(16, 16, key=key), equinox.is_array)


def _normalised_layer(key):
    """A draw scaled by its norm: a reduction, whose order `jax.vmap` may change."""
    w = jax.random.normal(key, (257, 33))
    return {"w": w / jnp.linalg.norm(w)}


@pytest.mark.parametrize("layer", [_random_layer, _dense_layer, _equinox_layer, _normalised_layer])
def test_stacked_on_host_is_the_loop_over_the_keys_bit_for_bit_in_host_memory(layer):
    """Each layer as `jax.jit(init_layer)` makes it from its key; `jax.vmap`'s values too,
    but for the norm (vmap reduces in another order)."""
    keys = jax.random.split(jax.random.key(3), 6)
    stack = jaxga.sharding.stacked_on_host(layer, keys)
    made = [jax.jit(layer)(key) for key in keys]
    assert_equal(stack, jax.tree.map(lambda *layers: jnp.stack(layers), *made))
    if layer is not _normalised_layer:
        assert_equal(stack, jax.vmap(layer)(keys))
    assert kinds(stack) == {"pinned_host"}
    assert {x.shape[0] for x in jax.tree.leaves(stack)} == {6}


def test_stacked_on_host_makes_a_layer_at_a_time():
    """Traced, every move between memories is one layer's; compiled, the stack is a
    host-memory result (``S(5)``). (The device peak: tests/h100/checks.py.)"""
    keys = jax.random.split(jax.random.key(0), 16)
    made = jax.jit(jaxga.sharding.stacked_on_host, static_argnums=0)
    moves = {
        shape
        for shape, _ in _device_puts(
            jax.make_jaxpr(made, static_argnums=0)(_random_layer, keys).jaxpr
        )
    }
    assert moves == {(16, 16), (3,), (16,)}, moves
    compiled = made.lower(_random_layer, keys).compile()
    assert "f32[16,16,16]{2,1,0:S(5)}" in compiled.as_text().splitlines()[0].split("->")[1]


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_stacked_on_host_on_a_mesh_gives_every_device_the_stack(axis_type):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    keys = jax.random.split(jax.random.key(3), 4)
    stack = jaxga.sharding.stacked_on_host(
        _random_layer, jax.device_put(keys, jax.NamedSharding(mesh, jax.P()))
    )
    assert_equal(stack, jax.vmap(_random_layer)(keys))
    for x in jax.tree.leaves(stack):
        assert x.sharding.memory_kind == "pinned_host" and x.sharding.mesh == mesh
        assert x.sharding.is_fully_replicated


def _a_function(key):
    return {"w": jnp.tanh}


def _nothing(key):
    return None


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((3, jnp.zeros(2)), TypeError, r"`init_layer` must be a function of a key; got 3"),
        ((_random_layer, "k"), TypeError, r"`keys` is 'k' of type str; expected a pytree of"),
        (
            (_random_layer, jax.random.key(0)),
            TypeError,
            r"`keys` must hold arrays of one leading \(layer\) axis; got \{'keys': \(\)\}",
        ),
        (
            (_random_layer, {"a": jnp.zeros(3), "b": jnp.zeros(4)}),
            TypeError,
            r"`keys` must hold arrays of one leading \(layer\) axis; got \{\"keys\['a'\]\": "
            r"\(3,\), \"keys\['b'\]\": \(4,\)\}",
        ),
        (
            (_random_layer, jax.random.PRNGKey(0)),
            TypeError,
            r"`keys` holds one raw key, uint32\[2\] \(jax.random.PRNGKey's\), which `init_layer` "
            r"fails on as 2 layers; expected a key for each layer: jax.random.split\(key, num_",
        ),
        (
            (_random_layer, jax.random.split(jax.random.key(0), 2)[:0]),
            TypeError,
            r"`keys` holds no layer; expected a key for each layer",
        ),
        (
            (_a_function, jax.random.split(jax.random.key(0), 2)),
            TypeError,
            r"`init_layer` must return a pytree of arrays; on one key: ",
        ),
        (
            (_nothing, jax.random.split(jax.random.key(0), 2)),
            TypeError,
            r"`init_layer` must return a pytree of arrays; got None",
        ),
    ],
    ids=[
        "not_a_function",
        "not_an_array",
        "no_layer_axis",
        "unlike_sizes",
        "one_raw_key",
        "no_layer",
        "returns_a_function",
        "returns_nothing",
    ],
)
def test_stacked_on_host_names_a_bad_argument(args, error, message):
    with pytest.raises(error, match=message):
        jaxga.sharding.stacked_on_host(*args)


def test_stacked_on_host_takes_numpy_inputs():
    def layer(x):
        return {"w": x * 2.0}

    stack = jaxga.sharding.stacked_on_host(layer, np.arange(4.0))
    assert_equal(stack, {"w": np.arange(4.0) * 2.0})
    assert kinds(stack) == {"pinned_host"}


def test_stacked_on_host_names_keys_split_over_a_mesh():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    keys = jax.random.split(jax.random.key(0), 8)
    keys = jax.device_put(keys, jax.NamedSharding(mesh, jax.P("data")))
    with pytest.raises(
        ValueError,
        match=r"`keys` is split over its mesh by (P|PartitionSpec)\('data',?\); expected it whole",
    ):
        jaxga.sharding.stacked_on_host(_random_layer, keys)


@pytest.mark.parametrize("kind", ["flax", "nnx"])
def test_a_jitted_step_checks_a_state_that_moved_to_host_memory_since_its_last_call(kind):
    """The check inside an enclosing jit is kept by where the traced leaves lie, not only
    their shapes: the same step refuses the state once its optimiser state moved."""
    tx = OPTIMIZERS["adamw"]()
    if kind == "flax":
        state = jaxga.TrainState.create(params=host_params(), tx=tx)
        loss = functools.partial(step_loss, stream=True, policy="full")
        run = jax.jit(jaxga.make_train_step(loss, 2, stream="layers"))
        state, _ = run(state, batch_of(0))
        args, where = (jaxga.sharding.offload(state),), r"`state`.opt_state\[0\]"
    else:
        model = Stack(nnx.Rngs(0), stream=True)
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        nnx.update(model.blocks, jax.device_put(nnx.state(model.blocks), HOST))
        run = nnx.jit(jaxga.nnx_train_step(nnx_loss, 2, stream="layers"))
        run(model, opt, batch_of(0))
        nnx.update(opt, jaxga.sharding.offload(nnx.state(opt)))
        args, where = (model, opt), r"`optimizer.opt_state`\[0\]"
    with pytest.raises(ValueError, match=where + r".* is in host memory .*: pass offload=True"):
        run(*args, batch_of(1))


def test_parameters_on_two_meshes_are_named():
    devices = jax.devices()
    one, other = (jax.sharding.Mesh(devices[i : i + 4], ("data",)) for i in (0, 4))
    params = host_params()
    params["layers"] = jax.device_put(
        params["layers"], jax.NamedSharding(one, jax.P(), memory_kind="pinned_host")
    )
    params["head"] = jax.device_put(params["head"], jax.NamedSharding(other, jax.P()))
    with pytest.raises(
        ValueError,
        match=r"`params` lies on more than one mesh \(\{'data': 4\} of devices \[4, 5, 6, 7\] and "
        r"\{'data': 4\} of devices \[0, 1, 2, 3\]\)",  # the head's mesh first: leaves in order
    ):
        jaxga.TrainState.create(params=params, tx=optax.adam(0.1))


def _block_state(key):
    """One NNX block's variables (`nnx.state`), made from a key."""
    return nnx.state(Block(nnx.Rngs(key)))


def _nnx_model(blocks):
    """The test NNX model with no arrays made (`nnx.eval_shape`), given these ``blocks``'
    variables and a head."""
    model = nnx.eval_shape(lambda: Stack(nnx.Rngs(0), stream=True))
    nnx.update(model.blocks, blocks)
    nnx.update(model.head, nnx.state(nnx.Linear(8, 11, rngs=nnx.Rngs(1))))
    return model


def test_an_nnx_model_made_in_host_memory_trains_as_one_whose_blocks_moved_there():
    """docs/streaming.md's NNX recipe: an `nnx.eval_shape`'d model given blocks made by
    `stacked_on_host` and an optimizer by `with_offloaded_init` (a plain `tx` JAX refuses on
    blocks in host memory: `nnx.Optimizer` runs `init` eagerly), never whole on the
    device, trains as the same model made on the device, its optimizer made there, and its
    blocks moved after, bit for bit."""
    keys = jax.random.split(jax.random.key(5), 4)
    made = _nnx_model(jaxga.sharding.stacked_on_host(_block_state, keys))
    assert kinds(nnx.state(made.blocks)) == {"pinned_host"}
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(nnx.state(made)))
    tx = test_streaming_nnx.optimizer()
    made = made, nnx.Optimizer(made, jaxga.sharding.with_offloaded_init(tx), wrt=nnx.Param)
    assert kinds(nnx.as_pure(made[1].opt_state)) == {"pinned_host"}
    moved = _nnx_model(jax.vmap(_block_state)(keys))
    moved = moved, nnx.Optimizer(moved, tx, wrt=nnx.Param)  # on the device, then moved
    nnx.update(moved[0].blocks, jax.device_put(nnx.state(moved[0].blocks), HOST))
    step = jaxga.nnx_train_step(nnx_loss, 4, stream="layers", offload=True)
    with jax.default_matmul_precision("highest"):
        for i in range(2):
            got, want = step(*made, batch_of(i)), step(*moved, batch_of(i))
    states = [(nnx.state(m), nnx.as_pure(o.opt_state)) for m, o in (made, moved)]
    assert_equal((*states[0], got), (*states[1], want))
    moments = test_streaming_nnx.moments(nnx.as_pure(made[1].opt_state))
    assert moments and kinds(moments) == {"pinned_host"}
