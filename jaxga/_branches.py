"""One trace of the taken branch: a ``lax.cond`` whose other branch is built from the
types of the taken one's single trace (`when`), and zeros of a traced value's type
(`zeros_of`). Below `collectives` and `_streaming`, which both branch so
(docs/architecture.md, "One trace of the taken branch")."""

from collections.abc import Callable
from typing import Any

import jax


def zeros_of(t: Any, zero: Any = 0) -> jax.Array:
    """Zeros of the type ``t`` (``jax.typeof``'s): its shape, dtype, sharding, varying axes.

    Args:
        t: a type, ``jax.typeof(x)``.
        zero: the zero, a traced one so that XLA sees no constant; default 0.

    Returns:
        An array of ``t``'s type, all zeros.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jaxga._branches import zeros_of
        >>> zeros_of(jax.typeof(jnp.ones((2, 3)))).tolist()
        [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    """
    zeros = jax.lax.full(t.shape, zero, t.dtype, sharding=t.sharding)
    return jax.lax.pcast(zeros, tuple(t.mat.varying), to="varying")


def when(pred: Any, fun: Callable[..., Any], *operands: Any, otherwise: Any = None) -> Any:
    """``fun(*operands)`` where ``pred``, else ``otherwise(types, *operands)``: a
    ``jax.lax.cond`` whose other branch is built from the types of ``fun``'s one trace
    (docs/architecture.md, "One trace of the taken branch").

    Args:
        pred: a boolean scalar.
        fun: the branch taken where ``pred``; traced once.
        *operands: the arguments of both branches.
        otherwise: ``(types, *operands) -> out``, ``types`` being ``jax.typeof`` of each
            leaf of ``fun``'s output; ``None``: zeros of each type (`zeros_of`).

    Returns:
        The output of the branch ``pred`` picks.

    Examples:
        >>> import jax.numpy as jnp
        >>> from jaxga._branches import when
        >>> when(jnp.array(False), jnp.sin, jnp.ones(2)).tolist()
        [0.0, 0.0]
    """
    traced = []  # the types of `fun`'s output, from its one trace

    def taken(*operands: Any) -> Any:
        out = fun(*operands)
        traced.append(jax.tree.map(jax.typeof, out))
        return out

    def other(*operands: Any) -> Any:  # cond traces `taken` first; else it is traced here
        if not traced:
            jax.eval_shape(taken, *operands)
        if otherwise is None:
            return jax.tree.map(zeros_of, traced[0])
        return otherwise(traced[0], *operands)

    return jax.lax.cond(pred, taken, other, *operands)
