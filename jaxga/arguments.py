"""A transformed function's arguments: which are differentiated, split, keys or state; checked."""

import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxga import _checks, collectives, modules
from jaxga.loss import Mean, as_mean


class Options(NamedTuple):
    num_microbatches: int
    argnums: tuple[int, ...]
    filters: dict[int, Any]  # the NNX filter of each differentiated argument
    single_argnum: bool
    has_aux: bool
    batch_argnums: tuple[int, ...]
    rng_argnums: tuple[int, ...] | None  # None: every other argument holding PRNG keys
    state_argnums: tuple[int, ...]
    single_state: bool
    axis_name: Any
    accumulator_dtype: Any


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


def parse_positions(fun, argnums, *named) -> dict[str, Any]:
    """Checks ``fun``; the :class:`Options` fields of ``argnums``, ``named`` (batch, rng, state)."""
    _checks.check_callable(fun, "fun")
    single = isinstance(argnums, int | nnx.DiffState)
    try:
        items = (argnums,) if single or isinstance(argnums, str) else tuple(argnums)
    except TypeError:
        items = (argnums,)
    filters = {a.argnum: a.filter for a in items if isinstance(a, nnx.DiffState)}
    diff = tuple(a.argnum if isinstance(a, nnx.DiffState) else a for a in items)
    pos = {"argnums": as_positions("argnums", diff, shown=repr(argnums))}
    for name, value in zip(("batch_argnums", "rng_argnums", "state_argnums"), named):
        if value is not None or name != "rng_argnums":  # rng_argnums=None: found later
            pos[name] = as_positions(name, value)
    if not pos["argnums"]:
        raise ValueError("`argnums` must name at least one argument to differentiate.")
    for (a, x), (b, y) in itertools.combinations(pos.items(), 2):
        if common := sorted(set(x) & set(y)):
            raise ValueError(
                f"`{a}`={x} and `{b}`={y} both name argument(s) {common}; an argument is one "
                f"of differentiated, split into micro-batches, a PRNG key or threaded state."
            )
    filters = {i: filters.get(i, nnx.Param) for i in pos["argnums"]}
    return {"rng_argnums": None, **pos, "filters": filters, "single_argnum": single}


def is_key(x: Any, raw: bool = True) -> bool:
    """A typed PRNG key, or (``raw``) a ``jax.random.PRNGKey``'s ``uint32[2]``."""
    dtype = getattr(x, "dtype", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
    return typed or (raw and dtype == jnp.uint32 and jnp.shape(x) == (2,))


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
    named = {*options.argnums, *options.batch_argnums, *options.state_argnums}
    found = []
    for i, arg in enumerate(args):
        leaves = [] if i in named or modules.holds_graph_node(arg) else jax.tree.leaves(arg)
        if any(is_key(x, raw=False) for x in leaves):
            found.append(i)
        elif any(is_key(x) for x in leaves):
            raise TypeError(
                f"args[{i}] holds a uint32[2] array, a raw PRNG key: pass rng_argnums={i} for a "
                f"key per micro-batch, or rng_argnums=() to give each this same array."
            )
    return tuple(found)


def check_call(options: Options, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
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
    named = {*options.argnums, *options.batch_argnums, *options.state_argnums}
    leaves = lambda i, a: [] if i in named or modules.holds_graph_node(a) else jax.tree.leaves(a)
    sized = lambda i, a: any(getattr(x, "shape", ())[:1] == rows for x in leaves(i, a))
    if whole := [i for i, arg in enumerate(args) if sized(i, arg)]:
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
                    f"`argnums` differentiates args[{i}]{jax.tree_util.keystr(path)} of dtype "
                    f"{jnp.result_type(leaf)}; expected floats (pass others in another argument)."
                )


def is_inexact(x: Any) -> bool:
    dtype = getattr(x, "dtype", None) if not isinstance(x, float | complex) else jnp.float32
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def describe(x: Any) -> str:
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return f"shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{x!r} of type {type(x).__name__}"


def _pair(out: Any, option: str, pair: str) -> tuple[Any, Any]:
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"With {option}, `fun` must return {pair}; got {type(out).__name__}.")
    return out


def parse_output(out: Any, options: Options, old_state: tuple) -> tuple[Mean, Any, tuple]:
    """``fun``'s output as ``(mean, aux, new_state)``, checked; the state like ``old_state``."""
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
    if modules.holds_graph_node((out, aux)):
        raise TypeError(
            "`fun` returned a Flax NNX graph node (a module) in its value or aux; expected "
            "arrays (jaxga writes module arguments' state back itself)."
        )
    total = out.total if isinstance(out, Mean) else out
    if not (is_inexact(total) and jnp.shape(total) == ()):
        got = f"{'Mean.total has' if isinstance(out, Mean) else 'it returned'} {describe(total)}"
        raise TypeError(f"`fun` must return a float scalar (or a Mean of them); {got}.")
    count = (mean := as_mean(out)).count
    if jnp.shape(count) != () or not jnp.issubdtype(jnp.result_type(count), jnp.number):
        raise TypeError(
            f"`fun` returned a jaxga.Mean whose count has {describe(jnp.asarray(count))}; "
            f"expected a scalar number of items (or total weight)."
        )
    state = (state,) if options.single_state else state
    return mean, aux, like(state, old_state, "returned a new_state")


def like(new: Any, old: Any, what: str) -> Any:
    """``new`` cast to the dtypes of ``old``, so that it can be carried by the scan."""
    if (got := jax.tree.structure(new)) != (given := jax.tree.structure(old)):
        raise TypeError(f"`fun` {what} with tree structure {got}; expected the one given, {given}.")

    def cast(path, n, o):
        n, dtype = jnp.asarray(n), jnp.result_type(o)
        numeric = jnp.issubdtype(dtype, jnp.number)
        same_kind = n.dtype == dtype or (numeric and jnp.can_cast(n.dtype, dtype, "same_kind"))
        if n.shape != jnp.shape(o) or not same_kind:
            raise TypeError(
                f"`fun` {what} whose leaf {jax.tree_util.keystr(path)} has {describe(n)}; it was "
                f"given {describe(jnp.asarray(o))}: state keeps its shape and dtype kind."
            )
        return n.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, new, old)
