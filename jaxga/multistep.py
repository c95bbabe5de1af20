"""Gradient accumulation across calls: an optax optimiser applied once every k calls."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxga import _checks, sharding

__all__ = ["MultiSteps", "MultiStepsState", "skip_not_finite"]

EveryK = int | Callable[[jax.Array], Any]
ShouldSkipFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]


class MultiStepsState(NamedTuple):
    """State of :class:`MultiSteps`.

    Attributes:
        mini_step: calls accumulated in the current group (int32); 0 after an
            applying call.
        gradient_step: how many times the inner optimiser has run (int32); the
            argument of an ``every_k`` schedule.
        acc_grads: the weighted mean Σ wᵢ gᵢ / Σ wᵢ of the gradients of the current
            group's calls so far, in the accumulator dtype. A running mean, so that the
            applying call hands it to the inner optimiser as it is, with no division
            into a second parameter-sized buffer. Until the group has weight
            (``mini_step`` 0, or only calls of weight 0 so far) it still holds the
            group applied last (zeros at first): the group's first weighted call
            overwrites it instead of a separate pass zeroing it.
        weight_sum: Σ wᵢ over the same calls (float32): the sum of the ``weight``
            arguments, a call without one counting 1.
        inner_opt_state: the inner optimiser's state; only applying calls change it.
        applied: whether the last call ran the inner optimiser (bool); see
            :meth:`MultiSteps.has_updated`.
        num_skipped: how many calls were skipped so far (int32).
        skip_state: the second output of ``should_skip_update_fn`` on the last call,
            e.g. ``{"should_skip": ..., "num_not_finite": ...}``; ``()`` without one.
    """

    mini_step: jax.Array
    gradient_step: jax.Array
    acc_grads: Any
    weight_sum: jax.Array
    inner_opt_state: Any
    applied: jax.Array
    num_skipped: jax.Array
    skip_state: Any = ()


def skip_not_finite(
    updates: Any, gradient_step: jax.Array, params: Any = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Returns whether any leaf of ``updates`` holds an inf or a NaN, and how many do.

    A ``should_skip_update_fn`` for :class:`MultiSteps`, with the signature of optax's
    (``optax.skip_not_finite``, ``optax.skip_large_updates`` fit too).

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> skip, info = jaxga.skip_not_finite({"w": jnp.array([1.0, jnp.nan])}, 0)
        >>> bool(skip), int(info["num_not_finite"])
        (True, 1)
    """
    del gradient_step, params
    # each leaf's count over the devices holding its shards (inside shard_map), so that a
    # replicated leaf is counted once and a sharded one over all its shards
    counts = [
        sharding.psum_varying(jnp.sum(~jnp.isfinite(g), dtype=jnp.int32))
        for g in jax.tree.leaves(updates)
    ]
    num_not_finite = sum(counts, jnp.zeros((), jnp.int32))
    should_skip = num_not_finite > 0
    return should_skip, {"should_skip": should_skip, "num_not_finite": num_not_finite}


def _check_state(state: Any) -> None:
    if not isinstance(state, MultiStepsState):
        kind = type(state)
        library = kind.__module__.split(".")[0]
        got = f"a {kind.__name__}" if library == "builtins" else f"{library}'s {kind.__name__}"
        raise TypeError(
            f"`state` must be the jaxga.MultiStepsState returned by jaxga.MultiSteps' `init` "
            f"or `update`; got {got} ({kind.__module__}.{kind.__qualname__})."
        )


def _check_inner(inner: Any) -> optax.GradientTransformationExtraArgs:
    _checks.check_optimizer(inner, "inner")
    return optax.with_extra_args_support(inner)


def _check_every_k(every_k: Any) -> EveryK:
    if isinstance(every_k, numbers.Integral) and not isinstance(every_k, bool):
        if every_k < 1:
            raise ValueError(f"`every_k` must be at least 1; got {every_k}.")
        return int(every_k)
    if callable(every_k):
        return _checks.check_arity(
            every_k, "every_k", 1, "`every_k(step)` of the applied-step count"
        )
    raise TypeError(
        f"`every_k` must be a positive int or a function of the applied-step count that "
        f"returns one; got {every_k!r} of type {type(every_k).__name__}."
    )


def _concrete(x: jax.Array) -> float | None:
    """Returns the value of a scalar known at trace time, or ``None`` for a tracer."""
    try:
        return float(x)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None


def _check_tree(grads: Any, acc_grads: Any) -> None:
    expected = jax.tree.structure(acc_grads)
    if jax.tree.structure(grads) != expected:
        raise TypeError(
            f"`grads` has tree structure {jax.tree.structure(grads)}, but the state was "
            f"initialised for {expected}; pass gradients of the params given to `init`."
        )
    for (path, g), a in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(acc_grads)
    ):
        if jnp.shape(g) != jnp.shape(a):
            raise ValueError(
                f"`grads{jax.tree_util.keystr(path)}` has shape {jnp.shape(g)}, but the "
                f"state was initialised for shape {jnp.shape(a)}."
            )


def _as_weight(weight: Any) -> jax.Array:
    """``weight`` as a float32 scalar; a call without one weighs 1."""
    if weight is None:
        return jnp.ones((), jnp.float32)
    try:
        w = jnp.asarray(weight)
    except TypeError:
        raise TypeError(f"`weight` must be a number; got {weight!r}.") from None
    if not (jnp.issubdtype(w.dtype, jnp.integer) or jnp.issubdtype(w.dtype, jnp.floating)):
        raise TypeError(f"`weight` must be an int or float scalar; got dtype {w.dtype}.")
    if w.shape != ():
        raise ValueError(f"`weight` must be a scalar; got shape {w.shape}.")
    value = _concrete(w)
    if value is not None and not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"`weight` must be finite and non-negative; got {value}.")
    return w.astype(jnp.float32)


def _group_size(every_k: EveryK, gradient_step: jax.Array) -> Any:
    if isinstance(every_k, int):
        return every_k
    k = jnp.asarray(every_k(gradient_step))
    if k.shape != () or not jnp.issubdtype(k.dtype, jnp.integer):
        raise TypeError(
            f"The `every_k` schedule must return an int scalar; it returned shape "
            f"{k.shape} and dtype {k.dtype}."
        )
    value = _concrete(k)
    if value is not None and value < 1:
        raise ValueError(f"The `every_k` schedule must return at least 1; it returned {k}.")
    return jnp.maximum(k, 1)


def _should_skip(
    fn: ShouldSkipFn | None, grads: Any, state: MultiStepsState, params: Any
) -> tuple[jax.Array, Any]:
    if fn is None:
        return jnp.zeros((), jnp.bool_), ()
    skip, skip_state = fn(grads, state.gradient_step, params)
    skip = jnp.asarray(skip)
    if skip.shape != () or skip.dtype != jnp.bool_:
        raise ValueError(
            f"`should_skip_update_fn` must return a bool scalar first; it returned shape "
            f"{skip.shape} and dtype {skip.dtype}."
        )
    if jax.tree.structure(skip_state) != jax.tree.structure(state.skip_state):
        raise ValueError(
            f"`should_skip_update_fn` returned a skip_state with tree structure "
            f"{jax.tree.structure(skip_state)}; `init` recorded "
            f"{jax.tree.structure(state.skip_state)}."
        )
    # Sharded gradients (FSDP) give each device a partial report: all must agree.
    return sharding.psum_varying((skip, _astype_like(skip_state, state.skip_state)))


def _astype_like(new: Any, old: Any) -> Any:
    return jax.tree.map(lambda n, o: jnp.asarray(n, jnp.result_type(o)), new, old)


def _init(
    inner: optax.GradientTransformationExtraArgs,
    accumulator_dtype: jnp.dtype | None,
    should_skip_update_fn: ShouldSkipFn | None,
    params: Any,
) -> MultiStepsState:
    def zeros(p):
        dtype = _checks.accumulation_dtype(accumulator_dtype, jnp.result_type(p))
        return jnp.zeros(jnp.shape(p), dtype)

    skip_state = ()
    if should_skip_update_fn is not None:
        grads = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.result_type(p)), params)
        step = jnp.zeros((), jnp.int32)
        out = jax.eval_shape(should_skip_update_fn, grads, step, params)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"`should_skip_update_fn` must return a pair (skip, report), as optax's "
                f"predicates do; it returned {out!r}."
            )
        skip_state = jax.tree.map(jnp.zeros_like, out[1])
    return MultiStepsState(
        mini_step=jnp.zeros((), jnp.int32),
        gradient_step=jnp.zeros((), jnp.int32),
        acc_grads=jax.tree.map(zeros, params),
        weight_sum=jnp.zeros((), jnp.float32),
        inner_opt_state=inner.init(params),
        applied=jnp.zeros((), jnp.bool_),
        num_skipped=jnp.zeros((), jnp.int32),
        skip_state=skip_state,
    )


def _update(
    inner: optax.GradientTransformationExtraArgs,
    every_k: EveryK,
    should_skip_update_fn: ShouldSkipFn | None,
    grads: Any,
    state: MultiStepsState,
    params: Any = None,
    *,
    weight: jax.typing.ArrayLike | None = None,
    **extra_args: Any,
) -> tuple[Any, MultiStepsState]:
    _check_state(state)
    _check_tree(grads, state.acc_grads)
    w = _as_weight(weight)
    k = _group_size(every_k, state.gradient_step)
    skip, skip_state = _should_skip(should_skip_update_fn, grads, state, params)
    # a traced weight cannot raise: a negative or non-finite one skips its call instead
    keep = ~skip & jnp.isfinite(w) & (w >= 0)
    # the group's weight before this call: 0 for a new group
    prior = jnp.where(state.mini_step == 0, 0.0, state.weight_sum)
    weight_sum = prior + w
    # the running weighted mean acc + (w / Σw)(g − acc); a call of weight 0 holds no
    # items, so its gradient (0 / 0 for an empty Mean) is not taken into it
    ratio = jnp.where(weight_sum > 0, w / weight_sum, 0.0)
    take = keep & (ratio > 0)

    def accumulate(acc, g):
        dtype = jnp.promote_types(jnp.promote_types(acc.dtype, g.dtype), jnp.float32)
        a, g = acc.astype(dtype), g.astype(dtype)
        # The group's first weighted call takes its gradient as it is, over the last
        # group's mean: a select, not a product with 0 (that mean may hold an inf) nor a
        # select of zeros (see `hold` below).
        new = jnp.where(prior > 0, a + ratio.astype(dtype) * (g - a), g)
        return jnp.where(take, new.astype(acc.dtype), acc)

    acc_grads = jax.tree.map(accumulate, state.acc_grads, grads)
    weight_sum = jnp.where(keep, weight_sum, state.weight_sum)
    mini_step = state.mini_step + keep.astype(jnp.int32)
    complete = keep & (mini_step >= k)
    # A group without weight holds no items: nothing to learn from, so the inner
    # optimiser (its weight decay, moments and schedule) does not run for it.
    apply = complete & (weight_sum > 0)
    grad_dtypes = jax.tree.map(jnp.result_type, grads)

    def run_inner(acc_grads, inner_state):
        mean = jax.tree.map(lambda a, dtype: a.astype(dtype), acc_grads, grad_dtypes)
        updates, new_inner = inner.update(mean, inner_state, params, **extra_args)
        return updates, _astype_like(new_inner, inner_state)

    # The zero updates of a call that does not apply come from a zero XLA cannot see is
    # constant. Where XLA turns this cond into selects (on a GPU, for Adam), a constant
    # zero of a parameter's shape would be merged with the zeros a layer scan's backward
    # pass starts from and kept alive through that pass: one parameter-sized buffer more
    # at the peak (benchmarks/compiled_for_gpu.py).
    zero = jax.lax.optimization_barrier(jnp.zeros((), jnp.float32))

    def hold(acc_grads, inner_state):
        shapes = jax.eval_shape(run_inner, acc_grads, inner_state)[0]
        # full_like keeps what eval_shape saw of each leaf: also its shard_map axes
        return jax.tree.map(lambda s: jax.lax.full_like(s, zero), shapes), inner_state

    updates, inner_state = jax.lax.cond(apply, run_inner, hold, acc_grads, state.inner_opt_state)
    new_state = MultiStepsState(
        mini_step=jnp.where(complete, 0, mini_step),
        gradient_step=state.gradient_step + apply.astype(jnp.int32),
        acc_grads=acc_grads,
        weight_sum=weight_sum,
        inner_opt_state=inner_state,
        applied=apply,
        num_skipped=state.num_skipped + (~keep).astype(jnp.int32),
        skip_state=skip_state,
    )
    return updates, new_state


class MultiSteps(optax.GradientTransformationExtraArgs):
    """Accumulates gradients over k calls and runs the ``inner`` optimiser once per k.

    Each call adds its gradient to the group's running mean. The call that completes
    a group of ``every_k`` calls passes that mean to ``inner`` — a single
    transformation or a whole ``optax.chain``, so clipping sees the accumulated
    gradient — and returns its updates; every other call returns zeros, so that
    ``optax.apply_updates`` leaves the parameters unchanged. ``inner`` runs once per
    group, not once per call: its step counter and learning-rate schedule advance
    once per k calls. With equal weights the parameters match
    ``optax.MultiSteps(inner, every_k, use_grad_mean=True)`` to float32 rounding.

    **Porting from optax.** ``jaxga.MultiSteps(inner, every_k_schedule=k)`` takes
    optax's spelling, ``.inner_opt`` and ``.has_updated`` are there, and the state has
    optax's ``inner_opt_state``, ``gradient_step``, ``mini_step`` and ``acc_grads``.
    What differs, and why: ``inner`` runs under a ``lax.cond`` on the applying call
    instead of on every call with k − 1 results thrown away (see **Cost** for what
    XLA makes of that); calls may be weighted; and the state (a
    ``jaxga.MultiStepsState``) adds ``weight_sum``, ``applied``, ``num_skipped`` and
    ``skip_state``. As in optax, nothing is skipped unless you ask.

    **Weights.** ``update(..., weight=w)`` weights a call's gradient, and the group's
    gradient is Σwᵢgᵢ / Σwᵢ (a call without ``weight`` weighs 1, so unweighted calls
    give the plain mean): the across-call counterpart of :class:`jaxga.Mean`. For a
    loss returning ``Mean(total, count)``, pass the gradient of ``mean.value`` and
    ``weight=mean.count``; k calls then give exactly the gradient of the token mean
    over all k batches. Weigh every call of a group or none. A group whose weights
    sum to 0 holds no items: it ends without running ``inner``, whose state and step
    count stay as they were (``has_updated`` is false).

    **Skipping.** With ``should_skip_update_fn=jaxga.skip_not_finite`` (any inf or NaN;
    optax's predicates fit too), a call whose gradient the predicate rejects leaves the
    accumulation as if it had not happened: same accumulator, group position, step
    count and inner state. It says so in the state: ``num_skipped`` counts skipped
    calls, ``skip_state`` holds the predicate's report and :meth:`has_updated` is false.
    Inside ``shard_map`` with gradients sharded over a mesh axis, each device sees its
    shards only: the decisions (and reports) that vary over the axis are combined —
    skip if any device would — so every device takes the same one. That is exact for
    :func:`skip_not_finite` (which counts each leaf over its shards), not for a
    predicate on a global quantity such as ``optax.skip_large_updates``' norm; the
    train step's FSDP layouts run the optimiser on the whole (sharded) arrays, where
    both are exact.
    The check costs one more read of the gradients per call and, since the accumulator
    may only change once the whole gradient is known to be finite, keeps the gradient
    in a buffer of its own instead of accumulating it as it is produced: one
    parameter-sized buffer more (measured in ``benchmarks/multisteps.py``, where
    ``optax.MultiSteps`` with the same predicate costs the same). That is why it is off
    by default.

    **Under jit** no value can raise an error. Eagerly a negative or non-finite
    ``weight``, or an ``every_k`` schedule returning less than 1, raises; under
    ``jit`` such a weight skips its call (counted in ``num_skipped``) and such a
    schedule value counts as 1 (every call applies: visible in ``gradient_step``).

    **Cost.** One buffer the size of the parameters (the accumulator), handed to
    ``inner`` as it is and overwritten by the next group's first weighted call rather
    than zeroed by a pass of its own. ``inner`` runs under ``lax.cond``, so its state
    and step count change on applying calls only; whether the other calls also skip
    its arithmetic is XLA's choice. On a CPU they do. XLA's GPU compiler turns a cheap
    cond into selects, which spare the host a wait for the predicate (compiled for an
    H100 it did so for Adam, and for global-norm clipping then Adam): every call then
    computes the update and keeps it on the applying one, as ``optax.MultiSteps``
    does, and a call's compiled peak is optax's, or less when both skip non-finite
    gradients (``benchmarks/compiled_for_gpu.py``).

    **Extra arguments** (``value=`` for ``optax.contrib.reduce_on_plateau`` or a line
    search) reach ``inner`` on the applying call only, so pass values that describe the
    whole group there, such as the group's mean loss, not the last micro-batch's.

    **Transforms.** Under ``vmap`` with a batched state the condition is batched, and
    JAX itself turns the ``cond`` into a ``select`` that runs the inner optimiser on
    every call, as optax does: the results are still exact. There are no host
    callbacks.

    Args:
        inner: the optax transformation to apply to the accumulated gradient.
        every_k: calls per group: a positive int, or a function of the applied-step
            count (``state.gradient_step``) returning one.
        every_k_schedule: optax's name for ``every_k``; give one of the two.
        accumulator_dtype: dtype of the accumulator; ``None`` (default) is at least
            float32 (bfloat16 gradients are accumulated in float32, float64 stays
            float64); an explicit dtype is used as given (``jnp.bfloat16`` halves its
            memory).
        should_skip_update_fn: ``(grads, gradient_step, params) -> (bool scalar,
            report)``, as optax's, e.g. :func:`skip_not_finite`; ``None`` (default) skips
            nothing.

    Example:
        >>> import jax.numpy as jnp, optax, jaxga
        >>> tx = jaxga.MultiSteps(optax.sgd(1.0), every_k=2)
        >>> params = jnp.zeros(2)
        >>> state = tx.init(params)
        >>> for g, n in ((jnp.array([1.0, 2.0]), 1), (jnp.array([4.0, 0.0]), 3)):
        ...     updates, state = tx.update(g, state, params, weight=n)  # e.g. token counts
        ...     params = optax.apply_updates(params, updates)
        >>> params.tolist(), bool(tx.has_updated(state))
        ([-3.25, -0.5], True)
    """

    def __new__(
        cls,
        inner: optax.GradientTransformation,
        every_k: EveryK | None = None,
        *,
        every_k_schedule: EveryK | None = None,
        accumulator_dtype: Any = None,
        should_skip_update_fn: ShouldSkipFn | None = None,
    ) -> MultiSteps:
        if (every_k is None) == (every_k_schedule is None):
            raise TypeError(
                "Pass the number of calls per group once: `every_k` or optax's spelling "
                f"`every_k_schedule`; got every_k={every_k!r}, "
                f"every_k_schedule={every_k_schedule!r}."
            )
        every_k = _check_every_k(every_k if every_k_schedule is None else every_k_schedule)
        if should_skip_update_fn is not None:
            signature = "`(grads, gradient_step, params) -> (skip, report)` or None"
            _checks.check_arity(should_skip_update_fn, "should_skip_update_fn", 3, signature)
        checked = _check_inner(inner)
        dtype = _checks.accumulator_dtype(accumulator_dtype)
        self = super().__new__(
            cls,
            functools.partial(_init, checked, dtype, should_skip_update_fn),
            functools.partial(_update, checked, every_k, should_skip_update_fn),
        )
        self._options = {
            "every_k": every_k,
            "accumulator_dtype": dtype,
            "should_skip_update_fn": should_skip_update_fn,
        }
        self.inner_opt = inner
        return self

    def has_updated(self, state: MultiStepsState) -> jax.Array:
        """Returns whether the call that produced ``state`` ran the inner optimiser.

        Example:
            >>> import jax.numpy as jnp, optax, jaxga
            >>> tx = jaxga.MultiSteps(optax.sgd(0.1), every_k=2)
            >>> state = tx.init(jnp.zeros(3))
            >>> _, state = tx.update(jnp.ones(3), state)
            >>> bool(tx.has_updated(state))
            False
        """
        _check_state(state)
        return state.applied

    def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
        """Returns this transformation as a plain ``optax.GradientTransformationExtraArgs``.

        Example:
            >>> import optax, jaxga
            >>> tx = jaxga.MultiSteps(optax.sgd(0.1), every_k=4).gradient_transformation()
            >>> type(tx).__name__
            'GradientTransformationExtraArgs'
        """
        return optax.GradientTransformationExtraArgs(self.init, self.update)

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={getattr(v, '__name__', v)!s}" for k, v in self._options.items())
        return f"MultiSteps({options})"

    def __reduce__(self):  # copy and pickle rebuild from the arguments, not from (init, update)
        return functools.partial(MultiSteps, self.inner_opt, **self._options), ()


# A transformation is configuration, not data: without this JAX would flatten it as a
# NamedTuple into its two functions and rebuild it by calling MultiSteps(init, update).
jax.tree_util.register_pytree_node(MultiSteps, lambda t: ((), t), lambda t, _: t)
