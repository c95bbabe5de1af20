"""Means kept as numerator and denominator, so that they combine exactly."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["Mean", "as_mean", "token_cross_entropy"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mean:
    """A mean kept as its numerator ``total`` and denominator ``count``; means add exactly.

    Example:
        >>> import jaxga
        >>> float((jaxga.Mean(3.0, 2.0) + jaxga.Mean(6.0, 1.0)).value)
        3.0
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
        """Returns the mean of ``values`` over the items where ``where`` is non-zero.

        Args:
            values: an array of numbers, summed in at least float32.
            where: a mask or non-negative weights broadcastable to ``values``. Under jit
                NaN or negative weights cannot be checked: they give a wrong mean.

        Example:
            >>> import jax.numpy as jnp, jaxga
            >>> float(jaxga.Mean.of(jnp.array([1.0, 2.0, 9.0]), where=jnp.array([1, 1, 0])).value)
            1.5
        """
        values = _array(values, "Mean.of: `values`", "an array of numbers", jnp.number, jnp.bool)
        dtype = jnp.promote_types(values.dtype, jnp.float32)  # counts survive long sums
        where = 1 if where is None else where
        weights = _broadcast(where, values.shape, "Mean.of: `where`", "`values`").astype(dtype)
        ok = jnp.all((weights >= 0) & (weights < jnp.inf))  # False for NaN too
        _check_eagerly(ok, "Mean.of: `where` must hold a mask or finite, non-negative weights")
        # a select, not only a product: a masked-out item may hold a NaN or an inf
        return cls(jnp.sum(jnp.where(weights != 0, values * weights, 0)), jnp.sum(weights))


def _array(value: Any, name: str, expected: str, *kinds: Any) -> jax.Array:
    try:
        array = jnp.asarray(value)
    except (TypeError, ValueError):  # None, strings, objects
        array = None
    if array is None or not any(jnp.issubdtype(array.dtype, kind) for kind in kinds):
        got = getattr(value, "dtype", None)
        got = f"dtype {got}" if got is not None else f"{value!r} of type {type(value).__name__}"
        raise TypeError(f"{name} must be {expected}; got {got}.")
    return array


def _check_eagerly(ok: jax.Array, message: str) -> None:
    if not isinstance(ok, jax.core.Tracer) and not ok:  # a traced value is not known yet
        raise ValueError(f"{message}.")


def _broadcast(value: Any, shape: tuple[int, ...], name: str, of: str) -> jax.Array:
    try:
        return jnp.broadcast_to(jnp.asarray(value), shape)
    except ValueError:
        message = f"{name} must broadcast to the shape of {of} {shape}; got {jnp.shape(value)}."
        raise ValueError(message) from None


def as_mean(value: Mean | jax.Array) -> Mean:
    """Returns ``value`` as a :class:`Mean`; a float scalar is a mean over one item.

    Example:
        >>> import jaxga
        >>> jaxga.as_mean(2.5)
        Mean(total=2.5, count=1.0)
    """
    if isinstance(value, Mean):
        return value
    _array(value, "as_mean: `value`", "a float scalar or a jaxga.Mean", jnp.floating)
    return Mean(value, 1.0)


def token_cross_entropy(logits: jax.Array, labels: jax.Array, mask: Any = None) -> Mean:
    """Returns the softmax cross-entropy of integer ``labels`` as a :class:`Mean` over tokens.

    Args:
        logits: ``[..., vocab]`` unnormalised log-probabilities.
        labels: ``[...]`` integer targets in ``[0, vocab)``; anything where ``mask`` is 0.
        mask: optional weights broadcastable to ``labels``; 0 leaves a token out.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> m = jaxga.token_cross_entropy(jnp.zeros((2, 5)), jnp.array([0, 3]), jnp.array([1, 0]))
        >>> float(m.count), round(float(m.value), 4)
        (1.0, 1.6094)
    """
    name, expected = "token_cross_entropy: `logits`", "a float array [..., vocab]"
    logits = _array(logits, name, expected, jnp.floating)
    labels = _array(labels, "token_cross_entropy: `labels`", "integer token ids", jnp.integer)
    if not logits.ndim or logits.shape[:-1] != labels.shape:
        shapes = f"for `labels` of shape {labels.shape}; got shape {logits.shape}"
        raise TypeError(f"{name} must be {expected} {shapes}.")
    if mask is not None:  # the labels of tokens left out are not looked up
        mask = _broadcast(mask, labels.shape, "token_cross_entropy: `mask`", "`labels`")
        labels = jnp.where(mask != 0, labels, 0)
    vocab, (low, high) = logits.shape[-1], (labels.min(), labels.max()) if labels.size else (0, 0)
    where = f"`labels` of counted tokens must lie in [0, {vocab}) for a vocabulary of {vocab}"
    _check_eagerly(
        (low >= 0) & (high < vocab), f"token_cross_entropy: {where}; got {low} to {high}"
    )
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return Mean.of(losses, where=mask)
