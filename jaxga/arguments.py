"""What an accumulated function was asked to do, and its arguments and output, checked."""

import functools
import inspect
import itertools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.tree_util import keystr, tree_flatten_with_path

from jaxga import _checks, collectives, meshes, modules
from jaxga.loss import Mean, check_value
from jaxga.microbatch import IndivisibleBatchError

FUN = "`fun`"  # how errors name the accumulated function, unless a train step words it


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
    aux: Any  # None (a Mean summed, others stacked), or kinds (auxiliary.KINDS), a prefix
    num_real_microbatches: Any = None  # None: all; else an int (or traced int) in 1..k
    canonical_convolutions: bool | str = "auto"  # True, False or "auto": on CPU backends only
    state_reduction: Any = "mean"  # "mean" (collectives.mean_over_devices) or (x, axes) -> x
    placement: Any = None  # a train step's collectives.Placement; None: as the values lie
    called_as: str = FUN  # how errors name the function: a train step's loss is worded so


def _items(value: Any) -> tuple[Any, ...]:
    """``value`` as a tuple: one position (an int or an `nnx.DiffState`), or several."""
    try:
        return (value,) if isinstance(value, int | nnx.DiffState) else tuple(value)
    except TypeError:  # not iterable: checked by the caller
        return (value,)


def as_positions(name: str, value: Any, shown: Any = None) -> tuple[int, ...]:
    """``value``, the argument ``name`` (an int or several), as distinct non-negative ints."""
    got = repr(value) if shown is None else shown
    values = _items(value)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TypeError(f"`{name}` must be a non-negative int or a tuple of them; got {got}.")
    if len(set(values)) != len(values):
        raise ValueError(f"`{name}` must not repeat a position; got {got}.")
    return values


def make_options(
    argnums: Any, *, batch_argnums: Any, rng_argnums: Any, state_argnums: Any, **others: Any
) -> Options:
    """The `Options` of these positions (checked: distinct, none named twice) and ``others``."""
    items = _items(argnums)
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
            raise ValueError(f"`{a}`={x} and `{b}`={y} both name argument(s) {common}.")
    filters = {a.argnum: a.filter for a in items if isinstance(a, nnx.DiffState)}
    return Options(
        filters={i: filters.get(i, nnx.Param) for i in named["argnums"]},
        single_argnum=isinstance(argnums, int | nnx.DiffState),
        rng_argnums=named.pop("rng_argnums", None),
        single_state=isinstance(state_argnums, int),
        **named,
        **others,
    )


def check_unroll(unroll: Any) -> int | bool:
    """``unroll``, checked: a bool or a positive int, as ``lax.scan``'s."""
    if isinstance(unroll, bool):
        return unroll
    return _checks.positive_int(unroll, "unroll", "a bool or a positive int, as lax.scan's")


def check_state_reduction(value: Any) -> Any:
    """``state_reduction``, checked: ``"mean"`` or a function ``(x, axes) -> x``."""
    if isinstance(value, str) and value == "mean":
        return value
    signature = '"mean" or a function `(x, axes) -> x` of each state leaf'
    return _checks.check_arity(value, "state_reduction", 2, signature)


def check_num_real(value: Any, num_microbatches: int) -> Any:
    """An int32 count, checked where it can be read; traced and outside ``1..k``, 0: no
    micro-batch counted, a `Mean` of no item (0 / 0: a NaN loss and gradients). An abstract
    one (a `jax.ShapeDtypeStruct`, for ``step.lower``): its int32 shape."""
    name, expected = "num_real_microbatches", "an int scalar or None"
    bad = f"`{name}` must be in 1..{num_microbatches} (num_microbatches); got {{}}."
    if value is None:
        return None
    if isinstance(value, jax.ShapeDtypeStruct):
        if value.shape != () or not jnp.issubdtype(value.dtype, jnp.integer):
            got = f"{value.dtype}{list(value.shape)}"
            raise TypeError(f"An abstract `{name}` must be an integer scalar; got {got}.")
        return jax.ShapeDtypeStruct((), jnp.int32, sharding=value.sharding)
    if isinstance(value, jax.core.Tracer):  # unread: 0 gives a NaN loss; checkify reports it
        n = _checks.scalar(value, name, (jnp.integer,), expected).astype(jnp.int32)
    else:
        n = np.asarray(value)
        if n.shape != () or n.dtype.kind not in "iu":
            raise TypeError(f"`{name}` must be {expected}; got {value!r:.60}.")
    ok = check_value((n >= 1) & (n <= num_microbatches), bad, n)
    return jnp.where(ok, jnp.asarray(n, jnp.int32), 0)  # one compiled step for every count


def is_key(x: Any, raw: bool = True) -> bool:
    """A typed PRNG key, or (``raw``) a ``jax.random.PRNGKey``'s ``uint32[2]``."""
    dtype = getattr(x, "dtype", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
    return typed or (raw and dtype == jnp.uint32 and jnp.shape(x) == (2,))


def is_inexact(x: Any) -> bool:
    return isinstance(x, float | complex) or jnp.issubdtype(getattr(x, "dtype", "O"), jnp.inexact)


def is_real_float(x: Any) -> bool:
    """Whether ``x`` is a real float (a loss's dtype: ``jax.grad`` takes no complex output)."""
    return isinstance(x, float) or jnp.issubdtype(getattr(x, "dtype", "O"), jnp.floating)


def shape_and_dtype(x: Any) -> str:
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return f"shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{x!r} of type {type(x).__name__}"


def _check_leaves(tree: Any, ok: Callable[[Any], bool], *, said: str, expected: str) -> None:
    """Raises for the first leaf not ``ok`` of ``{"args": {i: arg}}`` or ``{"aux": aux}``."""
    for path, leaf in tree_flatten_with_path(tree)[0]:
        if not ok(leaf):
            got = f"{path[0].key}{keystr(path[1:])}, {shape_and_dtype(leaf)}"
            raise TypeError(f"{said} {got}; expected {expected}.")


def _unnamed_leaves(options: Options, i: int, arg: Any) -> list[Any]:
    named = {*options.argnums, *options.batch_argnums, *options.state_argnums}
    if i in named or modules.holds_graph_node(arg):
        return []
    return jax.tree.leaves(arg)


def rng_positions(options: Options, args: tuple[Any, ...]) -> tuple[int, ...]:
    """The positions of ``args`` holding PRNG keys: ``rng_argnums`` checked, else found."""
    if options.rng_argnums is not None:
        given = {"args": {i: args[i] for i in options.rng_argnums}}
        _check_leaves(given, is_key, said="`rng_argnums` names", expected="a PRNG key")
        return options.rng_argnums
    found = []
    for i, arg in enumerate(args):
        leaves = _unnamed_leaves(options, i, arg)
        if any(is_key(x, raw=False) for x in leaves):
            found.append(i)
        elif any(is_key(x) for x in leaves):
            raise TypeError(f"args[{i}] holds a uint32[2] PRNG key: pass rng_argnums={i}, or ().")
    return tuple(found)


def check_call(
    options: Options, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[int, collectives.Route]:
    """The batch's rows (this device's, under a manual route) and the call's `Route`."""
    _check_positions(options, args, kwargs)
    return _rows_and_route(options, args)


def _check_positions(options: Options, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raises unless every position ``options`` names is among ``args``, holding no NNX
    graph node where arrays go (nor in ``kwargs``)."""
    for name in ("argnums", "batch_argnums", "rng_argnums", "state_argnums"):
        positions = getattr(options, name) or ()
        if positions and max(positions) >= len(args):
            keywords = f", not by keyword ({', '.join(kwargs)})" if kwargs else ""
            raise ValueError(
                f"`{name}`={positions}, but `fun` got {len(args)} arguments. Pass the batch as "
                f"an argument, by position{keywords}: jaxga reads its arguments by position."
            )
        for i in positions if name != "argnums" else ():
            if modules.holds_graph_node(args[i]):
                raise TypeError(f"`{name}` names args[{i}], a Flax NNX graph node; pass arrays.")
    for key, value in kwargs.items():
        if modules.holds_graph_node(value):
            raise TypeError(f"kwargs[{key!r}] holds a Flax NNX graph node; pass it by position.")


def _rows_and_route(options: Options, args: tuple[Any, ...]) -> tuple[int, collectives.Route]:
    """The batch's rows and the call's `Route`, checked: the batch divides over the devices."""
    k = options.num_microbatches
    rows = [_checks.leading_size(args[i], f"args[{i}]", "batch") for i in options.batch_argnums]
    for i, size in zip(options.batch_argnums, rows):
        if not size:  # None: no leaves
            raise ValueError(f"`batch_argnums` names args[{i}], with no array leaves or rows.")
    if len(set(rows)) > 1:
        sizes = ", ".join(f"args[{i}] {n}" for i, n in zip(options.batch_argnums, rows))
        raise ValueError(
            f"The arguments `batch_argnums` names must have one batch size; got {sizes}."
        )
    rows = rows[0] if rows else 0
    route = collectives.find_route(options.axis_name, [args[i] for i in options.batch_argnums])
    devices = collectives.axis_size(route)
    size = rows * devices if route.kind == "manual" else rows  # the global batch's
    if route.axes and size % (devices * k):
        raise IndivisibleBatchError.of(size, k, devices, route.axes)
    return rows, route


def _closed_over(fun: Any) -> dict[str, Any]:
    """The values ``fun`` reads besides its arguments: a partial's, a closure's, its globals'."""
    found = {}
    while isinstance(fun, functools.partial):
        found |= {f"partial args[{i}]": a for i, a in enumerate(fun.args)} | fun.keywords
        fun = fun.func
    try:
        names = inspect.getclosurevars(inspect.unwrap(fun))
    except (TypeError, ValueError):  # a callable object, a builtin
        return found
    return found | names.globals | names.nonlocals


def note_unsplit(error: Exception, fun: Any, options: Options, args: tuple, rows: int) -> None:
    """Notes on ``error`` the arrays of the batch's ``rows`` that ``fun`` read whole."""
    if not rows or options.num_microbatches == 1:
        return

    def whole(tree: Any) -> bool:
        leaves = jax.tree.leaves(tree)
        return any(isinstance(x, jax.Array | np.ndarray) and x.shape[:1] == (rows,) for x in leaves)

    unsplit = [i for i, a in enumerate(args) if whole(_unnamed_leaves(options, i, a))]
    closed = [name for name, value in _closed_over(fun).items() if whole(value)]
    if unsplit:
        named = ", ".join(f"args[{i}]" for i in unsplit)
        error.add_note(
            f"jaxga: not split, yet of the batch's {rows} rows: {named}; to split "
            f"them too, pass batch_argnums={(*options.batch_argnums, *unsplit)}."
        )
    if closed:
        error.add_note(
            f"jaxga: `fun` reads arrays of the batch's {rows} rows whole, from outside its "
            f"arguments: {', '.join(closed)}; a micro-batch holds "
            f"{rows // options.num_microbatches} rows: pass them in the batch, split with it."
        )


def note_host_memory(error: Exception, args: tuple) -> None:
    """Notes on ``error``, where JAX refused a value in host memory, the arguments' leaves
    that lie there: a loss reads a stack in host memory through a streamed scan alone.

    Args:
        error: an exception raised while tracing the loss; noted only if its message holds
            a type in host memory (JAX's ``float32<host>[...]``).
        args: the loss's arguments.

    Returns:
        None.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jaxga.arguments import note_host_memory
        >>> error = ValueError("... float32<host>[2] ...")
        >>> note_host_memory(error, ({"w": jax.device_put(jnp.ones(2), jax.memory.Space.Host)},))
        >>> error.__notes__[0][:52]
        "jaxga: of the loss's arguments, these lie in host me"
    """
    if not meshes.refuses_host_memory(error):
        return
    found = [
        f"args[{i}]{keystr(path)}"
        for i, arg in enumerate(args)
        for path, x in jax.tree_util.tree_leaves_with_path(arg)
        if _checks.is_array(x)
        and (
            meshes.memory_kind(x) in meshes.HOST_KINDS
            or meshes.memory_space(x) == jax.memory.Space.Host
        )
    ]
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        error.add_note(
            f"jaxga: of the loss's arguments, these lie in host memory: {', '.join(found[:3])}"
            f"{more}. A loss reads a layer stack there through jaxga.remat_scan(..., "
            "stream=True) or jaxga.pipeline_loss(..., stream=True) alone, which fetch a layer "
            "at a time; anything else it reads (a leaf outside the stack, a layer indexed, a "
            "jax.lax.scan or nnx.scan over it) must lie on the device: "
            "jax.device_put(x, jax.memory.Space.Device)."
        )


_KEYWORDS = {  # accumulate's own, which a user may pass to `fun` by mistake
    *("argnums", "batch_argnums", "num_microbatches", "num_real_microbatches", "axis_name"),
    *("has_aux", "aux", "state_argnums", "state_reduction", "rng_argnums", "unroll"),
    *("accumulator_dtype", "canonical_convolutions"),
}


def check_kwargs(fun: Any, kwargs: dict[str, Any]) -> None:
    """Raises for a keyword of jaxga's (``num_real_microbatches``...) that ``fun`` does not take."""
    ours = sorted(set(kwargs) & _KEYWORDS)
    if not ours:
        return
    try:
        inspect.signature(fun).bind_partial(**{name: None for name in ours})
    except TypeError:  # fun does not take them: they were meant for jaxga
        raise TypeError(
            f"`fun` was called with {ours}, which it does not take; they are arguments of "
            f"jaxga.value_and_grad / jaxga.accumulate: pass them there, "
            f"jaxga.value_and_grad(fun, ..., {ours[0]}=...)."
        ) from None
    except ValueError:  # no signature
        pass


def check_primals(primals: tuple[Any, ...], argnums: tuple[int, ...]) -> None:
    """Raises unless every leaf of the differentiated ``primals`` is a float."""
    given = {"args": dict(zip(argnums, primals))}
    _check_leaves(given, is_inexact, said="`argnums` differentiates", expected="floats")


class Output(NamedTuple):
    """What ``fun`` returned for one micro-batch, checked and taken apart."""

    mean: Mean
    aux: Any
    state: tuple[Any, ...]  # the new values of the state_argnums, in order


_FUN_PAIRS = {  # what `fun` returns as a pair: the option asking for it, the pair
    "state": ("`state_argnums`", "(output, new_state)"),
    "aux_state": ("has_aux=True and `state_argnums`", "((value, aux), new_state)"),
    "aux": ("has_aux=True", "(value, aux)"),
}
_STEP_PAIRS = {  # a train step's loss: the error when it does not return its pair
    "state": "{called_as} must return a pair (loss, new_model_state); got {got}.",
    "aux": "With has_aux=True, {called_as} must return (loss, aux); got {got}.",
    "aux_state": "{called_as} must return ((loss, aux), new_model_state); got {got}.",
}


def _pair(out: Any, options: Options, kind: str, hint: str = "") -> tuple[Any, Any]:
    """``out`` as the pair ``kind`` of `_FUN_PAIRS` says, or an error worded by ``options``."""
    if isinstance(out, tuple) and len(out) == 2:
        return out
    if options.called_as != FUN:
        got = f"an array of shape {out.shape}" if hasattr(out, "shape") else type(out).__name__
        raise TypeError(_STEP_PAIRS[kind].format(called_as=options.called_as, got=got))
    got = (
        f"an array of {shape_and_dtype(out)}"
        if hasattr(out, "shape")
        else f"a {type(out).__name__}"
    )
    option, pair = _FUN_PAIRS[kind]
    raise TypeError(f"With {option}, `fun` must return {pair}; got {got}{hint}.")


def _check_alone(out: Any, options: Options) -> None:
    """Raises if the loss ``out`` is a tuple or list: aux not asked for (a train step's loss:
    never, beside its pair)."""
    if not isinstance(out, tuple | list):
        return
    got = f"a {type(out).__name__} of length {len(out)}"
    if options.called_as == FUN and not options.has_aux:
        raise TypeError(f"`fun` returned {got}, but has_aux=False.")
    if options.called_as != FUN:
        plain = not (options.has_aux or options.state_argnums)
        hint = "; or build the step with has_aux=True" if plain else ""
        raise TypeError(f"{options.called_as} must give the loss alone, no aux; got {got}{hint}.")


def parse_output(out: Any, options: Options, old_state: tuple[Any, ...], *, rows: int) -> Output:
    """What ``fun`` returned for one micro-batch, checked and taken apart: its `Mean`, aux and
    new state (cast as ``old_state``); the errors name it as ``options.called_as`` says."""
    aux, state, called_as = None, (), options.called_as
    if options.state_argnums:
        out, state = _pair(out, options, "state")
    if options.has_aux and options.state_argnums:
        hint = " as its first item (a loss with no aux besides its state: has_aux=False)"
        out, aux = _pair(out, options, "aux_state", hint)
    elif options.has_aux:
        out, aux = _pair(out, options, "aux")
    _check_alone(out, options)
    if modules.holds_graph_node((out, aux)):
        raise TypeError(
            f"{called_as} returned an NNX graph node in its value or aux; expected arrays."
        )
    total, count = (out.total, out.count) if isinstance(out, Mean) else (out, 1)
    if not (is_real_float(total) and jnp.shape(total) == ()):
        what = "Mean.total has" if isinstance(out, Mean) else "it returned"
        raise TypeError(
            f"{called_as} must return a float scalar or a Mean; {what} {shape_and_dtype(total)}."
        )
    if not _checks.is_value(count):
        got = f"{count!r:.60} of type {type(count).__name__}"
        message = f"{called_as} returned a jaxga.Mean whose count is {got}; expected a scalar."
        raise TypeError(message)
    if jnp.shape(count) != () or not jnp.issubdtype(jnp.result_type(count), jnp.number):
        got = shape_and_dtype(jnp.asarray(count))
        raise TypeError(
            f"{called_as} returned a jaxga.Mean whose count has {got}; expected a scalar."
        )
    expected = "arrays or numbers"
    _check_leaves({"aux": aux}, _checks.is_value, said=f"{called_as} returned", expected=expected)
    items = max(rows, 1)  # without a batch, each micro-batch counts once
    mean = out if isinstance(out, Mean) else Mean(out * items, jnp.float32(items))
    state = (state,) if options.single_state else state
    new_state = cast_like(state, old_state, "returned a new_state", called_as=called_as)
    return Output(mean, aux, new_state)


class StateStructureError(TypeError):
    """A new state (threaded through the micro-batches) not shaped as the one given."""


def _structure_error(new: Any, old: Any, what: str, called_as: str) -> StateStructureError:
    if isinstance(new, Mapping) and isinstance(old, Mapping) and set(new) != set(old):
        extra = sorted(set(new) - set(old), key=str)
        missing = sorted(set(old) - set(new), key=str)
        return StateStructureError(
            f"{called_as} {what} with extra keys {extra} and missing keys {missing}."
        )
    got, given = jax.tree.structure(new), jax.tree.structure(old)
    return StateStructureError(f"{called_as} {what} with tree structure {got}; expected {given}.")


def cast_like(new: Any, old: Any, what: str, *, called_as: str = FUN) -> Any:
    """``new`` cast leaf by leaf to ``old``'s dtypes, or a `StateStructureError` saying that
    ``called_as`` ``what`` (a verb phrase) shaped otherwise."""
    if jax.tree.structure(new) != jax.tree.structure(old):
        pairs = zip(new, old) if isinstance(new, tuple) and isinstance(old, tuple) else ()
        for n, o in [*pairs, (new, old)]:  # the one state of several that differs, else all
            if jax.tree.structure(n) != jax.tree.structure(o):
                raise _structure_error(n, o, what, called_as)

    def cast(path, n, o):
        n, dtype = jnp.asarray(n), jnp.result_type(o)
        numeric = jnp.issubdtype(dtype, jnp.number)
        same_kind = n.dtype == dtype or (numeric and jnp.can_cast(n.dtype, dtype, "same_kind"))
        if n.shape != jnp.shape(o) or not same_kind:
            raise StateStructureError(
                f"{called_as} {what} whose leaf {keystr(path)} has {shape_and_dtype(n)}; it was "
                f"given {shape_and_dtype(jnp.asarray(o))}: state keeps its shape and dtype kind."
            )
        return n.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, new, old)
