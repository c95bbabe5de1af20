"""Helpers for running jaxga inside ``shard_map``/``pmap`` over a named mesh axis."""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["check_axis_bound", "varying"]


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
    """
    if axis_name is None:
        return tree

    def cast(x):
        if axis_name in getattr(jax.typeof(x), "vma", frozenset()):
            return x
        return jax.lax.pcast(x, axis_name, to="varying")

    return jax.tree.map(cast, tree)


def indivisible_error(batches: Any, num_microbatches: int, axis_name: Any) -> ValueError:
    """Returns the error for a global batch not divisible by devices × micro-batches."""
    local = jax.tree.leaves(batches)[0].shape[0]
    devices = jax.lax.axis_size(axis_name)
    return ValueError(
        f"The global batch of {local * devices} ({local} per device on {devices} devices of "
        f"axis {axis_name!r}) is not divisible by devices × num_microbatches = {devices} × "
        f"{num_microbatches} = {devices * num_microbatches}."
    )
