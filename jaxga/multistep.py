"""Gradient accumulation across calls: an optax optimiser applied once every k calls."""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxga import _checks, collectives


class MultiStepsState(NamedTuple):
    """State of :class:`MultiSteps`: optax's fields, a weighted mean and its weights.

    Attributes:
        mini_step: calls accumulated in the current group; 0 once a group completes.
        acc_grads: the group's weighted mean gradient so far, in the accumulator dtype.
        weight_sum: the group's total weight so far (a call without ``weight`` weighs 1).
        weighted: whether the last call passed ``weight``.
        applied: whether the last call ran the inner optimiser.
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


def skip_not_finite(updates: Any, gradient_step: Any, params: Any = None) -> tuple:
    """Whether any leaf of ``updates`` holds an inf or a NaN: a ``should_skip_update_fn``.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> skip, info = jaxga.skip_not_finite({"w": jnp.array([1.0, jnp.nan])}, 0)
        >>> bool(skip), int(info["num_not_finite"])
        (True, 1)
    """
    del gradient_step, params
    count = lambda g: collectives.psum_varying(jnp.sum(~jnp.isfinite(g), dtype=jnp.int32))
    num_not_finite = sum(map(count, jax.tree.leaves(updates)), jnp.zeros((), jnp.int32))
    should_skip = num_not_finite > 0
    return should_skip, {"should_skip": should_skip, "num_not_finite": num_not_finite}


def _check_state(state: Any, grads: Any = None) -> None:
    if not isinstance(state, MultiStepsState):
        kind = type(state)
        library = "a" if kind.__module__ == "builtins" else f"{kind.__module__.split('.')[0]}'s"
        raise TypeError(f"`state` must be a jaxga.MultiStepsState; got {library} {kind.__name__}.")
    expected, got = jax.tree.structure(state.acc_grads), jax.tree.structure(grads)
    if grads is not None and got != expected:
        raise TypeError(f"`grads` must have the params' tree structure, {expected}; got {got}.")
    for (path, g), a in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(state.acc_grads)):
        if jnp.shape(g) != jnp.shape(a):
            name = f"grads{jax.tree_util.keystr(path)}"
            raise ValueError(f"`{name}` must have shape {jnp.shape(a)}; got {jnp.shape(g)}.")


def _as_weight(weight: Any, state: MultiStepsState) -> tuple[jax.Array, jax.Array]:
    """``weight`` as a float32 scalar (1 for ``None``), and whether it is valid."""
    mixed = (state.mini_step > 0) & (state.weighted != (weight is not None))
    if not isinstance(mixed, jax.core.Tracer) and mixed:  # known eagerly
        got = "none after weighted calls" if weight is None else "one after unweighted calls"
        raise ValueError(f"`weight` must be given to all calls of a group or none; got {got}.")
    try:
        w = jnp.asarray(1.0 if weight is None else weight)
    except TypeError:
        raise TypeError(f"`weight` must be a number; got {weight!r}.") from None
    if w.shape != () or not any(jnp.issubdtype(w.dtype, t) for t in (jnp.integer, jnp.floating)):
        raise TypeError(f"`weight` must be an int or float scalar; got {w.dtype}{list(w.shape)}.")
    valid = jnp.isfinite(w) & (w >= 0)
    if not isinstance(valid, jax.core.Tracer) and not valid:
        raise ValueError(f"`weight` must be finite and non-negative; got {float(w)}.")
    return w.astype(jnp.float32), valid


def _apply_inner(inner, apply, acc_grads, grads, state, params, extra_args):
    """``inner``'s updates of the mean and new state if ``apply``, else zeros and the same."""
    grad_types = jax.tree.map(jax.typeof, grads)  # not `grads` themselves: no cond operand

    def run(acc_grads, inner_state):
        mean = optax.tree.cast_like(acc_grads, grad_types)
        updates, new_state = inner.update(mean, inner_state, params, **extra_args)
        return updates, optax.tree.cast_like(new_state, inner_state)

    # a zero XLA cannot see is constant, so never merged with other zeros of a parameter's shape
    zero = jax.lax.optimization_barrier(jnp.zeros((), jnp.float32))
    shapes = jax.eval_shape(run, acc_grads, state.inner_opt_state)[0]
    hold = lambda _, kept: (jax.tree.map(lambda s: jax.lax.full_like(s, zero), shapes), kept)
    return jax.lax.cond(apply, run, hold, acc_grads, state.inner_opt_state)


def _init(inner, accumulator_dtype, should_skip_update_fn, params: Any) -> MultiStepsState:
    skip_state = ()
    if should_skip_update_fn is not None:
        out = jax.eval_shape(should_skip_update_fn, params, jnp.zeros((), jnp.int32), params)
        pair = isinstance(out, tuple) and len(out) == 2
        if not pair or jnp.shape(out[0]) != () or jnp.result_type(out[0]) != jnp.bool_:
            raise TypeError(
                f"`should_skip_update_fn` must return a pair (a bool scalar, a report), as "
                f"optax's predicates do; it returned {out!r}."
            )
        skip_state = optax.tree.zeros_like(out[1])
    accumulator = lambda z: z.astype(_checks.sum_dtype(accumulator_dtype, z.dtype))
    return MultiStepsState(
        mini_step=jnp.int32(0),
        gradient_step=jnp.int32(0),
        acc_grads=jax.tree.map(accumulator, optax.tree.zeros_like(params)),
        weight_sum=jnp.float32(0),
        weighted=jnp.bool_(False),
        inner_opt_state=inner.init(params),
        applied=jnp.bool_(False),
        num_skipped=jnp.int32(0),
        skip_state=skip_state,
    )


def _update(inner, every_k, skip_fn, grads, state, params=None, *args, weight=None, **extra):
    if args:
        raise TypeError(
            f"MultiSteps.update takes (grads, state, params) by position; got {3 + len(args)} "
            f"positional arguments: pass `weight` by keyword, update(..., weight=w)."
        )
    _check_state(state, grads)
    w, keep = _as_weight(weight, state)
    skip, skip_state = jnp.zeros((), jnp.bool_), ()
    if skip_fn is not None:  # its output was checked by `init`
        skip, report = skip_fn(grads, state.gradient_step, params)
        report = optax.tree.cast_like(jax.tree.map(jnp.asarray, report), state.skip_state)
        skip, skip_state = collectives.psum_varying((jnp.asarray(skip), report))  # devices agree
    keep = keep & ~skip  # a call with a traced invalid weight is skipped: it cannot raise
    prior = jnp.where(state.mini_step == 0, 0.0, state.weight_sum)  # 0 for a new group
    weight_sum = prior + w
    ratio = jnp.where(weight_sum > 0, w / weight_sum, 0.0)  # 0: no items, its 0 / 0 stays out

    def add(acc, g):
        dtype = jnp.promote_types(jnp.promote_types(acc.dtype, g.dtype), jnp.float32)
        a, g = acc.astype(dtype), g.astype(dtype)
        # a new group overwrites the last group's mean by a select (it may hold an inf)
        new = jnp.where(prior > 0, a + ratio.astype(dtype) * (g - a), g)
        return jnp.where(keep & (ratio > 0), new.astype(acc.dtype), acc)

    acc_grads = jax.tree.map(add, state.acc_grads, grads)
    weight_sum = jnp.where(keep, weight_sum, state.weight_sum)
    mini_step = state.mini_step + keep.astype(jnp.int32)
    k = jnp.asarray(every_k(state.gradient_step) if callable(every_k) else every_k)
    is_int = k.shape == () and jnp.issubdtype(k.dtype, jnp.integer)
    if not is_int or (not isinstance(k, jax.core.Tracer) and k < 1):  # traced: taken as >= 1
        raise (ValueError if is_int else TypeError)(
            f"The `every_k` schedule must return an int scalar >= 1; it returned {k!r}."
        )
    done = keep & (mini_step >= jnp.maximum(k, 1))
    apply = done & (weight_sum > 0)  # a group without weight holds no items
    updates, inner_state = _apply_inner(inner, apply, acc_grads, grads, state, params, extra)
    return updates, MultiStepsState(
        mini_step=jnp.where(done, 0, mini_step),
        gradient_step=state.gradient_step + apply.astype(jnp.int32),
        acc_grads=acc_grads,
        weight_sum=weight_sum,
        weighted=jnp.asarray(weight is not None),
        inner_opt_state=inner_state,
        applied=apply,
        num_skipped=state.num_skipped + (~keep).astype(jnp.int32),
        skip_state=skip_state,
    )


@jax.tree_util.register_static  # configuration, not data: no leaves
class MultiSteps(optax.GradientTransformationExtraArgs):
    """Accumulates gradients over ``every_k`` calls, then applies ``inner`` to their mean.

    The call completing a group returns ``inner``'s updates of its weighted mean gradient
    Σwᵢgᵢ / Σwᵢ, the others zeros. Weigh every call of a group (``weight=w``, finite, ≥ 0) or none.

    Args:
        every_k: calls per group: a positive int, or a function of ``gradient_step``.
        every_k_schedule: optax's name for ``every_k``; give one of the two.
        accumulator_dtype: the accumulator's dtype; ``None`` keeps at least float32.
        should_skip_update_fn: ``(grads, gradient_step, params) -> (skip, report)``, e.g.
            :func:`skip_not_finite`; a skipped call leaves the accumulation as it was.

    Example:
        >>> import jax.numpy as jnp, optax, jaxga
        >>> tx = jaxga.MultiSteps(optax.sgd(1.0), every_k=2)
        >>> _, state = tx.update(jnp.array([1.0, 2.0]), tx.init(jnp.zeros(2)), weight=1)
        >>> updates, state = tx.update(jnp.array([4.0, 0.0]), state, weight=3)  # token counts
        >>> updates.tolist(), bool(tx.has_updated(state))
        ([-3.25, -0.5], True)
    """

    def __new__(
        cls,
        inner: optax.GradientTransformation,
        every_k: Any = None,
        *,
        every_k_schedule: Any = None,
        accumulator_dtype: Any = None,
        should_skip_update_fn: Any = None,
    ):
        if (every_k is None) == (every_k_schedule is None):
            raise TypeError(
                f"Pass `every_k` or optax's spelling `every_k_schedule`, once; got "
                f"every_k={every_k!r}, every_k_schedule={every_k_schedule!r}."
            )
        _checks.check_optimizer(inner, "inner")
        if should_skip_update_fn is not None:
            signature = "`(grads, gradient_step, params) -> (skip, report)` or None"
            _checks.check_arity(should_skip_update_fn, "should_skip_update_fn", 3, signature)
        every_k = every_k if every_k_schedule is None else every_k_schedule
        if callable(every_k):
            _checks.check_arity(every_k, "every_k", 1, "`every_k(step)` of `gradient_step`")
        else:
            expected = "a positive int or a function of `gradient_step` returning at least 1"
            every_k = _checks.positive_int(every_k, "every_k", expected)
        dtype = _checks.float_dtype(accumulator_dtype)
        wrapped = optax.with_extra_args_support(inner)
        init = functools.partial(_init, wrapped, dtype, should_skip_update_fn)
        update = functools.partial(_update, wrapped, every_k, should_skip_update_fn)
        self = super().__new__(cls, init, update)
        self.inner_opt, self._options = inner, dict(every_k=every_k, accumulator_dtype=dtype)
        self._options["should_skip_update_fn"] = should_skip_update_fn
        return self

    def has_updated(self, state: MultiStepsState) -> jax.Array:
        """Returns whether the call that produced ``state`` ran the inner optimiser."""
        _check_state(state)
        return state.applied

    def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
        """Returns this transformation as a plain ``optax.GradientTransformationExtraArgs``."""
        return optax.GradientTransformationExtraArgs(self.init, self.update)

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={getattr(v, '__name__', v)!s}" for k, v in self._options.items())
        return f"MultiSteps({options})"

    def __reduce__(self):  # copies rebuild from the arguments: a tuple's would pass (init, update)
        return functools.partial(MultiSteps, self.inner_opt, **self._options), ()
