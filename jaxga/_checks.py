"""Argument checks shared by jaxga's modules: each raises an error naming the argument."""

from __future__ import annotations

import inspect
import numbers
from typing import Any

import jax
import jax.numpy as jnp


def leading_size(tree: Any, name: str, axis: str) -> int | None:
    """The leading size all leaves of ``tree`` share (``None``: no leaves); raises naming a leaf."""
    sizes = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        where = f"{name}{jax.tree_util.keystr(path)}"
        if not (hasattr(leaf, "shape") or isinstance(leaf, numbers.Number)):
            raise TypeError(
                f"{where} is a {type(leaf).__name__} ({leaf!r}); every leaf of {name} must be "
                f"an array."
            )
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
    """``value`` if it is a positive int; raises naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"`{name}` must be {expected}; got {value!r} of type {type(value).__name__}."
        )
    if value < 1:
        raise ValueError(f"`{name}` must be {expected}; got {value}.")
    return int(value)


def float_dtype(value: Any, name: str = "accumulator_dtype") -> jnp.dtype | None:
    """``value`` as a floating dtype (``None`` stays ``None``); raises naming ``name``."""
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


def sum_dtype(dtype: jnp.dtype | None, leaf_dtype: Any) -> jnp.dtype:
    """The dtype sums of ``leaf_dtype`` are kept in: ``dtype``, or at least float32."""
    if dtype is not None:
        return jnp.dtype(dtype)
    return jnp.promote_types(jnp.float32, jnp.result_type(leaf_dtype))


def check_arity(fn: Any, name: str, nargs: int, signature: str) -> Any:
    """``fn`` if it can be called with ``nargs`` positional arguments; raises naming it.

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
    except (TypeError, ValueError):  # some builtins: the call will tell
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


def check_bool(value: Any, name: str) -> bool:
    """``value`` if it is a bool; raises naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool; got {value!r}.")
    return value
