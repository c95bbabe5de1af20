"""Layer stacks in host memory (a leaf with a leading layer axis, `is_streamed`): a layer
fetched to the device and written back in place, and the whole-stack operations a step
needs taken a layer at a time, so that no stack is ever whole on the device: a stack made
(`made_by_layer`, `zeros_placed_like`), updated (`layerwise`), summed over mesh axes
(`psum_by_layer`) and normed (`global_norm`). The streamed scan (`_streaming`) and the
optimiser's update by layer (`_layerwise`) are built on these.
"""

import functools
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxga.meshes import HOST_KINDS, layer_split, memory_space, type_spec

_HOST = jax.memory.Space.Host
_DEVICE = jax.memory.Space.Device


def is_streamed(leaf: Any) -> bool:
    """Whether ``leaf`` is a layer stack the update streams: in host memory, with a layer axis."""
    return memory_space(leaf) == _HOST and jnp.ndim(leaf) > 0


def on_device(tree: Any) -> Any:
    """``tree`` with its host-memory leaves fetched to the device (the others as they are):
    arrays, traced or not, copied; shape structs described on the device (on one device,
    without a sharding, as `planner.abstract` describes an array there)."""

    def fetch(leaf: Any) -> Any:
        if isinstance(leaf, jax.ShapeDtypeStruct):
            where = leaf.sharding
            if getattr(where, "memory_kind", None) not in HOST_KINDS:
                return leaf
            where = where.with_memory_kind("device") if len(where.device_set) > 1 else None
            return jax.ShapeDtypeStruct(
                leaf.shape, leaf.dtype, sharding=where, weak_type=leaf.weak_type
            )
        return jax.device_put(leaf, _DEVICE) if memory_space(leaf) == _HOST else leaf

    return jax.tree.map(fetch, tree)


def placed_like(tree: Any, homes: Any) -> Any:
    """``tree`` with each leaf written to the memory its leaf of ``homes`` lives in."""

    def put(leaf: Any, home: Any) -> Any:
        moved = memory_space(home) == _HOST and memory_space(leaf) != _HOST
        return jax.device_put(leaf, _HOST) if moved else leaf

    return jax.tree.map(put, tree, homes)


def zeros_placed_like(tree: Any, homes: Any) -> Any:
    """`placed_like` for a tree of zeros: a host-memory stack's zeros written a layer at a
    time (never a stack of zeros on the device).

    Examples:
        >>> import jax.numpy as jnp
        >>> from jaxga._host_stacks import zeros_placed_like
        >>> zeros_placed_like(jnp.zeros(2), jnp.ones(2)).tolist()
        [0.0, 0.0]
    """

    def put(leaf: Any, home: Any) -> Any:
        if not is_streamed(home):
            return placed_like(leaf, home)
        mesh = splitting_mesh(home)
        if mesh is None:
            return _zeros_stack(leaf, leaf.dtype)
        # split by its layers: each device its own, laid out as ``home`` (the zeros given
        # need not be: jnp.zeros_like keeps no layout in newer JAX)
        spec = type_spec(home)
        zeros = functools.partial(_zeros_stack, dtype=leaf.dtype)
        return jax.shard_map(zeros, mesh=mesh, in_specs=spec, out_specs=spec)(home)

    return jax.tree.map(put, tree, homes)


def _zeros_stack(like: Any, dtype: Any) -> jax.Array:
    """Zeros of ``dtype`` like ``like`` (its shape and varying axes) in host memory, made a
    layer at a time."""
    zeros = functools.partial(_zeros, like.shape[1:], dtype)
    stack = made_by_layer(zeros, jnp.arange(like.shape[0]))
    return jax.lax.pcast(stack, tuple(jax.typeof(like).mat.varying), to="varying")


def _zeros(shape: tuple[int, ...], dtype: Any, _: Any) -> jax.Array:
    """Zeros of ``shape`` and ``dtype``, whatever the third argument (a layer's index)."""
    return jnp.zeros(shape, dtype)


def made_by_layer(fn: Callable[[Any], Any], xs: Any) -> Any:
    """``fn(x)`` for each slice ``x`` of ``xs``' leading axis, made on the device and written
    to host memory, stacked there: a ``lax.scan``'s output (the stack never on the device).

    Args:
        fn: a function of one slice, returning a pytree of arrays (a layer's).
        xs: a pytree of arrays of one leading size (the layers').

    Returns:
        ``fn``'s pytree, each leaf stacked on a leading axis, in host memory.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jaxga._host_stacks import made_by_layer
        >>> stack = jax.jit(made_by_layer, static_argnums=0)(jnp.square, jnp.arange(3.0))
        >>> stack.tolist(), stack.sharding.memory_kind
        ([0.0, 1.0, 4.0], 'pinned_host')
    """

    def body(_: None, x: Any) -> tuple[None, Any]:
        return None, jax.device_put(fn(x), _HOST)

    return jax.lax.scan(body, None, xs)[1]


def fetch_layer(stacked: Any, index: Any) -> Any:
    """Layer ``index``'s slice of each leaf of ``stacked``, fetched to the device."""
    return on_device(
        jax.tree.map(lambda s: jax.lax.dynamic_index_in_dim(s, index, 0, False), stacked)
    )


def write_layer(stack: jax.Array, value: jax.Array, index: Any) -> jax.Array:
    """``stack`` with ``value`` as its layer ``index``, where ``stack`` lies (in place)."""
    value = placed_like(value.astype(stack.dtype), stack)
    return jax.lax.dynamic_update_index_in_dim(stack, value, index, 0)


def layerwise(fn: Callable[..., Any], home: Any, *others: Any, consts: tuple = ()) -> Any:
    """``fn(leaf, *other_leaves)`` over ``home``'s leaves; for a leaf in host memory, run on
    the device a layer (leading index) at a time and each result written back to host memory
    (over the leaf's own layer, in place, where ``fn`` keeps its dtype).

    Args:
        fn: an elementwise function of a leaf of ``home`` and the same leaves of ``others``.
        home: the tree whose leaves say where each result lives (host or device memory).
        others: trees like ``home`` (leaves of the same leading size).
        consts: scalars ``fn`` takes after the leaves, the same for every leaf (a count, say).

    Returns:
        ``fn``'s results, a tree like ``home``, each leaf in its leaf of ``home``'s memory.

    Examples:
        >>> import jax.numpy as jnp
        >>> from jaxga._host_stacks import layerwise
        >>> layerwise(jnp.add, {"w": jnp.ones(2)}, {"w": jnp.ones(2)})["w"].tolist()
        [2.0, 2.0]
    """

    def one(leaf: Any, *rest: Any) -> Any:
        if memory_space(leaf) != _HOST:
            return fn(leaf, *rest, *consts)
        if not jnp.ndim(leaf):
            return jax.device_put(fn(*on_device((leaf, *rest)), *consts), _HOST)
        layer = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in (leaf, *rest)]
        in_place = jax.eval_shape(fn, *layer, *consts).dtype == leaf.dtype
        splits = {layer_split(x) for x in (leaf, *rest)}
        if len(splits) > 1:  # each device would read other layers of another leaf
            got = f"stacks laid out apart, their layers split by {sorted(splits)}"
            raise ValueError(f"layerwise: {got}; expected one layout for every stack.")
        if not layer_split(leaf):
            return _by_layer(fn, in_place, consts, leaf, *rest)
        # split by its layers in jit's global view: each device's layers, in a shard_map
        mesh, specs = splitting_mesh(leaf), tuple(type_spec(x) for x in (leaf, *rest))
        local = functools.partial(_by_layer, fn, in_place)
        in_specs = (tuple(jax.P() for _ in consts), *specs)
        local = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=specs[0])
        return local(consts, leaf, *rest)

    return jax.tree.map(one, home, *others)


def _by_layer(fn: Callable[..., Any], in_place: bool, consts: tuple, leaf: Any, *rest: Any) -> Any:
    """`layerwise` on one stack in host memory: over ``leaf`` if ``in_place``, else a new stack."""

    def on(slices: tuple[Any, ...]) -> Any:
        return fn(*on_device(slices), *consts)

    def written(stack: Any, index: jax.Array) -> tuple[Any, None]:  # over ``leaf``
        return write_layer(stack, on(fetch_layer((stack, *rest), index)), index), None

    if not in_place:
        return made_by_layer(on, (leaf, *rest))
    varying = [jax.typeof(x).mat.varying for x in (leaf, *rest)]
    leaf = jax.lax.pcast(leaf, tuple(frozenset().union(*varying[1:]) - varying[0]), to="varying")
    return jax.lax.scan(written, leaf, jnp.arange(leaf.shape[0]))[0]


def check_resident(stacked_params: Any, fix: str) -> None:
    """Raises a `ValueError` naming the first leaf of ``stacked_params`` in host memory (a
    stack that only a streamed scan fetches), and ``fix``: what to call instead.

    Args:
        stacked_params: a layer stack, a pytree.
        fix: what the message tells the caller to do.

    Returns:
        None.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jaxga._host_stacks import check_resident
        >>> check_resident({"w": jnp.ones((2, 3))}, "pass stream=True")  # on the device
        >>> check_resident({"w": jax.device_put(jnp.ones((2, 3)), jax.memory.Space.Host)}, "no")
        Traceback (most recent call last):
        ...
        ValueError: `stacked_params`['w'] lives in host memory: no, which fetches each layer ...
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(stacked_params)[0]:
        if hasattr(leaf, "shape") and memory_space(leaf) == _HOST:
            where = f"`stacked_params`{jax.tree_util.keystr(path)} lives in host memory"
            raise ValueError(f"{where}: {fix}, which fetches each layer to the device.")


def splitting_mesh(leaf: Any) -> Any:
    """The mesh whose axes split ``leaf``'s layer axis in jit's global view
    (`meshes.layer_split`), or None."""
    return jax.typeof(leaf).sharding.mesh if layer_split(leaf) else None


def psum_by_layer(stacks: list[jax.Array], axes: Any) -> list[jax.Array]:
    """``stacks`` (in host memory, of one leading size) summed over the mesh ``axes`` a layer
    at a time on the device, one all-reduce of every stack's slice a layer, into new stacks
    in host memory: a sum no longer varies over ``axes``, and ``shard_map``'s types refuse
    writing it over a stack that does.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> from jaxga._host_stacks import psum_by_layer
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> summed = jax.shard_map(
        ...     lambda x: psum_by_layer([x], "data")[0], mesh=mesh, in_specs=P(), out_specs=P()
        ... )
        >>> summed(jnp.ones((2, 3))).tolist()
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    """

    def body(_: None, slices: list[jax.Array]) -> tuple[None, list[jax.Array]]:
        return None, [jax.device_put(x, _HOST) for x in jax.lax.psum(on_device(slices), axes)]

    return jax.lax.scan(body, None, stacks)[1]


def _squared(x: jax.Array) -> jax.Array:  # |x|², as optax squares a complex leaf
    return jnp.square(jnp.real(x)) + jnp.square(jnp.imag(x))


def global_norm(tree: Any) -> jax.Array:
    """``optax.tree.norm(tree)``, each host-memory stack's squares summed a layer at a time on
    the device (to float rounding of the whole leaf's sum: the order of the sum differs).

    Examples:
        >>> import jax.numpy as jnp
        >>> from jaxga._host_stacks import global_norm
        >>> float(global_norm({"w": jnp.full((2, 2), 3.0), "b": jnp.zeros(1)}))
        6.0
    """

    def squares(leaf: Any) -> jax.Array:
        if not is_streamed(leaf):
            return jnp.sum(_squared(on_device(leaf)))
        mesh = splitting_mesh(leaf)
        if mesh is None:
            return _stack_squares(leaf)
        spec = type_spec(leaf)  # split by its layers: each device's, summed
        summed = functools.partial(_stack_squares, over=layer_split(leaf))
        return jax.shard_map(summed, mesh=mesh, in_specs=spec, out_specs=jax.P())(leaf)

    return jnp.sqrt(jax.tree.reduce(operator.add, jax.tree.map(squares, tree), initializer=0))


def _stack_squares(stack: jax.Array, over: tuple = ()) -> jax.Array:
    """The sum of a host-memory stack's squares, a layer at a time on the device, at float32
    at least (then in optax's dtype for the leaf); summed over the mesh axes ``over``."""
    dtype = jnp.finfo(jax.typeof(stack).dtype).dtype  # optax's, per leaf (complex: real)

    def body(total: jax.Array, layer: jax.Array) -> tuple[jax.Array, None]:
        return total + jnp.sum(_squared(on_device(layer)), dtype=total.dtype), None

    total = jnp.zeros((), jnp.promote_types(dtype, jnp.float32))  # the layers' sums kept
    total = jax.lax.pcast(total, tuple(jax.typeof(stack).mat.varying), to="varying")
    total = jax.lax.scan(body, total, stack)[0]
    return (jax.lax.psum(total, over) if over else total).astype(dtype)
