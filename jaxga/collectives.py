"""Reductions across devices: which axes a call's batch is split over, and one reduction after."""

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxga import meshes
from jaxga._host_stacks import is_streamed, psum_by_layer
from jaxga.meshes import axes

__all__ = ["axes", "find_route", "psum_varying", "varying", "varying_axes"]


def varying_axes(x: Any) -> frozenset:
    """Returns the mesh axes ``x`` varies over (none outside ``shard_map``).

    Args:
        x: an array or a tracer.

    Returns:
        A frozenset of axis names: those of a ``shard_map`` here along which ``x`` may
        differ between devices (JAX's varying manual axes).

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> jaxga.collectives.varying_axes(jnp.ones(2))
        frozenset()
    """
    return jax.typeof(x).mat.varying


def invariant_axes(x: Any, axis_name: Any) -> tuple[Any, ...]:
    """The axes of ``axis_name`` that ``x`` does not vary over."""
    return tuple(a for a in axes(axis_name) if a not in varying_axes(x))


def varying(tree: Any, axis_name: Any) -> Any:
    """Returns ``tree`` with every leaf varying over ``axis_name`` (``None``: as it is).

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> def f(w):
        ...     return print(jax.typeof(jaxga.collectives.varying(w, "data"))) or w
        >>> _ = jax.shard_map(f, mesh=jax.make_mesh((1,), ["data"]), out_specs=jax.P())(jnp.ones(2))
        float32[2]{V:data}
    """
    if axis_name is None:
        return tree
    return jax.tree.map(
        lambda x: jax.lax.pcast(x, invariant_axes(x, axis_name), to="varying"), tree
    )


def psum_invariant(tree: Any, like: Any, axis_name: Any) -> Any:
    """Returns ``tree`` summed over ``axis_name``, but for the axes ``like``'s leaves vary over:
    one psum per group of axes; the stacks in host memory (streamed), a layer at a time on
    the device, one all-reduce a layer for those of one group and depth (`psum_by_layer`)."""
    leaves, treedef = jax.tree.flatten(tree)
    over = [invariant_axes(x, axis_name) for x in treedef.flatten_up_to(like)]
    depths = [jnp.shape(x)[0] if o and is_streamed(x) else None for x, o in zip(leaves, over)]
    for group, depth in dict.fromkeys(zip(over, depths)):  # None: not a stack in host memory
        indices = [i for i, key in enumerate(zip(over, depths)) if key == (group, depth)]
        parts = [leaves[i] for i in indices]
        summed = jax.lax.psum(parts, group) if depth is None else psum_by_layer(parts, group)
        for i, x in zip(indices, summed):
            leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def psum_varying(tree: Any) -> Any:
    """Returns each leaf summed over the mesh axes it varies over (bools: any device true).

    Args:
        tree: a pytree of arrays inside a ``shard_map``.

    Returns:
        ``tree``, each leaf invariant over every axis here: a sum of its devices' values.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> total = jax.shard_map(
        ...     jaxga.collectives.psum_varying, mesh=mesh, in_specs=P("data"), out_specs=P()
        ... )
        >>> total(jnp.arange(3.0)).tolist()
        [0.0, 1.0, 2.0]
    """

    def reduce(x):
        over = tuple(sorted(varying_axes(x), key=str))  # () a no-op
        if x.dtype == jnp.bool_ and over:
            return jax.lax.psum(x.astype(jnp.int32), over) > 0
        return jax.lax.psum(x, over)

    return jax.tree.map(reduce, tree)


class Route(NamedTuple):
    """Where one call's gradient sums are kept partial in the micro-batch loop, and reduced.

    ``kind``: ``"local"`` (the loop sees every row it is given: no reduction of jaxga's);
    ``"manual"`` (inside a ``shard_map`` over ``axes``: the sums vary over them, one
    ``psum`` after the loop); ``"opened"`` (jit's global view of a batch split over the
    Explicit or Auto ``axes`` of ``mesh``: jaxga opens a ``shard_map`` over them itself,
    and runs the manual route inside).
    """

    kind: str
    axes: tuple[Any, ...]
    mesh: Any = None  # the abstract mesh of an "opened" route


def _kind_of(axis: Any) -> str:
    mesh = jax.sharding.get_abstract_mesh()
    if kind := meshes.axis_kind(axis, mesh):
        return kind
    try:  # bound without a mesh: jax.pmap
        jax.lax.axis_index(axis)
    except NameError:
        message = (
            f"is not bound (the mesh here has axes {tuple(mesh.axis_names)}): call it inside "
            "jax.shard_map over it, under jax.set_mesh(mesh) of a mesh that has it, or pass "
            "axis_name=None."
        )
        raise ValueError(f"`axis_name`={axis!r} {message}") from None
    return "manual"


def _split_axes(leaf: Any) -> tuple[Any, ...]:
    """The Explicit mesh axes ``leaf``'s leading axis is split over (its type says)."""
    spec = meshes.type_spec(leaf)
    return axes(spec[0] or ()) if spec else ()


def find_route(axis_name: Any, batch: Any) -> Route:
    """The `Route` of a call on ``batch``: over the axes ``axis_name`` names, else JAX's.

    ``axis_name=None`` reads them from the batch: the axes it varies over inside a
    ``shard_map``, else those its type splits its rows over (Explicit axes); ``()``: none.

    Args:
        axis_name: a mesh axis name, a tuple or list of them, ``()`` or ``None``.
        batch: the call's batch (a pytree of arrays).

    Returns:
        A `Route`: ``kind`` (``"local"``, ``"manual"`` or ``"opened"``), ``axes`` and, to be
        opened, the ``mesh``.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> mesh = jax.make_mesh((1,), ("data",))  # Explicit axes
        >>> batch = jax.device_put(jnp.ones((4, 2)), jax.NamedSharding(mesh, jax.P("data")))
        >>> route = jaxga.collectives.find_route(None, {"x": batch})
        >>> route.kind, route.axes, jaxga.collectives.axis_size(route)
        ('opened', ('data',), 1)
        >>> jaxga.collectives.find_route((), {"x": batch}).kind  # jit's global view
        'local'
    """
    leaves = jax.tree.leaves(batch)
    if axis_name is not None:
        named = axes(axis_name)
        kinds = {a: _kind_of(a) for a in named}
        if len(set(kinds.values())) > 1:
            raise ValueError(
                f"`axis_name`={axis_name!r} mixes kinds of mesh axes: {kinds}; expected axes "
                "all Manual (a shard_map's) or all to be opened (jit's global view)."
            )
        kind = kinds[named[0]] if named else "local"
        return Route(kind, named, jax.sharding.get_abstract_mesh() if kind == "opened" else None)
    if manual := sorted(set().union(*map(varying_axes, leaves)), key=str):
        return Route("manual", tuple(manual))
    split = {_split_axes(x) for x in leaves} - {()}
    if len(split) > 1:
        raise ValueError(
            f"The batch's leaves are split over different mesh axes: {split}; expected every "
            "leaf's rows split over the same axes: lay them out alike, or pass `axis_name`."
        )
    if not split:
        return Route("local", ())
    mesh = next(jax.typeof(x).sharding.mesh for x in leaves if _split_axes(x))
    return Route("opened", split.pop(), mesh)


def axis_size(route: Route) -> int:
    """The number of devices the route's axes hold (1 for a local route)."""
    if route.kind == "manual":
        return jax.lax.axis_size(route.axes)
    return meshes.devices(route.mesh, route.axes)


class Placement(NamedTuple):
    """How a train step lays a call's arrays out over the loop's ``shard_map`` (an opened route).

    Without one (`jaxga.value_and_grad`), each value lies as its type (Explicit axes) or its
    NNX variable's sharding metadata says. The differentiated values split over the batch's
    axes go in split; they are gathered inside once and their gradients reduce-scattered
    once, after the loop, as ``grad_specs`` say — or, with ``gather_each`` (ZeRO-3),
    gathered in every micro-batch and reduce-scattered there (the gather's transpose). A
    primal split over the batch's axes has a gradient split over them too.
    """

    stage_axes: tuple[Any, ...] = ()  # manual in the loop beside the batch's: a pipeline's
    primal_specs: Any = None  # the differentiated values' PartitionSpecs; None: as they lie
    grad_specs: Any = None  # the gradient sums' layout after the loop; None: the primals'
    gather_each: bool = False  # ZeRO-3: the primals gathered in every micro-batch


def whole_over(tree: Any, over: tuple[Any, ...]) -> Any:
    """``tree`` resharded whole over the axes ``over`` (what its Explicit-axes types split
    over them; outside a ``shard_map``: `all_gathered` is inside one)."""

    def gather(x: Any) -> Any:
        sharding = jax.typeof(x).sharding
        if not meshes.is_explicit(sharding):
            return x
        spec = meshes.spec_over(sharding.spec, set(sharding.mesh.axis_names) - set(over))
        return x if spec == sharding.spec else jax.reshard(x, NamedSharding(sharding.mesh, spec))

    return jax.tree.map(gather, tree)


def laid_out_as(tree: Any, like: Any) -> Any:
    """``tree`` resharded as ``like``'s Explicit-axes types say (others as they are);
    ``like``: arrays, or their types (``jax.typeof``'s)."""

    def lay(x: Any, y: Any) -> Any:
        want = (jax.typeof(y) if isinstance(y, jax.Array) else y).sharding
        if meshes.is_explicit(want) and jax.typeof(x).sharding != want:
            return jax.reshard(x, want)
        return x

    return jax.tree.map(lay, tree, like)


def split_over(microbatches: Any, route: Route) -> Any:
    """Micro-batches ``[k, B / k, ...]`` with their rows split over an opened route's axes."""
    if not meshes.explicit_axes(route.mesh, route.axes):
        return microbatches  # Auto axes: the shard_map lays them out

    def place(x: Any) -> Any:
        sharding = jax.typeof(x).sharding
        entries = (*sharding.spec, *[None] * x.ndim)[: x.ndim]
        spec = P(entries[0], route.axes, *entries[2:])
        return x if spec == sharding.spec else jax.reshard(x, NamedSharding(route.mesh, spec))

    return jax.tree.map(place, microbatches)


def _splits(spec: P) -> list[tuple[int, Any]]:
    return [(dim, entry) for dim, entry in enumerate(spec) if entry is not None]


def all_gathered(tree: Any, specs: Any) -> Any:
    """Inside a ``shard_map``: each leaf gathered whole along the axes its spec splits it over;
    a stack in host memory (streamed) must not be split (gathered, it would be whole on the
    device): each device streams its own copy."""

    def gather(path: Any, x: Any, spec: P) -> Any:
        if is_streamed(x) and _splits(spec):
            where = f"{jax.tree_util.keystr(path)} of the differentiated arguments (the first: a"
            where += " train step's parameters or model)"
            raise ValueError(
                f"`stream`: a stack in host memory, {where}, is split over the mesh by {spec}; "
                "expected it replicated, P(): each device streams its own copy (leave the "
                "stacks unsplit: in `strategy`, NNX's metadata, or where the arrays lie)."
            )
        for dim, entry in _splits(spec):
            x = jax.lax.all_gather(x, entry, axis=dim, tiled=True)
        return x

    return jax.tree_util.tree_map_with_path(gather, tree, specs)


def reduce_scattered(tree: Any, specs: Any) -> Any:
    """Inside a ``shard_map``: each leaf summed over, and scattered as, its spec's axes."""

    def scatter(x: Any, spec: P) -> Any:
        for dim, entry in reversed(_splits(spec)):
            x = jax.lax.psum_scatter(x, entry, scatter_dimension=dim, tiled=True)
        return x

    return jax.tree.map(scatter, tree, specs)


def varying_where_split(tree: Any, specs: Any) -> Any:
    """Each leaf varying over the axes its spec names (then summed by `reduce_scattered`)."""

    def mark(x: Any, spec: P) -> Any:
        over = tuple(a for _, entry in _splits(spec) for a in axes(entry))
        return varying(x, over) if over else x

    return jax.tree.map(mark, tree, specs)


def inside_loop(tree: Any, route: Route) -> Any:
    """``tree`` as the loop carries and differentiates it: varying over a manual route's axes
    (its sums stay partial until `reduce_after`)."""
    return varying(tree, route.axes) if route.kind == "manual" else tree


def zeros_like_sums(primals: Any, dtype: Callable[[Any], Any]) -> Any:
    """Zeros of ``dtype(primal)``, laid out as each primal and varying over the manual axes it
    varies over (a pipeline's stages), to sum its gradients in."""

    def zero(x):
        sharding = jax.typeof(x).sharding
        where = getattr(x, "sharding", sharding) if meshes.is_explicit(sharding) else None
        return varying(
            jnp.zeros(jnp.shape(x), dtype(x), out_sharding=where), tuple(varying_axes(x))
        )

    return jax.tree.map(zero, primals)


def mean_over_devices(x: jax.Array, axes: tuple[Any, ...], *, old: jax.Array) -> jax.Array:
    """``state_reduction="mean"``: floats averaged over ``axes`` (the change from ``old``, the
    value before the loop, so that a state no device changed comes back unrounded); ints
    and keys, their max."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return old + jax.lax.pmean(x - old, axes)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = jax.lax.pmax(jax.random.key_data(x), axes)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.lax.pmax(x, axes)


def reduce_after(sums: Any, like: Any, route: Route) -> Any:
    """``sums`` reduced once over a manual route's axes, but for those ``like`` varies over."""
    return psum_invariant(sums, like, route.axes) if route.kind == "manual" else sums


_STAGE_AXES: contextvars.ContextVar[list | None] = contextvars.ContextVar("stages", default=None)


@contextlib.contextmanager
def stage_axes_seen() -> Iterator[list]:
    """A list that every pipeline run here, its stage axis Manual, appends its axis to."""
    token = _STAGE_AXES.set([])
    try:
        yield _STAGE_AXES.get()
    finally:
        _STAGE_AXES.reset(token)


def note_stage_axis(axis: Any) -> None:
    """Tells the loop tracing this loss that a pipeline ran over the Manual ``axis``."""
    seen = _STAGE_AXES.get()
    if seen is not None and axis not in seen:
        seen.append(axis)


def rows_invariant_axes(route: Route, batch: Any) -> tuple[Any, ...]:
    """The axes of a manual ``route`` that no leaf of ``batch`` varies over: devices along
    them hold the same rows (a pipeline's stages), so a micro-batch counts once there.
    Empty off a manual route, without a batch, or in a ``shard_map`` with ``check_vma=False``.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> route = jaxga.collectives.find_route((), [jnp.ones(4)])
        >>> jaxga.collectives.rows_invariant_axes(route, jnp.ones(4))
        ()
    """
    leaves = jax.tree.leaves(batch)
    if route.kind != "manual" or not leaves:
        return ()
    if not varying_axes(varying(jnp.zeros(()), route.axes)):  # check_vma=False: types unread
        return ()
    over = set().union(*map(varying_axes, leaves))
    return tuple(a for a in route.axes if a not in over)


def counted_once(mean: Any, stage_axes: list, route: Route) -> tuple[Any, Any]:
    """A micro-batch's ``mean``'s ``(total, count)`` as its pipelines' last stages give them
    (docs/pipeline.md, "A loss computed per stage"): over a stage axis of the route, zeros on
    the other stages (the route sums them after the loop); over one outside it, the last
    stage's on every stage. A `ValueError` if they still vary over a Manual mesh axis that
    ``route`` does not reduce over (the loop could not sum them)."""
    parts = (jnp.asarray(mean.total), jnp.asarray(mean.count))
    over = set(route.axes) if route.kind == "manual" else set()
    for axis in stage_axes:
        last = jax.lax.axis_index(axis) == jax.lax.axis_size(axis) - 1
        parts = tuple(jnp.where(last, x, jnp.zeros_like(x)) for x in parts)
        if axis not in over:
            parts = tuple(jax.lax.psum(parts, axis))
    extra = sorted(set().union(*map(varying_axes, parts)) - over, key=str)
    if extra:
        raise ValueError(_NOT_REDUCED.format(extra=extra, route=tuple(sorted(over, key=str))))
    return parts


_NOT_REDUCED = (
    "`fun` returned a loss that varies over the mesh axes {extra}, which `axis_name` (the "
    "axes jaxga sums the loss over: {route}) does not name: add them to `axis_name` if "
    "each device there holds other rows of the batch, or return the loss the same on "
    "every device of them (jax.lax.psum of a total masked to the device that holds it, "
    "with its count). A pipeline's stage axis, the batch the same on every stage: add it "
    "to `axis_name`, and each micro-batch counts once, on the last stage."
)
