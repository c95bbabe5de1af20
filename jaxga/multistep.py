"""Gradient accumulation across calls: an optax optimiser applied once every k calls."""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxga import _checks, collectives
from jaxga._branches import when, zeros_of
from jaxga.loss import check_value

_POSITIONAL = "`weight` is keyword-only: tx.update(grads, state, params, weight=...); got {}."


class MultiStepsState(NamedTuple):
    """State of [`jaxga.MultiSteps`][jaxga.MultiSteps]: optax's fields, a weighted mean, weights.

    Attributes:
        mini_step: calls accumulated in the current group; 0 once a group completes.
        gradient_step: groups applied so far: how many times the inner optimiser ran.
        acc_grads: the group's weighted mean gradient so far, in the accumulator dtype.
        weight_sum: the group's total weight so far (a call without ``weight`` weighs 1).
        weighted: whether the last call passed ``weight``.
        inner_opt_state: the inner optimiser's state.
        applied: whether the last call ran the inner optimiser.
        num_skipped: calls skipped so far (by the predicate, or a bad ``weight`` under `jit`).
        skip_state: the last report of ``should_skip_update_fn``; ``()`` without one.
    """

    mini_step: jax.Array
    gradient_step: jax.Array
    acc_grads: Any
    weight_sum: jax.Array
    weighted: jax.Array
    inner_opt_state: Any
    applied: jax.Array
    num_skipped: jax.Array
    skip_state: Any = ()


def _check_arrays(tree: Any, name: str, like: Any) -> None:
    """Raises unless ``tree`` holds arrays (`_checks.array_leaves`) shaped as ``like``'s."""
    expected, got = jax.tree.structure(like), jax.tree.structure(tree)
    if got != expected:
        raise TypeError(f"`{name}` must have the params' tree structure, {expected}; got {got}.")
    for (path, leaf), a in zip(_checks.array_leaves(tree, name), jax.tree.leaves(like)):
        where = f"{name}{jax.tree_util.keystr(path)}"
        if jnp.shape(leaf) != jnp.shape(a):
            raise ValueError(f"`{where}` must have shape {jnp.shape(a)}; got {jnp.shape(leaf)}.")


def _check_state(state: Any) -> MultiStepsState:
    if not isinstance(state, MultiStepsState):
        kind = type(state)
        library = "a" if kind.__module__ == "builtins" else f"{kind.__module__.split('.')[0]}'s"
        raise TypeError(f"`state` must be a jaxga.MultiStepsState; got {library} {kind.__name__}.")
    return state


def skip_not_finite(updates: Any, gradient_step: Any, params: Any = None) -> tuple[Any, dict]:
    """Says whether any leaf of ``updates`` holds an inf or a NaN: a ``should_skip_update_fn``.

    Args:
        updates: a call's gradient, a pytree of arrays.
        gradient_step: the state's ``gradient_step`` (unused; optax's signature).
        params: the parameters (unused; optax's signature).

    Returns:
        ``(should_skip, report)``: a bool scalar, and a dict of it and ``num_not_finite``.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> jaxga.skip_not_finite({"w": jnp.array([1.0, jnp.nan])}, 0)[1]
        {'should_skip': Array(True, dtype=bool), 'num_not_finite': Array(1, dtype=int32)}
    """
    _check_arrays(updates, "updates", like=updates)
    counts = [jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) for x in jax.tree.leaves(updates)]
    num_not_finite = sum(map(collectives.psum_varying, counts), jnp.zeros((), jnp.int32))  # by leaf
    should_skip = num_not_finite > 0
    return should_skip, {"should_skip": should_skip, "num_not_finite": num_not_finite}


def _never_skip(grads: Any, gradient_step: Any, params: Any) -> tuple[jax.Array, tuple]:
    return jnp.zeros((), jnp.bool_), ()


def _init(params: Any, *, inner: Any, accumulator_dtype: Any, should_skip: Any) -> MultiStepsState:
    _check_arrays(params, "params", like=params)
    out = jax.eval_shape(should_skip, params, jnp.zeros((), jnp.int32), params)
    pair = isinstance(out, tuple) and len(out) == 2
    if not pair or jnp.shape(out[0]) != () or jnp.result_type(out[0]) != jnp.bool_:
        raise TypeError(f"`should_skip_update_fn` must return (a bool, a report); got {out}.")

    def zeros(leaf: Any) -> jax.Array:  # an accumulator: at least float32, or accumulator_dtype
        dtype = _checks.grad_sum_dtype(accumulator_dtype, jnp.result_type(leaf))
        return jnp.zeros_like(leaf, dtype)

    return MultiStepsState(
        mini_step=jnp.int32(0),
        gradient_step=jnp.int32(0),
        acc_grads=jax.tree.map(zeros, params),
        weight_sum=jnp.float32(0),
        weighted=jnp.bool_(False),
        inner_opt_state=optax.with_extra_args_support(inner).init(params),
        applied=jnp.bool_(False),
        num_skipped=jnp.int32(0),
        skip_state=optax.tree.zeros_like(out[1]),
    )


def _accumulate(
    grads: Any, state: MultiStepsState, params: Any, weight: Any, should_skip: Callable, /
) -> tuple[MultiStepsState, jax.Array]:
    """``state`` with ``grads`` added at ``weight``, and whether they were (not skipped)."""
    got = "none after weighted calls" if weight is None else "one after unweighted calls"
    # traced, a mixed group is not refused: an unweighted call weighs 1, a weighted one its weight
    mixed = (state.mini_step > 0) & (state.weighted != (weight is not None))
    check_value(~mixed, f"`weight` must be given to all calls of a group or none; got {got}.")
    w = 1.0 if weight is None else weight
    w = _checks.scalar(w, "weight", (jnp.integer, jnp.floating), "an int or float scalar")
    message = "`weight` must be finite and non-negative; got {}."
    valid = check_value(jnp.isfinite(w) & (w >= 0), message, w)  # traced: the call is skipped
    w = w.astype(jnp.float32)
    skip, report = should_skip(grads, state.gradient_step, params)
    report = optax.tree.cast_like(jax.tree.map(jnp.asarray, report), state.skip_state)
    skip, report = collectives.psum_varying((jnp.asarray(skip), report))  # devices agree
    keep = valid & ~skip
    prior = jnp.where(state.mini_step == 0, 0.0, state.weight_sum)  # 0 for a new group
    weight_sum = prior + w
    ratio = jnp.where(weight_sum > 0, w / weight_sum, 0.0)  # 0: no items, its 0 / 0 stays out

    def add(acc, g):
        dtype = jnp.promote_types(jnp.promote_types(acc.dtype, g.dtype), jnp.float32)
        a, g = acc.astype(dtype), g.astype(dtype)
        new = jnp.where(prior > 0, a + ratio.astype(dtype) * (g - a), g)  # select: no old inf
        return jnp.where(keep & (ratio > 0), new.astype(acc.dtype), acc)

    return state._replace(
        mini_step=state.mini_step + keep.astype(jnp.int32),
        acc_grads=jax.tree.map(add, state.acc_grads, grads),
        weight_sum=jnp.where(keep, weight_sum, state.weight_sum),
        weighted=jnp.asarray(weight is not None),
        num_skipped=state.num_skipped + (~keep).astype(jnp.int32),
        skip_state=report,
    ), keep


def _group_size(every_k: Any, gradient_step: jax.Array) -> jax.Array:
    """The group size ``every_k`` says (an int, or a schedule of ``gradient_step``), checked:
    an int scalar; >= 1 where it can be read (traced, a smaller one is taken as 1)."""
    k = jnp.asarray(every_k(gradient_step) if callable(every_k) else every_k)
    said = "The `every_k` schedule must return an int scalar >= 1; got"
    if k.shape != () or not jnp.issubdtype(k.dtype, jnp.integer):
        traced = isinstance(k, jax.core.Tracer)  # a tracer's repr says nothing: its type
        got = f"a traced {k.dtype}{list(k.shape)}" if traced else repr(k)
        raise TypeError(f"{said} {got}.")
    check_value(k >= 1, said + " {!r}.", k)
    return k


def update(
    grads: Any,
    state: MultiStepsState,
    params: Any = None,
    *misplaced: Any,
    weight: Any = None,
    end_group: Any = False,
    inner: optax.GradientTransformation,
    every_k: Any,
    should_skip: Callable,
    **extra_args: Any,
) -> tuple[Any, MultiStepsState]:
    """A `MultiStepsTransformation`'s ``update``: ``weight`` and ``end_group`` by keyword only."""
    if misplaced:
        raise TypeError(_POSITIONAL.format(f"{misplaced!r:.60} after params"))
    _check_arrays(grads, "grads", like=_check_state(state).acc_grads)
    end_group = _checks.scalar(end_group, "end_group", (jnp.bool_,), "a bool")
    with jax.named_scope("accumulate"):
        group, keep = _accumulate(grads, state, params, weight, should_skip)
    k = _group_size(every_k, state.gradient_step)
    done = (keep & (group.mini_step >= jnp.maximum(k, 1))) | (end_group & (group.mini_step > 0))
    apply = done & (group.weight_sum > 0)  # a group without weight holds no items
    inner = optax.with_extra_args_support(inner)
    grad_types = jax.tree.map(jax.typeof, grads)  # not `grads` themselves: no cond operand

    def run(acc_grads, inner_state):
        mean = optax.tree.cast_like(acc_grads, grad_types)
        updates, new_state = inner.update(mean, inner_state, params, **extra_args)
        return updates, optax.tree.cast_like(new_state, inner_state)

    # a zero XLA cannot see is constant: never merged into zero buffers that stay live
    zero = jax.lax.optimization_barrier(jnp.zeros((), jnp.float32))

    def hold(types, acc_grads, inner_state):  # `inner` is traced once, in `run`
        zeros = functools.partial(zeros_of, zero=zero)
        return jax.tree.map(zeros, types[0]), inner_state

    with jax.named_scope("inner_update"):
        operands = (group.acc_grads, group.inner_opt_state)
        updates, opt_state = when(apply, run, *operands, otherwise=hold)
    return updates, group._replace(
        mini_step=jnp.where(done, 0, group.mini_step),
        gradient_step=state.gradient_step + apply.astype(jnp.int32),
        inner_opt_state=opt_state,
        applied=apply,
    )


class MultiStepsTransformation(optax.GradientTransformationExtraArgs):
    """What [`jaxga.MultiSteps`][jaxga.MultiSteps] returns: a GradientTransformationExtraArgs."""

    __slots__ = ()

    def has_updated(self, state: MultiStepsState) -> jax.Array:
        """``state.applied``: whether the call that returned ``state`` ran the inner optimiser."""
        return _check_state(state).applied

    def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
        """Returns ``optax.GradientTransformationExtraArgs(self.init, self.update)``, as optax's."""
        return optax.GradientTransformationExtraArgs(self.init, self.update)


def MultiSteps(
    inner: optax.GradientTransformation,
    every_k: int | Callable[[jax.Array], Any] | None = None,
    *,
    every_k_schedule: int | Callable[[jax.Array], Any] | None = None,
    accumulator_dtype: Any = None,
    should_skip_update_fn: Callable[..., tuple[Any, Any]] | None = None,
) -> MultiStepsTransformation:
    """Accumulates gradients over ``every_k`` calls, then applies ``inner`` to their mean.

    ``update`` takes, by keyword, ``weight=`` (e.g. a token count; a bad one raises, or traced
    skips its call, counted in ``num_skipped``) and ``end_group=True`` to end a group early.

    Args:
        inner: the optimiser to apply once per group, e.g. `optax.adamw(1e-3)` or a chain.
        every_k: calls per group: a positive int, or a function of ``gradient_step``.
        every_k_schedule: optax's name for ``every_k``; give one of the two.
        accumulator_dtype: the accumulator's dtype; ``None`` keeps at least float32.
        should_skip_update_fn: ``(grads, gradient_step, params) -> (skip, report)``.

    Returns:
        A `MultiStepsTransformation`: zero updates, or at a group's end `inner`'s of Σwᵢgᵢ / Σwᵢ.

    Examples:
        >>> import jax.numpy as jnp, optax, jaxga
        >>> tx = jaxga.MultiSteps(optax.sgd(1.0), every_k=2)
        >>> _, state = tx.update(jnp.array([1.0, 2.0]), tx.init(jnp.zeros(2)), weight=1)
        >>> tx.update(jnp.array([4.0, 0.0]), state, weight=3)[0].tolist()  # token counts
        [-3.25, -0.5]
    """
    _checks.check_optimizer(inner, "inner")
    should_skip = _never_skip if should_skip_update_fn is None else should_skip_update_fn
    _checks.check_arity(should_skip, "should_skip_update_fn", 3, "`(grads, gradient_step, params)`")
    if (every_k is None) == (every_k_schedule is None):
        got = f"{every_k=}, {every_k_schedule=}"
        raise TypeError(f"Pass one of `every_k` and `every_k_schedule`; got {got}.")
    every_k = every_k if every_k_schedule is None else every_k_schedule
    if callable(every_k):
        _checks.check_arity(every_k, "every_k", 1, "`every_k(step)` of `gradient_step`")
    else:
        every_k = _checks.positive_int(every_k, "every_k", "a positive int or a schedule")
    options = {"inner": inner, "should_skip": should_skip}
    dtype = _checks.float_dtype(accumulator_dtype)
    init = functools.partial(_init, accumulator_dtype=dtype, **options)
    return MultiStepsTransformation(init, functools.partial(update, every_k=every_k, **options))


def states_in(opt_state: Any, kind: type = MultiStepsState) -> list[Any]:
    """The states of type ``kind`` in ``opt_state``: its own, or inside a chain's; by default
    `jaxga.MultiSteps`' (``optax.MultiStepsState``: optax's)."""
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kind))
    return [x for x in nodes if isinstance(x, kind)]
