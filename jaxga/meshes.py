"""Mesh facts, read in one place: axis types, Manual axes, device counts, specs over axes."""

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

HOST_KINDS = ("pinned_host", "unpinned_host")  # memory kinds of host memory


def axes(axis_name: Any) -> tuple[Any, ...]:
    """Returns ``axis_name``, a name or a collection of names, as a tuple of names (a set's
    sorted: its own order may differ between processes, and every process must agree).

    Examples:
        >>> import jaxga
        >>> jaxga.collectives.axes("data"), jaxga.collectives.axes(["data", "model"])
        (('data',), ('data', 'model'))
    """
    if isinstance(axis_name, set | frozenset):
        return tuple(sorted(axis_name, key=str))
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def check_axis_name(axis_name: Any) -> Any:
    """``axis_name``, checked: ``None``, a mesh axis name (a string) or a tuple, list or set
    of distinct names (``()``: none).

    Args:
        axis_name: what a caller passed as ``axis_name``.

    Returns:
        ``axis_name``, as given.

    Raises:
        TypeError: a name that is not a string (an int is a position to JAX's collectives).
        ValueError: a name given twice.

    Examples:
        >>> import jaxga
        >>> jaxga.meshes.check_axis_name(("data", "fsdp"))
        ('data', 'fsdp')
        >>> jaxga.meshes.check_axis_name(0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        TypeError: `axis_name` must be None, a mesh axis name (a string) ...; got 0, of type int.
    """
    if axis_name is None:
        return None
    names = axes(axis_name)
    if bad := [name for name in names if not isinstance(name, str)]:
        expected = "None, a mesh axis name (a string) or a tuple, list or set of them"
        got = f"{bad[0]!r}, of type {type(bad[0]).__name__}"
        got += "" if bad[0] is axis_name else f", in {axis_name!r}"
        raise TypeError(f"`axis_name` must be {expected}; got {got}.")
    if len(set(names)) < len(names):
        raise ValueError(f"`axis_name`={axis_name!r} names an axis twice; expected distinct axes.")
    return axis_name


def axis_types(mesh: Any) -> dict[Any, AxisType]:
    """``mesh``'s axis types by name: the one place a mesh's types are read."""
    return dict(zip(mesh.axis_names, mesh.axis_types))


def explicit_axes(mesh: Any, names: Any = None) -> tuple[Any, ...]:
    """The Explicit axes of ``mesh`` among ``names`` (``None``: all of them)."""
    types = axis_types(mesh)
    names = types if names is None else axes(names)
    return tuple(a for a in names if types[a] == AxisType.Explicit)


def manual_axes(mesh: Any) -> frozenset:
    """The axes of ``mesh`` (an abstract mesh) that a ``shard_map`` here has made Manual."""
    return frozenset(a for a, t in axis_types(mesh).items() if t == AxisType.Manual)


def axis_kind(axis: Any, mesh: Any = None) -> str | None:
    """Whether ``axis`` is Manual on ``mesh`` (a ``shard_map`` here has it) or to be opened.

    Args:
        axis: a mesh axis name.
        mesh: an abstract mesh; default: the one here (``jax.sharding.get_abstract_mesh()``).

    Returns:
        ``"manual"`` or ``"opened"``; ``None`` where ``mesh`` has no such axis.

    Examples:
        >>> import jax, jaxga.meshes as m
        >>> mesh = jax.make_mesh((1,), ["data"]).abstract_mesh
        >>> m.axis_kind("data", mesh), m.axis_kind("stage", mesh)
        ('opened', None)
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if axis not in mesh.axis_names:
        return None
    return "manual" if axis in manual_axes(mesh) else "opened"


def global_axes(mesh: Any, manual: Any) -> tuple[Any, ...]:
    """The axes of ``mesh`` a loop in a ``shard_map`` over ``manual`` leaves in jit's global view.

    Args:
        mesh: a mesh or an abstract mesh.
        manual: the axes the loop's ``shard_map`` makes Manual: a name or names.

    Returns:
        ``mesh``'s other axes, in its order.

    Examples:
        >>> import jax, jaxga.meshes as m
        >>> m.global_axes(jax.make_mesh((1, 1), ["data", "model"]), "data")
        ('model',)
    """
    return tuple(a for a in mesh.axis_names if a not in axes(manual))


def is_explicit(sharding: Any) -> bool:
    """Whether ``sharding`` is a `NamedSharding` on a mesh with Explicit axes (its type says)."""
    return isinstance(sharding, NamedSharding) and bool(explicit_axes(sharding.mesh))


def devices(mesh: Any, names: Any) -> int:
    """How many devices ``mesh``'s axes ``names`` hold."""
    return math.prod(mesh.shape[a] for a in axes(names))


def spec_over(spec: P, names: Any) -> P:
    """``spec`` with its entries naming the axes ``names`` alone (the others dropped)."""
    keep = set(axes(names))

    def entry(e: Any) -> Any:
        return tuple(a for a in axes(e or ()) if a in keep) or None

    return P(*map(entry, spec))


def specs_over(specs: Any, names: Any) -> Any:
    """`spec_over` of every spec of ``specs``."""
    return jax.tree.map(lambda spec: spec_over(spec, names), specs, is_leaf=is_spec)


def is_spec(x: Any) -> bool:
    """Whether ``x`` is a ``PartitionSpec`` (a leaf of a tree of specs)."""
    return isinstance(x, P)


def canonical_spec(spec: P) -> P:
    """``spec`` spelt one way: its trailing ``None`` entries dropped (``P(None)`` is ``P()``),
    its unreduced and reduced axes kept.

    Examples:
        >>> from jax.sharding import PartitionSpec as P
        >>> from jaxga.meshes import canonical_spec
        >>> canonical_spec(P("data", None)) == P("data"), len(canonical_spec(P(None, None)))
        (True, 0)
    """
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries, unreduced=spec.unreduced, reduced=spec.reduced)


def type_spec(x: Any) -> P:
    """``x``'s PartitionSpec as its type says on Explicit axes, its axes per dimension (no
    stacked value jaxga lays out carries unreduced or reduced axes), else ``P()``.

    Args:
        x: an array or a traced value.

    Returns:
        A `jax.sharding.PartitionSpec`.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga.meshes as m
        >>> mesh = jax.make_mesh((1,), ["data"], axis_types=(jax.sharding.AxisType.Explicit,))
        >>> x = jax.device_put(jnp.ones(2), jax.NamedSharding(mesh, jax.P("data")))
        >>> m.type_spec(x) == jax.P("data"), m.type_spec(jnp.ones(2)) == jax.P()
        (True, True)
    """
    sharding = getattr(jax.typeof(x), "sharding", None)
    return P(*sharding.spec) if is_explicit(sharding) else P()


def layer_split(x: Any) -> tuple[Any, ...]:
    """The mesh axes that split ``x``'s leading (layer) axis as its type says in jit's
    global view: ``()`` where none do, or where a ``shard_map`` here has made them Manual
    (each device holds its own layers already).

    Args:
        x: an array or a traced value, its leading axis the layers.

    Returns:
        The axes' names, a tuple.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga.meshes as m
        >>> mesh = jax.make_mesh((1,), ["stage"], axis_types=(jax.sharding.AxisType.Explicit,))
        >>> stack = jax.device_put(jnp.ones((2, 3)), jax.NamedSharding(mesh, jax.P("stage")))
        >>> m.layer_split(stack), m.layer_split(jnp.ones((2, 3)))
        (('stage',), ())
    """
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if not spec or spec[0] is None or sharding.mesh.empty:
        return ()
    split = axes(spec[0])
    return () if set(split) & manual_axes(sharding.mesh) else split


def traced_as_placed(where: Any) -> Any:
    """``where`` as a shape struct's sharding that JAX traces in its memory: for host memory
    on one device, a one-device `NamedSharding` (a `SingleDeviceSharding`'s memory kind is
    not traced).

    Examples:
        >>> import jax
        >>> from jaxga.meshes import traced_as_placed
        >>> host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
        >>> traced_as_placed(host).memory_kind
        'pinned_host'
    """
    host = where.memory_kind in HOST_KINDS
    if not (host and isinstance(where, jax.sharding.SingleDeviceSharding)):
        return where
    mesh = jax.sharding.Mesh(list(where.device_set), ("device",))
    return NamedSharding(mesh, P(), memory_kind=where.memory_kind)


def in_memory_of(where: NamedSharding, x: Any) -> NamedSharding:
    """``where`` in the memory ``x`` lives in: a leaf in pinned host memory (a streamed stack,
    its type's ``jax.memory.Space.Host``) stays there when a step lays it out; any other leaf
    goes to the devices' memory (an ``unpinned_host`` one too: JAX types it as the device's).
    A host leaf laid out as ``where`` says keeps its own sharding (and so its memory kind,
    also where ``with_memory_kind`` cannot set one: a described device has no memories).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jaxga.meshes import in_memory_of
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> host = jax.NamedSharding(mesh, jax.P(), memory_kind="pinned_host")
        >>> x = jax.device_put(jnp.ones(2), host)
        >>> in_memory_of(jax.NamedSharding(mesh, jax.P()), x).memory_kind
        'pinned_host'
    """
    if memory_space(x) != jax.memory.Space.Host:
        return where
    now = getattr(x, "sharding", None)
    if isinstance(now, NamedSharding) and now.mesh == where.mesh:
        spec = NamedSharding(now.mesh, now.spec)  # P(None) and P() alike
        if spec.is_equivalent_to(NamedSharding(where.mesh, where.spec), jnp.ndim(x)):
            return now
    return where.with_memory_kind("pinned_host")


def memory_space(leaf: Any) -> Any:
    """Where ``leaf`` lives: ``jax.memory.Space.Host`` or ``Device`` (its abstract value's)."""
    return getattr(jax.typeof(leaf), "memory_space", jax.memory.Space.Device)


def memory_kind(x: Any) -> str | None:
    """The memory kind ``x`` lies in by its sharding (``"pinned_host"``, ``"unpinned_host"``,
    ``"device"``), or None (no sharding: a NumPy array, a tracer). JAX types an unpinned
    host array as the device's (`memory_space`): this tells them apart.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np, jaxga.meshes as m
        >>> host = jax.device_put(jnp.ones(2), jax.memory.Space.Host)
        >>> m.memory_kind(host), m.memory_kind(np.ones(2))
        ('pinned_host', None)
    """
    return getattr(getattr(x, "sharding", None), "memory_kind", None)


def refuses_host_memory(error: Exception) -> bool:
    """Whether ``error`` is JAX's refusal of a value in host memory where it computes: its
    message shows the value's type, ``float32<host>[...]``.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga.meshes as m
        >>> host = jax.device_put(jnp.ones(2), jax.memory.Space.Host)
        >>> try:
        ...     jax.jit(lambda x, y: x + y)(host, jnp.ones(2))
        ... except ValueError as e:
        ...     print(m.refuses_host_memory(e))
        True
    """
    return "<host>" in str(error)


def mesh_of(tree: Any, name: str) -> Mesh | None:
    """The one mesh the concrete leaves of ``tree`` laid out by a `NamedSharding` share, or
    ``None``: a traced leaf (the enclosing jit places them), no such leaf.

    Args:
        tree: a pytree of arrays (concrete or traced).
        name: the argument ``tree`` is, for the error.

    Returns:
        The mesh, or ``None``.

    Raises:
        ValueError: ``tree``'s leaves lie on more than one mesh.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jaxga.meshes import mesh_of
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> x = jax.device_put(jnp.ones(2), jax.NamedSharding(mesh, jax.P()))
        >>> mesh_of({"x": x}, "x") == mesh, mesh_of(jnp.ones(2), "y")
        (True, None)
    """
    leaves = jax.tree.leaves(tree)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return None
    shardings = [getattr(x, "sharding", None) for x in leaves]
    found = list(dict.fromkeys(s.mesh for s in shardings if isinstance(s, NamedSharding)))
    if len(found) > 1:
        got = " and ".join(
            f"{dict(m.shape)} of devices {[d.id for d in m.devices.flat]}" for m in found[:2]
        )
        raise ValueError(f"`{name}` lies on more than one mesh ({got}); expected one.")
    return found[0] if found else None


def jit_on_mesh_of(fn: Callable[[Any], Any], tree: Any, name: str) -> Any:
    """``jax.jit(fn)(tree)`` on ``tree``'s devices: under the mesh its leaves laid out by a
    `NamedSharding` share (`mesh_of`; `jax.set_mesh`: Explicit axes type what ``fn`` makes
    there), every argument kept (one ``fn`` does not read still says where the outputs go);
    traced, as a nested ``jax.jit`` (the enclosing one places it). On Auto axes XLA lays out
    what ``fn`` makes from nothing (zeros): replicated.

    Args:
        fn: a function of ``tree``.
        tree: a pytree of arrays (concrete or traced).
        name: the argument ``tree`` is, for the error.

    Returns:
        ``fn(tree)``, jitted.

    Raises:
        ValueError: ``tree``'s leaves lie on more than one mesh.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jaxga.meshes import jit_on_mesh_of
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> x = jax.device_put(jnp.ones(2), jax.NamedSharding(mesh, jax.P()))
        >>> jit_on_mesh_of(jnp.zeros_like, x, "x").sharding.mesh == mesh
        True
    """
    jitted = jax.jit(fn, keep_unused=True)
    mesh = mesh_of(tree, name)
    if mesh is None:
        return jitted(tree)
    with jax.set_mesh(mesh):
        return jitted(tree)
