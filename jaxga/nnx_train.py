"""`jaxga.nnx_train_step`: a jitted train step of a Flax NNX model and optimizer, in place."""

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxga import (
    _checks,
    _host_stacks,
    arguments,
    layouts,
    modules,
    planner,
    sharding,
    skeleton,
    steps,
)
from jaxga.accumulation import Accumulate
from jaxga.steps import check_on_device


def nnx_loss(graphdef: Any, loss: Callable[..., Any]) -> Callable[..., Any]:
    """Turns `loss(model, batch, rng)` on a split Flax NNX model into `make_train_step`'s.

    Args:
        graphdef: the model's `GraphDef`, from `nnx.split(model, nnx.Param, ...)`.
        loss: `loss(model, batch, rng) -> loss`.

    Returns:
        `loss(params, batch, model_state, rng) -> (loss, new_model_state)`.

    Examples:
        >>> import jax.numpy as jnp, jaxga, flax.nnx as nnx
        >>> graphdef, params, rest = nnx.split(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), nnx.Param, ...)
        >>> fn = jaxga.nnx_loss(graphdef, lambda m, x, rng: jnp.mean(m(x) ** 2))
        >>> fn(params, jnp.ones((4, 2)), rest, None)[0].shape
        ()
    """
    if not isinstance(graphdef, nnx.graphlib.GraphDef):
        raise TypeError(f"`graphdef` must be an nnx GraphDef; got {type(graphdef).__name__}.")
    _checks.check_arity(loss, "loss", 3, "`loss(model, batch, rng)`")

    def functional(params, batch, model_state, rng):
        part = modules.Part(None, graphdef, params, model_state)
        split = "`graphdef, params, rest = nnx.split(model, nnx.Param, ...)`"
        fix = f"pass `model_state=rest`, from {split}, to jaxga.TrainState.create"
        try:
            model = modules.put_together(part, params, model_state)
        except ValueError as e:
            got = f"`params` and `model_state` ({e})"
            raise ValueError(f"`nnx_loss` cannot rebuild the model from {got}: {fix}.") from None
        if not isinstance(model_state, nnx.State):  # the new one is: a split's rest, maybe empty
            got = f"{model_state!r:.40} of type {type(model_state).__name__}"
            raise TypeError(
                f"`model_state` must be the split's rest, an nnx.State; got {got}: {fix}."
            )
        return loss(model, batch, rng), modules.new_rest(model, part, nnx.Param)

    return functional


class NNXTrainStep(steps.JittedStep):
    """`step(model, optimizer, batch, num_real_microbatches=None, *, rngs, end_group) -> metrics`.

    It trains `optimizer.wrt` of `model` in place. `rngs`: an `nnx.Rngs` (its streams
    advance in every micro-batch, and are folded with the device on a mesh) or a PRNG key
    (`fold_in(key, g)` in global micro-batch `g`), handed to the loss as its third argument.
    `num_real_microbatches`, `end_group` and `step.plan`: as for a
    [`jaxga.TrainStep`][jaxga.TrainStep]. `optimizer.step` counts the updates that ran, not
    the calls (a call counting no items, unweighed, leaves it), as `nnx.Optimizer` does;
    a `jaxga.TrainStep`'s `state.step` counts calls.

    Examples:
        >>> import jaxga
        >>> isinstance(jaxga.nnx_train_step(lambda m, x: m(x).mean(), 2), jaxga.NNXTrainStep)
        True
    """

    _arity, _static_argnums = 3, (0,)  # the graphdef of the model, optimizer (and rngs)

    def _arguments(
        self,
        model: Any,
        optimizer: Any,
        batch: Any,
        num_real_microbatches: Any = None,
        *,
        rngs: Any = None,
        end_group: Any = None,
    ) -> tuple[Any, ...]:
        _check_model(model, optimizer)
        if not (rngs is None or isinstance(rngs, nnx.Rngs) or arguments.is_key(rngs)):
            got = type(rngs).__name__
            raise TypeError(f"`rngs` must be an nnx.Rngs, a PRNG key or None; got {got}.")
        _check_takes_rngs(self._loss, rngs)
        graphdef, state = nnx.split((model, optimizer, *_streams(rngs)))
        self._once((graphdef, state), _check_variables, model, optimizer, self.options)
        layout = self.options.layout
        if layout is not None:  # where the model put it; on the mesh, replicated, if nowhere
            state = sharding.onto(state, layout.mesh)
        keys = () if rngs is None or isinstance(rngs, nnx.Rngs) else (rngs,)  # Rngs: in state
        return self._laid_out(
            (graphdef,), state, batch, num_real_microbatches, end_group=end_group, extra=keys
        )

    def _fetched(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """With ``stream="auto"``, the model's variables in host memory fetched to the device:
        in place for a call's model, on a copy of a plan's shapes."""
        if self.options.stream != "auto" or not modules.is_graph_node(args[0]):
            return args
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(args)):
            args = planner.abstract(args)  # a copy: the plan's own shapes stay as they are
        nnx.update(args[0], _host_stacks.on_device(nnx.state(args[0])))
        return args

    def __call__(
        self,
        model: Any,
        optimizer: Any,
        batch: Any,
        num_real_microbatches: Any = None,
        *,
        rngs: Any = None,
        end_group: Any = None,
    ) -> steps.Metrics:
        if self.options.num_microbatches == "auto" and rngs is not None:
            raise ValueError('`rngs` needs a fixed num_microbatches; "auto" plans without them.')
        args = (model, optimizer, batch, num_real_microbatches)
        state, metrics = self._run(args, {"rngs": rngs, "end_group": end_group})
        nnx.update((model, optimizer, *_streams(rngs)), state)
        return metrics


def _streams(rngs: Any) -> list[Any]:
    """The graph nodes ``rngs`` adds to the step's state: an `nnx.Rngs`, else none."""
    return [rngs] if isinstance(rngs, nnx.Rngs) else []


def _check_model(model: Any, optimizer: Any) -> None:
    if not isinstance(optimizer, nnx.Optimizer):
        got = type(optimizer).__name__
        raise TypeError(f"`optimizer` must be an nnx.Optimizer; got {got}.")
    if not modules.is_graph_node(model):
        got = type(model).__name__
        raise TypeError(f"`model` must be the NNX module `optimizer` updates; got {got}.")
    if isinstance(optimizer, nnx.ModelAndOptimizer) and optimizer.model is not model:
        raise ValueError("`optimizer` is a ModelAndOptimizer of another model: use its .model.")


def _check_takes_rngs(loss: Callable[..., Any], rngs: Any) -> None:
    """Raises unless ``loss`` takes what the step hands it: ``rngs`` third, if given."""
    try:
        inspect.signature(loss).bind(*range(2 if rngs is None else 3))
    except ValueError:  # no signature (some builtins): the call will tell
        return
    except TypeError:
        if rngs is None:
            got = "takes (model, batch, rngs), but the step got no `rngs=`"
            fix = "call it with `rngs=` (an nnx.Rngs or a PRNG key)"
        else:
            got = "takes (model, batch), but the step got `rngs=`"
            fix = "take it (`loss(model, batch, rngs)`) or call the step without `rngs=`"
        handed = "which it hands the loss as its third argument"
        raise TypeError(f"`loss` {got}, {handed}: {fix}.") from None


def _check_wrt(model: Any, optimizer: Any) -> None:
    """Raises unless ``optimizer.wrt`` selects floats."""
    for path, leaf in jax.tree.leaves_with_path(nnx.as_pure(nnx.state(model, optimizer.wrt))):
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            got = f"model{jax.tree_util.keystr(path)} of dtype {leaf.dtype}"
            raise ValueError(f"`optimizer.wrt` must select floats; got {got}.")


def _check_variables(model: Any, optimizer: Any, options: steps.StepOptions) -> None:
    """Raises unless `_check_wrt`, ``offload=True`` finds an optimiser state to offload,
    ``model``'s variables lie on the device but where ``options.stream`` takes them in host
    memory (or ``offload`` picks), and the optimiser's state on the device unless
    ``offload``."""
    _check_wrt(model, optimizer)
    if options.offload is True and not jax.tree.leaves(nnx.state(optimizer.opt_state)):
        got = "an `optimizer` whose tx keeps no state (as optax.sgd)"
        raise ValueError(
            f"`offload`=True has nothing to offload: got {got}; expected offload=False."
        )
    variables = nnx.as_pure(nnx.state(model))  # every one taken as a parameter
    check_on_device(
        variables, name="model", params=None, offload=options.offload, stream=options.stream
    )
    opt_state = nnx.as_pure(nnx.state(optimizer.opt_state))  # as a Flax step checks its own
    name = "optimizer.opt_state"  # params="": no leaf of it a parameter
    check_on_device(opt_state, name=name, params="", offload=options.offload)


def _nnx_step(loss: Callable[..., Any], options: steps.StepOptions) -> Callable[..., Any]:
    def train_step(
        graphdef: Any, state: Any, batch: Any, num_real: Any, end_group: Any, *keys: Any
    ) -> tuple[Any, steps.Metrics]:  # keys: `rngs` given as a PRNG key, or none
        kind = _NNX(loss, options, graphdef, num_real, keys[0] if keys else None)
        return skeleton.train_step(kind, options, state, batch, end_group)

    return train_step


class _NNX(NamedTuple):
    """How `skeleton.train_step` takes a Flax NNX model, optimizer (and `nnx.Rngs`) apart and
    puts them back: their state, split outside the trace, merged in it."""

    loss: Callable[..., Any]
    options: steps.StepOptions
    graphdef: Any
    num_real: Any
    key: Any  # `rngs` given as a PRNG key, or None

    def specs(self, state: Any, layout: layouts.MeshLayout) -> Any:
        """As the metadata, or the strategy, says; the rest as it is."""
        mesh, axis_name = layout.mesh, layout.axis_name
        return sharding.nnx_state_specs(state, mesh, layout.strategy, axis_name=axis_name)

    def accumulate(self, state: Any, batch: Any, specs: Any) -> tuple[Any, Any]:
        model, optimizer, *streams = nnx.merge(self.graphdef, state)  # streams: an nnx.Rngs
        rngs = streams or ([] if self.key is None else [self.key])
        accumulated = steps.accumulator(  # the gradient of what the optimizer updates alone
            self.loss,
            self.options,
            nnx.DiffState(0, optimizer.wrt),
            num_real=self.num_real,
            called_as="`loss(model, batch)`",
            rng_argnums=None if self.key is None else 2,  # a key, typed or raw: folded
        )
        if (layout := self.options.layout) is None:
            acc = accumulated(model, batch, *rngs)
        else:  # the model as laid out; the engine told where the optimizer's part lies
            acc = _on_mesh(accumulated, layout, model, optimizer.wrt, batch, *rngs)
        return acc, nnx.state((model, optimizer, *streams))

    def optimizer(self, state: Any) -> skeleton.OptimizerAccess:
        """``optimizer.tx``, its update, and the pure parameters (``optimizer.wrt``) and
        optimiser state in ``state``."""
        tx, parts = nnx.merge(self.graphdef, state)[1].tx, (self.opt_state, self.params)
        return skeleton.OptimizerAccess(
            tx, self.updated, *parts, self.rebuild, static=self.graphdef
        )

    def updated(self, state: Any, grads: Any, **extra: Any) -> Any:
        """``nnx.Optimizer.update`` on ``state``: the model and optimizer put together."""
        model, optimizer, *streams = nnx.merge(self.graphdef, state, copy=True)
        held = isinstance(optimizer, nnx.ModelAndOptimizer)
        optimizer.update(*(() if held else (model,)), grads, **extra)
        return nnx.state((model, optimizer, *streams))

    def opt_state(self, state: Any) -> Any:
        """The pure optimiser state in ``state``."""
        _, optimizer, *_ = nnx.merge(self.graphdef, state)
        return nnx.as_pure(optimizer.opt_state)

    def params(self, state: Any) -> Any:
        """The pure parameters the optimizer updates (``optimizer.wrt``) in ``state``."""
        model, optimizer, *_ = nnx.merge(self.graphdef, state)
        return nnx.as_pure(nnx.state(model, optimizer.wrt))

    def rebuild(self, state: Any, params: Any, opt_state: Any) -> Any:
        """``state`` with these pure ``params`` and ``opt_state``, as ``optimizer.update``
        writes them."""
        model, optimizer, *streams = nnx.merge(self.graphdef, state, copy=True)
        nnx.update(model, params)
        nnx.update(optimizer.opt_state, nnx.state(opt_state))
        return nnx.state((model, optimizer, *streams))

    def put_back(self, given: Any, new: Any, acc: Any) -> Any:
        return new  # the step's state: the model, optimizer (and streams), updated


def _on_mesh(accumulated: Accumulate, layout: layouts.MeshLayout, model: Any, wrt: Any, *args):
    """``accumulated(model, *args)`` (`layouts.on_mesh`), told where the parameters it
    differentiates (``wrt`` of ``model``) lie: as the strategy says, the gradients as the
    optimiser state; without one, where they are (their types, their metadata)."""
    mesh, axis_name, strategy = layout.mesh, layout.axis_name, layout.strategy
    every = sharding.nnx_state_specs(nnx.state(model), mesh, axis_name=axis_name)
    specs = grads = None
    if strategy is not None:
        params = nnx.state(model, wrt)
        specs = (sharding.nnx_state_specs(params, mesh, strategy, axis_name=axis_name),)
        grads = (sharding.nnx_state_specs(params, mesh, strategy, axis_name=axis_name, grads=True),)
    return layouts.on_mesh(
        accumulated,
        layout,
        model,
        *args,
        param_specs=every,
        primal_specs=specs,
        grad_specs=grads,
        fix=_STAGES_FIX,
    )


_STAGES_FIX = (
    "name '{}' in the stacked layers' variables' sharding metadata (nnx.vmap's "
    "transform_metadata names it only on variables that already carry some: create them "
    "with nnx.with_partitioning(init, (None, ...)), e.g. nnx.Linear(kernel_init=...))"
)


def nnx_train_step(
    loss: Callable[..., Any],
    num_microbatches: int | str = 1,
    *,
    has_aux: bool = False,
    aux: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    axis_name: str | None = None,
    strategy: str | None = None,
    memory_budget: int | str | None = None,
    accumulator_dtype: Any = None,
    donate: bool = True,
    offload: bool | Callable[[Any, Any], bool] = False,
    reduce_once: bool = True,
    unroll: int | bool = 1,
    canonical_convolutions: bool | str = "auto",
    compiler_options: Mapping[str, Any] | None = None,
    weight: bool | None = None,
    learning_rate: Callable[[Any], Any] | None = None,
    pipeline_axis: str | None = None,
    stream: bool | str = False,
) -> NNXTrainStep:
    """Builds an NNX step `(model, optimizer, batch) -> metrics` training `optimizer.wrt` in place.

    The other keyword arguments are [`jaxga.make_train_step`][jaxga.make_train_step]'s.

    Args:
        loss: `loss(model, batch) -> loss`, a [`jaxga.Mean`][jaxga.Mean] or a scalar mean;
            `loss(model, batch, rngs)` for a step called with `rngs=`.
        num_microbatches: micro-batches per step, or `"auto"`, as for `make_train_step`.
        has_aux: whether the loss returns `(loss, aux)`, given back as `metrics["aux"]`.
        aux: how each aux leaf combines (`"rows"` for per-example outputs), as for
            [`jaxga.accumulate`][jaxga.accumulate]; `None`: a `Mean` summed, others stacked.
        mesh: split the batch over this mesh's `axis_name`; the model stays where its
            variables' sharding metadata put it (replicated where it says nothing), and the
            gradient is reduced once per step.
        axis_name: the batch's mesh axis (or axes); `None`: `"data"`; without a `mesh`, a
            one-device mesh of it (as for `make_train_step`).
        strategy: the state's layout on `mesh`: `None`, as the variables' sharding metadata
            says; or `"data_parallel"`, `"zero1"`, `"fsdp"`, `"zero3"` for the variables whose
            metadata names no axis (as for `make_train_step`; docs/distributed.md).
        reduce_once: `False` runs the loop in jit's global view of `mesh` (for a model that
            names `axis_name` in its own sharding annotations): exact; JAX reduces each time.
        weight: pass the call's item count to `optimizer.update(..., weight=)`; `None`: when
            `optimizer.tx` is or holds a `jaxga.MultiSteps` (as for `make_train_step`).
        learning_rate: `metrics["learning_rate"]`, a function of the (pure) optimiser state.
        pipeline_axis: the `mesh` axis of a pipeline's stages (`jaxga.pipeline_loss`): manual
            in the loop beside `axis_name`, so that each stage's variables, split over it by
            their sharding metadata, never move (as for `make_train_step`; docs/pipeline.md).
        stream: take the model's variables that live in pinned host memory (an `nnx.vmap`
            stack's parameters moved there, `nnx.update(model.blocks, jax.device_put(
            nnx.state(model.blocks, nnx.Param), host))`, after `nnx.Optimizer` made its
            state) and keep them there: the loss gets them as they lie, to
            fetch layer by layer with [`jaxga.remat_scan(stream=True)`][jaxga.remat_scan];
            their gradient sums live in host memory too; the optimiser's update fetches the
            parameters and gradients whole and writes the parameters back (any `tx`).
            `"layers"`: the update too runs a layer at a time, each layer's parameters,
            gradient and optimiser-state slices (moments, with `offload=True` in host
            memory) fetched, updated and written back: your statement that `optimizer.tx`
            is elementwise (sgd, adam, adamw, lion, schedules, `jaxga.MultiSteps` of them);
            a probe at trace time refuses the usual exceptions (`clip_by_global_norm`,
            LAMB), not every one. `True`: bit for bit the resident step; `"layers"`: to
            float rounding (another program). On a `mesh`, data parallel (the stacks
            replicated), as `make_train_step`'s (docs/streaming.md). `"auto"` (with
            `num_microbatches="auto"`, without a `mesh`): resident if any k fits (the
            variables in host memory fetched to the device, and kept there), else `True`,
            else `"layers"`, as `make_train_step`'s.

    Returns:
        A [`jaxga.NNXTrainStep`][jaxga.NNXTrainStep]; its `metrics`: `loss`, `count`,
        `grad_norm`, `learning_rate` (NaN without `inject_hyperparams`), `applied`, and with
        `has_aux`, `aux`.

    Examples:
        >>> import jax.numpy as jnp, optax, jaxga, flax.nnx as nnx
        >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> step = jaxga.nnx_train_step(lambda m, x: jaxga.Mean.of(m(x) ** 2), num_microbatches=4)
        >>> int(step(model, optimizer, jnp.ones((8, 3)))["count"])
        8
    """
    try:
        _checks.check_arity(loss, "loss", 2, "`loss(model, batch)` or `loss(model, batch, rngs)`")
    except TypeError:
        _checks.check_arity(loss, "loss", 3, "`loss(model, batch)` or `loss(model, batch, rngs)`")
    options = steps.step_options(
        num_microbatches,
        mesh=mesh,
        axis_name=axis_name,
        strategy=sharding.check_nnx_strategy(strategy),
        reduce_once=reduce_once,
        pipeline_axis=pipeline_axis,
        has_aux=has_aux,
        aux=aux,
        memory_budget=memory_budget,
        accumulator_dtype=accumulator_dtype,
        donate=donate,
        offload=offload,
        unroll=unroll,
        canonical_convolutions=canonical_convolutions,
        compiler_options=compiler_options,
        weight=weight,
        learning_rate=learning_rate,
        stream=stream,
    )
    return NNXTrainStep(_nnx_step, loss, options)
