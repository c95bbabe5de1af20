"""Jitted train steps: micro-batches, exact accumulation, the optimiser, donation and metrics."""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.training import train_state

from jaxga import _checks, modules, sharding
from jaxga.accumulation import Accumulated, accumulate
from jaxga.compiler import compiler_options
from jaxga.loss import Mean
from jaxga.multistep import MultiStepsState
from jaxga.state import model_io, unaliased

Metrics = dict[str, jax.Array]
_SPLIT = "`graphdef, params, rest = nnx.split(model, nnx.Param, ...)`"


def nnx_loss(graphdef: Any, loss: Callable[..., Any]) -> Callable[..., Any]:
    """Turns ``loss(model, batch, rng)`` on a split Flax NNX model into :func:`make_train_step`'s.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> from flax import nnx
        >>> graphdef, params, rest = nnx.split(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), nnx.Param, ...)
        >>> fn = jaxga.nnx_loss(graphdef, lambda m, x, rng: jnp.mean(m(x) ** 2))
        >>> fn(params, jnp.ones((4, 2)), rest, None)[0].shape
        ()
    """
    if not isinstance(graphdef, nnx.graphlib.GraphDef):
        got = type(graphdef).__name__
        raise TypeError(f"`graphdef` must be the GraphDef of {_SPLIT}; got {got}.")
    _checks.check_arity(loss, "loss", 3, "`loss(model, batch, rng)`")

    def functional(params, batch, model_state, rng):
        part = modules.Part(None, graphdef, params, model_state)
        try:
            model = modules.put_together(part, params, model_state)
        except ValueError as e:
            raise ValueError(
                f"`nnx_loss` could not rebuild the model from `params` and `model_state`: split "
                f"it as {_SPLIT} and pass `model_state=rest` ({e})."
            ) from None
        return loss(model, batch, rng), modules.new_rest(model, part, nnx.Param)

    return functional


def _find(tree: Any, kind: type) -> Any:
    """The first ``kind`` node in ``tree`` (a MultiSteps state in an optimiser's), or ``None``."""
    is_kind = lambda x: isinstance(x, kind)
    return next((x for x in jax.tree.leaves(tree, is_leaf=is_kind) if is_kind(x)), None)


def _update(acc: Accumulated, update: Callable[[Any, Any], Any], state: Any) -> Any:
    """``update(state, grads)``; with no items counted ``state`` (a MultiSteps: zero grads)."""
    counted = acc.mean.count > 0
    hint = "was it built for these parameters (`nnx.Optimizer(model, tx)`, `TrainState.create`)?"
    try:
        shapes = jax.eval_shape(update, state, acc.grads)
    except (TypeError, ValueError) as e:
        if "memory_space" in str(e):  # a state offloaded by another step
            hint = "its state is in host memory: pass offload=True, or move it to the device"
        raise ValueError(f"The optimiser's update fails on these parameters: {hint} ({e})") from e
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    for (path, before), after in zip(paths, jax.tree.leaves(shapes), strict=True):
        if jnp.shape(before) != after.shape:
            raise ValueError(
                f"The optimiser's update changes the shape of {jax.tree_util.keystr(path)} "
                f"from {jnp.shape(before)} to {after.shape}: {hint}"
            )
    if _find(state, MultiStepsState) is not None:
        zero = jax.lax.optimization_barrier(jnp.zeros((), jnp.float32))  # not a constant
        return update(state, jax.tree.map(lambda g: jnp.where(counted, g, zero), acc.grads))
    # leaf by leaf: nnx.Optimizer may rebuild a subtree with other node types
    dtypes = [x.dtype for x in jax.tree.leaves(shapes)]
    leaves = jax.lax.cond(
        counted,
        lambda state: jax.tree.leaves(update(state, acc.grads)),
        lambda state: [x.astype(d) for x, d in zip(jax.tree.leaves(state), dtypes)],
        state,
    )
    return jax.tree.unflatten(jax.tree.structure(shapes), leaves)


def _metrics(acc: Accumulated, old_opt_state: Any, opt_state: Any) -> Metrics:
    rates = optax.tree_utils.tree_get_all_with_path(opt_state, "learning_rate")
    found = [v for path, v in rates if any(getattr(k, "name", None) == "hyperparams" for k in path)]
    applied = acc.mean.count > 0
    if (ours := _find(opt_state, MultiStepsState)) is not None:
        applied = ours.applied
    elif (theirs := _find(opt_state, optax.MultiStepsState)) is not None:
        applied = theirs.gradient_step > _find(old_opt_state, optax.MultiStepsState).gradient_step
    return {
        "loss": acc.mean.value,
        "count": acc.mean.count,
        "grad_norm": optax.tree.norm(acc.grads),
        "learning_rate": jnp.asarray(found[0] if len(found) == 1 else jnp.nan, jnp.float32),
        "applied": applied,
    }


def _weight(tx: Any, acc: Accumulated) -> dict[str, jax.Array]:
    """``weight=`` the call's item count, for a MultiSteps in ``tx``."""
    weighted = isinstance(tx, optax.GradientTransformationExtraArgs)
    return {"weight": acc.mean.count} if weighted else {}


def _loss_alone(loss: Callable[..., Any], signature: str, pair: bool) -> Callable[..., Any]:
    """``loss`` checked to give the loss alone (``pair``: with a new model state)."""

    @functools.wraps(loss)
    def checked(*args):
        out = loss(*args)
        if pair and (isinstance(out, Mean) or not (isinstance(out, tuple) and len(out) == 2)):
            got = type(out).__name__ if isinstance(out, Mean | tuple) else None
            raise TypeError(
                f"{signature} must return a pair (loss, new_model_state), `model_state` if "
                f"unchanged; got {got or f'an array of shape {jnp.shape(out)}'}."
            )
        if isinstance(value := out[0] if pair else out, tuple | list):
            raise TypeError(
                f"{signature} must give the loss alone (a float scalar or a jaxga.Mean); got a "
                f"{type(value).__name__} of length {len(value)}: the step returns no aux."
            )
        return out  # the engine checks the new model state (state_argnums)

    return checked


def _traced(tree: Any) -> bool:
    """Whether an enclosing transformation traces ``tree`` (a TrainState's step is its first)."""
    return isinstance(next(iter(jax.tree.leaves(tree)), None), jax.core.Tracer)


def _as_step(fn: Callable, place: Callable[[Any], Any], donate: bool) -> Callable:
    """``fn`` jitted, on the placed state, naming a donated one; inlined under a ``jit``."""
    jitted = jax.jit(fn, donate_argnums=0 if donate else (), compiler_options=compiler_options())

    @functools.wraps(jitted)
    def step(state: Any, batch: Any) -> Any:
        if _traced(state):
            return fn(state, batch)
        if isinstance(leaf := getattr(state, "step", None), jax.Array) and leaf.is_deleted():
            raise ValueError(
                "The train step was given a state that an earlier call deleted: it donates its "
                "buffers (donate=True), so pass the state it returned (or use donate=False)."
            )
        state = place(state)
        return jitted(unaliased(state) if donate else state, batch)

    step.lower = lambda state, batch: jitted.lower(place(state), batch)
    step.trace = lambda state, batch: jitted.trace(place(state), batch)
    return step


def _offloaded(fn: Callable, offload: bool) -> Callable:
    """``fn(..., state, batch) -> (state, metrics)`` with its optimiser state in host memory."""
    if not offload:
        return fn

    def step(*args: Any) -> tuple[Any, Metrics]:
        *static, state, batch = args
        new, metrics = fn(*static, sharding.offload(state, "device"), batch)
        return sharding.offload(new), metrics

    return functools.wraps(fn)(step)


def _check_state(state: Any) -> None:
    if not isinstance(state, train_state.TrainState):
        nnx_model = modules.is_graph_node(state) or isinstance(state, nnx.State)
        hint = "; for a Flax NNX model use jaxga.nnx_train_step" if nnx_model else ""
        raise TypeError(
            "`state` must be a flax.training.train_state.TrainState (jaxga.TrainState is one); "
            f"got {type(state).__name__}{hint}."
        )


def _check_step_options(loss, num_microbatches, mesh, axis_name, strategy, donate, offload):
    if callable(getattr(num_microbatches, "update", None)):
        raise TypeError(
            f"make_train_step takes no optimiser: it runs `state.tx` (TrainState.create(params, "
            f"tx)); got `num_microbatches`={num_microbatches!r}."
        )
    _checks.positive_int(num_microbatches, "num_microbatches")
    _checks.check_arity(loss, "loss", 4, "`loss(params, batch, model_state, rng)`")
    sharding.check_strategy(strategy)
    if mesh is not None:
        sharding.check_mesh(mesh, axis_name, concrete=True)
    elif not (isinstance(strategy, str) and strategy == "data_parallel"):
        raise ValueError(f"`strategy`={strategy!r} shards the state over a mesh: pass `mesh`.")
    _checks.check_bool(donate, "donate")
    _checks.check_bool(offload, "offload")


def make_train_step(
    loss: Callable[..., Any],
    num_microbatches: int = 1,
    *,
    mesh: jax.sharding.Mesh | None = None,
    axis_name: str = "data",
    strategy: Any = "data_parallel",
    accumulator_dtype: Any = None,
    donate: bool = True,
    offload: bool = False,
) -> Callable[[Any, Any], tuple[Any, Metrics]]:
    """Builds one jitted train step ``(state, batch) -> (state, metrics)``.

    It accumulates over micro-batches (:func:`jaxga.accumulate`), then runs ``state.tx``
    (``weight=`` the item count). ``state``: a :class:`TrainState`, or a Flax ``TrainState``
    subclass with dict fields (``batch_stats``) and an ``rng`` or ``key`` field.

    Args:
        loss: ``loss(params, batch, model_state, rng) -> (loss, new_model_state)``, the
            loss a :class:`jaxga.Mean` or a scalar mean over its micro-batch.
        mesh, axis_name: shard the batch over this mesh axis; gradients are reduced once.
        strategy: the state's layout on the mesh: ``"data_parallel"``, ``"zero1"``,
            ``"fsdp"``, ``"zero3"`` or a tree of specs (:func:`jaxga.sharding.state_specs`).
        accumulator_dtype: dtype of the gradient sums; ``None``: at least float32.
        donate: donate the state's buffers to the step.
        offload: keep the optimiser state (a MultiSteps' inner one) in pinned host memory
            between steps (:func:`jaxga.sharding.offload`), on the device only for the update.

    Returns:
        The step; ``metrics``: ``loss``, ``count``, ``grad_norm``, ``learning_rate`` (NaN
        without ``optax.inject_hyperparams``), ``applied``.

    Example:
        >>> import jax, jax.numpy as jnp, optax, jaxga
        >>> def loss(params, batch, model_state, rng):
        ...     return jaxga.Mean.of((batch["x"] @ params - batch["y"]) ** 2), model_state
        >>> state = jaxga.TrainState.create(params=jnp.zeros(3), tx=optax.sgd(0.1))
        >>> step = jaxga.make_train_step(loss, num_microbatches=4)
        >>> state, metrics = step(state, {"x": jnp.ones((8, 3)), "y": jnp.ones(8)})
        >>> float(metrics["loss"]), int(metrics["count"]), int(state.step)
        (1.0, 8, 1)
    """
    _check_step_options(loss, num_microbatches, mesh, axis_name, strategy, donate, offload)
    dtype = _checks.float_dtype(accumulator_dtype)  # checked now, not at the first call
    options = dict(num_microbatches=num_microbatches, accumulator_dtype=dtype)
    axis = axis_name if mesh is not None else None  # the batch's shard_map axis
    accumulated = functools.partial(
        accumulate, batch_argnums=1, state_argnums=2, rng_argnums=3, axis_name=axis, **options
    )
    checked = _loss_alone(loss, "`loss(params, batch, model_state, rng)`", pair=True)

    def step(state: Any, batch: Any) -> tuple[Any, Metrics]:
        _check_state(state)
        model_state, rng, set_model_state = model_io(state)
        if mesh is None:
            acc = accumulated(checked)(state.params, batch, model_state, rng)
            specs, view = None, state.params
        else:
            args = (state, batch, model_state, rng)
            on = (accumulated, checked, mesh, axis_name, strategy, num_microbatches)
            acc, state, specs, view = sharding.accumulate_on_mesh(*on, *args)

        def update(params_and_opt_state, grads):
            params, opt_state = params_and_opt_state
            updates, opt_state = state.tx.update(grads, opt_state, view, **_weight(state.tx, acc))
            updates = updates if mesh is None else sharding.place(mesh, updates, specs.params)
            return optax.apply_updates(params, updates), opt_state

        params, opt_state = _update(acc, update, (state.params, state.opt_state))
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        new = set_model_state(new, acc.state)
        new = new if mesh is None else sharding.place(mesh, new, specs)
        return new, _metrics(acc, state.opt_state, opt_state)

    place = sharding.placer(mesh, strategy, axis_name, offload)
    return _as_step(_offloaded(step, offload), place, donate)


def _check_optimizer(optimizer: Any, model: Any, grads: Any) -> None:
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(f"`optimizer` must be an nnx.Optimizer; got {type(optimizer).__name__}.")
    if not modules.is_graph_node(model):
        got = type(model).__name__
        raise TypeError(f"`model` must be the NNX module `optimizer` updates; got {got}.")
    if isinstance(optimizer, nnx.ModelAndOptimizer) and optimizer.model is not model:
        raise ValueError(
            "`optimizer` is an nnx.ModelAndOptimizer of another model than `model`: call "
            "`step(optimizer.model, optimizer, batch)`."
        )
    expected = jax.tree.structure(nnx.as_pure(nnx.state(model, optimizer.wrt)))
    if grads is not None and jax.tree.structure(nnx.as_pure(grads)) != expected:
        raise ValueError(
            f"`optimizer` was built with wrt={optimizer.wrt!r}, but the step differentiates "
            f"nnx.Param: build it as nnx.Optimizer(model, tx, wrt=nnx.Param)."
        )


def _nnx_step(grad_fn: Callable, graphdef: Any, state: Any, batch: Any) -> tuple[Any, Metrics]:
    model, optimizer = nnx.merge(graphdef, state)
    acc = grad_fn(model, batch)
    _check_optimizer(optimizer, model, acc.grads)

    def update(state, grads):
        model, optimizer = nnx.merge(graphdef, state)
        model_arg = () if isinstance(optimizer, nnx.ModelAndOptimizer) else (model,)  # or held
        optimizer.update(*model_arg, grads, **_weight(optimizer.tx, acc))
        return nnx.state((model, optimizer))

    opt_state = nnx.as_pure(optimizer.opt_state)
    state = _update(acc, update, nnx.state((model, optimizer)))
    return state, _metrics(acc, opt_state, nnx.as_pure(nnx.merge(graphdef, state)[1].opt_state))


def nnx_train_step(
    loss: Callable[..., Any],
    num_microbatches: int = 1,
    *,
    accumulator_dtype: Any = None,
    donate: bool = True,
    offload: bool = False,
) -> Callable[[Any, Any, Any], Metrics]:
    """Builds a Flax NNX train step ``(model, optimizer, batch) -> metrics``, updating in place.

    Args:
        loss: ``loss(model, batch) -> loss``, a :class:`jaxga.Mean` or a scalar mean.
        num_microbatches, accumulator_dtype, donate, offload: as for :func:`make_train_step`.

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
    _checks.check_arity(loss, "loss", 2, "`loss(model, batch) -> loss`")
    _checks.check_bool(donate, "donate")
    _checks.check_bool(offload, "offload")
    options = dict(num_microbatches=num_microbatches, accumulator_dtype=accumulator_dtype)
    grad_fn = accumulate(_loss_alone(loss, "`loss(model, batch)`", pair=False), **options)
    pure = _offloaded(functools.partial(_nnx_step, grad_fn), offload)
    donated, xla = 1 if donate else (), compiler_options()
    jitted = jax.jit(pure, static_argnums=0, donate_argnums=donated, compiler_options=xla)

    def split(model: Any, optimizer: Any) -> tuple[Any, Any]:
        _check_optimizer(optimizer, model, None)
        graphdef, state = nnx.split((model, optimizer))
        state = sharding.placer(None, "data_parallel", None, offload)(state)
        return graphdef, unaliased(state) if donate else state

    def step(model: Any, optimizer: Any, batch: Any) -> Metrics:
        graphdef, state = split(model, optimizer)
        state, metrics = (pure if _traced(state) else jitted)(graphdef, state, batch)
        nnx.update((model, optimizer), state)
        return metrics

    step.lower = lambda model, optimizer, batch: jitted.lower(*split(model, optimizer), batch)
    step.trace = lambda model, optimizer, batch: jitted.trace(*split(model, optimizer), batch)
    return step
