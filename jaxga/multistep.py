"""Gradient accumulation across calls: an optax optimiser applied once every k calls."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Hashable
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
        acc_grads: Σ wᵢ gᵢ over the calls of the current group, in the accumulator
            dtype. While ``mini_step`` is 0 it still holds the group applied last (zeros
            at first): the next call overwrites it instead of a separate pass zeroing it.
        weight_sum: Σ wᵢ over the same calls (float32): the sum of the ``weight``
            arguments, or the number of calls without weights.
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

    The default ``should_skip_update_fn`` of :class:`MultiSteps`; it has the signature
    of optax's, so optax's predicates (``optax.skip_large_updates``) fit too.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> skip, info = jaxga.skip_not_finite({"w": jnp.array([1.0, jnp.nan])}, 0)
        >>> bool(skip), int(info["num_not_finite"])
        (True, 1)
    """
    del gradient_step, params
    counts = [jnp.sum(~jnp.isfinite(g), dtype=jnp.int32) for g in jax.tree.leaves(updates)]
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
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(
            f"`inner` must be an optax GradientTransformation (with `init` and `update`); "
            f"got {type(inner).__name__}."
        )
    return optax.with_extra_args_support(inner)


def _check_every_k(every_k: Any) -> EveryK:
    if isinstance(every_k, numbers.Integral) and not isinstance(every_k, bool):
        if every_k < 1:
            raise ValueError(f"`every_k` must be at least 1; got {every_k}.")
        return int(every_k)
    if callable(every_k):
        return every_k
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


def _reduce_over_shards(tree: Any, axis_name: Any) -> Any:
    """Sums the leaves of ``tree`` that vary over ``axis_name`` (bools: any device true).

    Leaves that are already the same on every device are left alone, so a report that a
    predicate reduced itself is not counted once per device.
    """
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)

    def reduce(x):
        axes = tuple(a for a in names if a in sharding._varying_axes(x))
        if not axes:
            return x
        if x.dtype == jnp.bool_:
            return jax.lax.psum(x.astype(jnp.int32), axes) > 0
        return jax.lax.psum(x, axes)

    return jax.tree.map(reduce, tree)


def _astype_like(new: Any, old: Any) -> Any:
    return jax.tree.map(lambda n, o: jnp.asarray(n, jnp.result_type(o)), new, old)


@dataclasses.dataclass(frozen=True, eq=False)
class _MultiStepsFns:
    """The validated configuration of a :class:`MultiSteps` and its init/update pair."""

    inner: optax.GradientTransformationExtraArgs
    every_k: EveryK
    weighted: bool
    accumulator_dtype: jnp.dtype | None
    should_skip_update_fn: ShouldSkipFn | None
    axis_name: Hashable | tuple[Hashable, ...] | None

    def init(self, params: Any) -> MultiStepsState:
        """Returns the initial :class:`MultiStepsState` for ``params``."""

        def zeros(p):
            dtype = _checks.accumulation_dtype(self.accumulator_dtype, jnp.result_type(p))
            return jnp.zeros(jnp.shape(p), dtype)

        skip_state = ()
        if self.should_skip_update_fn is not None:
            grads = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.result_type(p)), params)
            step = jnp.zeros((), jnp.int32)
            shapes = jax.eval_shape(self.should_skip_update_fn, grads, step, params)[1]
            skip_state = jax.tree.map(jnp.zeros_like, shapes)
        return MultiStepsState(
            mini_step=jnp.zeros((), jnp.int32),
            gradient_step=jnp.zeros((), jnp.int32),
            acc_grads=jax.tree.map(zeros, params),
            weight_sum=jnp.zeros((), jnp.float32),
            inner_opt_state=self.inner.init(params),
            applied=jnp.zeros((), jnp.bool_),
            num_skipped=jnp.zeros((), jnp.int32),
            skip_state=skip_state,
        )

    def update(
        self,
        grads: Any,
        state: MultiStepsState,
        params: Any = None,
        *,
        weight: jax.typing.ArrayLike | None = None,
        **extra_args: Any,
    ) -> tuple[Any, MultiStepsState]:
        """Adds ``grads`` to the group; its last call runs the inner optimiser on their mean.

        Returns ``(updates, new_state)``: the inner optimiser's updates for the
        (weighted) mean gradient of the group on the call that completes it, zeros of
        the same tree and dtypes on every other call. ``extra_args`` go to the inner
        optimiser on the applying call.
        """
        _check_state(state)
        _check_tree(grads, state.acc_grads)
        w = self._weight(weight)
        k = self._every_k(state.gradient_step)
        skip, skip_state = self._should_skip(grads, state, params)
        if w is not None:  # a traced weight cannot raise; a bad one skips the call instead
            skip = skip | ~(jnp.isfinite(w) & (w >= 0))
        if self.axis_name is not None:  # gradient shards must agree on skipping
            sharding.check_axis_bound(self.axis_name)
            skip, skip_state = _reduce_over_shards((skip, skip_state), self.axis_name)
        keep = ~skip
        first = state.mini_step == 0

        def accumulate(acc, g):
            dtype = jnp.promote_types(jnp.promote_types(acc.dtype, g.dtype), jnp.float32)
            term = g.astype(dtype) if w is None else w.astype(dtype) * g.astype(dtype)
            new = (jnp.where(first, 0, acc).astype(dtype) + term).astype(acc.dtype)
            return jnp.where(keep, new, acc)

        acc_grads = jax.tree.map(accumulate, state.acc_grads, grads)
        term = jnp.ones((), jnp.float32) if w is None else w
        weight_sum = jnp.where(
            keep, jnp.where(first, 0.0, state.weight_sum) + term, state.weight_sum
        )
        mini_step = state.mini_step + keep.astype(jnp.int32)
        complete = keep & (mini_step >= k)
        # A group without weight holds no items: nothing to learn from, so the inner
        # optimiser (its weight decay, moments and schedule) does not run for it.
        apply = complete & (weight_sum > 0)
        grad_dtypes = jax.tree.map(jnp.result_type, grads)

        def run_inner(acc_grads, weight_sum, inner_state):
            mean = jax.tree.map(
                lambda a, dtype: (
                    a.astype(jnp.promote_types(a.dtype, jnp.float32)) / weight_sum
                ).astype(dtype),
                acc_grads,
                grad_dtypes,
            )
            updates, new_inner = self.inner.update(mean, inner_state, params, **extra_args)
            return updates, _astype_like(new_inner, inner_state)

        def hold(acc_grads, weight_sum, inner_state):
            shapes = jax.eval_shape(run_inner, acc_grads, weight_sum, inner_state)[0]
            # zeros_like keeps what eval_shape saw of each leaf: also its shard_map axes
            return jax.tree.map(jnp.zeros_like, shapes), inner_state

        updates, inner_state = jax.lax.cond(
            apply, run_inner, hold, acc_grads, weight_sum, state.inner_opt_state
        )
        new_state = MultiStepsState(
            mini_step=jnp.where(complete, 0, mini_step),
            gradient_step=state.gradient_step + apply.astype(jnp.int32),
            acc_grads=acc_grads,
            weight_sum=weight_sum,
            inner_opt_state=inner_state,
            applied=apply,
            num_skipped=state.num_skipped + skip.astype(jnp.int32),
            skip_state=skip_state,
        )
        return updates, new_state

    def _weight(self, weight: Any) -> jax.Array | None:
        if not self.weighted:
            if weight is not None:
                raise ValueError(
                    "`weight` was given, but this MultiSteps was built with weighted=False; "
                    "build it with jaxga.MultiSteps(..., weighted=True) and pass a weight "
                    "on every call."
                )
            return None
        if weight is None:
            raise ValueError(
                "This MultiSteps was built with weighted=True, so every call needs `weight=` "
                "(e.g. the token count of the call's batch, jaxga.Mean.count); got none."
            )
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

    def _every_k(self, gradient_step: jax.Array) -> Any:
        if isinstance(self.every_k, int):
            return self.every_k
        k = jnp.asarray(self.every_k(gradient_step))
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
        self, grads: Any, state: MultiStepsState, params: Any
    ) -> tuple[jax.Array, Any]:
        if self.should_skip_update_fn is None:
            return jnp.zeros((), jnp.bool_), ()
        skip, skip_state = self.should_skip_update_fn(grads, state.gradient_step, params)
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
        return skip, _astype_like(skip_state, state.skip_state)


class MultiSteps(optax.GradientTransformationExtraArgs):
    """Accumulates gradients over k calls and runs the ``inner`` optimiser once per k.

    Each call adds its gradient to an accumulator. The call that completes a group of
    ``every_k`` calls passes the group's mean gradient to ``inner`` — a single
    transformation or a whole ``optax.chain``, so clipping sees the accumulated
    gradient — and returns its updates; every other call returns zeros, so that
    ``optax.apply_updates`` leaves the parameters unchanged. ``inner`` runs once per
    group, not once per call: its step counter and learning-rate schedule advance once
    per k calls. With equal weights the parameters match
    ``optax.MultiSteps(inner, every_k, use_grad_mean=True)`` to float32 rounding.
    What differs from optax: ``inner`` runs once per group (not on every call), non-finite
    gradients are skipped by default, and the state is a ``jaxga.MultiStepsState``
    (``inner_opt_state``, ``gradient_step`` and ``mini_step`` as in optax, plus
    ``weight_sum``, ``applied``, ``num_skipped``); ``.inner_opt`` is the wrapped optimiser.

    **Weights.** With ``weighted=True`` every call passes ``weight=`` (e.g. the token
    count of its batch) and the group's gradient is the weighted mean Σwᵢgᵢ / Σwᵢ:
    the across-call counterpart of :class:`jaxga.Mean`. For a loss returning
    ``Mean(total, count)``, pass the gradient of ``mean.value`` and
    ``weight=mean.count``; k calls then give exactly the gradient of the token mean
    over all k batches. Whether a transformation is weighted is fixed when it is built,
    so a weight given on some calls but not others is an error at trace time. A group
    whose weights sum to 0 holds no items: it ends without running ``inner``, whose
    state and step count stay as they were (``has_updated`` is false).

    **Skipping.** A call whose gradient ``should_skip_update_fn`` rejects (by default
    :func:`skip_not_finite`: any inf or NaN) leaves the accumulation as if it had not
    happened: same accumulator, group position, step count and inner state. It says so
    in the state: ``num_skipped`` counts skipped calls, ``skip_state`` holds the
    predicate's report and :meth:`has_updated` is false. Under ``jit`` a negative or
    non-finite ``weight`` cannot raise an error, so it skips its call the same way.
    ``should_skip_update_fn=None`` turns skipping off and saves one read of the
    gradients per call.

    **Cost.** One buffer the size of the parameters (the accumulator). A call that does
    not apply reads the gradient and the accumulator and writes the accumulator and the
    zero updates: it neither runs the inner optimiser nor selects between old and new
    inner states, and the accumulator is reset by the next group's first call rather
    than by a pass of its own.

    **Extra arguments** (``value=`` for ``optax.contrib.reduce_on_plateau`` or a line
    search) reach ``inner`` on the applying call only, so pass values that describe the
    whole group there, such as the group's mean loss, not the last micro-batch's.

    **Transforms.** The inner optimiser runs under ``lax.cond``. Under ``vmap`` with a
    batched state the condition is batched, and JAX turns the ``cond`` into a
    ``select`` that runs the inner optimiser on every call, as optax does: the results
    are still exact, only the saving is lost. Inside ``shard_map`` with sharded
    gradients (each device holds a different part), pass the mesh axis name(s) as
    ``axis_name`` so that all devices take the same skipping decision; with replicated
    gradients it is not needed. There are no host callbacks.

    Args:
        inner: the optax transformation to apply to the accumulated gradient.
        every_k: calls per group: a positive int, or a function of the applied-step
            count (``state.gradient_step``) returning one (a value below 1 under
            ``jit`` counts as 1).
        every_k_schedule: optax's name for ``every_k``; give one of the two, so that
            ``optax.MultiSteps(inner, every_k_schedule=k)`` ports by changing the class.
        weighted: whether every call passes ``weight=``.
        accumulator_dtype: dtype of the accumulator; ``None`` (default) is at least
            float32 (bfloat16 gradients are summed in float32, float64 stays float64);
            an explicit dtype is used as given (``jnp.bfloat16`` halves its memory).
        should_skip_update_fn: ``(grads, gradient_step, params) -> (bool scalar,
            report)``; ``None`` skips nothing.
        axis_name: mesh axis name(s) over which the gradients are sharded, inside
            ``shard_map``.

    Example:
        >>> import jax.numpy as jnp, optax, jaxga
        >>> tx = jaxga.MultiSteps(optax.sgd(1.0), every_k=2)
        >>> params = jnp.zeros(2)
        >>> state = tx.init(params)
        >>> for g in (jnp.array([1.0, 2.0]), jnp.array([3.0, 0.0])):
        ...     updates, state = tx.update(g, state, params)
        ...     params = optax.apply_updates(params, updates)
        >>> params.tolist(), bool(tx.has_updated(state))
        ([-2.0, -1.0], True)
    """

    def __new__(
        cls,
        inner: optax.GradientTransformation,
        every_k: EveryK | None = None,
        *,
        every_k_schedule: EveryK | None = None,
        weighted: bool = False,
        accumulator_dtype: Any = None,
        should_skip_update_fn: ShouldSkipFn | None = skip_not_finite,
        axis_name: Hashable | tuple[Hashable, ...] | None = None,
    ) -> MultiSteps:
        if (every_k is None) == (every_k_schedule is None):
            raise TypeError(
                "Pass the number of calls per group once: `every_k` or optax's spelling "
                f"`every_k_schedule`; got every_k={every_k!r}, "
                f"every_k_schedule={every_k_schedule!r}."
            )
        every_k = every_k if every_k_schedule is None else every_k_schedule
        if not isinstance(weighted, bool):
            raise TypeError(f"`weighted` must be a bool; got {weighted!r}.")
        if should_skip_update_fn is not None and not callable(should_skip_update_fn):
            raise TypeError(
                f"`should_skip_update_fn` must be a function or None; got "
                f"{type(should_skip_update_fn).__name__}."
            )
        fns = _MultiStepsFns(
            inner=_check_inner(inner),
            every_k=_check_every_k(every_k),
            weighted=weighted,
            accumulator_dtype=_checks.accumulator_dtype(accumulator_dtype),
            should_skip_update_fn=should_skip_update_fn,
            axis_name=axis_name,
        )
        self = super().__new__(cls, fns.init, fns.update)
        self._fns = fns
        self._inner = inner
        return self

    @property
    def inner(self) -> optax.GradientTransformation:
        """The wrapped optimiser."""
        return self._inner

    @property
    def inner_opt(self) -> optax.GradientTransformation:
        """The wrapped optimiser, under optax's name."""
        return self._inner

    @property
    def weighted(self) -> bool:
        """Whether every call passes ``weight=`` (fixed at construction)."""
        return self._fns.weighted

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
        f = self._fns
        skip = getattr(f.should_skip_update_fn, "__name__", f.should_skip_update_fn)
        return (
            f"MultiSteps(every_k={f.every_k!r}, weighted={f.weighted}, "
            f"accumulator_dtype={f.accumulator_dtype}, should_skip_update_fn={skip}, "
            f"axis_name={f.axis_name!r})"
        )

    def __reduce__(self):
        f = self._fns
        options = {
            "weighted": f.weighted,
            "accumulator_dtype": f.accumulator_dtype,
            "should_skip_update_fn": f.should_skip_update_fn,
            "axis_name": f.axis_name,
        }
        return functools.partial(MultiSteps, **options), (self._inner, f.every_k)


# A transformation is configuration, not data: without this JAX would flatten it as a
# NamedTuple into its two functions and rebuild it by calling MultiSteps(init, update).
jax.tree_util.register_pytree_node(MultiSteps, lambda t: ((), t), lambda t, _: t)
