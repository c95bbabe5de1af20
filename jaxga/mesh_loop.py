"""The train step's accumulation on a mesh: the loop in a ``shard_map`` over the batch's
axes (and a pipeline's stage axis), the state gathered and the gradient reduced once."""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxga import _checks, collectives
from jaxga.engine import Accumulated
from jaxga.microbatch import IndivisibleBatchError
from jaxga.sharding import MeshLayout, axes_size, fsdp_specs, is_spec, place, state_specs


class OnMesh(NamedTuple):
    """What the loop on a mesh gives the train step."""

    accumulated: Accumulated  # gradients laid out as the optimiser state (ZeRO-1: sharded)
    state: Any  # the train state, laid out
    specs: Any  # the train state's PartitionSpecs
    params: Any  # the parameters as the optimiser sees them, laid out as the gradients


def _split_over(spec: P, axis_name: Any, *, batch: bool) -> P:
    """``spec``'s entries naming the batch's axes (``batch``), or naming the others only."""
    batch_axes = set(collectives.axes(axis_name))

    def entry(e: Any) -> Any:
        return tuple(a for a in collectives.axes(e or ()) if (a in batch_axes) == batch) or None

    return P(*map(entry, spec))


def _on_split_axes(fn: Callable[..., Any], tree: Any, specs: Any) -> Any:
    """``fn(x, axis=...)`` on the leaves whose (batch-axes) spec splits an axis; others as is."""

    def apply(x: Any, spec: P) -> Any:
        axis = next((i for i, entry in enumerate(spec) if entry is not None), None)
        return x if axis is None else fn(x, axis=axis)

    return jax.tree.map(apply, tree, specs, is_leaf=is_spec)


def accumulate_on_mesh(
    loss: Callable[..., Any],
    layout: MeshLayout,
    state: Any,
    batch: Any,
    *,
    accumulate: Callable[[Callable[..., Any]], Callable[..., Accumulated]],
    model_state: Any,
    rng: Any,
) -> OnMesh:
    """``accumulate(loss)`` over ``layout.mesh``: the batch split over ``layout.axis_name``.

    With ``layout.pipeline_axis``, that axis is manual in the loop too: each stage's
    parameters (split over it by ``strategy``'s specs) stay on it, and `jaxga.pipeline_scan`
    runs there directly.

    In a ``shard_map`` over the batch's axes alone (the mesh's other axes stay in jit's
    global view): ``"fsdp"`` gathers the parameters once before the loop and reduce-scatters
    the gradients once after it, ``"zero1"`` reduce-scatters them as the optimiser state,
    ``"zero3"`` gathers in every micro-batch. ``reduce_once=False``: the loop in jit's global
    view instead, the parameters gathered once, JAX reducing in every micro-batch.
    """
    mesh, axis_name, strategy = layout.mesh, layout.axis_name, layout.strategy
    k, devices = accumulate(loss).options.num_microbatches, axes_size(mesh, axis_name)
    size = _checks.leading_size(batch, "batch", "batch") or 0  # 0: no leaves, as accumulate says
    if size % (devices * k):
        raise IndivisibleBatchError.of(size, k, devices, axis_name)
    specs = state_specs(state, mesh, strategy, axis_name=axis_name)
    state = place(mesh, state, specs)
    batch = place(mesh, batch, jax.tree.map(lambda _: P(axis_name), batch))
    grad_specs = fsdp_specs(state.params, mesh, axis_name) if strategy == "zero1" else specs.params
    gather = functools.partial(_split_over, axis_name=axis_name, batch=False)
    gathered = jax.tree.map(gather, specs.params, is_leaf=is_spec)
    manual = manual_axes(layout)
    others = [t for a, t in zip(mesh.axis_names, mesh.axis_types) if a not in manual]
    if strategy == "zero3" and (AxisType.Explicit in others or not layout.reduce_once):
        raise ValueError(f"`strategy`='zero3' {_ZERO3_GATHERS}; got {mesh}.")
    if layout.pipeline_axis is not None:
        fix = f"give `strategy` specs with P({layout.pipeline_axis!r}) on the stacked layers"
        check_stages(layout, specs.params, fix)
    if not layout.reduce_once or AxisType.Explicit in others:  # gathered once; the engine's
        # route reduces (all-reduced: jax 0.12 cannot reduce-scatter beside Explicit axes)
        params = place(mesh, state.params, gathered)
        accumulated = accumulate(loss)(params, batch, model_state, rng)
    else:  # gathered once, reduce-scattered once (ZeRO-3: gathered per micro-batch)
        loop = _sharded_loop(loss, layout, specs.params, grad_specs, accumulate)
        accumulated = loop(state.params, batch, model_state, rng)
    grads = place(mesh, accumulated.grads, grad_specs)
    return OnMesh(
        accumulated=accumulated._replace(grads=grads),
        state=state,
        specs=specs,
        params=place(mesh, state.params, grad_specs),
    )


def check_pipeline_axis(mesh: Any, axis_name: Any, pipeline_axis: Any, reduce_once: bool) -> None:
    """Raises unless ``pipeline_axis`` (a train step's argument) can be ``mesh``'s stage axis."""
    if pipeline_axis is None:
        return
    if mesh is None:
        raise ValueError(f"`pipeline_axis`={pipeline_axis!r} needs a `mesh` with that axis.")
    if pipeline_axis not in mesh.axis_names:
        got = f"{pipeline_axis!r} is not an axis of `mesh` {mesh.axis_names}"
        raise ValueError(f"`pipeline_axis`={got}.")
    if pipeline_axis in collectives.axes(axis_name):
        raise ValueError(f"`pipeline_axis`={pipeline_axis!r} is the batch's `axis_name` too.")
    if not reduce_once:
        raise ValueError("`pipeline_axis` needs reduce_once=True: the loop runs in a shard_map.")


def check_stages(layout: MeshLayout, param_specs: Any, fix: str) -> None:
    """Raises unless a pipeline's stage axis splits some parameters and the mesh's other
    axes (those the loop leaves in jit's global view) are Auto; ``fix`` says how to split."""
    specs = jax.tree.leaves(param_specs, is_leaf=is_spec)
    named = [s for s in specs if any(layout.pipeline_axis in collectives.axes(e or ()) for e in s)]
    if not named:
        raise ValueError(f"`pipeline_axis`={layout.pipeline_axis!r} splits no parameter: {fix}.")
    others = [a for a in layout.mesh.axis_names if a not in manual_axes(layout)]
    types = dict(zip(layout.mesh.axis_names, layout.mesh.axis_types))
    if any(types[a] == AxisType.Explicit for a in others):
        raise ValueError(
            f"`pipeline_axis` needs the mesh's other axes {others} Auto, not Explicit."
        )


def manual_axes(layout: MeshLayout) -> tuple[Any, ...]:
    """The axes the loop's ``shard_map`` makes manual: the batch's, and a pipeline's."""
    pipeline = (layout.pipeline_axis,) if layout.pipeline_axis else ()
    return (*collectives.axes(layout.axis_name), *pipeline)


def part(specs: Any, axes: tuple[Any, ...]) -> Any:
    """Each spec of ``specs`` with its entries over ``axes`` alone."""
    return jax.tree.map(
        functools.partial(_split_over, axis_name=axes, batch=True), specs, is_leaf=is_spec
    )


def _sharded_loop(
    loss: Callable[..., Any],
    layout: MeshLayout,
    param_specs: Any,
    grad_specs: Any,
    accumulate: Callable[[Callable[..., Any]], Callable[..., Accumulated]],
) -> Callable[..., Accumulated]:
    """`_local_accumulation` in a ``shard_map`` over `manual_axes`: ``(params, batch,
    model_state, rng) -> Accumulated``, the gradients laid out as ``grad_specs``."""
    batch_axes, manual = collectives.axes(layout.axis_name), manual_axes(layout)
    in_specs, out_specs = part(param_specs, batch_axes), part(grad_specs, batch_axes)
    local = _local_accumulation(loss, layout, in_specs, out_specs, accumulate)
    grads = part(grad_specs, manual)  # a pipeline's stages keep their own parameters
    return jax.shard_map(
        local,
        in_specs=(part(param_specs, manual), P(layout.axis_name), P(), P()),
        out_specs=Accumulated(mean=P(), grads=grads, aux=P(), state=P()),
        axis_names=set(manual),
    )


_ZERO3_GATHERS = (
    "gathers in every micro-batch in a shard_map over the batch's axes, which needs "
    "reduce_once=True and no other Explicit mesh axes (JAX 0.12 cannot differentiate the "
    "gather beside them): use 'fsdp', or make the other axes Auto"
)


def _local_accumulation(
    loss: Callable[..., Any],
    layout: MeshLayout,
    in_specs: Any,
    out_specs: Any,
    accumulate: Callable[[Callable[..., Any]], Callable[..., Accumulated]],
) -> Callable[..., Accumulated]:
    """One device's accumulation in `accumulate_on_mesh`'s ``shard_map`` (manual axes)."""
    axis_name = layout.axis_name
    gather = functools.partial(jax.lax.all_gather, axis_name=axis_name, tiled=True)

    def scatter(x: jax.Array, axis: int) -> jax.Array:
        return jax.lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True)

    def varying(x: jax.Array, axis: int) -> jax.Array:  # summed by the scatter, not by the loop
        return collectives.varying(x, axis_name)

    def on_shards(shards, batch, model_state, rng):  # ZeRO-3: gathered per micro-batch
        shards, batch = jax.lax.optimization_barrier((shards, batch))  # no hoisting of the gather
        return loss(_on_split_axes(gather, shards, in_specs), batch, model_state, rng)

    def local(params, batch, model_state, rng):
        if layout.strategy == "zero3":
            return accumulate(on_shards)(params, batch, model_state, rng)
        full = _on_split_axes(varying, _on_split_axes(gather, params, in_specs), out_specs)
        acc = accumulate(loss)(full, batch, model_state, rng)
        return acc._replace(grads=_on_split_axes(scatter, acc.grads, out_specs))

    return local
