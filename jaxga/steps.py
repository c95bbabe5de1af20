"""What both train steps share: their options, the jitted step, and the optimiser's update."""

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxga import _checks, convolution, planner, sharding
from jaxga.arguments import check_unroll
from jaxga.compiler import compiler_options
from jaxga.engine import Accumulated
from jaxga.loss import Mean
from jaxga.memory import format_bytes
from jaxga.multistep import MultiStepsState

Metrics = dict[str, jax.Array]
_LOG = logging.getLogger("jaxga")


def find(tree: Any, kind: type) -> Any:
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, kind))
    return next((x for x in leaves if isinstance(x, kind)), None)


_HINT = "was it built for these parameters?"


def apply_update(acc: Accumulated, update: Callable[[Any, Any], Any], state: Any) -> Any:
    """``update(state, grads)``, checked; with no items counted, ``state`` (a MultiSteps: zeros)."""
    try:
        shapes = jax.eval_shape(update, state, acc.grads)
    except (TypeError, ValueError) as e:
        raise ValueError(f"The optimiser's update fails on these parameters ({e}): {_HINT}") from e
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    for (path, before), after in zip(paths, jax.tree.leaves(shapes), strict=True):
        if jnp.shape(before) != after.shape:
            change = f"{jax.tree_util.keystr(path)} from {jnp.shape(before)} to {after.shape}"
            raise ValueError(f"The optimiser's update changes the shape of {change}: {_HINT}")
    counted = acc.mean.count > 0
    if find(state, MultiStepsState) is not None:  # it counts the call: give it zeros
        zero = jax.lax.optimization_barrier(jnp.zeros((), jnp.float32))  # not a constant
        return update(state, jax.tree.map(lambda g: jnp.where(counted, g, zero), acc.grads))

    # leaf by leaf: nnx.Optimizer may rebuild a subtree with other node types
    def updated(state):
        return jax.tree.leaves(update(state, acc.grads))

    def kept(state):
        return [x.astype(s.dtype) for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shapes))]

    leaves = jax.lax.cond(counted, updated, kept, state)
    return jax.tree.unflatten(jax.tree.structure(shapes), leaves)


def metrics(acc: Accumulated, old_opt_state: Any, opt_state: Any) -> Metrics:
    applied = acc.mean.count > 0
    if (ours := find(opt_state, MultiStepsState)) is not None:
        applied = ours.applied
    elif (theirs := find(opt_state, optax.MultiStepsState)) is not None:
        applied = theirs.gradient_step > find(old_opt_state, optax.MultiStepsState).gradient_step
    rates = optax.tree_utils.tree_get_all_with_path(opt_state, "learning_rate")
    found = [v for path, v in rates if any(getattr(k, "name", None) == "hyperparams" for k in path)]
    return {
        "loss": acc.mean.value,
        "count": acc.mean.count,
        "grad_norm": optax.tree.norm(acc.grads),
        "learning_rate": jnp.asarray(found[0] if len(found) == 1 else jnp.nan, jnp.float32),
        "applied": applied,
    }


def weight(tx: Any, acc: Accumulated) -> dict[str, jax.Array]:
    takes_extra_args = isinstance(tx, optax.GradientTransformationExtraArgs)
    return {"weight": acc.mean.count} if takes_extra_args else {}


def loss_alone(
    loss: Callable[..., Any], signature: str, *, pair: bool, aux: bool = False
) -> Callable[..., Any]:
    @functools.wraps(loss)
    def checked(*args):
        out = loss(*args)
        if pair and (isinstance(out, Mean) or not (isinstance(out, tuple) and len(out) == 2)):
            got = type(out).__name__ if isinstance(out, Mean | tuple) else None
            got = got or f"an array of shape {jnp.shape(out)}"
            raise TypeError(f"{signature} must return a pair (loss, new_model_state); got {got}.")
        if aux and not (isinstance(out, tuple) and len(out) == 2):
            got = type(out).__name__
            raise TypeError(f"With has_aux=True, {signature} must return (loss, aux); got {got}.")
        value = out[0] if pair or aux else out
        if isinstance(value, tuple | list):
            got = f"{type(value).__name__} of length {len(value)}"
            hint = "; or build the step with has_aux=True" if not (pair or aux) else ""
            raise TypeError(f"{signature} must give the loss alone, no aux; got a {got}{hint}.")
        return out  # the engine checks the new model state (state_argnums)

    return checked


def traced(tree: Any) -> bool:
    return isinstance(next(iter(jax.tree.leaves(tree)), None), jax.core.Tracer)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What a train step was built with (`step.options`): the arguments, checked.

    Its fields are [`make_train_step`][jaxga.make_train_step]'s arguments of the same names
    (`compiler_options` filled in, `memory_budget` in bytes), and `layout`: the mesh, the
    batch's axis and the state's layout (a `MeshLayout`), or `None` without a mesh.

    Examples:
        >>> import jaxga
        >>> jaxga.nnx_train_step(lambda model, x: model(x).mean(), 4).options.num_microbatches
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
    memory_budget: int | None = None
    has_aux: bool = False  # NNX: the loss returns (loss, aux), given back as metrics["aux"]
    canonical_convolutions: bool | str = "auto"  # the loop's convolutions NHWC/HWIO (XLA:CPU)


def step_options(num_microbatches: Any, **options: Any) -> StepOptions:
    xla = options.pop("compiler_options")
    if xla is None:
        xla = compiler_options()
    elif not isinstance(xla, Mapping):
        raise TypeError(f"`compiler_options` must be a dict of XLA options or None; got {xla!r}.")
    budget = options.pop("memory_budget")
    expected = "a positive int or 'auto'"
    if num_microbatches == "auto":
        budget = planner.device_budget(budget, name="memory_budget")
    elif budget is not None:
        raise ValueError(f'`memory_budget` needs num_microbatches="auto"; got {num_microbatches=}.')
    elif isinstance(num_microbatches, str):
        raise ValueError(f"`num_microbatches` must be {expected}; got {num_microbatches!r}.")
    else:
        num_microbatches = _checks.positive_int(num_microbatches, "num_microbatches", expected)
    return StepOptions(
        num_microbatches=num_microbatches,
        memory_budget=budget,
        accumulator_dtype=_checks.float_dtype(options.pop("accumulator_dtype")),
        donate=_checks.check_bool(options.pop("donate"), "donate"),
        offload=_checks.check_bool(options.pop("offload"), "offload"),
        unroll=check_unroll(options.pop("unroll")),
        canonical_convolutions=convolution.check_option(options.pop("canonical_convolutions")),
        compiler_options=dict(xla),
        **options,
    )


class JittedStep:
    """A jitted step; with `"auto"`, planned per call signature (`plan`, `max_plans`)."""

    _arity: int  # a call's arguments, the batch last, before `num_real_microbatches`
    _static_argnums: tuple[int, ...] = ()  # of the jitted function's arguments
    plan_search = "predict"  # how "auto" plans: jaxga.plan's `search`

    def __init__(self, build: Callable[..., Any], loss: Any, options: StepOptions, devices=1):
        self.options = options
        self.plan: planner.Plan | None = None
        self.max_plans = 8
        self._build, self._loss, self._devices = build, loss, devices
        self._plans: dict[Any, planner.Plan] = {}
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

    def _planned(self, args: tuple[Any, ...]) -> "JittedStep":
        """This step, or with `"auto"` the step planned for these arguments' shapes."""
        if self.options.num_microbatches != "auto":
            return self
        args, num_real = args[: self._arity], args[self._arity :]
        if any(n is not None for n in num_real):
            raise ValueError('`num_real_microbatches` needs a fixed k; "auto" plans one per shape.')
        if traced(args):
            message = 'num_microbatches="auto" cannot plan (compile) inside an enclosing jax.jit.'
            raise ValueError(message)
        leaves, treedef = jax.tree.flatten(args)
        kinds = [(jnp.shape(x), jnp.result_type(x), getattr(x, "sharding", None)) for x in leaves]
        key = (treedef, tuple(kinds))
        self.plan = self._plans.pop(key, None) or self._search(args)
        self._plans[key] = self.plan  # the most recent last
        if len(self._plans) > self.max_plans:
            del self._plans[next(iter(self._plans))]
        return self.plan.step

    def _search(self, args: tuple[Any, ...]) -> planner.Plan:
        local = (_checks.leading_size(args[-1], "batch", "batch") or 0) // self._devices
        counts = [k for k in range(1, local + 1) if local % k == 0]
        start, budget = time.perf_counter(), self.options.memory_budget
        plan = planner.plan(
            self._fixed,
            *args,
            budget=budget,
            num_microbatches=counts,
            remat=(None,),
            search=self.plan_search,
        )
        _LOG.info(
            f"jaxga: planned {plan.num_microbatches} micro-batch(es) of {plan.microbatch_size} "
            f"rows for a batch of {plan.batch_size} in {time.perf_counter() - start:.1f} s: peak "
            f"{format_bytes(plan.report.peak_bytes)} per device ({len(plan.candidates)} compiled)"
        )
        return plan

    def _fixed(self, num_microbatches: int, remat: Any) -> "JittedStep":
        del remat  # the model's own
        options = dataclasses.replace(self.options, num_microbatches=num_microbatches)
        return type(self)(self._build, self._loss, options, self._devices)

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """Lowers the step (planned, with `"auto"`) for these arguments, as a call lays them out."""
        return self.trace(*args).lower()

    def trace(self, *args: Any) -> jax.stages.Traced:
        """Traces the step (planned, with `"auto"`) for these arguments, as a call lays them out."""
        step = self._planned(args)
        return step._jitted.trace(*step._arguments(*args))
