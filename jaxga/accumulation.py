"""Exact gradient accumulation over micro-batches inside one compiled step."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxga import sharding
from jaxga._checks import leading_size, positive_int
from jaxga.loss import Mean, as_mean

__all__ = [
    "Accumulated",
    "accumulate",
    "grad",
    "merge_microbatches",
    "split_microbatches",
    "value_and_grad",
]

ArgNums = int | Sequence[int]


class Accumulated(NamedTuple):
    """Everything one pass over the micro-batches produced, before any output shaping.

    Attributes:
        mean: the summed loss, ``Mean(Σ total, Σ count)`` over micro-batches (and devices).
        grads: the gradient of ``mean.value``, one entry per differentiated argument,
            each leaf in its parameter's dtype.
        aux: auxiliary outputs stacked along a leading micro-batch axis (``None``
            without ``has_aux``).
        state: the threaded state after the last micro-batch, one entry per state
            argument (empty without ``state_argnums``).
    """

    mean: Mean
    grads: tuple[Any, ...]
    aux: Any
    state: tuple[Any, ...]


def _positions(name: str, value: ArgNums) -> tuple[int, ...]:
    values = (value,) if isinstance(value, int) else value
    try:
        values = tuple(values)
    except TypeError:
        raise TypeError(f"`{name}` must be an int or a tuple of ints; got {value!r}.") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TypeError(f"`{name}` must be a non-negative int or a tuple of them; got {value!r}.")
    if len(set(values)) != len(values):
        raise ValueError(f"`{name}` must not repeat a position; got {value!r}.")
    return values


def _check_num_microbatches(num_microbatches: Any) -> int:
    return positive_int(num_microbatches, "num_microbatches")


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


def _check_in_range(num_args: int, **named: tuple[int, ...]) -> None:
    for name, positions in named.items():
        if positions and max(positions) >= num_args:
            raise ValueError(
                f"`{name}`={positions} refers to positional argument {max(positions)}, but "
                f"the function was called with {num_args} positional argument(s)."
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
    num_microbatches = _check_num_microbatches(num_microbatches)
    size = leading_size(batch, name, "batch")
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


def _like(new: Any, old: Any, name: str) -> Any:
    """Casts ``new`` to the dtypes of ``old``, so that it can be a scan carry."""
    if jax.tree.structure(new) != jax.tree.structure(old):
        raise TypeError(
            f"`fun` returned a {name} with tree structure {jax.tree.structure(new)}; it must "
            f"match the state it was given, {jax.tree.structure(old)}."
        )
    return jax.tree.map(lambda n, o: jnp.asarray(n, jnp.result_type(o)), new, old)


def _fold_in(keys: Any, index: jax.Array) -> Any:
    return jax.tree.map(lambda key: jax.random.fold_in(key, index), keys)


def _accumulator_zeros(tree: Any, accumulator_dtype: Any) -> Any:
    return jax.tree.map(
        lambda x: jnp.zeros(jnp.shape(x), jnp.promote_types(accumulator_dtype, jnp.result_type(x))),
        tree,
    )


def accumulate(
    fun: Callable[..., Any],
    num_microbatches: int,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    argnums: ArgNums = 0,
    batch_argnums: ArgNums = 1,
    has_aux: bool = False,
    rng_argnums: ArgNums = (),
    state_argnums: ArgNums = (),
    axis_name: Any = None,
    accumulator_dtype: Any = jnp.float32,
) -> Accumulated:
    """Runs ``fun`` over micro-batches of ``args`` and returns the raw sums.

    This is the engine behind :func:`value_and_grad`; use it when you need the summed
    :class:`Mean` (for instance the token count) rather than only its value. Arguments
    are as for :func:`value_and_grad`.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> loss = lambda w, x: jaxga.Mean.of(w * x)
        >>> acc = jaxga.accumulate(loss, 2, (2.0, jnp.arange(4.0)))
        >>> float(acc.mean.value), float(acc.mean.count), float(acc.grads[0])
        (3.0, 4.0, 1.5)
    """
    kwargs = kwargs or {}
    num_microbatches = _check_num_microbatches(num_microbatches)
    positions = {
        "argnums": _positions("argnums", argnums),
        "batch_argnums": _positions("batch_argnums", batch_argnums),
        "rng_argnums": _positions("rng_argnums", rng_argnums),
        "state_argnums": _positions("state_argnums", state_argnums),
    }
    _check_disjoint(**positions)
    _check_in_range(len(args), **positions)
    diff_pos, batch_pos, rng_pos, state_pos = positions.values()
    if not diff_pos:
        raise ValueError("`argnums` must name at least one argument to differentiate.")

    local_k = num_microbatches
    device_index = 0
    if axis_name is not None:
        sharding.check_axis_bound(axis_name)
        device_index = jax.lax.axis_index(axis_name)

    batches = tuple(args[i] for i in batch_pos)
    try:
        micro = tuple(
            split_microbatches(b, num_microbatches, name=f"args[{i}]")
            for i, b in zip(batch_pos, batches)
        )
    except ValueError as e:
        if axis_name is not None and "not divisible" in str(e):
            raise sharding.indivisible_error(batches, num_microbatches, axis_name) from e
        raise
    primals = tuple(args[i] for i in diff_pos)
    # Loss totals and counts are summed at least in float32, and in float64 under x64.
    sum_dtype = jnp.result_type(accumulator_dtype, jnp.float32, *jax.tree.leaves(primals))
    keys = tuple(args[i] for i in rng_pos)
    state0 = jax.tree.map(jnp.asarray, tuple(args[i] for i in state_pos))

    def loss_on(diff, batch, keys, state):
        full = list(args)
        for group, values in ((diff_pos, diff), (batch_pos, batch), (rng_pos, keys)):
            for i, v in zip(group, values):
                full[i] = v
        for i, v in zip(state_pos, state):
            full[i] = v
        mean, aux, new_state = _parse_output(fun(*full, **kwargs), has_aux, bool(state_pos))
        if state_pos:
            new_state = (new_state,) if isinstance(state_argnums, int) else tuple(new_state)
            new_state = _like(new_state, state, "new_state")
        count = jax.lax.stop_gradient(jnp.asarray(mean.count, sum_dtype))
        return mean.total, (count, aux, new_state or ())

    grad_fn = jax.value_and_grad(loss_on, has_aux=True)

    def body(carry, batch_i):
        index, grads, total, count, state = carry
        keys_i = _fold_in(keys, device_index * local_k + index)
        diff = sharding.varying(primals, axis_name)
        (t, (c, aux, new_state)), g = grad_fn(diff, batch_i, keys_i, state)
        grads = jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, g)
        total = total + t.astype(total.dtype)
        return (index + 1, grads, total, count + c, new_state), aux

    carry = (
        jnp.zeros((), jnp.int32),
        _accumulator_zeros(primals, accumulator_dtype),
        jnp.zeros((), sum_dtype),
        jnp.zeros((), sum_dtype),
        state0,
    )
    carry = sharding.varying(carry, axis_name)
    (_, grads, total, count, state), aux = jax.lax.scan(body, carry, micro, length=num_microbatches)
    if axis_name is not None:
        grads, total, count = sharding.psum_invariant(
            (grads, total, count), (primals, 0.0, 0.0), axis_name
        )
    grads = jax.tree.map(lambda g, p: (g / count).astype(jnp.result_type(p)), grads, primals)
    return Accumulated(Mean(total, count), grads, aux if has_aux else None, state)


def value_and_grad(
    fun: Callable[..., Any],
    num_microbatches: int,
    *,
    argnums: ArgNums = 0,
    batch_argnums: ArgNums = 1,
    has_aux: bool = False,
    rng_argnums: ArgNums = (),
    state_argnums: ArgNums = (),
    axis_name: Any = None,
    accumulator_dtype: Any = jnp.float32,
) -> Callable[..., Any]:
    """Like :func:`jax.value_and_grad`, accumulated over micro-batches in one ``lax.scan``.

    The leading axis of every array in the batch argument(s) is split into
    ``num_microbatches`` equal micro-batches (see :func:`split_microbatches`);
    ``jax.value_and_grad(fun)`` runs on one micro-batch per scan iteration, so
    activations live for one micro-batch at a time, and gradients are summed in a
    carried accumulator.

    **How the micro-batches are combined.** If ``fun`` returns a :class:`jaxga.Mean`,
    totals and counts are summed over all micro-batches (and devices) and divided
    once: the value and gradient are exactly those of the whole batch, also for
    masked and variable-length losses. If ``fun`` returns a plain scalar, it is taken
    to be its micro-batch's mean and the micro-batches weigh equally — exact only
    when every micro-batch has the same number of items.

    Args:
        fun: the loss; returns a float scalar or a :class:`jaxga.Mean` (with
            ``has_aux``: a pair ``(loss, aux)``; with ``state_argnums``: a pair
            ``(output, new_state)`` where output is what it would return without).
        num_microbatches: how many micro-batches to split the batch into.
        argnums: position(s) of the argument(s) to differentiate, as in JAX.
        batch_argnums: position(s) of the argument(s) to split along their leading axis.
        has_aux: as in :func:`jax.value_and_grad`; ``aux`` comes back stacked along a
            leading micro-batch axis, as ``lax.scan`` stacks its outputs
            (:func:`merge_microbatches` restores per-example outputs to batch order).
        rng_argnums: position(s) of PRNG key arguments (any pytree of keys); micro-batch
            ``i`` (numbered globally across devices) receives ``fold_in(key, i)`` — also
            when ``num_microbatches`` is 1.
        state_argnums: position(s) of state that is not differentiated but updated, such
            as BatchNorm ``batch_stats``: ``fun`` returns ``(output, new_state)``, the
            state is carried from one micro-batch to the next, and the transformed
            function returns ``(result, new_state)``.
        axis_name: call inside ``shard_map``/``pmap`` over this axis: each device scans its
            local micro-batches and one ``psum`` of gradients, totals and counts follows
            the loop, giving the global-batch result on every device.
        accumulator_dtype: the least dtype of the gradient and loss sums: each sum is
            promoted with its argument's dtype, so bfloat16 parameters accumulate in
            float32 and float64 ones (under x64) in float64. Gradients are returned in
            each argument's own dtype; the value is at least float32.

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
    _check_num_microbatches(num_microbatches)
    positions = {
        "argnums": _positions("argnums", argnums),
        "batch_argnums": _positions("batch_argnums", batch_argnums),
        "rng_argnums": _positions("rng_argnums", rng_argnums),
        "state_argnums": _positions("state_argnums", state_argnums),
    }
    _check_disjoint(**positions)
    if not positions["argnums"]:
        raise ValueError("`argnums` must name at least one argument to differentiate.")

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        acc = accumulate(
            fun,
            num_microbatches,
            args,
            kwargs,
            argnums=argnums,
            batch_argnums=batch_argnums,
            has_aux=has_aux,
            rng_argnums=rng_argnums,
            state_argnums=state_argnums,
            axis_name=axis_name,
            accumulator_dtype=accumulator_dtype,
        )
        value = acc.mean.value
        out = (value, acc.aux) if has_aux else value
        grads = acc.grads[0] if isinstance(argnums, int) else acc.grads
        result = (out, grads)
        if positions["state_argnums"]:
            state = acc.state[0] if isinstance(state_argnums, int) else acc.state
            return result, state
        return result

    return wrapped


def grad(fun: Callable[..., Any], num_microbatches: int, **options: Any) -> Callable[..., Any]:
    """Like :func:`jax.grad`, accumulated over micro-batches; see :func:`value_and_grad`.

    Returns ``grads``, or ``(grads, aux)`` with ``has_aux``; with ``state_argnums``
    that result is paired with the new state: ``(result, new_state)``.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> g = jaxga.grad(lambda w, x: jnp.mean(w * x), num_microbatches=2)(1.0, jnp.arange(4.0))
        >>> float(g)
        1.5
    """
    value_and_grad_fun = value_and_grad(fun, num_microbatches, **options)
    has_aux = options.get("has_aux", False)
    has_state = bool(_positions("state_argnums", options.get("state_argnums", ())))

    def drop_value(result):
        (out, grads) = result
        return (grads, out[1]) if has_aux else grads

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        result = value_and_grad_fun(*args, **kwargs)
        if has_state:
            return drop_value(result[0]), result[1]
        return drop_value(result)

    return wrapped
