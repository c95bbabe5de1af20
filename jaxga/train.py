"""`jaxga.make_train_step`: a jitted train step of a Flax `TrainState`, on one device or a mesh."""

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax
from flax import nnx
from flax.training import train_state

from jaxga import _checks, modules, sharding, steps
from jaxga.accumulation import accumulate
from jaxga.arguments import StateStructureError, check_num_real
from jaxga.state import check_field_names, state_fields, unaliased
from jaxga.steps import Metrics, StepOptions


class TrainStep(steps.JittedStep):
    """`step(state, batch, num_real_microbatches=None) -> (state, metrics)`: `make_train_step`'s.

    `num_real_microbatches`: as for [`jaxga.accumulate`][jaxga.accumulate]; one compiled
    step for every count. With `num_microbatches="auto"`, `step.plan` is the last call's.

    Examples:
        >>> import jax.numpy as jnp, optax, jaxga
        >>> def loss(params, batch, model_state, rng):
        ...     return jnp.mean((batch * params) ** 2), model_state
        >>> step = jaxga.make_train_step(loss, 2)
        >>> state = jaxga.TrainState.create(params=jnp.ones(3), tx=optax.sgd(0.1))
        >>> step.lower(state, jnp.ones((4, 3))).compile().memory_analysis() is not None
        True
    """

    _arity = 2

    def _arguments(self, state: Any, batch: Any, num_real_microbatches: Any = None) -> tuple:
        _check_state(state)
        if not self.options.offload:
            sharding.check_on_device(state)
        state = sharding.lay_out(state, self.options.layout, offload_state=self.options.offload)
        return state, batch, check_num_real(num_real_microbatches, self.options.num_microbatches)

    def __call__(
        self, state: Any, batch: Any, num_real_microbatches: Any = None
    ) -> tuple[Any, Metrics]:
        if (planned := self._planned((state, batch, num_real_microbatches))) is not self:
            return planned(state, batch, num_real_microbatches)
        if steps.traced(state):  # inside a jit: inlined, compiled with the enclosing one's options
            return self._update(state, batch, num_real_microbatches)
        if isinstance(leaf := getattr(state, "step", None), jax.Array) and leaf.is_deleted():
            raise ValueError("`state` holds arrays an earlier call deleted: it donates them.")
        state, batch, real = self._arguments(state, batch, num_real_microbatches)
        return self._jitted(unaliased(state) if self.options.donate else state, batch, real)


def _check_state(state: Any) -> None:
    if not isinstance(state, train_state.TrainState):
        nnx_model = modules.is_graph_node(state) or isinstance(state, nnx.State)
        hint = "; for a Flax NNX model use jaxga.nnx_train_step" if nnx_model else ""
        got = f"{type(state).__name__}{hint}"
        raise TypeError(f"`state` must be a flax.training.train_state.TrainState; got {got}.")


def _accumulate_state(loss, options, fields, state, batch, *, num_real) -> sharding.OnMesh:
    layout = options.layout
    accumulated = functools.partial(
        accumulate,
        num_microbatches=options.num_microbatches,
        num_real_microbatches=num_real,
        batch_argnums=1,
        state_argnums=2,
        rng_argnums=3,
        axis_name=None if layout is None else layout.loop_axes,
        accumulator_dtype=options.accumulator_dtype,
        unroll=options.unroll,
        canonical_convolutions=options.canonical_convolutions,
    )
    model_state, rng = fields.read(state), fields.step_key(state)
    try:  # the errors a train state's fields explain get a note
        if layout is not None:
            with jax.sharding.use_abstract_mesh(layout.mesh.abstract_mesh):
                return sharding.accumulate_on_mesh(
                    loss,
                    layout,
                    state,
                    batch,
                    accumulate=accumulated,
                    model_state=model_state,
                    rng=rng,
                )
        acc = accumulated(loss)(state.params, batch, model_state, rng)
        return sharding.OnMesh(accumulated=acc, state=state, specs=None, params=state.params)
    except TypeError as e:
        if isinstance(e, StateStructureError):
            e.add_note(f"jaxga: {fields.describe(state)}.")
        elif rng is None:
            e.add_note(f"jaxga: the loss was given rng=None, as {fields.describe(state)}.")
        raise
    except NameError as e:  # JAX's error for a collective over an axis no map binds
        e.add_note("jaxga: a named axis needs a mesh: pass make_train_step(..., axis_name=NAME).")
        raise


def _state_step(loss: Callable[..., Any], options: StepOptions) -> Callable[..., Any]:
    checked = steps.loss_alone(loss, "`loss(params, batch, model_state, rng)`", pair=True)

    def train_step(state: Any, batch: Any, num_real: Any = None) -> tuple[Any, Metrics]:
        _check_state(state)
        if options.offload:
            state = sharding.offload(state, "device")
        fields = state_fields(state, options.model_state_fields, options.rng_field)
        looped = _accumulate_state(checked, options, fields, state, batch, num_real=num_real)
        acc, state = looped.accumulated, looped.state

        def apply_tx(params_and_opt_state, grads):
            params, opt_state = params_and_opt_state
            weight = steps.weight(state.tx, acc)
            updates, opt_state = state.tx.update(grads, opt_state, looped.params, **weight)
            if options.layout is not None:
                updates = sharding.place(options.layout.mesh, updates, looped.specs.params)
            return optax.apply_updates(params, updates), opt_state

        params, opt_state = steps.apply_update(acc, apply_tx, (state.params, state.opt_state))
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        new = fields.write(new, acc.state)
        if options.layout is not None:
            new = sharding.place(options.layout.mesh, new, looped.specs)
        if options.offload:
            new = sharding.offload(new)
        return new, steps.metrics(acc, state.opt_state, opt_state)

    return train_step


def make_train_step(
    loss: Callable[..., Any],
    num_microbatches: int | str = 1,
    *,
    memory_budget: int | str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    axis_name: str | None = None,
    strategy: Any = "data_parallel",
    accumulator_dtype: Any = None,
    donate: bool = True,
    offload: bool = False,
    reduce_once: bool = True,
    unroll: int | bool = 1,
    canonical_convolutions: bool | str = "auto",
    compiler_options: Mapping[str, Any] | None = None,
    model_state_fields: str | Sequence[str] | None = None,
    rng_field: str | None = None,
) -> TrainStep:
    """Builds a jitted train step `(state, batch) -> (state, metrics)` of a Flax `TrainState`.

    Args:
        loss: `loss(params, batch, model_state, rng) -> (loss, new_model_state)`, the loss a
            [`jaxga.Mean`][jaxga.Mean] or a scalar mean over its micro-batch.
        num_microbatches: micro-batches per step (and device), or `"auto"` (`step.plan`).
        memory_budget: with `"auto"`, a device's bytes (`"8GiB"`); `None`: 90 % of its limit.
        mesh: shard the batch over this mesh's `axis_name`; gradients are reduced once.
        axis_name: the batch's mesh axis (`"data"`); without a `mesh`, a one-device mesh of it.
        strategy: the state's layout on the mesh: `"data_parallel"`, `"zero1"`, `"fsdp"`,
            `"zero3"` or specs ([`jaxga.sharding.state_specs`][jaxga.sharding.state_specs]).
        accumulator_dtype: the gradient sums' dtype; `None`: at least float32.
        donate: donate the state's buffers to the step.
        offload: keep the optimiser state in pinned host memory between steps (`sharding.offload`).
        reduce_once: `False` runs the loop in jit's global view of `mesh`, for a model that
            names `axis_name` in its own sharding annotations (exact; JAX then reduces the
            gradient in every micro-batch).
        unroll: the micro-batch loop's `lax.scan` `unroll`; `True` trades memory for speed.
        canonical_convolutions: the loop's convolutions in XLA:CPU's fast layout; `"auto"`:
            on CPU backends only (as for [`jaxga.accumulate`][jaxga.accumulate]).
        compiler_options: XLA options; `None`: [`jaxga.compiler_options()`][jaxga.compiler_options].
        model_state_fields: `state`'s model-state field(s); `None`: jaxga.TrainState's, or guessed.
        rng_field: `state`'s PRNG key field; `None`: jaxga.TrainState's, or guessed.

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
    if callable(getattr(num_microbatches, "update", None)):
        got = f"{num_microbatches=}"
        raise TypeError(f"make_train_step takes no optimiser (it runs state.tx); got {got}.")
    _checks.check_arity(loss, "loss", 4, "`loss(params, batch, model_state, rng)`")
    if mesh is None and axis_name is not None:
        mesh = jax.make_mesh((1,), (axis_name,), devices=jax.local_devices()[:1])
    axis_name = "data" if axis_name is None else axis_name
    sharding.check_strategy(strategy)
    if mesh is not None:
        sharding.check_mesh(mesh, axis_name, concrete=True)
    elif not (isinstance(strategy, str) and strategy == "data_parallel"):
        raise ValueError(f"`strategy`={strategy!r} shards the state over a mesh: pass `mesh`.")
    fields, key = check_field_names(model_state_fields, rng_field)
    once = _checks.check_bool(reduce_once, "reduce_once")
    options = steps.step_options(
        num_microbatches,
        memory_budget=memory_budget,
        accumulator_dtype=accumulator_dtype,
        donate=donate,
        offload=offload,
        unroll=unroll,
        canonical_convolutions=canonical_convolutions,
        compiler_options=compiler_options,
        layout=None if mesh is None else sharding.MeshLayout(mesh, axis_name, strategy, once),
        model_state_fields=fields,
        rng_field=key,
    )
    devices = 1 if mesh is None else sharding.axes_size(mesh, axis_name)
    return TrainStep(_state_step, loss, options, devices)
