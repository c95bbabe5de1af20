"""Jitted train steps that put the whole jaxga pipeline together.

:func:`make_train_step` takes a functional state — a ``flax.training.train_state.TrainState``
(Linen, or an NNX model split with ``nnx.split``) — and :func:`nnx_train_step` takes a Flax
NNX model and its ``nnx.Optimizer``. Both split the batch into micro-batches, accumulate
the exact loss and gradient, hand the optimiser the call's item count (so a
:class:`jaxga.MultiSteps` anywhere in it accumulates exactly across calls too) and
return the same metrics.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxga import _checks, sharding
from jaxga.accumulation import Accumulated, accumulate
from jaxga.compiler import compiler_options
from jaxga.loss import Mean
from jaxga.multistep import MultiStepsState

__all__ = ["TrainState", "make_train_step", "nnx_loss", "nnx_train_step"]

Metrics = dict[str, jax.Array]
_FLAX_FIELDS = frozenset(f.name for f in dataclasses.fields(train_state.TrainState))


class TrainState(train_state.TrainState):
    """Flax's ``TrainState`` plus the model's non-differentiated state and a PRNG key.

    A ``flax.training.train_state.TrainState`` (``step``, ``apply_fn``, ``params``,
    ``tx``, ``opt_state``; ``apply_gradients`` works as in Flax) with two more fields:

    Attributes:
        model_state: state the model updates but does not differentiate, threaded
            through the micro-batches (Linen ``{"batch_stats": ...}``, the non-``Param``
            state of an NNX model split with ``nnx.split``); ``{}`` when there is none.
        rng: a typed PRNG key (any implementation); step ``s``, micro-batch ``i`` gets
            ``fold_in(fold_in(rng, s), i)``, so a resumed run draws the same keys.

    Any other ``flax.training.train_state.TrainState`` works with
    :func:`make_train_step` too; see there.

    Example:
        >>> import jax.numpy as jnp, optax, jaxga
        >>> state = jaxga.TrainState.create(params={"w": jnp.zeros(3)}, tx=optax.adam(1e-3))
        >>> state = state.replace(params={"w": jnp.ones(3)})  # a pytree: save it, map over it
        >>> int(state.step), state.params["w"].tolist()
        (0, [1.0, 1.0, 1.0])
    """

    model_state: Any = None
    rng: jax.Array | None = None

    @classmethod
    def create(
        cls,
        params: Any,
        tx: optax.GradientTransformation,
        *,
        apply_fn: Callable[..., Any] | None = None,
        model_state: Any = None,
        rng: jax.Array | int = 0,
        **kwargs: Any,
    ) -> TrainState:
        """Returns the initial state for ``params`` and the optimiser ``tx``.

        ``params``, ``model_state`` and ``rng`` are copied: the train step donates the state's
        buffers, which would otherwise delete arrays you still hold (an NNX model's
        own parameters, say). ``rng`` is an integer seed or a PRNG key.

        Example:
            >>> import jax.numpy as jnp, optax, jaxga
            >>> state = jaxga.TrainState.create(params=jnp.zeros(3), tx=optax.sgd(0.1), rng=1)
            >>> int(state.step), state.rng.shape
            (0, ())
        """
        _checks.check_optimizer(tx, "tx")
        if not jax.tree.leaves(params):
            raise ValueError(
                f"`params` must be a pytree holding the parameter arrays; got {params!r}, "
                f"which holds none."
            )
        model_state = {} if model_state is None else model_state
        params, model_state = jax.tree.map(_copy, (params, model_state))
        state = super().create(
            apply_fn=apply_fn,
            params=params,
            tx=tx,
            model_state=model_state,
            rng=_copy(_as_key(rng)),
            **kwargs,
        )
        # tx.init may keep the parameters themselves (prodigy): one buffer, donated twice
        return _unaliased(state.replace(step=jnp.zeros((), jnp.int32)))


def _copy(x: Any) -> Any:
    """A copy of the same kind (host arrays stay on the host, for ``jax.distributed``)."""
    return x.copy() if isinstance(x, np.ndarray) else jnp.array(x, copy=True)


def _as_key(rng: Any) -> jax.Array:
    """A typed PRNG key from a seed, a typed key or raw ``uint32`` key data."""
    bad = TypeError(f"`rng` must be an integer seed or a single PRNG key; got {rng!r}.")
    if isinstance(rng, str | bytes):  # result_type would read it as the name of a dtype
        raise bad
    try:
        dtype, shape = jnp.result_type(rng), jnp.shape(rng)
    except TypeError:
        raise bad from None
    if jnp.issubdtype(dtype, jax.dtypes.prng_key) and shape == ():
        return rng
    if jnp.issubdtype(dtype, jnp.integer) and shape == ():
        return jax.random.key(rng)
    if dtype == jnp.uint32 and shape == (2,):
        return jax.random.wrap_key_data(rng)
    raise TypeError(
        f"`rng` must be an integer seed or a single PRNG key; got {rng!r} (dtype {dtype}, "
        f"shape {shape})."
    )


def nnx_loss(graphdef: Any, loss: Callable[..., Any]) -> Callable[..., Any]:
    """Turns ``loss(model, batch, rng)`` on a Flax NNX model into the functional form.

    The result is ``(params, batch, model_state, rng) -> (loss, new_model_state)``, the
    signature :func:`make_train_step` takes, for a model split as
    ``graphdef, params, model_state = nnx.split(model, nnx.Param, ...)``.

    Example:
        >>> import jax, jax.numpy as jnp, optax, jaxga
        >>> from flax import nnx
        >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        >>> fn = jaxga.nnx_loss(graphdef, lambda m, b, rng: jnp.mean((m(b["x"]) - b["y"]) ** 2))
        >>> loss, _ = fn(params, {"x": jnp.ones((4, 2)), "y": jnp.zeros((4, 1))}, rest, None)
        >>> loss.shape
        ()
    """
    if not isinstance(graphdef, nnx.graphlib.GraphDef):
        raise TypeError(
            f"`graphdef` must be the GraphDef of `graphdef, params, rest = nnx.split(model, "
            f"nnx.Param, ...)`; got {type(graphdef).__name__}."
        )
    _checks.check_arity(loss, "loss", 3, "`loss(model, batch, rng)`")

    def functional(params, batch, model_state, rng):
        try:
            # copy=True: fresh Variables of this trace, so the model may update its state
            # (BatchNorm statistics, its own Rngs) inside the micro-batch loop.
            model = nnx.merge(graphdef, params, model_state, copy=True)
        except ValueError as e:
            raise ValueError(
                "`nnx_loss` could not rebuild the model from the state's params and "
                "model_state: split it as `graphdef, params, rest = nnx.split(model, "
                f"nnx.Param, ...)` and pass `model_state=rest` ({e})."
            ) from None
        value = loss(model, batch, rng)
        _, _, new_state = nnx.split(model, nnx.Param, ...)
        return value, new_state

    return functional


def _learning_rate(opt_state: Any) -> jax.Array:
    """The learning rate recorded by ``optax.inject_hyperparams``, or NaN if there is none."""
    found = [
        value
        for path, value in optax.tree_utils.tree_get_all_with_path(opt_state, "learning_rate")
        if any(getattr(key, "name", None) == "hyperparams" for key in path)
    ]
    return jnp.asarray(found[0] if len(found) == 1 else jnp.nan, jnp.float32)


def _first(opt_state: Any, kind: type) -> Any:
    """The first ``kind`` state in an optimiser's state (a MultiSteps'), or ``None``."""
    is_state = lambda x: isinstance(x, kind)
    return next((x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)), None)


def _update_if_counted(
    acc: Accumulated,
    opt_state: Any,
    update: Callable[[Any, Any], Any],
    state: Any,
    *,
    donated: bool,
) -> Any:
    """``update(state, grads)``, or ``state`` as it is for a call that counted no items.

    The mean gradient of no items is 0 / 0: a call whose batch is all padding must not
    reach the optimiser (its moments, weight decay and step count), as a group of weight
    0 does not reach :class:`jaxga.MultiSteps`' inner optimiser. A MultiSteps takes such
    a call itself (it is one of its group's calls, and weight 0 keeps its gradient out),
    so an optimiser holding one is called, with zeros for gradients: what sits beside it
    (another partition of ``optax.multi_transform``) sees a zero gradient, not 0 / 0.

    With ``donated`` operands the choice is a ``lax.cond``, whose untaken branch hands
    them back in place; without, a cond would copy them, and a per-leaf select is
    cheaper (measured with ``jaxga.memory_report`` on a CPU). An update that would change
    a leaf's shape (an optimiser built for other parameters, which broadcasting would
    otherwise let through) is named first.
    """
    counted = acc.mean.count > 0
    updated_shapes = jax.eval_shape(update, state, acc.grads)
    for (path, before), after in zip(
        jax.tree_util.tree_flatten_with_path(state)[0],
        jax.tree.leaves(updated_shapes),
        strict=True,
    ):
        if jnp.shape(before) != after.shape:
            raise ValueError(
                f"The optimiser's update changes the shape of {jax.tree_util.keystr(path)} "
                f"from {jnp.shape(before)} to {after.shape}: was it built for these "
                f"parameters (`nnx.Optimizer(model, tx, wrt=...)`, "
                f"`TrainState.create(params, tx)`)?"
            )
    if _first(opt_state, MultiStepsState) is not None:
        # a zero XLA cannot see is constant: no zeros of a parameter's shape (see MultiSteps)
        zero = jax.lax.optimization_barrier(jnp.zeros((), jnp.float32))
        grads = jax.tree.map(lambda g: jnp.where(counted, g, zero.astype(g.dtype)), acc.grads)
        return update(state, grads)
    # leaf by leaf: the update may rebuild a subtree with another node type (nnx.Optimizer
    # turns an optimiser state's lists into nnx.States), keeping the leaves and their order
    updated = lambda state: jax.tree.leaves(update(state, acc.grads))
    if donated:
        # the state as it is, in the dtypes the update gives it (inject_hyperparams' float32
        # moments of bfloat16 parameters): a cond's branches agree on types
        dtypes = [x.dtype for x in jax.tree.leaves(updated_shapes)]
        kept = lambda state: [x.astype(d) for x, d in zip(jax.tree.leaves(state), dtypes)]
        leaves = jax.lax.cond(counted, updated, kept, state)
    else:
        old = jax.tree.leaves(state)  # before `update`, which may write into its Variables
        leaves = map(functools.partial(jnp.where, counted), updated(state), old)
    return jax.tree.unflatten(jax.tree.structure(updated_shapes), list(leaves))


def _applied(acc: Accumulated, old_opt_state: Any, opt_state: Any) -> jax.Array:
    """Whether the call changed the parameters: not while a MultiSteps (jaxga's, or
    optax's, whose applied steps ``gradient_step`` counts) accumulates, nor for no items."""
    ours = _first(opt_state, MultiStepsState)
    if ours is not None:
        return ours.applied
    theirs = _first(opt_state, optax.MultiStepsState)
    if theirs is not None:
        return theirs.gradient_step > _first(old_opt_state, optax.MultiStepsState).gradient_step
    return acc.mean.count > 0


def _metrics(acc: Accumulated, old_opt_state: Any, opt_state: Any) -> Metrics:
    return {
        "loss": acc.mean.value,
        "count": acc.mean.count,
        "grad_norm": optax.tree.norm(acc.grads),
        "learning_rate": _learning_rate(opt_state),
        "applied": _applied(acc, old_opt_state, opt_state),
    }


def _weight_of(tx: Any, acc: Accumulated) -> dict[str, jax.Array]:
    """``weight=`` the call's item count, for optimisers that take extra arguments.

    :class:`jaxga.MultiSteps` (anywhere in an ``optax.chain``) weighs its calls by it;
    other transformations that take extra arguments ignore it.
    """
    extra_args = isinstance(tx, optax.GradientTransformationExtraArgs)
    return {"weight": acc.mean.count} if extra_args else {}


def _added_fields(state: train_state.TrainState) -> list[str]:
    """The array fields a TrainState subclass adds to Flax's."""
    return [
        f.name
        for f in dataclasses.fields(state)
        if f.name not in _FLAX_FIELDS and f.metadata.get("pytree_node", True)
    ]


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _rng_field(state: train_state.TrainState) -> str | None:
    """The field the step's keys come from: ``rng`` or ``key``, or the one holding a key."""
    if isinstance(state, TrainState):
        return "rng"
    names = [n for n in _added_fields(state) if n in ("rng", "key") or _is_key(getattr(state, n))]
    if len(names) > 1:
        raise ValueError(
            f"`state` ({type(state).__name__}) has several PRNG-key fields, {names}; the "
            f"train step draws its keys from one: keep one, or hold the others elsewhere."
        )
    return names[0] if names else None


def _model_fields(state: train_state.TrainState) -> list[str]:
    """The variable collections a TrainState subclass adds (``batch_stats``: dicts)."""
    rng = _rng_field(state)
    return [
        n
        for n in _added_fields(state)
        if n != rng and isinstance(getattr(state, n), collections.abc.Mapping)
    ]


def _get_model_state(state: train_state.TrainState) -> Any:
    if isinstance(state, TrainState):
        return state.model_state
    return {name: getattr(state, name) for name in _model_fields(state)}


def _get_rng(state: train_state.TrainState) -> jax.Array | None:
    """The step's base key: ``fold_in(key, step)``, or ``None`` if the state has none."""
    name = _rng_field(state)
    key = None if name is None else getattr(state, name)
    return None if key is None else jax.random.fold_in(_as_key(key), state.step)


def _set_model_state(state: train_state.TrainState, model_state: Any) -> Any:
    if isinstance(state, TrainState):
        return state.replace(model_state=model_state)
    return state.replace(**model_state)


def _check_state(state: Any) -> None:
    if isinstance(state, train_state.TrainState):
        return
    hint = (
        "; for a Flax NNX model and nnx.Optimizer use jaxga.nnx_train_step"
        if nnx.graphlib.is_graph_node(state)
        else ""
    )
    raise TypeError(
        f"`state` must be a flax.training.train_state.TrainState (jaxga.TrainState is one, "
        f"with model_state and rng); got {type(state).__name__}{hint}."
    )


def _check_no_aux(value: Any, signature: str) -> None:
    """A train step's loss is the loss alone: a ``(loss, aux)`` pair gets a clear error."""
    if isinstance(value, tuple | list):
        raise TypeError(
            f"{signature} must give the loss alone (a float scalar or a jaxga.Mean); got a "
            f"{type(value).__name__} of length {len(value)}. The train step returns no aux "
            f"output: compute other metrics in an evaluation step of your own."
        )


def _checked_loss(loss: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(loss)
    def checked(params, batch, model_state, rng):
        out = loss(params, batch, model_state, rng)
        if isinstance(out, Mean) or not (isinstance(out, tuple) and len(out) == 2):
            got = type(out).__name__
            if not isinstance(out, Mean | tuple):
                got = f"an array of shape {jnp.shape(out)}"
            raise TypeError(
                "`loss(params, batch, model_state, rng)` must return a pair (loss, "
                f"new_model_state) — return `model_state` unchanged if the model has none; "
                f"got {got}."
            )
        _check_no_aux(out[0], "The first element of `loss(params, batch, model_state, rng)`")
        given, returned = jax.tree.structure(model_state), jax.tree.structure(out[1])
        if returned != given:
            raise TypeError(
                f"`loss(params, batch, model_state, rng)` returned a new_model_state with tree "
                f"structure {returned}; it must keep the structure of the model_state it was "
                f"given, {given} (TrainState.create's `model_state`)."
            )
        return out

    return checked


def _donated(state: Any) -> bool:
    """Whether ``state`` was donated to an earlier call: its step counter tells (or, while
    that is a Python int, its first parameter). Every leaf is donated together."""
    leaf = getattr(state, "step", None)
    if not isinstance(leaf, jax.Array):
        leaf = next(iter(jax.tree.leaves(getattr(state, "params", None))), None)
    return isinstance(leaf, jax.Array) and leaf.is_deleted()


def _traced(tree: Any) -> bool:
    """Whether ``tree`` is being traced by an enclosing transformation (one leaf tells:
    a train state's step counter, without flattening the state)."""
    leaf = getattr(tree, "step", None)
    if leaf is None:
        leaf = next(iter(jax.tree.leaves(tree)), None)
    return isinstance(leaf, jax.core.Tracer)


def _buffers(x: jax.Array) -> list[Any]:
    """The addresses of ``x``'s buffers: two arrays that share one are one to donate.

    Addresses on different devices may coincide; that costs a needless copy, no error.
    """
    try:
        return [x.unsafe_buffer_pointer()]  # one device: cheap, no shard objects built
    except Exception:
        pass
    try:
        return [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]
    except Exception:  # a backend without buffer pointers: the array object itself
        return [id(x)]


def _unaliased(tree: Any) -> Any:
    """``tree`` with a copy of each array whose buffer it holds a second time.

    A call may not donate one buffer twice, and optimisers do hold the parameters
    themselves in their state (``optax.contrib.prodigy`` keeps the initial ones), also
    as other array objects over the same buffer (after ``jax.device_put``).
    """
    seen: set[Any] = set()

    def once(x: Any) -> Any:
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return x
        buffers = _buffers(x)
        if seen.intersection(buffers):
            return _copy(x)
        seen.update(buffers)
        return x

    return jax.tree.map(once, tree)


def _as_step(
    fn: Callable[..., Any], jitted: Any, place: Callable[[Any], Any], donate: bool
) -> Callable:
    """``jitted`` with its state placed by ``place`` first, and a clear error for a state
    an earlier call donated. Under an enclosing ``jit`` it is ``fn`` itself, inlined:
    XLA options belong to the outermost ``jit``."""

    @functools.wraps(jitted)
    def step(state: Any, batch: Any) -> Any:
        if _traced(state):
            return fn(state, batch)
        if _donated(state):
            raise ValueError(
                "The train step was given a state that an earlier call deleted: it donates "
                "its state's buffers (donate=True), so pass the state it returned, not the "
                "one you gave it (or build it with donate=False)."
            )
        state = place(state)
        return jitted(_unaliased(state) if donate else state, batch)

    step.lower = lambda state, batch: jitted.lower(place(state), batch)
    step.trace = lambda state, batch: jitted.trace(place(state), batch)
    return step


def _state_placer(mesh: Mesh | None, strategy: Any, axis_name: str) -> Callable[[Any], Any]:
    """Puts a state that is not on ``mesh`` yet (fresh from ``create``) where the step keeps
    it, so that its first call compiles the program the later ones run and donates.

    Two leaves tell, the step counter and the first parameter; arrays and
    ``jax.ShapeDtypeStruct``s are placed.
    """

    def placed(x: Any, spec: P) -> bool:
        current = getattr(x, "sharding", None)
        return (
            isinstance(current, NamedSharding)
            and current.mesh == mesh
            and current.is_equivalent_to(NamedSharding(mesh, spec), len(x.shape))
        )

    def first_param_spec(param: Any) -> P:
        if not isinstance(strategy, str):
            return jax.tree.leaves(strategy, is_leaf=lambda x: isinstance(x, P))[0]
        if strategy in ("fsdp", "zero3"):
            return sharding.fsdp_spec(param.shape, mesh.shape[axis_name], axis_name)
        return P()

    def place(state: Any) -> Any:
        if mesh is None:
            return state
        _check_state(state)
        counter = state.step
        param = next(iter(jax.tree.leaves(state.params)), None)
        if placed(counter, P()) and (param is None or placed(param, first_param_spec(param))):
            return state
        shardings = sharding.state_shardings(state, mesh, strategy, axis_name=axis_name)

        def put(x, where):
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where)
            return sharding.put(x, where)

        return jax.tree.map(put, state, shardings)

    return place


def _check_wrt(optimizer: Any, model: Any, grads: Any) -> None:
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            f"`optimizer` must be an nnx.Optimizer(model, tx, wrt=nnx.Param); got "
            f"{type(optimizer).__name__}."
        )
    if isinstance(optimizer, nnx.ModelAndOptimizer) and optimizer.model is not model:
        raise ValueError(
            "`optimizer` is an nnx.ModelAndOptimizer of another model than `model`: pass "
            "the model it holds, `step(optimizer.model, optimizer, batch)`."
        )
    expected = jax.tree.structure(nnx.as_pure(nnx.state(model, optimizer.wrt)))
    if jax.tree.structure(nnx.as_pure(grads)) != expected:
        raise ValueError(
            f"`optimizer` was built with wrt={optimizer.wrt!r}, but the step differentiates "
            f"the model's nnx.Param state; build it as nnx.Optimizer(model, tx, wrt=nnx.Param)."
        )


def make_train_step(
    loss: Callable[..., Any],
    num_microbatches: int = 1,
    *,
    mesh: Mesh | None = None,
    axis_name: str = "data",
    strategy: Any = "data_parallel",
    accumulator_dtype: Any = None,
    donate: bool = True,
) -> Callable[[Any, Any], tuple[Any, Metrics]]:
    """Builds one jitted train step ``(state, batch) -> (state, metrics)``.

    The step splits ``batch`` into ``num_microbatches`` micro-batches, accumulates
    the loss and gradients exactly with :func:`jaxga.accumulate` (a fresh PRNG key
    per micro-batch, model state threaded from one micro-batch to the next), runs
    the state's optimiser ``state.tx`` and returns the new state.

    ``state`` is a ``flax.training.train_state.TrainState``. With a
    :class:`jaxga.TrainState` the model state is ``state.model_state`` and the keys
    come from ``state.rng``. With any other (a Linen user's own subclass, say, with a
    ``batch_stats`` field) the model state is the dict of the variable collections the
    subclass adds — its fields that hold dicts (``{"batch_stats": ...}``, just what
    Linen's ``apply(..., mutable=...)`` returns) — and the keys come from its field
    named ``rng`` or ``key``, or the one holding a PRNG key (``None`` without one).
    Other added fields (a ``dynamic_scale``, counters) pass through unchanged.

    The optimiser is handed the call's item count as ``weight=``, so a
    :class:`jaxga.MultiSteps` in it accumulates exactly across calls; other
    transformations ignore it. The state's buffers are donated: use the state the
    step returns, not the one you gave it. (:meth:`jaxga.TrainState.create` copies the
    arrays it is given; Flax's own ``TrainState.create`` does not, so the first call
    deletes the ``params`` you passed it.)

    Args:
        loss: ``loss(params, batch, model_state, rng) -> (loss, new_model_state)``,
            where ``loss`` is a :class:`jaxga.Mean` (exact for masked and
            variable-length losses) or a scalar mean over its micro-batch. For Flax
            NNX, :func:`nnx_loss` builds it from ``loss(model, batch, rng)``; for Linen,
            call ``model.apply({"params": params, **model_state}, ..., rngs=...,
            mutable=list(model_state))``.
        num_microbatches: micro-batches per call.
        mesh: data parallelism: the batch is sharded over ``mesh``'s ``axis_name``
            axis; each device scans its own micro-batches and the gradients are
            reduced once per call, after the loop. A single process may pass host
            arrays; with several processes pass global arrays
            (:func:`jaxga.sharding.shard_batch` places this process's rows,
            ``jax.device_put(state, jaxga.sharding.state_shardings(...))`` the state).
            Model state is threaded per device; then floating leaves (BatchNorm
            statistics) are averaged over devices and the others (counters, keys)
            take their maximum. See ``docs/distributed.md``.
        axis_name: the mesh axis the batch is sharded over.
        strategy: with ``mesh``, how the state is laid out over ``axis_name``
            (:func:`jaxga.sharding.state_specs`): ``"data_parallel"`` replicates it;
            ``"zero1"`` shards the optimiser state (the gradient is reduce-scattered
            into its shards, the updated parameters all-gathered); ``"fsdp"`` shards
            the parameters and optimiser state too — they are all-gathered once per
            call, before the micro-batch loop, and the gradient is reduce-scattered
            once, after it; ``"zero3"`` shards the same, but gathers the parameters
            in every micro-batch and reduce-scatters each micro-batch's gradient, so
            that neither whole parameters nor a whole gradient sum stay on a device
            through the loop (k times the communication). A tree of
            ``PartitionSpec``s for the parameters is FSDP with those specs. The
            returned state keeps the layout.
        accumulator_dtype: dtype of the gradient sums; ``None`` (default) is at least
            float32, an explicit dtype is used as given.
        donate: donate the state's buffers to the step. Inside a ``jax.jit`` of your
            own, donate the state there too: without, the step's guard for a batch that
            counts no items (a ``lax.cond`` over the state) holds a copy of the state.

    Returns:
        The jitted step (with ``lower`` and ``trace``, for :func:`jaxga.memory_report`
        and :func:`jaxga.plan`). ``metrics`` holds ``loss`` (the exact global mean),
        ``count`` (items, e.g. tokens; for a scalar loss, micro-batches over all
        devices), ``grad_norm`` (of the accumulated gradient), ``learning_rate`` (from
        ``optax.inject_hyperparams``, NaN if unknown) and ``applied`` (whether the
        parameters changed on this call: false while a MultiSteps accumulates, and for
        a call whose batch counts no items — all padding — which leaves the parameters
        and the optimiser as they were; its ``loss`` and ``grad_norm`` are NaN).

    Example:
        >>> import jax, jax.numpy as jnp, optax, jaxga
        >>> def loss(params, batch, model_state, rng):
        ...     return jaxga.Mean.of((batch["x"] @ params - batch["y"]) ** 2), model_state
        >>> state = jaxga.TrainState.create(params=jnp.zeros(3), tx=optax.sgd(0.1))
        >>> step = jaxga.make_train_step(loss, num_microbatches=4)
        >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.ones(8)}
        >>> state, metrics = step(state, batch)
        >>> float(metrics["loss"]), int(metrics["count"]), int(state.step)
        (1.0, 8, 1)
    """
    if callable(getattr(num_microbatches, "update", None)):
        raise TypeError(
            "make_train_step takes no optimiser: it runs the state's own (`state.tx`, as "
            "in Flax's TrainState); build the step as make_train_step(loss, "
            "num_microbatches) and the state with jaxga.TrainState.create(params, tx)."
        )
    _checks.positive_int(num_microbatches, "num_microbatches")
    signature = "`loss(params, batch, model_state, rng) -> (loss, new_model_state)`"
    _checks.check_arity(loss, "loss", 4, signature)
    if mesh is not None:
        sharding._check_mesh(mesh, kinds=(Mesh,))  # a concrete one: it places arrays
        sharding._check_mesh_axis(mesh, axis_name)
    sharding._check_strategy(strategy)
    if mesh is None and not (isinstance(strategy, str) and strategy == "data_parallel"):
        raise ValueError(f"`strategy`={strategy!r} shards the state over a mesh: pass `mesh`.")
    if not isinstance(donate, bool):
        raise TypeError(f"`donate` must be a bool; got {donate!r}.")
    accumulate_with = functools.partial(
        accumulate,
        num_microbatches=num_microbatches,
        batch_argnums=1,
        state_argnums=2,
        rng_argnums=3,
        axis_name=axis_name if mesh is not None else None,
        accumulator_dtype=accumulator_dtype,
    )
    checked = _checked_loss(loss)
    grad_fn = accumulate_with(checked)

    def step(state: Any, batch: Any) -> tuple[Any, Metrics]:
        _check_state(state)
        rng = _get_rng(state)
        model_state = _get_model_state(state)
        if mesh is None:
            acc = grad_fn(state.params, batch, model_state, rng)
            params_view, place = state.params, lambda tree, _: tree
        else:
            _check_mesh_batch(batch, mesh, axis_name, num_microbatches)
            specs = sharding.state_specs(state, mesh, strategy, axis_name=axis_name)
            place = functools.partial(_place, mesh)
            state = place(state, specs)
            grad_specs = _grad_specs(state.params, specs.params, strategy, mesh, axis_name)
            acc = _accumulate_on_mesh(
                accumulate_with,
                checked,
                isinstance(strategy, str) and strategy == "zero3",
                mesh,
                axis_name,
                specs.params,
                grad_specs,
                state.params,
                place(batch, jax.tree.map(lambda _: P(axis_name), batch)),
                model_state,
                rng,
            )
            # zero1: the optimiser runs on its shards of the (replicated) parameters
            params_view = place(state.params, grad_specs)

        def update(params_and_opt_state, grads):
            params, opt_state = params_and_opt_state
            updates, opt_state = state.tx.update(
                grads, opt_state, params_view, **_weight_of(state.tx, acc)
            )
            if mesh is not None:
                updates = place(updates, specs.params)
            return optax.apply_updates(params, updates), opt_state

        params, opt_state = _update_if_counted(
            acc, state.opt_state, update, (state.params, state.opt_state), donated=donate
        )
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        new_state = _set_model_state(new_state, acc.state)
        if mesh is not None:
            new_state = place(new_state, specs)
        return new_state, _metrics(acc, state.opt_state, opt_state)

    # on a GPU: no zero-filled scan buffers (jaxga.compiler)
    jitted = jax.jit(
        step, donate_argnums=(0,) if donate else (), compiler_options=compiler_options()
    )
    return _as_step(step, jitted, _state_placer(mesh, strategy, axis_name), donate)


def _check_mesh_batch(batch: Any, mesh: Mesh, axis_name: str, num_microbatches: int) -> None:
    """Names a batch the devices × micro-batches do not divide, before it is placed."""
    size = _checks.leading_size(batch, "batch", "batch")
    if size is None:
        raise ValueError(f"`batch` has no array leaves to split over the devices; got {batch!r}.")
    devices = mesh.shape[axis_name]
    if size % (devices * num_microbatches):
        raise sharding.indivisible_error(size, devices, num_microbatches, axis_name)


def _place(mesh: Mesh, tree: Any, specs: Any) -> Any:
    """``tree`` with the sharding of ``specs``, in its type too on a mesh of explicit axes."""
    explicit = AxisType.Explicit in mesh.axis_types

    def put(x, spec):
        if x is None:
            return x
        sharding_ = NamedSharding(mesh, spec)
        if explicit:
            return jax.reshard(x, sharding_)
        return jax.lax.with_sharding_constraint(x, sharding_)

    return jax.tree.map(put, tree, specs, is_leaf=lambda x: x is None)


def _sharded_dim(spec: P) -> int | None:
    return next((i for i, entry in enumerate(spec) if entry is not None), None)


def _grad_specs(params: Any, param_specs: Any, strategy: Any, mesh: Mesh, axis_name: str) -> Any:
    """How the gradient leaves the micro-batch loop: reduce-scattered to the shards of the
    state it updates (the parameters' under FSDP, the optimiser state's under ZeRO-1)."""
    if strategy == "zero1":
        return sharding.fsdp_specs(params, mesh, axis_name)
    return param_specs


def _accumulate_on_mesh(
    accumulate_with: Callable[..., Callable[..., Accumulated]],
    loss: Callable[..., Any],
    per_microbatch: bool,
    mesh: Mesh,
    axis_name: str,
    param_specs: Any,
    grad_specs: Any,
    params: Any,
    batch: Any,
    model_state: Any,
    rng: Any,
) -> Accumulated:
    """The micro-batch loop on every device, with the state's shards gathered for it.

    By default sharded parameters are all-gathered once, before the loop; a gradient
    that stays replicated is all-reduced by :func:`jaxga.accumulate`, one whose state is
    sharded is kept local through the loop and reduce-scattered into its shard after it.
    With ``per_microbatch`` the loss gathers the parameters itself, so each micro-batch
    gathers them and reduce-scatters its gradient (JAX's transpose of the gather), and
    the accumulator holds only this device's shard.
    """
    is_spec = lambda x: isinstance(x, P)

    def gather(x, spec):
        dim = _sharded_dim(spec)
        return x if dim is None else jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)

    def scatter(g, spec):
        dim = _sharded_dim(spec)
        if dim is None:
            return g
        return jax.lax.psum_scatter(g, axis_name, scatter_dimension=dim, tiled=True)

    def gathered(tree):
        return jax.tree.map(gather, tree, param_specs, is_leaf=is_spec)

    def local(params, batch, model_state, rng):
        if per_microbatch:

            def loss_on_shards(shards, batch, *rest):
                # tied to the micro-batch, so that XLA does not hoist the gather out of
                # the loop (and keep the whole parameters through it)
                shards, batch = jax.lax.optimization_barrier((shards, batch))
                return loss(gathered(shards), batch, *rest)

            return accumulate_with(loss_on_shards)(params, batch, model_state, rng)
        # local sums through the loop for the gradients that are reduce-scattered
        full = jax.tree.map(
            lambda x, spec: x if _sharded_dim(spec) is None else sharding.varying(x, axis_name),
            gathered(params),
            grad_specs,
            is_leaf=is_spec,
        )
        acc = accumulate_with(loss)(full, batch, model_state, rng)
        return acc._replace(grads=jax.tree.map(scatter, acc.grads, grad_specs, is_leaf=is_spec))

    out_specs = Accumulated(mean=P(), grads=grad_specs, aux=P(), state=P())
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(param_specs, P(axis_name), P(), P()),
        out_specs=out_specs,
    )(params, batch, model_state, rng)


def nnx_train_step(
    loss: Callable[..., Any],
    num_microbatches: int = 1,
    *,
    accumulator_dtype: Any = None,
    donate: bool = True,
) -> Callable[[Any, Any, Any], Metrics]:
    """Builds one compiled train step ``(model, optimizer, batch) -> metrics`` for Flax NNX.

    The Flax NNX counterpart of :func:`make_train_step`: ``loss(model, batch)`` runs
    on each micro-batch through :func:`jaxga.accumulate`, so the model's
    ``nnx.Param``s are differentiated and every other ``nnx.Variable`` (BatchNorm
    statistics, ``nnx.Rngs`` counters for Dropout) is threaded through the
    micro-batches and written back, as if they had run one after another. Then
    ``optimizer.update(model, grads, weight=count)`` (``optimizer.update(grads, ...)``
    for an ``nnx.ModelAndOptimizer``, called with the model it holds) updates the model
    in place: a
    :class:`jaxga.MultiSteps` optimiser weighs each call by its item count, so
    accumulation across calls is exact too; other transformations ignore ``weight``.

    Args:
        loss: ``loss(model, batch) -> loss``, a :class:`jaxga.Mean` or a scalar mean
            over its micro-batch.
        num_microbatches: micro-batches per call.
        accumulator_dtype: dtype of the gradient sums; ``None`` (default) is at least
            float32.
        donate: donate the buffers of the model's and the optimiser's state to the step
            (the model and optimiser get the new ones): one copy of them in memory, not
            two. Arrays taken out of the model before the call are deleted by it, and so
            are those of an ``nnx.clone`` of it, which shares them: snapshot with
            ``jax.tree.map(jnp.copy, nnx.state(model))``, or pass ``donate=False``
            (which also costs a copy of the parameters, kept for a call whose batch
            counts no items).

    Returns:
        The step; it updates ``model`` and ``optimizer`` in place and returns the
        metrics of :func:`make_train_step`. It is ``jax.jit``-compiled over
        ``nnx.split((model, optimizer))``, with :func:`jaxga.compiler_options`; its
        ``lower`` and ``trace`` take the step's arguments, so
        ``jaxga.memory_report(step, model, optimizer, batch)`` sizes it without running.

    Example:
        >>> import jax.numpy as jnp, optax, jaxga
        >>> from flax import nnx
        >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> loss = lambda m, b: jaxga.Mean.of((m(b["x"])[:, 0] - b["y"]) ** 2)
        >>> step = jaxga.nnx_train_step(loss, num_microbatches=4)
        >>> metrics = step(model, optimizer, {"x": jnp.ones((8, 3)), "y": jnp.ones(8)})
        >>> int(metrics["count"]), int(optimizer.step[...])
        (8, 1)
    """
    _checks.positive_int(num_microbatches, "num_microbatches")
    _checks.check_arity(loss, "loss", 2, "`loss(model, batch) -> loss`")

    @functools.wraps(loss)
    def checked(model, batch):
        value = loss(model, batch)
        _check_no_aux(value, "`loss(model, batch)`")
        return value

    grad_fn = accumulate(
        checked, num_microbatches=num_microbatches, accumulator_dtype=accumulator_dtype
    )

    def pure(graphdef: Any, state: Any, batch: Any) -> tuple[Any, Metrics]:
        model, optimizer = nnx.merge(graphdef, state)
        acc = grad_fn(model, batch)
        _check_wrt(optimizer, model, acc.grads)

        def update(state, grads):
            model, optimizer = nnx.merge(graphdef, state)
            if isinstance(optimizer, nnx.ModelAndOptimizer):  # which holds the model
                optimizer.update(grads, **_weight_of(optimizer.tx, acc))
            else:
                optimizer.update(model, grads, **_weight_of(optimizer.tx, acc))
            return nnx.state((model, optimizer))

        opt_state = nnx.as_pure(optimizer.opt_state)
        state = _update_if_counted(
            acc, opt_state, update, nnx.state((model, optimizer)), donated=donate
        )
        new_opt_state = nnx.as_pure(nnx.merge(graphdef, state)[1].opt_state)
        return state, _metrics(acc, opt_state, new_opt_state)

    # jax.jit of the split objects rather than nnx.jit: it takes XLA's options
    if not isinstance(donate, bool):
        raise TypeError(f"`donate` must be a bool; got {donate!r}.")
    jitted = jax.jit(
        pure,
        static_argnums=0,
        donate_argnums=(1,) if donate else (),
        compiler_options=compiler_options(),
    )

    def split(model: Any, optimizer: Any) -> tuple[Any, Any]:
        if not isinstance(optimizer, nnx.Optimizer):
            _check_wrt(optimizer, model, None)
        graphdef, state = nnx.split((model, optimizer))
        return graphdef, _unaliased(state) if donate else state

    def step(model: Any, optimizer: Any, batch: Any) -> Metrics:
        graphdef, state = split(model, optimizer)
        state, metrics = (pure if _traced(state) else jitted)(graphdef, state, batch)
        nnx.update((model, optimizer), state)
        return metrics

    # for jaxga.memory_report and jaxga.plan: the compiled program of these arguments
    step.lower = lambda model, optimizer, batch: jitted.lower(*split(model, optimizer), batch)
    step.trace = lambda model, optimizer, batch: jitted.trace(*split(model, optimizer), batch)
    return step
