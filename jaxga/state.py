"""The train state: Flax's ``TrainState`` with model state and a key, checked and read."""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

from jaxga import _checks, modules


class TrainState(train_state.TrainState):
    """Flax's ``TrainState`` plus the model's non-differentiated state and a PRNG key.

    Attributes:
        model_state: state the model updates but does not differentiate (Linen
            ``{"batch_stats": ...}``, an NNX model's non-``Param`` state); ``{}`` if none.
        rng: a typed PRNG key; step ``s``, micro-batch ``i`` draws ``fold_in(fold_in(rng, s), i)``.

    Example:
        >>> import jax.numpy as jnp, optax, jaxga
        >>> state = jaxga.TrainState.create(params=jnp.zeros(3), tx=optax.sgd(0.1), rng=1)
        >>> int(state.step), state.rng.shape, state.model_state
        (0, (), {})
    """

    model_state: Any = None
    rng: jax.Array | None = None

    @classmethod
    def create(
        cls,
        params: Any,
        tx: optax.GradientTransformation,
        *,
        apply_fn: Callable[..., Any] | None = None,
        model_state: Any = None,
        rng: jax.Array | int = 0,
        **kwargs: Any,
    ) -> "TrainState":
        """Returns the initial state, with copies of ``params``, ``model_state`` and ``rng``."""
        _checks.check_optimizer(tx, "tx")
        check_arrays(params, "params")
        model_state = {} if model_state is None else model_state
        check_arrays(model_state, "model_state", empty_ok=True)
        params, model_state, rng = jax.tree.map(copy, (params, model_state, as_key(rng)))
        state = super().create(
            apply_fn=apply_fn, params=params, tx=tx, model_state=model_state, rng=rng, **kwargs
        )
        return unaliased(state.replace(step=jnp.zeros((), jnp.int32)))


def check_arrays(tree: Any, name: str, empty_ok: bool = False) -> None:
    """Raises unless ``tree`` is a pytree of arrays (``nnx.Param``s only, for an NNX state)."""
    split = "split it as `graphdef, params, rest = nnx.split(model, nnx.Param, ...)`"
    if modules.holds_module(tree):
        raise TypeError(f"`{name}` is (or holds) a module; {split}, or use jaxga.nnx_train_step.")
    is_variable = lambda x: isinstance(x, nnx.Variable)
    kinds = {type(v).__name__ for v in jax.tree.leaves(tree, is_leaf=is_variable) if is_variable(v)}
    if name == "params" and (others := kinds - {"Param"}):
        raise ValueError(f"`params` holds {sorted(others)} besides nnx.Param: {split}.")
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    for path, x in leaves:
        if not (hasattr(x, "dtype") or isinstance(x, int | float | complex)):
            where = f"{name}{jax.tree_util.keystr(path)}"
            raise TypeError(f"{where} is {x!r} of type {type(x).__name__}; expected an array.")
    if not leaves and not empty_ok:
        raise ValueError(f"`{name}` must be a pytree holding the parameter arrays; got {tree!r}.")


def copy(x: Any) -> Any:
    """A copy of the same kind (host arrays stay on the host, for ``jax.distributed``)."""
    return x.copy() if isinstance(x, np.ndarray) else jnp.array(x, copy=True)


def as_key(rng: Any) -> jax.Array:
    """A typed PRNG key from a seed, a typed key or raw ``uint32[2]`` key data."""
    dtype = getattr(rng, "dtype", None) or (jnp.int32 if isinstance(rng, int) else None)
    shape = jnp.shape(rng) if dtype is not None else None
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key) and shape == ():
        return rng
    if dtype is not None and jnp.issubdtype(dtype, jnp.integer) and shape == ():
        return jax.random.key(rng)
    if dtype == jnp.uint32 and shape == (2,):
        return jax.random.wrap_key_data(rng)
    raise TypeError(f"`rng` must be an integer seed or a single PRNG key; got {rng!r}.")


def unaliased(tree: Any) -> Any:
    """``tree`` with a copy of each array whose buffer it already holds (donated only once)."""
    seen: set[Any] = set()

    def once(x: Any) -> Any:
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return x
        try:
            buffers = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
        except Exception:  # a backend without buffer pointers: the array object itself
            buffers = {id(x)}
        if seen & buffers:
            return copy(x)
        seen.update(buffers)
        return x

    return jax.tree.map(once, tree)


def model_io(state: Any) -> tuple[Any, jax.Array | None, Callable[[Any, Any], Any]]:
    """A Flax TrainState's model state, the step's key, and how to set a new model state."""
    if isinstance(state, TrainState):
        model_state, key = state.model_state, state.rng
        setter = lambda s, m: s.replace(model_state=m)
    else:  # a subclass: its added dict fields (batch_stats) and its key field
        flax = {f.name for f in dataclasses.fields(train_state.TrainState)}
        nodes = [f.name for f in dataclasses.fields(state) if f.metadata.get("pytree_node", True)]
        added = [n for n in nodes if n not in flax]
        dtype = lambda n: getattr(getattr(state, n), "dtype", np.float32)
        is_key = lambda n: n in ("rng", "key") or jnp.issubdtype(dtype(n), jax.dtypes.prng_key)
        keys = [n for n in added if is_key(n)]
        if len(keys) > 1:
            kind = type(state).__name__
            raise ValueError(f"`state` ({kind}) has PRNG-key fields {keys}; expected one.")
        fields = [n for n in added if n not in keys and isinstance(getattr(state, n), Mapping)]
        model_state = {n: getattr(state, n) for n in fields}
        key = getattr(state, keys[0]) if keys else None
        setter = lambda s, m: s.replace(**m)
    rng = None if key is None else jax.random.fold_in(as_key(key), state.step)
    return model_state, rng, setter
