"""What runs inside ``shard_map`` over a named mesh axis: varying casts and reductions."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["axes", "check_axis_bound", "psum_invariant", "psum_varying", "varying", "varying_axes"]


def axes(axis_name: Any) -> tuple[Any, ...]:
    """``axis_name`` as a tuple of axis names (a name, or a tuple of names)."""
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def varying_axes(x: Any) -> frozenset:
    """The mesh axes over which ``x`` varies (empty outside ``shard_map``)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax 0.10: ShapedArray.mat.varying; older: .vma
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def check_axis_bound(axis_name: Any) -> None:
    """Raises a ``ValueError`` unless ``axis_name`` is bound by an enclosing map.

    Example:
        >>> import jaxga
        >>> try:
        ...     jaxga.collectives.check_axis_bound("data")
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

    The gradient of a value marked varying stays local to its device: no all-reduce
    per micro-batch, one after the loop (:func:`psum_invariant`).

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> f = lambda w: print(jax.typeof(jaxga.collectives.varying(w, "data"))) or w
        >>> _ = jax.shard_map(f, mesh=mesh, in_specs=jax.P(), out_specs=jax.P())(jnp.ones(2))
        float32[2]{V:data}
    """
    if axis_name is None:
        return tree

    def cast(x):
        missing = tuple(a for a in axes(axis_name) if a not in varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def psum_invariant(tree: Any, like: Any, axis_name: Any) -> Any:
    """Sums ``tree`` over ``axis_name``, except over the axes the matching leaf of ``like`` varies.

    A replicated parameter gets the sum of all devices' gradients; a sharded one keeps
    its own. Leaves summed over the same axes share one ``psum``.

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> def f(w):
        ...     g = jaxga.collectives.varying(w, "data")
        ...     return jaxga.collectives.psum_invariant(g, w, "data")
        >>> jax.shard_map(f, mesh=mesh, in_specs=jax.P(), out_specs=jax.P())(jnp.ones(2))
        Array([1., 1.], dtype=float32)
    """
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, like_leaf in enumerate(treedef.flatten_up_to(like)):
        over = tuple(a for a in axes(axis_name) if a not in varying_axes(like_leaf))
        groups.setdefault(over, []).append(i)
    for over, indices in groups.items():
        if over:
            summed = jax.lax.psum([leaves[i] for i in indices], over)
            for i, x in zip(indices, summed):
                leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def psum_varying(tree: Any) -> Any:
    """Sums each leaf over the mesh axes it varies over (bools: whether any device is true).

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> f = lambda x: jaxga.collectives.psum_varying(jnp.sum(x))
        >>> x = jax.device_put(jnp.arange(4.0), jax.NamedSharding(mesh, jax.P("data")))
        >>> float(jax.shard_map(f, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P())(x))
        6.0
    """

    def reduce(x):
        over = tuple(sorted(varying_axes(x), key=str))
        if not over:
            return x
        if x.dtype == jnp.bool_:
            return jax.lax.psum(x.astype(jnp.int32), over) > 0
        return jax.lax.psum(x, over)

    return jax.tree.map(reduce, tree)
