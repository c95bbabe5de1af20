"""The optimiser's state made a layer at a time over layer stacks in host memory
(`jaxga.sharding.with_offloaded_init`): ``tx.init`` over each stack's layers, fetched to the
device one at a time, its state written to host memory; a probe first refuses a ``tx.init``
that is not elementwise (docs/streaming.md). The update's counterpart: `_layerwise`.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxga._host_stacks import fetch_layer, is_streamed, made_by_layer
from jaxga._layerwise import (
    STREAMED,
    StreamError,
    first_difference,
    leaf_kinds,
    probe_like,
    stand_in,
)

# The optimiser's state made a layer at a time (`jaxga.sharding.with_offloaded_init`).
_INIT = "jaxga.sharding.with_offloaded_init(tx)"
_INIT_FIX = (
    "make it whole on the device (jax.jit(tx.init)), move it with jaxga.sharding.offload and "
    "build the step with stream=True; a mask or labels by the leaves' rank, shape or size "
    "treat a layer unlike its stack: give them by the parameters' paths"
)


def init_by_layer(tx: Any, params: Any) -> Any:
    """``tx.init(params)`` with the state leaves that mirror a stack in host memory (a
    parameter with a layer axis) made a layer at a time and written to host memory:
    ``tx.init`` once over the resident leaves (each stack a stand-in with no layers), then,
    per layer count, a ``lax.scan`` whose step ``l`` runs ``tx.init`` on the stacks' layer
    ``l`` fetched to the device, and writes the mirrors it makes to host memory (the scan's
    output, stacked there). `check_init` first finds ``tx.init`` exact that way.

    Args:
        tx: an optax transformation.
        params: the parameters; stacks in host memory.

    Returns:
        ``tx.init(params)``, each stack's mirrors in host memory, the other leaves on the
        device.

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> from jaxga._layerwise_init import init_by_layer
        >>> stack = jax.device_put(jnp.ones((4, 3)), jax.memory.Space.Host)
        >>> mu = jax.jit(init_by_layer, static_argnums=0)(optax.adam(0.1), {"w": stack})[0].mu
        >>> mu["w"].tolist()[0], mu["w"].sharding.memory_kind
        ([0.0, 0.0, 0.0], 'pinned_host')
    """
    if not any(map(is_streamed, jax.tree.leaves(params))):
        return tx.init(params)
    whole = jax.eval_shape(tx.init, params)
    kinds = leaf_kinds(tx, params, whole, who=_INIT, fix=_INIT_FIX)
    check_init(tx, params, kinds)
    try:
        return _split_init(tx, params, kinds, whole)
    except (TypeError, ValueError) as e:  # passed the probes, fails at these sizes
        raise _init_fails_apart(e) from e


def _init_fails_apart(e: Exception) -> ValueError:
    """The error of a ``tx.init`` that fails on a stack's layers apart (``e``)."""
    got = f"`tx.init` fails on a stack's layers apart ({e})"
    return ValueError(f"{_INIT} makes the state a layer at a time; {got}: {_INIT_FIX}.")


def _split_init(tx: Any, params: Any, kinds: Any, whole: Any) -> Any:
    """`init_by_layer`'s ``tx.init(params)``, the leaves of ``kinds`` `STREAMED` by layer;
    ``whole``: ``tx.init(params)`` or its shapes (`jax.eval_shape`)."""
    (p, treedef), (pk, ok) = jax.tree.flatten(params), kinds
    shapes, whole_def = jax.tree.flatten(whole)
    shapes = [jnp.shape(x) for x in shapes]
    stood = [stand_in(x) if k == STREAMED else x for x, k in zip(p, pk)]
    made, state_def = jax.tree.flatten(tx.init(jax.tree.unflatten(treedef, stood)))
    if state_def != whole_def:  # a rule of the leaves' sizes (a stand-in has none)
        got = "a state of another structure for stacks of no layers than for the stacks"
        raise ValueError(f"`tx.init` makes {got} ({_apart(state_def, whole_def)})")
    sizes = {jnp.shape(x)[0] for x, k in zip(p, pk) if k == STREAMED} - {0}  # 0: made above
    for size in sorted(sizes):
        mine_p = [i for i, (x, k) in enumerate(zip(p, pk)) if k == STREAMED and x.shape[0] == size]
        mine_o = [i for i, (s, k) in enumerate(zip(shapes, ok)) if k == STREAMED and s[0] == size]
        one = functools.partial(
            _init_layer, tx, params, mine_p=mine_p, mine_o=mine_o, state_def=state_def
        )
        for i, stack in zip(mine_o, made_by_layer(one, jnp.arange(size))):
            made[i] = stack
    return jax.tree.unflatten(state_def, made)


def _init_layer(
    tx: Any, params: Any, layer: jax.Array, *, mine_p: Any, mine_o: Any, state_def: Any
) -> list[Any]:
    """`_split_init`'s state of one layer: ``tx.init`` of layer ``layer`` of the stacks at
    flat indices ``mine_p`` (the other leaves stand-ins), its leaves ``mine_o``; raises if
    that state is not of the whole state's structure ``state_def``."""
    p, treedef = jax.tree.flatten(params)
    one = [stand_in(x) for x in p]
    for i in mine_p:
        one[i] = fetch_layer(p[i], layer)
    new, new_def = jax.tree.flatten(tx.init(jax.tree.unflatten(treedef, one)))
    if new_def != state_def:  # a rule of the leaves' ranks (a mask by ndim, say)
        got = "a state of another structure for one layer than for the stack"
        raise ValueError(f"`tx.init` makes {got} ({_apart(new_def, state_def)})")
    return [new[i] for i in mine_o]


def _apart(got: Any, want: Any) -> str:
    """Where the state structures ``got`` and ``want`` (treedefs) part: their first leaf
    path that differs, else the structures themselves (their nodes differ)."""
    try:
        paths = [
            [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]
            for tree in (jax.tree.unflatten(d, [0] * d.num_leaves) for d in (got, want))
        ]
    except Exception:  # a node that cannot hold ints: the structures say where
        paths = [[], []]
    for i, (mine, theirs) in enumerate(zip(*paths)):
        if mine != theirs:
            return f"leaf {i} is {mine} there, {theirs} for the stack"
    return f"{str(got)[:300]} there, {str(want)[:300]} for the stack"


def check_init(tx: Any, params: Any, kinds: Any) -> None:
    """Raises unless `init_by_layer` gives exactly ``tx.init``'s value on small concrete
    probes of ``params``' structure (each leaf of its rank; 2 layers of unlike scale, size 3
    on other axes), ``kinds`` (`leaf_kinds`) saying which leaves are stacks."""
    with jax.ensure_compile_time_eval(), jax.disable_jit():  # op by op, scans as loops
        probe = probe_like(params, 0)
        try:
            whole = tx.init(probe)
        except (TypeError, ValueError) as e:
            got = f"`tx.init` fails on its probes (2 layers, size 3 on other axes: {e})"
            raise ValueError(f"{_INIT} checks {got}: {_INIT_FIX}.") from e
        try:
            split = _split_init(tx, probe, kinds, whole)
            if jax.tree.structure(split) != jax.tree.structure(whole):
                got = f"{jax.tree.structure(split)}, not {jax.tree.structure(whole)}"
                raise ValueError(f"`tx.init` makes a state of another structure: {got}")
        except (TypeError, ValueError) as e:
            raise _init_fails_apart(e) from e
        differs = first_difference(split, whole)
    if differs is not None:
        where, a, b = differs
        raise StreamError(
            f"{_INIT} makes the state a layer at a time, exact only for an optimiser whose "
            f"state for each element is made from that element alone (sgd, adam, adamw, "
            f"lion); `tx.init` is not: on a probe, the state's {where} got "
            f"{a.ravel()[:4].tolist()} a layer at a time; expected the whole tree's "
            f"{b.ravel()[:4].tolist()}: {_INIT_FIX}."
        )
