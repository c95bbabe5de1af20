"""What an accumulated function was asked to do, and its arguments and output, checked."""

import itertools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxga import _checks, collectives, modules
from jaxga.loss import Mean, as_mean

AUX_MODES = ("auto", "stack")


class Options(NamedTuple):
    """How [`jaxga.accumulate`][jaxga.accumulate] was built: its arguments, checked."""

    num_microbatches: int
    argnums: tuple[int, ...]
    filters: dict[int, Any]  # the NNX filter of each differentiated argument
    single_argnum: bool  # argnums was one position: grads are not a tuple
    has_aux: bool
    batch_argnums: tuple[int, ...]
    rng_argnums: tuple[int, ...] | None  # None: every other argument holding typed keys
    state_argnums: tuple[int, ...]
    single_state: bool  # state_argnums was one position: the state is not a tuple
    axis_name: Any
    accumulator_dtype: Any
    unroll: int | bool
    aux: str


def as_positions(name: str, value: Any, shown: Any = None) -> tuple[int, ...]:
    """``value`` as a tuple of argument positions; raises naming ``name``."""
    got = repr(value) if shown is None else shown
    expected = f"`{name}` must be a non-negative int or a tuple of them; got {got}."
    try:
        values = (value,) if isinstance(value, int) else tuple(value)
    except TypeError:
        raise TypeError(expected) from None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TypeError(expected)
    if len(set(values)) != len(values):
        raise ValueError(f"`{name}` must not repeat a position; got {got}.")
    return values


def _argnum_items(argnums: Any) -> tuple[Any, ...]:
    if isinstance(argnums, int | nnx.DiffState | str):
        return (argnums,)
    try:
        return tuple(argnums)
    except TypeError:
        return (argnums,)


def make_options(
    argnums: Any, *, batch_argnums: Any, rng_argnums: Any, state_argnums: Any, **rest: Any
) -> Options:
    """`Options` from `accumulate`'s arguments: the positions checked, ``rest`` as given."""
    items = _argnum_items(argnums)
    diff = tuple(a.argnum if isinstance(a, nnx.DiffState) else a for a in items)
    named = {
        "argnums": as_positions("argnums", diff, shown=repr(argnums)),
        "batch_argnums": as_positions("batch_argnums", batch_argnums),
        "state_argnums": as_positions("state_argnums", state_argnums),
    }
    if rng_argnums is not None:  # None: found at the call
        named["rng_argnums"] = as_positions("rng_argnums", rng_argnums)
    if not named["argnums"]:
        raise ValueError("`argnums` must name at least one argument to differentiate.")
    for (a, x), (b, y) in itertools.combinations(named.items(), 2):
        if common := sorted(set(x) & set(y)):
            raise ValueError(
                f"`{a}`={x} and `{b}`={y} both name argument(s) {common}; an argument is one "
                f"of differentiated, split into micro-batches, a PRNG key or threaded state."
            )
    filters = {a.argnum: a.filter for a in items if isinstance(a, nnx.DiffState)}
    return Options(
        filters={i: filters.get(i, nnx.Param) for i in named["argnums"]},
        single_argnum=isinstance(argnums, int | nnx.DiffState),
        rng_argnums=named.pop("rng_argnums", None),
        single_state=isinstance(state_argnums, int),
        **named,
        **rest,
    )


def check_unroll(unroll: Any) -> int | bool:
    if isinstance(unroll, bool):
        return unroll
    return _checks.positive_int(unroll, "unroll", "a bool or a positive int, as lax.scan's")


def check_aux(aux: Any) -> str:
    if not (isinstance(aux, str) and aux in AUX_MODES):
        raise ValueError(f"`aux` must be one of {AUX_MODES}; got {aux!r}.")
    return aux


def is_key(x: Any, raw: bool = True) -> bool:
    """A typed PRNG key, or (``raw``) a ``jax.random.PRNGKey``'s ``uint32[2]``."""
    dtype = getattr(x, "dtype", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
    return typed or (raw and dtype == jnp.uint32 and jnp.shape(x) == (2,))


def _unnamed_leaves(options: Options, i: int, arg: Any) -> list[Any]:
    """The leaves of ``args[i]`` if no option names it and it holds no module, else none."""
    named = {*options.argnums, *options.batch_argnums, *options.state_argnums}
    if i in named or modules.holds_graph_node(arg):
        return []
    return jax.tree.leaves(arg)


def rng_positions(options: Options, args: tuple[Any, ...]) -> tuple[int, ...]:
    """The PRNG key arguments: ``rng_argnums``, or by default every other one holding keys."""
    if options.rng_argnums is not None:
        for i in options.rng_argnums:
            for path, key in jax.tree_util.tree_flatten_with_path(args[i])[0]:
                if not is_key(key):
                    raise TypeError(
                        f"`rng_argnums` names args[{i}], but args[{i}]{jax.tree_util.keystr(path)} "
                        f"is not a PRNG key ({describe(key)}); expected jax.random.key's."
                    )
        return options.rng_argnums
    found = []
    for i, arg in enumerate(args):
        leaves = _unnamed_leaves(options, i, arg)
        if any(is_key(x, raw=False) for x in leaves):
            found.append(i)
        elif any(is_key(x) for x in leaves):
            raise TypeError(
                f"args[{i}] holds a uint32[2] array, a raw PRNG key: pass rng_argnums={i} for a "
                f"key per micro-batch, or rng_argnums=() to give each this same array."
            )
    return tuple(found)


def _check_positions_exist(options: Options, args: tuple[Any, ...]) -> None:
    for name in ("argnums", "batch_argnums", "rng_argnums", "state_argnums"):
        positions = getattr(options, name) or ()
        if positions and max(positions) >= len(args):
            hint = " Pass the batch as an argument." if name == "batch_argnums" else ""
            raise ValueError(
                f"`{name}`={positions} refers to positional argument {max(positions)}, but "
                f"the function was called with {len(args)} positional argument(s).{hint}"
            )
        for i in positions if name != "argnums" else ():
            if modules.holds_graph_node(args[i]):
                raise TypeError(
                    f"`{name}` names args[{i}], a Flax NNX graph node; modules are "
                    f"differentiated (`argnums`) or passed as they are (state threaded)."
                )


def check_call(options: Options, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raises for arguments the options cannot apply to, naming the argument."""
    _check_positions_exist(options, args)
    if named := [key for key, value in kwargs.items() if modules.holds_graph_node(value)]:
        raise TypeError(
            f"Keyword argument {named[0]!r} holds a Flax NNX graph node; pass it by position."
        )
    for i in options.batch_argnums:
        if not _checks.leading_size(args[i], f"args[{i}]", "batch"):  # None: no leaves
            raise ValueError(
                f"`batch_argnums` names args[{i}], which has no array leaves or no rows (got "
                f"{args[i]!r}): pass the batch there, or set `batch_argnums`."
            )
    batch_leaves = jax.tree.leaves([args[i] for i in options.batch_argnums])
    if options.axis_name is not None:
        collectives.check_axis_bound(options.axis_name)
    elif axes := sorted(set().union(*map(collectives.varying_axes, batch_leaves)), key=str):
        raise ValueError(
            f"The batch varies over mesh axes {axes} (inside shard_map), but `axis_name` is "
            f"None: pass axis_name={axes[0]!r}."
        )


def note_unsplit(error: Exception, options: Options, args: tuple[Any, ...]) -> None:
    """Adds to ``error`` which arguments left whole have as many rows as the batch."""
    if options.num_microbatches == 1 or not options.batch_argnums:
        return
    rows = jnp.shape(jax.tree.leaves(args[options.batch_argnums[0]])[0])[:1]
    whole = [
        i
        for i, arg in enumerate(args)
        if any(getattr(x, "shape", ())[:1] == rows for x in _unnamed_leaves(options, i, arg))
    ]
    if whole:
        error.add_note(
            f"jaxga: not split, yet of the batch's {rows[0]} rows: "
            f"{', '.join(f'args[{i}]' for i in whole)}; to split them too, pass "
            f"batch_argnums={(*options.batch_argnums, *whole)}."
        )


def check_primals(primals: tuple[Any, ...], argnums: tuple[int, ...]) -> None:
    for i, tree in zip(argnums, primals):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if not is_inexact(leaf):
                raise TypeError(
                    f"`argnums` differentiates args[{i}]{jax.tree_util.keystr(path)}, "
                    f"{describe(leaf)}; expected float arrays (pass others in another argument)."
                )


def is_inexact(x: Any) -> bool:
    dtype = getattr(x, "dtype", None) if not isinstance(x, float | complex) else jnp.float32
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def describe(x: Any) -> str:
    """``x`` in an error message: its shape and dtype, or its value and type."""
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return f"shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{x!r} of type {type(x).__name__}"


class Output(NamedTuple):
    """What ``fun`` returned for one micro-batch, checked and taken apart."""

    mean: Mean
    aux: Any
    state: tuple[Any, ...]  # the new values of the state_argnums, in order


def _pair(out: Any, option: str, pair: str) -> tuple[Any, Any]:
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"With {option}, `fun` must return {pair}; got {type(out).__name__}.")
    return out


def _check_value(value: Any, aux: Any) -> None:
    if modules.holds_graph_node((value, aux)):
        raise TypeError(
            "`fun` returned a Flax NNX graph node (a module) in its value or aux; expected "
            "arrays (jaxga writes module arguments' state back itself)."
        )
    total = value.total if isinstance(value, Mean) else value
    if not (is_inexact(total) and jnp.shape(total) == ()):
        what = "Mean.total has" if isinstance(value, Mean) else "it returned"
        raise TypeError(
            f"`fun` must return a float scalar (or a Mean of them); {what} {describe(total)}."
        )
    for path, leaf in jax.tree_util.tree_flatten_with_path(aux)[0]:
        if not (hasattr(leaf, "dtype") or isinstance(leaf, int | float | bool | complex)):
            raise TypeError(
                f"`fun` returned aux{jax.tree_util.keystr(path)}, {describe(leaf)}; aux leaves "
                f"must be arrays or numbers."
            )


def parse_output(out: Any, options: Options, old_state: tuple[Any, ...]) -> Output:
    """``fun``'s output checked and taken apart; the new state cast like ``old_state``."""
    aux, state = None, ()
    if options.state_argnums:
        out, state = _pair(out, "`state_argnums`", "(output, new_state)")
    if options.has_aux:
        out, aux = _pair(out, "has_aux=True", "(value, aux)")
    elif isinstance(out, tuple | list):
        raise TypeError(
            f"`fun` returned a {type(out).__name__} of length {len(out)}, but has_aux=False; "
            f"pass has_aux=True if it returns (loss, aux)."
        )
    _check_value(out, aux)
    mean = as_mean(out)
    count = mean.count
    if jnp.shape(count) != () or not jnp.issubdtype(jnp.result_type(count), jnp.number):
        raise TypeError(
            f"`fun` returned a jaxga.Mean whose count has {describe(jnp.asarray(count))}; "
            f"expected a scalar number of items (or total weight)."
        )
    state = (state,) if options.single_state else state
    return Output(mean, aux, cast_like(state, old_state, "returned a new_state"))


class StateStructureError(TypeError):
    """A new state (threaded through the micro-batches) not shaped as the one given."""


def _structure_error(new: Any, old: Any, what: str) -> StateStructureError:
    got, given = jax.tree.structure(new), jax.tree.structure(old)
    if isinstance(new, Mapping) and isinstance(old, Mapping) and set(new) != set(old):
        extra, missing = sorted(set(new) - set(old), key=str), sorted(set(old) - set(new), key=str)
        return StateStructureError(
            f"`fun` {what} with keys {sorted(new, key=str)}; it was given {sorted(old, key=str)} "
            f"(extra: {extra}, missing: {missing}). Return the keys it was given (with Flax "
            f"Linen, `mutable=` only the collections the state holds)."
        )
    return StateStructureError(
        f"`fun` {what} with tree structure {got}; expected the one given, {given}."
    )


def cast_like(new: Any, old: Any, what: str) -> Any:
    """``new`` cast to the dtypes of ``old``, so that it can be carried by the scan."""
    if jax.tree.structure(new) != jax.tree.structure(old):
        for n, o in zip(new, old) if isinstance(new, tuple) and isinstance(old, tuple) else ():
            if jax.tree.structure(n) != jax.tree.structure(o):
                raise _structure_error(n, o, what)
        raise _structure_error(new, old, what)

    def cast(path, n, o):
        n, dtype = jnp.asarray(n), jnp.result_type(o)
        numeric = jnp.issubdtype(dtype, jnp.number)
        same_kind = n.dtype == dtype or (numeric and jnp.can_cast(n.dtype, dtype, "same_kind"))
        if n.shape != jnp.shape(o) or not same_kind:
            raise StateStructureError(
                f"`fun` {what} whose leaf {jax.tree_util.keystr(path)} has {describe(n)}; it was "
                f"given {describe(jnp.asarray(o))}: state keeps its shape and dtype kind."
            )
        return n.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, new, old)
