"""The train state: Flax's ``TrainState`` with model state and a key, checked and read."""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
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

    Examples:
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

    def is_variable(x: Any) -> bool:
        return isinstance(x, nnx.Variable)

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
        except (NotImplementedError, RuntimeError):  # a backend without buffer pointers
            buffers = {id(x)}
        if seen & buffers:
            return copy(x)
        seen.update(buffers)
        return x

    return jax.tree.map(once, tree)


_FLAX_FIELDS = frozenset(f.name for f in dataclasses.fields(train_state.TrainState))


@dataclasses.dataclass(frozen=True)
class StateFields:
    """Where a train state keeps the model's non-differentiated state and its PRNG key.

    Attributes:
        model_state: one field, passed to the loss as it is (`jaxga.TrainState`'s
            `"model_state"`), or a tuple of fields passed as a dict (a Flax `TrainState`
            subclass's `("batch_stats",)`).
        rng: the field holding the key (a seed, a typed key or raw key data), or `None`.
        guessed: whether jaxga found these fields itself (said in errors).
    """

    model_state: str | tuple[str, ...]
    rng: str | None
    guessed: bool = False

    def read(self, state: Any) -> Any:
        """The model state the loss is given."""
        if isinstance(self.model_state, str):
            return getattr(state, self.model_state)
        return {name: getattr(state, name) for name in self.model_state}

    def write(self, state: Any, model_state: Any) -> Any:
        """``state`` holding the loss's new ``model_state``."""
        if isinstance(self.model_state, str):
            return state.replace(**{self.model_state: model_state})
        return state.replace(**model_state)

    def step_key(self, state: Any) -> jax.Array | None:
        """The step's key: the key field's, folded with the step number."""
        if self.rng is None:
            return None
        return jax.random.fold_in(as_key(getattr(state, self.rng)), state.step)

    def describe(self, state: Any) -> str:
        """What the fields are, for an error about ``state``."""
        how = "guessed" if self.guessed else "given"
        return (
            f"the step reads {type(state).__name__}'s model state from {self.model_state!r} and "
            f"its key from {self.rng!r} ({how}; name them with make_train_step's "
            f"`model_state_fields=` and `rng_field=`)"
        )


def _is_key_field(state: Any, name: str) -> bool:
    dtype = getattr(getattr(state, name), "dtype", np.float32)
    return name in ("rng", "key") or jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _guess_fields(state: Any) -> StateFields:
    """A Flax ``TrainState`` subclass's added dict fields, and its key field if it has one."""
    nodes = [f.name for f in dataclasses.fields(state) if f.metadata.get("pytree_node", True)]
    added = [name for name in nodes if name not in _FLAX_FIELDS]
    keys = [name for name in added if _is_key_field(state, name)]
    if len(keys) > 1:
        kind = type(state).__name__
        raise ValueError(
            f"`state` ({kind}) has PRNG-key fields {keys}; expected one, or pass `rng_field=`."
        )
    dicts = [n for n in added if n not in keys and isinstance(getattr(state, n), Mapping)]
    return StateFields(tuple(dicts), keys[0] if keys else None, guessed=True)


def check_field_names(
    model_state_fields: Any, rng_field: Any
) -> tuple[str | tuple[str, ...] | None, str | None]:
    """``model_state_fields`` (a name, or a tuple of names) and ``rng_field``, checked."""
    if rng_field is not None and not isinstance(rng_field, str):
        raise TypeError(f"`rng_field` must be a field name (a str) or None; got {rng_field!r}.")
    if model_state_fields is None or isinstance(model_state_fields, str):
        return model_state_fields, rng_field
    names = tuple(model_state_fields) if isinstance(model_state_fields, Sequence) else None
    if names is None or not all(isinstance(name, str) for name in names):
        raise TypeError(
            f"`model_state_fields` must be a field name, a sequence of field names or None; "
            f"got {model_state_fields!r}."
        )
    return names, rng_field


def state_fields(
    state: Any, model_state_fields: str | tuple[str, ...] | None, rng_field: str | None
) -> StateFields:
    """The fields of ``state`` that hold model state and the key: as given, else guessed.

    `jaxga.TrainState`: ``model_state`` and ``rng``. Another Flax ``TrainState`` subclass:
    the dict fields it adds (``batch_stats``), and a field named ``rng`` or ``key`` or
    holding a typed key.
    """
    if isinstance(state, TrainState):
        guess = StateFields("model_state", "rng")
    else:
        guess = _guess_fields(state)
    given = StateFields(
        guess.model_state if model_state_fields is None else model_state_fields,
        guess.rng if rng_field is None else rng_field,
        guessed=guess.guessed and (model_state_fields is None or rng_field is None),
    )
    names = [given.model_state] if isinstance(given.model_state, str) else given.model_state
    for name in [*names, *([given.rng] if given.rng else [])]:
        if not hasattr(state, name):
            raise ValueError(
                f"`state` ({type(state).__name__}) has no field {name!r}; {given.describe(state)}."
            )
    return given
