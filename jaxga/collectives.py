"""What runs inside ``shard_map`` over a named mesh axis: varying casts and reductions."""

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["axes", "check_axis_bound", "psum_invariant", "psum_varying", "varying", "varying_axes"]


def axes(axis_name: Any) -> tuple[Any, ...]:
    """Returns ``axis_name``, a name or a tuple of names, as a tuple of names."""
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def varying_axes(x: Any) -> frozenset:
    """Returns the mesh axes ``x`` varies over (none outside ``shard_map``)."""
    return jax.typeof(x).mat.varying


def _invariant(x: Any, axis_name: Any) -> tuple[Any, ...]:
    return tuple(a for a in axes(axis_name) if a not in varying_axes(x))


def check_axis_bound(axis_name: Any) -> None:
    """Raises a ``ValueError`` unless ``axis_name`` is bound by an enclosing map."""
    try:
        jax.lax.axis_index(axis_name)
    except NameError:
        message = "is not bound: call it inside a jax.shard_map over it, or pass axis_name=None."
        raise ValueError(f"`axis_name`={axis_name!r} {message}") from None


def varying(tree: Any, axis_name: Any) -> Any:
    """Returns ``tree`` with every leaf varying over ``axis_name`` (``None``: as it is).

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> def f(w):
        ...     return print(jax.typeof(jaxga.collectives.varying(w, "data"))) or w
        >>> _ = jax.shard_map(f, mesh=jax.make_mesh((1,), ["data"]), out_specs=jax.P())(jnp.ones(2))
        float32[2]{V:data}
    """
    if axis_name is None:
        return tree
    return jax.tree.map(lambda x: jax.lax.pcast(x, _invariant(x, axis_name), to="varying"), tree)


def psum_invariant(tree: Any, like: Any, axis_name: Any) -> Any:
    """Returns ``tree`` summed over ``axis_name``, but for the axes ``like``'s leaves vary over."""
    leaves, treedef = jax.tree.flatten(tree)
    over = [_invariant(x, axis_name) for x in treedef.flatten_up_to(like)]
    for group in dict.fromkeys(over):  # one psum per group of axes
        indices = [i for i, o in enumerate(over) if o == group]
        for i, x in zip(indices, jax.lax.psum([leaves[i] for i in indices], group)):
            leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def psum_varying(tree: Any) -> Any:
    """Returns each leaf summed over the mesh axes it varies over (bools: any device true)."""

    def reduce(x):
        over = tuple(sorted(varying_axes(x), key=str))  # () a no-op
        if x.dtype == jnp.bool_ and over:
            return jax.lax.psum(x.astype(jnp.int32), over) > 0
        return jax.lax.psum(x, over)

    return jax.tree.map(reduce, tree)
