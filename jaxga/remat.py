"""Rematerialised scans over stacked layers: per-layer and two-level (√L) checkpointing."""

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxga._checks import check_arity, check_bool, leading_size, positive_int

Policy = str | Sequence[str] | Callable[..., Any] | None
_STACK = "jax.tree.map(lambda *p: jnp.stack(p), *layers)"


class Remat(NamedTuple):
    """A row of :data:`REMAT` (least to most recomputation): a policy, segments, what is kept."""

    policy: Callable[..., Any] | None
    segments: int | str
    keeps: str


_cp = jax.checkpoint_policies
_offload = _cp.offload_dot_with_no_batch_dims("device", "pinned_host")
REMAT: dict[str, Remat] = {
    "none": Remat(None, 1, "everything (no rematerialisation)"),
    "dots": Remat(_cp.dots_saveable, 1, "the outputs of matmuls and convolutions"),
    "dots_no_batch": Remat(_cp.dots_with_no_batch_dims_saveable, 1, "unbatched matmul outputs"),
    "offload_dots": Remat(_offload, 1, "as dots_no_batch, on host"),
    "full": Remat(_cp.nothing_saveable, 1, "each layer's input"),
    "sqrt": Remat(_cp.nothing_saveable, "sqrt", "the inputs of √L segments of layers"),
}
_PER_LAYER = [name for name, row in REMAT.items() if row.segments == 1]  # checkpoint_policy's


def checkpoint_policy(policy: Policy) -> Callable[..., Any] | None:
    """Returns the ``jax.checkpoint`` policy that ``policy`` stands for.

    ``policy``: a per-layer name of :data:`REMAT` (``"none"`` or ``None``: no checkpoint), a
    list of ``checkpoint_name`` names to save, or a ``jax.checkpoint_policies`` callable.

    Example:
        >>> import jax, jaxga
        >>> jaxga.checkpoint_policy("full") is jax.checkpoint_policies.nothing_saveable
        True
    """
    if policy is None or callable(policy):
        return policy
    if isinstance(policy, str) and policy in _PER_LAYER:
        return REMAT[policy].policy
    if isinstance(policy, (list, tuple)) and all(isinstance(n, str) for n in policy):
        return _cp.save_only_these_names(*policy)
    raise (ValueError if isinstance(policy, str) else TypeError)(
        f"`policy` must be one of {_PER_LAYER} (other remat names: **remat_options(name)), None, "
        f"a list of checkpoint_name names or a jax.checkpoint_policies callable; got {policy!r}."
    )


def remat_options(name: str) -> dict[str, Any]:
    """Returns the :func:`remat_scan` keyword arguments for a name of :data:`REMAT`.

    Example:
        >>> from jaxga.remat import remat_options
        >>> remat_options("sqrt"), remat_options("dots")
        ({'policy': 'full', 'segments': 'sqrt'}, {'policy': 'dots', 'segments': 1})
    """
    if not isinstance(name, str) or name not in REMAT:
        raise ValueError(f"`name`={name!r} is not a remat name; expected one of {list(REMAT)}.")
    policy = next(n for n in _PER_LAYER if REMAT[n].policy is REMAT[name].policy)
    return {"policy": policy, "segments": REMAT[name].segments}


def stack_length(stacked_params: Any) -> int:
    """Returns the number of layers L: the common leading size of every leaf."""
    layers = stacked_params if isinstance(stacked_params, (list, tuple)) else ()
    kinds = {jax.tree.structure(p) for p in layers}
    if len(layers) > 1 and len(kinds) == 1 and kinds.pop().num_nodes > 1:  # per-layer trees
        raise ValueError(
            f"`stacked_params` is a {type(layers).__name__} of {len(layers)} per-layer trees; "
            f"stack them into one tree of leaves with a leading layer axis: {_STACK}."
        )
    try:
        size = leading_size(stacked_params, "stacked_params", "layer")
    except ValueError as e:
        raise ValueError(f"{e} Stack per-layer parameters with {_STACK}.") from None
    if size is None:
        raise ValueError("`stacked_params` has no array leaves; it must be a pytree of arrays.")
    return size


def resolve_segments(segments: int | str, num_layers: int) -> int:
    """Returns the number of segments: ``segments``, or for ``"sqrt"`` the divisor nearest √L."""
    divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
    if segments == "sqrt" and divisors:
        return min(divisors, key=lambda d: (abs(d - math.sqrt(num_layers)), d))
    if segments == "sqrt":
        raise ValueError("`segments`='sqrt' needs at least one layer; `stacked_params` has 0.")
    segments = positive_int(segments, "segments", "a positive int or 'sqrt'")
    if num_layers % segments:
        below, above = [d for d in divisors if d < segments], [d for d in divisors if d > segments]
        raise ValueError(
            f"`segments`={segments} does not divide the number of layers L={num_layers}; the "
            f"nearest divisors are {' and '.join(map(str, [below[-1], *above[:1]]))}."
        )
    return segments


def _same_carry(x: Any, y: Any, num_layers: int) -> Any:
    """``y``, what ``layer_fn`` returned, if it has the structure, shapes and dtypes of ``x``."""
    kind = lambda v: f"{jnp.result_type(v).name}{list(jnp.shape(v))}"
    a, b = jax.tree.map(kind, x), jax.tree.map(kind, y)
    if jax.tree.structure(a) != jax.tree.structure(b) or jax.tree.leaves(a) != jax.tree.leaves(b):
        raise TypeError(
            f"`layer_fn` must return a carry like its input, {a}; got {b}. It was given one of "
            f"the L={num_layers} slices of `stacked_params` along their leading (layer) axis."
        )
    return y


def remat_scan(
    layer_fn: Callable[[Any, Any], Any],
    stacked_params: Any,
    x: Any,
    *,
    policy: Policy = "full",
    segments: int | str = 1,
    unroll: bool = False,
) -> Any:
    """Computes ``for p in stacked_params: x = layer_fn(p, x)``, rematerialised, in a ``lax.scan``.

    Args:
        layer_fn: ``layer_fn(params_of_one_layer, x) -> x``, keeping ``x``'s shapes and dtypes.
        policy: each layer's ``jax.checkpoint`` policy, see :func:`checkpoint_policy`.
        segments: 1 (per-layer remat), a divisor s of the leading size L of ``stacked_params``
            (an outer scan over s checkpointed segments of L/s layers), or ``"sqrt"`` (s ≈ √L).
        unroll: run the layers (of a segment) without a loop; only with ``policy="none"``/None.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> w, x = jnp.full((16, 4, 4), 0.1), jnp.ones((2, 4))
        >>> jaxga.remat_scan(lambda w, x: jnp.tanh(x @ w), w, x, segments="sqrt").shape
        (2, 4)
    """
    num_layers = stack_length(stacked_params)
    save = checkpoint_policy(policy)
    num_segments = resolve_segments(segments, num_layers)
    check_arity(layer_fn, "layer_fn", 2, "layer_fn(params_of_one_layer, x) -> x")
    if check_bool(unroll, "unroll") and save is not None:  # only a loop keeps remat apart
        got = getattr(policy, "__name__", repr(policy))
        raise ValueError(f"`unroll`=True needs policy='none' or None; got policy={got}.")
    step = lambda params, carry: _same_carry(carry, layer_fn(params, carry), num_layers)
    if save is not None:  # inside a scan the loop keeps XLA from merging recomputation
        step = jax.checkpoint(step, policy=save, prevent_cse=False)
    body = lambda f: lambda carry, params: (f(params, carry), None)
    layers = lambda p, c: jax.lax.scan(body(step), c, p, unroll=unroll)[0]
    if num_segments == 1:
        return layers(stacked_params, x)
    shape = lambda p: (num_segments, num_layers // num_segments, *jnp.shape(p)[1:])
    stacked_params = jax.tree.map(lambda p: jnp.reshape(p, shape(p)), stacked_params)
    return jax.lax.scan(body(jax.checkpoint(layers, prevent_cse=False)), x, stacked_params)[0]
