"""Rematerialised scans over stacked layers: per-layer and two-level (√L) checkpointing."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxga._checks import check_arity, leading_size, positive_int

__all__ = [
    "REMAT",
    "Remat",
    "checkpoint_policy",
    "remat_options",
    "remat_scan",
    "resolve_segments",
    "stack_length",
]

Policy = str | Sequence[str] | Callable[..., Any] | None
_STACK = "jax.tree.map(lambda *p: jnp.stack(p), *layers)"


class Remat(NamedTuple):
    """A row of :data:`REMAT`: a ``jax.checkpoint`` policy, ``segments`` and what is kept."""

    policy: Callable[..., Any] | None
    segments: int | str
    keeps: str


_cp = jax.checkpoint_policies
# The remat names, from least to most recomputation (jaxga.plan's default order).
REMAT: dict[str, Remat] = {
    "none": Remat(None, 1, "everything (no rematerialisation)"),
    "dots": Remat(_cp.dots_saveable, 1, "the outputs of matmuls and convolutions"),
    "dots_no_batch": Remat(
        _cp.dots_with_no_batch_dims_saveable, 1, "the outputs of matmuls without batch dims"
    ),
    "offload_dots": Remat(
        _cp.offload_dot_with_no_batch_dims("device", "pinned_host"), 1, "as dots_no_batch, on host"
    ),
    "full": Remat(_cp.nothing_saveable, 1, "each layer's input"),
    "sqrt": Remat(_cp.nothing_saveable, "sqrt", "the inputs of √L segments of layers"),
}


def _names(segments: int | str | None = None) -> str:
    return ", ".join(repr(n) for n, r in REMAT.items() if segments in (None, r.segments))


def checkpoint_policy(policy: Policy) -> Callable[..., Any] | None:
    """Returns the ``jax.checkpoint`` policy for a per-layer name of :data:`REMAT`.

    Args:
        policy: a name (``"none"`` or ``None``: no checkpoint), a list of
            ``checkpoint_name`` names to save, or a ``jax.checkpoint_policies`` callable.

    Example:
        >>> import jax, jaxga
        >>> jaxga.checkpoint_policy("full") is jax.checkpoint_policies.nothing_saveable
        True
    """
    row = REMAT.get(policy) if isinstance(policy, str) else None
    if policy is None or (row is not None and row.segments == 1):
        return None if row is None else row.policy
    if isinstance(policy, str):
        hint = f" (pass **remat_options({policy!r}) to remat_scan)" if row else ""
        raise ValueError(
            f"`policy`={policy!r} is not a known policy name{hint}; expected one of "
            f"{_names(segments=1)}, a list of checkpoint_name names, or a "
            f"jax.checkpoint_policies callable."
        )
    if callable(policy):
        return policy
    if isinstance(policy, (list, tuple)) and all(isinstance(n, str) for n in policy):
        return _cp.save_only_these_names(*policy)
    raise TypeError(
        f"`policy` must be a policy name, None, a list of checkpoint_name names or a "
        f"jax.checkpoint_policies callable; got {policy!r} of type {type(policy).__name__}."
    )


def remat_options(name: str) -> dict[str, Any]:
    """Returns the :func:`remat_scan` keyword arguments for a name of :data:`REMAT`.

    Example:
        >>> from jaxga.remat import remat_options
        >>> remat_options("sqrt"), remat_options("dots")
        ({'policy': 'full', 'segments': 'sqrt'}, {'policy': 'dots', 'segments': 1})
    """
    row = REMAT.get(name) if isinstance(name, str) else None
    if row is None:
        raise ValueError(f"`name`={name!r} is not a remat name; expected one of {_names()}.")
    policy = next(n for n, r in REMAT.items() if r.segments == 1 and r.policy is row.policy)
    return {"policy": policy, "segments": row.segments}


def stack_length(stacked_params: Any) -> int:
    """Returns the number of layers L: the common leading size of every leaf.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxga.remat import stack_length
        >>> stack_length({"w": jnp.zeros((6, 3, 3)), "b": jnp.zeros((6, 3))})
        6
    """
    if isinstance(stacked_params, (list, tuple)) and len(stacked_params) > 1:
        kinds = {jax.tree.structure(p) for p in stacked_params}
        if len(kinds) == 1 and jax.tree.structure(stacked_params[0]).num_nodes > 1:
            raise ValueError(
                f"`stacked_params` is a {type(stacked_params).__name__} of "
                f"{len(stacked_params)} per-layer trees; stack them into one tree whose "
                f"leaves have a leading layer axis: {_STACK}."
            )
    try:
        size = leading_size(stacked_params, "stacked_params", "layer")
    except ValueError as e:
        raise ValueError(f"{e} Stack per-layer parameters with {_STACK}.") from None
    if size is None:
        raise ValueError(
            "`stacked_params` has no array leaves; it must be a pytree of arrays that "
            "share a leading layer axis of size L."
        )
    return size


def resolve_segments(segments: int | str, num_layers: int) -> int:
    """Returns the number of segments: ``segments``, or for ``"sqrt"`` the divisor of L nearest √L.

    Example:
        >>> from jaxga.remat import resolve_segments
        >>> resolve_segments("sqrt", 64), resolve_segments("sqrt", 12)
        (8, 3)
    """
    divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
    if segments == "sqrt" and not divisors:
        raise ValueError(
            f"`segments`='sqrt' needs at least one layer; `stacked_params` has {num_layers} "
            f"(a leading layer axis of size {num_layers})."
        )
    if segments == "sqrt":
        return min(divisors, key=lambda d: (abs(d - math.sqrt(num_layers)), d))
    if isinstance(segments, str):
        raise ValueError(f"`segments` must be a positive int or 'sqrt'; got {segments!r}.")
    segments = positive_int(segments, "segments", "a positive int or 'sqrt'")
    if num_layers % segments:
        nearest = [max(d for d in divisors if d < segments)]
        nearest += [d for d in divisors if d > segments][:1]
        raise ValueError(
            f"`segments`={segments} does not divide the number of layers L={num_layers}; "
            f"the nearest divisors of {num_layers} are {' and '.join(map(str, nearest))}."
        )
    return segments


def _carry_checked(layer_fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def typed(v: Any) -> str:
        return f"{jnp.result_type(v).name}{list(jnp.shape(v))}"

    def step(params: Any, x: Any) -> Any:
        y = layer_fn(params, x)
        if jax.tree.structure(x) != jax.tree.structure(y):
            raise TypeError(
                f"`layer_fn` must return a carry with the structure of its input "
                f"{jax.tree.structure(x)}; got {jax.tree.structure(y)}."
            )
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(x)[0], jax.tree.leaves(y)):
            if typed(a) != typed(b):
                raise TypeError(
                    f"`layer_fn` changed the carry x{jax.tree_util.keystr(path)} from "
                    f"{typed(a)} to {typed(b)}; a layer must return its input's shape and dtype."
                )
        return y

    return step


def remat_scan(
    layer_fn: Callable[[Any, Any], Any],
    stacked_params: Any,
    x: Any,
    *,
    policy: Policy = "full",
    segments: int | str = 1,
) -> Any:
    """Computes ``for p in stacked_params: x = layer_fn(p, x)`` in a rematerialised ``lax.scan``.

    Args:
        layer_fn: ``layer_fn(params_of_one_layer, x) -> x``, returning ``x``'s structure,
            shapes and dtypes.
        stacked_params: a pytree of arrays sharing a leading layer axis of size L.
        x: the initial carry, an array or a pytree of arrays.
        policy: the ``jax.checkpoint`` policy of each layer, see :func:`checkpoint_policy`.
        segments: 1 (per-layer remat), a divisor s of L (an outer scan over s
            checkpointed segments of L/s layers), or ``"sqrt"`` (s nearest √L).

    Returns:
        The carry after the last layer.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> w = jnp.full((16, 4, 4), 0.1)
        >>> y = jaxga.remat_scan(lambda w, x: jnp.tanh(x @ w), w, jnp.ones((2, 4)), segments="sqrt")
        >>> y.shape
        (2, 4)
    """
    num_layers = stack_length(stacked_params)
    save = checkpoint_policy(policy)
    num_segments = resolve_segments(segments, num_layers)
    check_arity(layer_fn, "layer_fn", 2, "layer_fn(params_of_one_layer, x) -> x")
    step = _carry_checked(layer_fn)
    if save is not None:  # inside a scan the loop keeps XLA from merging recomputation
        step = jax.checkpoint(step, policy=save, prevent_cse=False)

    def scan(step: Callable[[Any, Any], Any], x: Any, stacked: Any) -> Any:
        return jax.lax.scan(lambda carry, params: (step(params, carry), None), x, stacked)[0]

    if num_segments == 1:
        return scan(step, x, stacked_params)
    segment = jax.checkpoint(lambda params, carry: scan(step, carry, params), prevent_cse=False)
    per_segment = num_layers // num_segments
    grouped = jax.tree.map(
        lambda p: jnp.reshape(p, (num_segments, per_segment, *jnp.shape(p)[1:])), stacked_params
    )
    return scan(segment, x, grouped)
