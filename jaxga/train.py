"""`jaxga.make_train_step`: a jitted train step of a Flax `TrainState`, on one device or a mesh."""

import functools
import inspect
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from flax.training import train_state

from jaxga import (
    _checks,
    _host_stacks,
    layouts,
    meshes,
    modules,
    planner,
    sharding,
    skeleton,
    steps,
)
from jaxga.accumulation import Accumulate
from jaxga.arguments import StateStructureError, is_inexact, shape_and_dtype
from jaxga.engine import Accumulated
from jaxga.layouts import MeshLayout
from jaxga.state import TrainState, check_field_names, state_fields
from jaxga.steps import Metrics, StepOptions


class TrainStep(steps.JittedStep):
    """`step(state, batch, num_real_microbatches=None, *, end_group=None) -> (state, metrics)`.

    `num_real_microbatches`: as for [`jaxga.accumulate`][jaxga.accumulate]; one compiled
    step for every count. `end_group`: a bool (may be traced) for `state.tx.update`, through
    `state.apply_gradients` (`jaxga.MultiSteps` ends its group early). With `"auto"`,
    `step.plan` is the last call's.

    `state.step` counts the step's calls, a call counting no items too (the key the loss gets
    is folded with it); `nnx_train_step`'s `optimizer.step` counts updates instead.

    Examples:
        >>> import jax.numpy as jnp, optax, jaxga
        >>> def loss(params, batch, model_state, rng):
        ...     return jnp.mean((batch * params) ** 2), model_state
        >>> step = jaxga.make_train_step(loss, 2)
        >>> state = jaxga.TrainState.create(params=jnp.ones(3), tx=optax.sgd(0.1))
        >>> step.lower(state, jnp.ones((4, 3))).compile().memory_analysis() is not None
        True
    """

    _arity, _static_argnums = 2, (0,)  # with strategy=None, the state's specs (`_as_laid_out`)

    def _arguments(
        self, state: Any, batch: Any, num_real_microbatches: Any = None, *, end_group: Any = None
    ) -> tuple[Any, ...]:
        layout = self.options.layout
        self._once(state, _check_state, state, self.options.offload, self.options.stream)
        if steps.is_traced(state):  # inside a jit: inlined, with the enclosing jit's options
            _warn_unread(layout)
            self._check_batch(batch)
            return None, state, batch, num_real_microbatches, steps.check_end_group(end_group)
        static = (self._as_laid_out(state, layout),)
        return self._laid_out(
            static, state, batch, num_real_microbatches, end_group=end_group, layout=layout
        )

    def _as_laid_out(self, state: Any, layout: MeshLayout | None) -> tuple[Any, ...] | None:
        """With ``strategy=None`` on a mesh, the `PartitionSpec` of each of ``state``'s leaves
        as `sharding.state_specs` reads them from the (concrete) arrays, each spelt one way
        (`meshes.canonical_spec`): a traced array's type does not say how Auto axes split it.
        Kept by the state's structure and shardings. `None` otherwise: the step works the
        specs out from the strategy."""
        if layout is None or layout.strategy is not None:
            return None
        leaves, treedef = jax.tree.flatten(state)
        key = (treedef, *(getattr(x, "sharding", None) for x in leaves))
        try:
            return self._specs[key]
        except TypeError:  # a static field that cannot be hashed: worked out for this call
            key = None
        except KeyError:
            pass
        specs = sharding.state_specs(state, layout.mesh, None, axis_name=layout.axis_name)
        specs = tuple(map(meshes.canonical_spec, jax.tree.leaves(specs, is_leaf=meshes.is_spec)))
        if key is not None:
            if len(self._specs) >= self.max_plans:  # the oldest layout's dropped
                del self._specs[next(iter(self._specs))]
            self._specs[key] = specs
        return specs

    def _keyed(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not (self.options.offload and isinstance(args[0], train_state.TrainState)):
            return args
        return (
            planner.abstract((sharding.offload(args[0], select=self.options.offload),))[0],
            *args[1:],
        )

    def _fetched(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if self.options.stream != "auto" or not isinstance(args[0], train_state.TrainState):
            return args
        return (args[0].replace(params=_host_stacks.on_device(args[0].params)), *args[1:])

    def __call__(
        self, state: Any, batch: Any, num_real_microbatches: Any = None, *, end_group: Any = None
    ) -> tuple[Any, Metrics]:
        params = jax.tree.leaves(getattr(state, "params", None))
        first = (getattr(state, "step", None), *params[:1])  # a Flax state's step: maybe an int
        if any(
            isinstance(x, jax.Array) and not steps.is_traced(x) and x.is_deleted() for x in first
        ):
            raise ValueError("`state` holds arrays an earlier call deleted: it donates them.")
        return self._run((state, batch, num_real_microbatches), {"end_group": end_group})


def _warn_unread(layout: MeshLayout | None) -> None:
    """Warns where ``strategy=None`` meets a traced state on a mesh with Auto axes: the
    types say nothing of their split, so the step lays the state out replicated there."""
    if layout is None or layout.strategy is not None:
        return
    explicit, sizes = meshes.explicit_axes(layout.mesh), layout.mesh.shape
    if auto := [a for a in layout.mesh.axis_names if a not in explicit and sizes[a] > 1]:
        _checks.warn_at_caller(
            f"strategy=None inside an enclosing jax.jit cannot read how the mesh's Auto axes "
            f"{auto} split the state (its types do not say): the step lays it out replicated. "
            "Call the step outside jit, or give `strategy` specs."
        )


def _check_type(state: Any) -> None:
    """Raises unless ``state`` is a Flax TrainState."""
    if not isinstance(state, train_state.TrainState):
        nnx_model = modules.is_graph_node(state) or isinstance(state, nnx.State)
        hint = "; for a Flax NNX model use jaxga.nnx_train_step" if nnx_model else ""
        got = f"{type(state).__name__}{hint}"
        raise TypeError(f"`state` must be a flax.training.train_state.TrainState; got {got}.")


def _check_state(state: Any, offload: Any, stream: bool | str) -> None:
    """Raises unless ``state`` is a Flax TrainState of float parameters, on the device but
    where ``offload`` and ``stream`` keep leaves in host memory (`steps.check_on_device`)."""
    _check_type(state)
    for path, x in jax.tree_util.tree_flatten_with_path(state.params)[0]:
        if not is_inexact(x):
            got = f"`state.params`{jax.tree_util.keystr(path)} has {shape_and_dtype(x)}"
            fix = "expected floats (what the model does not differentiate: model_state)"
            raise TypeError(f"{got}; the step differentiates every parameter: {fix}.")
    if offload or stream:  # some leaves may live in host memory
        steps.check_on_device(state, offload=offload, stream=stream)
    else:
        steps.check_on_device(state)


class _Flax(NamedTuple):
    """How `skeleton.train_step` takes a Flax TrainState apart and puts it back."""

    loss: Callable[..., Any]
    options: StepOptions
    num_real: Any
    laid_out: tuple[Any, ...] | None = None  # `_as_laid_out`'s specs, leaf by leaf

    def specs(self, state: Any, layout: MeshLayout) -> Any:
        if self.laid_out is not None:
            return jax.tree.unflatten(jax.tree.structure(state), self.laid_out)
        return sharding.state_specs(state, layout.mesh, layout.strategy, axis_name=layout.axis_name)

    def accumulate(self, state: Any, batch: Any, specs: Any) -> tuple[Accumulated, Any]:
        """The loss accumulated over ``batch``, and ``state`` as the optimiser sees it."""
        options = self.options
        fields = state_fields(state, options.model_state_fields, options.rng_field)
        roles = {"batch_argnums": 1, "state_argnums": 2, "rng_argnums": 3}
        called_as = "`loss(params, batch, model_state, rng)`"
        accumulated = steps.accumulator(
            self.loss, options, 0, num_real=self.num_real, called_as=called_as, **roles
        )
        rng = fields.step_key(state)
        try:  # the errors a train state's fields explain get a note
            if options.layout is None:
                acc, updated = accumulated(state.params, batch, fields.read(state), rng), state
            else:
                args = (batch, fields.read(state), rng)
                acc, updated = _on_mesh(accumulated, options.layout, state, specs, *args)
        except TypeError as e:
            if isinstance(e, StateStructureError):
                e.add_note(f"jaxga: {fields.describe(state)}.")
            elif rng is None and "NoneType" in str(e):  # plausibly the key the loss used
                e.add_note(f"jaxga: the loss was given rng=None, as {fields.describe(state)}.")
            raise
        return acc, updated

    def optimizer(self, state: Any) -> skeleton.OptimizerAccess:
        """``state.tx``, ``state``'s own ``apply_gradients``, its params and opt_state."""
        method = _apply_gradients(state)
        check = functools.partial(_check_takes, state)  # outside apply_update's try
        fields = operator.attrgetter("opt_state"), operator.attrgetter("params"), self.rebuild
        update = functools.partial(_applied, method)
        return skeleton.OptimizerAccess(state.tx, update, *fields, check=check, static=method)

    def put_back(self, given: Any, new: Any, acc: Accumulated) -> Any:
        fields = state_fields(given, self.options.model_state_fields, self.options.rng_field)
        # `step` counts calls, whatever apply_gradients did to it: it adds 1 where the update
        # ran, none where a call counting nothing skipped it (unweighed); NNX's counts updates
        return fields.write(new.replace(step=given.step + 1), acc.state)

    def rebuild(self, state: Any, params: Any, opt_state: Any) -> Any:
        """``state`` with these ``params`` and ``opt_state``."""
        return state.replace(params=params, opt_state=opt_state)


def _on_mesh(accumulated: Accumulate, layout: MeshLayout, state: Any, specs: Any, *args: Any):
    """``accumulated(state.params, *args)`` (`layouts.on_mesh`), the parameters laid out by
    ``specs`` (``state``'s); the gradients, and the parameters the optimiser sees, as the
    optimiser state (ZeRO-1: split)."""
    mesh, axis_name, params = layout.mesh, layout.axis_name, state.params
    row, size = sharding.split_of(layout.strategy), meshes.devices(mesh, axis_name)

    def grad_spec(x: Any, spec: Any) -> Any:  # as the optimiser state, where the row splits it
        split = row.spec("grads", jnp.shape(x), size, axis_name)
        return spec if split is None else split

    grads = jax.tree.map(grad_spec, params, specs.params)
    if not layout.reduce_once:  # jit's global view: the parameters gathered once
        gathered = meshes.specs_over(specs.params, layouts.others(layout))
        params = sharding.place(mesh, params, gathered)
    acc = layouts.on_mesh(
        accumulated,
        layout,
        params,
        *args,
        param_specs=specs.params,
        primal_specs=(specs.params,),
        grad_specs=(grads,),
        fix="give `strategy` specs with P('{}') on the stacked layers",
    )
    acc = acc._replace(grads=sharding.place(mesh, acc.grads, grads))
    return acc, state.replace(params=sharding.place(mesh, state.params, grads))


def _apply_gradients(state: Any) -> Callable[..., Any]:
    """``state``'s own ``apply_gradients``, unbound (a subclass's override kept).

    Flax's own method sends keywords to ``replace`` and reads fp8's key in dict params:
    for it, `jaxga.TrainState.apply_gradients`, which runs Flax's for dict params and
    hands ``weight`` and ``end_group`` to ``tx``.
    """
    if type(state).apply_gradients is train_state.TrainState.apply_gradients:
        return TrainState.apply_gradients
    return type(state).apply_gradients


def _check_takes(state: Any, extra: dict[str, Any]) -> None:
    """Raises unless ``state``'s own ``apply_gradients`` (a Flax subclass's) takes ``extra``."""
    if _apply_gradients(state) is TrainState.apply_gradients or isinstance(state, TrainState):
        return
    takes = inspect.signature(state.apply_gradients).parameters  # a subclass of ours: **kwargs
    if missing := [n for n in extra if n not in takes]:
        got = f"{type(state).__name__}.apply_gradients takes no `{missing[0]}`"
        fix = "or build the step with weight=False" if missing[0] == "weight" else "or a subclass"
        raise TypeError(f"The step passes {got}: expected a jaxga.TrainState, {fix}.")


def _applied(method: Callable[..., Any], state: Any, grads: Any, **extra: Any) -> Any:
    """``method``, a state's own ``apply_gradients`` (`_apply_gradients`), with ``extra``."""
    return method(state, grads=grads, **extra)


def _state_step(loss: Callable[..., Any], options: StepOptions) -> Callable[..., Any]:
    def train_step(
        laid_out: Any, state: Any, batch: Any, num_real: Any = None, end_group: Any = None
    ) -> tuple:
        _check_type(state)
        kind = _Flax(loss, options, num_real, laid_out)
        return skeleton.train_step(kind, options, state, batch, end_group)

    return train_step


def make_train_step(
    loss: Callable[..., Any],
    num_microbatches: int | str = 1,
    *unexpected: Any,
    memory_budget: int | str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    axis_name: str | None = None,
    strategy: Any = "data_parallel",
    accumulator_dtype: Any = None,
    donate: bool = True,
    offload: bool | Callable[[Any, Any], bool] = False,
    reduce_once: bool = True,
    unroll: int | bool = 1,
    canonical_convolutions: bool | str = "auto",
    compiler_options: Mapping[str, Any] | None = None,
    model_state_fields: str | Sequence[str] | None = None,
    rng_field: str | None = None,
    weight: bool | None = None,
    learning_rate: Callable[[Any], Any] | None = None,
    pipeline_axis: str | None = None,
    stream: bool | str = False,
) -> TrainStep:
    """Builds a jitted train step `(state, batch) -> (state, metrics)` of a Flax `TrainState`.

    Args:
        loss: `loss(params, batch, model_state, rng) -> (loss, new_model_state)`, the loss a
            [`jaxga.Mean`][jaxga.Mean] or a scalar mean over its micro-batch.
        num_microbatches: micro-batches per step (and device), or `"auto"` (`step.plan`).
        unexpected: none: the step takes no optimiser (it runs `state.tx`), an error says so.
        memory_budget: with `"auto"`, a device's bytes (`"8GiB"`); `None`: 90 % of its limit.
        mesh: shard the batch over this mesh's `axis_name`; gradients are reduced once.
        axis_name: the batch's mesh axis (`"data"`); without a `mesh`, a one-device mesh of it.
        strategy: the state's layout on the mesh: `"data_parallel"`, `"zero1"`, `"fsdp"`,
            `"zero3"`, specs ([`jaxga.sharding.state_specs`][jaxga.sharding.state_specs]),
            or `None`: the parameters and optimiser state as they lie (read before the
            trace; one compile per layout).
        accumulator_dtype: the gradient sums' dtype; `None`: at least float32.
        donate: donate the state's buffers to the step.
        offload: keep the optimiser state in pinned host memory between steps; a function
            `(path, leaf) -> bool` picks the leaves (`jaxga.sharding.offload`'s `select`).
        reduce_once: `False` runs the loop in jit's global view of `mesh`, for a model that
            names `axis_name` in its own sharding annotations (exact; JAX then reduces the
            gradient in every micro-batch).
        unroll: the micro-batch loop's `lax.scan` `unroll`; `True` trades memory for speed.
        canonical_convolutions: the loop's convolutions in XLA:CPU's fast layout; `"auto"`:
            on CPU backends only (as for [`jaxga.accumulate`][jaxga.accumulate]).
        compiler_options: XLA options; `None`: [`jaxga.compiler_options()`][jaxga.compiler_options].
        model_state_fields: `state`'s model-state field(s), never `params`, `opt_state`, `tx`
            or `step`; `None`: jaxga.TrainState's, or none for a Flax TrainState that adds no
            fields (one that adds fields must name them).
        rng_field: `state`'s PRNG key field; `None`: jaxga.TrainState's, or none.
        weight: pass the call's item count to `state.apply_gradients(weight=)`; `None`: when
            `state.tx` is or holds (a chain) a `jaxga.MultiSteps` (docs/multisteps.md). Weighed,
            a call counting no items still runs the update (weight 0); unweighed, it does not.
        learning_rate: `metrics["learning_rate"]`, a function of `state.opt_state`; `None`: the
            one `learning_rate` of `optax.inject_hyperparams` (NaN without; several: an error).
        pipeline_axis: the `mesh` axis of a pipeline's stages (`jaxga.pipeline_scan`): manual
            in the loop beside `axis_name`, so that each stage's parameters, split over it by
            `strategy`'s specs, never move (docs/pipeline.md).
        stream: take `state.params` leaves that live in pinned host memory and keep them
            there: the loss gets them as they lie, to fetch layer by layer with
            [`jaxga.remat_scan(stream=True)`][jaxga.remat_scan]; their gradient sums live
            in host memory too (added on the device a layer at a time); the optimiser's
            update fetches the parameters and gradients whole and writes the parameters
            back (any `tx`). `"layers"`: the update too runs a layer at a time, each
            layer's parameters, gradient and optimiser-state slices (moments, with
            `offload=True` in host memory) fetched, updated and written back: your
            statement that `tx` is elementwise (sgd, adam, adamw, lion, schedules,
            `jaxga.MultiSteps` of them); a probe at trace time refuses the usual exceptions
            (`clip_by_global_norm`, LAMB), not every one. `True`: bit for bit the resident
            step; `"layers"`: to float rounding (another program). On a `mesh`, data
            parallel (`strategy="data_parallel"`, the stacks replicated): each device
            streams its own copy, and each stack's sum is reduced once after the loop, a
            layer at a time (docs/streaming.md, "On a mesh"). With `pipeline_axis` (an
            Explicit axis; the loss's `jaxga.pipeline_loss(..., stream=True)`), each stage
            streams its own layers, and with `"layers"` updates them a layer at a time
            (docs/streaming.md, "A pipeline's stages"). `"auto"` (with
            `num_microbatches="auto"`, without a `mesh`): the plan tries the step resident
            first (the parameters in host memory fetched to the device, and kept there),
            then `True`, then `"layers"`, each over every k, and takes the first that fits
            `memory_budget`.

    Returns:
        A [`jaxga.TrainStep`][jaxga.TrainStep]; its `metrics`: `loss`,
        `count`, `grad_norm`, `learning_rate` (NaN without `inject_hyperparams`), `applied`.

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
    _check_no_optimizer(num_microbatches, *unexpected)
    _checks.check_arity(loss, "loss", 4, "`loss(params, batch, model_state, rng)`")
    fields, key = check_field_names(model_state_fields, rng_field)
    options = steps.step_options(
        num_microbatches,
        mesh=mesh,
        axis_name=axis_name,
        strategy=strategy,
        reduce_once=reduce_once,
        pipeline_axis=pipeline_axis,
        memory_budget=memory_budget,
        stream=stream,
        accumulator_dtype=accumulator_dtype,
        donate=donate,
        offload=offload,
        unroll=unroll,
        canonical_convolutions=canonical_convolutions,
        compiler_options=compiler_options,
        model_state_fields=fields,
        rng_field=key,
        weight=weight,
        learning_rate=learning_rate,
    )
    return TrainStep(_state_step, loss, options)


def _check_no_optimizer(*positional: Any) -> None:
    """Raises if an optimiser (or more) follows ``loss``: the step runs ``state.tx``."""
    if len(positional) > 1 or callable(getattr(positional[0], "update", None)):
        got = ", ".join(type(x).__name__ if hasattr(x, "update") else repr(x) for x in positional)
        fix = "pass tx to TrainState.create and num_microbatches= alone"
        raise TypeError(f"make_train_step takes no optimiser (it runs state.tx); got {got}: {fix}.")
