"""A train step on a mesh: its `MeshLayout`, checked, and the one wiring of both steps' loss
onto the mesh (`on_mesh`: the batch placed, the engine told where the parameters lie)."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxga import _checks, collectives, meshes
from jaxga.accumulation import Accumulate
from jaxga.engine import Accumulated
from jaxga.meshes import in_memory_of
from jaxga.microbatch import IndivisibleBatchError
from jaxga.sharding import (
    check_mesh,
    check_strategy,
    is_laid_out,
    offload,
    place,
    put,
    split_of,
    state_shardings,
)


class MeshLayout(NamedTuple):
    """Where a train step runs: a mesh, the batch's axis on it, and the state's layout."""

    mesh: Mesh
    axis_name: Any
    strategy: Any  # a name of STRATEGIES, a tree of the parameters' PartitionSpecs, or None
    reduce_once: bool = True  # False: the loop in jit's global view, JAX reducing each time
    pipeline_axis: str | None = None  # a pipeline's stage axis: manual in the loop too

    @property
    def loop_axes(self) -> Any:
        """The engine's ``axis_name``: the batch's axis, or ``()`` for jit's global view."""
        return self.axis_name if self.reduce_once else ()


def batch_specs(batch: Any, layout: MeshLayout) -> Any:
    """Each leaf of ``batch`` split over ``layout``'s batch axis (its rows)."""
    return jax.tree.map(lambda _: P(layout.axis_name), batch)


def batch_onto(batch: Any, layout: "MeshLayout | None") -> Any:
    """``batch`` with each concrete leaf committed to other devices than ``layout.mesh``'s
    (or to them in another order) put on the mesh, in the memory it lives in: split over the
    batch's axis where the devices divide its rows, else replicated; the step then lays it
    out. jit refuses arrays committed elsewhere; a leaf on this process's devices alone,
    for a mesh over processes, is refused by name (`jaxga.sharding.shard_batch` makes it).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jaxga.layouts import MeshLayout, batch_onto
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> x = jax.device_put(jnp.ones((8, 2)), jax.devices()[-1])  # one device's
        >>> x = batch_onto({"x": x}, MeshLayout(mesh, "data", None))["x"]
        >>> x.sharding.device_set == set(mesh.devices.flat)
        True
    """
    if layout is None:
        return batch
    mesh, devices = layout.mesh, meshes.devices(layout.mesh, layout.axis_name)
    order = tuple(mesh.devices.flat)

    def onto(path: Any, x: Any) -> Any:
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or not x.committed:
            return x
        where = x.sharding  # its devices in order (one device's: that one)
        named = isinstance(where, NamedSharding)
        if (tuple(where.mesh.devices.flat) if named else tuple(where.device_set)) == order:
            return x
        if mesh.is_multi_process or not x.is_fully_addressable:
            got = f"`batch`{jax.tree_util.keystr(path)} lies on this process's devices alone"
            fix = "build it with jaxga.sharding.shard_batch(batch, mesh)"
            raise ValueError(f"{got}, and the mesh spans processes: {fix}.")
        split = jnp.ndim(x) > 0 and jnp.shape(x)[0] % devices == 0
        spec = P(layout.axis_name) if split else P()
        return jax.device_put(x, NamedSharding(mesh, spec, memory_kind=where.memory_kind))

    return jax.tree_util.tree_map_with_path(onto, batch)


def _committed(x: Any) -> Any:
    """``x`` committed where it lies (its memory kind kept: streamed parameters stay)."""
    return jax.device_put(x, x.sharding) if isinstance(x, jax.Array) else x


def lay_out(
    state: Any,
    layout: MeshLayout | None,
    *,
    offload_state: bool | Callable,
    wanted: dict[Any, Any] | None = None,
) -> Any:
    """``state`` ``put`` where a step keeps it (concrete): on the mesh (a streamed stack in
    host memory still), offloaded as asked.
    With a ``layout``, ``state`` is a Flax train state, put again when any leaf lies
    elsewhere; ``wanted`` keeps its shardings by the state's structure and shapes (a step's
    own, so that a call checks its state without working them out again). An NNX step
    passes None and lays its model out itself."""
    if layout is not None:
        wanted = {} if wanted is None else wanted  # a call of its own, not a step's
        if not _laid_out_already(state, layout, wanted):
            where = state_shardings(state, layout.mesh, layout.strategy, axis_name=layout.axis_name)
            state = put(state, jax.tree.map(in_memory_of, where, state))
    elif offload_state and not all(getattr(x, "committed", True) for x in jax.tree.leaves(state)):
        state = jax.tree.map(_committed, state)  # as the step returns it
    return offload(state, select=offload_state) if offload_state else state


def _laid_out_already(state: Any, layout: MeshLayout, wanted: dict[Any, Any]) -> bool:
    """Whether every leaf of ``state`` lies as ``layout`` lays it out, in the memory it lives
    in (`in_memory_of`); with ``strategy=None`` (as each leaf lies), on the mesh at all."""
    leaves, mesh = jax.tree.leaves(state), layout.mesh
    if layout.strategy is None:
        shardings = [getattr(x, "sharding", None) for x in leaves]
        return all(isinstance(s, NamedSharding) and s.mesh == mesh for s in shardings)
    key = (jax.tree.structure(state), *((jnp.shape(x), getattr(x, "dtype", None)) for x in leaves))
    try:
        hash(key)
    except TypeError:  # a static field that cannot be hashed: worked out for this call alone
        key, wanted = None, {}
    if key not in wanted:
        where = state_shardings(state, mesh, layout.strategy, axis_name=layout.axis_name)
        wanted[key] = jax.tree.leaves(where)
    return all(
        getattr(x, "sharding", None) == where or is_laid_out(x, in_memory_of(where, x))
        for x, where in zip(leaves, wanted[key])
    )


def on_mesh(
    accumulating: Accumulate,
    layout: MeshLayout,
    primal: Any,
    batch: Any,
    *args: Any,
    param_specs: Any,
    primal_specs: Any,
    grad_specs: Any,
    fix: str,
) -> Accumulated:
    """A train step's accumulation on ``layout.mesh``, in jit's global view of it: the batch's
    rows checked divisible and placed over ``layout.axis_name``, the layout checked
    (`check_layout`), and the engine told where the differentiated values lie (a
    `collectives.Placement`) before ``accumulating(primal, batch, *args)`` runs.

    With ``layout.pipeline_axis``, that axis is manual in the loop too: each stage's
    parameters (split over it) stay on it, and a pipeline runs there directly. With
    ``layout.reduce_once``, the loop runs in a ``shard_map`` over the batch's axes alone:
    ``"fsdp"`` gathers the parameters once before it and reduce-scatters the gradients once
    after it, ``"zero1"`` reduce-scatters them as the optimiser state, ``"zero3"`` gathers in
    every micro-batch. ``reduce_once=False``: the loop in jit's global view, JAX reducing in
    every micro-batch.

    Args:
        accumulating: the step's `Accumulate` (its loss and options).
        layout: the step's `MeshLayout`.
        primal: the differentiated argument (the parameters).
        batch: the step's batch, split over ``layout.axis_name`` here.
        args: ``accumulating``'s other arguments, as they are.
        param_specs: the parameters' specs, checked against the stage axis.
        primal_specs: where each differentiated argument lies (a tuple of trees; None: as
            they lie).
        grad_specs: where their gradients go (None: as the differentiated values lie).
        fix: how to split the parameters over a stage axis, for the error (``{}`` its name).

    Returns:
        ``accumulating``'s `Accumulated`, its gradient laid out by ``grad_specs``.
    """
    mesh, axis_name = layout.mesh, layout.axis_name
    k, devices = accumulating.options.num_microbatches, meshes.devices(mesh, axis_name)
    size = _checks.leading_size(batch, "batch", "batch") or 0  # 0: no leaves, as accumulate says
    if size % (devices * k):
        raise IndivisibleBatchError.of(size, k, devices, axis_name)
    check_layout(layout, param_specs, fix)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        batch = place(mesh, batch, batch_specs(batch, layout))
        placement = collectives.Placement(
            stage_axes=stage_axes(layout),
            primal_specs=primal_specs,  # a tuple, a tree per differentiated argument; None: as
            grad_specs=grad_specs,  # they lie
            gather_each=split_of(layout.strategy).gather_each,
        )
        options = accumulating.options._replace(placement=placement)
        return Accumulate(accumulating.fun, options)(primal, batch, *args)


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
    if pipeline_axis in meshes.axes(axis_name):
        raise ValueError(f"`pipeline_axis`={pipeline_axis!r} is the batch's `axis_name` too.")
    if not reduce_once:
        raise ValueError("`pipeline_axis` needs reduce_once=True: the loop runs in a shard_map.")


def check_layout(layout: MeshLayout, param_specs: Any, fix: str) -> None:
    """Raises unless the loop can run on ``layout``: ZeRO-3 and a pipeline's stage axis (which
    must split some parameters; ``fix`` says how, ``{}`` its name) need the mesh's other
    axes (those the loop leaves in jit's global view) Auto."""
    explicit = meshes.explicit_axes(layout.mesh, others(layout))
    if split_of(layout.strategy).gather_each and (explicit or not layout.reduce_once):
        got = f"the Explicit axes {explicit}" if explicit else "reduce_once=False"
        raise ValueError(f"`strategy`='zero3' {_ZERO3_GATHERS}; got {got}.")
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
    return list(
        meshes.global_axes(layout.mesh, (*meshes.axes(layout.axis_name), *stage_axes(layout)))
    )


_ZERO3_GATHERS = (
    "gathers in every micro-batch in a shard_map over the batch's axes, which needs "
    "reduce_once=True and no other Explicit mesh axes (JAX, up to 0.12 at least, cannot "
    "differentiate the gather beside them): use 'fsdp', or make the other axes Auto"
)
