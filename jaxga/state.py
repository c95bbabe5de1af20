"""The train state: Flax's ``TrainState`` with model state and a key, checked and read."""

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

from jaxga import _checks, _host_stacks, meshes, modules, sharding
from jaxga.arguments import is_key


class TrainState(train_state.TrainState):
    """Flax's ``TrainState`` plus the model's non-differentiated state and a PRNG key.

    Attributes:
        model_state: what the model updates but does not differentiate (``batch_stats``), or ``{}``.
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
        """Returns the initial state, with copies of ``params``, ``model_state`` and ``rng``;
        with parameters in host memory (streamed stacks), ``tx.init`` jitted: the optimiser
        state on the device, where a step keeps it unless ``offload=True``
        (`jaxga.sharding.with_offloaded_init(tx)` makes it in host memory instead)."""
        _checks.check_optimizer(tx, "tx")
        check_arrays(params, "params")
        model_state = {} if model_state is None else model_state
        check_arrays(model_state, "model_state", empty_ok=True)
        params, model_state, rng = jax.tree.map(copy, (params, model_state, as_key(rng)))
        # Flax's create runs `tx.init`; jitted where parameters live in host memory (streamed
        # stacks: an eager zeros_like cannot make host arrays), the state made on the device
        init = tx
        if any(meshes.memory_kind(x) in meshes.HOST_KINDS for x in jax.tree.leaves(params)):
            init = optax.GradientTransformation(_jitted_init(tx, params), tx.update)
        given = {"apply_fn": apply_fn, "params": params, "model_state": model_state, "rng": rng}
        if isinstance(params, Mapping | jax.Array):  # Flax's reads a dict's keys (fp8)
            state = super().create(tx=init, **given, **kwargs)
        else:  # a tuple, an Equinox module's arrays: as Flax's makes it
            state = cls(step=0, tx=init, opt_state=init.init(params), **given, **kwargs)
        return unaliased(state.replace(step=jnp.zeros((), jnp.int32), tx=tx))

    def apply_gradients(
        self, *, grads: Any, weight: Any = None, end_group: Any = None, **kwargs: Any
    ) -> "TrainState":
        """Flax's ``apply_gradients`` (fp8 too), passing ``weight`` and ``end_group`` to ``tx``.

        Args:
            grads: the gradient, shaped as ``params``.
            weight: if not ``None``, ``tx.update``'s ``weight=``: the items counted
                ([`jaxga.MultiSteps`][jaxga.MultiSteps] weighs the call by it).
            end_group: if not ``None``, ``tx.update``'s ``end_group=`` (a MultiSteps' group ends).
            **kwargs: other fields to replace, as Flax's.

        Returns:
            The state after one update: ``step + 1``, new ``params`` and ``opt_state``.

        Examples:
            >>> import jax.numpy as jnp, optax, jaxga
            >>> tx = jaxga.MultiSteps(optax.sgd(1.0), every_k=2)
            >>> state = jaxga.TrainState.create(params=jnp.zeros(2), tx=tx)
            >>> state = state.apply_gradients(grads=jnp.ones(2), weight=3)
            >>> state.apply_gradients(grads=jnp.zeros(2), weight=1).params.tolist()
            [-0.75, -0.75]
        """
        extra = {k: v for k, v in (("weight", weight), ("end_group", end_group)) if v is not None}
        tx = self.tx

        def update(updates: Any, opt_state: Any, params: Any = None) -> tuple[Any, Any]:
            return tx.update(updates, opt_state, params, **extra)

        if isinstance(grads, Mapping):  # Flax's, with its fp8 overwrite-with-gradient
            with_extra = self.replace(tx=optax.GradientTransformation(tx.init, update))
            new = train_state.TrainState.apply_gradients(with_extra, grads=grads, **kwargs)
            return new.replace(tx=tx)
        updates, opt_state = update(grads, self.opt_state, self.params)  # arrays, tuples...
        params = optax.apply_updates(self.params, updates)
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **kwargs)


def check_arrays(tree: Any, name: str, empty_ok: bool = False) -> None:
    """Raises unless ``tree`` is a pytree of arrays (``nnx.Param``s only, for an NNX state)."""
    split = "split it as `graphdef, params, rest = nnx.split(model, nnx.Param, ...)` and pass"
    split += " `model_state=rest` (jaxga.TrainState.create)"
    if modules.holds_graph_node(tree):
        raise TypeError(f"`{name}` is (or holds) a module; {split}, or use jaxga.nnx_train_step.")
    if modules.holds_module(tree) and not all(map(_checks.is_array, jax.tree.leaves(tree))):
        fix = "pass its float arrays, eqx.filter(model, eqx.is_inexact_array), and eqx.combine"
        raise TypeError(
            f"`{name}` holds an Equinox module with leaves that are not arrays (a Python "
            f"float, a function); {fix} them with the rest in the loss."
        )
    variables = jax.tree.leaves(tree, is_leaf=modules.is_variable)
    kinds = {type(v).__name__ for v in variables if isinstance(v, nnx.Variable)}
    if name == "params" and (others := kinds - {"Param"}):
        raise ValueError(f"`params` holds {sorted(others)} besides nnx.Param: {split}.")
    leaves = _checks.array_leaves(tree, name, "{where} is {got}; expected an array.")
    if not leaves and not empty_ok:
        got = f"{tree!r:.60}"
        raise ValueError(f"`{name}` must be a pytree holding the parameter arrays; got {got}.")


def copy(x: Any) -> Any:
    """A copy of the same kind, in the same memory (NumPy arrays stay NumPy arrays, for
    ``jax.distributed``; an array in host memory, pinned or not, stays there)."""
    if isinstance(x, np.ndarray):
        return x.copy()
    if meshes.memory_kind(x) in meshes.HOST_KINDS:
        return jax.device_put(x, x.sharding, may_alias=False)
    return jnp.array(x, copy=True)


def _jitted_init(tx: optax.GradientTransformation, params: Any) -> Callable[[Any], Any]:
    """``tx.init`` jitted on ``params``' mesh (`sharding.init_on_mesh`); where it computes
    on parameters that lie in host memory (DoG's distances), which JAX refuses, on them
    fetched to the device instead (a ``with_offloaded_init`` state, made a layer at a
    time, and any other, as they were made)."""
    jitted = functools.partial(sharding.init_on_mesh, tx, tx.init)
    try:
        jax.eval_shape(jitted, params)
    except ValueError as e:
        if not meshes.refuses_host_memory(e):
            raise
        fetched = functools.partial(_init_on_device, tx.init)
        jitted = functools.partial(sharding.init_on_mesh, tx, fetched)
    return jitted


def _init_on_device(init: Callable[[Any], Any], params: Any) -> Any:
    """``init`` of ``params`` fetched to the device."""
    return init(_host_stacks.on_device(params))


def as_key(rng: Any) -> jax.Array:
    """A typed PRNG key from a seed, a typed key or raw ``uint32[2]`` key data."""
    if is_key(rng, raw=False) and jnp.shape(rng) == ():
        return rng
    dtype = jnp.int32 if isinstance(rng, int) else getattr(rng, "dtype", float)
    if jnp.issubdtype(dtype, jnp.integer) and jnp.shape(rng) == ():
        return jax.random.key(rng)
    if dtype == jnp.uint32 and jnp.shape(rng) == (2,):
        return jax.random.wrap_key_data(rng)
    raise TypeError(f"`rng` must be an integer seed or a single PRNG key; got {rng!r}.")


def unaliased(tree: Any) -> Any:
    """``tree`` with a copy of each array whose buffer it already holds (donated only once)."""
    # every call, not once per signature: sharing a buffer is a fact of the values, not of
    # shapes (jit hands back an input it passes through; device_put may keep the buffer)
    seen: set[Any] = set()
    leaves, treedef = jax.tree.flatten(tree)
    for i, x in enumerate(leaves):
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            continue
        try:
            buffers = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
        except (NotImplementedError, RuntimeError):  # a backend without buffer pointers
            buffers = {id(x)}
        if seen & buffers:
            leaves[i] = copy(x)
        seen.update(buffers)
    return jax.tree.unflatten(treedef, leaves)


@dataclasses.dataclass(frozen=True)
class StateFields:
    """Where a train state keeps the model's non-differentiated state and its PRNG key."""

    model_state: str | tuple[str, ...]  # jaxga.TrainState's "model_state"; Flax's ("batch_stats",)
    rng: str | None  # the key's field (a seed, a typed key or key data), folded with the step

    def read(self, state: Any) -> Any:
        if isinstance(self.model_state, str):
            return getattr(state, self.model_state)
        return {name: getattr(state, name) for name in self.model_state}

    def write(self, state: Any, model_state: Any) -> Any:
        if isinstance(self.model_state, str):
            return state.replace(**{self.model_state: model_state})
        return state.replace(**model_state)

    def step_key(self, state: Any) -> jax.Array | None:
        if self.rng is None:
            return None
        return jax.random.fold_in(as_key(getattr(state, self.rng)), state.step)

    def describe(self, state: Any) -> str:
        return (
            f"the step reads {type(state).__name__}'s model state from {self.model_state!r} and "
            f"its key from {self.rng!r} (make_train_step's `model_state_fields=`, `rng_field=`)"
        )


# the fields the step itself trains, updates or reads: never the model's state or its key
_STEP_FIELDS = ("params", "opt_state", "tx", "step", "apply_fn")


def check_field_names(fields: Any, rng_field: Any) -> tuple[Any, str | None]:
    """The model-state ``fields`` (a name, or a tuple of names) and ``rng_field``, checked."""
    if rng_field is not None and not isinstance(rng_field, str):
        raise TypeError(f"`rng_field` must be a field name (a str) or None; got {rng_field!r}.")
    if rng_field in _STEP_FIELDS:
        expected = f"the PRNG key's field, not one the step keeps itself {_STEP_FIELDS}"
        raise ValueError(f"`rng_field` must name {expected}; got {rng_field!r}.")
    if fields is None:
        return fields, rng_field
    if not (isinstance(fields, str | Sequence) and all(isinstance(name, str) for name in fields)):
        expected = "a name, a sequence of names or None"
        raise TypeError(f"`model_state_fields` must be {expected}; got {fields!r}.")
    names = [fields] if isinstance(fields, str) else list(fields)
    if any(name in _STEP_FIELDS for name in names):
        expected = "the model's non-differentiated state (e.g. ('batch_stats',)) or ()"
        own = f"not a field the step keeps itself {_STEP_FIELDS}"
        raise ValueError(f"`model_state_fields` must name {expected}, {own}; got {fields!r}.")
    return (fields if isinstance(fields, str) else tuple(fields)), rng_field


_NAME_THEM = (
    "pass make_train_step's `model_state_fields=` (the fields holding model state, e.g. "
    "('batch_stats',), or ()) and `rng_field=` (the key's field, or None): jaxga does not guess"
)


def state_fields(state: Any, model_state_fields: Any, rng_field: Any) -> StateFields:
    """The fields of ``state`` holding model state and the key: as given, else its class's."""
    ours = isinstance(state, TrainState)
    flax_fields = {f.name for f in dataclasses.fields(train_state.TrainState)}
    nodes = [f.name for f in dataclasses.fields(state) if f.metadata.get("pytree_node", True)]
    if not ours and model_state_fields is None and (added := sorted(set(nodes) - flax_fields)):
        raise ValueError(f"`state`, a {type(state).__name__}, adds fields {added}: {_NAME_THEM}.")
    if not ours:  # nnx.split's variables other than nnx.Param belong in the model state
        check_arrays(state.params, "params", empty_ok=True)
    given = StateFields(
        ("model_state" if ours else ()) if model_state_fields is None else model_state_fields,
        ("rng" if ours else None) if rng_field is None else rng_field,
    )
    names = [given.model_state] if isinstance(given.model_state, str) else given.model_state
    if given.rng is not None and given.rng in names:
        got = f"{given.rng!r}, the key's (`rng_field`)"
        raise ValueError(f"`model_state_fields` must not name the PRNG key's field; got {got}.")
    fields = sorted(f.name for f in dataclasses.fields(state))
    for argument, name in [*(("model_state_fields", n) for n in names), ("rng_field", given.rng)]:
        if name is not None and not hasattr(state, name):
            got = f"{name!r}: `state`, a {type(state).__name__}, has no field {name!r}"
            raise ValueError(f"`{argument}` must name one of `state`'s {fields}; got {got}.")
    return given
