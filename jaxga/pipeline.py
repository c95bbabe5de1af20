"""Pipeline parallelism: a stack of layers split into stages over a mesh axis, micro-batches
streamed through them, in one SPMD program (GPipe, and circular with repeats)."""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxga import collectives
from jaxga._checks import check_arity, positive_int
from jaxga.microbatch import IndivisibleBatchError, merge_microbatches, split_microbatches
from jaxga.remat import Policy, remat_scan, stack_length

SCHEDULES = ("gpipe", "circular")


class Schedule(NamedTuple):
    """A pipeline's shape: ``stages`` S, ``microbatches`` m, ``repeats`` r (chunks a stage holds).

    Stage ``s`` runs work item ``w = t - s`` at iteration ``t``: micro-batch ``w % m``
    through its chunk ``w // m``; ``m · r + S - 1`` iterations, ``S - 1`` of each stage's
    idle (the bubble, `bubble`).
    """

    stages: int
    microbatches: int
    repeats: int

    @property
    def iterations(self) -> int:
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble(self) -> float:
        """The fraction of each stage's iterations that is idle: ``(S - 1) / (m · r + S - 1)``."""
        return (self.stages - 1) / self.iterations


def pipeline_order(stacked_params: Any, stages: int, repeats: int = 1) -> Any:
    """The layer stack reordered so that stage ``s`` holds, contiguously, the layers it runs.

    With ``repeats`` r, layer ``l`` belongs to chunk ``l // (L / (S · r))``, and chunk ``c``
    to stage ``c % S``: stage ``s`` runs chunks ``s, s + S, ...``. Laid out over the stage
    axis (``P(axis_name)`` on the layer axis), each stage then holds its own layers: the
    weights never move. With ``repeats=1`` this is the stack as it is.

    Args:
        stacked_params: a pytree of arrays with a leading layer axis L, in layer order.
        stages: S, the size of the stage axis.
        repeats: r, the chunks each stage holds (`pipeline_scan`'s ``repeats``).

    Returns:
        The same arrays, the layer axis reordered; `pipeline_scan` reads this order.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> jaxga.pipeline_order(jnp.arange(8), stages=2, repeats=2).tolist()
        [0, 1, 4, 5, 2, 3, 6, 7]
    """
    num_layers = stack_length(stacked_params)
    _check_layers(num_layers, stages, repeats)
    layers = np.arange(num_layers).reshape(repeats, stages, -1).swapaxes(0, 1).reshape(-1)

    def reorder(p: Any) -> jax.Array:  # a gather: laid out over Explicit axes, it stays so
        where = jax.typeof(p).sharding
        explicit = AxisType.Explicit in getattr(where.mesh, "axis_types", ())
        return jnp.asarray(p).at[layers].get(out_sharding=where if explicit else None)

    return jax.tree.map(reorder, stacked_params)


def _check_layers(num_layers: int, stages: int, repeats: int) -> None:
    if num_layers % (stages * repeats):
        got = f"L={num_layers} layers for S={stages} stages × r={repeats} repeats"
        raise ValueError(f"`stacked_params` must hold a multiple of S · r layers; got {got}.")


def _stage_mesh(axis_name: str, stacked_params: Any, mesh: Any) -> tuple[str, Any]:
    """Whether the stage axis is ``"manual"`` here or to be ``"opened"``, and its mesh."""
    context = jax.sharding.get_abstract_mesh()
    if axis_name in context.axis_names:
        manual = dict(zip(context.axis_names, context.axis_types))[axis_name] == AxisType.Manual
        if manual or mesh is None:
            return ("manual" if manual else "opened"), context
    if mesh is not None:
        if axis_name not in mesh.axis_names:
            got = f"{axis_name!r} is not an axis of `mesh` {mesh.axis_names}"
            raise ValueError(f"`axis_name`={got}.")
        return "opened", mesh
    for leaf in jax.tree.leaves(stacked_params):  # Explicit axes: the type says
        typed = getattr(jax.typeof(leaf), "sharding", None)
        if axis_name in getattr(getattr(typed, "mesh", None), "axis_names", ()):
            return "opened", typed.mesh
    raise ValueError(
        f"`axis_name`={axis_name!r} is not an axis of the mesh here: lay `stacked_params` out "
        f"on a mesh with it (Explicit axes), call under jax.set_mesh(mesh), or pass `mesh`."
    )


def take(tree: Any, index: Any) -> Any:
    """Each leaf's entry ``index`` of its leading axis (a traced index)."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False), tree)


def put(tree: Any, index: Any, value: Any, where: Any) -> Any:
    """``tree`` with entry ``index`` of its leading axis set to ``value`` where ``where``."""

    def put(x, v):
        return jax.lax.dynamic_update_index_in_dim(x, jnp.where(where, v, x[index]), index, 0)

    return jax.tree.map(put, tree, value)


def select(where: Any, a: Any, b: Any) -> Any:
    """``a`` where ``where``, else ``b``: two trees alike."""
    return jax.tree.map(lambda x, y: jnp.where(where, x, y), a, b)


class Stages(NamedTuple):
    """What every stage runs: the layers, the schedule, the stage axis (`_run_stages`)."""

    layer_fn: Callable[..., Any]  # (params, x) or, with a key, (params, x, key)
    policy: Policy
    schedule: Schedule
    axis: str


def run_stage(stages: Stages, chunk: Any, ids: jax.Array, x: Any, key: Any) -> Any:
    """One chunk of a stage's layers (``[L / (S · r), ...]``, global layer ``ids``) on ``x``."""

    def layer(params_and_id: tuple, x: Any) -> Any:
        params, layer_id = params_and_id
        if key is None:
            return stages.layer_fn(params, x)
        return stages.layer_fn(params, x, jax.random.fold_in(key, layer_id))

    return remat_scan(layer, (chunk, ids), x, policy=stages.policy)


def _run_stages(stages: Stages, params: Any, x: Any, key: Any) -> Any:
    """One stage's part of the pipeline, inside a ``shard_map`` over the stage axis.

    ``params``: this stage's layers, ``[r · L / (S · r), ...]``; ``x``: the whole carry,
    split here into m micro-batches. A bubble iteration runs the layers on a real
    micro-batch, never on what the stage holds (zeros, NaN, garbage), and its result is
    dropped: no value or gradient depends on it. Returns the last stage's outputs, on
    every stage.
    """
    plan, axis = stages.schedule, stages.axis
    stage, last = jax.lax.axis_index(axis), plan.stages - 1
    m, items = plan.microbatches, plan.microbatches * plan.repeats
    chunks = jax.tree.map(lambda p: jnp.reshape(p, (plan.repeats, -1, *p.shape[1:])), params)
    size = jax.tree.leaves(chunks)[0].shape[1]  # layers a chunk
    ids = (jnp.arange(plan.repeats)[:, None] * plan.stages + stage) * size + jnp.arange(size)
    xs = split_rows(x, m, "x")
    zeros = collectives.varying(jax.tree.map(jnp.zeros_like, xs), (axis,))
    ring = [(s, (s + 1) % plan.stages) for s in range(plan.stages)]

    def run_chunk(chunks: Any, c: jax.Array, x: Any, key: Any) -> Any:  # sliced inside:
        return run_stage(stages, take(chunks, c), ids[c], x, key)  # no weights saved a step

    run = jax.checkpoint(run_chunk, policy=jax.checkpoint_policies.nothing_saveable)

    def iteration(carry: tuple, t: jax.Array) -> tuple:
        held, stored, outputs = carry  # from the stage before; stage 0's repeats; results
        w = t - stage
        valid = (w >= 0) & (w < items)
        chunk, i = jnp.clip(w, 0, items - 1) // m, jnp.clip(w, 0, items - 1) % m
        first = select(chunk == 0, take(xs, i), take(stored, i))  # stage 0: fresh or around
        given = select(stage == 0, first, held)
        given = select(valid, given, take(xs, i))  # a bubble runs on a real micro-batch
        micro_key = None if key is None else jax.random.fold_in(key, i)
        out = run(chunks, chunk, given, micro_key)  # not in a cond: the weights stay loop
        # constants of the scan's backward (a cond would save them at every iteration)
        done = valid & (stage == last) & (chunk == plan.repeats - 1)
        outputs = put(outputs, i, out, done)
        passed = jax.lax.ppermute(out, axis, ring)  # stage S - 1's goes around to stage 0
        w_last = t - last  # the item stage S - 1 finished: kept by stage 0 for its next chunk
        keep = (stage == 0) & (w_last >= 0) & (w_last < items)
        stored = put(stored, jnp.clip(w_last, 0, items - 1) % m, passed, keep)
        return (passed, stored, outputs), None

    carry = (take(zeros, 0), zeros, zeros)
    (_, _, outputs), _ = jax.lax.scan(iteration, carry, jnp.arange(plan.iterations))
    outputs = jax.lax.psum(select(stage == last, outputs, zeros), axis)  # on every stage
    return merge_microbatches(outputs)


class _Opened(NamedTuple):
    """The ``shard_map``s of a pipeline jaxga opens: the forward, and its backward."""

    forward: Callable[..., Any]  # (params, x, key) -> y
    backward: Callable[..., Any]  # (params, x, key, dy) -> (dparams, dx)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _opened(maps: _Opened, params: Any, x: Any, key: Any) -> Any:
    return maps.forward(params, x, key)


def _opened_forward(maps: _Opened, params: Any, x: Any, key: Any) -> tuple[Any, tuple]:
    return maps.forward(params, x, key), (params, x, key)


def _opened_backward(maps: _Opened, inputs: tuple, dy: Any) -> tuple[Any, Any, None]:
    return (*maps.backward(*inputs, dy), None)


_opened.defvjp(_opened_forward, _opened_backward)


def _open(stages: Stages, mesh: Any) -> _Opened:
    """`_run_stages` in ``shard_map``s over the stage axis alone, forward and backward.

    The backward runs the forward again inside its own ``shard_map``: JAX cannot yet carry
    a nested ``shard_map``'s residuals out of it (inside jaxga's own over the batch's axes).
    """
    run = functools.partial(_run_stages, stages)

    def backward(params: Any, x: Any, key: Any, dy: Any) -> tuple[Any, Any]:
        return jax.vjp(lambda p, x: run(p, x, key), params, x)[1](dy)

    def shard(fun: Callable[..., Any], specs: tuple, out: Any) -> Callable[..., Any]:
        names = {"in_specs": specs, "out_specs": out, "axis_names": {stages.axis}}
        return jax.shard_map(fun, mesh=mesh, **names)

    stage_axis = P(stages.axis)
    return _Opened(
        forward=shard(run, (stage_axis, P(), P()), P()),
        backward=shard(backward, (stage_axis, P(), P(), P()), (stage_axis, P())),
    )


def split_rows(x: Any, m: int, name: str) -> Any:
    """``x``'s rows as the pipeline's m micro-batches (`split_microbatches`); an
    `IndivisibleBatchError` says that they are the pipeline's, not jaxga's accumulation's."""
    try:
        return split_microbatches(x, m, name=name)
    except IndivisibleBatchError as e:
        raise IndivisibleBatchError(f"{e} (the pipeline's micro-batches of `{name}`)") from None


def plan_stages(
    layer_fn: Callable[..., Any],
    stacked_params: Any,
    *,
    num_microbatches: int,
    axis_name: str,
    policy: Policy,
    rng: Any,
    mesh: Any,
    repeats: int = 1,
) -> tuple[Stages, str, Any]:
    """A pipeline's arguments checked: its `Stages`, whether the stage axis is
    ``"manual"`` here or to be ``"opened"``, and the mesh."""
    repeats = positive_int(repeats, "repeats")
    signature = "layer_fn(params_of_one_layer, x" + (", key) -> x" if rng is not None else ") -> x")
    check_arity(layer_fn, "layer_fn", 2 if rng is None else 3, signature)
    kind, mesh = _stage_mesh(axis_name, stacked_params, mesh)
    m = positive_int(num_microbatches, "num_microbatches")
    plan = Schedule(mesh.shape[axis_name], m, repeats)
    if plan.microbatches < plan.stages:
        at_least = f"at least the S={plan.stages} stages (and divide x's rows)"
        got = f"{plan.microbatches}; it must be {at_least}"
        raise ValueError(f"`num_microbatches`={got}.")
    if kind == "manual" and any(
        axis_name not in collectives.varying_axes(x) for x in jax.tree.leaves(stacked_params)
    ):
        fix = (
            f"lay the layer axis out over it: P({axis_name!r}) in your shard_map's in_specs, "
            "a train step's strategy specs, or the variables' sharding metadata"
        )
        raise ValueError(f"`stacked_params` are the same on every stage of {axis_name!r}: {fix}.")
    layers = stack_length(stacked_params) * (plan.stages if kind == "manual" else 1)  # L
    _check_layers(layers, plan.stages, repeats)
    return Stages(layer_fn, policy, plan, axis_name), kind, mesh


def pipeline_scan(
    layer_fn: Callable[..., Any],
    stacked_params: Any,
    x: Any,
    *,
    num_microbatches: int,
    axis_name: str = "stage",
    schedule: str = "gpipe",
    repeats: int = 1,
    policy: Policy = "full",
    rng: jax.Array | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> Any:
    """``for p in stacked_params: x = layer_fn(p, x)``, its layers split into pipeline stages.

    The S devices of ``axis_name`` each run L / S of the layers (their weights never move:
    lay ``stacked_params`` out with ``P(axis_name)`` on the layer axis, in
    [`pipeline_order`][jaxga.pipeline_order]); ``x``'s rows are split into m micro-batches
    (micro-batch ``i``: rows ``i, i + m, ...``) that stream through the stages, activations
    passed on with ``ppermute``. ``"gpipe"``: each micro-batch once through S stages;
    ``"circular"``: through each stage ``repeats`` times, a chunk of layers each time, which
    shrinks the idle bubble to ``(S - 1) / (r · m + S - 1)``. Each stage's layers run as
    [`remat_scan`][jaxga.remat_scan] with ``policy``; only a stage's inputs are kept for the
    backward pass. Results and gradients are those of the layers applied in order.

    Call it in jit's global view (jaxga opens a ``shard_map`` over ``axis_name`` alone),
    inside jaxga's accumulation or ``shard_map`` over other axes, or inside your own
    ``shard_map`` over ``axis_name``.

    Args:
        layer_fn: ``layer_fn(params_of_one_layer, x) -> x``, keeping ``x``'s shapes and
            dtypes; with ``rng``, ``layer_fn(params_of_one_layer, x, key)``.
        stacked_params: the layers' parameters, a leading layer axis L, in `pipeline_order`.
        x: the carry, an array or pytree of arrays with a leading batch axis.
        num_microbatches: m, at least S, dividing the batch.
        axis_name: the mesh axis of the stages.
        schedule: ``"gpipe"`` or ``"circular"``.
        repeats: r, the chunks of layers each stage holds (``"circular"``; 1 for ``"gpipe"``).
        policy: each layer's checkpoint policy, as for `remat_scan`.
        rng: a PRNG key: layer ``l`` on micro-batch ``i`` gets ``fold_in(fold_in(rng, i), l)``.
        mesh: the mesh, if neither the context (``jax.set_mesh``) nor the params' types say.

    Returns:
        The last layer's output, like ``x``, the same on every stage.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
        >>> stack = jnp.full((4, 3, 3), 0.1)  # 4 layers, 2 on each stage
        >>> w = jax.device_put(stack, jax.NamedSharding(mesh, jax.P("stage")))
        >>> def layer(w, x):
        ...     return jnp.tanh(x @ w)
        >>> def forward(w, x):
        ...     return jaxga.pipeline_scan(layer, w, x, num_microbatches=2)
        >>> y = jax.jit(forward)(w, jnp.ones((4, 3)))
        >>> bool(jnp.allclose(y, jaxga.remat_scan(layer, stack, jnp.ones((4, 3)))))
        True
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"`schedule` must be one of {SCHEDULES}; got {schedule!r}.")
    if schedule == "gpipe" and repeats != 1:
        raise ValueError(f"`repeats`={repeats} needs schedule='circular'; 'gpipe' runs one chunk.")
    options = {"num_microbatches": num_microbatches, "axis_name": axis_name, "policy": policy}
    stages, kind, mesh = plan_stages(
        layer_fn, stacked_params, repeats=repeats, rng=rng, mesh=mesh, **options
    )
    if kind == "manual":
        return _run_stages(stages, stacked_params, x, rng)
    return _opened(_open(stages, mesh), stacked_params, x, rng)
