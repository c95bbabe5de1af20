"""Means kept as numerator and denominator, so that they combine exactly."""

import contextlib
import contextvars
import dataclasses
import math
import numbers
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import checkify

_CHECKIFY = contextvars.ContextVar("jaxga_checkify", default=False)


@contextlib.contextmanager
def checkify_values() -> Iterator[None]:
    """Within it, jaxga's checks of traced values are recorded for ``checkify.checkify``.

    Off by default, and a function traced before, outside it, keeps its program without the
    checks: trace a new one within it (why: ``docs/normalization.md``, "Bad values").

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> from jax.experimental import checkify
        >>> def mean(w):
        ...     return jaxga.Mean.of(jnp.ones(2), where=w).value
        >>> with jaxga.checkify_values():
        ...     error, _ = checkify.checkify(jax.jit(mean))(jnp.array([1.0, -1.0]))
        >>> error.get().startswith("Mean.of: `where` must hold")
        True
    """
    token = _CHECKIFY.set(True)
    try:
        yield
    finally:
        _CHECKIFY.reset(token)


def check_value(ok: Any, message: str, *got: Any) -> jax.Array:
    """Raises ``ValueError(message.format(*got))`` unless ``ok``; traced, within
    `checkify_values`, a ``checkify.debug_check`` of it."""
    if isinstance(ok, jax.core.Tracer):
        if _CHECKIFY.get():
            checkify.debug_check(ok, message, *got)
    elif not ok:
        raise ValueError(message.format(*got))
    return ok


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
        """``total / count``: the mean, divided once."""
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
            where: a mask or finite, non-negative weights: bad ones raise; traced, give NaN.
            normalize: what is averaged over; S: the sequences with weight.
                ``"token_mean"``: Σ wℓ / Σ w, every token weighs the same.
                ``"sequence_mean"``: each sequence's weighted mean, averaged over the S.
                ``"sequence_sum"``: each sequence's weighted sum, averaged over the S.
            segment_ids: ints: one sequence a row and id > 0, <= 0 padding; `None`: a row.

        Returns:
            A `Mean` whose count is Σ w (token_mean) or S; total and count NaN for traced bad
            ``where`` or ``segment_ids`` (`checkify.checkify` raises their errors).

        Examples:
            >>> import jaxga
            >>> ids = [[1, 1, 2]]  # one row packing two sequences: (1 + 3) / 2, and 4
            >>> m = jaxga.Mean.of([[1.0, 3.0, 4.0]], segment_ids=ids, normalize="sequence_mean")
            >>> float(m.total), float(m.count)
            (6.0, 2.0)
        """
        values = _array(values, "Mean.of: `values`")
        weights, ok = _weights(where, "Mean.of: `where`", values)
        ids, in_range = _segment_ids(segment_ids, values, normalize)
        if ids is not None:
            weights = jnp.where(ids > 0, weights, 0)  # 0 or less: padding
            per_sequence, sequences = _sequences(weights, ids)
            if normalize == "sequence_mean":
                weights = weights / jnp.where(per_sequence > 0, per_sequence, 1)
        count = jnp.sum(weights) if normalize == "token_mean" else sequences
        # a select, not only a product: a masked-out item may hold a NaN or an inf
        total = jnp.sum(jnp.where(weights != 0, values * weights, 0))
        scale = jnp.where(ok & in_range, 1.0, jnp.nan)  # multiplied: a NaN gradient too
        return cls(total * scale, count * scale)


NORMALIZATIONS = ("token_mean", "sequence_mean", "sequence_sum")


def _weights(where: Any, name: str, values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``where`` as float weights laid out as ``values``, and whether they are good."""
    message = f"{name} must hold a mask or finite, non-negative weights; got {{}}."
    _check_concrete_weights(where, message)
    where = _array(1 if where is None else where, name)
    dtype = jnp.promote_types(values.dtype, jnp.float32)  # bfloat16 values: float32 sums
    try:
        weights = jnp.broadcast_to(where, values.shape).astype(dtype)
    except ValueError:
        raise ValueError(f"{name} must broadcast to {values.shape}; got {where.shape}.") from None
    bad = ~((weights >= 0) & (weights < jnp.inf))  # NaN too
    got = jnp.min(jnp.where(bad, weights, jnp.inf), initial=jnp.inf)  # a reduction: any layout
    return weights, check_value(~jnp.any(bad), message, got)


def _check_concrete_weights(where: Any, message: str) -> None:
    """Raises for bad weights known now (a list, a NumPy array), which a trace would make a
    tracer, whose check only NaNs the mean."""
    if where is None or isinstance(where, jax.core.Tracer):
        return
    if not getattr(where, "is_fully_addressable", True):  # other processes hold some of it
        return
    try:
        weights = np.asarray(where, np.float64)
    except (TypeError, ValueError):  # not numbers: `_array` says so
        return
    bad = ~((weights >= 0) & (weights < np.inf))  # NaN too
    if bad.any():
        raise ValueError(message.format(weights[bad].min()))


def _segment_ids(segment_ids: Any, like: jax.Array, normalize: str) -> tuple[Any, Any]:
    """``segment_ids`` for ``like``, and whether in range; None where ``normalize`` needs none."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"`normalize` must be one of {NORMALIZATIONS}; got {normalize!r}.")
    if segment_ids is None and normalize == "token_mean":
        return None, True
    shape = like.shape
    if not shape:
        raise ValueError("`values` must have a tokens axis (the last) for sequences; got a scalar.")
    given = jnp.ones_like(like, jnp.int32) if segment_ids is None else segment_ids  # None: rows
    ids = _array(given, "`segment_ids`", "integer segment ids", (jnp.integer,))
    if ids.shape != shape:
        raise ValueError(f"`segment_ids` must have the tokens' shape {shape}; got {ids.shape}.")
    high = jnp.max(ids, initial=0)
    message = f"`segment_ids` must be at most {shape[-1]}, the tokens a row; got {{}}."
    return ids, check_value(high <= shape[-1], message, high)


def _sequences(weights: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each token's sequence's weight, and the number of sequences with weight."""
    tokens, rows = weights.shape[-1], math.prod(weights.shape[:-1])  # not -1: maybe no tokens
    ids = ids.reshape(rows, tokens)

    def row(weights: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        sums = jax.ops.segment_sum(weights, ids, num_segments=tokens + 1)  # ids <= 0: dropped
        return sums[ids], jnp.sum(sums[1:] > 0, dtype=weights.dtype)

    # row by row (a vmap): rows split over mesh axes stay where they are
    per_token, counts = jax.vmap(row)(weights.reshape(rows, tokens), ids)
    return per_token.reshape(weights.shape), jnp.sum(counts)


def _array(
    x: Any, name: str, expected: str = "an array of numbers", kinds: tuple = (jnp.number, jnp.bool)
) -> jax.Array:
    try:
        array = jnp.asarray(x)
    except (TypeError, ValueError):  # None, strings, objects
        array = None
    if array is None or not any(jnp.issubdtype(array.dtype, kind) for kind in kinds):
        got = f"dtype {x.dtype}" if hasattr(x, "dtype") else f"{x!r} of type {type(x).__name__}"
        raise TypeError(f"{name} must be {expected}; got {got}.")
    return array


def token_cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    mask: Any = None,
    *,
    normalize: str = "token_mean",
    segment_ids: Any = None,
    label_smoothing: float = 0.0,
) -> Mean:
    """The softmax cross-entropy of ``logits`` ``[..., vocab]`` as a `jaxga.Mean`.

    Args:
        logits: the model's outputs, floats ``[..., vocab]``.
        labels: the target token ids ``[...]``; a token left out may hold any (``-100``).
        mask: the tokens' weights, 0 to leave one out: [`Mean.of`][jaxga.Mean.of]'s ``where``.
        normalize: ``"token_mean"``, ``"sequence_mean"`` or ``"sequence_sum"``, as `Mean.of`'s.
        segment_ids: the packed sequences' ids, <= 0 padding; ``None``: a sequence a row.
        label_smoothing: α in [0, 1): targets (1 - α)·one-hot + α / vocab, as optax.smooth_labels.

    Returns:
        A `Mean` of the counted tokens' losses; NaN for traced bad values, as `Mean.of`'s.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> m = jaxga.token_cross_entropy(jnp.zeros((2, 5)), jnp.array([0, 3]), jnp.array([1, 0]))
        >>> float(m.count), round(float(m.value), 4)
        (1.0, 1.6094)
    """
    logits = _array(logits, "`logits`", "a float array", (jnp.floating,))
    labels = _array(labels, "`labels`", "integer token ids", (jnp.integer,))
    if jnp.iinfo(labels.dtype).bits < 32:  # ids compared with a vocabulary's: none wraps round
        labels = labels.astype(jnp.int32)
    if not logits.ndim or logits.shape[:-1] != labels.shape:
        raise TypeError(f"`logits` {logits.shape} must be [..., vocab] for labels {labels.shape}.")
    number = isinstance(label_smoothing, numbers.Real) and not isinstance(label_smoothing, bool)
    if not (number and 0 <= label_smoothing < 1):
        raise ValueError(f"`label_smoothing` must be a float in [0, 1); got {label_smoothing!r}.")
    weights, ok = _weights(mask, "`mask`", labels)
    ids, _ = _segment_ids(segment_ids, labels, normalize)  # and checked by Mean.of
    counted = (weights != 0) if ids is None else (weights != 0) & (ids > 0)
    labels = jnp.where(counted, labels, 0)  # tokens left out: their labels are not looked up
    vocab = logits.shape[-1]
    low, high = (labels.min(), labels.max()) if labels.size else (0, 0)
    message = f"counted `labels` must be in [0, {vocab}); got {{}} to {{}}."
    ok &= check_value((low >= 0) & (high < vocab), message, low, high)
    # a one-hot, not a gather: it runs on logits sharded over the vocabulary (Explicit axes),
    # and optax's one-hot cross-entropy is its integer one to the bit
    targets = labels[..., None] == jnp.arange(vocab, dtype=labels.dtype)
    if label_smoothing:
        targets = optax.smooth_labels(targets.astype(jnp.float32), label_smoothing)
    losses = optax.softmax_cross_entropy(logits.astype(jnp.float32), targets)
    where = jnp.where(ok, weights, jnp.nan)  # a bad value, traced: Mean.of's NaN
    return Mean.of(losses, where, normalize=normalize, segment_ids=segment_ids)
