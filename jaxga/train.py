"""Jitted train steps: micro-batches, exact accumulation, the optimiser, donation and metrics."""

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.training import train_state

from jaxga import _checks, modules, sharding
from jaxga.accumulation import accumulate
from jaxga.arguments import StateStructureError, check_unroll
from jaxga.compiler import compiler_options
from jaxga.engine import Accumulated
from jaxga.loss import Mean
from jaxga.multistep import MultiStepsState
from jaxga.state import StateFields, check_field_names, state_fields, unaliased

Metrics = dict[str, jax.Array]
_SPLIT = "`graphdef, params, rest = nnx.split(model, nnx.Param, ...)`"


def nnx_loss(graphdef: Any, loss: Callable[..., Any]) -> Callable[..., Any]:
    """Turns `loss(model, batch, rng)` on a split Flax NNX model into `make_train_step`'s.

    Examples:
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

    def is_kind(x: Any) -> bool:
        return isinstance(x, kind)

    return next((x for x in jax.tree.leaves(tree, is_leaf=is_kind) if is_kind(x)), None)


_HINT = "was it built for these parameters (`nnx.Optimizer(model, tx)`, `TrainState.create`)?"


def _check_update_shapes(update: Callable[[Any, Any], Any], state: Any, grads: Any) -> Any:
    """The shapes ``update(state, grads)`` gives, checked to be ``state``'s."""
    try:
        shapes = jax.eval_shape(update, state, grads)
    except (TypeError, ValueError) as e:
        raise ValueError(f"The optimiser's update fails on these parameters: {_HINT} ({e})") from e
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    for (path, before), after in zip(paths, jax.tree.leaves(shapes), strict=True):
        if jnp.shape(before) != after.shape:
            raise ValueError(
                f"The optimiser's update changes the shape of {jax.tree_util.keystr(path)} "
                f"from {jnp.shape(before)} to {after.shape}: {_HINT}"
            )
    return shapes


def _apply(acc: Accumulated, update: Callable[[Any, Any], Any], state: Any) -> Any:
    """``update(state, grads)``; with no items counted, ``state`` (a MultiSteps: zero grads)."""
    counted = acc.mean.count > 0
    shapes = _check_update_shapes(update, state, acc.grads)
    if _find(state, MultiStepsState) is not None:  # it counts the call: give it zeros
        zero = jax.lax.optimization_barrier(jnp.zeros((), jnp.float32))  # not a constant
        return update(state, jax.tree.map(lambda g: jnp.where(counted, g, zero), acc.grads))
    dtypes = [x.dtype for x in jax.tree.leaves(shapes)]

    # leaf by leaf: nnx.Optimizer may rebuild a subtree with other node types
    def updated(state):
        return jax.tree.leaves(update(state, acc.grads))

    def kept(state):
        return [x.astype(d) for x, d in zip(jax.tree.leaves(state), dtypes)]

    leaves = jax.lax.cond(counted, updated, kept, state)
    return jax.tree.unflatten(jax.tree.structure(shapes), leaves)


def _learning_rate(opt_state: Any) -> jax.Array:
    """``optax.inject_hyperparams``' learning rate if there is one, else NaN."""
    rates = optax.tree_utils.tree_get_all_with_path(opt_state, "learning_rate")
    found = [v for path, v in rates if any(getattr(k, "name", None) == "hyperparams" for k in path)]
    return jnp.asarray(found[0] if len(found) == 1 else jnp.nan, jnp.float32)


def _metrics(acc: Accumulated, old_opt_state: Any, opt_state: Any) -> Metrics:
    applied = acc.mean.count > 0
    if (ours := _find(opt_state, MultiStepsState)) is not None:
        applied = ours.applied
    elif (theirs := _find(opt_state, optax.MultiStepsState)) is not None:
        applied = theirs.gradient_step > _find(old_opt_state, optax.MultiStepsState).gradient_step
    return {
        "loss": acc.mean.value,
        "count": acc.mean.count,
        "grad_norm": optax.tree.norm(acc.grads),
        "learning_rate": _learning_rate(opt_state),
        "applied": applied,
    }


def _weight(tx: Any, acc: Accumulated) -> dict[str, jax.Array]:
    """``weight=`` the call's item count, for an optimiser that may hold a MultiSteps."""
    takes_extra_args = isinstance(tx, optax.GradientTransformationExtraArgs)
    return {"weight": acc.mean.count} if takes_extra_args else {}


def _loss_alone(loss: Callable[..., Any], signature: str, *, pair: bool) -> Callable[..., Any]:
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
        value = out[0] if pair else out
        if isinstance(value, tuple | list):
            raise TypeError(
                f"{signature} must give the loss alone (a float scalar or a jaxga.Mean); got a "
                f"{type(value).__name__} of length {len(value)}: the step returns no aux."
            )
        return out  # the engine checks the new model state (state_argnums)

    return checked


def _traced(tree: Any) -> bool:
    """Whether an enclosing transformation traces ``tree`` (a TrainState's step is its first)."""
    return isinstance(next(iter(jax.tree.leaves(tree)), None), jax.core.Tracer)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What a train step was built with, checked (`step.options`).

    Attributes:
        num_microbatches: micro-batches per step.
        accumulator_dtype: the gradient sums' dtype; `None`: at least float32.
        donate: whether the step donates the state's buffers.
        offload: whether the optimiser state lives in pinned host memory between steps.
        unroll: the micro-batch loop's `lax.scan` `unroll`.
        compiler_options: the XLA options the step compiles with.
        layout: the mesh, batch axis and state layout (`make_train_step` with a `mesh`).
        model_state_fields: the train state's model-state field(s); `None`: found.
        rng_field: the train state's key field; `None`: found.

    Examples:
        >>> import jaxga
        >>> def loss(params, batch, model_state, rng):
        ...     return (batch * params).mean(), model_state
        >>> jaxga.make_train_step(loss, 4).options.num_microbatches
        4
    """

    num_microbatches: int
    accumulator_dtype: Any
    donate: bool
    offload: bool
    unroll: int | bool
    compiler_options: Mapping[str, Any]
    layout: sharding.MeshLayout | None = None
    model_state_fields: str | tuple[str, ...] | None = None
    rng_field: str | None = None


def _step_options(num_microbatches: Any, **options: Any) -> StepOptions:
    """The options every train step takes, checked now rather than at the first call."""
    xla = options.pop("compiler_options")
    if xla is None:
        xla = compiler_options()
    elif not isinstance(xla, Mapping):
        raise TypeError(
            f"`compiler_options` must be a dict of XLA options or None (jaxga's); got {xla!r}."
        )
    return StepOptions(
        num_microbatches=_checks.positive_int(num_microbatches, "num_microbatches"),
        accumulator_dtype=_checks.float_dtype(options.pop("accumulator_dtype")),
        donate=_checks.check_bool(options.pop("donate"), "donate"),
        offload=_checks.check_bool(options.pop("offload"), "offload"),
        unroll=check_unroll(options.pop("unroll")),
        compiler_options=dict(xla),
        **options,
    )


class _JittedStep:
    """A pure step jitted with its options; ``lower`` and ``trace`` see what ``__call__`` runs."""

    def __init__(self, update: Callable[..., Any], options: StepOptions, *, static_argnums=()):
        self.options = options
        self._update = update
        donated = (len(static_argnums),) if options.donate else ()
        self._jitted = jax.jit(
            update,
            static_argnums=static_argnums,
            donate_argnums=donated,
            compiler_options=options.compiler_options,
        )

    def _arguments(self, *args: Any) -> tuple[Any, ...]:
        raise NotImplementedError

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """Lowers the step for these arguments, laid out as a call lays them out."""
        return self._jitted.lower(*self._arguments(*args))

    def trace(self, *args: Any) -> jax.stages.Traced:
        """Traces the step for these arguments, laid out as a call lays them out."""
        return self._jitted.trace(*self._arguments(*args))


class TrainStep(_JittedStep):
    """`step(state, batch) -> (state, metrics)`: what `jaxga.make_train_step` builds.

    Attributes:
        options: the `StepOptions` it was built with.

    Examples:
        >>> import jax.numpy as jnp, optax, jaxga
        >>> def loss(params, batch, model_state, rng):
        ...     return jnp.mean((batch * params) ** 2), model_state
        >>> step = jaxga.make_train_step(loss, 2)
        >>> state = jaxga.TrainState.create(params=jnp.ones(3), tx=optax.sgd(0.1))
        >>> step.lower(state, jnp.ones((4, 3))).compile().memory_analysis() is not None
        True
    """

    def _arguments(self, state: Any, batch: Any) -> tuple[Any, Any]:
        _check_state(state)
        if not self.options.offload:
            sharding.check_on_device(state)
        state = sharding.lay_out(state, self.options.layout, offload_state=self.options.offload)
        return state, batch

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Metrics]:
        if _traced(state):  # inside a jit: inlined, compiled with the enclosing one's options
            return self._update(state, batch)
        if isinstance(leaf := getattr(state, "step", None), jax.Array) and leaf.is_deleted():
            raise ValueError(
                "The train step was given a state that an earlier call deleted: it donates its "
                "buffers (donate=True), so pass the state it returned (or use donate=False)."
            )
        state, batch = self._arguments(state, batch)
        return self._jitted(unaliased(state) if self.options.donate else state, batch)


def _check_state(state: Any) -> None:
    if not isinstance(state, train_state.TrainState):
        nnx_model = modules.is_graph_node(state) or isinstance(state, nnx.State)
        hint = "; for a Flax NNX model use jaxga.nnx_train_step" if nnx_model else ""
        raise TypeError(
            "`state` must be a flax.training.train_state.TrainState (jaxga.TrainState is one); "
            f"got {type(state).__name__}{hint}."
        )


def _check_mesh_options(mesh: Any, axis_name: Any, strategy: Any) -> None:
    sharding.check_strategy(strategy)
    if mesh is not None:
        sharding.check_mesh(mesh, axis_name, concrete=True)
    elif not (isinstance(strategy, str) and strategy == "data_parallel"):
        raise ValueError(f"`strategy`={strategy!r} shards the state over a mesh: pass `mesh`.")


@contextlib.contextmanager
def _explained(fields: StateFields, state: Any, rng: Any) -> Iterator[None]:
    """Adds to an error of the loss what the step read from ``state`` (and what it guessed)."""
    try:
        yield
    except StateStructureError as e:
        e.add_note(f"jaxga: {fields.describe(state)}.")
        raise
    except TypeError as e:
        if rng is None:
            e.add_note(f"jaxga: the loss was given rng=None, as {fields.describe(state)}.")
        raise


def _accumulate_state(loss, options: StepOptions, state: Any, batch: Any) -> sharding.OnMesh:
    """The loop over ``batch``'s micro-batches for a train state: on one device or a mesh."""
    layout = options.layout

    def accumulated(fn: Callable[..., Any]) -> Callable[..., Accumulated]:
        return accumulate(
            fn,
            num_microbatches=options.num_microbatches,
            batch_argnums=1,
            state_argnums=2,
            rng_argnums=3,
            axis_name=None if layout is None else layout.axis_name,
            accumulator_dtype=options.accumulator_dtype,
            unroll=options.unroll,
        )

    fields = state_fields(state, options.model_state_fields, options.rng_field)
    model_state, rng = fields.read(state), fields.step_key(state)
    with _explained(fields, state, rng):
        if layout is not None:
            return sharding.accumulate_on_mesh(
                loss, layout, state, batch, accumulate=accumulated, model_state=model_state, rng=rng
            )
        acc = accumulated(loss)(state.params, batch, model_state, rng)
        return sharding.OnMesh(accumulated=acc, state=state, specs=None, params=state.params)


def _state_update(loss: Callable[..., Any], options: StepOptions) -> Callable[..., Any]:
    """The pure step of a train state: ``(state, batch) -> (state, metrics)``."""
    checked = _loss_alone(loss, "`loss(params, batch, model_state, rng)`", pair=True)

    def train_step(state: Any, batch: Any) -> tuple[Any, Metrics]:
        _check_state(state)
        if options.offload:
            state = sharding.offload(state, "device")
        looped = _accumulate_state(checked, options, state, batch)
        acc, state = looped.accumulated, looped.state

        def apply_tx(params_and_opt_state, grads):
            params, opt_state = params_and_opt_state
            weight = _weight(state.tx, acc)
            updates, opt_state = state.tx.update(grads, opt_state, looped.params, **weight)
            if options.layout is not None:
                updates = sharding.place(options.layout.mesh, updates, looped.specs.params)
            return optax.apply_updates(params, updates), opt_state

        params, opt_state = _apply(acc, apply_tx, (state.params, state.opt_state))
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        fields = state_fields(state, options.model_state_fields, options.rng_field)
        new = fields.write(new, acc.state)
        if options.layout is not None:
            new = sharding.place(options.layout.mesh, new, looped.specs)
        if options.offload:
            new = sharding.offload(new)
        return new, _metrics(acc, state.opt_state, opt_state)

    return train_step


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
    unroll: int | bool = 1,
    compiler_options: Mapping[str, Any] | None = None,
    model_state_fields: str | Sequence[str] | None = None,
    rng_field: str | None = None,
) -> TrainStep:
    """Builds one jitted train step `(state, batch) -> (state, metrics)`.

    It accumulates over micro-batches ([`jaxga.accumulate`][jaxga.accumulate]), then runs
    `state.tx` (`weight=` the item count). `state`: a [`jaxga.TrainState`][jaxga.TrainState],
    or a Flax `TrainState` subclass with dict fields (`batch_stats`) and a key field.

    Args:
        loss: `loss(params, batch, model_state, rng) -> (loss, new_model_state)`, the
            loss a [`jaxga.Mean`][jaxga.Mean] or a scalar mean over its micro-batch.
        num_microbatches: micro-batches per step (on each device, with a `mesh`).
        mesh: shard the batch over this mesh's `axis_name`; gradients are reduced once.
        axis_name: the mesh axis the batch is split over.
        strategy: the state's layout on the mesh: `"data_parallel"`, `"zero1"`, `"fsdp"`,
            `"zero3"` or a tree of specs
            ([`jaxga.sharding.state_specs`][jaxga.sharding.state_specs]).
        accumulator_dtype: dtype of the gradient sums; `None`: at least float32.
        donate: donate the state's buffers to the step.
        offload: keep the optimiser state (a MultiSteps' inner one) in pinned host memory
            between steps ([`jaxga.sharding.offload`][jaxga.sharding.offload]), on the
            device only for the update.
        unroll: the micro-batch loop's `lax.scan` `unroll`; `1` keeps one micro-batch's
            activations at a time, `True` trades that memory for speed.
        compiler_options: XLA options the step compiles with; `None`:
            [`jaxga.compiler_options()`][jaxga.compiler_options] (an option on GPUs, `{}`
            elsewhere); `{}`: none.
        model_state_fields: the field(s) of `state` holding the model state; `None`:
            `model_state` for a `jaxga.TrainState`, else the dict fields a subclass adds.
        rng_field: the field of `state` holding the PRNG key; `None`: `rng` for a
            `jaxga.TrainState`, else a field named `rng` or `key` or holding a typed key.

    Returns:
        A [`jaxga.TrainStep`][jaxga.TrainStep]; `metrics`: `loss`, `count`, `grad_norm`,
        `learning_rate` (NaN without `optax.inject_hyperparams`), `applied`.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, jaxga
        >>> def loss(params, batch, model_state, rng):
        ...     return jaxga.Mean.of((batch["x"] @ params - batch["y"]) ** 2), model_state
        >>> state = jaxga.TrainState.create(params=jnp.zeros(3), tx=optax.sgd(0.1))
        >>> step = jaxga.make_train_step(loss, num_microbatches=4)
        >>> state, metrics = step(state, {"x": jnp.ones((8, 3)), "y": jnp.ones(8)})
        >>> float(metrics["loss"]), int(metrics["count"]), int(state.step)
        (1.0, 8, 1)
    """
    if callable(getattr(num_microbatches, "update", None)):
        raise TypeError(
            f"make_train_step takes no optimiser: it runs `state.tx` (TrainState.create(params, "
            f"tx)); got `num_microbatches`={num_microbatches!r}."
        )
    _checks.check_arity(loss, "loss", 4, "`loss(params, batch, model_state, rng)`")
    _check_mesh_options(mesh, axis_name, strategy)
    fields, key = check_field_names(model_state_fields, rng_field)
    options = _step_options(
        num_microbatches,
        accumulator_dtype=accumulator_dtype,
        donate=donate,
        offload=offload,
        unroll=unroll,
        compiler_options=compiler_options,
        layout=None if mesh is None else sharding.MeshLayout(mesh, axis_name, strategy),
        model_state_fields=fields,
        rng_field=key,
    )
    return TrainStep(_state_update(loss, options), options)


def _check_optimizer(optimizer: Any, model: Any) -> None:
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
    trained = nnx.as_pure(nnx.state(model, optimizer.wrt))
    for path, leaf in jax.tree_util.tree_flatten_with_path(trained)[0]:
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            raise ValueError(
                f"`optimizer` was built with wrt={optimizer.wrt!r}, which selects "
                f"model{jax.tree_util.keystr(path)} of dtype {leaf.dtype}: the step trains what "
                f"the optimizer updates, so `wrt` must select float parameters (nnx.Param, "
                f"nnx.LoRAParam...)."
            )


def _nnx_update(loss: Callable[..., Any], options: StepOptions) -> Callable[..., Any]:
    """The pure step of an NNX model: ``(graphdef, state, batch) -> (state, metrics)``."""
    checked = _loss_alone(loss, "`loss(model, batch)`", pair=False)

    def train_step(graphdef: Any, state: Any, batch: Any) -> tuple[Any, Metrics]:
        if options.offload:
            state = sharding.offload(state, "device")
        model, optimizer = nnx.merge(graphdef, state)
        grad_fn = accumulate(  # the gradient of what the optimizer updates, and only that
            checked,
            nnx.DiffState(0, optimizer.wrt),
            num_microbatches=options.num_microbatches,
            accumulator_dtype=options.accumulator_dtype,
            unroll=options.unroll,
        )
        acc = grad_fn(model, batch)

        def apply_tx(state, grads):
            model, optimizer = nnx.merge(graphdef, state)
            held = isinstance(optimizer, nnx.ModelAndOptimizer)
            optimizer.update(*(() if held else (model,)), grads, **_weight(optimizer.tx, acc))
            return nnx.state((model, optimizer))

        old_opt_state = nnx.as_pure(optimizer.opt_state)
        state = _apply(acc, apply_tx, nnx.state((model, optimizer)))
        _, new_optimizer = nnx.merge(graphdef, state)
        metrics = _metrics(acc, old_opt_state, nnx.as_pure(new_optimizer.opt_state))
        return (sharding.offload(state) if options.offload else state), metrics

    return train_step


class NNXTrainStep(_JittedStep):
    """`step(model, optimizer, batch) -> metrics`: what `jaxga.nnx_train_step` builds.

    Attributes:
        options: the `StepOptions` it was built with.

    Examples:
        >>> import jax.numpy as jnp, optax, jaxga
        >>> from flax import nnx
        >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> step = jaxga.nnx_train_step(lambda m, x: jnp.mean(m(x) ** 2), 2, donate=False)
        >>> step.trace(model, optimizer, jnp.ones((4, 3))).jaxpr is not None
        True
    """

    def __init__(self, update: Callable[..., Any], options: StepOptions):
        super().__init__(update, options, static_argnums=(0,))

    def _arguments(self, model: Any, optimizer: Any, batch: Any) -> tuple[Any, Any, Any]:
        _check_optimizer(optimizer, model)
        graphdef, state = nnx.split((model, optimizer))
        state = sharding.lay_out(state, None, offload_state=self.options.offload)
        return graphdef, state, batch

    def __call__(self, model: Any, optimizer: Any, batch: Any) -> Metrics:
        graphdef, state, batch = self._arguments(model, optimizer, batch)
        if _traced(state):  # inside a jit: inlined, compiled with the enclosing one's options
            state, metrics = self._update(graphdef, state, batch)
        else:
            state = unaliased(state) if self.options.donate else state
            state, metrics = self._jitted(graphdef, state, batch)
        nnx.update((model, optimizer), state)
        return metrics


def nnx_train_step(
    loss: Callable[..., Any],
    num_microbatches: int = 1,
    *,
    accumulator_dtype: Any = None,
    donate: bool = True,
    offload: bool = False,
    unroll: int | bool = 1,
    compiler_options: Mapping[str, Any] | None = None,
) -> NNXTrainStep:
    """Builds a Flax NNX train step `(model, optimizer, batch) -> metrics`, updating in place.

    It trains what the optimizer updates: the gradient is taken of the model's state that
    `optimizer.wrt` selects (`nnx.Param`, or `nnx.LoRAParam` for LoRA...) and of nothing else.

    Args:
        loss: `loss(model, batch) -> loss`, a [`jaxga.Mean`][jaxga.Mean] or a scalar mean.
        num_microbatches: micro-batches per step.
        accumulator_dtype: as for [`jaxga.make_train_step`][jaxga.make_train_step].
        donate: as for [`jaxga.make_train_step`][jaxga.make_train_step].
        offload: as for [`jaxga.make_train_step`][jaxga.make_train_step].
        unroll: as for [`jaxga.make_train_step`][jaxga.make_train_step].
        compiler_options: as for [`jaxga.make_train_step`][jaxga.make_train_step].

    Returns:
        A [`jaxga.NNXTrainStep`][jaxga.NNXTrainStep]; its metrics as `make_train_step`'s.

    Examples:
        >>> import jax.numpy as jnp, optax, jaxga
        >>> from flax import nnx
        >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> def loss(model, batch):
        ...     return jaxga.Mean.of((model(batch["x"])[:, 0] - batch["y"]) ** 2)
        >>> step = jaxga.nnx_train_step(loss, num_microbatches=4)
        >>> metrics = step(model, optimizer, {"x": jnp.ones((8, 3)), "y": jnp.ones(8)})
        >>> int(metrics["count"]), int(optimizer.step[...])
        (8, 1)
    """
    _checks.check_arity(loss, "loss", 2, "`loss(model, batch) -> loss`")
    options = _step_options(
        num_microbatches,
        accumulator_dtype=accumulator_dtype,
        donate=donate,
        offload=offload,
        unroll=unroll,
        compiler_options=compiler_options,
    )
    return NNXTrainStep(_nnx_update(loss, options), options)
