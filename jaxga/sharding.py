"""Data parallelism: running jaxga inside ``shard_map``/``pmap`` over a named mesh axis.

``jaxga.value_and_grad(..., axis_name="data")`` called inside ``jax.shard_map`` (or
``jax.pmap``) scans each device's local micro-batches and reduces gradients, loss
totals and counts across the axis **once**, after the loop. This module holds the
pieces that make that work (:func:`check_axis_bound`, :func:`varying`,
:func:`psum_invariant`) and helpers to put data on a mesh from one or many processes
(:func:`shard_batch`, :func:`replicate`). See ``docs/distributed.md``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxga._checks import positive_int

__all__ = [
    "IndivisibleBatchError",
    "check_axis_bound",
    "fsdp_spec",
    "fsdp_specs",
    "indivisible_error",
    "psum_invariant",
    "psum_varying",
    "put",
    "replicate",
    "shard_batch",
    "state_shardings",
    "state_specs",
    "varying",
]


def _axes(axis_name: Any) -> tuple[Any, ...]:
    """Returns ``axis_name`` as a tuple of axis names (a name, or a tuple of names)."""
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def _varying_axes(x: Any) -> frozenset:
    """Returns the mesh axes over which ``x`` varies (empty outside ``shard_map``)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # recent jax (0.10): ShapedArray.mat.varying
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))  # older jax: ShapedArray.vma


def check_axis_bound(axis_name: Any) -> None:
    """Raises a ``ValueError`` unless ``axis_name`` is bound by an enclosing map.

    Example:
        >>> import jaxga
        >>> try:
        ...     jaxga.sharding.check_axis_bound("data")
        ... except ValueError as e:
        ...     print(str(e).split(";")[0])
        `axis_name`='data' is not bound
    """
    try:
        jax.lax.axis_index(axis_name)
    except NameError:
        raise ValueError(
            f"`axis_name`={axis_name!r} is not bound; call the function inside "
            f"jax.shard_map (or jax.pmap) over a mesh axis named {axis_name!r}, or pass "
            f"axis_name=None on a single device."
        ) from None


def varying(tree: Any, axis_name: Any) -> Any:
    """Marks every leaf of ``tree`` as varying over ``axis_name`` (no-op when ``None``).

    Differentiating inside ``shard_map`` with respect to a value that is replicated
    over the axis makes JAX insert a ``psum`` into the gradient. Inside a micro-batch
    loop that would be one all-reduce per micro-batch; marking the value as varying
    first keeps the gradient local, so the caller can reduce once after the loop.
    ``axis_name`` may be a tuple of axis names; leaves already varying over some of
    them are cast over the others only.

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> def f(w):
        ...     print(jax.typeof(w), jax.typeof(jaxga.sharding.varying(w, "data")))
        ...     return w
        >>> _ = jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P())(jnp.ones(2))
        float32[2] float32[2]{V:data}
        >>> jaxga.sharding.varying(1.0, None)
        1.0
    """
    if axis_name is None:
        return tree
    axes = _axes(axis_name)

    def cast(x):
        vma = _varying_axes(x)
        for axis in axes:
            if axis not in vma:
                x = jax.lax.pcast(x, axis, to="varying")
        return x

    return jax.tree.map(cast, tree)


def psum_invariant(tree: Any, like: Any, axis_name: Any) -> Any:
    """Sums ``tree`` over ``axis_name``, skipping axes where the matching leaf of ``like`` varies.

    This is how gradients are reduced after the micro-batch loop: a parameter that is
    replicated over the axis gets the sum of every device's gradient, while one that
    already varies over it (sharded FSDP-style, or per device) keeps its own — the
    gradient JAX itself would give it. ``like`` has the structure of ``tree`` (leaves
    may be placeholders such as ``0.0``). Leaves summed over the same axes are summed
    in one ``psum``. Under ``pmap`` and ``shard_map(..., check_vma=False)`` nothing is
    known to vary, so everything is summed.

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> def f(replicated, sharded):
        ...     grads = jaxga.sharding.varying((replicated, sharded), "data")  # local sums
        ...     out = jaxga.sharding.psum_invariant(grads, (replicated, sharded), "data")
        ...     print(*(jax.typeof(x) for x in out))
        ...     return out
        >>> sharded = jaxga.sharding.shard_batch(jnp.ones(2), mesh)
        >>> _ = jax.shard_map(f, mesh=mesh, in_specs=(P(), P("data")),
        ...                   out_specs=(P(), P("data")))(jnp.ones(2), sharded)
        float32[2] float32[2]{V:data}
    """
    axes = _axes(axis_name)
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, like_leaf in enumerate(treedef.flatten_up_to(like)):
        vma = _varying_axes(like_leaf)
        groups.setdefault(tuple(a for a in axes if a not in vma), []).append(i)
    out = list(leaves)
    for over, indices in groups.items():
        if over:
            summed = jax.lax.psum([leaves[i] for i in indices], over if len(over) > 1 else over[0])
            for i, x in zip(indices, summed):
                out[i] = x
    return jax.tree.unflatten(treedef, out)


def psum_varying(tree: Any) -> Any:
    """Sums each leaf over the mesh axes it varies over (bools: whether any device is true).

    The result is the same on every device. Leaves that vary over no axis (outside
    ``shard_map``, or replicated) are returned as they are, so a report that is already
    global is not counted once per device. This is how per-shard reports (non-finite
    counts of FSDP-sharded gradients) become one decision.

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> f = lambda x: jaxga.sharding.psum_varying(jnp.sum(x))
        >>> x = jaxga.sharding.shard_batch(jnp.arange(4.0), mesh)
        >>> float(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P())(x))
        6.0
    """

    def reduce(x):
        axes = tuple(sorted(_varying_axes(x), key=str))
        if not axes:
            return x
        if x.dtype == jnp.bool_:
            return jax.lax.psum(x.astype(jnp.int32), axes) > 0
        return jax.lax.psum(x, axes)

    return jax.tree.map(reduce, tree)


class IndivisibleBatchError(ValueError):
    """A global batch that the devices × micro-batches do not divide."""


def indivisible_error(
    global_size: int, devices: int, num_microbatches: int, axis_name: Any
) -> IndivisibleBatchError:
    """Returns the error for a global batch not divisible by devices × micro-batches."""
    return IndivisibleBatchError(
        f"The global batch of {global_size} ({global_size // devices} per device on "
        f"{devices} devices of axis {axis_name!r}) is not divisible by devices × "
        f"num_microbatches = {devices} × {num_microbatches} = {devices * num_microbatches}."
    )


def shard_batch(batch: Any, mesh: Mesh, axis_name: Any = "data") -> Any:
    """Places this process's rows of a batch on ``mesh``, split over ``axis_name``.

    Every leaf's leading axis is sharded over the mesh axis (or tuple of axes)
    ``axis_name`` and replicated over the other axes. On one process, ``batch`` is the
    whole global batch. Under ``jax.distributed`` each process passes its own rows
    (the ones its data loader produced) and gets back global arrays whose leading
    axis concatenates all processes' rows in process order (for the usual
    mesh from ``jax.make_mesh``, whose devices are ordered by process); this is
    :func:`jax.make_array_from_process_local_data` applied to every leaf. A leaf that
    already is a global array on ``mesh`` (one that spans other processes' devices,
    or, on one process, one already sharded this way) is kept as it is, resharded if
    needed, so placing a batch twice costs nothing.

    Example:
        >>> import jax, numpy as np, jaxga
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> batch = jaxga.sharding.shard_batch({"x": np.ones((8, 3))}, mesh)
        >>> batch["x"].shape, batch["x"].sharding.spec
        ((8, 3), P('data',))
    """
    _check_mesh(mesh, kinds=(Mesh,))
    for axis in _axes(axis_name):
        _check_mesh_axis(mesh, axis)
    sharding = NamedSharding(mesh, P(axis_name))
    local_mesh = mesh.local_mesh.shape
    shards = int(np.prod([local_mesh[a] for a in _axes(axis_name)]))

    def place(path, x):
        if isinstance(x, jax.Array) and x.ndim:  # already global rows: keep or reshard
            same_mesh = isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
            if same_mesh and x.sharding.is_equivalent_to(sharding, x.ndim):
                return x
            if not x.is_fully_addressable:
                return jax.device_put(x, sharding)
        shape = np.shape(x)
        where = f"batch{jax.tree_util.keystr(path)}"
        if not shape or shape[0] % shards:
            got = f"shape {shape}" if shape else "a scalar"
            raise ValueError(
                f"shard_batch: {where} has {got}; its leading axis (this process's rows) must "
                f"be divisible by the {shards} shard(s) of mesh axis {axis_name!r} held by "
                f"this process's devices."
            )
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree_util.tree_map_with_path(place, batch)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Places ``tree`` (e.g. parameters, optimiser state) on every device of ``mesh``.

    Under ``jax.distributed`` every process must pass the same values (for instance
    parameters initialised from the same seed).

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> params = jaxga.sharding.replicate({"w": jnp.zeros(3)}, mesh)
        >>> params["w"].sharding.is_fully_replicated
        True
    """
    _check_mesh(mesh, kinds=(Mesh,))
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: put(x, sharding), tree)


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """``jax.device_put``, for typed PRNG keys too under ``jax.distributed``.

    Every process passes the same value.

    Example:
        >>> import jax, jaxga
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> key = jaxga.sharding.put(jax.random.key(0), jax.NamedSharding(mesh, jax.P()))
        >>> key.sharding.is_fully_replicated
        True
    """
    if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
        # device_put takes a typed key to one process's devices only; its data travels.
        data = jax.device_put(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(x, sharding)


# --- sharded train state (FSDP / ZeRO) -------------------------------------------------

STRATEGIES = ("data_parallel", "zero1", "fsdp", "zero3")


def fsdp_spec(shape: tuple[int, ...], size: int, axis_name: Any = "data") -> P:
    """Returns the spec that splits the largest axis of ``shape`` divisible by ``size``.

    Ties go to the first such axis; a shape with none (a scalar, a bias whose length
    ``size`` does not divide) is replicated, ``P()``. This is the rule by which
    :func:`state_shardings` shards parameters and optimiser state over a mesh axis of
    ``size`` devices.

    Example:
        >>> from jaxga.sharding import fsdp_spec
        >>> tuple(fsdp_spec((768, 3072), 8)), tuple(fsdp_spec((10,), 8))
        ((None, 'data'), ())
    """
    size = positive_int(size, "size")
    dims = [i for i, n in enumerate(shape) if n >= size and n % size == 0]
    if not dims:
        return P()
    dim = max(dims, key=lambda i: (shape[i], -i))
    return P(*(axis_name if i == dim else None for i in range(dim + 1)))


def fsdp_specs(tree: Any, mesh: Mesh, axis_name: Any = "data") -> Any:
    """Returns :func:`fsdp_spec` for every leaf of ``tree`` over ``mesh``'s ``axis_name``.

    Only the mesh's shape is read, so an abstract mesh will do.

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> mesh = jax.sharding.AbstractMesh((8,), ("data",))
        >>> specs = jaxga.sharding.fsdp_specs({"w": jnp.zeros((4, 8)), "b": jnp.zeros(3)}, mesh)
        >>> tuple(specs["w"]), tuple(specs["b"])
        ((None, 'data'), ())
    """
    _check_mesh_axis(mesh, axis_name)
    size = mesh.shape[axis_name]
    return jax.tree.map(lambda x: fsdp_spec(jnp.shape(x), size, axis_name), tree)


def _replicated(tree: Any) -> Any:
    return jax.tree.map(lambda _: P(), tree)


def _check_param_specs(specs: Any, params: Any, size: int, axis_name: Any) -> Any:
    """``specs``, a PartitionSpec per parameter, checked against ``params`` and the mesh."""
    is_spec = lambda x: isinstance(x, P)
    if jax.tree.structure(specs, is_leaf=is_spec) != jax.tree.structure(params):
        raise ValueError(
            f"`strategy`, a tree of PartitionSpecs, must have the structure of the "
            f"parameters, {jax.tree.structure(params)}; got "
            f"{jax.tree.structure(specs, is_leaf=is_spec)}."
        )
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, x), spec in zip(flat, jax.tree.leaves(specs, is_leaf=is_spec)):
        where, shape = f"params{jax.tree_util.keystr(path)}", jnp.shape(x)
        if not is_spec(spec) or len(spec) > len(shape):
            raise ValueError(
                f"The spec for {where} must be a PartitionSpec of at most {len(shape)} "
                f"entries (its shape is {shape}); got {spec!r}."
            )
        for dim, entry in enumerate(spec):
            if entry is None:
                continue
            if entry != axis_name:
                raise ValueError(
                    f"The spec for {where}, {spec}, names {entry!r}; jaxga shards the state "
                    f"over the data axis {axis_name!r} only."
                )
            if shape[dim] % size:
                raise ValueError(
                    f"The spec for {where}, {spec}, splits its axis {dim} of size "
                    f"{shape[dim]} over the {size} devices of {axis_name!r}, which do not "
                    f"divide it."
                )
    return specs


def _check_mesh(mesh: Any, kinds: tuple[type, ...] = (Mesh, jax.sharding.AbstractMesh)) -> None:
    """Raises unless ``mesh`` is one of ``kinds``: abstract meshes do where only shapes count,
    not where arrays are placed (``kinds=(Mesh,)``)."""
    if not isinstance(mesh, kinds):
        raise TypeError(
            f"`mesh` must be a jax.sharding.Mesh (e.g. jax.make_mesh((n,), ('data',))); "
            f"got {mesh!r} of type {type(mesh).__name__}."
        )


def _check_mesh_axis(mesh: Mesh, axis_name: Any) -> None:
    """Raises unless ``mesh`` is a mesh and ``axis_name`` one of its axes."""
    _check_mesh(mesh)
    if axis_name not in mesh.axis_names:
        raise ValueError(f"`axis_name`={axis_name!r} is not an axis of `mesh` {mesh.axis_names}.")


def _check_strategy(strategy: Any) -> None:
    """Raises for a strategy name that is not one of :data:`STRATEGIES`."""
    if isinstance(strategy, str) and strategy not in STRATEGIES:
        raise ValueError(
            f"`strategy` must be one of {', '.join(map(repr, STRATEGIES))} or a tree of "
            f"PartitionSpecs for the parameters; got {strategy!r}."
        )


def state_specs(
    state: Any, mesh: Mesh, strategy: Any = "data_parallel", *, axis_name: Any = "data"
) -> Any:
    """Returns the PartitionSpec of every leaf of a train state under ``strategy``.

    ``state`` is a ``flax.training.train_state.TrainState`` (arrays or
    ``jax.ShapeDtypeStruct``s); the result has its structure. ``strategy``:

    * ``"data_parallel"``: everything replicated.
    * ``"zero1"``: the optimiser state sharded over ``axis_name`` by
      :func:`fsdp_spec`, the parameters replicated.
    * ``"fsdp"`` and ``"zero3"``: parameters and optimiser state sharded by
      :func:`fsdp_spec` (the two differ in when the train step gathers the parameters).
    * a tree of ``PartitionSpec``s shaped like the parameters: FSDP with these specs
      for the parameters; optimiser state shaped like the parameters (Adam's moments,
      :class:`jaxga.MultiSteps`' accumulator) follows them (``optax.tree_map_params``).

    Everything else (the step, model state, PRNG key, counters) is replicated.

    Example:
        >>> import jax, jax.numpy as jnp, optax, jaxga
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> state = jaxga.TrainState.create(params={"w": jnp.zeros((8, 16))}, tx=optax.adam(0.1))
        >>> specs = jaxga.sharding.state_specs(state, mesh, "fsdp")
        >>> tuple(specs.params["w"]), tuple(specs.opt_state[0].mu["w"]), tuple(specs.step)
        ((None, 'data'), (None, 'data'), ())
    """
    _check_mesh_axis(mesh, axis_name)
    _check_strategy(strategy)
    if not (hasattr(state, "params") and hasattr(state, "opt_state")):
        raise TypeError(
            f"`state` must be a train state with `params` and `opt_state` (jaxga.TrainState "
            f"or Flax's); got {type(state).__name__}."
        )
    size = mesh.shape[axis_name]
    specs = _replicated(state)
    if isinstance(strategy, str):
        if strategy == "data_parallel":
            return specs
        sharded = strategy in ("fsdp", "zero3")
        params = fsdp_specs(state.params, mesh, axis_name) if sharded else specs.params
        return specs.replace(params=params, opt_state=fsdp_specs(state.opt_state, mesh, axis_name))
    params = _check_param_specs(strategy, state.params, size, axis_name)
    opt_state = optax.tree_map_params(
        state.tx,
        lambda _, spec: spec,
        state.opt_state,
        params,
        transform_non_params=lambda tree: fsdp_specs(tree, mesh, axis_name),
        is_leaf=lambda x: isinstance(x, P),
    )
    return specs.replace(params=params, opt_state=opt_state)


def state_shardings(
    state: Any, mesh: Mesh, strategy: Any = "data_parallel", *, axis_name: Any = "data"
) -> Any:
    """Returns :func:`state_specs` as ``NamedSharding``s on ``mesh``.

    Use them to place a state (``jax.device_put(state, shardings)``), to describe one
    without allocating it (``jax.ShapeDtypeStruct(..., sharding=...)`` for
    :func:`jaxga.memory_report` or an orbax restore onto another device count), or as
    ``out_shardings`` of a jitted initialiser, so that the state is never whole on one
    device.

    Example:
        >>> import jax, jax.numpy as jnp, optax, jaxga
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> state = jaxga.TrainState.create(params={"w": jnp.zeros((8, 16))}, tx=optax.sgd(0.1))
        >>> state = jax.device_put(state, jaxga.sharding.state_shardings(state, mesh, "fsdp"))
        >>> tuple(state.params["w"].sharding.spec)
        (None, 'data')
    """
    specs = state_specs(state, mesh, strategy, axis_name=axis_name)
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P)
    )
