"""The optimiser's update a layer at a time over layer stacks in host memory
(``make_train_step(stream="layers")``): each layer's parameters, gradient and optimiser-state
slices fetched to the device, updated, and written back; a probe refuses a ``tx`` that is not
elementwise (docs/streaming.md).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxga._streaming import is_streamed, on_device, placed_like
from jaxga.multistep import MultiStepsState

# The optimiser's update layer by layer (`make_train_step(stream="layers")`). Each leaf is of
# one kind: `_STATE` (an optimiser-state leaf that mirrors no parameter: a count, a schedule's
# state), `_RESIDENT` (a parameter on the device, or an optimiser-state leaf mirroring one) or
# `_STREAMED` (a parameter in host memory with a layer axis, or a state leaf mirroring one).
_STATE, _RESIDENT, _STREAMED = 0, 1, 2
_FIX = "build the step with stream=True (the whole-tree update) for this `tx`"


class StreamError(ValueError):
    """`stream="layers"` cannot update this optimiser a layer at a time (raised unwrapped)."""


def leaf_kinds(tx: Any, params: Any, opt_state: Any) -> tuple[list[int], list[int]]:
    """Each leaf's kind (`_STATE`, `_RESIDENT`, `_STREAMED`), flat, of ``params`` and of
    ``opt_state``, whose copies of the parameters ``optax.tree_utils.tree_map_params`` finds.

    Args:
        tx: the optax transformation ``opt_state`` is of.
        params: the parameters, streamed leaves in host memory.
        opt_state: ``tx``'s state for ``params``.

    Returns:
        ``(kinds of params' leaves, kinds of opt_state's leaves)``.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> from jaxga._layerwise import leaf_kinds
        >>> params = {"w": jnp.ones((2, 3))}
        >>> leaf_kinds(optax.adam(0.1), params, optax.adam(0.1).init(params))
        ([1], [0, 1, 1])
    """
    kinds = jax.tree.map(lambda x: _STREAMED if is_streamed(x) else _RESIDENT, params)

    def mirror(leaf: Any, kind: int, param: Any) -> int:
        if jnp.shape(leaf) != jnp.shape(param):
            raise ValueError(f"a state leaf of shape {jnp.shape(leaf)} for {jnp.shape(param)}")
        return kind

    try:
        marked = optax.tree_utils.tree_map_params(
            tx, mirror, opt_state, kinds, params, transform_non_params=_non_param
        )
    except (TypeError, ValueError, AttributeError) as e:
        raise StreamError(
            f'`stream`="layers": optax.tree_utils.tree_map_params cannot find the copies of the '
            f"parameters in `tx`'s state ({type(e).__name__}: {e}); expected an optimiser whose "
            f"state holds parameter-shaped trees: {_FIX}."
        ) from e
    return jax.tree.leaves(kinds), jax.tree.leaves(marked)


def _non_param(tree: Any) -> Any:
    return jax.tree.map(lambda _: _STATE, tree)


def _empty(leaf: Any) -> jax.Array:
    """A stand-in for ``leaf`` with no layers: shape ``(0, ...)``, on the device."""
    return jnp.zeros((0, *jnp.shape(leaf)[1:]), jax.typeof(leaf).dtype)


def _leaves(state: Any, grads: Any) -> tuple[list[Any], list[Any], list[Any]]:
    return jax.tree.leaves(state.params), jax.tree.leaves(grads), jax.tree.leaves(state.opt_state)


def _with(state: Any, params: list[Any], opt_state: list[Any]) -> Any:
    """``state`` with these flat ``params`` and ``opt_state`` leaves."""
    return state.replace(
        params=jax.tree.unflatten(jax.tree.structure(state.params), params),
        opt_state=jax.tree.unflatten(jax.tree.structure(state.opt_state), opt_state),
    )


def split_update(
    update: Callable[..., Any], state: Any, grads: Any, *, kinds: Any, **extra: Any
) -> Any:
    """``update(state, grads, **extra)`` in parts: once over the resident leaves (each stack a
    stand-in with no layers), then, per layer count, a ``lax.scan`` over the stacks' layers
    (the resident leaves stand-ins), each layer's slices fetched and written back home.

    Args:
        update: ``(state, grads, **extra) -> state``, a train state's ``apply_gradients``.
        state: a train state (``params``, ``opt_state``).
        grads: the gradient, like ``state.params``.
        kinds: `leaf_kinds` of ``state``'s params and optimiser state.
        extra: ``update``'s keywords (``weight``, ``end_group``).

    Returns:
        The updated state; its optimiser-state leaves that mirror no parameter from the
        resident call (each layer's call computes the same, `check_elementwise`).

    Examples:
        >>> import jax.numpy as jnp, optax, jaxga
        >>> from jaxga._layerwise import leaf_kinds, split_update
        >>> state = jaxga.TrainState.create(params=jnp.ones((2, 3)), tx=optax.sgd(1.0))
        >>> kinds = ([2], [])  # as if the (2, 3) stack lived in host memory
        >>> def update(state, grads, **extra):
        ...     return state.apply_gradients(grads=grads, **extra)
        >>> split_update(update, state, jnp.ones((2, 3)), kinds=kinds).params.tolist()
        [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    """
    (p, g, o), (pk, ok) = _leaves(state, grads), kinds
    params = [_empty(x) if k == _STREAMED else on_device(x) for x, k in zip(p, pk)]
    grads_d = [_empty(x) if k == _STREAMED else on_device(x) for x, k in zip(g, pk)]
    opt = [_empty(x) if k == _STREAMED else on_device(x) for x, k in zip(o, ok)]
    grads_d = jax.tree.unflatten(jax.tree.structure(grads), grads_d)
    new = update(_with(state, params, opt), grads_d, **extra)
    new_p, new_o = jax.tree.leaves(new.params), jax.tree.leaves(new.opt_state)
    for size in sorted({jnp.shape(x)[0] for x, k in zip(p, pk) if k == _STREAMED}):
        got_p, got_o = _scan_layers(update, state, grads, kinds, size=size, extra=extra)
        new_p = [got_p.get(i, x) for i, x in enumerate(new_p)]
        new_o = [got_o.get(i, x) for i, x in enumerate(new_o)]
    return _with(new, new_p, new_o)


def _scan_layers(
    update: Callable[..., Any], state: Any, grads: Any, kinds: Any, *, size: int, extra: Any
) -> tuple[dict[int, Any], dict[int, Any]]:
    """The streamed leaves of ``size`` layers updated a layer at a time: by flat index, the
    new params and optimiser-state leaves, each in its old leaf's memory."""
    (p, g, o), (pk, ok) = _leaves(state, grads), kinds
    mine_p = [i for i, (x, k) in enumerate(zip(p, pk)) if k == _STREAMED and x.shape[0] == size]
    mine_o = [i for i, (x, k) in enumerate(zip(o, ok)) if k == _STREAMED and x.shape[0] == size]
    treedef = jax.tree.structure(grads)

    def body(_: None, slices: tuple[list[Any], list[Any], list[Any]]) -> tuple[None, Any]:
        params, grads_l = [_empty(x) for x in p], [_empty(x) for x in g]
        opt = [on_device(x) if k == _STATE else _empty(x) for x, k in zip(o, ok)]
        for i, w, d in zip(mine_p, slices[0], slices[1]):
            params[i], grads_l[i] = on_device(w), on_device(d)
        for i, s in zip(mine_o, slices[2]):
            opt[i] = on_device(s)
        new = update(_with(state, params, opt), jax.tree.unflatten(treedef, grads_l), **extra)
        new_p, new_o = jax.tree.leaves(new.params), jax.tree.leaves(new.opt_state)
        homes = ([p[i] for i in mine_p], [o[i] for i in mine_o])
        return None, placed_like(([new_p[i] for i in mine_p], [new_o[i] for i in mine_o]), homes)

    xs = ([p[i] for i in mine_p], [g[i] for i in mine_p], [o[i] for i in mine_o])
    ys_p, ys_o = jax.lax.scan(body, None, xs)[1]
    return dict(zip(mine_p, ys_p)), dict(zip(mine_o, ys_o))


def _probe(tree: Any, seed: int, *, nan: bool = False) -> Any:
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


def check_elementwise(update: Callable[..., Any], state: Any, kinds: Any, **extra: Any) -> None:
    """Raises unless `split_update` gives exactly ``update``'s whole-tree result, on small
    concrete probes of ``state``'s structure: four updates (layers of unlike scale, a NaN in
    the last; ``end_group`` alternating where ``state.tx`` holds a `jaxga.MultiSteps`).

    Args:
        update: ``(state, grads, **extra) -> state``, a train state's ``apply_gradients``.
        state: a train state of the step (its ``tx``, and its params' tree and ranks).
        kinds: `leaf_kinds` of ``state``'s params and optimiser state.
        extra: the keywords the step passes ``update`` (their values replaced by probes').

    Returns:
        None.

    Examples:
        >>> import jax.numpy as jnp, optax, jaxga
        >>> from jaxga._layerwise import check_elementwise
        >>> state = jaxga.TrainState.create(params=jnp.ones((2, 3)), tx=optax.adam(0.1))
        >>> def update(state, grads, **extra):
        ...     return state.apply_gradients(grads=grads, **extra)
        >>> check_elementwise(update, state, ([2], [0, 2, 2]))  # adam: exact by layer
    """
    with jax.ensure_compile_time_eval(), jax.disable_jit():  # op by op, scans as loops
        params = _probe(state.params, 0)
        whole = split = state.replace(step=0, params=params, opt_state=state.tx.init(params))
        grouped = bool(_multisteps(split.opt_state)) or "end_group" in extra
        for t in range(4):
            probe = {k: jnp.asarray(t + 1, jax.typeof(v).dtype) for k, v in extra.items()}
            probe = {k: v for k, v in probe.items() if k == "weight"}
            probe |= {"end_group": jnp.asarray(t % 2 == 1)} if grouped else {}
            grads = _probe(state.params, t + 1, nan=t == 3)
            whole = update(whole, grads, **probe)
            try:
                split = split_update(update, split, grads, kinds=kinds, **probe)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f'`stream`="layers": `tx` fails on one layer ({e}): {_FIX}.'
                ) from e
            _check_same(split, whole, t)


def _multisteps(opt_state: Any) -> list[Any]:
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, MultiStepsState))
    return [x for x in nodes if isinstance(x, MultiStepsState)]


def _check_same(split: Any, whole: Any, t: int) -> None:
    """Raises, naming the first leaf that differs, unless ``split`` equals ``whole``."""
    got = jax.tree_util.tree_leaves_with_path((split.params, split.opt_state))
    for (path, a), b in zip(got, jax.tree.leaves((whole.params, whole.opt_state)), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if not np.array_equal(a, b, equal_nan=np.issubdtype(a.dtype, np.inexact)):
            where = ("params" if path[0].idx == 0 else "opt_state") + jax.tree_util.keystr(path[1:])
            raise StreamError(
                f'`stream`="layers" updates a layer at a time, exact only for an optimiser '
                f"that updates each element from its own values (sgd, adam, adamw, lion); "
                f"`tx` is not (it reduces across leaves or layers: clipping by global norm, "
                f"trust ratios, factored moments). On a probe, update {t + 1}'s {where} got "
                f"{a.ravel()[:4]} a layer at a time; expected the whole-tree {b.ravel()[:4]}: "
                f"{_FIX}."
            )


def updated_by_layer(
    update: Callable[..., Any], state: Any, grads: Any, *, tx: Any, **extra: Any
) -> Any:
    """``update(state, grads, **extra)`` with the stacks in host memory updated a layer at a
    time (`split_update`), once `check_elementwise` finds ``tx`` exact that way.

    Args:
        update: ``(state, grads, **extra) -> state``, a train state's ``apply_gradients``.
        state: a train state; its stacks (leaves with a layer axis) in host memory streamed.
        grads: the gradient, like ``state.params`` (a stack's in host memory or not).
        tx: ``state``'s optax transformation.
        extra: ``update``'s keywords (``weight``, ``end_group``).

    Returns:
        The updated state, each leaf in its old leaf's memory (the others on the device).

    Examples:
        >>> import jax, jax.numpy as jnp, optax, jaxga
        >>> from jaxga._layerwise import updated_by_layer
        >>> host = jax.memory.Space.Host
        >>> state = jaxga.TrainState.create(params=jnp.ones((2, 3)), tx=optax.adam(0.1))
        >>> run = jax.jit(updated_by_layer, static_argnums=0, static_argnames="tx")
        >>> state = state.replace(params=jax.device_put(state.params, host))
        >>> def update(state, grads, **extra):
        ...     return state.apply_gradients(grads=grads, **extra)
        >>> new = run(update, state, jnp.ones((2, 3)), tx=state.tx)
        >>> round(float(new.params[0, 0]), 4), str(jax.typeof(new.params).memory_space)
        (0.9, 'MemorySpace.Host')
    """
    kinds = leaf_kinds(tx, state.params, state.opt_state)
    check_elementwise(update, state, kinds, **extra)
    return split_update(update, state, grads, kinds=kinds, **extra)


def streamed_leaves(state: Any) -> Any:
    """A tree like ``state`` (a train state): True at the leaves the update streams (stacks in
    host memory, and the optimiser-state leaves that mirror them), False elsewhere."""
    pk, ok = leaf_kinds(state.tx, state.params, state.opt_state)
    none = jax.tree.map(lambda _: False, state)
    return _with(none, [k == _STREAMED for k in pk], [k == _STREAMED for k in ok])
