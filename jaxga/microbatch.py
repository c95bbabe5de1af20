"""Splitting a batch into micro-batches and merging per-micro-batch outputs back."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxga import _checks

__all__ = ["IndivisibleBatchError", "merge_microbatches", "split_microbatches"]


class IndivisibleBatchError(ValueError):
    """A batch that the devices × micro-batches do not divide."""

    @classmethod
    def of(cls, size: int, num_microbatches: int, devices: int = 1, axis_name: Any = None):
        """The error for a global batch of ``size`` rows."""
        if axis_name is None:
            return cls(
                f"The batch size {size} is not divisible by num_microbatches={num_microbatches}."
            )
        return cls(
            f"The global batch of {size} ({size // devices} per device on {devices} devices "
            f"of axis {axis_name!r}) is not divisible by devices × num_microbatches = "
            f"{devices} × {num_microbatches} = {devices * num_microbatches}."
        )


def split_microbatches(batch: Any, num_microbatches: int, *, name: str = "batch") -> Any:
    """Splits the leading axis of every leaf of ``batch`` into ``num_microbatches``.

    Returns leaves of shape ``[k, B // k, ...]``; micro-batch ``i`` holds rows
    ``i, i + k, i + 2k, ...``, so a batch sharded along its leading axis stays evenly
    sharded within every micro-batch.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> jaxga.split_microbatches(jnp.arange(6), 2).tolist()
        [[0, 2, 4], [1, 3, 5]]
    """
    k = _checks.positive_int(num_microbatches, "num_microbatches")
    size = _checks.leading_size(batch, name, "batch")
    if size is not None and size % k:
        raise IndivisibleBatchError.of(size, k)

    def split(x):
        x = jnp.asarray(x)
        return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def merge_microbatches(tree: Any) -> Any:
    """Undoes :func:`split_microbatches`: ``[k, B // k, ...]`` leaves back to ``[B, ...]``.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> x = jnp.arange(6)
        >>> jaxga.merge_microbatches(jaxga.split_microbatches(x, 3)).tolist()
        [0, 1, 2, 3, 4, 5]
    """

    def merge(x):
        x = jnp.asarray(x)
        if x.ndim < 2:
            raise ValueError(
                f"merge_microbatches: every leaf needs a micro-batch axis and a batch axis; "
                f"got a leaf of shape {x.shape}."
            )
        return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])

    return jax.tree.map(merge, tree)
