"""A jitted train step that puts the whole jaxga pipeline together."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxga._checks import positive_int
from jaxga.accumulation import accumulate
from jaxga.compiler import compiler_options
from jaxga.multistep import MultiSteps, MultiStepsState
from jaxga.sharding import replicate, shard_batch

__all__ = ["TrainState", "make_train_step", "nnx_loss"]


class TrainState(struct.PyTreeNode):
    """Everything a train step reads and writes, as one pytree of arrays.

    Attributes:
        step: how many times the step has been called (micro-steps count too when the
            optimiser is a :class:`jaxga.MultiSteps`).
        params: the differentiated parameters.
        opt_state: the optax state of the optimiser.
        model_state: state the model updates but does not differentiate, threaded
            through the micro-batches (Linen ``{"batch_stats": ...}``, the non-``Param``
            state of an NNX model); ``{}`` when there is none.
        rng: a typed PRNG key (any implementation); step ``s``, micro-batch ``i`` gets
            ``fold_in(fold_in(rng, s), i)``, so a resumed run draws the same keys.

    Example:
        >>> import jax.numpy as jnp, optax, jaxga
        >>> state = jaxga.TrainState.create({"w": jnp.zeros(3)}, optax.adam(1e-3))
        >>> state = state.replace(params={"w": jnp.ones(3)})  # a pytree: save it, map over it
        >>> int(state.step), state.params["w"].tolist()
        (0, [1.0, 1.0, 1.0])
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array

    @classmethod
    def create(
        cls,
        params: Any,
        optimizer: optax.GradientTransformation,
        *,
        model_state: Any = None,
        rng: jax.Array | int = 0,
    ) -> TrainState:
        """Returns the initial state for ``params`` and ``optimizer``.

        ``params`` and ``model_state`` are copied: the train step donates the state's
        buffers, which would otherwise delete arrays you still hold (an NNX model's
        own parameters, say). ``rng`` is an integer seed or a PRNG key.

        Example:
            >>> import jax.numpy as jnp, optax, jaxga
            >>> state = jaxga.TrainState.create({"w": jnp.zeros(3)}, optax.sgd(0.1), rng=1)
            >>> int(state.step), state.rng.shape
            (0, ())
        """
        model_state = {} if model_state is None else model_state
        params, model_state = jax.tree.map(_copy, (params, model_state))
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            model_state=model_state,
            rng=_as_key(rng),
        )


def _copy(x: Any) -> Any:
    """A copy of the same kind (host arrays stay on the host, for ``jax.distributed``)."""
    return x.copy() if isinstance(x, np.ndarray) else jnp.array(x, copy=True)


def _as_key(rng: Any) -> jax.Array:
    """A typed PRNG key from a seed, a typed key or raw ``uint32`` key data."""
    dtype, shape = jnp.result_type(rng), jnp.shape(rng)
    if jnp.issubdtype(dtype, jax.dtypes.prng_key) and shape == ():
        return rng
    if jnp.issubdtype(dtype, jnp.integer) and shape == ():
        return jax.random.key(rng)
    if dtype == jnp.uint32 and shape == (2,):
        return jax.random.wrap_key_data(rng)
    raise TypeError(
        f"`rng` must be an integer seed or a single PRNG key; got dtype {dtype} and shape {shape}."
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
    from flax import nnx

    def functional(params, batch, model_state, rng):
        # copy=True: fresh Variables of this trace, so the model may update its state
        # (BatchNorm statistics, its own Rngs) inside the micro-batch loop.
        model = nnx.merge(graphdef, params, model_state, copy=True)
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


def _mean_over(tree: Any, before: Any, axis_name: Any) -> Any:
    """Floating leaves: the mean over devices; others (counters, flags, keys): the max.

    Floats are averaged as ``before + mean(x - before)``, so a leaf no device changed
    (BatchNorm statistics in eval mode) stays bit for bit what it was.
    """

    def reduce(x, old):
        if jnp.issubdtype(x.dtype, jnp.floating):
            return old + jax.lax.pmean(x - old, axis_name)
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # e.g. an NNX RngKey
            data = jax.lax.pmax(jax.random.key_data(x), axis_name)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.lax.pmax(x, axis_name)

    return jax.tree.map(reduce, tree, before)


def _leaf_paths(tree: Any) -> frozenset[str]:
    return frozenset(
        jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    )


def _check_batch(expected: frozenset[str], batch: Any) -> None:
    """Raises if ``batch`` has other leaves than the batch the step was first called with.

    Only the leaves are compared: per-example shapes may change (length buckets), and
    the step retraces for them as any jitted function does.
    """
    got = _leaf_paths(batch)
    if got != expected:
        problems = [f"missing batch{k}" for k in sorted(expected - got)]
        problems += [f"unexpected batch{k}" for k in sorted(got - expected)]
        raise ValueError(
            "The batch does not have the leaves of the batch the train step was first "
            f"called with: {'; '.join(problems)}."
        )


def _multisteps_states(opt_state: Any) -> list[MultiStepsState]:
    is_state = lambda x: isinstance(x, MultiStepsState)
    return [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]


def make_train_step(
    loss: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    num_microbatches: int = 1,
    *,
    mesh: Mesh | None = None,
    axis_name: str = "data",
    accumulator_dtype: Any = None,
    donate: bool = True,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """Builds one jitted train step ``(state, batch) -> (state, metrics)``.

    The step splits ``batch`` into ``num_microbatches`` micro-batches, accumulates
    the loss and gradients exactly with :func:`jaxga.accumulate` (a fresh PRNG key
    per micro-batch, model state threaded from one micro-batch to the next),
    applies ``optimizer`` and returns the new state. The state's buffers are
    donated, so the old state must not be used after the call.

    Args:
        loss: ``loss(params, batch, model_state, rng) -> (loss, new_model_state)``,
            where ``loss`` is a :class:`jaxga.Mean` (exact for masked and
            variable-length losses) or a scalar mean over its micro-batch. For Flax
            NNX, :func:`nnx_loss` builds it from ``loss(model, batch, rng)``; for Linen,
            call ``model.apply({"params": params, **model_state}, ..., rngs=...,
            mutable=list(model_state))``.
        optimizer: any optax transformation. A :class:`jaxga.MultiSteps` (built with
            ``weighted=True``) receives the call's item count as ``weight``, so
            accumulation across calls is exact too.
        num_microbatches: micro-batches per call.
        mesh: data parallelism: the batch is sharded over ``mesh``'s ``axis_name``
            axis, the state replicated, each device scans its own micro-batches and
            the gradients are reduced once per call. A batch of host (numpy) arrays
            holds this process's rows and is placed with
            :func:`jaxga.sharding.shard_batch`; a state not yet on the mesh is
            replicated. Model state is threaded per device; then floating leaves
            (BatchNorm statistics) are averaged over devices and the others
            (counters, keys) take their maximum. See ``docs/distributed.md``.
        axis_name: the mesh axis the batch is sharded over.
        accumulator_dtype: dtype of the gradient sums; ``None`` (default) is at least
            float32, an explicit dtype is used as given.
        donate: donate the state's buffers to the step.

    Returns:
        The jitted step. ``metrics`` holds ``loss`` (the exact global mean), ``count``
        (items, e.g. tokens; for a scalar loss, micro-batches over all devices),
        ``grad_norm`` (of the accumulated gradient),
        ``learning_rate`` (from ``optax.inject_hyperparams``, NaN if unknown) and
        ``applied`` (whether the parameters changed on this call). With ``mesh``, the
        step places its arguments and calls the jitted step; ``step.lower(state,
        batch)`` lowers that.

    Example:
        >>> import jax, jax.numpy as jnp, optax, jaxga
        >>> def loss(params, batch, model_state, rng):
        ...     return jaxga.Mean.of((batch["x"] @ params - batch["y"]) ** 2), model_state
        >>> state = jaxga.TrainState.create(jnp.zeros(3), optax.sgd(0.1))
        >>> step = jaxga.make_train_step(loss, optax.sgd(0.1), num_microbatches=4)
        >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.ones(8)}
        >>> state, metrics = step(state, batch)
        >>> float(metrics["loss"]), int(metrics["count"]), int(state.step)
        (1.0, 8, 1)
    """
    positive_int(num_microbatches, "num_microbatches")
    if not callable(loss):
        raise TypeError(f"`loss` must be a function; got {type(loss).__name__}.")
    if not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise TypeError(
            f"`optimizer` must be an optax GradientTransformation; got {type(optimizer).__name__}."
        )
    if mesh is not None and axis_name not in mesh.axis_names:
        raise ValueError(f"`axis_name`={axis_name!r} is not an axis of `mesh` {mesh.axis_names}.")
    if isinstance(optimizer, MultiSteps) and not optimizer.weighted:
        raise ValueError(
            "`optimizer` is a jaxga.MultiSteps built with weighted=False, but the train step "
            "weights each call by its item count (Mean.count) so that accumulation across "
            "calls is exact; build it with jaxga.MultiSteps(..., weighted=True)."
        )
    data_axis = axis_name if mesh is not None else None
    seen: dict[str, Any] = {}

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        _check_batch(seen.setdefault("batch", _leaf_paths(batch)), batch)
        if not isinstance(optimizer, MultiSteps) and _multisteps_states(state.opt_state):
            raise ValueError(
                "`optimizer` has a jaxga.MultiSteps inside another transformation; the "
                "train step hands it each call's item count only when it is the outermost "
                "one: build jaxga.MultiSteps(optax.chain(...), every_k, weighted=True)."
            )
        rng = jax.random.fold_in(state.rng, state.step)
        acc = accumulate(
            loss,
            num_microbatches=num_microbatches,
            batch_argnums=1,
            state_argnums=2,
            rng_argnums=3,
            axis_name=data_axis,
            accumulator_dtype=accumulator_dtype,
        )(state.params, batch, state.model_state, rng)
        grads, model_state = acc.grads, acc.state
        extra = {"weight": acc.mean.count} if isinstance(optimizer, MultiSteps) else {}
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params, **extra)
        has_updated = getattr(optimizer, "has_updated", None)
        metrics = {
            "loss": acc.mean.value,
            "count": acc.mean.count,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": _learning_rate(opt_state),
            "applied": jnp.asarray(True if has_updated is None else has_updated(opt_state)),
        }
        new_state = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            opt_state=opt_state,
            model_state=model_state,
        )
        return new_state, metrics

    donate_argnums = (0,) if donate else ()
    options = compiler_options()  # on a GPU: no zero-filled scan buffers (jaxga.compiler)
    if mesh is None:
        return jax.jit(step, donate_argnums=donate_argnums, compiler_options=options)
    sharded = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(axis_name)), out_specs=(P(), P()))
    jitted = jax.jit(
        sharded,
        donate_argnums=donate_argnums,
        in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P(axis_name))),
        compiler_options=options,
    )

    return _MeshStep(jitted, mesh, axis_name)


class _MeshStep:
    """The train step on a mesh: places its arguments, then calls the jitted step.

    A host batch holds this process's rows: it is placed on the mesh with
    :func:`jaxga.sharding.shard_batch`, as jit alone cannot (an explicit mesh's
    ``shard_map`` rejects unsharded inputs, and with several processes jit takes only
    global arrays). A state not yet on the mesh (fresh from ``TrainState.create``) is
    replicated first, so that the first call compiles the step the later calls use.
    ``lower`` and ``trace`` take arrays or ``jax.ShapeDtypeStruct``s of the global
    shapes, so :func:`jaxga.memory_report` and :func:`jaxga.plan` work on the step.
    """

    def __init__(self, jitted: Any, mesh: Mesh, axis_name: str):
        self.jitted, self.mesh, self.axis_name = jitted, mesh, axis_name

    def _place(self, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((state, batch))):
            return state, batch
        on_mesh = lambda x: getattr(getattr(x, "sharding", None), "mesh", None) == self.mesh
        if not all(on_mesh(x) for x in jax.tree.leaves(state)):
            state = replicate(state, self.mesh)
        return state, shard_batch(batch, self.mesh, self.axis_name)

    def _abstract(self, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
        """Arrays or shape structs as shape structs placed as the step takes them."""

        def spec(partition):
            sharding = NamedSharding(self.mesh, partition)
            return lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype, sharding=sharding)

        return jax.tree.map(spec(P()), state), jax.tree.map(spec(P(self.axis_name)), batch)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        return self.jitted(*self._place(state, batch))

    def lower(self, state: TrainState, batch: Any) -> Any:
        return self.jitted.lower(*self._abstract(state, batch))

    def trace(self, state: TrainState, batch: Any) -> Any:
        return self.jitted.trace(*self._abstract(state, batch))
