"""Argument checks shared by jaxga's modules: each raises an error naming the argument."""

import contextlib
import inspect
import numbers
import os
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxga import modules

# jaxga's and JAX's own files: a warning names the first line outside them (the user's)
_INTERNAL = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, modules))


def warn_at_caller(message: str) -> None:
    """``warnings.warn(message)`` at the first frame outside jaxga and JAX: the user's line
    (a step called in a function of theirs, or through ``jax.jit(step)``)."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: the caller of this function
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


def leading_size(tree: Any, name: str, axis: str) -> int | None:
    """The one leading size of ``tree``'s leaves (None without leaves), or an error naming
    the leaf (``name`` and its path) that is not an array with a leading ``axis`` axis or
    differs from the others."""
    sizes = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        where = f"{name}{jax.tree_util.keystr(path)}"
        shape = getattr(leaf, "shape", () if isinstance(leaf, numbers.Number) else None)
        if not shape:
            number = shape is None or isinstance(leaf, numbers.Number)
            got = f"{leaf!r:.60}" if number else leaf.dtype  # not a tracer's repr
            raise (TypeError if shape is None else ValueError)(
                f"{where} is a {type(leaf).__name__ if shape is None else 'scalar'} ({got}); "
                f"every leaf of {name} must be an array with a leading {axis} axis."
            )
        numeric(leaf, where)
        sizes[where] = shape[0]
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise ValueError(f"The leaves of {name} have different leading sizes ({listed}).")
    return next(iter(sizes.values()), None)


def numeric(leaf: Any, where: str) -> None:
    """Raises for a leaf whose dtype JAX has not (objects, strings, dates), named ``where``."""
    if getattr(getattr(leaf, "dtype", None), "kind", "") in tuple("OSUMm"):
        raise TypeError(f"{where} must hold numbers or bools; got dtype {leaf.dtype}.")


def is_array(x: Any) -> bool:
    """Whether ``x`` is an array (JAX's or NumPy's), not a Python number."""
    return isinstance(x, jax.Array | np.ndarray)


def is_value(x: Any) -> bool:
    """Whether ``x`` is an array (it has a dtype) or a Python number."""
    return hasattr(x, "dtype") or isinstance(x, int | float | complex)


_NOT_ARRAY = "`{where}` must be {expected}; got {got}."


def array_leaves(tree: Any, name: str, message: str = _NOT_ARRAY) -> list[tuple[Any, Any]]:
    """``tree``'s leaves with their paths, each an array or a number of a dtype JAX has, or a
    `TypeError` naming the first that is not: ``message`` formatted with its ``where``
    (``name`` and the leaf's path), ``expected`` and ``got``."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    for path, leaf in leaves:
        where = f"{name}{jax.tree_util.keystr(path)}"
        if not is_value(leaf):
            expected = "an array or a number" if path else "a pytree of arrays"
            got = f"{leaf!r:.60} of type {type(leaf).__name__}"
            raise TypeError(message.format(where=where, expected=expected, got=got))
        numeric(leaf, f"`{where}`")
    return leaves


def _wrong(name: str, expected: str, value: Any, error: type = TypeError) -> Exception:
    kind = type(value)  # numpy.bool, not bool, for np.True_
    kind = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
    return error(f"`{name}` must be {expected}; got {value!r} of type {kind}.")


def positive_int(value: Any, name: str, expected: str = "a positive int") -> int:
    """``value`` as an int >= 1, or an error naming ``name`` and saying ``expected``."""
    is_int = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not is_int or value < 1:
        raise _wrong(name, expected, value, ValueError if is_int else TypeError)
    return int(value)


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise _wrong(name, "a bool", value)
    return value


def float_dtype(value: Any, name: str = "accumulator_dtype") -> jnp.dtype | None:
    with contextlib.suppress(TypeError):  # not a dtype at all
        if value is None or jnp.issubdtype(value, jnp.floating):
            return None if value is None else jnp.dtype(value)
    got = getattr(value, "__name__", repr(value))
    raise TypeError(f"`{name}` must be a floating dtype (jnp.float32...) or None; got {got}.")


def grad_sum_dtype(dtype: jnp.dtype | None, leaf_dtype: Any) -> jnp.dtype:
    """The dtype a gradient of ``leaf_dtype`` is summed in: ``accumulator_dtype`` (``dtype``)
    if given, else at least float32 (not `Call.sum_dtype`, the loss totals' and counts')."""
    return jnp.promote_types(jnp.float32, leaf_dtype) if dtype is None else jnp.dtype(dtype)


def check_callable(fn: Any, name: str, expected: str = "a function") -> None:
    if not callable(fn):
        raise _wrong(name, expected, fn)
    if modules.is_graph_node(fn):  # a model where its loss goes
        raise TypeError(f"`{name}` must be {expected}; got a Flax NNX {type(fn).__name__}.")


def check_arity(fn: Any, name: str, nargs: int, signature: str, keywords: Any = ()) -> Any:
    expected = f"callable as {signature}"
    check_callable(fn, name, expected)
    try:
        inspect.signature(fn).bind(*range(nargs), **dict.fromkeys(keywords))
    except ValueError:  # no signature (some builtins): the call will tell
        pass
    except TypeError:
        raise TypeError(f"`{name}` must be {expected}; it takes {inspect.signature(fn)}.") from None
    return fn


def check_optimizer(tx: Any, name: str) -> None:
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise _wrong(name, "an optax GradientTransformation like optax.adam(1e-3)", tx)


def scalar(value: Any, name: str, kinds: tuple[Any, ...], expected: str) -> jax.Array:
    """``value`` as a scalar array of one of ``kinds`` (may be traced), or a `TypeError`."""
    try:
        array = jnp.asarray(value)
    except (TypeError, ValueError):  # a string, None, an object
        raise TypeError(f"`{name}` must be {expected}; got {value!r:.60}.") from None
    if array.shape != () or not any(jnp.issubdtype(array.dtype, kind) for kind in kinds):
        got = f"{array.dtype}{list(array.shape)}" if hasattr(value, "dtype") else repr(value)
        raise TypeError(f"`{name}` must be {expected}; got {got}.")
    return array
