"""Exact gradient accumulation over micro-batches inside one compiled step.

One engine, :func:`accumulate`, runs the loss over the micro-batches in a ``lax.scan``;
:func:`value_and_grad` and :func:`grad` shape its result as JAX's functions do.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxga import _checks, collectives, modules
from jaxga.loss import Mean, as_mean
from jaxga.microbatch import IndivisibleBatchError, merge_microbatches, split_microbatches

__all__ = ["Accumulated", "accumulate", "grad", "value_and_grad"]

ArgNums = int | nnx.DiffState | Sequence[int | nnx.DiffState]
Positions = int | Sequence[int]


class Accumulated(NamedTuple):
    """Everything one pass over the micro-batches produced.

    Attributes:
        mean: ``Mean(Σ total, Σ count)`` over micro-batches and devices.
        grads: the gradient of ``mean.value`` in each parameter's dtype; a tuple for a
            sequence ``argnums``; an ``nnx.State`` for an NNX module.
        aux: the auxiliary output as :func:`value_and_grad` returns it, or ``None``.
        state: the threaded ``state_argnums`` after the last micro-batch, or ``None``.
    """

    mean: Mean
    grads: Any
    aux: Any
    state: Any


@dataclasses.dataclass(frozen=True)
class _Options:
    num_microbatches: int
    argnums: tuple[int, ...]
    filters: dict[int, Any]  # the NNX filter of each differentiated argument
    single_argnum: bool
    has_aux: bool
    batch_argnums: tuple[int, ...]
    rng_argnums: tuple[int, ...] | None  # None: every other argument holding PRNG keys
    state_argnums: tuple[int, ...]
    single_state: bool
    axis_name: Any
    accumulator_dtype: Any


def _positions(name: str, value: Any, shown: Any = None) -> tuple[int, ...]:
    expected = f"`{name}` must be a non-negative int or a tuple of them; got {shown or value!r}."
    try:
        values = (value,) if isinstance(value, int) else tuple(value)
    except TypeError:
        raise TypeError(expected) from None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TypeError(expected)
    if len(set(values)) != len(values):
        raise ValueError(f"`{name}` must not repeat a position; got {shown or value!r}.")
    return values


def _options(fun, argnums, has_aux, num_microbatches, **named) -> _Options:
    if not callable(fun):
        raise TypeError(f"`fun` must be a function; got {fun!r} of type {type(fun).__name__}.")
    single = isinstance(argnums, int | nnx.DiffState)
    items = (argnums,) if single or isinstance(argnums, str) else argnums
    try:
        items = tuple(items)
    except TypeError:
        items = (argnums,)
    filters = {a.argnum: a.filter for a in items if isinstance(a, nnx.DiffState)}
    diff = tuple(a.argnum if isinstance(a, nnx.DiffState) else a for a in items)
    diff = _positions("argnums", diff, shown=repr(argnums))
    if not diff:
        raise ValueError("`argnums` must name at least one argument to differentiate.")
    rng = named["rng_argnums"]
    positions = {
        "argnums": diff,
        "batch_argnums": _positions("batch_argnums", named["batch_argnums"]),
        "rng_argnums": () if rng is None else _positions("rng_argnums", rng),
        "state_argnums": _positions("state_argnums", named["state_argnums"]),
    }
    names = list(positions)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if common := sorted(set(positions[a]) & set(positions[b])):
                raise ValueError(
                    f"`{a}`={positions[a]} and `{b}`={positions[b]} both name positional "
                    f"argument(s) {common}; an argument is either differentiated, split into "
                    f"micro-batches, a PRNG key or threaded state, not two of these."
                )
    return _Options(
        num_microbatches=_checks.positive_int(num_microbatches, "num_microbatches"),
        argnums=diff,
        filters={i: filters.get(i, nnx.Param) for i in diff},
        single_argnum=single,
        has_aux=_checks.check_bool(has_aux, "has_aux"),
        batch_argnums=positions["batch_argnums"],
        rng_argnums=None if rng is None else positions["rng_argnums"],
        state_argnums=positions["state_argnums"],
        single_state=isinstance(named["state_argnums"], int),
        axis_name=named["axis_name"],
        accumulator_dtype=_checks.float_dtype(named["accumulator_dtype"]),
    )


# --- checks at call time ------------------------------------------------------------


def _is_key(x: Any, raw: bool = True) -> bool:
    """A typed PRNG key, or (``raw``) a ``jax.random.PRNGKey``'s ``uint32[2]``."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    return jnp.issubdtype(dtype, jax.dtypes.prng_key) or (
        raw and dtype == jnp.uint32 and jnp.shape(x) == (2,)
    )


def _rng_positions(options: _Options, args: tuple[Any, ...]) -> tuple[int, ...]:
    """The PRNG key arguments: ``rng_argnums``, or by default every other one holding keys."""
    if options.rng_argnums is not None:
        for i in options.rng_argnums:
            for path, key in jax.tree_util.tree_flatten_with_path(args[i])[0]:
                if not _is_key(key):
                    raise TypeError(
                        f"`rng_argnums` names args[{i}], but args[{i}]"
                        f"{jax.tree_util.keystr(path)} is not a PRNG key ({_describe(key)}); "
                        f"expected keys from jax.random.key (or jax.random.PRNGKey)."
                    )
        return options.rng_argnums
    named = {*options.argnums, *options.batch_argnums, *options.state_argnums}
    found = []
    for i, arg in enumerate(args):
        if i in named or modules.holds_graph_node(arg):
            continue
        leaves = jax.tree.leaves(arg)
        if any(_is_key(x, raw=False) for x in leaves):
            found.append(i)
        elif any(_is_key(x) for x in leaves):
            raise TypeError(
                f"args[{i}] holds a uint32[2] array, a raw PRNG key (jax.random.PRNGKey): pass "
                f"rng_argnums={i} so that each micro-batch draws its own key from it, or "
                f"rng_argnums=() to give every micro-batch this same array."
            )
    return tuple(found)


def _check_call(options: _Options, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    for name in ("argnums", "batch_argnums", "rng_argnums", "state_argnums"):
        positions = getattr(options, name) or ()
        if positions and max(positions) >= len(args):
            hint = " Pass the batch as an argument." if name == "batch_argnums" else ""
            raise ValueError(
                f"`{name}`={positions} refers to positional argument {max(positions)}, but "
                f"the function was called with {len(args)} positional argument(s).{hint}"
            )
        if name != "argnums":
            for i in positions:
                if modules.holds_graph_node(args[i]):
                    raise TypeError(
                        f"`{name}` names args[{i}], a Flax NNX graph node; modules are "
                        f"differentiated (`argnums`) or passed as they are, and their state "
                        f"is threaded through the micro-batches without being named."
                    )
    for key, value in kwargs.items():
        if modules.holds_graph_node(value):
            raise TypeError(
                f"Keyword argument {key!r} holds a Flax NNX graph node; pass modules positionally."
            )
    for i in options.batch_argnums:
        if not jax.tree.leaves(args[i]):
            raise ValueError(
                f"`batch_argnums` names args[{i}], which has no array leaves (got {args[i]!r}): "
                f"nothing would be split. Pass the batch there, or set `batch_argnums`."
            )
        _checks.leading_size(args[i], f"args[{i}]", "batch")
    if options.axis_name is not None:
        collectives.check_axis_bound(options.axis_name)
    elif axes := set().union(
        *map(collectives.varying_axes, jax.tree.leaves([args[i] for i in options.batch_argnums]))
    ):
        raise ValueError(
            f"The batch varies over mesh axes {sorted(axes, key=str)} (this is inside "
            f"shard_map), but `axis_name` is None: pass axis_name={sorted(axes, key=str)[0]!r} "
            f"so that the sums are reduced across devices once, after the micro-batch loop."
        )


def _check_primals(primals: tuple[Any, ...], argnums: tuple[int, ...]) -> None:
    for i, tree in zip(argnums, primals):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if not _is_inexact(leaf):
                raise TypeError(
                    f"`argnums` differentiates args[{i}], whose leaf args[{i}]"
                    f"{jax.tree_util.keystr(path)} has dtype {jnp.result_type(leaf)}; only "
                    f"floating leaves can be differentiated. Pass others in another argument."
                )


def _is_inexact(x: Any) -> bool:
    dtype = getattr(x, "dtype", None) if not isinstance(x, float | complex) else jnp.float32
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _describe(x: Any) -> str:
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return f"shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{x!r} of type {type(x).__name__}"


def _parse_output(out: Any, options: _Options) -> tuple[Mean, Any, Any]:
    """``fun``'s output as ``(mean, aux, new_state)``, each checked."""
    state = aux = None
    if options.state_argnums:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"With `state_argnums`, `fun` must return a pair (output, new_state); got "
                f"{type(out).__name__}."
            )
        out, state = out
    if options.has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"With has_aux=True, `fun` must return a pair (value, aux); got "
                f"{type(out).__name__}."
            )
        out, aux = out
    elif isinstance(out, tuple | list):
        raise TypeError(
            f"`fun` returned a {type(out).__name__} of length {len(out)}, but has_aux=False; "
            f"pass has_aux=True if it returns (loss, aux)."
        )
    if modules.holds_graph_node((out, aux)):
        raise TypeError(
            "`fun` returned a Flax NNX graph node (a module) in its value or aux; return "
            "arrays: jaxga writes the state of module arguments back into them itself."
        )
    total = out.total if isinstance(out, Mean) else out
    if not (_is_inexact(total) and jnp.shape(total) == ()):
        what = "Mean.total has" if isinstance(out, Mean) else "it returned"
        raise TypeError(
            f"`fun` must return a float scalar or a jaxga.Mean of float scalars; "
            f"{what} {_describe(total)}."
        )
    mean = as_mean(out)
    count = mean.count
    if jnp.shape(count) != () or not jnp.issubdtype(jnp.result_type(count), jnp.number):
        raise TypeError(
            f"`fun` returned a jaxga.Mean whose count has {_describe(jnp.asarray(count))}; "
            f"expected a scalar number of items (or total weight)."
        )
    return mean, aux, state


def _like(new: Any, old: Any, what: str) -> Any:
    """``new`` cast to the dtypes of ``old``, so that it can be carried by the scan."""
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
                f"`fun` {what} whose leaf {jax.tree_util.keystr(path)} has {_describe(n)}; it was "
                f"given {_describe(jnp.asarray(o))}: state keeps its shape and dtype kind."
            )
        return n.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, new, old)


# --- the engine ---------------------------------------------------------------------


def _fold_keys(tree: Any, index: jax.Array, raw: bool = True) -> Any:
    return jax.tree.map(lambda x: jax.random.fold_in(x, index) if _is_key(x, raw) else x, tree)


def _reduce_state(state: Any, before: Any, axis_name: Any) -> Any:
    """Threaded state that was the same on every device made the same again: floating
    leaves averaged (``before + pmean(x - before)``), counters and keys their maximum."""

    def reduce(x, old):
        over = tuple(
            a for a in collectives.axes(axis_name) if a not in collectives.varying_axes(old)
        )
        if not over:
            return x
        if jnp.issubdtype(x.dtype, jnp.floating):
            return old + jax.lax.pmean(x - old, over)
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = jax.lax.pmax(jax.random.key_data(x), over)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.lax.pmax(x, over)

    return jax.tree.map(reduce, state, before)


def _finish_aux(aux: Any, whole: Any, k: int) -> Any:
    """``aux`` as the whole batch gives it (``whole``: its shapes): per-example leaves in
    batch order, ``Mean``s summed; other leaves keep their micro-batch axis."""

    def finish(x, like):
        if isinstance(x, Mean):
            return Mean(jnp.sum(x.total, 0), jnp.sum(x.count, 0))
        if k == 1 or jnp.shape(x)[1:] == like.shape:  # the same per micro-batch: keep all k
            return x[0] if k == 1 else x
        return merge_microbatches(x)

    return jax.tree.map(finish, aux, whole, is_leaf=lambda x: isinstance(x, Mean))


def _split_batches(options: _Options, args: tuple[Any, ...]) -> tuple[Any, ...]:
    k, axis = options.num_microbatches, options.axis_name
    batches = [args[i] for i in options.batch_argnums]
    local = next((jnp.shape(x)[0] for x in jax.tree.leaves(batches)), None)
    if axis is not None and local is not None and local % k:  # name the global batch
        devices = jax.lax.axis_size(axis)
        raise IndivisibleBatchError.of(local * devices, k, devices, axis)
    micro = tuple(
        split_microbatches(b, k, name=f"args[{i}]") for i, b in zip(options.batch_argnums, batches)
    )
    return micro


def _micro_loss(fun, options, args, kwargs, parts, rng_pos, device, sum_dtype) -> Callable:
    """``(diff, batch, index, state) -> (total, (count, aux, state))``."""
    diff_pos, state_pos = options.argnums, options.state_argnums

    def loss_on(diff, batch, index, state):
        full = list(args)
        for group, values in ((diff_pos, diff), (options.batch_argnums, batch)):
            for i, v in zip(group, values):
                full[i] = v
        for i, v in zip(state_pos, state[0]):
            full[i] = v
        for i in rng_pos:
            full[i] = _fold_keys(args[i], device * options.num_microbatches + index)
        for i, p in parts.items():
            own = diff[diff_pos.index(i)] if i in diff_pos else None
            full[i] = modules.put_together(p, own, state[1][i])
        mean, aux, user = _parse_output(fun(*full, **kwargs), options)
        if state_pos:
            user = _like(
                (user,) if options.single_state else user, state[0], "returned a new_state"
            )
        rest = {
            i: _like(
                modules.new_rest(full[i], p, options.filters.get(i)),
                state[1][i],
                f"left the module args[{i}] with state",
            )
            for i, p in parts.items()
        }
        count = jax.lax.stop_gradient(jnp.asarray(mean.count, sum_dtype))
        return jnp.asarray(mean.total), (count, aux, (user if state_pos else (), rest))

    return loss_on


def _scan(loss_on, options, primals, micro, state0, sum_dtype) -> tuple[Any, ...]:
    """Sums of gradients, totals and counts over the micro-batches, the state and aux."""
    axis, grad_fn = options.axis_name, jax.value_and_grad(loss_on, has_aux=True)

    def body(carry, batch):
        index, grads, total, count, state = carry
        diff = collectives.varying(primals, axis)  # local sums: one reduction after the loop
        (t, (c, aux, state)), g = grad_fn(diff, batch, index, state)
        grads = jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, g)
        return (index + 1, grads, total + t.astype(sum_dtype), count + c, state), aux

    dtype = lambda x: _checks.sum_dtype(options.accumulator_dtype, jnp.result_type(x))
    zeros = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), dtype(x)), primals)
    zero = jnp.zeros((), sum_dtype)
    carry = collectives.varying((jnp.zeros((), jnp.int32), zeros, zero, zero, state0), axis)
    carry, aux = jax.lax.scan(body, carry, micro, length=options.num_microbatches)
    return (*carry[1:], aux)


def _accumulate(fun: Callable, options: _Options, args: tuple, kwargs: dict) -> Accumulated:
    _check_call(options, args, kwargs)
    axis, filters = options.axis_name, options.filters
    parts = {
        i: modules.take_apart(arg, f"args[{i}]", filters.get(i))
        for i, arg in enumerate(args)
        if modules.holds_module(arg)
    }
    modules.check_unshared(parts)
    primals = tuple(modules.diff_of(parts[i]) if i in parts else args[i] for i in options.argnums)
    _check_primals(primals, options.argnums)
    micro = _split_batches(options, args)
    device = 0 if axis is None else jax.lax.axis_index(axis)
    leaves = jax.tree.leaves(primals)
    sum_dtype = jnp.result_type(options.accumulator_dtype or jnp.float32, jnp.float32, *leaves)
    rest = {i: modules.rest_of(p) for i, p in parts.items()}
    user = jax.tree.map(jnp.asarray, tuple(args[i] for i in options.state_argnums))
    state0 = (user, rest if axis is None else _fold_keys(rest, device, raw=False))
    rng_pos = _rng_positions(options, args)
    loss_on = _micro_loss(fun, options, args, kwargs, parts, rng_pos, device, sum_dtype)
    grads, total, count, state, aux = _scan(loss_on, options, primals, micro, state0, sum_dtype)
    if options.has_aux:
        batches = tuple(args[i] for i in options.batch_argnums)
        whole = jax.eval_shape(loss_on, primals, batches, 0, state0)[1][1]
        aux = _finish_aux(aux, whole, options.num_microbatches)
    if axis is not None:
        sums = collectives.psum_invariant((grads, total, count), (primals, 0.0, 0.0), axis)
        grads, total, count = sums
        state = _reduce_state(state, state0, axis)
        restore = lambda x, r: r if _is_key(x, raw=False) else x  # the caller's NNX keys
        state = (state[0], jax.tree.map(restore, state[1], rest))
    _check_count(count)
    grads = jax.tree.map(lambda g, p: (g / count).astype(jnp.result_type(p)), grads, primals)
    for i, new in state[1].items():
        modules.write_back(parts[i], new)
    return Accumulated(
        mean=Mean(total, count),
        grads=grads[0] if options.single_argnum else grads,
        aux=aux if options.has_aux else None,
        state=(state[0][0] if options.single_state else state[0])
        if options.state_argnums
        else None,
    )


def _check_count(count: jax.Array) -> None:
    """An eagerly known count that is NaN or negative is an error (under jit it is a NaN)."""
    if not isinstance(count, jax.core.Tracer) and not bool(count >= 0):
        raise ValueError(
            f"The loss's jaxga.Mean counts summed to {float(count)} items over the batch; a "
            f"count is a number of items or a total weight: finite and non-negative."
        )


# --- the public transformations -----------------------------------------------------


def accumulate(
    fun: Callable[..., Any],
    argnums: ArgNums = 0,
    has_aux: bool = False,
    *,
    num_microbatches: int,
    batch_argnums: Positions = 1,
    rng_argnums: Positions | None = None,
    state_argnums: Positions = (),
    axis_name: Any = None,
    accumulator_dtype: Any = None,
) -> Callable[..., Accumulated]:
    """Like :func:`value_and_grad`, returning everything as an :class:`Accumulated`.

    Args:
        fun: the loss; returns a float scalar (a mean over its micro-batch) or a
            :class:`jaxga.Mean`; with ``has_aux`` a pair ``(loss, aux)``; with
            ``state_argnums`` a pair ``(output, new_state)``.
        argnums: position(s) of the argument(s) to differentiate, as in JAX; for NNX
            modules also ``nnx.DiffState(position, filter)``.
        has_aux: whether ``fun`` returns ``(loss, aux)``.
        num_microbatches: how many micro-batches to split the batch into.
        batch_argnums: position(s) of the argument(s) split along their leading axis.
        rng_argnums: position(s) of PRNG key arguments; micro-batch ``i`` gets
            ``fold_in(key, i)``. ``None`` (default): every other argument holding typed
            keys; ``()``: none.
        state_argnums: position(s) of state threaded through the micro-batches (Linen
            ``batch_stats``); ``fun`` returns ``(output, new_state)``.
        axis_name: the mesh axis the batch is split over inside ``shard_map``: sums are
            reduced across it once, after the loop.
        accumulator_dtype: dtype of the gradient sums; ``None``: at least float32.

    Returns:
        A function with ``fun``'s signature returning an :class:`Accumulated`.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> loss = lambda w, x: jaxga.Mean.of(w * x)
        >>> acc = jaxga.accumulate(loss, num_microbatches=2)(2.0, jnp.arange(4.0))
        >>> float(acc.mean.value), float(acc.mean.count), float(acc.grads)
        (3.0, 4.0, 1.5)
    """
    options = _options(
        fun,
        argnums,
        has_aux,
        num_microbatches,
        batch_argnums=batch_argnums,
        rng_argnums=rng_argnums,
        state_argnums=state_argnums,
        axis_name=axis_name,
        accumulator_dtype=accumulator_dtype,
    )

    @functools.wraps(fun)
    def accumulated(*args: Any, **kwargs: Any) -> Accumulated:
        return _accumulate(fun, options, args, kwargs)

    accumulated.has_state = bool(options.state_argnums)
    return accumulated


def value_and_grad(
    fun: Callable[..., Any],
    argnums: ArgNums = 0,
    has_aux: bool = False,
    *,
    num_microbatches: int,
    **options: Any,
) -> Callable[..., Any]:
    """Like :func:`jax.value_and_grad`, accumulated over micro-batches in one ``lax.scan``.

    The leading axis of every array in the batch argument(s) is split into
    ``num_microbatches`` micro-batches; gradients, and the totals and counts of a
    :class:`jaxga.Mean` loss, are summed over them and divided once. NNX modules are
    taken as ``nnx.value_and_grad`` takes them (their other state threaded through the
    micro-batches and written back), Equinox modules as ``eqx.filter_value_and_grad``
    does. ``aux`` comes back as the whole batch would give it where that is known:
    per-example leaves in batch order, ``jaxga.Mean`` leaves summed; other leaves are
    stacked along a leading micro-batch axis.

    Args:
        fun: the loss, as for :func:`accumulate`.
        argnums: as in :func:`jax.value_and_grad`.
        has_aux: as in :func:`jax.value_and_grad`.
        num_microbatches: how many micro-batches to split the batch into.
        **options: ``batch_argnums``, ``rng_argnums``, ``state_argnums``, ``axis_name``,
            ``accumulator_dtype``, as for :func:`accumulate`.

    Returns:
        A function returning ``(value, grads)``, or ``((value, aux), grads)`` with
        ``has_aux``; with ``state_argnums`` paired with the new state.

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
    accumulated = accumulate(fun, argnums, has_aux, num_microbatches=num_microbatches, **options)

    @functools.wraps(fun)
    def value_and_grad_fun(*args: Any, **kwargs: Any) -> Any:
        acc = accumulated(*args, **kwargs)
        value = (acc.mean.value, acc.aux) if has_aux else acc.mean.value
        return ((value, acc.grads), acc.state) if accumulated.has_state else (value, acc.grads)

    return value_and_grad_fun


def grad(
    fun: Callable[..., Any],
    argnums: ArgNums = 0,
    has_aux: bool = False,
    *,
    num_microbatches: int,
    **options: Any,
) -> Callable[..., Any]:
    """Like :func:`jax.grad`, accumulated over micro-batches; see :func:`value_and_grad`.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> g = jaxga.grad(lambda w, x: jnp.mean(w * x), num_microbatches=2)(1.0, jnp.arange(4.0))
        >>> float(g)
        1.5
    """
    accumulated = accumulate(fun, argnums, has_aux, num_microbatches=num_microbatches, **options)

    @functools.wraps(fun)
    def grad_fun(*args: Any, **kwargs: Any) -> Any:
        acc = accumulated(*args, **kwargs)
        result = (acc.grads, acc.aux) if has_aux else acc.grads
        return (result, acc.state) if accumulated.has_state else result

    return grad_fun
