"""What computes an output of a traced program: the operations it depends on, counted so
that a layer stack's program and its layer's compare (`cone`), for ``stream="layers"``'s
check that an optimiser updates a stack as it updates each layer (`_layerwise`)."""

import collections
from typing import Any

import numpy as np
from jax.extend import core


def cone(jaxpr: core.Jaxpr, outs: list[int]) -> tuple[collections.Counter, frozenset]:
    """What ``jaxpr``'s outputs ``outs`` are computed by: the operations they depend on, in
    it and the jaxprs it calls, and the inputs they read. Through a call (``jit``, custom
    derivatives, ``checkpoint``) and each branch of a ``cond`` it follows the outputs; a
    loop (``scan``, ``while``) counts whole.

    Args:
        jaxpr: a `jax.extend.core.Jaxpr`, e.g. ``jax.make_jaxpr(f)(*args).jaxpr``.
        outs: indices of its outputs.

    Returns:
        ``(operations, inputs)``: each operation counted by its primitive's name, the axes
        it works along (a reduction's, a sort's, a flip's) counted from the last (``-1``)
        and its constants (a scale's factor), those that only lay values out (`_LAYOUT`:
        reshapes, broadcasts) left out; and the indices of the inputs read.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jaxga._cones import cone
        >>> f = lambda x, y: (jnp.sum(x * 0.5, axis=-1), y + 1.0)
        >>> jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 3)), jnp.ones(2)).jaxpr
        >>> ops, inputs = cone(jaxpr, [0])
        >>> sorted(ops.items()), inputs
        ([('mul by 0.5', 1), ('reduce_sum along (-1,)', 1)], frozenset({0}))
    """
    needed = {v for v in (jaxpr.outvars[i] for i in outs) if isinstance(v, core.Var)}
    counted, laid_out = collections.Counter(), _laid_out(jaxpr)
    for eqn in reversed(jaxpr.eqns):
        used = [i for i, v in enumerate(eqn.outvars) if v in needed]
        if not used:
            continue
        ops, reads = _called(eqn, used, laid_out)
        counted += ops
        needed.update(v for v in reads if isinstance(v, core.Var))
    return counted, frozenset(i for i, v in enumerate(jaxpr.invars) if v in needed)


def _called(
    eqn: core.JaxprEqn, used: list[int], laid_out: dict[Any, Any]
) -> tuple[collections.Counter, list[Any]]:
    """`cone` of one equation's outputs ``used``: the operations (its own, `_operation`, and
    its jaxprs') and the equation's inputs they read."""
    layout = eqn.primitive.name in _LAYOUT
    own = collections.Counter({} if layout else {_operation(eqn, laid_out): 1})
    inner, is_cond = list(core.jaxprs_in_params(eqn.params)), eqn.primitive.name == "cond"
    operands = eqn.invars[1:] if is_cond else eqn.invars
    if (
        not inner
        or eqn.primitive.name in _LOOPS
        or any((len(j.invars), len(j.outvars)) != (len(operands), len(eqn.outvars)) for j in inner)
    ):  # no jaxpr; a loop's, or one not called as the equation is: all of it
        return own + sum(map(_operations, inner), collections.Counter()), eqn.invars
    reads = list(eqn.invars[:1]) if is_cond else []  # a cond's index
    for j in inner:  # a call's jaxpr, or each branch of a cond
        ops, ins = cone(j, used)
        own += ops
        reads += [operands[i] for i in ins]
    return own, reads


# Primitives whose jaxprs run more than once (`cone` counts them whole).
_LOOPS = frozenset({"scan", "while"})
# Primitives that only lay values out, which a stack and its layer's slice may differ in
# (jnp broadcasts a constant to an array's shape, and uses it as it is for a scalar).
_LAYOUT = frozenset({"reshape", "squeeze", "broadcast_in_dim", "transpose", "copy"})


def _laid_out(jaxpr: core.Jaxpr) -> dict[Any, Any]:
    """The variables of ``jaxpr`` that only lay out a constant (`_LAYOUT` of a literal, a
    broadcast ``0.5``, say), each one's literal."""
    found: dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _LAYOUT and len(eqn.invars) == 1:
            source = eqn.invars[0]
            source = source if isinstance(source, core.Literal) else found.get(source)
            if source is not None:
                found[eqn.outvars[0]] = source
    return found


def _operations(jaxpr: core.Jaxpr) -> collections.Counter:
    """Every operation of ``jaxpr`` and of the jaxprs it calls, counted by `_operation`
    (those of `_LAYOUT` left out)."""
    counted, laid_out = collections.Counter(), _laid_out(jaxpr)
    for eqn in jaxpr.eqns:
        for inner in core.jaxprs_in_params(eqn.params):
            counted += _operations(inner)
        if eqn.primitive.name not in _LAYOUT:
            counted[_operation(eqn, laid_out)] += 1
    return counted


def _operation(eqn: core.JaxprEqn, laid_out: dict[Any, Any]) -> str:
    """An equation's operation, as a stack's and its layer's may be compared: its
    primitive's name; the axes it works along (a reduction's, a sort's, a flip's) counted
    from the last, ``-1``, since a layer's slice has one axis fewer in front; and its
    constants (a scale's factor), given or laid out (`_laid_out`)."""
    name, params = eqn.primitive.name, eqn.params
    axes = next((params[k] for k in ("axes", "axis", "dimension", "dimensions") if k in params), ())
    axes = (axes,) if isinstance(axes, int) else axes
    if eqn.invars and isinstance(axes, tuple) and axes and all(isinstance(a, int) for a in axes):
        ndim = len(eqn.invars[0].aval.shape)
        name += f" along {tuple(sorted(a - ndim for a in axes))}"
    given = (v if isinstance(v, core.Literal) else laid_out.get(v) for v in eqn.invars)
    constants = [str(np.asarray(v.val)) for v in given if v is not None]
    return name + (f" by {', '.join(constants)}" if constants else "")
