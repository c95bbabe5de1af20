"""Exact gradient accumulation over micro-batches inside one compiled step: the public API."""

import functools
from collections.abc import Callable, Sequence
from typing import Any

from flax import nnx

from jaxga import _checks, arguments, auxiliary, convolution, engine, meshes

OPTION_CHECKS: dict[str, Callable[[Any], Any]] = {  # the options both entry points check
    "has_aux": functools.partial(_checks.check_bool, name="has_aux"),
    "accumulator_dtype": _checks.float_dtype,
    "unroll": arguments.check_unroll,
    "aux": auxiliary.check,
    "canonical_convolutions": convolution.check_option,
}


def check_options(**given: Any) -> dict[str, Any]:
    """Each of ``given`` checked by `OPTION_CHECKS` (an error names the first bad one).

    Examples:
        >>> import jaxga
        >>> jaxga.accumulation.check_options(unroll=2, has_aux=False)
        {'unroll': 2, 'has_aux': False}
    """
    return {name: OPTION_CHECKS[name](value) for name, value in given.items()}


class Accumulate:
    """``fun`` accumulated over micro-batches: what [`jaxga.accumulate`][jaxga.accumulate] returns.

    Args:
        fun: the loss it accumulates, kept as `self.fun`.
        options: the options it was built with, checked, kept as `self.options`.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> jaxga.accumulate(jnp.vdot, num_microbatches=2).options.num_microbatches
        2
    """

    def __init__(self, fun: Callable[..., Any], options: arguments.Options):
        functools.update_wrapper(self, fun)  # first: it copies fun's __dict__, which may
        self.fun = fun  # hold attributes of these names
        self.options = options

    def __call__(self, *args: Any, **kwargs: Any) -> engine.Accumulated:
        """``fun(*args, **kwargs)`` accumulated over the micro-batches: an `Accumulated`."""
        return engine.run(self.fun, self.options, args, kwargs)


def accumulate(
    fun: Callable[..., Any],
    argnums: int | nnx.DiffState | Sequence[int | nnx.DiffState] = 0,
    has_aux: bool = False,
    *,
    num_microbatches: int,
    num_real_microbatches: Any = None,
    batch_argnums: int | Sequence[int] = 1,
    rng_argnums: int | Sequence[int] | None = None,
    state_argnums: int | Sequence[int] = (),
    axis_name: Any = None,
    accumulator_dtype: Any = None,
    unroll: int | bool = 1,
    aux: Any = None,
    canonical_convolutions: bool | str = "auto",
    state_reduction: str | Callable[[Any, tuple[Any, ...]], Any] = "mean",
) -> Accumulate:
    """Like [`jaxga.value_and_grad`][jaxga.value_and_grad], returning an `Accumulated`.

    Args:
        fun: the loss, a float scalar (its micro-batch's mean) or a [`jaxga.Mean`][jaxga.Mean].
        argnums: the position(s) to differentiate; NNX: `nnx.DiffState(position, filter)` too.
        has_aux: whether `fun` returns `(loss, aux)`; `state_argnums`: `(that, new_state)`.
        num_microbatches: `k`, how many micro-batches to split the batch into.
        num_real_microbatches: run only the first `n` of `k` (a batch by `merge_microbatches`).
        batch_argnums: the argument(s) to split; micro-batch `i` holds rows `i, i + k, ...`.
        rng_argnums: PRNG key arguments, `fold_in(key, i)` in micro-batch `i`; `None`: any key.
        state_argnums: the argument(s) threaded through the micro-batches (`batch_stats`).
        axis_name: the `shard_map` axis the batch is split over; sums are reduced once.
        accumulator_dtype: the dtype gradients are summed in; `None`: at least float32.
        unroll: `lax.scan`'s; `1` keeps one micro-batch's activations at a time.
        aux: how each aux leaf combines over the micro-batches: a kind, `"sum"`, `"rows"`
            (a row per example, in the batch's order) or `"stack"` (`[k, ...]`), for each
            subtree, a prefix of the aux (`{"logits": "rows", "hist": None}`); `None`: a
            `Mean` summed, any other leaf stacked, `[k, ...]` (`k = 1` too).
        canonical_convolutions: the loop's convolutions NHWC/HWIO; `"auto"`: on CPU backends only.
        state_reduction: how threaded state is replicated over the devices after the loop:
            `"mean"` (floats averaged, ints and keys maxed) or `(x, axes) -> x` per leaf.

    Returns:
        An [`Accumulate`][jaxga.Accumulate]: called as `fun`, it returns an `Accumulated`.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> acc = jaxga.accumulate(jnp.vdot, num_microbatches=2)(jnp.ones(2), jnp.eye(2))
        >>> float(acc.mean.value), float(acc.mean.count), acc.grads
        (1.0, 2.0, Array([0.5, 0.5], dtype=float32))
        >>> def loss(w, x):
        ...     return jnp.mean(x @ w), {"rows": x @ w, "max": jnp.max(x @ w)}
        >>> aux = {"rows": "rows", "max": None}  # None: a Mean summed, others stacked
        >>> acc = jaxga.accumulate(loss, has_aux=True, num_microbatches=2, aux=aux)
        >>> {name: x.shape for name, x in acc(jnp.ones(2), jnp.eye(2)).aux.items()}
        {'max': (2,), 'rows': (2,)}
    """
    _checks.check_callable(fun, "fun")
    k = _checks.positive_int(num_microbatches, "num_microbatches")
    num_real = arguments.check_num_real(num_real_microbatches, k)
    checked = check_options(
        has_aux=has_aux,
        accumulator_dtype=accumulator_dtype,
        unroll=unroll,
        aux=aux,
        canonical_convolutions=canonical_convolutions,
    )
    options = arguments.make_options(
        argnums,
        batch_argnums=batch_argnums,
        rng_argnums=rng_argnums,
        state_argnums=state_argnums,
        num_microbatches=k,
        num_real_microbatches=num_real,
        axis_name=meshes.check_axis_name(axis_name),
        state_reduction=arguments.check_state_reduction(state_reduction),
        **checked,
    )
    return Accumulate(fun, options)


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | nnx.DiffState | Sequence[int | nnx.DiffState] = 0,
    has_aux: bool = False,
    *,
    num_microbatches: int,
    **options: Any,
) -> Callable[..., Any]:
    """Like `jax.value_and_grad`, accumulated over micro-batches in one `lax.scan`.

    Args:
        fun: the loss, as for `jax.value_and_grad`; it may return a [`jaxga.Mean`][jaxga.Mean].
        argnums: as for `jax.value_and_grad`; NNX: `nnx.DiffState` too.
        has_aux: as for `jax.value_and_grad`.
        num_microbatches: how many micro-batches to split the batch into.
        **options: as for [`jaxga.accumulate`][jaxga.accumulate].

    Returns:
        A function returning what `jax.value_and_grad`'s does; `state_argnums`: `(that, new_state)`.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> jaxga.value_and_grad(jnp.vdot, num_microbatches=2)(jnp.ones(2), jnp.ones((2, 2)))
        (Array(2., dtype=float32), Array([1., 1.], dtype=float32))
    """
    accumulated = accumulate(fun, argnums, has_aux, num_microbatches=num_microbatches, **options)

    @functools.wraps(fun)
    def value_and_grad_fun(*args: Any, **kwargs: Any) -> Any:
        acc = accumulated(*args, **kwargs)
        result = ((acc.mean.value, acc.aux) if has_aux else acc.mean.value), acc.grads
        return (result, acc.state) if accumulated.options.state_argnums else result

    return value_and_grad_fun


def grad(
    fun: Callable[..., Any],
    argnums: int | nnx.DiffState | Sequence[int | nnx.DiffState] = 0,
    has_aux: bool = False,
    *,
    num_microbatches: int,
    **options: Any,
) -> Callable[..., Any]:
    """Like `jax.grad`, accumulated over micro-batches: see `jaxga.value_and_grad`.

    Args:
        fun: the loss, as for `jax.grad`; it may return a `jaxga.Mean`.
        argnums: as for `jax.grad`; NNX: `nnx.DiffState` too.
        has_aux: as for `jax.grad`.
        num_microbatches: how many micro-batches to split the batch into.
        **options: as for [`jaxga.accumulate`][jaxga.accumulate].

    Returns:
        A function returning `grads`, `(grads, aux)` with `has_aux`, paired as `value_and_grad`.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> jaxga.grad(jnp.vdot, num_microbatches=2)(jnp.ones(2), jnp.arange(4.0).reshape(2, 2))
        Array([1., 2.], dtype=float32)
    """
    accumulated = accumulate(fun, argnums, has_aux, num_microbatches=num_microbatches, **options)

    @functools.wraps(fun)
    def grad_fun(*args: Any, **kwargs: Any) -> Any:
        acc = accumulated(*args, **kwargs)
        result = (acc.grads, acc.aux) if has_aux else acc.grads
        return (result, acc.state) if accumulated.options.state_argnums else result

    return grad_fun
