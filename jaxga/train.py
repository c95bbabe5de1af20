"""A jitted train step that puts the whole jaxga pipeline together."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxga.accumulation import accumulate
from jaxga.multistep import MultiSteps

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
        rng: raw ``uint32`` PRNG key data; step ``s``, micro-batch ``i`` gets
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

        Example:
            >>> import jax.numpy as jnp, optax, jaxga
            >>> state = jaxga.TrainState.create({"w": jnp.zeros(3)}, optax.sgd(0.1))
            >>> int(state.step), state.rng.dtype
            (0, dtype('uint32'))
        """
        if isinstance(rng, int):
            rng = jax.random.key(rng)
        if jnp.issubdtype(jnp.result_type(rng), jax.dtypes.prng_key):
            rng = jax.random.key_data(rng)
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            model_state={} if model_state is None else model_state,
            rng=jnp.asarray(rng, jnp.uint32),
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
        model = nnx.merge(graphdef, params, model_state)
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


def _mean_over(tree: Any, axis_name: Any) -> Any:
    def reduce(x):
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jax.lax.pmean(x, axis_name)
        return jax.lax.pmax(x, axis_name)

    return jax.tree.map(reduce, tree)


def _describe(batch: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    return {
        jax.tree_util.keystr(path): (tuple(jnp.shape(x))[1:], jnp.result_type(x))
        for path, x in leaves
    }


def _check_batch(expected: dict[str, Any], batch: Any) -> None:
    got = _describe(batch)
    if got == expected:
        return
    problems = [f"missing batch{k}" for k in expected.keys() - got.keys()]
    problems += [f"unexpected batch{k}" for k in got.keys() - expected.keys()]
    problems += [
        f"batch{k} has per-example shape {got[k][0]} and dtype {got[k][1]}, expected "
        f"{expected[k][0]} and {expected[k][1]}"
        for k in expected.keys() & got.keys()
        if got[k] != expected[k]
    ]
    raise ValueError(
        "The batch does not match the one the train step was first built for: "
        + "; ".join(sorted(problems))
        + "."
    )


def make_train_step(
    loss: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    num_microbatches: int = 1,
    *,
    mesh: Mesh | None = None,
    axis_name: str = "data",
    accumulator_dtype: Any = jnp.float32,
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
            the gradients are reduced once per call. Floating model state (e.g.
            BatchNorm statistics) is averaged over devices after the step.
        axis_name: the mesh axis the batch is sharded over.
        accumulator_dtype: dtype of the gradient sums.
        donate: donate the state's buffers to the step.

    Returns:
        The jitted step. ``metrics`` holds ``loss`` (the exact global mean), ``count``
        (items, e.g. tokens), ``grad_norm`` (of the accumulated gradient),
        ``learning_rate`` (from ``optax.inject_hyperparams``, NaN if unknown) and
        ``applied`` (whether the parameters changed on this call).

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
    if isinstance(optimizer, MultiSteps) and not optimizer.weighted:
        raise ValueError(
            "`optimizer` is a jaxga.MultiSteps built with weighted=False, but the train step "
            "weights each call by its item count (Mean.count) so that accumulation across "
            "calls is exact; build it with jaxga.MultiSteps(..., weighted=True)."
        )
    data_axis = axis_name if mesh is not None else None
    seen: dict[str, Any] = {}

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        expected = seen.setdefault("batch", _describe(batch))
        _check_batch(expected, batch)
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        acc = accumulate(
            loss,
            num_microbatches,
            (state.params, batch, state.model_state, rng),
            argnums=0,
            batch_argnums=1,
            state_argnums=2,
            rng_argnums=3,
            axis_name=data_axis,
            accumulator_dtype=accumulator_dtype,
        )
        (grads,), (model_state,) = acc.grads, acc.state
        if data_axis is not None:
            model_state = _mean_over(model_state, data_axis)
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
    if mesh is None:
        return jax.jit(step, donate_argnums=donate_argnums)
    sharded = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(axis_name)), out_specs=(P(), P()))
    return jax.jit(
        sharded,
        donate_argnums=donate_argnums,
        in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P(axis_name))),
    )
