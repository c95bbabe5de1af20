"""Reductions across devices: which axes a call's batch is split over, and one reduction after."""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "Route",
    "axes",
    "axis_size",
    "find_route",
    "gathered",
    "inside_loop",
    "laid_out_as",
    "psum_invariant",
    "psum_varying",
    "reduce_after",
    "split_over",
    "varying",
    "varying_axes",
    "zeros_like_sums",
    "zeros_of",
]


def axes(axis_name: Any) -> tuple[Any, ...]:
    """Returns ``axis_name``, a name or a tuple of names, as a tuple of names."""
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def varying_axes(x: Any) -> frozenset:
    """Returns the mesh axes ``x`` varies over (none outside ``shard_map``)."""
    return jax.typeof(x).mat.varying


def _invariant(x: Any, axis_name: Any) -> tuple[Any, ...]:
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
    return jax.tree.map(lambda x: jax.lax.pcast(x, _invariant(x, axis_name), to="varying"), tree)


def zeros_of(t: Any) -> jax.Array:
    """Zeros of the type ``t`` (``jax.typeof``'s): its shape, dtype, sharding, varying axes."""
    zeros = jax.lax.full(t.shape, 0, t.dtype, sharding=t.sharding)
    return jax.lax.pcast(zeros, tuple(t.mat.varying), to="varying")


def psum_invariant(tree: Any, like: Any, axis_name: Any) -> Any:
    """Returns ``tree`` summed over ``axis_name``, but for the axes ``like``'s leaves vary over."""
    leaves, treedef = jax.tree.flatten(tree)
    over = [_invariant(x, axis_name) for x in treedef.flatten_up_to(like)]
    for group in dict.fromkeys(over):  # one psum per group of axes
        indices = [i for i, o in enumerate(over) if o == group]
        for i, x in zip(indices, jax.lax.psum([leaves[i] for i in indices], group)):
            leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def psum_varying(tree: Any) -> Any:
    """Returns each leaf summed over the mesh axes it varies over (bools: any device true)."""

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
    if axis in mesh.axis_names:
        types = dict(zip(mesh.axis_names, mesh.axis_types))
        return "manual" if types[axis] == AxisType.Manual else "opened"
    try:  # bound without a mesh: jax.pmap
        jax.lax.axis_index(axis)
    except NameError:
        message = (
            "is not bound: call it inside jax.shard_map over it, under jax.set_mesh(mesh) of a "
            "mesh that has it, or pass axis_name=None."
        )
        raise ValueError(f"`axis_name`={axis!r} {message}") from None
    return "manual"


def _split_axes(leaf: Any) -> tuple[Any, ...]:
    """The Explicit mesh axes ``leaf``'s leading axis is split over (its type says)."""
    sharding = getattr(jax.typeof(leaf), "sharding", None)
    if not isinstance(sharding, NamedSharding) or not getattr(leaf, "ndim", 0):
        return ()
    types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types))
    return tuple(a for a in axes(sharding.spec[0] or ()) if types.get(a) == AxisType.Explicit)


def find_route(axis_name: Any, batch: Any) -> Route:
    """The `Route` of a call on ``batch``: over the axes ``axis_name`` names, else JAX's.

    ``axis_name=None`` reads them from the batch: the axes it varies over inside a
    ``shard_map``, else those its type splits its rows over (Explicit axes); ``()``: none.

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
            raise ValueError(f"`axis_name`={axis_name!r} mixes kinds of mesh axes: {kinds}.")
        kind = kinds[named[0]] if named else "local"
        return Route(kind, named, jax.sharding.get_abstract_mesh() if kind == "opened" else None)
    if manual := sorted(set().union(*map(varying_axes, leaves)), key=str):
        return Route("manual", tuple(manual))
    split = {_split_axes(x) for x in leaves} - {()}
    if len(split) > 1:
        raise ValueError(f"The batch's leaves are split over different mesh axes: {split}.")
    if not split:
        return Route("local", ())
    mesh = next(jax.typeof(x).sharding.mesh for x in leaves if _split_axes(x))
    return Route("opened", split.pop(), mesh)


def axis_size(route: Route) -> int:
    """The number of devices the route's axes hold (1 for a local route)."""
    if route.kind == "manual":
        return jax.lax.axis_size(route.axes)
    return math.prod(route.mesh.shape[a] for a in route.axes)


def gathered(tree: Any, over: tuple[Any, ...]) -> Any:
    """``tree`` with what its Explicit-axes types split over the axes ``over`` gathered."""

    def gather(x: Any) -> Any:
        sharding = jax.typeof(x).sharding
        if not isinstance(sharding, NamedSharding) or not set(over) & set(sharding.mesh.axis_names):
            return x
        kept = [tuple(a for a in axes(e or ()) if a not in over) or None for e in sharding.spec]
        spec = P(*kept)
        return x if spec == sharding.spec else jax.reshard(x, NamedSharding(sharding.mesh, spec))

    return jax.tree.map(gather, tree)


def laid_out_as(tree: Any, like: Any) -> Any:
    """``tree`` resharded as ``like``'s Explicit-axes types say (others as they are)."""

    def lay(x: Any, y: Any) -> Any:
        want = jax.typeof(y).sharding
        typed = AxisType.Explicit in getattr(getattr(want, "mesh", None), "axis_types", ())
        return jax.reshard(x, want) if typed and jax.typeof(x).sharding != want else x

    return jax.tree.map(lay, tree, like)


def split_over(microbatches: Any, route: Route) -> Any:
    """Micro-batches ``[k, B / k, ...]`` with their rows split over an opened route's axes."""

    types = dict(zip(route.mesh.axis_names, route.mesh.axis_types))
    if not any(types[a] == AxisType.Explicit for a in route.axes):
        return microbatches  # Auto axes: the shard_map lays them out

    def place(x: Any) -> Any:
        sharding = jax.typeof(x).sharding
        entries = (*sharding.spec, *[None] * x.ndim)[: x.ndim]
        spec = P(entries[0], route.axes, *entries[2:])
        return x if spec == sharding.spec else jax.reshard(x, NamedSharding(route.mesh, spec))

    return jax.tree.map(place, microbatches)


def inside_loop(primals: Any, route: Route) -> Any:
    """``primals`` as the loop differentiates them: manual, varying (their sums stay partial)."""
    return varying(primals, route.axes) if route.kind == "manual" else primals


def zeros_like_sums(primals: Any, dtype: Callable[[Any], Any], route: Route) -> Any:
    """Zeros of ``dtype(primal)``, laid out as each primal, to sum its gradients in.

    They vary over the manual axes each primal varies over (a pipeline's stages), and over
    a manual route's axes, over which the sums stay partial until `reduce_after`.
    """

    def zero(x):
        sharding = jax.typeof(x).sharding
        typed = AxisType.Explicit in getattr(getattr(sharding, "mesh", None), "axis_types", ())
        where = getattr(x, "sharding", sharding) if typed else None  # concrete if it can
        over = (*(route.axes if route.kind == "manual" else ()), *varying_axes(x))
        return varying(jnp.zeros(jnp.shape(x), dtype(x), out_sharding=where), over)

    return jax.tree.map(zero, primals)


def reduce_after(sums: Any, like: Any, route: Route) -> Any:
    """``sums`` reduced once over a manual route's axes, but for those ``like`` varies over."""
    return psum_invariant(sums, like, route.axes) if route.kind == "manual" else sums
