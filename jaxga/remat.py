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


class Remat(NamedTuple):
    """A named remat strategy of :func:`remat_scan`; the rows of :data:`REMAT`.

    Attributes:
        policy: the ``jax.checkpoint`` policy of each layer; ``None``: no checkpoint.
        segments: ``remat_scan``'s ``segments``: 1 (per-layer remat) or ``"sqrt"``.
        keeps: what the backward pass keeps of the forward pass.
    """

    policy: Callable[..., Any] | None
    segments: int | str
    keeps: str


_cp = jax.checkpoint_policies

# The remat names, from least to most recomputation: checkpoint_policy, remat_options,
# jaxga.plan's default candidates and the examples' --remat choices all come from here.
REMAT: dict[str, Remat] = {
    "none": Remat(None, 1, "everything (no rematerialisation)"),
    "dots": Remat(
        _cp.dots_saveable,
        1,
        "the outputs of matrix multiplications and convolutions; element-wise work is recomputed",
    ),
    "dots_no_batch": Remat(
        _cp.dots_with_no_batch_dims_saveable,
        1,
        "the outputs of matrix multiplications without batch dimensions; batched ones "
        "(attention scores) are recomputed too",
    ),
    "offload_dots": Remat(
        _cp.offload_dot_with_no_batch_dims("device", "pinned_host"),
        1,
        "as 'dots_no_batch', offloaded to pinned host memory where the backend has it",
    ),
    "full": Remat(_cp.nothing_saveable, 1, "each layer's input; every layer is recomputed once"),
    "sqrt": Remat(
        _cp.nothing_saveable,
        "sqrt",
        "the inputs of √L segments of layers; every layer is recomputed twice",
    ),
}


def _names(segments: int | str | None = None) -> str:
    return ", ".join(repr(n) for n, r in REMAT.items() if segments in (None, r.segments))


def checkpoint_policy(policy: Policy) -> Callable[..., Any] | None:
    """Returns the ``jax.checkpoint`` policy for a policy name, list of names or callable.

    A name is a per-layer row of :data:`REMAT` (all but ``"sqrt"``, which is
    ``policy="full"`` over √L segments); ``"none"`` gives ``None``: do not checkpoint
    at all, and ``None`` itself is taken as ``"none"``. A list (or tuple) of strings
    saves exactly the values tagged with those names by
    :func:`jax.ad_checkpoint.checkpoint_name`. A callable is taken to be a
    :data:`jax.checkpoint_policies` policy and is returned as it is.

    Example:
        >>> import jax, jaxga
        >>> jaxga.checkpoint_policy("full") is jax.checkpoint_policies.nothing_saveable
        True
        >>> jaxga.checkpoint_policy("none") is None
        True
    """
    if policy is None:
        return None
    if isinstance(policy, str):
        row = REMAT.get(policy)
        if row is not None and row.segments == 1:
            return row.policy
        hint = (
            f" ({policy!r} is not a per-layer policy: pass **remat_options({policy!r}) to "
            f"remat_scan)"
            if row is not None
            else ""
        )
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

    Use it to turn a remat name (a command-line choice, or a candidate of
    :func:`jaxga.plan`) into ``remat_scan(..., **remat_options(name))``.

    Example:
        >>> from jaxga.remat import remat_options
        >>> remat_options("sqrt"), remat_options("dots")
        ({'policy': 'full', 'segments': 'sqrt'}, {'policy': 'dots', 'segments': 1})
    """
    row = REMAT.get(name) if isinstance(name, str) else None
    if row is None:
        raise ValueError(f"`name`={name!r} is not a remat name; expected one of {_names()}.")
    # The per-layer row with the same policy names it; "sqrt" is "full" over segments.
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
    size = leading_size(stacked_params, "stacked_params", "layer")
    if size is None:
        raise ValueError(
            "`stacked_params` has no array leaves; it must be a pytree of arrays that "
            "share a leading layer axis of size L."
        )
    return size


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_segments(segments: int | str, num_layers: int) -> int:
    """Returns the number of segments for ``segments`` (an int, or ``"sqrt"``) and L layers.

    ``"sqrt"`` picks the divisor of L nearest to √L (the smaller one on a tie), which
    balances the segment inputs kept during the forward pass against the layers
    recomputed at once in the backward pass.

    Example:
        >>> from jaxga.remat import resolve_segments
        >>> resolve_segments("sqrt", 64), resolve_segments("sqrt", 12)
        (8, 3)
    """
    if isinstance(segments, str):
        if segments != "sqrt":
            raise ValueError(f"`segments` must be a positive int or 'sqrt'; got {segments!r}.")
        root = math.sqrt(num_layers)
        return min(_divisors(num_layers), key=lambda d: (abs(d - root), d))
    segments = positive_int(segments, "segments", "a positive int or 'sqrt'")
    if num_layers % segments:
        below = max(d for d in _divisors(num_layers) if d < segments)
        above = [d for d in _divisors(num_layers) if d > segments]
        nearest = f"{below} and {above[0]}" if above else f"{below}"
        raise ValueError(
            f"`segments`={segments} does not divide the number of layers L={num_layers}; "
            f"the nearest divisors of {num_layers} are {nearest}."
        )
    return segments


def _carry_checked(layer_fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def step(params: Any, x: Any) -> Any:
        y = layer_fn(params, x)
        x_struct, y_struct = jax.tree.structure(x), jax.tree.structure(y)
        if x_struct != y_struct:
            raise TypeError(
                f"`layer_fn` must return a carry with the structure of its input "
                f"{x_struct}; got {y_struct}."
            )
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(x)[0], jax.tree.leaves(y)):
            if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b):
                raise TypeError(
                    f"`layer_fn` changed the carry x{jax.tree_util.keystr(path)} from "
                    f"{jnp.result_type(a).name}{list(jnp.shape(a))} to "
                    f"{jnp.result_type(b).name}{list(jnp.shape(b))}; a layer must return "
                    f"its input's shape and dtype."
                )
        return y

    return step


def _scan_layers(step: Callable[[Any, Any], Any], x: Any, stacked_params: Any) -> Any:
    return jax.lax.scan(lambda carry, params: (step(params, carry), None), x, stacked_params)[0]


def remat_scan(
    layer_fn: Callable[[Any, Any], Any],
    stacked_params: Any,
    x: Any,
    *,
    policy: Policy = "full",
    segments: int | str = 1,
) -> Any:
    """Applies ``layer_fn`` once per stacked layer in a ``lax.scan``, rematerialised.

    Computes ``for i in range(L): x = layer_fn(params[i], x)``, where ``params[i]`` is
    the i-th slice along the leading axis of every leaf of ``stacked_params``, with the
    same result and gradients as that Python loop, but compiled once whatever L, and
    with activations recomputed in the backward pass instead of stored:

    * ``segments=1``: each layer is a ``jax.checkpoint`` with ``policy`` (per-layer
      remat): the backward pass keeps the L layer inputs, plus what ``policy`` saves,
      for at most one extra forward pass (``"full"``; less for ``"dots"``).
    * ``segments=s`` (a divisor of L): two levels. An outer scan over s segments keeps
      only the s segment inputs; in the backward pass each segment of L/s layers is
      recomputed as a whole, its layers checkpointed with ``policy``. With
      ``policy="full"`` the activation memory is O(s + L/s) layer inputs (O(√L) for
      ``"sqrt"``) for at most two extra forward passes; with ``policy="none"`` a
      segment's layers store everything while it is recomputed (Chen et al., 2016):
      one extra forward pass, and memory of s layer inputs plus L/s whole layers.
    * ``segments="sqrt"``: s is the divisor of L nearest to √L (see
      :func:`resolve_segments`).

    Random layers: put one PRNG key per layer into ``stacked_params`` (e.g.
    ``jax.random.split(key, L)``), so that recomputation draws the same numbers.

    **Flax NNX.** Create the blocks with stacked parameters, split once, merge per layer::

        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(dim, rngs=rngs)

        graphdef, params = nnx.split(make_blocks(nnx.Rngs(0)))   # leaves: [L, ...]
        y = jaxga.remat_scan(lambda p, x: nnx.merge(graphdef, p)(x), params, x)

    Inside a module, store the stacked blocks as an attribute and call
    ``nnx.split(self.blocks)`` in ``__call__``. **Flax Linen**: stack parameters with
    ``jax.vmap(block.init, in_axes=(0, None))(jax.random.split(key, L), x)`` and use
    ``lambda p, x: block.apply(p, x)`` as ``layer_fn``.

    Args:
        layer_fn: ``layer_fn(params_i, x) -> x``; must return a pytree with the
            structure, shapes and dtypes of ``x``.
        stacked_params: pytree of arrays sharing a leading layer axis of size L. A
            list of per-layer trees is not that: its arrays' own first axes would be
            scanned over. Stack it first: ``jax.tree.map(lambda *p: jnp.stack(p),
            *layers)``.
        x: the initial carry (an array or pytree of arrays).
        policy: what a layer keeps for the backward pass: ``"none"`` or ``None``
            (everything),
            ``"full"`` (nothing), ``"dots"``, ``"dots_no_batch"``, ``"offload_dots"``
            (where the backend has pinned host memory), a list of
            :func:`jax.ad_checkpoint.checkpoint_name` names to save, or any
            ``jax.checkpoint_policies`` callable. See :data:`REMAT`.
        segments: 1 (per-layer remat), a divisor s of L (two-level remat over s
            segments), or ``"sqrt"``.

    Returns:
        The carry after the last layer.

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> w = jnp.full((16, 4, 4), 0.1)
        >>> layer = lambda w, x: jnp.tanh(x @ w)
        >>> x = jnp.ones((2, 4))
        >>> y = jaxga.remat_scan(layer, w, x, segments="sqrt")
        >>> loop = x
        >>> for i in range(16):
        ...     loop = layer(w[i], loop)
        >>> bool(jnp.allclose(y, loop))
        True
    """
    num_layers = stack_length(stacked_params)
    save = checkpoint_policy(policy)
    num_segments = resolve_segments(segments, num_layers)
    check_arity(layer_fn, "layer_fn", 2, "layer_fn(params_of_one_layer, x) -> x")

    step = _carry_checked(layer_fn)
    if save is not None:
        # Inside a scan the loop itself keeps XLA from merging forward and recomputation.
        step = jax.checkpoint(step, policy=save, prevent_cse=False)
    if num_segments == 1:
        return _scan_layers(step, x, stacked_params)

    def segment(carry: Any, params: Any) -> Any:
        return _scan_layers(step, carry, params)

    segment = jax.checkpoint(segment, prevent_cse=False)
    per_segment = num_layers // num_segments
    grouped = jax.tree.map(
        lambda p: jnp.reshape(p, (num_segments, per_segment, *jnp.shape(p)[1:])), stacked_params
    )
    return jax.lax.scan(lambda carry, params: (segment(carry, params), None), x, grouped)[0]
