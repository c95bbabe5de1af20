"""Exact gradient accumulation over micro-batches inside one compiled step."""

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import core as jex_core

from jaxga import _checks, arguments, collectives, modules
from jaxga.loss import Mean
from jaxga.microbatch import IndivisibleBatchError, merge_microbatches, split_microbatches

ArgNums = int | nnx.DiffState | Sequence[int | nnx.DiffState]
Positions = int | Sequence[int]


class Accumulated(NamedTuple):
    """What one pass over the micro-batches produced.

    Attributes:
        mean: ``Mean(Σ total, Σ count)`` over micro-batches and devices.
        grads: the gradient of ``mean.value``, as :func:`jax.grad` (NNX: an ``nnx.State``).
        aux: the auxiliary output as :func:`value_and_grad` returns it, or ``None``.
        state: the ``state_argnums`` after the last micro-batch, or ``None``.
    """

    mean: Mean
    grads: Any
    aux: Any
    state: Any


def _fold_keys(tree: Any, index: jax.Array, raw: bool = True) -> Any:
    fold = lambda x: jax.random.fold_in(x, index) if arguments.is_key(x, raw) else x
    return jax.tree.map(fold, tree)


def _reduce_state(state: Any, before: Any, axis_name: Any) -> Any:
    """Replicated threaded state made the same again: floats averaged, the rest maxed."""
    axes = collectives.axes(axis_name)

    def reduce(x, old):
        if not (over := tuple(a for a in axes if a not in collectives.varying_axes(old))):
            return x
        if jnp.issubdtype(x.dtype, jnp.floating):
            return old + jax.lax.pmean(x - old, over)
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = jax.lax.pmax(jax.random.key_data(x), over)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.lax.pmax(x, over)

    return jax.tree.map(reduce, state, before)


def _finish_aux(aux: Any, whole: Any, k: int, rows: int) -> Any:
    """``aux`` as the batch (shapes ``whole``) gives it: per-example rows merged, Means summed."""

    def finish(x, like):
        if isinstance(x, Mean):
            return Mean(jnp.sum(x.total, 0), jnp.sum(x.count, 0))
        if k == 1:
            return x[0]
        per_example = jnp.shape(x)[1:2] == (rows,) and like.shape == (k * rows, *x.shape[2:])
        return merge_microbatches(x) if per_example else x

    return jax.tree.map(finish, aux, whole, is_leaf=lambda x: isinstance(x, Mean))


def _micro_loss(fun, options, args, kwargs, parts, rng_pos, device, sum_dtype) -> Callable:
    """``(diff, batch, index, state) -> (total, (count, aux, state))``."""
    diff_pos, batch_pos, state_pos = options.argnums, options.batch_argnums, options.state_argnums

    def loss_on(diff, batch, index, state):
        given = dict(zip((*diff_pos, *batch_pos, *state_pos), (*diff, *batch, *state[0])))
        full = [given.get(i, arg) for i, arg in enumerate(args)]
        for i in rng_pos:
            full[i] = _fold_keys(args[i], device * options.num_microbatches + index)
        for i, p in parts.items():
            own = diff[diff_pos.index(i)] if i in diff_pos else None
            full[i] = modules.put_together(p, own, state[1][i])
        try:
            out = fun(*full, **kwargs)
        except Exception as e:  # often an argument of examples left whole: say which
            arguments.note_unsplit(e, options, args)
            raise
        mean, aux, user = arguments.parse_output(out, options, state[0])
        rest = {i: modules.new_rest(full[i], p, options.filters.get(i)) for i, p in parts.items()}
        rest = arguments.like(rest, state[1], "left its modules (by position) a state")
        count = jax.lax.stop_gradient(jnp.asarray(mean.count, sum_dtype))
        return jnp.asarray(mean.total), (count, aux, (user, rest))

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
    unroll = _unroll(loss_on, primals, micro, state0, options.num_microbatches)
    carry, aux = jax.lax.scan(body, carry, micro, length=options.num_microbatches, unroll=unroll)
    return (*carry[1:], aux)


def _unroll(loss_on: Callable, primals: Any, micro: Any, state: Any, k: int) -> int:
    """``k`` for a loss with convolutions on a CPU (slow in XLA:CPU loops), else 1."""
    if jax.default_backend() != "cpu":
        return 1
    first = jax.tree.map(lambda x: x[0], micro)
    return k if _has_conv(jax.make_jaxpr(loss_on)(primals, first, 0, state)) else 1


def _has_conv(jaxpr: Any) -> bool:
    subs = [j for e in jaxpr.eqns for j in jex_core.jaxprs_in_params(e.params)]
    names = {e.primitive.name for e in jaxpr.eqns}
    return "conv_general_dilated" in names or any(map(_has_conv, subs))


def _accumulate(fun, options: arguments.Options, args: tuple, kwargs: dict) -> Accumulated:
    arguments.check_call(options, args, kwargs)
    axis, filters = options.axis_name, options.filters
    modular = [i for i, arg in enumerate(args) if modules.holds_module(arg)]
    parts = {i: modules.take_apart(args[i], f"args[{i}]", filters.get(i)) for i in modular}
    modules.check_unshared(parts)
    primals = tuple(modules.diff_of(parts[i]) if i in parts else args[i] for i in options.argnums)
    arguments.check_primals(primals, options.argnums)
    k, batches = options.num_microbatches, tuple(args[i] for i in options.batch_argnums)
    local = next((jnp.shape(x)[0] for x in jax.tree.leaves(batches)), 0)
    if axis is not None and local % k:  # name the global batch
        devices = jax.lax.axis_size(axis)
        raise IndivisibleBatchError.of(local * devices, k, devices, axis)
    micro = tuple(split_microbatches(args[i], k, name=f"args[{i}]") for i in options.batch_argnums)
    device = 0 if axis is None else jax.lax.axis_index(axis)
    leaves = jax.tree.leaves(primals)
    sum_dtype = jnp.result_type(options.accumulator_dtype or jnp.float32, jnp.float32, *leaves)
    rest = modules.rest_of(parts)
    user = jax.tree.map(jnp.asarray, tuple(args[i] for i in options.state_argnums))
    state0 = (user, rest if axis is None else _fold_keys(rest, device, raw=False))
    rng_pos = arguments.rng_positions(options, args)
    loss_on = _micro_loss(fun, options, args, kwargs, parts, rng_pos, device, sum_dtype)
    grads, total, count, state, aux = _scan(loss_on, options, primals, micro, state0, sum_dtype)
    if options.has_aux:
        whole = jax.eval_shape(loss_on, primals, batches, 0, state0)[1][1]
        aux = _finish_aux(aux, whole, k, local // k)
    if axis is not None:
        sums = collectives.psum_invariant((grads, total, count), (primals, 0.0, 0.0), axis)
        grads, total, count = sums
        state = _reduce_state(state, state0, axis)
        restore = lambda x, r: r if arguments.is_key(x, raw=False) else x  # the caller's NNX keys
        state = (state[0], jax.tree.map(restore, state[1], rest))
    if not isinstance(count, jax.core.Tracer) and not (jnp.isfinite(count) and count >= 0):
        raise ValueError(  # under jit: NaN
            f"The loss's jaxga.Mean counts summed to {float(count)} items; expected a finite, "
            f"non-negative number of items or total weight."
        )
    grads = jax.tree.map(lambda g, p: (g / count).astype(jnp.result_type(p)), grads, primals)
    modules.write_back(parts, state[1])
    user = state[0][0] if options.single_state else state[0] or None
    return Accumulated(Mean(total, count), grads[0] if options.single_argnum else grads, aux, user)


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
        fun: the loss: a float scalar (its micro-batch's mean) or a :class:`jaxga.Mean`;
            with ``has_aux`` ``(loss, aux)``; with ``state_argnums`` ``(output, new_state)``.
        argnums, has_aux: as in JAX; for NNX modules also ``nnx.DiffState(position, filter)``.
        num_microbatches: how many micro-batches to split the batch into.
        batch_argnums: position(s) of the argument(s) split along their leading axis.
        rng_argnums: position(s) of PRNG keys; micro-batch ``i`` gets ``fold_in(key, i)``.
            ``None``: every other argument holding typed keys; ``()``: none.
        state_argnums: position(s) of state threaded through the micro-batches (``batch_stats``).
        axis_name: the ``shard_map`` axis the batch is split over; sums are reduced once.
        accumulator_dtype: dtype of the gradient sums; ``None``: at least float32.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> loss = lambda w, x: jaxga.Mean.of(w * x)
        >>> acc = jaxga.accumulate(loss, num_microbatches=2)(2.0, jnp.arange(4.0))
        >>> float(acc.mean.value), float(acc.mean.count), float(acc.grads)
        (3.0, 4.0, 1.5)
    """
    options = arguments.Options(
        **arguments.parse_positions(fun, argnums, batch_argnums, rng_argnums, state_argnums),
        num_microbatches=_checks.positive_int(num_microbatches, "num_microbatches"),
        has_aux=_checks.check_bool(has_aux, "has_aux"),
        single_state=isinstance(state_argnums, int),
        axis_name=axis_name,
        accumulator_dtype=_checks.float_dtype(accumulator_dtype),
    )
    accumulated = functools.wraps(fun)(lambda *args, **kw: _accumulate(fun, options, args, kw))
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

    Gradients and a :class:`jaxga.Mean` loss's totals and counts are summed, then divided once.
    Modules are taken as ``nnx.value_and_grad`` and ``eqx.filter_value_and_grad`` take them.
    ``aux``: per-example rows and ``Mean``s as the whole batch gives them, others ``[k, ...]``.

    Args:
        fun, argnums, has_aux: as for :func:`jax.value_and_grad`.
        num_microbatches, **options: as for :func:`accumulate`.

    Returns:
        A function returning ``(value, grads)``, or ``((value, aux), grads)`` with
        ``has_aux``; with ``state_argnums`` paired with the new state.

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> loss = lambda w, b: jaxga.token_cross_entropy(b["x"] @ w, b["y"])
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
