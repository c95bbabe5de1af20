"""Rematerialised scans over stacked layers: per-layer and two-level (√L) checkpointing."""

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import core

from jaxga import convolution, modules
from jaxga._checks import check_arity, check_bool, leading_size, positive_int
from jaxga._host_stacks import check_resident
from jaxga._streaming import streamed_scan, summed_here

Policy = str | Sequence[str] | Callable[..., Any] | None
_STACK = "jax.tree.map(lambda *p: jnp.stack(p), *layers)"
_UNSTACKED = (
    "`stacked_params` looks like one layer's parameters: its leading axis was read as L={} "
    "layers, layer_fn(stacked_params[i], x) {}, but layer_fn(stacked_params, x) gives a carry "
    f"like x. Stack the layers' parameters: {_STACK}."
)


class Remat(NamedTuple):
    """A row of `REMAT`: how a named remat setting rematerialises a scan over layers.

    Attributes:
        policy: the ``jax.checkpoint`` policy, what each layer keeps; None for no checkpoint.
        segments: the checkpointed segments of layers, 1 (each layer) or ``"sqrt"`` (√L).

    Examples:
        >>> import jax
        >>> from jaxga.remat import REMAT
        >>> REMAT["sqrt"].policy is jax.checkpoint_policies.nothing_saveable, REMAT["sqrt"].segments
        (True, 'sqrt')
    """

    policy: Callable[..., Any] | None  # what each layer keeps
    segments: int | str  # 1, or "sqrt"


_cp = jax.checkpoint_policies
REMAT: dict[str, Remat] = {  # least to most recomputation
    "none": Remat(None, 1),  # everything
    "dots": Remat(_cp.dots_saveable, 1),  # the outputs of matmuls and convolutions
    "dots_no_batch": Remat(_cp.dots_with_no_batch_dims_saveable, 1),  # unbatched matmul outputs
    "offload_dots": Remat(_cp.offload_dot_with_no_batch_dims("device", "pinned_host"), 1),
    "full": Remat(_cp.nothing_saveable, 1),  # each layer's input
    "sqrt": Remat(_cp.nothing_saveable, "sqrt"),  # the inputs of √L segments of layers
}
"""The named remat settings, least recomputation first: each name's `Remat` (what each
layer keeps, and in how many segments). ``jaxga.plan(remat=...)`` defaults to its names;
`remat_options` turns one into ``remat_scan``'s keywords."""
_PER_LAYER = [name for name, row in REMAT.items() if row.segments == 1]  # checkpoint_policy's
_FACTORIES = {f: name for name, f in vars(_cp).items() if name.startswith(("save_", "offload_"))}


def checkpoint_policy(policy: Policy) -> Callable[..., Any] | None:
    """Returns the ``jax.checkpoint`` policy that ``policy`` stands for.

    Args:
        policy: a per-layer name of `REMAT`, None, a list of ``checkpoint_name`` names, or a policy.

    Returns:
        The policy, or ``None`` for no checkpoint.

    Examples:
        >>> import jax, jaxga
        >>> jaxga.checkpoint_policy("full") is jax.checkpoint_policies.nothing_saveable
        True
    """
    if any(policy is factory for factory in _FACTORIES):
        name = f"jax.checkpoint_policies.{_FACTORIES[policy]}"
        raise TypeError(f"`policy`={name} makes a policy when called; pass e.g. {name}(...).")
    if policy is None or callable(policy):
        return policy
    if isinstance(policy, str) and policy in _PER_LAYER:
        return REMAT[policy].policy
    if isinstance(policy, list | tuple) and all(isinstance(n, str) for n in policy):
        return _cp.save_only_these_names(*policy)
    raise (ValueError if isinstance(policy, str) else TypeError)(
        f"`policy` must be one of {_PER_LAYER}, None, a list of names or a policy; got {policy!r}."
    )


def remat_options(name: str) -> dict[str, Any]:
    """Returns the [`remat_scan`][jaxga.remat_scan] keywords a name of `REMAT` stands for.

    Args:
        name: a name of `REMAT`, e.g. ``"dots"`` or ``"sqrt"``.

    Returns:
        ``{"policy": ..., "segments": ...}``: the per-layer policy's name (one that
        [`checkpoint_policy`][jaxga.checkpoint_policy] takes) and the segments.

    Examples:
        >>> from jaxga.remat import remat_options
        >>> remat_options("sqrt"), remat_options("dots")
        ({'policy': 'full', 'segments': 'sqrt'}, {'policy': 'dots', 'segments': 1})
    """
    if not isinstance(name, str) or name not in REMAT:
        raise ValueError(f"`name`={name!r} is not a remat name; expected one of {list(REMAT)}.")
    policy = next(n for n in _PER_LAYER if REMAT[n].policy is REMAT[name].policy)
    return {"policy": policy, "segments": REMAT[name].segments}


def stack_length(stacked_params: Any) -> int:
    """Returns the number of layers L in stacked parameters: their leaves' leading size.

    Args:
        stacked_params: a pytree of arrays, each with the same leading layer axis L.

    Returns:
        L; raises ``ValueError`` for a list of per-layer trees (not stacked), leaves whose
        leading sizes differ, or no array leaves.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> jaxga.remat.stack_length({"w": jnp.ones((4, 3, 3)), "b": jnp.ones((4, 3))})
        4
    """
    layers = stacked_params if isinstance(stacked_params, list | tuple) else ()
    structures = {jax.tree.structure(p) for p in layers}
    if len(layers) > 1 and len(structures) == 1 and structures.pop().num_nodes > 1:
        raise ValueError(f"`stacked_params` has {len(layers)} per-layer trees; stack: {_STACK}.")
    try:
        size = leading_size(stacked_params, "stacked_params", "layer")
    except ValueError as e:
        raise ValueError(f"{e} Stack per-layer parameters with {_STACK}.") from None
    if size is None:
        raise ValueError("`stacked_params` has no array leaves; it must be a pytree of arrays.")
    return size


def resolve_segments(segments: int | str, num_layers: int) -> int:
    """Returns the number of checkpointed segments ``segments`` stands for with L layers.

    Args:
        segments: a positive int that divides ``num_layers``, or ``"sqrt"``: the divisor of
            ``num_layers`` nearest √L (the smaller of two as near).
        num_layers: L, the number of layers.

    Returns:
        The number of segments; raises ``ValueError`` for a count that does not divide L,
        naming the divisors nearest it.

    Examples:
        >>> import jaxga
        >>> jaxga.remat.resolve_segments("sqrt", 12), jaxga.remat.resolve_segments(4, 12)
        (3, 4)
    """
    divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
    if segments == "sqrt":  # the divisor nearest √L
        if not divisors:
            raise ValueError("`segments`='sqrt' needs at least one layer; `stacked_params` has 0.")
        return min(divisors, key=lambda d: (abs(d - num_layers**0.5), d))
    segments = positive_int(segments, "segments", "a positive int or 'sqrt'")
    if num_layers % segments:
        above = sum(d < segments for d in divisors)  # the index of the first divisor above
        nearest = " or ".join(map(str, divisors[above - 1 : above + 1]))
        raise ValueError(f"`segments`={segments} does not divide L={num_layers}; try {nearest}.")
    return segments


def _describe(tree: Any) -> Any:  # each leaf as its dtype and shape, e.g. 'float32[2, 3]'
    return jax.tree.map(lambda leaf: f"{jnp.result_type(leaf).name}{list(jnp.shape(leaf))}", tree)


def _like(x: Any, y: Any) -> bool:  # whether y has the structure, shapes and dtypes of x
    return jax.tree.flatten(_describe(x)) == jax.tree.flatten(_describe(y))


def _gives_carry(layer_fn: Callable[..., Any], x: Any, *args: Any) -> bool:
    try:  # whether layer_fn(*args) returns a carry like x
        return _like(x, jax.eval_shape(layer_fn, *args))
    except Exception:  # a probe on the error path: the original error is raised instead
        return False


def _apply_layer(layer_fn: Callable[..., Any], stacked: Any, x: Any, params: Any) -> Any:
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    state = _nnx_state(params)
    before = [v.get_raw_value() for _, v in state]
    try:
        y = layer_fn(params, x)
    except Exception as e:
        error, got = e, f"raised {type(e).__name__}"
    else:
        if any(v.get_raw_value() is not value for (_, v), value in zip(state, before)):
            _check_unchanged(layer_fn, params, x, before)  # set anew: changed, or as it was?
        if _like(x, y):
            return y, None
        got = f"returned {_describe(y)} for x of {_describe(x)}"
        error = TypeError(f"`layer_fn` must return a carry like x; it {got} (L={num_layers}).")
    if _gives_carry(layer_fn, x, stacked, x):  # all of stacked_params as one layer's
        raise ValueError(_UNSTACKED.format(num_layers, got))
    if _gives_carry(layer_fn, x, x, params):
        raise TypeError(f"`layer_fn` takes its arguments swapped: as layer_fn(params, x) it {got}.")
    raise error


def _nnx_state(params: Any) -> list[tuple[Any, nnx.Variable]]:
    """The NNX Variables of one layer's ``params`` that are not parameters (a Dropout's RNG
    count, a BatchNorm's statistics), with their paths."""
    found = jax.tree_util.tree_flatten_with_path(params, is_leaf=modules.is_variable)[0]
    return [(p, v) for p, v in found if modules.is_variable(v) and not isinstance(v, nnx.Param)]


def _check_unchanged(layer_fn: Callable[..., Any], params: Any, x: Any, before: list) -> None:
    """Raises if ``layer_fn`` changes a Variable of `_nnx_state` (``before``: their values):
    an update `remat_scan` cannot carry out of its loop, which returns the carry alone. Read
    from ``layer_fn``'s jaxpr: a value it sets that is not the one it got (an NNX transform,
    ``nnx.remat``, sets every Variable anew, most as they were)."""

    def values_after(values: list, params: Any, x: Any) -> list:
        for (_, variable), value in zip(_nnx_state(params), values):
            variable.set_raw_value(value)
        layer_fn(params, x)
        return [variable.get_raw_value() for _, variable in _nnx_state(params)]

    jaxpr = jax.make_jaxpr(values_after)(before, params, x).jaxpr
    sizes = [len(jax.tree.leaves(value)) for value in before]  # the inputs' and outputs' leaves
    ends = itertools.accumulate(sizes)
    for (path, variable), size, end in zip(_nnx_state(params), sizes, ends):
        if all(_forwarded(jaxpr, i) == i for i in range(end - size, end)):
            continue
        where = f"stacked_params{jax.tree_util.keystr(path)}, an nnx.{type(variable).__name__}"
        fix = _STATE_FIX.get(type(variable).__name__, _STATE_FIX[None])
        raise ValueError(
            f"`layer_fn` updates {where}, which remat_scan cannot carry out of its loop (it "
            f"returns the carry alone): {fix}"
        )


_STATE_FIX = {  # what a stacked layer's changing state would do, and what to do instead
    "RngCount": (
        "every micro-batch and step would draw the same dropout mask. Expected layers whose "
        "state does not change: draw dropout from a key passed in the carry, x = (h, key) "
        "(docs/batchnorm-dropout.md), or run them deterministic."
    ),
    "BatchStat": (
        "the batch statistics would never move. A stack cannot keep them: normalise each "
        "example by itself (LayerNorm, RMSNorm), or freeze them (use_running_average=True)."
    ),
    None: "its change would be lost. Expected layers whose state does not change.",
}


def _forwarded(jaxpr: Any, out: int) -> int | None:
    """The input of ``jaxpr`` that its output ``out`` is, through copies and the calls that
    pass it on (``jit``, ``checkpoint``); None if computed."""
    made = {v: (eqn, i) for eqn in jaxpr.eqns for i, v in enumerate(eqn.outvars)}
    var = jaxpr.outvars[out]
    while var not in jaxpr.invars:
        if var not in made:  # a literal
            return None
        eqn, i = made[var]
        inner = list(core.jaxprs_in_params(eqn.params))
        if eqn.primitive.name in ("copy", "copy_p"):
            var = eqn.invars[0]
        elif len(inner) == 1 and len(inner[0].invars) == len(eqn.invars):
            if (j := _forwarded(inner[0], i)) is None:
                return None
            var = eqn.invars[j]
        else:
            return None
    return jaxpr.invars.index(var)


def _carry_of(body: Callable[..., Any], params: Any, x: Any) -> Any:
    """A scan body's ``(x, params) -> (x, None)`` as a layer ``(params, x) -> x``."""
    return body(x, params)[0]


def _checkpointed(layer_fn: Callable[..., Any], stacked_params: Any, save: Any) -> Any:
    """A scan body ``(x, params) -> (x, None)`` of ``layer_fn``, checked, checkpointed by
    the policy ``save`` (None: not)."""
    one_layer = functools.partial(_apply_layer, layer_fn, stacked_params)
    if save is None:
        return one_layer
    # inside a scan the loop keeps XLA from merging recomputation
    return jax.checkpoint(one_layer, policy=save, prevent_cse=False)


def streamed_window(
    layer_fn: Callable[[Any, Any], Any],
    stacked_params: Any,
    x: Any,
    *,
    policy: Policy,
    window: tuple[Any, int],
) -> Any:
    """`remat_scan` with ``stream=True`` over layers ``start`` to ``start + size - 1`` of
    the stack alone (``window = (start, size)``; ``start`` may be traced): a pipeline
    stage's chunk of its layers. The other layers are neither fetched nor run. Its
    gradient is taken inside a loop whose sums take the stack's (`_streaming.vjp_summed`,
    as a pipeline's ticks do): the window's layers are added to them, the others left.

    Args:
        layer_fn: ``layer_fn(params_of_one_layer, x) -> x``.
        stacked_params: the layers' parameters, a leading layer axis; in host memory or not.
        x: the carry.
        policy: each layer's checkpoint policy, as for `remat_scan`.
        window: ``(start, size)``, the layers run.

    Returns:
        Layer ``start + size - 1``'s output, like ``x``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from jaxga.remat import streamed_window
        >>> def layer(w, x):
        ...     return x * w
        >>> w = jnp.arange(1.0, 5.0)[:, None] * jnp.ones((4, 2))  # layers scaling by 1, 2, 3, 4
        >>> streamed_window(layer, w, jnp.ones(2), policy="full", window=(1, 2)).tolist()
        [6.0, 6.0]
    """
    one_layer = _checkpointed(layer_fn, stacked_params, checkpoint_policy(policy))
    return streamed_scan(functools.partial(_carry_of, one_layer), stacked_params, x, window=window)


def _check_stream(segments: Any, unroll: Any, canonical_convolutions: Any) -> None:
    """Raises for an option ``remat_scan(stream=True)`` does not take."""
    given = [("segments", segments, 1), ("unroll", unroll, False)]
    given.append(("canonical_convolutions", canonical_convolutions, False))
    for name, value, expected in given:
        if isinstance(value, bool | str) != isinstance(expected, bool) or value != expected:
            got = f"`{name}`={value!r} with stream=True"
            raise ValueError(f"{got}: not supported; expected {name}={expected!r}.")


def remat_scan(
    layer_fn: Callable[[Any, Any], Any],
    stacked_params: Any,
    x: Any,
    *,
    policy: Policy = "full",
    segments: int | str = 1,
    unroll: bool = False,
    canonical_convolutions: bool | str = False,
    stream: bool = False,
    prefetch: bool = True,
) -> Any:
    """Computes ``for p in stacked_params: x = layer_fn(p, x)``, rematerialised, in a ``lax.scan``.

    In the loss of `jaxga.value_and_grad` or a train step, over a differentiated stack as
    the loss received it, with ``policy="full"`` and one segment (or ``stream=True``), the
    scan is a ``jax.custom_vjp`` whose backward pass adds each layer's gradient to its
    gradient sum as it produces it (docs/remat.md); elsewhere it is JAX's own ``lax.scan``.

    Args:
        layer_fn: ``layer_fn(params_of_one_layer, x) -> x``, keeping ``x``'s shapes and dtypes.
        stacked_params: the layers' parameters, a pytree of arrays with a leading layer axis L.
        x: the carry, an array or pytree of arrays, given to the first layer.
        policy: each layer's policy, see [`checkpoint_policy`][jaxga.checkpoint_policy].
        segments: 1 (per layer), a divisor s of L (s checkpointed segments) or ``"sqrt"``.
        unroll: run the layers (of a segment) without a loop; only with ``policy="none"``/None.
        canonical_convolutions: the backward's convolutions in NHWC/HWIO (reverse mode only):
            True, False (the default) or ``"auto"``, on CPU backends only (see
            ``jaxga.convolution.rewrites``).
        stream: fetch each layer's slice of ``stacked_params`` (which may live in host memory,
            ``pinned_host``) to the device in the forward pass and again in the backward
            pass, and write each layer's gradient where its parameters live as the backward
            produces it (inside jaxga's micro-batch loop, added to the gradient sum there);
            with ``segments=1``, no ``unroll`` and no ``canonical_convolutions``. Each
            layer's input is kept, and the layer recomputed under ``policy`` in the
            backward. Bit for bit the resident scan's result and gradients (docs/streaming.md).
        prefetch: with ``stream=True``, fetch each layer one iteration ahead of its use, so
            that the copy overlaps the layer before it (the default: two layers' slices on
            the device, and one layer more moved a pass forward and back); False fetches
            each where it is used, every layer waiting for its copy.

    Returns:
        The last layer's output, like ``x``.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> w, x = jnp.full((16, 4, 4), 0.1), jnp.ones((2, 4))
        >>> jaxga.remat_scan(lambda w, x: jnp.tanh(x @ w), w, x, segments="sqrt").shape
        (2, 4)
        >>> jaxga.remat_scan(lambda w, x: jnp.tanh(x @ w), w, x, stream=True).shape
        (2, 4)
    """
    if not check_bool(prefetch, "prefetch") and not check_bool(stream, "stream"):
        raise ValueError("`prefetch`=False applies to stream=True; got stream=False.")
    if check_bool(stream, "stream"):
        _check_stream(segments, unroll, canonical_convolutions)
    else:
        check_resident(stacked_params, "pass stream=True")
    if convolution.rewrites(canonical_convolutions):  # XLA:CPU, see docs/gpus.md
        options = {"policy": policy, "segments": segments, "unroll": unroll}
        plain = functools.partial(remat_scan, layer_fn, **options, canonical_convolutions=False)
        return convolution.canonical_backward(plain)(stacked_params, x)
    num_layers = stack_length(stacked_params)
    save = checkpoint_policy(policy)
    num_segments = resolve_segments(segments, num_layers)
    check_arity(layer_fn, "layer_fn", 2, "layer_fn(params_of_one_layer, x) -> x")
    for path, leaf in jax.tree_util.tree_flatten_with_path(x)[0]:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            got = f"x{jax.tree_util.keystr(path)} is {leaf!r} of type {type(leaf).__name__}"
            raise TypeError(f"Every leaf of the carry `x` must be an array; {got}.")
    if check_bool(unroll, "unroll") and save is not None:  # only a loop keeps remat apart
        got = getattr(policy, "__name__", repr(policy))
        raise ValueError(f"`unroll`=True needs policy='none' or None; got policy={got}.")
    if num_layers == 0:  # no layer: the carry as given (a stream has nothing to fetch)
        return x
    one_layer = _checkpointed(layer_fn, stacked_params, save)
    whole_layers = save is _cp.nothing_saveable and num_segments == 1 and not unroll
    # in jaxga's loop, the backward pass adds each layer's gradient to its sum (docs/remat.md)
    if stream or (whole_layers and summed_here(stacked_params)):
        layer = functools.partial(_carry_of, one_layer)
        return streamed_scan(layer, stacked_params, x, prefetch=prefetch and stream)
    layers = functools.partial(jax.lax.scan, one_layer, unroll=unroll)  # (x, params) -> (x, None)
    if num_segments == 1:
        return layers(x, stacked_params)[0]
    shape = (num_segments, num_layers // num_segments)  # of each leaf's leading axis, split
    segmented = jax.tree.map(lambda p: jnp.reshape(p, (*shape, *jnp.shape(p)[1:])), stacked_params)
    return jax.lax.scan(jax.checkpoint(layers, prevent_cse=False), x, segmented)[0]
