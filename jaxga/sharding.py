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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "check_axis_bound",
    "indivisible_error",
    "psum_invariant",
    "replicate",
    "shard_batch",
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


def indivisible_error(batches: Any, num_microbatches: int, axis_name: Any) -> ValueError:
    """Returns the error for a global batch not divisible by devices × micro-batches."""
    local = jax.tree.leaves(batches)[0].shape[0]
    devices = jax.lax.axis_size(axis_name)
    return ValueError(
        f"The global batch of {local * devices} ({local} per device on {devices} devices of "
        f"axis {axis_name!r}) is not divisible by devices × num_microbatches = {devices} × "
        f"{num_microbatches} = {devices * num_microbatches}."
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
    sharding = NamedSharding(mesh, P())

    def put(x):
        if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
            # device_put takes a typed key to one process's devices only; its data travels.
            data = jax.device_put(jax.random.key_data(x), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.device_put(x, sharding)

    return jax.tree.map(put, tree)
