"""Means kept as numerator and denominator, so that they combine exactly."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mean:
    """A mean kept as its numerator ``total`` and denominator ``count``; means add exactly.

    Examples:
        >>> import jaxga
        >>> float((jaxga.Mean.of([1.0, 2.0, 9.0], where=[1, 1, 0]) + jaxga.Mean(6.0, 1.0)).value)
        3.0
    """

    total: jax.Array
    count: jax.Array

    @property
    def value(self) -> jax.Array:
        return self.total / self.count

    def __add__(self, other: "Mean") -> "Mean":
        return optax.tree.add(self, other) if isinstance(other, Mean) else NotImplemented

    @classmethod
    def of(cls, values: jax.Array, where: jax.Array | None = None) -> "Mean":
        """The mean of ``values`` weighted by ``where``. Under jit, weights cannot be checked."""
        values = _array(values, "Mean.of: `values`")
        where = _array(1 if where is None else where, "Mean.of: `where`", shape=values.shape)
        weights = where.astype(jnp.promote_types(values.dtype, jnp.float32))
        ok = jnp.all((weights >= 0) & (weights < jnp.inf))  # False for NaN too
        if not isinstance(ok, jax.core.Tracer) and not ok:  # traced: not known yet
            raise ValueError("Mean.of: `where` must hold a mask or finite, non-negative weights.")
        # a select, not only a product: a masked-out item may hold a NaN or an inf
        return cls(jnp.sum(jnp.where(weights != 0, values * weights, 0)), jnp.sum(weights))


def _array(x, name, expected="an array of numbers", kinds=(jnp.number, jnp.bool), shape=None):
    try:
        array = jnp.asarray(x)
    except (TypeError, ValueError):  # None, strings, objects
        array = None
    if array is None or not any(jnp.issubdtype(array.dtype, kind) for kind in kinds):
        got = f"dtype {x.dtype}" if hasattr(x, "dtype") else f"{x!r} of type {type(x).__name__}"
        raise TypeError(f"{name} must be {expected}; got {got}.")
    try:
        return array if shape is None else jnp.broadcast_to(array, shape)
    except ValueError:
        raise ValueError(f"{name} must broadcast to {shape}; got {array.shape}.") from None


def as_mean(value: Mean | jax.Array) -> Mean:
    """Returns ``value`` as a [`Mean`][jaxga.Mean]; a float scalar is a mean over one item.

    Examples:
        >>> import jaxga
        >>> jaxga.as_mean(2.5)
        Mean(total=2.5, count=1.0)
    """
    if isinstance(value, Mean):
        return value
    _array(value, "as_mean: `value`", "a float scalar or a jaxga.Mean", (jnp.floating,))
    return Mean(value, 1.0)


def token_cross_entropy(logits: jax.Array, labels: jax.Array, mask: Any = None) -> Mean:
    """The softmax cross-entropy of ``logits`` ``[..., vocab]`` as a `jaxga.Mean` over tokens.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> m = jaxga.token_cross_entropy(jnp.zeros((2, 5)), jnp.array([0, 3]), jnp.array([1, 0]))
        >>> float(m.count), round(float(m.value), 4)
        (1.0, 1.6094)
    """
    logits = _array(logits, "`logits`", "a float array", (jnp.floating,))
    labels = _array(labels, "`labels`", "integer token ids", (jnp.integer,))
    if not logits.ndim or logits.shape[:-1] != labels.shape:
        raise TypeError(f"`logits` {logits.shape} must be [..., vocab] for labels {labels.shape}.")
    mask = _array(1 if mask is None else mask, "`mask`", shape=labels.shape)
    labels = jnp.where(mask != 0, labels, 0)  # tokens left out: their labels are not looked up
    vocab = logits.shape[-1]
    low, high = (labels.min(), labels.max()) if labels.size else (0, 0)
    if not isinstance(low, jax.core.Tracer) and not 0 <= low <= high < vocab:  # as in Mean.of
        raise ValueError(f"counted `labels` must be in [0, {vocab}); got {low} to {high}.")
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return Mean.of(losses, where=mask)
