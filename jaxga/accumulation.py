"""Exact gradient accumulation over micro-batches inside one compiled step.

One private engine, :func:`_accumulate`, runs the loss over the micro-batches in a
``lax.scan``; :func:`accumulate`, :func:`value_and_grad` and :func:`grad` are thin
wrappers that validate their options once, when they are built, and shape its result.
Flax NNX graph nodes (modules, ``nnx.Optimizer``s, lists or dicts of them) may be
passed wherever ``nnx.value_and_grad`` takes them; see :func:`value_and_grad`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxga import _checks, sharding
from jaxga.loss import Mean, as_mean

__all__ = [
    "Accumulated",
    "accumulate",
    "grad",
    "merge_microbatches",
    "split_microbatches",
    "value_and_grad",
]

ArgNums = int | nnx.DiffState | Sequence[int | nnx.DiffState]


class Accumulated(NamedTuple):
    """Everything one pass over the micro-batches produced.

    Attributes:
        mean: the summed loss, ``Mean(Σ total, Σ count)`` over micro-batches (and
            devices): ``mean.value`` is the loss, ``mean.count`` the number of items
            (tokens, or micro-batches for a scalar loss).
        grads: the gradient of ``mean.value``, each leaf in its parameter's dtype; a
            tree for an int ``argnums``, a tuple of trees for a sequence. A Flax NNX
            argument's gradient is an ``nnx.State``, as ``nnx.grad`` returns.
        aux: auxiliary outputs stacked along a leading micro-batch axis (``None``
            without ``has_aux``).
        state: the threaded state after the last micro-batch, shaped like
            ``state_argnums`` (``None`` without it).
    """

    mean: Mean
    grads: Any
    aux: Any
    state: Any


@dataclasses.dataclass(frozen=True)
class _Options:
    """The validated options of one transformed function."""

    num_microbatches: int
    argnums: tuple[int, ...]
    filters: dict[int, Any]  # NNX filter of the differentiated state, per argument
    single_argnum: bool
    has_aux: bool
    batch_argnums: tuple[int, ...]
    rng_argnums: tuple[int, ...]
    state_argnums: tuple[int, ...]
    single_state: bool
    axis_name: Any
    accumulator_dtype: jnp.dtype | None


def _positions(name: str, value: Any, items: Any = None) -> tuple[int, ...]:
    """``value`` as a tuple of positions; ``items`` are its entries when not ``value`` itself."""
    expected = f"`{name}` must be a non-negative int or a tuple of them; got {value!r}."
    try:
        values = tuple((value,) if isinstance(value, int) else value if items is None else items)
    except TypeError:
        raise TypeError(expected) from None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TypeError(expected)
    if len(set(values)) != len(values):
        raise ValueError(f"`{name}` must not repeat a position; got {value!r}.")
    return values


def _diff_positions(argnums: Any) -> tuple[tuple[int, ...], dict[int, Any]]:
    """Positions and NNX filters (``nnx.Param`` unless a ``DiffState`` says) of ``argnums``."""
    items = argnums
    if isinstance(argnums, int | nnx.DiffState):
        items = (argnums,)
    elif isinstance(argnums, Sequence) and not isinstance(argnums, str):
        items = tuple(argnums)
    if isinstance(items, tuple):
        filters = {a.argnum: a.filter for a in items if isinstance(a, nnx.DiffState)}
        items = tuple(a.argnum if isinstance(a, nnx.DiffState) else a for a in items)
    else:
        filters = {}
    positions = _positions("argnums", argnums, items)
    if not positions:
        raise ValueError("`argnums` must name at least one argument to differentiate.")
    return positions, {i: filters.get(i, nnx.Param) for i in positions}


def _check_disjoint(**named: tuple[int, ...]) -> None:
    items = list(named.items())
    for i, (name_a, a) in enumerate(items):
        for name_b, b in items[i + 1 :]:
            if common := sorted(set(a) & set(b)):
                raise ValueError(
                    f"`{name_a}`={a} and `{name_b}`={b} both name positional argument(s) "
                    f"{common}; an argument is either differentiated, split into "
                    f"micro-batches, a PRNG key or threaded state, not two of these."
                )


def _options(
    fun: Any,
    num_microbatches: Any,
    argnums: Any,
    has_aux: Any,
    batch_argnums: Any,
    rng_argnums: Any,
    state_argnums: Any,
    axis_name: Any,
    accumulator_dtype: Any,
) -> _Options:
    if not callable(fun):
        raise TypeError(f"`fun` must be a function; got {fun!r} of type {type(fun).__name__}.")
    if not isinstance(has_aux, bool):
        raise TypeError(f"`has_aux` must be a bool; got {has_aux!r}.")
    diff, filters = _diff_positions(argnums)
    positions = {
        "argnums": diff,
        "batch_argnums": _positions("batch_argnums", batch_argnums),
        "rng_argnums": _positions("rng_argnums", rng_argnums),
        "state_argnums": _positions("state_argnums", state_argnums),
    }
    _check_disjoint(**positions)
    return _Options(
        num_microbatches=_checks.positive_int(num_microbatches, "num_microbatches"),
        argnums=diff,
        filters=filters,
        single_argnum=isinstance(argnums, int | nnx.DiffState),
        has_aux=has_aux,
        batch_argnums=positions["batch_argnums"],
        rng_argnums=positions["rng_argnums"],
        state_argnums=positions["state_argnums"],
        single_state=isinstance(state_argnums, int),
        axis_name=axis_name,
        accumulator_dtype=_checks.accumulator_dtype(accumulator_dtype),
    )


def split_microbatches(batch: Any, num_microbatches: int, *, name: str = "batch") -> Any:
    """Splits the leading axis of every leaf of ``batch`` into ``num_microbatches``.

    Returns the same tree with leaves of shape ``[k, B // k, ...]``. Micro-batch ``i``
    holds rows ``i, i + k, i + 2k, ...``: strided rows keep a batch that is sharded
    along its leading axis evenly sharded within every micro-batch.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> jaxga.split_microbatches(jnp.arange(6), 2).tolist()
        [[0, 2, 4], [1, 3, 5]]
    """
    num_microbatches = _checks.positive_int(num_microbatches, "num_microbatches")
    size = _checks.leading_size(batch, name, "batch")
    if size is not None and size % num_microbatches:
        raise ValueError(
            f"The batch size {size} (leading axis of {name}) is not divisible by "
            f"num_microbatches={num_microbatches}."
        )

    def split(x):
        x = jnp.asarray(x)
        x = x.reshape(x.shape[0] // num_microbatches, num_microbatches, *x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(split, batch)


def merge_microbatches(tree: Any) -> Any:
    """Undoes :func:`split_microbatches`: ``[k, B // k, ...]`` leaves back to ``[B, ...]``.

    Use it on the stacked ``aux`` of :func:`value_and_grad` to get per-example outputs
    in the batch's own row order.

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


# --- Flax NNX graph nodes -------------------------------------------------------------


def _is_graph_node(x: Any) -> bool:
    # Variables are graph nodes too, but an nnx.State of them is plain data: a pytree.
    return nnx.graphlib.is_graph_node(x) and not isinstance(x, nnx.Variable)


def _has_graph_node(tree: Any) -> bool:
    return any(map(_is_graph_node, jax.tree.leaves(tree, is_leaf=_is_graph_node)))


@dataclasses.dataclass(frozen=True)
class _Node:
    """A Flax NNX graph node taken apart (a leaf, not a pytree node, on purpose)."""

    module: Any
    graphdef: Any
    diff: Any  # the filtered, differentiated state; None if not differentiated
    rest: Any  # everything else, threaded through the micro-batches


def _is_node(x: Any) -> bool:
    return isinstance(x, _Node)


def _split_arg(arg: Any, position: int, wrt: Any) -> Any:
    """``arg`` with every graph node in it replaced by a :class:`_Node`."""

    def split(x):
        if not _is_graph_node(x):
            return x
        if wrt is None:
            graphdef, rest = nnx.split(x)
            return _Node(x, graphdef, None, rest)
        graphdef, diff, rest = nnx.split(x, wrt, ...)
        if not jax.tree.leaves(diff):
            raise ValueError(
                f"args[{position}] holds a Flax NNX {type(x).__name__}, but the filter {wrt!r} "
                f"of `argnums` selects none of its state: there is nothing to differentiate. "
                f"Pass nnx.DiffState({position}, filter) with a filter that selects parameters."
            )
        return _Node(x, graphdef, diff, rest)

    return jax.tree.map(split, arg, is_leaf=_is_graph_node)


def _check_unshared(nodes: dict[int, Any]) -> None:
    """Raises if two graph nodes among the arguments share a Variable (or are one node)."""
    owner: dict[int, str] = {}
    for i, split in nodes.items():
        for path, x in jax.tree_util.tree_flatten_with_path(split, is_leaf=_is_node)[0]:
            if not _is_node(x):
                continue
            where = f"args[{i}]{jax.tree_util.keystr(path)}"
            variables = (v for _, v in nnx.iter_graph(x.module) if isinstance(v, nnx.Variable))
            for v in variables:
                first = owner.setdefault(id(v), where)
                if first != where:
                    raise ValueError(
                        f"{first} and {where} share state (they are, or hold, the same Flax "
                        f"NNX module or Variable). jaxga takes each module among the "
                        f"arguments apart on its own, so shared state would have its gradient "
                        f"and updates split between them. Pass it once, or pass one module "
                        f"that holds both (an nnx.Module, nnx.List or nnx.Dict), which is "
                        f"taken apart as a whole."
                    )


def _diff_of(split: Any) -> Any:
    return jax.tree.map(lambda x: x.diff if _is_node(x) else x, split, is_leaf=_is_node)


def _rest_of(split: Any) -> Any:
    return jax.tree.map(lambda x: x.rest if _is_node(x) else None, split, is_leaf=_is_node)


def _merge_arg(split: Any, diff: Any, rest: Any) -> Any:
    """Fresh modules of the current trace from ``split`` with ``diff`` and ``rest`` state."""

    def merge(x, d, r):
        if not _is_node(x):
            return x if diff is None else d
        # copy=True: fresh Variables of this trace, which the loss may update
        # (BatchNorm statistics, Rngs counters) inside the micro-batch loop.
        states = (r,) if d is None else (d, r)
        return nnx.merge(x.graphdef, *states, copy=True)

    diffs = jax.tree.map(lambda x: None, split, is_leaf=_is_node) if diff is None else diff
    return jax.tree.map(merge, split, diffs, rest, is_leaf=lambda x: _is_node(x) or x is None)


def _new_rest(merged: Any, split: Any, wrt: Any) -> Any:
    """The non-differentiated state of the modules of ``merged`` after the loss ran."""

    def rest(x, module):
        if not _is_node(x):
            return None
        return nnx.split(module)[1] if wrt is None else nnx.split(module, wrt, ...)[2]

    return jax.tree.map(rest, split, merged, is_leaf=lambda x: _is_node(x) or _is_graph_node(x))


def _write_back(split: Any, rest: Any) -> None:
    def update(x, r):
        if _is_node(x):
            nnx.update(x.module, r)

    jax.tree.map(update, split, rest, is_leaf=lambda x: _is_node(x) or x is None)


def _fold_keys(state: Any, index: jax.Array) -> Any:
    """Folds ``index`` into every typed PRNG key of ``state`` (e.g. an NNX ``RngKey``)."""

    def fold(x):
        if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
            return jax.random.fold_in(x, index)
        return x

    return jax.tree.map(fold, state)


def _restore_keys(state: Any, before: Any) -> Any:
    def restore(x, old):
        return old if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key) else x

    return jax.tree.map(restore, state, before)


# --- checks at call time ------------------------------------------------------------


def _check_call(options: _Options, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    named = {
        "argnums": options.argnums,
        "batch_argnums": options.batch_argnums,
        "rng_argnums": options.rng_argnums,
        "state_argnums": options.state_argnums,
    }
    for name, positions in named.items():
        if positions and max(positions) >= len(args):
            raise ValueError(
                f"`{name}`={positions} refers to positional argument {max(positions)}, but "
                f"the function was called with {len(args)} positional argument(s)."
            )
    for key, value in kwargs.items():
        if _has_graph_node(value):
            raise TypeError(
                f"Keyword argument {key!r} holds a Flax NNX graph node; pass modules "
                f"positionally, so that jaxga can thread their state through the micro-batches."
            )
    for name in ("batch_argnums", "rng_argnums", "state_argnums"):
        for i in named[name]:
            if _has_graph_node(args[i]):
                raise TypeError(
                    f"`{name}` names args[{i}], a Flax NNX graph node ({type(args[i]).__name__}); "
                    f"modules are either differentiated (`argnums`) or passed as they are: "
                    f"their state (BatchNorm statistics, Rngs) is threaded through the "
                    f"micro-batches and written back without being named."
                )
    for i in options.batch_argnums:
        if not jax.tree.leaves(args[i]):
            raise ValueError(
                f"`batch_argnums` names args[{i}], which has no array leaves (got "
                f"{args[i]!r}): nothing would be split, and the whole batch would run "
                f"{options.num_microbatches} times. Pass the batch there, or set "
                f"`batch_argnums` to where it is."
            )
    for i in options.rng_argnums:
        for path, key in jax.tree_util.tree_flatten_with_path(args[i])[0]:
            dtype, shape = jnp.result_type(key), jnp.shape(key)
            typed = jnp.issubdtype(dtype, jax.dtypes.prng_key)
            raw = dtype == jnp.uint32 and shape[-1:] == (2,)
            if not (typed or raw):
                raise TypeError(
                    f"`rng_argnums` names args[{i}], but args[{i}]{jax.tree_util.keystr(path)} "
                    f"is not a PRNG key (dtype {dtype}, shape {shape}); expected keys from "
                    f"jax.random.key (or raw uint32[2] keys from jax.random.PRNGKey)."
                )


def _check_primals(primals: tuple[Any, ...], argnums: tuple[int, ...]) -> None:
    for i, tree in zip(argnums, primals):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            dtype = jnp.result_type(leaf)
            if not jnp.issubdtype(dtype, jnp.inexact):
                raise TypeError(
                    f"`argnums` differentiates args[{i}], whose leaf "
                    f"args[{i}]{jax.tree_util.keystr(path)} has dtype {dtype}; only floating "
                    f"leaves can be differentiated (jaxga has no `allow_int`: integer "
                    f"gradients cannot be summed). Pass integer values in another argument."
                )


def _check_axis(options: _Options, batches: tuple[Any, ...]) -> None:
    if options.axis_name is not None:
        sharding.check_axis_bound(options.axis_name)
        return
    axes = set().union(*(sharding._varying_axes(x) for x in jax.tree.leaves(batches)))
    if axes:
        raise ValueError(
            f"The batch varies over mesh axes {sorted(axes, key=str)} (this is inside "
            f"shard_map), but `axis_name` is None: pass axis_name={sorted(axes, key=str)[0]!r} "
            f"so that gradients, totals and counts are reduced across devices once, after the "
            f"micro-batch loop."
        )


def _parse_output(out: Any, has_aux: bool, has_state: bool) -> tuple[Mean, Any, Any]:
    state = None
    if has_state:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                "With `state_argnums`, `fun` must return a pair (output, new_state); got "
                f"{type(out).__name__}."
            )
        out, state = out
    aux = None
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                "With has_aux=True, `fun` must return a pair (value, aux); got "
                f"{type(out).__name__}."
            )
        out, aux = out
        if _has_graph_node(aux):
            raise TypeError(
                "`fun` returned a Flax NNX graph node (a module or Variable) in its aux; "
                "return arrays instead: jaxga writes the state of module arguments back "
                "into them itself."
            )
    elif isinstance(out, tuple | list):
        raise TypeError(
            f"`fun` returned a {type(out).__name__} of length {len(out)}, but has_aux=False; "
            f"pass has_aux=True if it returns (loss, aux)."
        )
    if not isinstance(out, Mean) and _has_graph_node(out):
        raise TypeError(
            "`fun` returned a Flax NNX graph node; it must return a float scalar or a "
            "jaxga.Mean (module state is written back into module arguments by jaxga)."
        )
    mean = as_mean(out)
    total, count = mean.total, mean.count
    if jnp.shape(total) != () or not jnp.issubdtype(jnp.result_type(total), jnp.floating):
        what = "Mean.total" if isinstance(out, Mean) else "the value"
        raise TypeError(
            f"`fun` must return a float scalar or a jaxga.Mean with a float scalar total; "
            f"{what} has shape {jnp.shape(total)} and dtype {jnp.result_type(total)}."
        )
    if jnp.shape(count) != () or not jnp.issubdtype(jnp.result_type(count), jnp.number):
        raise TypeError(
            f"`fun` returned a jaxga.Mean whose count has shape {jnp.shape(count)} and dtype "
            f"{jnp.result_type(count)}; expected a scalar number of items (or total weight)."
        )
    return mean, aux, state


def _like(new: Any, old: Any, what: str) -> Any:
    """Casts ``new`` to the dtypes of ``old``, so that it can be a scan carry."""
    if jax.tree.structure(new) != jax.tree.structure(old):
        raise TypeError(
            f"`fun` {what} with tree structure {jax.tree.structure(new)}; it must keep the "
            f"structure it was given, {jax.tree.structure(old)}."
        )

    def cast(path, n, o):
        n, dtype = jnp.asarray(n), jnp.result_type(o)
        same_kind = n.dtype == dtype or (
            jnp.issubdtype(dtype, jnp.number) and jnp.can_cast(n.dtype, dtype, casting="same_kind")
        )
        if n.shape != jnp.shape(o) or not same_kind:
            raise TypeError(
                f"`fun` {what} whose leaf {jax.tree_util.keystr(path)} has shape {n.shape} and "
                f"dtype {n.dtype}; it was given shape {jnp.shape(o)} and dtype {dtype}: the "
                f"state must keep its shape, and its dtype up to casts within one kind."
            )
        return n.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, new, old)


def _reduce_state(state: Any, before: Any, axis_name: Any) -> Any:
    """Makes threaded state that was the same on every device the same again.

    Floating leaves take the mean over devices, as ``before + mean(x - before)`` so that
    a leaf no device changed stays bit for bit what it was; counters and keys take the
    maximum. Leaves that already differed across devices stay per device.
    """
    axes = sharding._axes(axis_name)

    def reduce(x, old):
        over = tuple(a for a in axes if a not in sharding._varying_axes(old))
        if not over:
            return x
        if jnp.issubdtype(x.dtype, jnp.floating):
            return old + jax.lax.pmean(x - old, over)
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = jax.lax.pmax(jax.random.key_data(x), over)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.lax.pmax(x, over)

    return jax.tree.map(reduce, state, before)


# --- the engine ---------------------------------------------------------------------


def _accumulate(
    fun: Callable[..., Any], options: _Options, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Accumulated:
    _check_call(options, args, kwargs)
    k = options.num_microbatches
    diff_pos, batch_pos = options.argnums, options.batch_argnums
    rng_pos, state_pos = options.rng_argnums, options.state_argnums

    nodes = {
        i: _split_arg(arg, i, options.filters.get(i))
        for i, arg in enumerate(args)
        if _has_graph_node(arg)
    }
    _check_unshared(nodes)
    primals = tuple(_diff_of(nodes[i]) if i in nodes else args[i] for i in diff_pos)
    _check_primals(primals, diff_pos)
    batches = tuple(args[i] for i in batch_pos)
    _check_axis(options, batches)
    device_index = 0 if options.axis_name is None else jax.lax.axis_index(options.axis_name)
    if options.axis_name is not None:  # name the global batch, not this device's rows
        # the first leaf's rows; split_microbatches names scalars and mismatched leaves
        local = next((jnp.shape(x)[0] for x in jax.tree.leaves(batches) if jnp.ndim(x)), None)
        if local is not None and local % k:
            devices = jax.lax.axis_size(options.axis_name)
            raise sharding.indivisible_error(local * devices, devices, k, options.axis_name)
    micro = tuple(split_microbatches(b, k, name=f"args[{i}]") for i, b in zip(batch_pos, batches))
    # Loss totals and counts are summed at least in float32, and in float64 under x64.
    sum_dtype = jnp.result_type(
        options.accumulator_dtype or jnp.float32, jnp.float32, *jax.tree.leaves(primals)
    )
    keys = tuple(args[i] for i in rng_pos)
    user_state = jax.tree.map(jnp.asarray, tuple(args[i] for i in state_pos))
    node_state = {i: _rest_of(split) for i, split in nodes.items()}
    if options.axis_name is not None:  # each device draws its own NNX random streams
        node_state = _fold_keys(node_state, device_index)

    def loss_on(diff, batch, keys, state):
        user, node_rest = state
        full = list(args)
        for group, values in ((diff_pos, diff), (batch_pos, batch), (rng_pos, keys)):
            for i, v in zip(group, values):
                full[i] = v
        for i, v in zip(state_pos, user):
            full[i] = v
        for i, split in nodes.items():
            own = diff[diff_pos.index(i)] if i in diff_pos else None
            full[i] = _merge_arg(split, own, node_rest[i])
        out = fun(*full, **kwargs)
        mean, aux, new_user = _parse_output(out, options.has_aux, bool(state_pos))
        if state_pos:
            new_user = (new_user,) if options.single_state else tuple(new_user)
            new_user = _like(new_user, user, "returned a new_state")
        new_rest = {
            i: _like(
                _new_rest(full[i], nodes[i], options.filters.get(i)),
                node_rest[i],
                f"left the Flax NNX argument args[{i}] with state",
            )
            for i in nodes
        }
        count = jax.lax.stop_gradient(jnp.asarray(mean.count, sum_dtype))
        return jnp.asarray(mean.total), (count, aux, (new_user or (), new_rest))

    grad_fn = jax.value_and_grad(loss_on, has_aux=True)

    def body(carry, batch_i):
        index, grads, total, count, state = carry
        keys_i = jax.tree.map(lambda key: jax.random.fold_in(key, device_index * k + index), keys)
        diff = sharding.varying(primals, options.axis_name)
        (t, (c, aux, new_state)), g = grad_fn(diff, batch_i, keys_i, state)
        grads = jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, g)
        total = total + t.astype(total.dtype)
        return (index + 1, grads, total, count + c, new_state), aux

    zeros = jax.tree.map(
        lambda x: jnp.zeros(
            jnp.shape(x), _checks.accumulation_dtype(options.accumulator_dtype, jnp.result_type(x))
        ),
        primals,
    )
    state0 = (user_state, node_state)
    total0 = jnp.zeros((), sum_dtype)
    carry = (jnp.zeros((), jnp.int32), zeros, total0, total0, state0)
    carry = sharding.varying(carry, options.axis_name)
    (_, grads, total, count, state), aux = jax.lax.scan(body, carry, micro, length=k)
    if options.axis_name is not None:
        grads, total, count = sharding.psum_invariant(
            (grads, total, count), (primals, 0.0, 0.0), options.axis_name
        )
        state = _reduce_state(state, state0, options.axis_name)
        state = (state[0], _restore_keys(state[1], {i: _rest_of(n) for i, n in nodes.items()}))
    grads = jax.tree.map(lambda g, p: (g / count).astype(jnp.result_type(p)), grads, primals)
    user_state, node_state = state
    for i, node_rest in node_state.items():
        _write_back(nodes[i], node_rest)
    return Accumulated(
        mean=Mean(total, count),
        grads=grads[0] if options.single_argnum else grads,
        aux=aux if options.has_aux else None,
        state=(user_state[0] if options.single_state else user_state) if state_pos else None,
    )


# --- the public transformations -----------------------------------------------------


def accumulate(
    fun: Callable[..., Any],
    argnums: ArgNums = 0,
    has_aux: bool = False,
    *,
    num_microbatches: int,
    batch_argnums: int | Sequence[int] = 1,
    rng_argnums: int | Sequence[int] = (),
    state_argnums: int | Sequence[int] = (),
    axis_name: Any = None,
    accumulator_dtype: Any = None,
) -> Callable[..., Accumulated]:
    """Like :func:`value_and_grad`, but the function returns everything as an :class:`Accumulated`.

    Use it when you need the summed :class:`Mean` (for instance the token count, to
    weight :class:`jaxga.MultiSteps` calls) rather than only its value. Options are as
    for :func:`value_and_grad`.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> loss = lambda w, x: jaxga.Mean.of(w * x)
        >>> acc = jaxga.accumulate(loss, num_microbatches=2)(2.0, jnp.arange(4.0))
        >>> float(acc.mean.value), float(acc.mean.count), float(acc.grads)
        (3.0, 4.0, 1.5)
    """
    options = _options(
        fun,
        num_microbatches,
        argnums,
        has_aux,
        batch_argnums,
        rng_argnums,
        state_argnums,
        axis_name,
        accumulator_dtype,
    )

    @functools.wraps(fun)
    def accumulated(*args: Any, **kwargs: Any) -> Accumulated:
        return _accumulate(fun, options, args, kwargs)

    return accumulated


def value_and_grad(
    fun: Callable[..., Any],
    argnums: ArgNums = 0,
    has_aux: bool = False,
    *,
    num_microbatches: int,
    batch_argnums: int | Sequence[int] = 1,
    rng_argnums: int | Sequence[int] = (),
    state_argnums: int | Sequence[int] = (),
    axis_name: Any = None,
    accumulator_dtype: Any = None,
) -> Callable[..., Any]:
    """Like :func:`jax.value_and_grad`, accumulated over micro-batches in one ``lax.scan``.

    The leading axis of every array in the batch argument(s) is split into
    ``num_microbatches`` equal micro-batches (see :func:`split_microbatches`);
    ``jax.value_and_grad(fun)`` runs on one micro-batch per scan iteration, so
    activations live for one micro-batch at a time, and gradients are summed in a
    carried accumulator. ``argnums`` and ``has_aux`` are positional as in JAX, so
    porting a call never changes its meaning.

    **How the micro-batches are combined.** If ``fun`` returns a :class:`jaxga.Mean`,
    totals and counts are summed over all micro-batches (and devices) and divided
    once: the value and gradient are exactly those of the whole batch, also for
    masked and variable-length losses. If ``fun`` returns a plain scalar, it is taken
    to be its micro-batch's mean and the micro-batches weigh equally — exact only
    when every micro-batch has the same number of items.

    **Flax NNX.** Arguments may be NNX graph nodes (modules, ``nnx.Optimizer``s, lists
    or dicts of them), as for ``nnx.value_and_grad``: the ``nnx.Param`` state of a
    differentiated module is differentiated (``nnx.DiffState(i, filter)`` in
    ``argnums`` chooses other state) and its gradient comes back as an ``nnx.State``.
    All other state of every module argument — BatchNorm statistics, ``nnx.Rngs``
    counters, any ``nnx.Variable`` the model writes — is carried from one micro-batch
    to the next and written back into the module when the call returns, exactly as
    if the micro-batches had been run one after another in order 0, 1, …, k − 1.
    Dropout drawing from an ``nnx.Rngs`` of the module thus gets a fresh key per
    micro-batch (the stream's counter advances once per draw, as it would over k
    sequential steps), and a different one on the next call. Works eagerly, inside
    ``nnx.jit`` and inside ``jax.jit``.

    **Randomness.** Explicit PRNG key arguments (``rng_argnums``) give micro-batch
    ``i`` the key ``fold_in(key, i)``, with ``i`` numbered across devices. With
    ``axis_name``, each device also folds its index into the keys of NNX ``Rngs``
    for the duration of the call, so devices draw different masks; the module's keys
    are unchanged afterwards and its counters advance as on one device.

    Args:
        fun: the loss; returns a float scalar or a :class:`jaxga.Mean` (with
            ``has_aux``: a pair ``(loss, aux)``; with ``state_argnums``: a pair
            ``(output, new_state)`` where output is what it would return without).
        argnums: position(s) of the argument(s) to differentiate, as in JAX; for NNX
            arguments an ``nnx.DiffState(position, filter)`` too.
        has_aux: as in :func:`jax.value_and_grad`; ``aux`` comes back stacked along a
            leading micro-batch axis, as ``lax.scan`` stacks its outputs
            (:func:`merge_microbatches` restores per-example outputs to batch order).
        num_microbatches: how many micro-batches to split the batch into.
        batch_argnums: position(s) of the argument(s) to split along their leading axis.
        rng_argnums: position(s) of PRNG key arguments (any pytree of keys).
        state_argnums: position(s) of state that is not differentiated but updated, such
            as Linen ``batch_stats``: ``fun`` returns ``(output, new_state)``, the state
            is carried from one micro-batch to the next, and the transformed function
            returns ``(result, new_state)``. (NNX modules need no such argument.)
        axis_name: the mesh axis the batch is split over, inside ``shard_map``/``pmap``:
            each device scans its local micro-batches and one ``psum`` of gradients,
            totals and counts follows the loop, giving the global-batch result on every
            device. Threaded state that was the same on every device (replicated
            BatchNorm statistics) is averaged over devices; counters take the maximum.
        accumulator_dtype: the dtype of the gradient sums. ``None`` (default): at
            least float32 — bfloat16 gradients are summed in float32, float64 ones
            (under x64) in float64; an explicit dtype is used as it is. Gradients are
            returned in each argument's own dtype; the value is at least float32.

    Returns:
        A function with ``fun``'s signature returning ``(value, grads)``, or
        ``((value, aux), grads)`` with ``has_aux``; with ``state_argnums`` that result is
        paired with the new state: ``(result, new_state)``.

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> def loss(w, batch):
        ...     return jaxga.token_cross_entropy(batch["x"] @ w, batch["y"], batch["mask"])
        >>> w = jnp.zeros((3, 4))
        >>> batch = {"x": jnp.ones((8, 5, 3)), "y": jnp.zeros((8, 5), jnp.int32),
        ...          "mask": jnp.ones((8, 5))}
        >>> value, g = jax.jit(jaxga.value_and_grad(loss, num_microbatches=4))(w, batch)
        >>> round(float(value), 4), g.shape
        (1.3863, (3, 4))
    """
    accumulated = accumulate(
        fun,
        argnums,
        has_aux,
        num_microbatches=num_microbatches,
        batch_argnums=batch_argnums,
        rng_argnums=rng_argnums,
        state_argnums=state_argnums,
        axis_name=axis_name,
        accumulator_dtype=accumulator_dtype,
    )
    has_state = bool(_positions("state_argnums", state_argnums))

    @functools.wraps(fun)
    def value_and_grad_fun(*args: Any, **kwargs: Any) -> Any:
        acc = accumulated(*args, **kwargs)
        value = acc.mean.value
        result = ((value, acc.aux) if has_aux else value), acc.grads
        return (result, acc.state) if has_state else result

    return value_and_grad_fun


def grad(
    fun: Callable[..., Any],
    argnums: ArgNums = 0,
    has_aux: bool = False,
    *,
    num_microbatches: int,
    batch_argnums: int | Sequence[int] = 1,
    rng_argnums: int | Sequence[int] = (),
    state_argnums: int | Sequence[int] = (),
    axis_name: Any = None,
    accumulator_dtype: Any = None,
) -> Callable[..., Any]:
    """Like :func:`jax.grad`, accumulated over micro-batches; see :func:`value_and_grad`.

    Returns ``grads``, or ``(grads, aux)`` with ``has_aux``; with ``state_argnums``
    that result is paired with the new state: ``(result, new_state)``.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> g = jaxga.grad(lambda w, x: jnp.mean(w * x), num_microbatches=2)(1.0, jnp.arange(4.0))
        >>> float(g)
        1.5
    """
    accumulated = accumulate(
        fun,
        argnums,
        has_aux,
        num_microbatches=num_microbatches,
        batch_argnums=batch_argnums,
        rng_argnums=rng_argnums,
        state_argnums=state_argnums,
        axis_name=axis_name,
        accumulator_dtype=accumulator_dtype,
    )
    has_state = bool(_positions("state_argnums", state_argnums))

    @functools.wraps(fun)
    def grad_fun(*args: Any, **kwargs: Any) -> Any:
        acc = accumulated(*args, **kwargs)
        result = (acc.grads, acc.aux) if has_aux else acc.grads
        return (result, acc.state) if has_state else result

    return grad_fun
