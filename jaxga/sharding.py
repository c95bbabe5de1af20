"""Train states and batches on a mesh: layouts (ZeRO-1, FSDP...); the loop is the engine's."""

import functools
import numbers
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, Sharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxga import _checks, meshes, modules
from jaxga._host_stacks import made_by_layer
from jaxga._layerwise import UnmappedState, map_mirrors
from jaxga._layerwise_init import init_by_layer
from jaxga.microbatch import IndivisibleBatchError  # noqa: F401 (importable from here too)


class Split(NamedTuple):
    """What a named strategy splits over the batch's axis (`split_of`): the one table of them."""

    params: bool  # the parameters, gathered for the loop (once; ZeRO-3: in every micro-batch)
    opt_state: bool  # the optimiser state, and the gradients, reduce-scattered to it
    gather_each: bool  # ZeRO-3: the parameters gathered in every micro-batch

    def spec(self, role: str, shape: tuple[int, ...], size: int, axis_name: Any) -> P | None:
        """The spec of a leaf of ``shape`` in ``role`` (``"params"``, ``"opt_state"``, or
        ``"grads"``: split as the optimiser state) over ``size`` devices of ``axis_name``.

        Returns:
            `fsdp_spec` of ``shape`` where this row splits ``role``, else ``None``.

        Examples:
            >>> import jaxga
            >>> jaxga.sharding.split_of("zero1").spec("grads", (8, 4), 2, "data")
            P('data',)
        """
        split = self.params if role == "params" else self.opt_state
        return fsdp_spec(shape, size, axis_name) if split else None


_SPLITS = {
    "data_parallel": Split(params=False, opt_state=False, gather_each=False),
    "zero1": Split(params=False, opt_state=True, gather_each=False),
    "fsdp": Split(params=True, opt_state=True, gather_each=False),
    "zero3": Split(params=True, opt_state=True, gather_each=True),
}
STRATEGIES = tuple(_SPLITS)  # the named layouts of a train state on a mesh


def split_of(strategy: Any) -> Split:
    """What ``strategy`` splits over the batch's axis: a named one's row; specs or ``None``
    (the layout as given) split nothing of their own.

    Examples:
        >>> import jaxga
        >>> jaxga.sharding.split_of("zero1")
        Split(params=False, opt_state=True, gather_each=False)
    """
    return _SPLITS[strategy] if isinstance(strategy, str) else _SPLITS["data_parallel"]


_SPACES = {"pinned_host": jax.memory.Space.Host, "device": jax.memory.Space.Device}
_MOVED: dict[Any, list[bool]] = {}  # offload's leaves to move, by tree structure


def is_laid_out(x: Any, sharding: NamedSharding) -> bool:
    """Whether ``x`` lies on ``sharding``'s mesh as ``sharding`` lays it out."""
    now = getattr(x, "sharding", None)  # None: a host array or a bare shape struct
    on_mesh = isinstance(now, NamedSharding) and now.mesh == sharding.mesh
    return on_mesh and now.is_equivalent_to(sharding, x.ndim)


def check_mesh(mesh: Any, axis_name: Any = None, concrete: bool = False) -> None:
    """Raises unless ``mesh`` is a mesh (``concrete``: not abstract) with ``axis_name``."""
    if not isinstance(mesh, (Mesh,) if concrete else (Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(f"`mesh` must be a jax.sharding.Mesh (jax.make_mesh); got {mesh!r}.")
    for axis in () if axis_name is None else meshes.axes(axis_name):
        if axis not in mesh.axis_names:
            raise ValueError(f"`axis_name`={axis!r} is not an axis of `mesh` {mesh.axis_names}.")


def check_strategy(strategy: Any, *, specs: bool = True) -> Any:
    """``strategy``, checked: a name of `STRATEGIES`, ``None``, or (``specs``: a step's) a
    tree of PartitionSpecs, not a whole state's (its structure checked against the
    parameters where they are at hand); without ``specs`` (a plan's, for its own
    ``build``), anything but a string passes."""
    names = ", ".join(map(repr, STRATEGIES))
    expected = f"one of {names}, None (as placed) or a tree of PartitionSpecs for the params"
    if isinstance(strategy, str) and strategy not in STRATEGIES:
        raise ValueError(f"`strategy` must be {expected}; got {strategy!r}.")
    if not specs or strategy is None or isinstance(strategy, str):
        return strategy
    if not all(map(meshes.is_spec, jax.tree.leaves(strategy, is_leaf=meshes.is_spec))):
        raise TypeError(f"`strategy` must be {expected}; got {strategy!r:.80}.")
    if hasattr(strategy, "params"):  # state_specs' whole tree
        got = f"a {type(strategy).__name__} of specs, a whole state's: pass its `.params`"
        raise ValueError(f"`strategy`'s specs must have the params' tree; got {got}.")
    return strategy


def shard_batch(batch: Any, mesh: Mesh, axis_name: Any = "data") -> Any:
    """Places this process's rows of a batch on ``mesh``, split over ``axis_name`` (concrete).

    Examples:
        >>> import jax, numpy as np, jaxga
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> jaxga.sharding.shard_batch({"x": np.ones((8, 3))}, mesh)["x"].sharding.spec
        P('data',)
    """
    check_mesh(mesh, axis_name, concrete=True)
    sharding = NamedSharding(mesh, P(axis_name))
    shards = meshes.devices(mesh.local_mesh, axis_name)

    def rows(path, x):
        on_devices = isinstance(x, jax.Array) and x.ndim > 0  # global rows: keep or reshard
        if on_devices and (is_laid_out(x, sharding) or not x.is_fully_addressable):
            return jax.device_put(x, sharding)
        shape = np.shape(x)
        if not shape or shape[0] % shards:
            raise ValueError(
                f"shard_batch: batch{jax.tree_util.keystr(path)} has shape {shape}; its leading "
                f"axis must be divisible by the {shards} local shard(s) of axis {axis_name!r}."
            )
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree_util.tree_map_with_path(rows, batch)


def onto(tree: Any, mesh: Mesh) -> Any:
    """``tree``, what is not on ``mesh`` replicated on it, in the memory it lives in (host
    memory kept: a streamed stack); on another mesh: an error.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> jaxga.sharding.onto({"w": jnp.ones(2)}, mesh)["w"].sharding.spec
        P()
    """

    def one(path: Any, x: Any) -> Any:
        now = getattr(x, "sharding", None)
        if isinstance(x, jax.core.Tracer) or (isinstance(now, NamedSharding) and now.mesh == mesh):
            return x  # traced: laid out by the enclosing jit
        if isinstance(now, NamedSharding) and now.mesh.size > 1:
            where = f"{jax.tree_util.keystr(path)} is laid out on another mesh, {now.mesh}"
            raise ValueError(f"The model's state{where}; expected `mesh` {mesh}.")
        return put(x, meshes.in_memory_of(NamedSharding(mesh, P()), x))

    return jax.tree_util.tree_map_with_path(one, tree)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """``tree``, every leaf replicated on every device of ``mesh`` (a `put`).

    Args:
        tree: a pytree of arrays, PRNG keys or shape structs.
        mesh: a concrete `jax.sharding.Mesh`.

    Returns:
        ``tree`` placed with ``NamedSharding(mesh, P())``.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> jaxga.sharding.replicate(jnp.ones(3), mesh).sharding.spec
        P()
    """
    check_mesh(mesh, concrete=True)
    return put(tree, NamedSharding(mesh, P()))


def put(tree: Any, sharding: Any) -> Any:
    """``jax.device_put`` of ``tree`` on a tree of shardings (concrete); keys and shape structs too.

    Args:
        tree: a pytree of arrays, PRNG keys or `jax.ShapeDtypeStruct`s.
        sharding: a `jax.sharding.Sharding` for every leaf, or a tree of them shaped as `tree`.

    Returns:
        `tree` placed (shape structs: with the sharding set).

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> where = jax.NamedSharding(mesh, jax.P())
        >>> jaxga.sharding.put({"w": jnp.ones(2)}, where)["w"].sharding.spec
        P()
    """
    _checks.array_leaves(tree, "tree")  # a string, say, named here, not by device_put
    if isinstance(sharding, Sharding):
        sharding = jax.tree.map(lambda _: sharding, tree)
    leaves, treedef = jax.tree.flatten(sharding, is_leaf=lambda x: isinstance(x, Sharding))
    if treedef != jax.tree.structure(tree) or not all(isinstance(x, Sharding) for x in leaves):
        expected = "a Sharding or a tree of them like `tree`"
        raise TypeError(f"`sharding` must be {expected}; got {sharding!r}.")

    def one(x, where):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x.update(sharding=meshes.traced_as_placed(where))
        if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):  # its data, across processes
            data = jax.device_put(jax.random.key_data(x), where)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.device_put(x, where)

    return jax.tree.map(one, tree, sharding)


def _no_leaves(node: Any) -> bool:  # an empty subtree (an empty optimiser state), kept whole
    return not jax.tree.leaves(node)


def _optimizer_leaves(state: Any) -> list[bool]:
    """Which leaves `offload` moves: under ``opt_state``, but not a MultiSteps' accumulator."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    paths = [tuple(jax.tree_util.keystr(p, simple=True, separator="/").split("/")) for p, _ in flat]
    nodes = jax.tree_util.tree_flatten_with_path(state, is_leaf=_no_leaves)[0]  # empty ones too
    named = [jax.tree_util.keystr(p, simple=True, separator="/").split("/") for p, _ in nodes]
    scoped = any("opt_state" in p for p in named)  # a train state's or optimiser's; else all
    groups = {p[:i] for p in paths for i, k in enumerate(p) if k == "inner_opt_state"}
    # in a MultiSteps state, but not in its inner_opt_state:
    held = [any(p[: len(g)] == g and p[len(g)] != "inner_opt_state" for g in groups) for p in paths]
    return [("opt_state" in p or not scoped) and not h for p, h in zip(paths, held)]


def check_select(select: Any, name: str) -> Any:
    """``select`` (an argument called ``name``), checked: a bool or a function of (path, leaf)."""
    if not (callable(select) or isinstance(select, bool)):
        raise TypeError(f"`{name}` must be a bool or a function of (path, leaf); got {select!r}.")
    return select


def offload(
    state: Any, memory_kind: str = "pinned_host", *, select: Any = True, keep: Any = None
) -> Any:
    """Moves the leaves ``select(path, leaf)`` picks to ``memory_kind`` (``"device"``: back).

    ``keep``: ``None``, or a tree of bools like ``state``: its True leaves stay where they lie.

    ``select=True`` picks the optimiser state: the leaves under an ``opt_state`` (all, if no
    path names one), but of a MultiSteps state only its ``inner_opt_state``; ``False``: none.

    Examples:
        >>> import jax.numpy as jnp, optax, jaxga
        >>> state = jaxga.TrainState.create(params=jnp.zeros(3), tx=optax.adam(0.1))
        >>> jaxga.sharding.offload(state).opt_state[0].mu.sharding.memory_kind
        'pinned_host'
    """
    if memory_kind not in _SPACES:
        raise ValueError(f"`memory_kind` must be 'pinned_host' or 'device'; got {memory_kind!r}.")
    check_select(select, "select")
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    if callable(select):
        moved = [bool(select(path, x)) for path, x in flat]
    else:  # the rule above, cached by tree structure
        if treedef not in _MOVED:
            if len(_MOVED) >= 64:  # a bound: a Flax TrainState's structure holds its tx
                _MOVED.pop(next(iter(_MOVED)))  # and apply_fn, kept alive by the key
            _MOVED[treedef] = _optimizer_leaves(state)
        moved = _MOVED[treedef]
        moved = [m and bool(select) for m in moved]
    if keep is not None:
        kept, kept_def = jax.tree.flatten(keep)
        if kept_def != treedef:
            got = f"another structure than `state` (leaves: {len(kept)} against {len(flat)})"
            want = "a bool for each leaf of `state`: jax.tree.map(lambda x: False, state), say"
            raise ValueError(f"`keep` has {got}; expected {want}.")
        moved = [m and not k for m, k in zip(moved, kept)]

    def move(x: Any) -> Any:
        if isinstance(x, jax.core.Tracer):  # moved unless its type says it is there
            there = meshes.memory_space(x) == _SPACES[memory_kind]
            return x if there else jax.device_put(x, _SPACES[memory_kind])
        now = getattr(x, "sharding", None)  # None: a host array or a bare shape struct
        where = (now or SingleDeviceSharding(jax.local_devices()[0])).with_memory_kind(memory_kind)
        return x if now and now.memory_kind == memory_kind else put(x, where)

    return jax.tree.unflatten(treedef, [move(x) if m else x for (_, x), m in zip(flat, moved)])


_NOT_AN_ARRAY = "`{where}` is {got}; expected {expected}."


def _split_by(x: Any) -> Any:
    """The spec splitting array ``x`` over its mesh (a traced one's: its type's, on Explicit
    axes), or None where each device holds it whole (a NumPy array too)."""
    if isinstance(x, jax.core.Tracer):
        spec = meshes.type_spec(x)
        return spec if any(axis is not None for axis in spec) else None
    sharding = getattr(x, "sharding", None)
    if sharding is None or sharding.is_fully_replicated:
        return None
    return getattr(sharding, "spec", sharding)


def with_offloaded_init(tx: Any) -> Any:
    """``tx``, its ``init`` making the optimiser state in pinned host memory, never whole on
    the device: where a step built with ``offload=True`` keeps it (`offload`'s rule: all of
    it but a `jaxga.MultiSteps`' sums), and the state's copies of each layer stack in host
    memory (a parameter with a leading layer axis, as ``remat_scan(stream=True)`` reads:
    Adam's moments, a MultiSteps' sums too) made a layer at a time on the device and
    written there. For ``TrainState.create`` and ``nnx.Optimizer`` before a step built with
    ``stream="layers", offload=True`` (docs/streaming.md). Wrap the outermost transformation.

    Args:
        tx: an optax transformation, whose state for each element is made from that element
            alone (sgd, adam, adamw, lion, `jaxga.MultiSteps` of these); its ``update`` is
            kept.

    Returns:
        ``tx`` with the new ``init`` (jitted, on the parameters' mesh, each copy of a
        parameter laid out as it, `init_on_mesh`): of ``tx``'s type
        where that is a NamedTuple (optax's and jaxga's transformations), else an
        ``optax.GradientTransformationExtraArgs``.

    Raises:
        TypeError: ``tx`` is not an optax transformation (here); ``init``'s ``params``
            hold a leaf that is not an array.
        ValueError: from ``init``: a stack in host memory split over a mesh (streaming
            takes replicated stacks), or a ``tx`` whose state made a layer at a time is
            not ``tx.init``'s, checked on small probes first (a ``StreamError``), or fails.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, jaxga
        >>> stack = jax.device_put(jnp.ones((4, 3)), jax.memory.Space.Host)
        >>> tx = jaxga.sharding.with_offloaded_init(optax.adam(0.1))
        >>> tx.init({"w": stack})[0].nu["w"].sharding.memory_kind
        'pinned_host'
    """
    _checks.check_optimizer(tx, "tx")
    init = functools.partial(_offloaded_init, tx)
    if hasattr(tx, "_replace"):  # a NamedTuple: optax's, a MultiSteps
        return tx._replace(init=init)
    return optax.GradientTransformationExtraArgs(init, tx.update)


def _offloaded_init(tx: Any, params: Any) -> Any:
    """`with_offloaded_init`'s ``init``: the state made by layer, then offloaded."""
    for path, x in _checks.array_leaves(params, "params", _NOT_AN_ARRAY):
        host = meshes.memory_space(x) == jax.memory.Space.Host
        if host and (spec := _split_by(x)) is not None:
            raise ValueError(
                f"`params`{jax.tree_util.keystr(path)}, a stack in host memory, is split over "
                f"the mesh by {spec}; expected it replicated, P() (streaming keeps a copy on "
                "every device)."
            )

    def made(params: Any) -> Any:
        return offload(init_by_layer(tx, params))

    return init_on_mesh(tx, made, params)


def init_on_mesh(tx: Any, init: Callable[[Any], Any], params: Any) -> Any:
    """``init(params)``, a state of ``tx``, jitted on the parameters' mesh
    (`meshes.jit_on_mesh_of`), each leaf that mirrors a parameter laid out as that parameter:
    Explicit axes type it so; on Auto axes, where XLA would lay out what ``init`` makes from
    nothing replicated, each leaf of its parameter's shape is constrained to its parameter's
    spec, in the memory ``init`` makes it in (concrete parameters; traced ones, the enclosing
    jit lays it out). A state ``optax.tree_utils.tree_map_params`` cannot map (L-BFGS's) is
    left as XLA lays it out; a step lays it out.

    Args:
        tx: the optax transformation the state is of (its mirrors found by
            ``optax.tree_utils.tree_map_params``).
        init: a function of ``params`` that makes ``tx``'s state (``tx.init``).
        params: the parameters.

    Returns:
        ``init(params)``.

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> from jaxga.sharding import init_on_mesh
        >>> devices = jax.device_count()
        >>> mesh = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> split = jax.NamedSharding(mesh, jax.P("data"))
        >>> w = jax.device_put(jnp.ones((4 * devices, 2)), split)
        >>> tx = optax.adam(0.1)
        >>> init_on_mesh(tx, tx.init, {"w": w})[0].mu["w"].sharding.is_equivalent_to(split, 2)
        True
    """
    mesh = meshes.mesh_of(params, "params")
    specs = _auto_specs(mesh, params)

    def made(params: Any) -> Any:
        state = init(params)
        if specs is None:
            return state
        try:
            return map_mirrors(tx, functools.partial(_constrained, mesh), state, specs, params)
        except UnmappedState:  # optax cannot pair them: as XLA lays it out (a step lays it out)
            return state

    return meshes.jit_on_mesh_of(made, params, "params")


def _auto_specs(mesh: Mesh | None, params: Any) -> Any:
    """Each leaf of ``params``' spec on ``mesh`` (`meshes.mesh_of`) where its axes are all
    Auto and some leaf is split there (``P()`` off it), or ``None``: no mesh, an Explicit
    axis (JAX's types lay the state out), no leaf split."""
    if mesh is None or any(t != AxisType.Auto for t in mesh.axis_types):
        return None

    def spec(x: Any) -> P:
        sharding = getattr(x, "sharding", None)
        on_mesh = isinstance(sharding, NamedSharding) and sharding.mesh == mesh
        return sharding.spec if on_mesh else P()

    specs = jax.tree.map(spec, params)
    if all(axis is None for s in jax.tree.leaves(specs, is_leaf=meshes.is_spec) for axis in s):
        return None
    return specs


def _constrained(mesh: Mesh, leaf: Any, spec: P, param: Any) -> Any:
    """``leaf`` constrained to ``spec`` on ``mesh``, in its own memory, where it is shaped as
    ``param`` (not a factored or stacked copy); replicated: as it is."""
    if all(axis is None for axis in spec) or jnp.shape(leaf) != jnp.shape(param):
        return leaf
    kind = "pinned_host" if meshes.memory_space(leaf) == jax.memory.Space.Host else "device"
    return jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, spec, memory_kind=kind))


def stacked_on_host(init_layer: Callable[[Any], Any], keys: Any) -> Any:
    """The layer stack of ``init_layer(key)`` for each of ``keys``, made a layer at a time on
    the device (a ``lax.scan``, jitted on ``keys``' mesh) and each layer written to pinned
    host memory: the parameters of a stack that fits only in host memory, for
    ``remat_scan(stream=True)``; never whole on the device. The values are those of a loop
    over the keys, which are ``jax.jit(jax.vmap(init_layer))(keys)``'s for threefry keys
    (JAX's default) and elementwise draws; with ``rbg`` keys, an ``init_layer`` that reduces
    (a norm, an orthogonal init), or ``vmap`` run eagerly, ``vmap``'s may round otherwise.

    Args:
        init_layer: ``key -> a layer's parameters`` (a pytree of arrays), as ``Dense.init``
            or an Equinox layer's arrays make them.
        keys: one input a layer, on a leading axis: PRNG keys (``jax.random.split(key, L)``)
            or a pytree of arrays of one leading size; replicated on a mesh (each device's
            host memory gets the stack), on one device otherwise.

    Returns:
        ``init_layer``'s pytree, each leaf with a leading axis of ``len(keys)`` layers, in
        pinned host memory.

    Raises:
        TypeError: ``init_layer`` is not callable or returns what is not a pytree of
            arrays, or ``keys`` holds a leaf that is not an array, or no leaves, or leaves
            without one leading size, or no layer, or is one raw key (``uint32[2]``) that
            ``init_layer`` fails on.
        ValueError: a leaf of ``keys`` is split over its mesh; or ``keys`` lie on two meshes.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> def layer(key):
        ...     return {"w": jax.random.normal(key, (16, 16)) / 4, "b": jnp.zeros(16)}
        >>> stack = jaxga.sharding.stacked_on_host(layer, jax.random.split(jax.random.key(0), 8))
        >>> stack["w"].shape, stack["w"].sharding.memory_kind
        ((8, 16, 16), 'pinned_host')
    """
    if not callable(init_layer):
        raise TypeError(f"`init_layer` must be a function of a key; got {init_layer!r:.60}.")
    leaves = _checks.array_leaves(keys, "keys", _NOT_AN_ARRAY)
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for _, x in leaves}
    if len(sizes) != 1 or None in sizes:
        got = {f"keys{jax.tree_util.keystr(p)}": jnp.shape(x) for p, x in leaves} or keys
        if isinstance(keys, int):  # a number of layers
            got = f"{keys}, a number: for {keys} layers, pass jax.random.split(key, {keys})"
        raise TypeError(f"`keys` must hold arrays of one leading (layer) axis; got {got}.")
    want = "a key for each layer: jax.random.split(key, num_layers)"
    if sizes == {0}:
        raise TypeError(f"`keys` holds no layer; expected {want}.")
    for path, x in leaves:
        if (spec := _split_by(x)) is not None:
            got = f"`keys{jax.tree_util.keystr(path)}` is split over its mesh by {spec}"
            raise ValueError(f"{got}; expected it whole on each device (replicated).")
    try:
        layer = jax.eval_shape(init_layer, jax.tree.map(operator.itemgetter(0), keys))
    except TypeError as e:
        if jnp.shape(keys) == (2,) and jnp.result_type(keys) == jnp.uint32:  # as 2 layers
            got = "one raw key, uint32[2] (jax.random.PRNGKey's), which `init_layer` fails on"
            raise TypeError(f"`keys` holds {got} as 2 layers; expected {want}.") from e
        raise TypeError(f"`init_layer` must return a pytree of arrays; on one key: {e}") from e
    if not jax.tree.leaves(layer):
        raise TypeError(f"`init_layer` must return a pytree of arrays; got {layer!r:.60}.")
    made = functools.partial(made_by_layer, init_layer)
    return meshes.jit_on_mesh_of(made, keys, "keys")


def fsdp_spec(shape: tuple[int, ...], size: int, axis_name: Any = "data") -> P:
    """The spec splitting the largest axis of ``shape`` that ``size`` devices divide, or ``P()``.

    Args:
        shape: an array's shape.
        size: the number of devices along ``axis_name``.
        axis_name: the mesh axis (or axes) to split over.

    Returns:
        A `PartitionSpec` naming ``axis_name`` at that axis (the first of equal sizes).

    Examples:
        >>> import jaxga
        >>> jaxga.sharding.fsdp_spec((6, 16), 4)
        P(None, 'data')
    """
    size = _checks.positive_int(size, "size")
    sizes = isinstance(shape, tuple | list) and all(isinstance(n, numbers.Integral) for n in shape)
    if not sizes:
        raise TypeError(f"`shape` must be a tuple of ints, an array's shape; got {shape!r}.")
    dims = [i for i, n in enumerate(shape) if n >= size and n % size == 0]
    dim = max(dims, key=lambda i: (shape[i], -i), default=None)
    return P() if dim is None else P(*(axis_name if i == dim else None for i in range(dim + 1)))


def fsdp_specs(tree: Any, mesh: Mesh, axis_name: Any = "data") -> Any:
    """[`fsdp_spec`][jaxga.sharding.fsdp_spec] of every leaf of `tree` over `mesh`'s `axis_name`.

    Args:
        tree: a pytree of arrays or shape structs.
        mesh: a mesh with ``axis_name``.
        axis_name: the mesh axis (or axes) to split over.

    Returns:
        A tree of `PartitionSpec`s shaped as ``tree``.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> jaxga.sharding.fsdp_specs({"w": jnp.ones((4, 2))}, mesh)
        {'w': P('data',)}
    """
    check_mesh(mesh, axis_name)
    size = meshes.devices(mesh, axis_name)
    return jax.tree.map(lambda x: fsdp_spec(jnp.shape(x), size, axis_name), tree)


def _check_param_specs(specs: Any, params: Any, mesh: Mesh) -> None:
    got, want = jax.tree.structure(specs, is_leaf=meshes.is_spec), jax.tree.structure(params)
    if got != want:
        raise ValueError(f"`strategy`'s specs must have the params' tree {want}; got {got}.")
    leaves = jax.tree_util.tree_leaves_with_path(params)
    for (path, x), spec in zip(leaves, jax.tree.leaves(specs, is_leaf=meshes.is_spec)):
        where, shape = f"The spec for params{jax.tree_util.keystr(path)}", jnp.shape(x)
        named = [a for entry in spec if entry is not None for a in meshes.axes(entry)]
        if not meshes.is_spec(spec) or len(spec) > len(shape) or set(named) - set(mesh.axis_names):
            raise ValueError(
                f"{where} must be a PartitionSpec of at most {len(shape)} entries (its shape is "
                f"{shape}), each None or axes of the mesh {mesh.axis_names}; got {spec!r}."
            )
        for dim, entry in enumerate(spec):
            size = meshes.devices(mesh, entry or ())
            if shape[dim] % size:
                raise ValueError(
                    f"{where}, {spec}, splits its axis {dim} of size {shape[dim]} over the "
                    f"{size} devices of {entry!r}, which do not divide it."
                )


def _spec_of(x: Any, mesh: Mesh) -> P:
    """``x``'s PartitionSpec on ``mesh``, as it is laid out (traced: as its type says)."""
    now = jax.typeof(x).sharding if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
    if isinstance(now, NamedSharding) and now.mesh.axis_names == mesh.axis_names:
        return P(*now.spec)
    return P()


def state_specs(
    state: Any, mesh: Mesh, strategy: Any = "data_parallel", *, axis_name: Any = "data"
) -> Any:
    """A train state's PartitionSpecs under ``strategy``: a name in `STRATEGIES` or param specs.

    Args:
        state: a train state with ``params``, ``opt_state`` and ``tx`` (a Flax ``TrainState``).
        mesh: the mesh the state is laid out on.
        strategy: a name in `STRATEGIES`; a tree of `PartitionSpec`s shaped as the
            parameters (the optimiser's copies of a parameter follow it, its other leaves
            for a parameter, such as adafactor's factored moments, are replicated, the rest
            split as `fsdp_specs` splits them); or ``None``, the parameters and the
            optimiser state as they are laid out.
        axis_name: the batch's mesh axis (or axes), which the named strategies split over.

    Returns:
        A tree of `PartitionSpec`s shaped as ``state`` (``P()`` for what is not split).

    Examples:
        >>> import jax, jax.numpy as jnp, optax, jaxga
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> state = jaxga.TrainState.create(params={"w": jnp.zeros((8, 16))}, tx=optax.adam(0.1))
        >>> jaxga.sharding.state_specs(state, mesh, "fsdp").params["w"]
        P(None, 'data')
    """
    check_mesh(mesh, axis_name)
    check_strategy(strategy)
    if not (hasattr(state, "params") and hasattr(state, "opt_state")):
        kind = type(state).__name__
        raise TypeError(f"`state` must be a train state with `params`, `opt_state`; got {kind}.")
    specs = jax.tree.map(lambda _: P(), state)
    shard = functools.partial(fsdp_specs, mesh=mesh, axis_name=axis_name)
    if strategy is None:  # as placed: every array's own layout, the parameters' and the rest
        where = functools.partial(_spec_of, mesh=mesh)
        params, opt_state = jax.tree.map(where, state.params), jax.tree.map(where, state.opt_state)
        return specs.replace(params=params, opt_state=opt_state)
    if isinstance(strategy, str):
        row, size = split_of(strategy), meshes.devices(mesh, axis_name)

        def by_row(role: str, tree: Any) -> Any:  # P(): what the row does not split
            return jax.tree.map(
                lambda x: row.spec(role, jnp.shape(x), size, axis_name) or P(), tree
            )

        params, opt_state = by_row("params", state.params), by_row("opt_state", state.opt_state)
        return specs.replace(params=params, opt_state=opt_state)
    _check_param_specs(strategy, state.params, mesh)

    def follow(leaf: Any, spec: P, param: Any) -> P:  # a copy of a parameter: its spec
        return spec if jnp.shape(leaf) == jnp.shape(param) else P()  # factored: whole

    try:
        opt_state = map_mirrors(
            state.tx, follow, state.opt_state, strategy, state.params, transform_non_params=shard
        )
    except UnmappedState as e:
        raise ValueError(
            f"`strategy`, a tree of specs, lays the optimiser state's copies of the parameters "
            f"out as the parameters, but {e}; expected an optimiser whose state holds "
            "parameter-shaped trees, or a named strategy."
        ) from e
    return specs.replace(params=strategy, opt_state=opt_state)


def nnx_state_specs(
    state: Any,
    mesh: Mesh,
    strategy: str | None = None,
    *,
    axis_name: Any = "data",
    grads: bool = False,
) -> Any:
    """A Flax NNX state's PartitionSpecs on ``mesh``, as a train step lays it out.

    Each variable's sharding metadata (axes ``mesh`` lacks dropped); a variable whose
    metadata names none: ``None`` without a ``strategy`` (where it is, it stays), else split
    over ``axis_name`` as the strategy splits the parameters (`nnx.Param`) or the optimiser
    state, or ``P()``.

    Args:
        state: an `nnx.State` (`nnx.state(model)`, `nnx.state((model, optimizer))`).
        mesh: the mesh the state is laid out on.
        strategy: `None` (the metadata alone) or one of `STRATEGIES`.
        axis_name: the batch's mesh axis (or axes) a strategy splits over.
        grads: the specs of ``state``'s gradients, split as the optimiser state.

    Returns:
        An `nnx.State` shaped as ``state``, a `PartitionSpec` in each variable.

    Examples:
        >>> import jax, optax, jaxga, flax.nnx as nnx
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
        >>> state = nnx.state((model, nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)))
        >>> jaxga.sharding.nnx_state_specs(state, mesh, "fsdp")[0]["kernel"].get_value()
        P(None, 'data')
    """
    check_mesh(mesh, axis_name)
    check_nnx_strategy(strategy)
    row, size = split_of(strategy), meshes.devices(mesh, axis_name)

    def one(variable: Any, spec: Any) -> Any:
        given = meshes.spec_over(spec.get_value(), mesh.axis_names)
        if any(given) or strategy is None:
            return spec.replace(given if any(given) else None)
        opt = grads or isinstance(variable, nnx.optimizer.OptState)
        if not (opt or isinstance(variable, nnx.Param)):
            return spec.replace(given)
        role = "grads" if grads else "opt_state" if opt else "params"
        split = row.spec(role, jnp.shape(variable.get_value()), size, axis_name)
        return spec.replace(given if split is None else split)

    specs = nnx.get_partition_spec(state)
    return jax.tree.map(one, state, specs, is_leaf=modules.is_variable)


def check_nnx_strategy(strategy: Any) -> str | None:
    """``strategy`` for an NNX model: ``None`` (its metadata) or a name of `STRATEGIES`."""
    if not (strategy is None or isinstance(strategy, str)):
        expected = f"one of {', '.join(map(repr, STRATEGIES))} or None (the model's metadata)"
        raise TypeError(f"`strategy` for an NNX model must be {expected}; got {strategy!r}.")
    return check_strategy(strategy)


def state_shardings(
    state: Any, mesh: Mesh, strategy: Any = "data_parallel", *, axis_name: Any = "data"
) -> Any:
    """[`state_specs`][jaxga.sharding.state_specs] as `NamedSharding`s on `mesh`: the same
    arguments; a tree of shardings shaped as ``state``, for `jax.device_put` or a jit's
    ``out_shardings``.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, jaxga
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> state = jaxga.TrainState.create(params={"w": jnp.zeros(4)}, tx=optax.sgd(0.1))
        >>> jaxga.sharding.state_shardings(state, mesh).params["w"].spec
        P()
    """
    specs = state_specs(state, mesh, strategy, axis_name=axis_name)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=meshes.is_spec)


def place(mesh: Mesh, tree: Any, specs: Any) -> Any:
    """Inside a jit, ``tree`` constrained to ``specs`` on ``mesh`` (on Explicit axes:
    resharded), each leaf in the memory it lives in; a leaf whose spec is ``None`` stays
    where it is."""
    move = jax.reshard if meshes.explicit_axes(mesh) else jax.lax.with_sharding_constraint

    def one(spec: Any, x: Any) -> Any:
        return x if spec is None else move(x, meshes.in_memory_of(NamedSharding(mesh, spec), x))

    return jax.tree.map(one, specs, tree, is_leaf=lambda x: x is None or meshes.is_spec(x))
