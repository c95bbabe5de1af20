"""What both train steps share: their options, the jitted step, the checks of a call."""

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxga import _checks, layouts, meshes, planner, sharding
from jaxga.accumulation import OPTION_CHECKS, Accumulate, accumulate, check_options
from jaxga.arguments import check_num_real
from jaxga.compiler import compiler_options
from jaxga.memory import format_bytes
from jaxga.meshes import HOST_KINDS
from jaxga.microbatch import IndivisibleBatchError
from jaxga.state import unaliased

Metrics = dict[str, jax.Array]
_LOG = logging.getLogger("jaxga")


def injected_learning_rate(opt_state: Any) -> jax.Array:
    """The one learning rate ``optax.inject_hyperparams`` holds in ``opt_state``, else NaN."""
    rates = optax.tree_utils.tree_get_all_with_path(opt_state, "learning_rate")
    found = [(p, v) for p, v in rates if any(getattr(k, "name", None) == "hyperparams" for k in p)]
    if len(found) > 1:
        where = ", ".join(jax.tree_util.keystr(path) for path, _ in found)
        fix = "pass the step's `learning_rate=`, a function of the optimiser state, to pick one"
        raise ValueError(f"The optimiser state holds {len(found)} learning rates ({where}): {fix}.")
    return jnp.asarray(found[0][1] if found else jnp.nan, jnp.float32)


def check_end_group(end_group: Any) -> jax.Array | None:
    """A call's ``end_group``: ``None``, or a bool scalar (traced: one program for both)."""
    if end_group is None:
        return None
    return _checks.scalar(end_group, "end_group", (jnp.bool_,), "a bool")


_STREAM_FIX = (
    "pass stream=True (its loss fetching it layer by layer with "
    "jaxga.remat_scan(stream=True)), or move it to the device with jax.device_put"
)
_OFFLOAD_FIX = "pass offload=True, or move it back with jaxga.sharding.offload(state, 'device')"


def check_on_device(
    tree: Any,
    *,
    name: str = "state",
    params: str | None = "params",
    offload: Any = False,
    stream: bool = False,
) -> None:
    """Raises if a leaf of ``tree`` (the argument ``name``) is in host memory where the step
    does not take it: a parameter (under the field ``params``; ``None``: every leaf, a model's
    variables) unless ``stream`` (and then in pinned host memory, which JAX streams from);
    another leaf unless ``offload`` (a function: any leaf). A traced leaf's type says host
    memory but not which kind: taken as pinned."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        kind = meshes.memory_kind(x)
        if isinstance(x, jax.core.Tracer) and meshes.memory_space(x) == jax.memory.Space.Host:
            kind = "pinned_host"  # inside an enclosing jit its type says host memory
        where = f"`{name}`{jax.tree_util.keystr(path)} is in host memory ({kind})"
        param = params is None or (bool(path) and getattr(path[0], "name", None) == params)
        if param and stream and kind in HOST_KINDS and _is_key(x):  # JAX aborts the process
            fix = "keep keys on the device: move the parameters alone, nnx.state(blocks, nnx.Param)"
            raise ValueError(f"{where}, a PRNG key, which a streaming step cannot take: {fix}.")
        unpinned = param and stream and kind == "unpinned_host"  # JAX streams from pinned
        allowed = kind not in HOST_KINDS or callable(offload) or (stream if param else offload)
        if allowed and not unpinned:
            continue
        if unpinned:
            fix = "move it to pinned_host (jax.device_put with memory_kind='pinned_host')"
            raise ValueError(f"{where}; `stream` takes pinned_host alone: {fix}.")
        if params is None:  # a model: every variable is expected on the device
            where += "; expected on the device"
        raise ValueError(f"{where}: {_STREAM_FIX if param else _OFFLOAD_FIX}.")


def typed_as_placed(x: Any) -> Any:
    """``x``, copied where it lies if it is `mistyped` (as Orbax restores a leaf into pinned
    host memory), which JAX's ``jit`` aborts the process on when it is donated.

    Args:
        x: a leaf of a step's state.

    Returns:
        ``x`` itself, or a copy in the same memory whose type says so.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> x = jnp.ones(3)
        >>> jaxga.steps.typed_as_placed(x) is x  # type and sharding agree: as it is
        True
    """
    return jax.device_put(x, x.sharding, may_alias=False) if mistyped(x) else x


def mistyped(x: Any) -> bool:
    """Whether ``x`` lies in pinned host memory by its sharding and on the device by its type.

    Args:
        x: any value; an array's sharding and type are read.

    Returns:
        True for such an array (JAX types unpinned host memory as the device: not one).

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
        >>> jaxga.steps.mistyped(jax.device_put(jnp.ones(3), host))
        False
    """
    kind = meshes.memory_kind(x)
    if kind != "pinned_host" or isinstance(x, jax.core.Tracer):  # JAX types unpinned as device
        return False
    return meshes.memory_space(x) != jax.memory.Space.Host


def _is_key(x: Any) -> bool:
    """Whether ``x`` is an array of typed PRNG keys (``jax.random.key``'s)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def signature(tree: Any) -> tuple[Any, ...]:
    """What a check or plan is kept for: ``tree``'s structure, leaves' shapes, dtypes, shardings
    (a traced leaf's type: its memory and sharding)."""
    xs, treedef = jax.tree.flatten(tree)
    kinds = [(jnp.shape(x), getattr(x, "dtype", type(x)), _placement(x)) for x in xs]
    return treedef, tuple(kinds)


def _placement(x: Any) -> Any:
    """Where ``x`` lies, hashable: its sharding, or a traced leaf's type."""
    return jax.typeof(x) if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)


def is_traced(tree: Any) -> bool:
    """Whether ``tree``'s first leaf is traced (a call inside an enclosing jit)."""
    return isinstance(next(iter(jax.tree.leaves(tree)), None), jax.core.Tracer)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What a train step was built with (`step.options`): the arguments, checked.

    Attributes:
        num_microbatches: micro-batches per step (and device), or `"auto"`.
        accumulator_dtype: the gradient sums' dtype; `None`: at least float32.
        donate: whether the step donates the state's buffers.
        offload: `True`, `False` or a function `(path, leaf) -> bool`: what lives in host memory.
        unroll: the micro-batch loop's `lax.scan` `unroll`.
        compiler_options: the XLA options the step compiles with (`None` filled in).
        layout: the mesh, the batch's axis and the state's layout, or `None` without a mesh.
        model_state_fields: (Flax) the train state's model-state field(s); `None`:
            jaxga.TrainState's.
        rng_field: (Flax) the train state's key field; `None`: jaxga.TrainState's (or none).
        memory_budget: with `"auto"`, the bytes a device may use.
        has_aux: (NNX) whether the loss returns `(loss, aux)`, given back as `metrics["aux"]`.
        aux: (NNX) how each aux leaf combines over the micro-batches (`jaxga.accumulate`'s).
        canonical_convolutions: the loop's convolutions in XLA:CPU's fast layout.
        weight: whether `tx.update` gets `weight=`; `None`: for a `jaxga.MultiSteps`, or one in tx.
        learning_rate: the `learning_rate` metric, a function of the optimiser state.
        stream: whether parameters in host memory stay there (the loss streams them); `"layers"`:
            the optimiser's update runs over them a layer at a time too; `"auto"`: as planned.

    Examples:
        >>> import jaxga
        >>> jaxga.nnx_train_step(lambda model, x: model(x).mean(), 4).options.num_microbatches
        4
    """

    num_microbatches: int | str
    accumulator_dtype: Any
    donate: bool
    offload: bool | Callable[[Any, Any], bool]
    unroll: int | bool
    compiler_options: Mapping[str, Any]
    layout: layouts.MeshLayout | None = None
    model_state_fields: str | tuple[str, ...] | None = None  # Flax's TrainState only
    rng_field: str | None = None  # Flax's TrainState only
    memory_budget: int | None = None
    has_aux: bool = False
    aux: Any = None
    canonical_convolutions: bool | str = "auto"
    weight: bool | None = None
    learning_rate: Callable[[Any], Any] = injected_learning_rate
    stream: bool | str = False


def _check_learning_rate(rate: Any) -> Callable[[Any], Any]:
    """The step's ``learning_rate=``, checked: a function of the optimiser state."""
    _checks.check_callable(rate, "learning_rate", "a function of the optimiser state or None")
    return _checks.check_arity(rate, "learning_rate", 1, "learning_rate(opt_state) -> a scalar")


def step_options(
    num_microbatches: Any,
    *,
    mesh: Any,
    axis_name: Any,
    strategy: Any,
    reduce_once: Any,
    pipeline_axis: Any,
    **options: Any,
) -> StepOptions:
    """Both train steps' arguments, checked once: their `StepOptions` (the layout built).
    ``axis_name`` without a ``mesh``: a one-device mesh of it (a loss's collectives over it
    bind); ``None``: ``"data"``."""
    axis_name = meshes.check_axis_name(axis_name)
    if mesh is None and axis_name is not None:
        names = meshes.axes(axis_name)
        mesh = jax.make_mesh((1,) * len(names), names, devices=jax.local_devices()[:1])
    axis_name = "data" if axis_name is None else axis_name
    layout = layouts.mesh_layout(
        mesh, axis_name, strategy, reduce_once=reduce_once, pipeline_axis=pipeline_axis
    )
    xla = options.pop("compiler_options")
    if xla is None:
        xla = compiler_options()
    elif not isinstance(xla, Mapping):
        raise TypeError(f"`compiler_options` must be a dict of XLA options or None; got {xla!r}.")
    # `stream` before the budget: a refused stream is said first, whatever the budget
    stream = _check_stream(options.pop("stream", False), layout, num_microbatches)
    num_microbatches, budget = _count(num_microbatches, options.pop("memory_budget"))
    if not isinstance(weight := options.pop("weight"), bool | None):
        raise TypeError(f"`weight` must be None, True or False; got {weight!r}.")
    rate = _check_learning_rate(options.pop("learning_rate") or injected_learning_rate)
    options.setdefault("has_aux", False)
    options.setdefault("aux", None)
    checked = check_options(**{name: options.pop(name) for name in OPTION_CHECKS})
    if checked["has_aux"] and pipeline_axis is not None:  # its rows would leave the loop per stage
        raise ValueError("`pipeline_axis` with has_aux=True: not supported; return a Mean alone.")
    donate = _checks.check_bool(options.pop("donate"), "donate")
    offload = sharding.check_select(options.pop("offload"), "offload")
    return StepOptions(
        num_microbatches=num_microbatches,
        memory_budget=budget,
        donate=donate,
        offload=offload,
        compiler_options=dict(xla),
        layout=layout,
        weight=weight,
        learning_rate=rate,
        stream=stream,
        **checked,
        **options,
    )


def _check_stream(stream: Any, layout: layouts.MeshLayout | None, k: Any) -> bool | str:
    """``stream`` (False, True, "layers"; "auto" with ``k`` "auto"), checked; on a mesh, data
    parallel: each device streams its own copy of a stack (a split one is refused at trace
    time, `collectives.all_gathered`), the stacks' sums reduced once after the loop, a
    layer at a time; with a pipeline's stage axis, each stage its own layers."""
    if stream == "auto" and k != "auto":
        raise ValueError(
            f'`stream`="auto" needs num_microbatches="auto"; got num_microbatches={k!r}.'
        )
    if not (isinstance(stream, bool) or stream in ("layers", "auto")):
        raise TypeError(f"`stream` must be False, True, 'layers' or 'auto'; got {stream!r}.")
    if not stream or layout is None:
        return stream
    on = f"`stream`={stream!r} on a mesh"
    if stream == "auto":
        raise ValueError(f"{on}: the planner does not try streaming on a mesh; expected {_ON}.")
    if isinstance(layout.strategy, str) and layout.strategy != "data_parallel":
        got = f"`strategy`={layout.strategy!r}"
        expected = f"'data_parallel', or specs that leave the streamed stacks unsplit ({_EACH})"
        raise ValueError(f"{on} with {got}: not supported; expected {expected}.")
    if layout.pipeline_axis is not None:
        _check_stream_stages(stream, layout)
    if others := layouts.others(layout):
        got = f"the mesh's axes {others} beside `axis_name`={layout.axis_name!r}"
        expected = "a mesh of the batch's axes alone (or `axis_name` naming every axis)"
        raise ValueError(f"{on} streams data parallel only; got {got}; expected {expected}.")
    if not layout.reduce_once:
        raise ValueError(f"{on} needs reduce_once=True ({_ONCE}); got reduce_once=False.")
    return stream


def _check_stream_stages(stream: bool | str, layout: layouts.MeshLayout) -> None:
    """Raises unless a pipelined step can stream: on an Explicit stage axis, where the
    stacks' types say that they are split, so that the step divides their sums and
    ``"layers"`` updates them on each device over its own layers, in a ``shard_map``
    (on Auto axes, XLA's SPMD partitioner gathered the sums whole)."""
    got = f"`stream`={stream!r} with `pipeline_axis`={layout.pipeline_axis!r}"
    if not meshes.explicit_axes(layout.mesh, layout.pipeline_axis):
        want = "an Explicit stage axis (jax.make_mesh's default axis_types)"
        raise ValueError(f"{got} on an Auto axis: not supported; expected {want}.")


_ON = "True or 'layers' with num_microbatches an int, or stream=False"
_EACH = "each device streams its own copy of each stack from host memory"
_ONCE = "each stack's gradient sum reduced once after the loop, a layer at a time"


def _count(num_microbatches: Any, budget: Any) -> tuple[int | str, int | None]:
    """``num_microbatches`` and ``memory_budget``, checked (the budget: with "auto" alone)."""
    expected = "a positive int or 'auto'"
    if num_microbatches == "auto":
        return num_microbatches, planner.device_budget(budget, name="memory_budget")
    if budget is not None:
        raise ValueError(f'`memory_budget` needs num_microbatches="auto"; got {num_microbatches=}.')
    if isinstance(num_microbatches, str):
        raise ValueError(f"`num_microbatches` must be {expected}; got {num_microbatches!r}.")
    return _checks.positive_int(num_microbatches, "num_microbatches", expected), None


def accumulator(
    loss: Callable[..., Any],
    options: StepOptions,
    argnums: Any,
    *,
    num_real: Any,
    called_as: str,
    **roles: Any,
) -> Accumulate:
    """``loss`` accumulated as a train step's ``options`` say (micro-batches, loop, dtypes);
    ``roles``: its batch, state and key arguments, as [`jaxga.accumulate`][jaxga.accumulate]'s;
    ``called_as``: how the errors of its output name it."""
    layout = options.layout
    accumulated = accumulate(
        loss,
        argnums,
        options.has_aux,
        num_microbatches=options.num_microbatches,
        num_real_microbatches=num_real,
        axis_name=None if layout is None else layout.loop_axes,
        accumulator_dtype=options.accumulator_dtype,
        unroll=options.unroll,
        aux=options.aux,
        canonical_convolutions=options.canonical_convolutions,
        **roles,
    )
    return Accumulate(accumulated.fun, accumulated.options._replace(called_as=called_as))


class JittedStep:
    """A jitted train step; with `num_microbatches="auto"`, the one planned for each call.

    A subclass's ``__call__`` runs `_run`; its ``_arguments`` turns a call's arguments into
    the jitted function's (checked, laid out): the static ones, then the state (donated).

    Attributes:
        options: the `StepOptions` it was built with.
        plan: with `"auto"`, the [`jaxga.Plan`][jaxga.Plan] of the last call's arguments.
        max_plans: with `"auto"`, how many argument signatures' plans it keeps (8).
        plan_search: with `"auto"`, how it plans: [`jaxga.plan`][jaxga.plan]'s `search`.
    """

    _arity: int  # a call's arguments, the batch last, before `num_real_microbatches`
    _static_argnums: tuple[int, ...] = ()  # of the jitted function's arguments
    plan_search = "predict"
    _arguments: Callable[..., tuple[Any, ...]]

    def __init__(self, build: Callable[..., Any], loss: Any, options: StepOptions):
        self.options = options
        self.plan: planner.Plan | None = None
        self.max_plans = 8
        layout = options.layout
        self._devices = 1 if layout is None else meshes.devices(layout.mesh, layout.axis_name)
        self._build, self._loss = build, loss
        self._plans: dict[Any, planner.Plan] = {}
        self._checked: set[Any] = set()  # the signatures `_once` checked
        self._wanted: dict[Any, Any] = {}  # the state's shardings by shape (layouts.lay_out)
        self._specs: dict[Any, Any] = {}  # strategy=None's specs by shardings (a Flax step's)
        if options.num_microbatches == "auto":
            return
        self._update = build(loss, options)
        donated = (len(self._static_argnums),) if options.donate else ()
        self._jitted = jax.jit(
            self._update,
            static_argnums=self._static_argnums,
            donate_argnums=donated,
            compiler_options=options.compiler_options,
        )

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call (planned, with `"auto"`): the jitted function's output; in a jit, inlined."""
        if any(isinstance(n, jax.ShapeDtypeStruct) for n in args[self._arity :]):
            fix = "`step.lower` and `step.trace` take that; a call takes an int scalar or None"
            raise TypeError(f"`num_real_microbatches` is a jax.ShapeDtypeStruct: {fix}.")
        if (planned := self._planned(args)) is not self:
            return planned._run(self._handed(planned, args), kwargs)
        arguments = list(self._arguments(*args, **kwargs))
        i = len(self._static_argnums)  # the state
        run = self._update if is_traced(arguments[i]) else self._jitted
        if self.options.donate:
            arguments[i] = unaliased(arguments[i])
        return run(*arguments)

    def _laid_out(
        self,
        static: tuple[Any, ...],
        state: Any,
        batch: Any,
        num_real: Any,
        *,
        end_group: Any,
        layout: layouts.MeshLayout | None = None,
        extra: tuple[Any, ...] = (),
    ) -> tuple[Any, ...]:
        """What a subclass's ``_arguments`` ends with, the jitted function's arguments:
        ``static``, ``state`` laid out (`layouts.lay_out` on ``layout``, offloaded as the
        step says), ``batch``, ``num_real`` and ``end_group`` checked, then ``extra``."""
        self._check_batch(batch)
        if any(map(mistyped, jax.tree.leaves(state))):  # Orbax's restored leaves, say
            state = jax.tree.map(typed_as_placed, state)
        offload = self.options.offload
        state = layouts.lay_out(state, layout, offload_state=offload, wanted=self._wanted)
        batch = layouts.batch_onto(batch, self.options.layout)
        real = check_num_real(num_real, self.options.num_microbatches)
        return (*static, state, batch, real, check_end_group(end_group), *extra)

    def _check_batch(self, batch: Any) -> None:
        """Raises for a ``batch`` that `accumulate` would refuse, named as the step's."""
        if not jax.tree.leaves(batch):
            got = f"{batch!r:.60}"
            raise ValueError(f"`batch` must hold arrays, rows on their leading axis; got {got}.")
        rows, k = _checks.leading_size(batch, "batch", "batch"), self.options.num_microbatches
        if not rows:
            raise ValueError(f"`batch` must hold rows to split into micro-batches; got {rows}.")
        if self.options.layout is None and rows % k:  # on a mesh, `layouts.accumulate_on` says it
            raise IndivisibleBatchError(f"`batch`: {IndivisibleBatchError.of(rows, k)}")

    def _planned(self, args: tuple[Any, ...]) -> "JittedStep":
        """This step, or with `"auto"` the step planned for these arguments' shapes."""
        if self.options.num_microbatches != "auto":
            return self
        args, num_real = args[: self._arity], args[self._arity :]
        if any(n is not None for n in num_real):
            raise ValueError('`num_real_microbatches` needs a fixed k; "auto" plans one per shape.')
        if is_traced(args):
            message = 'num_microbatches="auto" cannot plan (compile) inside an enclosing jax.jit.'
            raise ValueError(message)
        args = planner.abstract(args)
        key = signature(self._keyed(args))
        self.plan = self._plans.pop(key, None) or self._search(args)
        self._plans[key] = self.plan  # the most recent last
        if self.plan.stream is False:  # stream="auto"'s resident plan: the fetched ones' too
            self._plans[signature(self._keyed(self._fetched(args)))] = self.plan
        while len(self._plans) > self.max_plans:
            del self._plans[next(iter(self._plans))]
        return self.plan.step

    def _once(self, tree: Any, check: Callable[..., Any], *args: Any) -> None:
        """Runs ``check(*args)`` once per `signature` of ``tree`` (all it depends on)."""
        if (key := signature(tree)) not in self._checked:
            check(*args)
            self._checked = set() if len(self._checked) >= 64 else self._checked
            self._checked.add(key)

    def _search(self, args: tuple[Any, ...]) -> planner.Plan:
        """The plan for these arguments; with ``stream="auto"``, resident candidates (the
        parameters fetched) first, then streamed ones (``True``, ``"layers"``) if none fits."""
        local = (_checks.leading_size(args[-1], "batch", "batch") or 0) // self._devices
        counts = [k for k in range(1, local + 1) if local % k == 0]
        start, budget = time.perf_counter(), self.options.memory_budget
        streams = (None,)
        if self.options.stream == "auto":  # streamed too, if any parameter lies in host memory
            hosted = signature(self._fetched(args)) != signature(args)
            streams = (False, True, "layers") if hosted else (False,)
        over: list[planner.Candidate] = []  # the candidates of the streams none of which fits
        for stream in streams:
            try:
                plan = planner.plan(
                    self._fixed,
                    *(self._fetched(args) if stream is False else args),
                    budget=budget,
                    num_microbatches=counts,
                    remat=(None,),
                    stream=None if stream is None else (stream,),
                    search=self.plan_search,
                )
                break
            except planner.InfeasibleBudgetError as e:
                over += e.candidates
                if stream == streams[-1]:  # none of any stream fits
                    raise planner.over_budget(over, budget) from None
        plan = dataclasses.replace(plan, candidates=(*over, *plan.candidates))
        _LOG.info(
            f"jaxga: planned {plan.num_microbatches} micro-batch(es) of {plan.microbatch_size} "
            f"rows for a batch of {plan.batch_size} in {time.perf_counter() - start:.1f} s: peak "
            f"{format_bytes(plan.report.peak_bytes)} per device ({len(plan.candidates)} compiled)"
        )
        return plan

    def _fixed(self, num_microbatches: int, remat: Any, stream: Any = None) -> "JittedStep":
        del remat  # the model's own
        fixed = {"num_microbatches": num_microbatches}
        fixed |= {} if stream is None else {"stream": stream}
        return type(self)(self._build, self._loss, dataclasses.replace(self.options, **fixed))

    def _fetched(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """A call's arguments as a resident plan of ``stream="auto"`` takes them: a subclass's
        state with its parameters in host memory fetched to the device (here: as they are)."""
        return args

    def _keyed(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """A call's (abstract) arguments as a plan is kept for them: a subclass's state placed
        as a call lays it out (offloaded), so that the state a step returns finds its plan."""
        return args

    def _handed(
        self, planned: "JittedStep", args: tuple[Any, ...], *, call: bool = True
    ) -> tuple[Any, ...]:
        """A call's arguments as the ``planned`` step takes them: `_fetched` if resident (for
        a trace, not a ``call``, their shapes: a model is never moved to trace it)."""
        if not (self.options.stream == "auto" and planned.options.stream is False):
            return args
        mine = args[: self._arity] if call else planner.abstract(args[: self._arity])
        return (*self._fetched(mine), *args[self._arity :])

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """Lowers the step (planned, with `"auto"`) for these arguments, as a call lays them out."""
        return self.trace(*args, **kwargs).lower()

    def trace(self, *args: Any, **kwargs: Any) -> jax.stages.Traced:
        """Traces the step (planned, with `"auto"`) for these arguments, as a call lays them out."""
        step = self._planned(args)
        handed = self._handed(step, args, call=False)
        return step._jitted.trace(*step._arguments(*handed, **kwargs))
