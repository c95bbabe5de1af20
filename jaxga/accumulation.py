"""Exact gradient accumulation over micro-batches inside one compiled step: the public API."""

import functools
from collections.abc import Callable, Sequence
from typing import Any

from flax import nnx

from jaxga import _checks, arguments, engine
from jaxga.engine import Accumulated

ArgNums = int | nnx.DiffState | Sequence[int | nnx.DiffState]
Positions = int | Sequence[int]


class Accumulate:
    """``fun`` accumulated over micro-batches: what [`jaxga.accumulate`][jaxga.accumulate] returns.

    Attributes:
        fun: the loss it accumulates.
        options: the options it was built with, checked.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> def loss(w, x):
        ...     return jnp.mean(w * x)
        >>> acc = jaxga.accumulate(loss, num_microbatches=2)
        >>> acc.options.num_microbatches, float(acc(2.0, jnp.arange(4.0)).mean.value)
        (2, 3.0)
    """

    def __init__(self, fun: Callable[..., Any], options: arguments.Options):
        self.fun = fun
        self.options = options
        functools.update_wrapper(self, fun)

    def __call__(self, *args: Any, **kwargs: Any) -> Accumulated:
        return engine.run(self.fun, self.options, args, kwargs)


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
    unroll: int | bool = 1,
    aux: str = "auto",
) -> Accumulate:
    """Like [`jaxga.value_and_grad`][jaxga.value_and_grad], returning an `Accumulated`.

    Args:
        fun: the loss: a float scalar (its micro-batch's mean) or a [`jaxga.Mean`][jaxga.Mean];
            with `has_aux`, `(loss, aux)`; with `state_argnums`, `(output, new_state)`.
        argnums: the position(s) to differentiate; for NNX modules also
            `nnx.DiffState(position, filter)` (default filter: `nnx.Param`).
        has_aux: whether `fun` returns `(loss, aux)`.
        num_microbatches: how many micro-batches to split the batch into.
        batch_argnums: the argument(s) split along their leading axis; micro-batch `i`
            holds rows `i, i + k, i + 2k, ...`.
        rng_argnums: PRNG key argument(s); micro-batch `i` gets `fold_in(key, i)`. `None`:
            every other argument holding typed keys; `()`: none.
        state_argnums: argument(s) threaded through the micro-batches (`batch_stats`).
        axis_name: the `shard_map` axis the batch is split over; sums are reduced once.
        accumulator_dtype: the gradient sums' dtype; `None`: at least float32.
        unroll: the loop's `lax.scan` `unroll`: `1` holds one micro-batch's activations at
            a time; `True` unrolls it, faster for convolutions on XLA:CPU but without the
            memory saving.
        aux: `"auto"`: a `Mean` comes back as the whole batch's, a leaf with one row per
            example as the batch's rows, a scalar once per micro-batch (`[k]`), any other
            leaf is an error; `"stack"`: every leaf but a `Mean` once per micro-batch.

    Returns:
        An [`Accumulate`][jaxga.Accumulate]: called as `fun`, it returns an `Accumulated`.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> def loss(w, x):
        ...     return jaxga.Mean.of(w * x)
        >>> acc = jaxga.accumulate(loss, num_microbatches=2)(2.0, jnp.arange(4.0))
        >>> float(acc.mean.value), float(acc.mean.count), float(acc.grads)
        (3.0, 4.0, 1.5)
    """
    _checks.check_callable(fun, "fun")
    options = arguments.make_options(
        argnums,
        batch_argnums=batch_argnums,
        rng_argnums=rng_argnums,
        state_argnums=state_argnums,
        num_microbatches=_checks.positive_int(num_microbatches, "num_microbatches"),
        has_aux=_checks.check_bool(has_aux, "has_aux"),
        axis_name=axis_name,
        accumulator_dtype=_checks.float_dtype(accumulator_dtype),
        unroll=arguments.check_unroll(unroll),
        aux=arguments.check_aux(aux),
    )
    return Accumulate(fun, options)


def value_and_grad(
    fun: Callable[..., Any],
    argnums: ArgNums = 0,
    has_aux: bool = False,
    *,
    num_microbatches: int,
    **options: Any,
) -> Callable[..., Any]:
    """Like `jax.value_and_grad`, accumulated over micro-batches in one `lax.scan`.

    Gradients and a [`jaxga.Mean`][jaxga.Mean] loss's totals and counts are summed, then
    divided once. Modules are taken as `nnx.value_and_grad` and `eqx.filter_value_and_grad`
    take them.

    Args:
        fun: the loss, as for `jax.value_and_grad`; it may return a `jaxga.Mean`.
        argnums: as for `jax.value_and_grad` (NNX: `nnx.DiffState` too).
        has_aux: as for `jax.value_and_grad`.
        num_microbatches: how many micro-batches to split the batch into.
        **options: `batch_argnums`, `rng_argnums`, `state_argnums`, `axis_name`,
            `accumulator_dtype`, `unroll`, `aux`: as for [`jaxga.accumulate`][jaxga.accumulate].

    Returns:
        A function returning `(value, grads)`, or `((value, aux), grads)` with `has_aux`;
        with `state_argnums`, `((value, grads), new_state)` or
        `(((value, aux), grads), new_state)`.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> def loss(w, b):
        ...     return jaxga.token_cross_entropy(b["x"] @ w, b["y"])
        >>> batch = {"x": jnp.ones((8, 5, 3)), "y": jnp.zeros((8, 5), jnp.int32)}
        >>> vg = jax.jit(jaxga.value_and_grad(loss, num_microbatches=4))
        >>> value, g = vg(jnp.zeros((3, 4)), batch)
        >>> round(float(value), 4), g.shape
        (1.3863, (3, 4))
    """
    accumulated = accumulate(fun, argnums, has_aux, num_microbatches=num_microbatches, **options)

    @functools.wraps(fun)
    def value_and_grad_fun(*args: Any, **kwargs: Any) -> Any:
        acc = accumulated(*args, **kwargs)
        value = (acc.mean.value, acc.aux) if has_aux else acc.mean.value
        if accumulated.options.state_argnums:
            return (value, acc.grads), acc.state
        return value, acc.grads

    return value_and_grad_fun


def grad(
    fun: Callable[..., Any],
    argnums: ArgNums = 0,
    has_aux: bool = False,
    *,
    num_microbatches: int,
    **options: Any,
) -> Callable[..., Any]:
    """Like `jax.grad`, accumulated over micro-batches: see `jaxga.value_and_grad`.

    Args:
        fun: the loss, as for `jax.grad`; it may return a `jaxga.Mean`.
        argnums: as for `jax.grad` (NNX: `nnx.DiffState` too).
        has_aux: as for `jax.grad`.
        num_microbatches: how many micro-batches to split the batch into.
        **options: as for [`jaxga.accumulate`][jaxga.accumulate].

    Returns:
        A function returning `grads`, or `(grads, aux)` with `has_aux`; with `state_argnums`
        paired with the new state.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> def loss(w, x):
        ...     return jnp.mean(w * x)
        >>> float(jaxga.grad(loss, num_microbatches=2)(1.0, jnp.arange(4.0)))
        1.5
    """
    accumulated = accumulate(fun, argnums, has_aux, num_microbatches=num_microbatches, **options)

    @functools.wraps(fun)
    def grad_fun(*args: Any, **kwargs: Any) -> Any:
        acc = accumulated(*args, **kwargs)
        result = (acc.grads, acc.aux) if has_aux else acc.grads
        return (result, acc.state) if accumulated.options.state_argnums else result

    return grad_fun
