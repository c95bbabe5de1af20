"""Means kept as numerator and denominator, so that they combine exactly."""

import dataclasses
import math
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
    def of(
        cls,
        values: jax.Array,
        where: jax.Array | None = None,
        *,
        normalize: str = "token_mean",
        segment_ids: jax.Array | None = None,
    ) -> "Mean":
        """The mean of ``values`` weighted by ``where``, over tokens or over sequences.

        Args:
            values: the items' values; `[..., tokens]` for the sequence normalisations.
            where: a mask or finite, non-negative weights (Under jit, they cannot be checked).
            normalize: `"token_mean"`, `"sequence_mean"` or `"sequence_sum"` (the docs' table).
            segment_ids: ints: one sequence a row and id > 0, <= 0 padding; `None`: a row.

        Returns:
            A `Mean` whose count is Σ w (token_mean) or the number of sequences with weight.

        Examples:
            >>> import jaxga
            >>> ids = [[1, 1, 2]]  # one row packing two sequences: (1 + 3) / 2, and 4
            >>> m = jaxga.Mean.of([[1.0, 3.0, 4.0]], segment_ids=ids, normalize="sequence_mean")
            >>> float(m.total), float(m.count)
            (6.0, 2.0)
        """
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"`normalize` must be one of {NORMALIZATIONS}; got {normalize!r}.")
        values = _array(values, "Mean.of: `values`")
        where = _array(1 if where is None else where, "Mean.of: `where`", shape=values.shape)
        weights = where.astype(jnp.promote_types(values.dtype, jnp.float32))
        ok = jnp.all((weights >= 0) & (weights < jnp.inf))  # False for NaN too
        if not isinstance(ok, jax.core.Tracer) and not ok:  # traced: not known yet
            raise ValueError("Mean.of: `where` must hold a mask or finite, non-negative weights.")
        if segment_ids is not None or normalize != "token_mean":
            ids = _segment_ids(segment_ids, values)
            weights = jnp.where(ids > 0, weights, 0)  # 0 or less: padding
            per_sequence, sequences = _sequences(weights, ids)
            if normalize == "sequence_mean":
                weights = weights / jnp.where(per_sequence > 0, per_sequence, 1)
        count = jnp.sum(weights) if normalize == "token_mean" else sequences
        # a select, not only a product: a masked-out item may hold a NaN or an inf
        return cls(jnp.sum(jnp.where(weights != 0, values * weights, 0)), count)


NORMALIZATIONS = ("token_mean", "sequence_mean", "sequence_sum")


def _segment_ids(segment_ids: Any, like: jax.Array) -> jax.Array:
    """``segment_ids`` for tokens ``like``, checked; ``None``: each row is one sequence."""
    shape = like.shape
    if not shape:
        raise ValueError("`values` must have a tokens axis (the last) for sequences; got a scalar.")
    if segment_ids is None:
        return jnp.ones_like(like, jnp.int32)  # laid out as the tokens
    ids = _array(segment_ids, "`segment_ids`", "integer segment ids", (jnp.integer,))
    if ids.shape != shape:
        raise ValueError(f"`segment_ids` must have the tokens' shape {shape}; got {ids.shape}.")
    high = ids.max() if ids.size else 0
    if not isinstance(high, jax.core.Tracer) and high > shape[-1]:
        raise ValueError(f"`segment_ids` must be at most {shape[-1]}; got {high}.")
    return ids


def _sequences(weights: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each token's sequence's weight, and the sequences with weight (NaN: an id out of range)."""
    tokens, rows = weights.shape[-1], math.prod(weights.shape[:-1])  # not -1: maybe no tokens
    ids = ids.reshape(rows, tokens)

    def row(weights: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        sums = jax.ops.segment_sum(weights, ids, num_segments=tokens + 1)  # ids <= 0: dropped
        return sums[ids], jnp.sum(sums[1:] > 0, dtype=weights.dtype)

    # row by row (a vmap): rows split over mesh axes stay where they are
    per_token, counts = jax.vmap(row)(weights.reshape(rows, tokens), ids)
    count = jnp.where(jnp.all(ids <= tokens), jnp.sum(counts), jnp.nan)
    return per_token.reshape(weights.shape), count


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


def token_cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    mask: Any = None,
    *,
    normalize: str = "token_mean",
    segment_ids: Any = None,
) -> Mean:
    """The softmax cross-entropy of ``logits`` ``[..., vocab]`` as a `jaxga.Mean`.

    ``mask`` (weights), ``normalize`` and ``segment_ids`` are [`Mean.of`][jaxga.Mean.of]'s.

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
    counted = mask != 0
    if segment_ids is not None:
        counted &= _segment_ids(segment_ids, labels) > 0
    labels = jnp.where(counted, labels, 0)  # tokens left out: their labels are not looked up
    vocab = logits.shape[-1]
    low, high = (labels.min(), labels.max()) if labels.size else (0, 0)
    if not isinstance(low, jax.core.Tracer) and not 0 <= low <= high < vocab:  # as in Mean.of
        raise ValueError(f"counted `labels` must be in [0, {vocab}); got {low} to {high}.")
    # a one-hot, not a gather: it runs on logits sharded over the vocabulary (Explicit axes),
    # and optax's one-hot cross-entropy is its integer one to the bit
    one_hot = labels[..., None] == jnp.arange(vocab, dtype=labels.dtype)
    losses = optax.softmax_cross_entropy(logits.astype(jnp.float32), one_hot)
    return Mean.of(losses, where=mask, normalize=normalize, segment_ids=segment_ids)
