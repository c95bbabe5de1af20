"""Small argument checks shared by the modules of jaxga."""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def leading_size(tree: Any, name: str, axis: str) -> int | None:
    """Returns the size of the leading axis every leaf of ``tree`` shares (``None``: no leaves).

    Raises a ``ValueError`` that names the leaf when a leaf is a scalar, and lists every
    leaf's size when they differ. ``name`` is how messages call the tree (an argument
    name) and ``axis`` what its leading axis holds ("batch", "layer").

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxga._checks import leading_size
        >>> leading_size({"x": jnp.zeros((4, 2)), "y": jnp.zeros(4)}, "batch", "batch")
        4
    """
    sizes = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        where = f"{name}{jax.tree_util.keystr(path)}"
        shape = jnp.shape(leaf)
        if not shape:
            raise ValueError(
                f"{where} is a scalar ({leaf!r}); every leaf of {name} needs a leading {axis} axis."
            )
        sizes[where] = shape[0]
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise ValueError(
            f"The leaves of {name} have different leading sizes ({listed}); every leaf "
            f"needs the same leading {axis} axis."
        )
    return next(iter(sizes.values()), None)


def positive_int(value: Any, name: str, expected: str = "a positive int") -> int:
    """Returns ``value`` if it is a positive int; raises an error naming ``name`` otherwise.

    Example:
        >>> from jaxga._checks import positive_int
        >>> positive_int(4, "num_microbatches")
        4
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"`{name}` must be {expected}; got {value!r} of type {type(value).__name__}."
        )
    if value < 1:
        raise ValueError(f"`{name}` must be {expected}; got {value}.")
    return int(value)


def accumulator_dtype(value: Any, name: str = "accumulator_dtype") -> jnp.dtype | None:
    """Returns ``value`` as a floating dtype (``None`` stays ``None``); raises naming ``name``.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxga._checks import accumulator_dtype
        >>> accumulator_dtype(jnp.bfloat16)
        dtype(bfloat16)
    """
    if value is None:
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        got = repr(value) if dtype is None else str(dtype)
        raise TypeError(
            f"`{name}` must be a floating dtype such as jnp.float32 or jnp.bfloat16, or None; "
            f"got {got}."
        )
    return dtype


def accumulation_dtype(dtype: jnp.dtype | None, leaf_dtype: Any) -> jnp.dtype:
    """The dtype a sum of ``leaf_dtype`` values is kept in: ``dtype``, or by default at least
    float32 (float64 stays float64).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxga._checks import accumulation_dtype
        >>> accumulation_dtype(None, jnp.bfloat16), accumulation_dtype(jnp.bfloat16, jnp.float32)
        (dtype('float32'), dtype(bfloat16))
    """
    if dtype is not None:
        return jnp.dtype(dtype)
    return jnp.promote_types(jnp.float32, jnp.result_type(leaf_dtype))


def check_arity(fn: Any, name: str, nargs: int, signature: str) -> Callable[..., Any]:
    """Returns ``fn`` if it can be called with ``nargs`` positional arguments; raises naming it.

    ``signature`` is the expected call, for the message. A callable whose signature
    Python cannot read (some builtins) is accepted: its call will tell.

    Example:
        >>> from jaxga._checks import check_arity
        >>> try:
        ...     check_arity(lambda x: x, "layer_fn", 2, "layer_fn(params, x) -> x")
        ... except TypeError as e:
        ...     print(e)
        `layer_fn` must be callable as layer_fn(params, x) -> x; it takes (x).
    """
    if not callable(fn):
        raise TypeError(
            f"`{name}` must be callable as {signature}; got {fn!r} of type {type(fn).__name__}."
        )
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn
    try:
        sig.bind(*range(nargs))
    except TypeError:
        raise TypeError(f"`{name}` must be callable as {signature}; it takes {sig}.") from None
    return fn


def check_optimizer(tx: Any, name: str) -> None:
    """Raises unless ``tx`` is an optax transformation (has ``init`` and ``update``)."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"`{name}` must be an optax GradientTransformation (with `init` and `update`), "
            f"e.g. optax.adam(1e-3); got {tx!r} of type {type(tx).__name__}."
        )
