"""How a loss's auxiliary output combines over micro-batches and devices: a kind per leaf."""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.tree_util import keystr, tree_flatten_with_path

from jaxga.loss import Mean
from jaxga.microbatch import merge_microbatches

KINDS = ("auto", "sum", "rows", "stack")  # what `aux=` may say of a subtree


def is_mean(x: Any) -> bool:
    return isinstance(x, Mean)


def check(aux: Any) -> Any:
    """``aux=``: ``"auto"``, or one of `KINDS` for each subtree of the aux (a prefix of it).

    Examples:
        >>> import jaxga
        >>> jaxga.auxiliary.check({"logits": "rows", "hist": "sum"})
        {'logits': 'rows', 'hist': 'sum'}
    """
    for path, kind in tree_flatten_with_path(aux)[0]:
        if not (isinstance(kind, str) and kind in KINDS):
            where = f"aux{keystr(path)}" if path else "aux"
            expected = f"'auto' or a tree of kinds {KINDS} (a prefix of the aux)"
            raise ValueError(f"`{where}` must be {expected}; got {kind!r}.")
    return aux


def kinds(given: Any, aux: Any, *, k: int, rows: int) -> Any:
    """How each leaf of ``aux`` (stacked by the scan, ``[k, ...]``) combines: a tree of kinds.

    ``"sum"``: summed over the micro-batches (a `Mean` always is); ``"rows"``: one row per
    example, merged back into the batch's ``k · rows`` rows; ``"stack"``: one value per
    micro-batch; ``"once"`` (``"auto"`` at ``k = 1``): the one micro-batch's value as it is,
    as ``jax.value_and_grad`` returns it. ``"auto"`` reads shapes: a leaf whose leading axis
    has the micro-batch's row count is taken as rows — name the kind of one that only
    happens to (a histogram of as many classes as a micro-batch has rows).

    Args:
        given: `aux=`, a kind for each subtree of ``aux`` (a prefix); ``"auto"``: read from
            one micro-batch's shapes (a `Mean` summed, ``rows`` rows merged, a scalar stacked).
        aux: the scan's aux, each leaf ``[k, ...]``.
        k: the number of micro-batches.
        rows: the rows of one micro-batch.

    Returns:
        A tree shaped as ``aux`` (a `Mean` a leaf) of "sum", "rows", "stack" and "once".
    """

    def spread(kind: str, part: Any) -> Any:  # the subtree's kind, on each of its leaves
        return jax.tree.map(lambda _: kind, part, is_leaf=is_mean)

    try:
        spread_kinds = jax.tree.map(spread, given, aux)
    except ValueError as e:  # not a prefix
        got = jax.tree.structure(aux, is_leaf=is_mean)
        raise ValueError(f"`aux` kinds {given!r} must be a prefix of aux {got}.") from e
    kind = functools.partial(_kind, k, rows)
    return jax.tree_util.tree_map_with_path(kind, aux, spread_kinds, is_leaf=is_mean)


def _kind(k: int, rows: int, path: Any, x: Any, given: str) -> str:
    """A leaf's kind: as ``given``; ``"auto"``: a `Mean` summed, rows merged, a scalar stacked."""
    if is_mean(x):
        return "sum"
    where = f"aux{keystr(path)} of shape {jnp.shape(x)[1:]}"
    if given == "rows" and jnp.shape(x)[1:2] != (rows,):
        raise TypeError(f"`aux` says 'rows' for {where}; expected {rows} rows (a micro-batch's).")
    if given != "auto":
        return given
    if jnp.shape(x)[1:2] == (rows,):
        return "rows"
    if k == 1:
        return "once"
    if jnp.shape(x) == (k,):
        return "stack"
    expected = (
        f"a Mean, a scalar or a row per example ({rows} rows). New model state goes through "
        f"`state_argnums`, not aux; for other values say how they combine: aux='stack' for "
        f"every leaf, or kinds by leaf, aux={{...: 'sum' | 'rows' | 'stack'}}"
    )
    raise TypeError(f"`fun` returned {where} for a micro-batch; expected {expected}.")


def _signature(tree: Any, skip: int = 0) -> tuple[Any, list[tuple[int, ...]]]:
    return jax.tree.structure(tree), [jnp.shape(x)[skip:] for x in jax.tree.leaves(tree)]


def check_not_state(aux: Any, args: tuple[Any, ...], skip: set[int]) -> None:
    """Raises if ``aux`` (stacked ``[k, ...]``) or a part of it is shaped as an argument.

    Such a part is the loss's new state (an `eqx.nn.State`, Linen ``batch_stats``): it goes
    through ``state_argnums``, so that each micro-batch starts from the one before's.
    ``skip``: the positions that cannot be state (the batch's, the differentiated).
    """
    parts = {"aux": aux}
    if isinstance(aux, tuple | list | dict):
        items = aux.items() if isinstance(aux, dict) else enumerate(aux)
        parts |= {f"aux[{key!r}]": x for key, x in items}
    states = {i: _signature(a) for i, a in enumerate(args) if i not in skip}
    for where, part in parts.items():
        for i, (tree, shapes) in states.items():
            if tree.num_nodes > 1 and (tree, shapes) == _signature(part, skip=1):  # not a leaf
                path, leaf = tree_flatten_with_path(part)[0][0]
                raise TypeError(
                    f"`fun` returned {where}, a {type(part).__name__} shaped as args[{i}] "
                    f"({where}{keystr(path)} of shape {jnp.shape(leaf)[1:]}, ...): new state? "
                    f"State goes through `state_argnums`: pass state_argnums={i} and return "
                    f"(loss, new_state), or ((loss, aux), new_state) with has_aux=True; each "
                    f"micro-batch then starts from the state the one before returned. Not "
                    f"state: name its kind, aux={{...: 'sum' | 'rows' | 'stack'}}."
                )


def combine(aux: Any, kinds: Any) -> Any:
    """``aux``, stacked by the scan, combined as ``kinds`` (from `kinds`) say."""

    def one(x: Any, kind: str) -> Any:
        if kind == "sum":  # a Mean's total and count, or the leaf
            return jax.tree.map(lambda y: jnp.sum(y, 0), x)
        if kind == "once":
            return x[0]
        return merge_microbatches(x) if kind == "rows" else x

    return jax.tree.map(one, aux, kinds, is_leaf=is_mean)


def with_device_axis(aux: Any, kinds: Any, rows: int) -> Any:
    """A ``shard_map``'s out, its leaves ``[k, ...]``: a leaf of one row per example (kind
    ``"rows"``, or ``"stack"`` with ``rows`` rows at axis 1) concatenated over the devices
    there, as jit's global view gives it; every other leaf given a devices' axis at 1
    (``"stack"``: ``[k, devices, ...]``; ``"sum"``, a `Mean`: summed over it after)."""

    def one(x: Any, kind: str) -> Any:
        if kind == "rows" or (kind != "sum" and jnp.shape(x)[1:2] == (rows,)):
            return x  # the devices' rows, in order
        return jax.tree.map(lambda y: y[:, None], x)

    return jax.tree.map(one, aux, kinds, is_leaf=is_mean)


def without_device_axis(aux: Any, kinds: Any) -> Any:
    """`with_device_axis`' sums, ``[k, devices, ...]``, summed over the devices."""

    def one(x: Any, kind: str) -> Any:
        return jax.tree.map(lambda y: jnp.sum(y, axis=1), x) if kind == "sum" else x

    return jax.tree.map(one, aux, kinds, is_leaf=is_mean)
