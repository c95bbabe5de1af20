"""Splitting a batch into micro-batches and merging per-micro-batch outputs back."""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxga import _checks


class IndivisibleBatchError(ValueError):
    """A batch that the devices × micro-batches do not divide."""

    @classmethod
    def of(cls, size: int, num_microbatches: int, devices: int = 1, axis_name: Any = None):
        """The error for a global batch of ``size`` rows."""
        k, on, times = num_microbatches, "", ""
        if axis_name is not None:
            on = f" ({size // devices} per device on {devices} devices of axis {axis_name!r})"
            times = f" × {devices} devices = {devices * k}"
        return cls(f"The batch size {size}{on} is not divisible by num_microbatches={k}{times}.")


def split_microbatches(batch: Any, num_microbatches: int, *, name: str = "batch") -> Any:
    """Splits each leaf of ``batch`` into ``[k, B // k, ...]``, ``k = num_microbatches``, strided.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> jaxga.split_microbatches(jnp.arange(6), 2).tolist()
        [[0, 2, 4], [1, 3, 5]]
    """
    k = _checks.positive_int(num_microbatches, "num_microbatches")
    size = _checks.leading_size(batch, name, "batch")
    if size is not None and size % k:
        raise IndivisibleBatchError.of(size, k)
    if size is None:
        return batch
    # optax's reshape is column-major: micro-batch i holds rows i, i + k, ... (and a batch
    # sharded along its rows stays sharded along each micro-batch's)
    return optax.microbatching.reshape_batch_axis(jax.tree.map(jnp.asarray, batch), size // k)


def merge_microbatches(tree: Any) -> Any:
    """Undoes `jaxga.split_microbatches`: leaves `[k, B // k, ...]` back to `[B, ...]`.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> jaxga.merge_microbatches(jaxga.split_microbatches(jnp.arange(6), 3)).tolist()
        [0, 1, 2, 3, 4, 5]
    """

    def merge(x):
        shape = jnp.shape(x)
        if len(shape) < 2:
            raise ValueError(f"merge_microbatches: leaves must be [k, B // k, ...]; got {shape}.")
        return jnp.reshape(jnp.swapaxes(x, 0, 1), (shape[0] * shape[1], *shape[2:]))

    return jax.tree.map(merge, tree)
