"""How a loss's auxiliary output combines over micro-batches and devices: one table of kinds."""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.tree_util import keystr, tree_flatten_with_path

from jaxga.loss import Mean
from jaxga.microbatch import merge_microbatches


@dataclasses.dataclass(frozen=True)
class Kind:
    """How an aux leaf of one kind combines (as optax's ``microbatching`` ``Accumulator``).

    Attributes:
        means: what a leaf of this kind comes back as, in words (for errors).
        over_microbatches: the scan's stacked leaf, ``[k, ...]``, to this device's value.
        summed_over_devices: where jaxga opens the ``shard_map``, the devices' values are
            summed (`True`) or concatenated along their leading axis (`False`).
        fits: ``(stacked leaf, rows of a micro-batch) -> bool``: whether it can be this kind.
        needs: what `fits` asks, in words, for the error when it does not.
    """

    means: str
    over_microbatches: Callable[[jax.Array], jax.Array]
    summed_over_devices: bool
    fits: Callable[[jax.Array, int], bool]
    needs: str


def _summed(x: jax.Array) -> jax.Array:
    return jnp.sum(x, axis=0)


def _as_is(x: jax.Array) -> jax.Array:
    return x


def _is_number(x: jax.Array, rows: int) -> bool:
    return jnp.issubdtype(x.dtype, jnp.number) or x.dtype == jnp.bool_


def _has_rows(x: jax.Array, rows: int) -> bool:
    return jnp.shape(x)[1:2] == (rows,)


def _anything(x: jax.Array, rows: int) -> bool:
    return True


KINDS = {  # what `aux=` may name a subtree: the one table
    "sum": Kind("summed", _summed, True, _is_number, "numbers"),
    "rows": Kind("a row per example", merge_microbatches, False, _has_rows, "{rows} rows"),
    "stack": Kind("[k, ...]", _as_is, False, _anything, "anything"),
}
_NAMES = ", ".join(f"{name!r} ({kind.means})" for name, kind in KINDS.items())


def is_mean(x: Any) -> bool:
    return isinstance(x, Mean)


def _unnamed(x: Any) -> bool:
    return x is None


def default(leaf: Any) -> str:
    """The kind of a leaf ``aux=`` does not name: a `Mean` is summed, any other leaf stacked."""
    return "sum" if is_mean(leaf) else "stack"


def check(aux: Any) -> Any:
    """``aux=``: `None` (each leaf's `default`), or a kind of `KINDS` (or `None`) per subtree.

    Examples:
        >>> import jaxga
        >>> jaxga.auxiliary.check({"logits": "rows", "hist": "sum", "rest": None})
        {'logits': 'rows', 'hist': 'sum', 'rest': None}
    """
    for path, kind in tree_flatten_with_path(aux, is_leaf=_unnamed)[0]:
        if not (kind is None or (isinstance(kind, str) and kind in KINDS)):
            where = f"aux{keystr(path)}" if path else "aux"
            expected = f"None or a tree of kinds ({_NAMES}; None: the default), a prefix of the aux"
            raise ValueError(f"`{where}` must be {expected}; got {kind!r}.")
    return aux


def kinds(given: Any, aux: Any, *, rows: int) -> Any:
    """How each leaf of ``aux`` (stacked by the scan, ``[k, ...]``) combines: a tree of names.

    Args:
        given: `aux=`, a kind name (or `None`: the leaf's `default`) for each subtree of
            ``aux``, a prefix of it. No shape is read to choose a kind.
        aux: the scan's aux, each leaf ``[k, ...]``; a `Mean` is one leaf.
        rows: the rows of one micro-batch (on this device).

    Returns:
        A tree shaped as ``aux`` of names of `KINDS`; a leaf that cannot be of its kind
        raises, naming its path and the kinds.
    """

    def spread(kind: str | None, part: Any) -> Any:  # the subtree's kind, on each of its leaves
        return jax.tree.map(lambda leaf: kind or default(leaf), part, is_leaf=is_mean)

    try:
        named = jax.tree.map(spread, given, aux, is_leaf=_unnamed)
    except ValueError as e:  # not a prefix
        got = jax.tree.structure(aux, is_leaf=is_mean)
        raise ValueError(f"`aux` kinds {given!r} must be a prefix of aux {got}.") from e
    return jax.tree_util.tree_map_with_path(
        functools.partial(_fitting, rows), aux, named, is_leaf=is_mean
    )


def _fitting(rows: int, path: Any, x: Any, name: str) -> str:
    kind = KINDS[name]
    if all(kind.fits(y, rows) for y in jax.tree.leaves(x)):
        return name
    y = jax.tree.leaves(x)[0]
    got = f"aux{keystr(path)} of shape {jnp.shape(y)[1:]} and dtype {y.dtype}"
    needs = kind.needs.format(rows=rows)
    raise TypeError(f"`fun` returned {got}: a {name!r} leaf needs {needs}. Kinds: {_NAMES}.")


def combine(aux: Any, kinds: Any) -> Any:
    """``aux``, stacked by the scan, combined over the micro-batches as ``kinds`` say."""

    def one(x: Any, name: str) -> Any:  # a Mean: its total and count alike
        return jax.tree.map(KINDS[name].over_microbatches, x)

    return jax.tree.map(one, aux, kinds, is_leaf=is_mean)


def with_device_axis(aux: Any, kinds: Any) -> Any:
    """One device's ``aux``, combined (`combine`), to leave a ``shard_map`` whose out spec
    splits the leading axis over the devices: a leaf the devices sum gets one
    (``[1, ...]``); the others' leading axes (rows, micro-batches) are concatenated."""

    def one(x: Any, name: str) -> Any:
        summed = KINDS[name].summed_over_devices
        return jax.tree.map(lambda y: y[None], x) if summed else x

    return jax.tree.map(one, aux, kinds, is_leaf=is_mean)


def without_device_axis(aux: Any, kinds: Any) -> Any:
    """`with_device_axis`' leaves the devices sum, ``[devices, ...]``, summed over them."""

    def one(x: Any, name: str) -> Any:
        summed = KINDS[name].summed_over_devices
        return jax.tree.map(_summed, x) if summed else x

    return jax.tree.map(one, aux, kinds, is_leaf=is_mean)
