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
    size = _checks.leading_size(batch, name, "batch") or 0  # 0: no leaves
    if size % k:
        raise IndivisibleBatchError.of(size, k)
    # column-major: micro-batch i holds rows i, i + k, ... (a row-sharded batch stays sharded)
    return optax.microbatching.reshape_batch_axis(jax.tree.map(jnp.asarray, batch), size // k)


def merge_microbatches(tree: Any) -> Any:
    """Undoes `jaxga.split_microbatches`: leaves `[k, B // k, ...]` back to `[B, ...]`.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> jaxga.merge_microbatches(jaxga.split_microbatches(jnp.arange(6), 3)).tolist()
        [0, 1, 2, 3, 4, 5]
    """
    if short := [s for s in map(jnp.shape, jax.tree.leaves(tree)) if len(s) < 2]:
        raise ValueError(f"merge_microbatches: leaves must be [k, B // k, ...]; got {short[0]}.")
    return jax.tree.map(lambda x: jax.lax.collapse(jnp.swapaxes(x, 0, 1), 0, 2), tree)
