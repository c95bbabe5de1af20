"""Splitting a batch into micro-batches and merging per-micro-batch outputs back."""

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxga import _checks, meshes


class IndivisibleBatchError(ValueError):
    """A batch that the devices × micro-batches do not divide."""

    @classmethod
    def of(cls, size: int, num_microbatches: int, devices: int = 1, axis_name: Any = None):
        """The error for a batch of ``size`` rows that ``num_microbatches`` × ``devices``
        (along ``axis_name``) do not divide, every number named."""
        k, on, times = num_microbatches, "", ""
        if axis_name is not None:
            axis_name = (
                axis_name[0] if isinstance(axis_name, tuple) and len(axis_name) == 1 else axis_name
            )
            on = f" ({size // devices} per device on {devices} devices of axis {axis_name!r})"
            times = f" × {devices} devices = {devices * k}"
        return cls(f"The batch size {size}{on} is not divisible by num_microbatches={k}{times}.")


def split_microbatches(batch: Any, num_microbatches: int, *, name: str = "batch") -> Any:
    """Splits each leaf of ``batch`` into ``[k, B // k, ...]``, ``k = num_microbatches``, strided.

    Args:
        batch: a pytree of arrays with one leading size ``B``.
        num_microbatches: ``k``, a positive int dividing ``B``.
        name: what to call ``batch`` in an error (an argument's name).

    Returns:
        ``batch`` with each leaf ``[k, B // k, ...]``: micro-batch ``i`` holds rows ``i, i +
        k, ...`` (each device's rows stay on it).

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> jaxga.split_microbatches(jnp.arange(6), 2).tolist()
        [[0, 2, 4], [1, 3, 5]]
    """
    k = _checks.positive_int(num_microbatches, "num_microbatches")
    size = _checks.leading_size(batch, name, "batch") or 0  # 0: no leaves
    if size % k:
        error = IndivisibleBatchError.of(size, k)
        raise IndivisibleBatchError(f"`{name}`: {error}")
    return jax.tree.map(lambda x: _split(jnp.asarray(x), k), batch)


def _reshaped(x: jax.Array, shape: tuple[int, ...], head: int, leading: tuple) -> jax.Array:
    """``x`` reshaped; on Explicit axes, its first ``head`` axes' entries become ``leading``."""
    sharding = jax.typeof(x).sharding
    if not meshes.is_explicit(sharding):
        return jnp.reshape(x, shape)  # JAX infers the layout
    mesh = getattr(getattr(x, "sharding", None), "mesh", sharding.mesh)  # concrete if it can
    entries = (*sharding.spec.partitions, *[None] * x.ndim)[: x.ndim]
    where = NamedSharding(mesh, P(*leading, *entries[head:]))
    return jnp.reshape(x, shape, out_sharding=where)


def _row_entry(x: jax.Array) -> Any:  # the mesh axes x's leading axis is split over
    return (*jax.typeof(x).sharding.spec.partitions, None)[0]


def _split(x: jax.Array, k: int) -> jax.Array:
    # [B] -> [B // k, k] -> [k, B // k]: micro-batch i holds rows i, i + k, ..., and each
    # device's rows of a batch split over a mesh axis stay on it (no communication)
    shape = (x.shape[0] // k, k, *x.shape[1:])
    return jnp.swapaxes(_reshaped(x, shape, 1, (_row_entry(x), None)), 0, 1)


def merge_microbatches(tree: Any) -> Any:
    """Undoes `jaxga.split_microbatches`: leaves `[k, B // k, ...]` back to `[B, ...]`.

    Args:
        tree: a pytree whose leaves are ``[k, B // k, ...]`` (a scan's stacked outputs).

    Returns:
        ``tree`` with each leaf ``[B, ...]``, rows in the batch's order.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> jaxga.merge_microbatches(jaxga.split_microbatches(jnp.arange(6), 3)).tolist()
        [0, 1, 2, 3, 4, 5]
    """
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if short := [(path, jnp.shape(x)) for path, x in leaves if jnp.ndim(x) < 2]:
        path, shape = short[0]
        got = f"`tree`{jax.tree_util.keystr(path)} of shape {shape}"
        raise ValueError(f"merge_microbatches: leaves must be [k, B // k, ...]; got {got}.")
    return jax.tree.map(_merge, tree)


def _merge(x: jax.Array) -> jax.Array:
    rows = jnp.swapaxes(x, 0, 1)
    return _reshaped(rows, (-1, *x.shape[2:]), 2, (_row_entry(rows),))
