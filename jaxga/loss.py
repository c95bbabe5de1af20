"""Means kept as numerator and denominator, so that they can be combined exactly."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

__all__ = ["Mean", "as_mean", "token_cross_entropy"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mean:
    """A mean kept as its numerator ``total`` and denominator ``count``.

    A loss that averages over a variable number of items (tokens that are not
    padding, weighted examples) cannot be averaged again per micro-batch: the mean
    of means over-weights short micro-batches. Return a ``Mean`` instead and jaxga
    adds totals and counts over micro-batches, devices and accumulation calls, and
    divides once. ``count`` is treated as a constant: no gradient flows through it.

    Means add exactly: ``Mean(a, n) + Mean(b, m) == Mean(a + b, n + m)``.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> m = jaxga.Mean.of(jnp.array([1.0, 2.0, 9.0]), where=jnp.array([1, 1, 0]))
        >>> float(m.value), float((m + jaxga.Mean(6.0, 1.0)).value)
        (1.5, 3.0)
    """

    total: jax.Array
    count: jax.Array

    @property
    def value(self) -> jax.Array:
        """The mean itself, ``total / count``."""
        return self.total / self.count

    def __add__(self, other: Mean) -> Mean:
        if not isinstance(other, Mean):
            return NotImplemented
        return Mean(self.total + other.total, self.count + other.count)

    @classmethod
    def of(cls, values: jax.Array, where: jax.Array | None = None) -> Mean:
        """Returns the mean of ``values``, counting only items where ``where`` is non-zero.

        ``where`` may be a boolean mask or non-negative per-item weights, broadcastable
        to ``values`` (as in NumPy, aligned on the trailing axes: per-row weights of a
        ``[B, T]`` array have shape ``[B, 1]``); the count is then the sum of the weights.
        Items of weight 0 are left out of the value even when they hold a NaN or an inf;
        their gradient is 0 unless their own is not finite (``log(0)``, say): compute
        such values on safe inputs (``jnp.where(mask, x, 1)``) to keep it finite.

        Example:
            >>> import jax.numpy as jnp, jaxga
            >>> float(jaxga.Mean.of(jnp.array([2.0, 4.0])).value)
            3.0
        """
        values = jnp.asarray(values)
        # Sums of many low-precision items lose counts (bfloat16 has 8 bits of mantissa).
        dtype = jnp.promote_types(values.dtype, jnp.float32)
        values = values.astype(dtype)
        if where is None:
            return cls(jnp.sum(values), jnp.asarray(values.size, dtype))
        if not _broadcasts_to(jnp.shape(where), values.shape):
            raise ValueError(
                f"Mean.of: `where` must broadcast to the shape of `values` {values.shape}; "
                f"got {jnp.shape(where)}."
            )
        weights = jnp.broadcast_to(jnp.asarray(where), values.shape).astype(dtype)
        if not isinstance(weights, jax.core.Tracer) and not bool(
            jnp.all(jnp.isfinite(weights) & (weights >= 0))
        ):
            raise ValueError(
                "Mean.of: `where` must hold a mask or finite, non-negative weights; it holds "
                "NaN, inf or negative values. (Under jit this cannot be checked: such weights "
                "give a NaN or wrong mean.)"
            )
        # a select, not only a product: a masked-out item may hold a NaN or an inf
        return cls(jnp.sum(jnp.where(weights != 0, values * weights, 0)), jnp.sum(weights))


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return jnp.broadcast_shapes(shape, target) == tuple(target)
    except ValueError:
        return False


def as_mean(value: Mean | jax.Array) -> Mean:
    """Returns ``value`` as a :class:`Mean`; a plain scalar is a mean over one item.

    Example:
        >>> import jaxga
        >>> jaxga.as_mean(2.5)
        Mean(total=2.5, count=1.0)
    """
    if isinstance(value, Mean):
        return value
    try:
        dtype = jnp.result_type(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"as_mean: `value` must be a jaxga.Mean or a float; got {value!r} "
            f"of type {type(value).__name__}."
        )
    return Mean(value, 1.0)


def token_cross_entropy(
    logits: jax.Array, labels: jax.Array, mask: jax.Array | None = None
) -> Mean:
    """Returns the softmax cross-entropy of integer ``labels`` as a :class:`Mean` over tokens.

    Args:
        logits: ``[..., vocab]`` unnormalised log-probabilities.
        labels: ``[...]`` integer targets in ``[0, vocab)``; those of tokens the mask
            leaves out may be anything (e.g. ``-100`` for padding).
        mask: optional, broadcastable to ``labels``; tokens where it is zero (padding)
            are not counted, and non-zero values weigh tokens.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> logits = jnp.zeros((2, 3, 5))
        >>> labels = jnp.zeros((2, 3), jnp.int32)
        >>> m = jaxga.token_cross_entropy(logits, labels, mask=jnp.array([[1, 1, 0], [1, 0, 0]]))
        >>> float(m.count), round(float(m.value), 4)
        (3.0, 1.6094)
    """
    logits = jnp.asarray(logits)
    labels = jnp.asarray(labels)
    if logits.ndim == 0 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(
            f"token_cross_entropy: `logits` must be a float array [..., vocab]; got shape "
            f"{logits.shape} and dtype {logits.dtype}."
        )
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(
            f"token_cross_entropy: `labels` must be integer token ids; got dtype {labels.dtype}."
        )
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"token_cross_entropy: `logits` has shape {logits.shape}, so `labels` must have "
            f"shape {logits.shape[:-1]}; got {labels.shape}."
        )
    if mask is not None and not _broadcasts_to(jnp.shape(mask), labels.shape):
        raise ValueError(
            f"token_cross_entropy: `mask` must broadcast to the shape of `labels` "
            f"{labels.shape}; got {jnp.shape(mask)}."
        )
    if mask is not None:  # the labels of tokens left out are not looked up
        labels = jnp.where(jnp.broadcast_to(jnp.asarray(mask), labels.shape) != 0, labels, 0)
    if not isinstance(labels, jax.core.Tracer) and labels.size:
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= logits.shape[-1]:
            raise ValueError(
                f"token_cross_entropy: `labels` of counted tokens must lie in "
                f"[0, {logits.shape[-1]}) for a vocabulary of {logits.shape[-1]}; got labels "
                f"from {low} to {high}."
            )
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return Mean.of(losses, where=mask)
