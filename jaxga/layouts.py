"""A train step's state on a mesh: laid out by its strategy, and the engine's one loop onto
the mesh told where the parameters lie (`collectives.Placement`)."""

from typing import Any, NamedTuple

import jax

from jaxga import _checks, collectives, meshes
from jaxga.accumulation import Accumulate
from jaxga.engine import Accumulated
from jaxga.microbatch import IndivisibleBatchError
from jaxga.sharding import (
    MeshLayout,
    batch_specs,
    check_mesh,
    check_strategy,
    place,
    split_of,
    state_specs,
)


class OnMesh(NamedTuple):
    """What the loop on a mesh gives the train step."""

    accumulated: Accumulated  # gradients laid out as the optimiser state (ZeRO-1: sharded)
    state: Any  # the train state as the optimiser sees it: its parameters laid out as those
    specs: Any  # the train state's PartitionSpecs


def accumulate_on_mesh(
    accumulated: Accumulate,
    layout: MeshLayout,
    state: Any,
    batch: Any,
    *,
    model_state: Any,
    rng: Any,
) -> OnMesh:
    """``accumulated`` (a loss, accumulated) over ``layout.mesh``: the batch split over
    ``layout.axis_name``, the state laid out by ``layout.strategy``.

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
    k, devices = accumulated.options.num_microbatches, meshes.devices(mesh, axis_name)
    size = _checks.leading_size(batch, "batch", "batch") or 0  # 0: no leaves, as accumulate says
    if size % (devices * k):
        raise IndivisibleBatchError.of(size, k, devices, axis_name)
    specs = state_specs(state, mesh, strategy, axis_name=axis_name)
    state = place(mesh, state, specs)
    batch = place(mesh, batch, batch_specs(batch, layout))
    row = split_of(strategy)

    def grad_spec(x: Any, spec: Any) -> Any:  # as the optimiser state, where the row splits it
        split = row.spec("grads", jax.numpy.shape(x), devices, axis_name)
        return spec if split is None else split

    grad_specs = jax.tree.map(grad_spec, state.params, specs.params)
    check_layout(layout, specs.params, "give `strategy` specs with P('{}') on the stacked layers")
    if layout.reduce_once:  # the engine's one loop onto the mesh
        on_mesh = with_placement(accumulated, layout, (specs.params,), (grad_specs,))
        acc = on_mesh(state.params, batch, model_state, rng)
    else:  # jit's global view: the parameters gathered once, JAX reducing in every micro-batch
        gathered = meshes.specs_over(specs.params, others(layout))
        acc = accumulated(place(mesh, state.params, gathered), batch, model_state, rng)
    grads = place(mesh, acc.grads, grad_specs)
    return OnMesh(
        accumulated=acc._replace(grads=grads),
        state=state.replace(params=place(mesh, state.params, grad_specs)),
        specs=specs,
    )


def with_placement(
    accumulated: Accumulate, layout: MeshLayout, primal_specs: Any, grad_specs: Any
) -> Accumulate:
    """``accumulated`` told where a train step on ``layout`` lays out the values it
    differentiates: its `collectives.Placement` (the stage axes, ZeRO-3's gathers, and the
    specs: a tuple, one tree per differentiated argument; ``None``: as they lie)."""
    placement = collectives.Placement(
        stage_axes=stage_axes(layout),
        primal_specs=primal_specs,
        grad_specs=grad_specs,
        gather_each=split_of(layout.strategy).gather_each,
    )
    return Accumulate(accumulated.fun, accumulated.options._replace(placement=placement))


def mesh_layout(
    mesh: Any, axis_name: Any, strategy: Any, *, reduce_once: Any, pipeline_axis: Any
) -> MeshLayout | None:
    """A train step's `MeshLayout` from its arguments, checked; `None` without a mesh."""
    check_strategy(strategy)
    once = _checks.check_bool(reduce_once, "reduce_once")
    if mesh is None and strategy not in (None, "data_parallel"):  # NNX's None: its metadata
        raise ValueError(f"`strategy`={strategy!r} shards the state over a mesh: pass `mesh`.")
    if mesh is not None:
        check_mesh(mesh, axis_name, concrete=True)
    if pipeline_axis is not None:
        _check_pipeline_axis(mesh, axis_name, pipeline_axis, once)
    return None if mesh is None else MeshLayout(mesh, axis_name, strategy, once, pipeline_axis)


def _check_pipeline_axis(mesh: Any, axis_name: Any, pipeline_axis: str, reduce_once: bool) -> None:
    """Raises unless ``pipeline_axis`` (a train step's argument) can be ``mesh``'s stage axis."""
    if mesh is None:
        raise ValueError(f"`pipeline_axis`={pipeline_axis!r} needs a `mesh` with that axis.")
    if pipeline_axis not in mesh.axis_names:
        got = f"{pipeline_axis!r} is not an axis of `mesh` {mesh.axis_names}"
        raise ValueError(f"`pipeline_axis`={got}.")
    if pipeline_axis in collectives.axes(axis_name):
        raise ValueError(f"`pipeline_axis`={pipeline_axis!r} is the batch's `axis_name` too.")
    if not reduce_once:
        raise ValueError("`pipeline_axis` needs reduce_once=True: the loop runs in a shard_map.")


def check_layout(layout: MeshLayout, param_specs: Any, fix: str) -> None:
    """Raises unless the loop can run on ``layout``: ZeRO-3 and a pipeline's stage axis (which
    must split some parameters; ``fix`` says how, ``{}`` its name) need the mesh's other
    axes (those the loop leaves in jit's global view) Auto."""
    explicit = meshes.explicit_axes(layout.mesh, others(layout))
    if split_of(layout.strategy).gather_each and (explicit or not layout.reduce_once):
        raise ValueError(f"`strategy`='zero3' {_ZERO3_GATHERS}; got {layout.mesh}.")
    if layout.pipeline_axis is None:
        return
    specs = jax.tree.leaves(param_specs, is_leaf=meshes.is_spec)
    named = [s for s in specs if any(meshes.spec_over(s, layout.pipeline_axis))]
    if not named:
        stage = layout.pipeline_axis
        raise ValueError(f"`pipeline_axis`={stage!r} splits no parameter: {fix.format(stage)}.")
    if explicit:
        raise ValueError(
            f"`pipeline_axis` needs the mesh's other axes {others(layout)} Auto, not Explicit."
        )


def stage_axes(layout: MeshLayout) -> tuple[Any, ...]:
    """The axes manual in the loop beside the batch's: a pipeline's stage axis, or none."""
    return (layout.pipeline_axis,) if layout.pipeline_axis else ()


def others(layout: MeshLayout) -> list[Any]:
    """The mesh's axes the loop leaves in jit's global view."""
    manual = (*collectives.axes(layout.axis_name), *stage_axes(layout))
    return [a for a in layout.mesh.axis_names if a not in manual]


_ZERO3_GATHERS = (
    "gathers in every micro-batch in a shard_map over the batch's axes, which needs "
    "reduce_once=True and no other Explicit mesh axes (JAX 0.12 cannot differentiate the "
    "gather beside them): use 'fsdp', or make the other axes Auto"
)
