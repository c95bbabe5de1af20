"""Train states and batches on a mesh: layouts (ZeRO-1, FSDP...) and the sharded loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxga import _checks, collectives
from jaxga.accumulation import Accumulated
from jaxga.collectives import check_axis_bound, psum_invariant, psum_varying, varying
from jaxga.microbatch import IndivisibleBatchError

__all__ = [
    "STRATEGIES",
    "IndivisibleBatchError",
    "check_axis_bound",
    "fsdp_spec",
    "fsdp_specs",
    "psum_invariant",
    "psum_varying",
    "put",
    "replicate",
    "shard_batch",
    "state_shardings",
    "state_specs",
    "varying",
]

STRATEGIES = ("data_parallel", "zero1", "fsdp", "zero3")
_is_spec = lambda x: isinstance(x, P)


def check_mesh(mesh: Any, axis_name: Any = None, concrete: bool = False) -> None:
    """Raises unless ``mesh`` is a mesh (``concrete``: not abstract) with ``axis_name``."""
    kinds = (Mesh,) if concrete else (Mesh, jax.sharding.AbstractMesh)
    if not isinstance(mesh, kinds):
        raise TypeError(
            f"`mesh` must be a jax.sharding.Mesh (e.g. jax.make_mesh((n,), ('data',))); "
            f"got {mesh!r} of type {type(mesh).__name__}."
        )
    for axis in () if axis_name is None else collectives.axes(axis_name):
        if axis not in mesh.axis_names:
            raise ValueError(f"`axis_name`={axis!r} is not an axis of `mesh` {mesh.axis_names}.")


def check_strategy(strategy: Any) -> None:
    """Raises for a strategy name that is not one of :data:`STRATEGIES`."""
    if isinstance(strategy, str) and strategy not in STRATEGIES:
        raise ValueError(
            f"`strategy` must be one of {', '.join(map(repr, STRATEGIES))} or a tree of "
            f"PartitionSpecs for the parameters; got {strategy!r}."
        )


def shard_batch(batch: Any, mesh: Mesh, axis_name: Any = "data") -> Any:
    """Places this process's rows of a batch on ``mesh``, split over ``axis_name``.

    On one process ``batch`` is the global batch; under ``jax.distributed`` each process
    passes its own rows and gets global arrays, as
    ``jax.make_array_from_process_local_data`` does. Global arrays already placed are kept.

    Example:
        >>> import jax, numpy as np, jaxga
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> batch = jaxga.sharding.shard_batch({"x": np.ones((8, 3))}, mesh)
        >>> batch["x"].shape, batch["x"].sharding.spec
        ((8, 3), P('data',))
    """
    check_mesh(mesh, axis_name, concrete=True)
    sharding = NamedSharding(mesh, P(axis_name))
    shards = int(np.prod([mesh.local_mesh.shape[a] for a in collectives.axes(axis_name)]))

    def place(path, x):
        if isinstance(x, jax.Array) and x.ndim:  # already global rows: keep or reshard
            same_mesh = isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
            if same_mesh and x.sharding.is_equivalent_to(sharding, x.ndim):
                return x
            if not x.is_fully_addressable:
                return jax.device_put(x, sharding)
        shape = np.shape(x)
        if not shape or shape[0] % shards:
            got = f"shape {shape}" if shape else "a scalar"
            raise ValueError(
                f"shard_batch: batch{jax.tree_util.keystr(path)} has {got}; its leading axis "
                f"(this process's rows) must be divisible by the {shards} shard(s) of mesh "
                f"axis {axis_name!r} held by this process's devices."
            )
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree_util.tree_map_with_path(place, batch)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Places ``tree`` on every device of ``mesh`` (every process passes the same values).

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> jaxga.sharding.replicate({"w": jnp.zeros(3)}, mesh)["w"].sharding.is_fully_replicated
        True
    """
    check_mesh(mesh, concrete=True)
    return jax.tree.map(lambda x: put(x, NamedSharding(mesh, P())), tree)


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """``jax.device_put``, for typed PRNG keys too under ``jax.distributed``.

    Example:
        >>> import jax, jaxga
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> key = jaxga.sharding.put(jax.random.key(0), jax.NamedSharding(mesh, jax.P()))
        >>> key.sharding.is_fully_replicated
        True
    """
    if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):  # its data travels
        data = jax.device_put(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(x, sharding)


def fsdp_spec(shape: tuple[int, ...], size: int, axis_name: Any = "data") -> P:
    """The spec splitting the largest axis of ``shape`` that ``size`` devices divide (or ``P()``).

    Example:
        >>> from jaxga.sharding import fsdp_spec
        >>> tuple(fsdp_spec((768, 3072), 8)), tuple(fsdp_spec((10,), 8))
        ((None, 'data'), ())
    """
    size = _checks.positive_int(size, "size")
    dims = [i for i, n in enumerate(shape) if n >= size and n % size == 0]
    if not dims:
        return P()
    dim = max(dims, key=lambda i: (shape[i], -i))
    return P(*(axis_name if i == dim else None for i in range(dim + 1)))


def fsdp_specs(tree: Any, mesh: Mesh, axis_name: Any = "data") -> Any:
    """:func:`fsdp_spec` for every leaf of ``tree`` over ``mesh``'s ``axis_name``.

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> mesh = jax.sharding.AbstractMesh((8,), ("data",))
        >>> specs = jaxga.sharding.fsdp_specs({"w": jnp.zeros((4, 8)), "b": jnp.zeros(3)}, mesh)
        >>> tuple(specs["w"]), tuple(specs["b"])
        ((None, 'data'), ())
    """
    check_mesh(mesh, axis_name)
    return jax.tree.map(lambda x: fsdp_spec(jnp.shape(x), mesh.shape[axis_name], axis_name), tree)


def _check_param_specs(specs: Any, params: Any, size: int, axis_name: Any) -> Any:
    if jax.tree.structure(specs, is_leaf=_is_spec) != jax.tree.structure(params):
        raise ValueError(
            f"`strategy`, a tree of PartitionSpecs, must have the structure of the parameters, "
            f"{jax.tree.structure(params)}; got {jax.tree.structure(specs, is_leaf=_is_spec)}."
        )
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, x), spec in zip(flat, jax.tree.leaves(specs, is_leaf=_is_spec)):
        where, shape = f"params{jax.tree_util.keystr(path)}", jnp.shape(x)
        if not _is_spec(spec) or len(spec) > len(shape):
            raise ValueError(
                f"The spec for {where} must be a PartitionSpec of at most {len(shape)} "
                f"entries (its shape is {shape}); got {spec!r}."
            )
        for dim, entry in enumerate(spec):
            if entry is not None and entry != axis_name:
                raise ValueError(
                    f"The spec for {where}, {spec}, names {entry!r}; jaxga shards the state "
                    f"over the data axis {axis_name!r} only."
                )
            if entry is not None and shape[dim] % size:
                raise ValueError(
                    f"The spec for {where}, {spec}, splits its axis {dim} of size "
                    f"{shape[dim]} over the {size} devices of {axis_name!r}, which do not "
                    f"divide it."
                )
    return specs


def state_specs(
    state: Any, mesh: Mesh, strategy: Any = "data_parallel", *, axis_name: Any = "data"
) -> Any:
    """The PartitionSpec of every leaf of a train state under ``strategy``.

    Args:
        state: a ``flax.training.train_state.TrainState`` (arrays or shape structs).
        mesh: the mesh (an abstract one will do).
        strategy: ``"data_parallel"`` (all replicated), ``"zero1"`` (optimiser state
            sharded), ``"fsdp"`` or ``"zero3"`` (parameters and optimiser state sharded by
            :func:`fsdp_spec`), or a tree of parameter specs (FSDP with those specs;
            optimiser state shaped like the parameters follows them).
        axis_name: the mesh axis to shard over.

    Returns:
        A tree of specs with the structure of ``state``.

    Example:
        >>> import jax, jax.numpy as jnp, optax, jaxga
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> state = jaxga.TrainState.create(params={"w": jnp.zeros((8, 16))}, tx=optax.adam(0.1))
        >>> specs = jaxga.sharding.state_specs(state, mesh, "fsdp")
        >>> tuple(specs.params["w"]), tuple(specs.opt_state[0].mu["w"]), tuple(specs.step)
        ((None, 'data'), (None, 'data'), ())
    """
    check_mesh(mesh, axis_name)
    check_strategy(strategy)
    if not (hasattr(state, "params") and hasattr(state, "opt_state")):
        raise TypeError(
            f"`state` must be a train state with `params` and `opt_state` (jaxga.TrainState "
            f"or Flax's); got {type(state).__name__}."
        )
    specs = jax.tree.map(lambda _: P(), state)
    if strategy == "data_parallel":
        return specs
    opt_specs = fsdp_specs(state.opt_state, mesh, axis_name)
    if isinstance(strategy, str):
        sharded = strategy in ("fsdp", "zero3")
        params = fsdp_specs(state.params, mesh, axis_name) if sharded else specs.params
        return specs.replace(params=params, opt_state=opt_specs)
    params = _check_param_specs(strategy, state.params, mesh.shape[axis_name], axis_name)
    opt_state = optax.tree_map_params(
        state.tx,
        lambda _, spec: spec,
        state.opt_state,
        params,
        transform_non_params=lambda tree: fsdp_specs(tree, mesh, axis_name),
        is_leaf=_is_spec,
    )
    return specs.replace(params=params, opt_state=opt_state)


def state_shardings(
    state: Any, mesh: Mesh, strategy: Any = "data_parallel", *, axis_name: Any = "data"
) -> Any:
    """:func:`state_specs` as ``NamedSharding``s on ``mesh``, e.g. for ``jax.device_put``.

    Example:
        >>> import jax, jax.numpy as jnp, optax, jaxga
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> state = jaxga.TrainState.create(params={"w": jnp.zeros((8, 16))}, tx=optax.sgd(0.1))
        >>> state = jax.device_put(state, jaxga.sharding.state_shardings(state, mesh, "fsdp"))
        >>> tuple(state.params["w"].sharding.spec)
        (None, 'data')
    """
    specs = state_specs(state, mesh, strategy, axis_name=axis_name)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=_is_spec)


# --- the train step on a mesh ---------------------------------------------------------


def place(mesh: Mesh, tree: Any, specs: Any) -> Any:
    """``tree`` constrained to ``specs`` on ``mesh`` (resharded on a mesh of explicit axes)."""
    explicit = AxisType.Explicit in mesh.axis_types

    def put_one(x, spec):
        if x is None:
            return x
        where = NamedSharding(mesh, spec)
        return jax.reshard(x, where) if explicit else jax.lax.with_sharding_constraint(x, where)

    return jax.tree.map(put_one, tree, specs, is_leaf=lambda x: x is None)


def placer(mesh: Mesh | None, strategy: Any, axis_name: Any) -> Callable[[Any], Any]:
    """Puts a state not yet on ``mesh`` where the step keeps it (arrays or shape structs);
    its step counter and first parameter tell whether it is there already."""

    def placed(x: Any, spec: P) -> bool:
        current = getattr(x, "sharding", None)
        return (
            isinstance(current, NamedSharding)
            and current.mesh == mesh
            and current.is_equivalent_to(NamedSharding(mesh, spec), len(x.shape))
        )

    def place_state(state: Any) -> Any:
        if mesh is None:
            return state
        param = next(iter(jax.tree.leaves(state.params)), None)
        if isinstance(strategy, str):
            size = mesh.shape[axis_name]
            sharded = strategy in ("fsdp", "zero3") and param is not None
            spec = fsdp_spec(param.shape, size, axis_name) if sharded else P()
        else:
            spec = jax.tree.leaves(strategy, is_leaf=_is_spec)[0]
        if placed(state.step, P()) and (param is None or placed(param, spec)):
            return state
        return jax.tree.map(
            lambda x, where: (
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where)
                if isinstance(x, jax.ShapeDtypeStruct)
                else put(x, where)
            ),
            state,
            state_shardings(state, mesh, strategy, axis_name=axis_name),
        )

    return place_state


def check_batch(batch: Any, mesh: Mesh, axis_name: Any, num_microbatches: int) -> None:
    """Names a batch the devices × micro-batches do not divide, before it is placed."""
    size = _checks.leading_size(batch, "batch", "batch")
    if size is None:
        raise ValueError(f"`batch` has no array leaves to split over the devices; got {batch!r}.")
    devices = mesh.shape[axis_name]
    if size % (devices * num_microbatches):
        raise IndivisibleBatchError.of(size, num_microbatches, devices, axis_name)


def _sharded_dim(spec: P) -> int | None:
    return next((i for i, entry in enumerate(spec) if entry is not None), None)


def accumulate_on_mesh(
    accumulated: Callable[..., Callable],
    loss: Callable[..., Any],
    mesh: Mesh,
    axis_name: Any,
    strategy: Any,
    num_microbatches: int,
    state: Any,
    batch: Any,
    *rest: Any,
) -> tuple[Any, Any, Any, Any]:
    """The train step's micro-batch loop on every device of ``mesh``.

    Returns ``(accumulated, state placed by strategy, its specs, the parameters as the
    optimiser sees them)``. Sharded parameters are gathered once before the loop and their
    gradient reduce-scattered once after it; ZeRO-3 does both in every micro-batch.
    """
    check_batch(batch, mesh, axis_name, num_microbatches)
    specs = state_specs(state, mesh, strategy, axis_name=axis_name)
    state = place(mesh, state, specs)
    kind = strategy if isinstance(strategy, str) else "fsdp"
    grad_specs = fsdp_specs(state.params, mesh, axis_name) if kind == "zero1" else specs.params
    batch = place(mesh, batch, jax.tree.map(lambda _: P(axis_name), batch))

    def gathered(tree):
        def gather(x, spec):
            dim = _sharded_dim(spec)
            return x if dim is None else jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)

        return jax.tree.map(gather, tree, specs.params, is_leaf=_is_spec)

    def scatter(g, spec):
        dim = _sharded_dim(spec)
        if dim is None:
            return g
        return jax.lax.psum_scatter(g, axis_name, scatter_dimension=dim, tiled=True)

    def local(params, batch, *rest):
        if kind == "zero3":

            def loss_on_shards(shards, batch, *rest):
                # tied to the micro-batch, so that XLA does not hoist the gather out of the loop
                shards, batch = jax.lax.optimization_barrier((shards, batch))
                return loss(gathered(shards), batch, *rest)

            return accumulated(loss_on_shards)(params, batch, *rest)
        full = jax.tree.map(  # local sums through the loop for the gradients scattered after it
            lambda x, spec: x if _sharded_dim(spec) is None else varying(x, axis_name),
            gathered(params),
            grad_specs,
            is_leaf=_is_spec,
        )
        acc = accumulated(loss)(full, batch, *rest)
        return acc._replace(grads=jax.tree.map(scatter, acc.grads, grad_specs, is_leaf=_is_spec))

    in_specs = (specs.params, P(axis_name), *(P() for _ in rest))
    out_specs = Accumulated(mean=P(), grads=grad_specs, aux=P(), state=P())
    run = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    acc = run(state.params, batch, *rest)
    return acc, state, specs, place(mesh, state.params, grad_specs)
