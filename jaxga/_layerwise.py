"""The optimiser's update a layer at a time over layer stacks in host memory (both train
steps' ``stream="layers"``): each layer's parameters, gradient and optimiser-state slices
fetched to the device, updated, and written back; a probe, and a trace at the stacks' real
sizes, refuse a ``tx`` that is not elementwise (docs/streaming.md). Its state made the
same way: `_layerwise_init`. A step's kind says how to reach its parameters and optimiser state
(`skeleton.OptimizerAccess`): a Flax TrainState's, an NNX optimizer's.
"""

import collections
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxga._cones import cone
from jaxga._host_stacks import (
    fetch_layer,
    is_streamed,
    on_device,
    splitting_mesh,
    write_layer,
)
from jaxga.meshes import devices, layer_split, type_spec
from jaxga.multistep import states_in

if TYPE_CHECKING:
    from jaxga.skeleton import OptimizerAccess

# The optimiser's update layer by layer (`make_train_step(stream="layers")`). Each leaf is of
# one kind: `STATE` (an optimiser-state leaf that mirrors no parameter: a count, a schedule's
# state), `RESIDENT` (a parameter on the device, or an optimiser-state leaf mirroring one) or
# `STREAMED` (a parameter in host memory with a layer axis, or a state leaf mirroring one).
STATE, RESIDENT, STREAMED = 0, 1, 2
_FIX = "build the step with stream=True (the whole-tree update) for this `tx`"
_BY_RANK = (
    "a mask or labels by the leaves' rank, shape or size treat a layer's slice (an axis "
    "fewer) unlike its stack: give them by the parameters' paths"
)
_WHO = '`stream`="layers"'


class StreamError(ValueError):
    """`stream="layers"` cannot update this optimiser a layer at a time (raised unwrapped)."""


def leaf_kinds(
    tx: Any, params: Any, opt_state: Any, *, who: str = _WHO, fix: str = _FIX
) -> tuple[list[int], list[int]]:
    """Each leaf's kind (`STATE`, `RESIDENT`, `STREAMED`), flat, of ``params`` and of
    ``opt_state``, whose copies of the parameters ``optax.tree_utils.tree_map_params`` finds.

    Args:
        tx: the optax transformation ``opt_state`` is of.
        params: the parameters, streamed leaves in host memory.
        opt_state: ``tx``'s state for ``params`` (or its shapes, `jax.eval_shape`).
        who: what streams, for an error (a `StreamError` if the mirrors cannot be found).
        fix: what to do instead, for that error.

    Returns:
        ``(kinds of params' leaves, kinds of opt_state's leaves)``.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> from jaxga._layerwise import leaf_kinds
        >>> params = {"w": jnp.ones((2, 3))}
        >>> leaf_kinds(optax.adam(0.1), params, optax.adam(0.1).init(params))
        ([1], [0, 1, 1])
    """
    kinds = jax.tree.map(lambda x: STREAMED if is_streamed(x) else RESIDENT, params)

    def mirror(leaf: Any, kind: int, param: Any) -> int:
        if jnp.shape(leaf) != jnp.shape(param):
            raise ValueError(f"a state leaf of shape {jnp.shape(leaf)} for {jnp.shape(param)}")
        return kind

    try:
        marked = map_mirrors(tx, mirror, opt_state, kinds, params, transform_non_params=_non_param)
    except UnmappedState as e:
        raise StreamError(
            f"{who}: {e}; expected an optimiser whose state holds parameter-shaped trees: {fix}."
        ) from e
    return jax.tree.leaves(kinds), jax.tree.leaves(marked)


class UnmappedState(ValueError):
    """`map_mirrors` cannot pair an optimiser state's copies of the parameters with them."""


def map_mirrors(
    tx: Any,
    fn: Callable[..., Any],
    opt_state: Any,
    *rest: Any,
    transform_non_params: Callable[[Any], Any] | None = None,
) -> Any:
    """``optax.tree_utils.tree_map_params(tx, fn, opt_state, *rest, ...)``: ``fn`` of each
    optimiser-state leaf that mirrors a parameter and of that parameter's leaves in ``rest``;
    a parameter `optax.masked` or `optax.multi_transform` leaves out of a state (an
    ``optax.MaskedNode``: no array) is kept, where optax's would find ``rest`` unlike it.

    Args:
        tx: the optax transformation ``opt_state`` is of.
        fn: a function of a state leaf and the leaves of ``rest`` at its parameter.
        opt_state: ``tx``'s state (or its shapes, `jax.eval_shape`).
        rest: trees shaped like the parameters (a tree of specs, of kinds).
        transform_non_params: a function of each subtree that mirrors no parameter.

    Returns:
        ``opt_state`` mapped.

    Raises:
        UnmappedState: ``tree_map_params`` fails (``tx.init`` on its placeholder, a state
            unlike ``rest``, ``fn``), naming what it raised.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> from jaxga._layerwise import map_mirrors
        >>> params = {"a": jnp.ones(2), "b": jnp.ones(3)}
        >>> tx = optax.masked(optax.adam(0.1), {"a": True, "b": False})
        >>> state = map_mirrors(tx, lambda x, p: p.size, tx.init(params), params)
        >>> state.inner_state[0].mu
        {'a': 2, 'b': MaskedNode()}
    """

    def mapped(leaf: Any, *others: Any) -> Any:
        return leaf if isinstance(leaf, optax.MaskedNode) else fn(leaf, *others)

    try:
        return optax.tree_utils.tree_map_params(
            tx,
            mapped,
            opt_state,
            *rest,
            transform_non_params=transform_non_params,
            is_leaf=lambda x: isinstance(x, optax.MaskedNode),
        )
    except (TypeError, ValueError, AttributeError, IndexError, KeyError) as e:
        raise UnmappedState(
            "optax.tree_utils.tree_map_params cannot find the copies of the parameters in "
            f"`tx`'s state ({type(e).__name__}: {e})"
        ) from e


def _non_param(tree: Any) -> Any:
    return jax.tree.map(lambda _: STATE, tree)


def stand_in(leaf: Any) -> jax.Array:
    """A stand-in for ``leaf`` with no layers: shape ``(0, ...)``, on the device."""
    return jnp.zeros((0, *jnp.shape(leaf)[1:]), jax.typeof(leaf).dtype)


def _trees(access: "OptimizerAccess", state: Any) -> tuple[Any, Any]:
    """``(params, opt_state)`` of ``state``, as ``access`` reaches them."""
    return access.params(state), access.opt_state(state)


def _parts(access: "OptimizerAccess", state: Any) -> tuple[list[Any], ...]:
    """The flat params and optimiser-state leaves of ``state``, as ``access`` reaches them."""
    return tuple(map(jax.tree.leaves, _trees(access, state)))


def _with(access: "OptimizerAccess", state: Any, params: list[Any], opt_state: list[Any]) -> Any:
    """``state`` with these flat ``params`` and ``opt_state`` leaves (``access.rebuild``)."""
    treedefs = map(jax.tree.structure, _trees(access, state))
    return access.rebuild(state, *map(jax.tree.unflatten, treedefs, (params, opt_state)))


def split_update(
    access: "OptimizerAccess", state: Any, grads: Any, *, kinds: Any, **extra: Any
) -> Any:
    """``access.update(state, grads, **extra)`` in parts: once over the resident leaves (each
    stack a stand-in with no layers), then, per layer count, a ``lax.scan`` over the stacks'
    layers (the resident leaves stand-ins), each layer's slices fetched and written back home.

    Args:
        access: a `skeleton.OptimizerAccess`: the update, and how it reaches the parameters
            and the optimiser state of ``state``.
        state: a train state (a Flax TrainState, an NNX model and optimizer's state).
        grads: the gradient, leaves like ``access.params(state)``'s.
        kinds: `leaf_kinds` of ``state``'s params and optimiser state.
        extra: ``update``'s keywords (``weight``, ``end_group``; and ``counted``, which
            `skeleton`'s update takes to keep each layer's slices where nothing counted).

    Returns:
        The updated state; its optimiser-state leaves that mirror no parameter from the
        resident call (each layer's call computes the same, `check_elementwise`).

    Examples:
        >>> import jax.numpy as jnp, optax, jaxga
        >>> from jaxga._layerwise import split_update
        >>> state = jaxga.TrainState.create(params=jnp.ones((2, 3)), tx=optax.sgd(1.0))
        >>> access = jaxga.train._Flax(None, None, None).optimizer(state)
        >>> kinds = ([2], [])  # as if the (2, 3) stack lived in host memory
        >>> split_update(access, state, jnp.ones((2, 3)), kinds=kinds).params.tolist()
        [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    """
    (p, o), g, (pk, ok) = _parts(access, state), jax.tree.leaves(grads), kinds
    params = [stand_in(x) if k == STREAMED else on_device(x) for x, k in zip(p, pk)]
    grads_d = [stand_in(x) if k == STREAMED else on_device(x) for x, k in zip(g, pk)]
    opt = [stand_in(x) if k == STREAMED else on_device(x) for x, k in zip(o, ok)]
    grads_d = jax.tree.unflatten(jax.tree.structure(grads), grads_d)
    new = access.update(_with(access, state, params, opt), grads_d, **extra)
    new_p, new_o = _parts(access, new)
    groups = {_group(x) for x, k in zip(p, pk) if k == STREAMED}  # (layers, their split)
    for group in sorted(groups, key=str):
        got_p, got_o = _scan_where_they_lie(access, state, grads, kinds, group=group, extra=extra)
        new_p = [got_p.get(i, x) for i, x in enumerate(new_p)]
        new_o = [got_o.get(i, x) for i, x in enumerate(new_o)]
    return _with(access, new, new_p, new_o)


def _group(x: Any) -> tuple[int, tuple[Any, ...]]:
    """A stack's layers and the mesh axes that split them (`meshes.layer_split`)."""
    return x.shape[0], layer_split(x)


def _split_of(axes: tuple[Any, ...]) -> str:
    """How a stack's layers are split: ``"split over ('stage',)"`` or ``"not split"``."""
    return f"split over {axes!r}" if axes else "not split"


def _scan_where_they_lie(
    access: "OptimizerAccess", state: Any, grads: Any, kinds: Any, *, group: Any, extra: Any
) -> tuple[dict[int, Any], dict[int, Any]]:
    """`_scan_layers` over the streamed stacks of ``group`` (`_group`: their layers and the
    axes that split them); split over Explicit axes in jit's global view (a pipeline's
    stages), in a ``shard_map``: each device over its own layers. Raises a `StreamError` if
    a stack's gradient is laid out otherwise."""
    (p, o), g, (pk, ok) = _parts(access, state), jax.tree.leaves(grads), kinds
    mine = [
        [i for i, (x, k) in enumerate(zip(leaves, ks)) if k == STREAMED and _group(x) == group]
        for leaves, ks in ((p, pk), (o, ok))
    ]
    apart = [i for i in mine[0] if _group(g[i]) != group]
    if apart:  # a device would update its own layers with others' gradients
        got = f"a stack of {group[0]} layers {_split_of(group[1])}, its gradient's"
        got += f" {_split_of(_group(g[apart[0]])[1])}"
        raise StreamError(f'`stream`="layers": {got}; expected the gradient laid out as it.')
    size, split = group
    if not split:
        return _scan_layers(access, state, grads, kinds, mine=mine, size=size, extra=extra)
    mesh = splitting_mesh(p[mine[0][0]])
    layers = size // devices(mesh, split)

    def scanned(state: Any, grads: Any, extra: Any) -> tuple[dict[int, Any], dict[int, Any]]:
        # the traced values the update takes come in through ``state`` and ``extra``
        return _scan_layers(access, state, grads, kinds, mine=mine, size=layers, extra=extra)

    in_specs = jax.tree.map(type_spec, (state, grads, extra))
    out_specs = ({i: type_spec(p[i]) for i in mine[0]}, {i: type_spec(o[i]) for i in mine[1]})
    on_each = jax.shard_map(scanned, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    return on_each(state, grads, extra)


def _scan_layers(
    access: "OptimizerAccess",
    state: Any,
    grads: Any,
    kinds: Any,
    *,
    mine: list[list[int]],
    size: int,
    extra: Any,
) -> tuple[dict[int, Any], dict[int, Any]]:
    """The streamed leaves ``mine`` (the params' and the optimiser state's flat indices) of
    ``size`` layers updated a layer at a time: by flat index, the new params and
    optimiser-state leaves, each in its old leaf's memory."""
    (p, o), g, (_, ok) = _parts(access, state), jax.tree.leaves(grads), kinds
    mine_p, mine_o = mine
    treedef = jax.tree.structure(grads)

    def body(stacks: tuple[list[Any], list[Any]], layer: jax.Array) -> tuple[Any, None]:
        param_stacks, state_stacks = stacks  # written in place, layer by layer
        params, grads_l = [stand_in(x) for x in p], [stand_in(x) for x in g]
        opt = [on_device(x) if k == STATE else stand_in(x) for x, k in zip(o, ok)]
        for i, w in zip(mine_p, param_stacks):
            params[i], grads_l[i] = fetch_layer((w, g[i]), layer)
        for i, s in zip(mine_o, state_stacks):
            opt[i] = fetch_layer(s, layer)
        one = _with(access, state, params, opt), jax.tree.unflatten(treedef, grads_l)
        new_p, new_o = _parts(access, access.update(*one, **extra))
        new = ([new_p[i] for i in mine_p], [new_o[i] for i in mine_o])
        return jax.tree.map(functools.partial(_written, at=layer), stacks, new), None

    stacks = ([p[i] for i in mine_p], [o[i] for i in mine_o])  # written in place, layer by layer
    ys_p, ys_o = jax.lax.scan(body, stacks, jnp.arange(size))[0]
    return dict(zip(mine_p, ys_p)), dict(zip(mine_o, ys_o))


def _written(stack: Any, value: Any, *, at: jax.Array) -> Any:
    """``stack`` with ``value`` written, where ``stack`` lies, as its layer ``at``: raises if
    ``tx`` changed its dtype (the whole tree's update would)."""
    if (dtype := jax.typeof(stack).dtype) != jax.typeof(value).dtype:
        got = f"changes a stack's dtype from {dtype} to {jax.typeof(value).dtype}"
        raise StreamError(f'`stream`="layers": `tx` {got}; expected the same dtype: {_FIX}.')
    return write_layer(stack, value, at)


def probe_like(tree: Any, seed: int, *, nan: bool = False) -> Any:
    """Small values like ``tree``'s leaves: each of its ndim, 2 layers (the second 1000 times
    the first) of size 3 on other axes; with ``nan``, a NaN in layer 1 of every stack."""
    rng = np.random.default_rng(seed)

    def leaf(x: Any) -> jax.Array:
        if not jnp.ndim(x):  # a scalar parameter: no layers
            return jnp.asarray(rng.normal(), jax.typeof(x).dtype)
        shape = (2,) + (3,) * (jnp.ndim(x) - 1)
        value = rng.normal(size=shape) * np.reshape([1.0, 1e3], (2,) + (1,) * (len(shape) - 1))
        if nan:
            value[(1,) + (0,) * (len(shape) - 1)] = np.nan
        return jnp.asarray(value, jax.typeof(x).dtype)

    return jax.tree.map(leaf, tree)


def check_elementwise(
    access: "OptimizerAccess", state: Any, grads: Any, kinds: Any, **extra: Any
) -> None:
    """Raises unless `split_update` gives ``access.update``'s whole-tree result (to `_ULPS`
    units in the last place), on small concrete probes of ``state``'s structure: four
    updates (layers of unlike scale, a NaN in the last; ``end_group`` alternating where
    ``access.tx`` holds a `jaxga.MultiSteps`); then `check_same_operations`. Once per
    ``tx``, ``access.static``, params' structure, shapes, dtypes and kinds, and ``extra``'s
    names (a ``tx`` that cannot be hashed: every time).

    Args:
        access: a `skeleton.OptimizerAccess` (its ``tx``, ``update``, and how it reaches the
            parameters and the optimiser state of ``state``).
        state: a train state of the step (its params' tree and ranks).
        grads: the step's gradient (its tree, for the probes').
        kinds: `leaf_kinds` of ``state``'s params and optimiser state.
        extra: the keywords the step passes ``update`` (their values replaced by probes').

    Returns:
        None.

    Examples:
        >>> import jax.numpy as jnp, optax, jaxga
        >>> from jaxga._layerwise import check_elementwise
        >>> state = jaxga.TrainState.create(params=jnp.ones((2, 3)), tx=optax.adam(0.1))
        >>> access = jaxga.train._Flax(None, None, None).optimizer(state)
        >>> check_elementwise(access, state, state.params, ([2], [0, 2, 2]))  # adam: exact
    """
    if (key := _probe_key(access, state, kinds, extra)) in _PROBED:
        return
    with jax.ensure_compile_time_eval(), jax.disable_jit():  # op by op, scans as loops
        params = probe_like(access.params(state), 0)
        # and from zeros, where the new parameters are the updates: a difference of an
        # update is not lost in the rounding of parameters far larger than it (noise)
        for start in (params, jax.tree.map(jnp.zeros_like, params)):
            _check_probe(access, state, start, grads, kinds=kinds, extra=extra)
    check_same_operations(access, state, grads, kinds, **extra)
    if key is not None:
        if len(_PROBED) >= 64:
            _PROBED.clear()
        _PROBED[key] = None


def _check_probe(
    access: "OptimizerAccess", state: Any, params: Any, grads: Any, *, kinds: Any, extra: dict
) -> None:
    """`check_elementwise`'s four updates from the probe parameters ``params``."""
    made = on_device(access.tx.init(params))  # `with_offloaded_init`'s: in host memory
    whole = split = access.rebuild(_scalars(state), params, made)
    grouped = bool(states_in(access.opt_state(split))) or "end_group" in extra
    for t in range(4):
        probe = {k: jnp.asarray(t + 1, jax.typeof(v).dtype) for k, v in extra.items()}
        probe = {k: v for k, v in probe.items() if k == "weight"}
        probe |= {"end_group": jnp.asarray(t % 2 == 1)} if grouped else {}
        probe_grads = probe_like(grads, t + 1, nan=t == 3)
        whole = access.update(whole, probe_grads, **probe)
        try:
            split = split_update(access, split, probe_grads, kinds=kinds, **probe)
        except (TypeError, ValueError, ZeroDivisionError) as e:  # muon: fan_out / fan_in
            raise _fails_on_a_layer(e) from e
        _check_same(_trees(access, split), _trees(access, whole), t)


def check_same_operations(
    access: "OptimizerAccess", state: Any, grads: Any, kinds: Any, **extra: Any
) -> None:
    """Raises unless ``access.update`` computes each streamed leaf of its result by the same
    operations and from the same inputs (`_cones.cone`) for a whole stack as for one of its
    layers, traced (not run) at the stacks' real sizes: what the small probes of
    `check_elementwise` cannot see (a weight-decay mask by size that takes a stack and
    leaves its layers out).

    Args:
        access: a `skeleton.OptimizerAccess` (its ``update``, and how it reaches the
            parameters and the optimiser state of ``state``).
        state: a train state of the step (its leaves' shapes and dtypes).
        grads: the step's gradient (its shapes).
        kinds: `leaf_kinds` of ``state``'s params and optimiser state.
        extra: the keywords the step passes ``update``.

    Returns:
        None.

    Raises:
        StreamError: a leaf's operations or inputs differ, or ``update`` fails on a layer's
            shapes.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, jaxga
        >>> from jaxga._layerwise import check_same_operations
        >>> big = lambda ps: jax.tree.map(lambda x: x.size > 4, ps)  # a stack of 6, layers of 3
        >>> state = jaxga.TrainState.create(params=jnp.ones((2, 3)), tx=optax.adamw(0.1, mask=big))
        >>> access = jaxga.train._Flax(None, None, None).optimizer(state)
        >>> check_same_operations(access, state, state.params, ([2], [0, 2, 2]))
        Traceback (most recent call last):
        ...
        jaxga._layerwise.StreamError: `stream`="layers" updates a layer at a time, and `tx` ...
    """
    (p, o), (pk, ok) = _parts(access, state), kinds
    leaves, streamed = [*p, *o], [i for i, k in enumerate([*pk, *ok]) if k == STREAMED]
    if not streamed:
        return
    whole = jax.tree.map(_abstract, (state, p, o, grads, extra))
    traced = jax.make_jaxpr(functools.partial(_updated, access))
    whole_jaxpr = traced(whole).jaxpr
    for size in sorted({jnp.shape(x)[0] for x, k in zip(p, pk) if k == STREAMED}):
        try:
            layer_jaxpr = traced(_layer_of(whole, kinds, size=size)).jaxpr
        except StreamError:
            raise
        except (AttributeError, TypeError, ValueError) as e:  # another state for a layer
            raise _fails_on_a_layer(e) from e
        for i in (i for i in streamed if jnp.shape(leaves[i])[0] == size):
            stack, layer = cone(whole_jaxpr, [i]), cone(layer_jaxpr, [i])
            if stack != layer:
                raise _differs_on_a_layer(access, state, i, stack, layer)


def _differs_on_a_layer(
    access: "OptimizerAccess", state: Any, leaf: int, stack: Any, layer: Any
) -> StreamError:
    """`check_same_operations`'s error: flat leaf ``leaf`` of the update's params and
    optimiser state is computed by ``stack``'s cone (`_cones.cone`) whole, by ``layer``'s a
    layer at a time."""
    trees = _trees(access, state)
    paths = [
        name + jax.tree_util.keystr(path)
        for name, tree in zip(("params", "opt_state"), trees)
        for path, _ in jax.tree_util.tree_leaves_with_path(tree)
    ]
    (ops, reads), (layer_ops, layer_reads) = stack, layer
    parts = []
    if more := ops - layer_ops:
        parts.append(f"the stack's computation has {_listed(more)} that a layer's lacks")
    if fewer := layer_ops - ops:
        parts.append(f"a layer's has {_listed(fewer)} that the stack's lacks")
    if reads != layer_reads:
        parts.append("they read other inputs")
    where = f"{paths[leaf]} (a stack of {jnp.shape(jax.tree.leaves(trees)[leaf])[0]} layers)"
    return StreamError(
        f'`stream`="layers" updates a layer at a time, and `tx` computes the new {where} '
        f"otherwise than each of its layers (traced at their sizes, not run): "
        f"{', '.join(parts)}; expected the same computation for the stack as for each layer. "
        f"Either `tx` reduces across a stack's layers or across leaves (a global norm, trust "
        f"ratios), or {_BY_RANK}; or {_FIX}."
    )


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    """``x``'s shape, dtype and weak type, on the device."""
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _updated(access: "OptimizerAccess", trees: tuple[Any, ...]) -> Any:
    """``access.update``'s params and optimiser-state leaves, flat, from ``trees``: the
    state, its flat params and optimiser-state leaves, the gradient and the keywords."""
    state, params, opt_state, grads, extra = trees
    new = access.update(_with(access, state, params, opt_state), grads, **extra)
    return [*jax.tree.leaves(access.params(new)), *jax.tree.leaves(access.opt_state(new))]


def _layer_of(trees: tuple[Any, ...], kinds: Any, *, size: int) -> tuple[Any, ...]:
    """`_updated`'s ``trees`` (abstract) with each streamed leaf of ``size`` layers one
    layer's shape."""
    (state, p, o, grads, extra), (pk, ok) = trees, kinds

    def one(x: Any, kind: int) -> Any:
        if kind != STREAMED or x.shape[0] != size:
            return x
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, weak_type=x.weak_type)

    g = jax.tree.unflatten(jax.tree.structure(grads), list(map(one, jax.tree.leaves(grads), pk)))
    return state, list(map(one, p, pk)), list(map(one, o, ok)), g, extra


def _listed(counted: collections.Counter, most: int = 6) -> str:
    """``counted``'s operations, ``"add ×1, mul ×2"`` (the first ``most``)."""
    named = [f"{name} ×{n}" for name, n in sorted(counted.items())]
    return ", ".join(named[:most]) + (f" and {len(named) - most} more" if named[most:] else "")


# The keys of the probes `check_elementwise` passed: module-level because the probe runs
# inside a trace, where no step object is at hand, and its verdict holds across retraces
# and steps; bounded (64 keys, each holding its tx and parameter signature alive).
_PROBED: dict[Any, None] = {}


def _probe_key(access: "OptimizerAccess", state: Any, kinds: Any, extra: Any) -> Any:
    """What a probe's verdict depends on, hashable; None if ``tx`` (or else) is not."""
    params = access.params(state)
    types = tuple((jnp.shape(x), jax.typeof(x).dtype) for x in jax.tree.leaves(params))
    key = (access.tx, access.static, jax.tree.structure(params), types, *map(tuple, kinds), *extra)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _scalars(state: Any) -> Any:
    """``state`` with its numeric scalars zeros (concrete): a step count the update advances."""

    def concrete(x: Any) -> Any:
        numeric = jnp.issubdtype(jax.typeof(x).dtype, jnp.number)
        return jnp.zeros((), jax.typeof(x).dtype) if numeric and not jnp.ndim(x) else x

    return jax.tree.map(concrete, state)


def first_difference(
    split: Any, whole: Any, *, ulps: int = 0
) -> tuple[str, np.ndarray, np.ndarray] | None:
    """``(where, split's leaf, whole's leaf)`` of the first leaf of ``split`` that differs from
    ``whole``'s by more than ``ulps`` units in the last place of its dtype, relative to each
    element and to the leaf's largest finite magnitude (NaNs alike), or None; ``where``
    reads from ``split``'s tree paths."""
    got = jax.tree_util.tree_leaves_with_path(split)
    for (path, a), b in zip(got, jax.tree.leaves(whole), strict=True):
        a, b = _numpy(a), _numpy(b)
        if not jnp.issubdtype(a.dtype, jnp.inexact):
            same = np.array_equal(a, b)
        else:
            tol = ulps * float(jnp.finfo(a.dtype).eps)
            a, b = a.astype(np.float64), b.astype(np.float64)
            scale = np.max(np.abs(b[np.isfinite(b)]), initial=0.0)
            same = np.allclose(a, b, rtol=tol, atol=tol * scale, equal_nan=True)
        if not same:
            return jax.tree_util.keystr(path), a, b
    return None


def _numpy(x: Any) -> np.ndarray:
    """``x`` as a NumPy array; a PRNG key (an optimiser's noise) as its data."""
    if jax.dtypes.issubdtype(jax.typeof(x).dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


# How far `check_elementwise`'s probe lets a layer's update round from the stack's: a
# layer's scalars may round otherwise than the stack's vector (Adam's, one scalar a layer).
_ULPS = 8


def _check_same(split: Any, whole: Any, t: int) -> None:
    """Raises, naming the first leaf that differs, unless ``split`` equals ``whole`` (each
    ``(params, opt_state)``)."""
    if (differs := first_difference(split, whole, ulps=_ULPS)) is None:
        return
    path, a, b = differs
    where = ("params" if path.startswith("[0]") else "opt_state") + path[3:]
    a, b = np.ravel(a), np.ravel(b)
    at = _furthest(a, b)
    raise StreamError(
        f'`stream`="layers" updates a layer at a time, exact only for an optimiser '
        f"that updates each element from its own values (sgd, adam, adamw, lion); "
        f"`tx` is not (it reduces across leaves or layers: clipping by global norm, "
        f"trust ratios, factored moments; it draws noise for a whole leaf; or {_BY_RANK}). "
        f"On a probe, update {t + 1}'s {where} got {a[at : at + 4].tolist()} (from element "
        f"{at}) a layer at a time; expected the whole-tree {b[at : at + 4].tolist()}: {_FIX}."
    )


def _furthest(a: np.ndarray, b: np.ndarray) -> int:
    """The index of the element of ``a`` furthest from ``b``'s relative to what
    `first_difference` allows there (NaN against a number the furthest, NaN against NaN
    and equal infinities none)."""
    if not a.size or a.dtype.kind not in "fc":
        return int(np.argmax(a != b)) if a.size else 0
    scale = np.max(np.abs(b[np.isfinite(b)]), initial=0.0)
    with np.errstate(invalid="ignore"):
        score = np.abs(a - b) / np.maximum(scale + np.abs(b), np.finfo(np.float64).tiny)
    score = np.nan_to_num(score, nan=0.0)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    score = np.where(nan_a & nan_b, 0.0, np.where(nan_a | nan_b, np.inf, score))
    return int(np.argmax(score))


def updated_by_layer(access: "OptimizerAccess", state: Any, grads: Any, **extra: Any) -> Any:
    """``access.update(state, grads, **extra)`` with the stacks in host memory updated a layer
    at a time (`split_update`), once `check_elementwise` finds ``access.tx`` exact that way.

    Args:
        access: a `skeleton.OptimizerAccess`: the update, ``tx``, and how it reaches the
            parameters and the optimiser state of ``state``.
        state: a train state; its stacks (leaves with a layer axis) in host memory streamed.
        grads: the gradient, like the parameters (a stack's in host memory or not).
        extra: ``update``'s keywords (``weight``, ``end_group``).

    Returns:
        The updated state, each leaf in its old leaf's memory (the others on the device).

    Examples:
        >>> import functools, jax, jax.numpy as jnp, optax, jaxga
        >>> from jaxga._layerwise import updated_by_layer
        >>> host = jax.memory.Space.Host
        >>> state = jaxga.TrainState.create(params=jnp.ones((2, 3)), tx=optax.adam(0.1))
        >>> access = jaxga.train._Flax(None, None, None).optimizer(state)
        >>> state = state.replace(params=jax.device_put(state.params, host))
        >>> new = jax.jit(functools.partial(updated_by_layer, access))(state, jnp.ones((2, 3)))
        >>> round(float(new.params[0, 0]), 4), str(jax.typeof(new.params).memory_space)
        (0.9, 'MemorySpace.Host')
    """
    kinds = leaf_kinds(access.tx, *_trees(access, state))
    check_elementwise(access, state, grads, kinds, **extra)
    try:
        return split_update(access, state, grads, kinds=kinds, **extra)
    except StreamError:
        raise
    except (TypeError, ValueError, ZeroDivisionError) as e:  # passed the probe, fails here
        raise _fails_on_a_layer(e) from e


def _fails_on_a_layer(e: Exception) -> StreamError:
    """The error of a ``tx`` that fails on a layer's slices (``e``), naming ``stream=``."""
    return StreamError(f'`stream`="layers": `tx` fails on one layer ({e}); {_BY_RANK}: {_FIX}.')


def streamed_leaves(access: "OptimizerAccess", state: Any) -> Any:
    """A tree like ``state``: True at the leaves the update streams (stacks in host memory,
    and the optimiser-state leaves that mirror them, as ``access`` reaches them), False
    elsewhere."""
    pk, ok = leaf_kinds(access.tx, *_trees(access, state))
    none = jax.tree.map(lambda _: np.asarray(False), state)  # arrays: NNX's state keeps them
    marks = [[np.asarray(k == STREAMED) for k in kinds] for kinds in (pk, ok)]
    return _with(access, none, *marks)
