"""A layer scan that streams each layer's parameters from host memory (``remat_scan(stream=True)``).

The forward pass fetches each layer's slice to the device and keeps each layer's input;
the backward pass, a reverse ``lax.scan`` of its own (a ``jax.custom_vjp``), fetches each
layer again, recomputes it under its checkpoint policy, takes its ``jax.vjp`` and writes
the layer's gradient where the layer's parameters live (host memory for host-resident
leaves) as it is produced; inside a micro-batch loop (`summing_into`), added to the
gradient sum there instead. Copies between memories change no bit: the result and both
gradients equal the resident scan's. A ``window`` runs some layers of the stack alone (a
pipeline stage's chunk), and a sums' ``gate`` (a pipeline's bubble tick) leaves the sums
as they are and skips each layer of the recomputed forward pass.
"""

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import get_opaque_trace_state

from jaxga._branches import when
from jaxga._host_stacks import fetch_layer, layerwise, placed_like, write_layer


class Summing:
    """A micro-batch loop's gradient sums, to which a layer scan's backward pass adds its
    stack's gradient a layer at a time as it produces it (`summing_into`).

    A scan takes a stack's sum when the loss gives it the stack as the loss received it: the
    same traced value, at the loss's own trace (not under a `jax.vmap` or another
    transformation inside the loss, whose backward pass could run more than once), that no
    other primal is, its sum of its cotangent's type and not taken by another scan
    (`claim`). The scan's forward pass then carries the sum to its backward pass if it runs
    at the gradient's trace, and the backward pass returns the sum plus the stack's
    gradient as the stack's gradient, and says so (``added``).

    Attributes:
        treedef: the structure of the values the gradient is taken with respect to.
        sums: their gradient sums so far, leaf for leaf.
        trace: the trace the gradient is taken at (`jax.extend.core.get_opaque_trace_state`):
            where a scan's forward pass runs when it may add a sum.
        seen: the primals' leaves as the differentiated function sees them (`enter`).
        seen_trace: the differentiated function's trace, where a scan's stack is matched.
        claimed: leaf for leaf, whether a scan has taken its sum.
        added: leaf for leaf, whether a backward pass added its gradient to its sum: the
            gradient then returned for it is the new sum.
        gate: a boolean scalar: where False, the sums are left as they are (a pipeline's
            bubble tick); None: always added.

    Examples:
        >>> import jax.numpy as jnp
        >>> from jaxga._streaming import Summing
        >>> summing = Summing(jnp.ones(2), jnp.zeros(2))
        >>> summing.added_tree()
        False
    """

    def __init__(self, primals: Any, sums: Any, gate: Any = None) -> None:
        self.treedef = jax.tree.structure(primals)
        self.gate = gate
        self.sums = self.treedef.flatten_up_to(sums)
        self.trace = get_opaque_trace_state()
        self.seen: list[Any] = []
        self.seen_trace: Any = None
        self.claimed = [False] * len(self.sums)
        self.added = [False] * len(self.sums)

    def enter(self, primals: Any) -> None:
        """Records ``primals`` as the differentiated function sees them, at its trace."""
        self.seen = self.treedef.flatten_up_to(primals)
        self.seen_trace = get_opaque_trace_state()

    def position(self, leaf: Any) -> int | None:
        """The position of ``leaf``'s sum if a scan here may take it (see the class); else None."""
        if get_opaque_trace_state() != self.seen_trace:
            return None
        found = [i for i, seen in enumerate(self.seen) if seen is leaf]
        if len(found) != 1 or self.claimed[found[0]]:
            return None
        return found[0] if _same_type(self.sums[found[0]], leaf) else None

    def claim(self, stacked: Any) -> list[int | None]:
        """`position` of each leaf of ``stacked`` in turn, each sum found taken at once (a
        primal twice in one stack takes its sum once)."""
        positions = []
        for leaf in jax.tree.leaves(stacked):
            positions.append(self.position(leaf))
            if positions[-1] is not None:
                self.claimed[positions[-1]] = True
        return positions

    def added_tree(self) -> Any:
        """``added``, a tree like the primals."""
        return jax.tree.unflatten(self.treedef, self.added)


def _same_type(total: Any, leaf: Any) -> bool:
    """Whether ``total`` can stand for ``leaf``'s gradient: the shape, dtype, memory, manual
    axis type and partition spec of ``leaf``'s cotangent (a mesh that one of them leaves
    empty, as a one-device program may, matches any)."""
    a, b = jax.typeof(total), jax.typeof(leaf).to_ct_aval()
    keys = [(x.shape, x.dtype, x.memory_space, x.mat, x.sharding.spec) for x in (a, b)]
    meshes = {x.sharding.mesh for x in (a, b) if not x.sharding.mesh.empty}
    return keys[0] == keys[1] and len(meshes) < 2


_SUMMING: contextvars.ContextVar[Summing | None] = contextvars.ContextVar(
    "jaxga_summing", default=None
)


def summed_here(stacked: Any) -> bool:
    """Whether a layer scan over ``stacked`` here would add a leaf's gradient to its sum in
    its backward pass (`Summing.position`: in the differentiated function of a
    `summing_into`, on a stack as that function received it).

    Args:
        stacked: a layer scan's stack.

    Returns:
        True if the scan would take a sum for one of its leaves.

    Examples:
        >>> import jax.numpy as jnp
        >>> from jaxga._streaming import summed_here
        >>> summed_here(jnp.ones((2, 3)))  # outside a micro-batch loop
        False
    """
    summing = _SUMMING.get()
    leaves = jax.tree.leaves(stacked)
    return summing is not None and any(summing.position(x) is not None for x in leaves)


@contextlib.contextmanager
def summing_into(
    primals: Any, sums: Any, *, enabled: bool = True, gate: Any = None
) -> Iterator[Summing]:
    """While a micro-batch's gradient with respect to ``primals`` is traced: a layer scan
    (`streamed_scan`) given one of ``primals``' leaves as the differentiated function
    received it (which that function records with `Summing.enter`) adds that leaf's
    gradient to its sum in ``sums`` a layer at a time, in place, as its backward pass
    produces it, and returns the new sum as the leaf's gradient (so the micro-batch's
    gradient of a stack is never whole anywhere); `Summing` says when. Other leaves'
    gradients are returned as they are. `value_and_summed_grad` is the way to use it.

    Args:
        primals: the values the gradient is taken with respect to, as given to it.
        sums: their gradient sums so far, a tree like ``primals``.
        enabled: False: no scan adds a sum (the record says none was added).
        gate: a boolean scalar, or None (always added): where False, each scan leaves its
            sums as they are (`Summing.gate`), and its forward pass passes each layer's
            input on uncomputed: for a caller that drops the forward's value, as
            `vjp_summed` does.

    Yields:
        The `Summing` record: ``added_tree()`` says which gradients returned are new sums.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jaxga._streaming import streamed_scan, summing_into
        >>> def loss(w):
        ...     summing.enter(w)
        ...     return jnp.sum(streamed_scan(lambda w, x: x * w, w, jnp.ones(2)))
        >>> w, total = jnp.full((3, 2), 2.0), jnp.full((3, 2), 10.0)
        >>> with summing_into(w, total) as summing:
        ...     grad = jax.grad(loss)(w)
        >>> summing.added_tree(), grad[0].tolist()
        (True, [14.0, 14.0])
    """
    summing = Summing(primals, sums, gate)
    token = _SUMMING.set(summing if enabled else None)
    try:
        yield summing
    finally:
        _SUMMING.reset(token)


def _summed(total: Any, grad: Any, added: bool, gate: Any = None) -> Any:
    """``total + grad`` (a stack in host memory a layer at a time), or ``grad`` if ``added``
    already (its backward pass added ``total``); ``total`` where ``gate`` is False."""
    if added:
        return grad
    return layerwise(_plus, total, grad, consts=() if gate is None else (gate,))


def _plus(total: jax.Array, grad: jax.Array, gate: Any = None) -> jax.Array:
    """``total + grad`` in ``total``'s dtype where ``gate`` (None: always), else ``total``
    (whatever ``grad`` holds: NaN too)."""
    new = total + grad.astype(total.dtype)
    return new if gate is None else jnp.where(gate, new, total)


def value_and_summed_grad(
    fun: Callable[..., Any], *, in_backward: bool = True
) -> Callable[..., Any]:
    """``jax.value_and_grad(fun, has_aux=True)`` with respect to its first argument, the
    gradient added to sums given after ``fun``'s arguments: a layer stack's in its scan's
    backward pass (`summing_into`) if ``in_backward`` and the scan can, the rest after it.

    Args:
        fun: ``fun(primals, *args) -> (value, aux)``.
        in_backward: whether a scan may add a stack's gradient in its backward pass.

    Returns:
        ``(primals, *args, sums) -> ((value, aux), sums + gradient)``, each sum where its
        leaf of ``sums`` lives.

    Examples:
        >>> import jax.numpy as jnp
        >>> from jaxga._streaming import streamed_scan, value_and_summed_grad
        >>> def fun(w):
        ...     return jnp.sum(streamed_scan(lambda w, x: x * w, w, jnp.ones(2))), None
        >>> w, total = jnp.full((3, 2), 2.0), jnp.full((3, 2), 10.0)
        >>> (value, _), sums = value_and_summed_grad(fun)(w, total)
        >>> float(value), sums[0].tolist()
        (16.0, [14.0, 14.0])
    """

    def summed(primals: Any, *args: Any) -> tuple[Any, Any]:
        *args, sums = args
        with summing_into(primals, sums, enabled=in_backward) as summing:

            def entered(primals: Any, *args: Any) -> Any:  # the primals as ``fun`` sees them
                summing.enter(primals)
                return fun(primals, *args)

            out, grads = jax.value_and_grad(entered, has_aux=True)(primals, *args)
        return out, jax.tree.map(_summed, sums, grads, summing.added_tree())

    return summed


def vjp_summed(
    fun: Callable[..., Any], primals: tuple, cotangent: Any, sums: tuple, *, gate: Any = None
) -> tuple:
    """``jax.vjp(fun, *primals)``'s gradients for ``cotangent``, each added to its sum: a
    layer scan's stack in its backward pass, a layer at a time where the sum lies
    (`summing_into`), the rest after it.

    Args:
        fun: ``fun(*primals) -> y``.
        primals: its arguments.
        cotangent: like ``y``.
        sums: the gradient sums so far, a tuple like ``primals``.
        gate: a boolean scalar: where False, ``sums`` come back as they are (the gradients
            computed and dropped, a select a layer at a time, not a ``lax.cond``, which
            would copy each sum whole); None: always added.

    Returns:
        ``sums`` plus the gradients, a tuple like ``primals``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from jaxga._streaming import streamed_scan, vjp_summed
        >>> def fun(w, x):
        ...     return streamed_scan(lambda w, x: x * w, w, x)
        >>> w, x, total = jnp.full((3, 2), 2.0), jnp.ones(2), jnp.full((3, 2), 10.0)
        >>> sums = vjp_summed(fun, (w, x), jnp.ones(2), (total, jnp.zeros(2)))
        >>> sums[0][0].tolist(), sums[1].tolist()
        ([14.0, 14.0], [8.0, 8.0])
    """
    with summing_into(primals, sums, gate=gate) as summing:

        def entered(*primals: Any) -> Any:  # the primals as ``fun`` sees them
            summing.enter(primals)
            return fun(*primals)

        grads = jax.vjp(entered, *primals)[1](cotangent)
    summed = functools.partial(_summed, gate=gate)
    return jax.tree.map(summed, sums, grads, summing.added_tree())


def _layer_scan(
    body: Callable[..., Any], carry: Any, stacked: Any, xs: Any, first: Any, *, reverse: bool
) -> tuple[Any, Any, Any]:
    """``lax.scan`` of ``body(carry, layer, (x, index)) -> (carry, y)`` over ``stacked``'s
    layers ``xs[1]`` (consecutive indices) in order (last to first if ``reverse``), each
    layer's slice fetched to the device: one
    iteration ahead of its use, so that the copy overlaps the layer before it, if ``first``
    (the first layer's slice, already fetched) is given; where it is used if ``first`` is
    None. Returns the carry, the ``y``s and the slice fetched last (None if ``first`` is):
    the last layer's again (the first of a pass the other way) at the end of a forward
    pass, the first layer's at the end of a reverse one (fetched with no layer left to use
    it)."""
    _, indices = xs
    ahead = -1 if reverse else 1

    def scanned(state: tuple[Any, Any], slices: tuple[Any, Any]) -> tuple[Any, Any]:
        carry, layer = state
        _, index = slices
        if layer is None:  # not prefetched: fetched here, the layer waiting for its copy
            carry, y = body(carry, fetch_layer(stacked, index), slices)
            return (carry, None), y
        following = jnp.clip(index + ahead, indices[0], indices[-1])
        following = fetch_layer(stacked, following)  # in flight meanwhile
        carry, y = body(carry, layer, slices)
        return (carry, following), y

    (carry, last), ys = jax.lax.scan(scanned, (carry, first), xs, reverse=reverse)
    return carry, ys, last


def _forward(
    layer: Callable[..., Any],
    consts: Any,
    stacked: Any,
    x: Any,
    *,
    prefetch: bool,
    indices: jax.Array,
    gate: Any = None,
) -> tuple[Any, Any]:
    """The layers ``indices`` on ``x``, each fetched (ahead if ``prefetch``): the output, and
    the residuals of the backward pass (each layer's input, the last layer's slice or None).
    Where ``gate`` (a `Summing`'s) is False, each layer passes its input on, not computed."""
    run = layer if gate is None else functools.partial(when, gate, layer, otherwise=_passed)

    def body(carry: Any, params: Any, _: tuple[None, jax.Array]) -> tuple[Any, Any]:
        return run(params, carry, *consts), carry

    first = fetch_layer(stacked, indices[0]) if prefetch else None
    y, inputs, last = _layer_scan(body, x, stacked, (None, indices), first, reverse=False)
    return y, (inputs, last)


def _passed(types: Any, params: Any, x: Any, *consts: Any) -> Any:
    """A layer's input ``x`` as its output (``when``'s other branch: a skipped layer)."""
    return x


def _backward(
    layer: Callable[..., Any], taken: tuple[Any, Any], saved: Any, grad_y: Any
) -> tuple[Any, Any, Any]:
    """The reverse scan over the layers the forward pass ran: each layer fetched (ahead if
    the forward pass handed on a layer), its vjp taken, its gradient written home, or added
    to its sum where the forward pass handed on one (``taken``: the `Summing` record and
    each leaf's position in it), where the sums' gate is True. A window's float leaves all
    have sums (`_check_window_summed`); its int leaves' gradients are float0 zeros."""
    consts, stacked, (inputs, last), (sums, gate), indices = saved
    homes, treedef = jax.tree.flatten(stacked)
    some = len(indices) != homes[0].shape[0]  # some layers: each float leaf's sum taken

    # computed where ``gate`` is False too: a cond here, tried, held about a layer more
    def body(carry: tuple[Any, Any, Any], params: Any, xs: Any) -> tuple[Any, Any]:
        (grad_x, grad_consts, sums), (x, index) = carry, xs
        _, vjp = jax.vjp(layer, params, x, *consts)
        grad_params, grad_x, *grad_c = vjp(grad_x)
        grad_consts = tuple(s if s is None else s + g for s, g in zip(grad_consts, grad_c))
        grads = treedef.flatten_up_to(grad_params)
        sums = [s if s is None else _added(s, g, index, gate) for s, g in zip(sums, grads)]
        ys = [placed_like(g, h) if s is None else None for g, h, s in zip(grads, homes, sums)]
        return (grad_x, grad_consts, sums), ys

    zeros = tuple(jnp.zeros_like(c) if _inexact(c) else None for c in consts)
    xs = (inputs, indices)
    carry, ys, _ = _layer_scan(body, (grad_y, zeros, sums), stacked, xs, last, reverse=True)
    grad_x, grad_consts, sums = carry
    summing, positions = taken
    for i, total in zip(positions, sums):  # these gradients are their new sums
        if total is not None:
            summing.added[i] = True
    if some:  # an int stack's gradient (a float one's is its sum): float0 zeros
        ys = [y if y is None else np.zeros(h.shape, jax.dtypes.float0) for y, h in zip(ys, homes)]
    grads = [y if s is None else s for y, s in zip(ys, sums)]
    return grad_consts, jax.tree.unflatten(treedef, grads), grad_x


def _added(total: jax.Array, grad: jax.Array, index: Any, gate: Any) -> jax.Array:
    """``total`` with ``grad`` added to its layer ``index``, where ``total`` lies (in place),
    where ``gate`` (None: always). ``grad`` is rounded alone first, as the loop rounds it:
    no matrix product fused with the addition."""
    grad = jax.lax.optimization_barrier(grad)
    return write_layer(total, _plus(fetch_layer(total, index), grad, gate), index)


def _taken_sums(taken: tuple[Any, Any]) -> tuple[list[Any], Any]:
    """The sums a scan's forward pass hands to its backward pass, and their gate: those
    ``taken`` (the `Summing` record and each leaf's position) if it runs at the gradient's
    trace, else none (the loop adds them)."""
    summing, positions = taken
    if summing is None or get_opaque_trace_state() != summing.trace:
        return [None] * len(positions), None
    return [None if i is None else summing.sums[i] for i in positions], summing.gate


def _inexact(x: Any) -> bool:  # a value with a gradient (an int or a key has none)
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def streamed_scan(
    layer: Callable[..., Any],
    stacked: Any,
    x: Any,
    *,
    prefetch: bool = True,
    window: tuple[Any, int] | None = None,
) -> Any:
    """``for p in stacked: x = layer(p, x)``, each layer's slice fetched to the device in the
    forward and the backward pass, its gradient written where ``stacked``'s leaf lives.

    Args:
        layer: ``layer(params_of_one_layer, x) -> x``, checkpointed as the caller wants.
        stacked: the layers' parameters, leading axis L; leaves on the device or in host memory.
        x: the carry.
        prefetch: fetch each layer one iteration ahead of its use (the copy overlaps the
            layer before it; two layers on the device, one more moved a pass forward and
            back), or where it is used.
        window: ``(start, size)``: run layers ``start`` to ``start + size - 1`` alone (a
            pipeline stage's chunk; a traced ``start`` is clamped into the stack, as
            slicing clamps); differentiated, inside a loop whose sums take the stack's
            gradient (`vjp_summed`); None: every layer.

    Returns:
        The last layer's output, like ``x``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from jaxga._streaming import streamed_scan
        >>> streamed_scan(lambda w, x: x * w, jnp.full((3, 2), 2.0), jnp.ones(2)).tolist()
        [8.0, 8.0]
    """
    one = fetch_layer(stacked, 0)  # a layer's slice, for tracing
    converted, consts = jax.closure_convert(layer, one, x)  # closed-over values differentiated too
    leaves = jax.tree.leaves(stacked)
    indices = _window_indices(window, leaves[0].shape[0])
    forward = functools.partial(_forward, converted, prefetch=prefetch, indices=indices)

    @jax.custom_vjp
    def run(consts: tuple[Any, ...], stacked: Any, x: Any) -> Any:
        return forward(consts, stacked, x)[0]

    summing = _SUMMING.get()  # the sums of a micro-batch loop, taken here, at the loss's trace
    positions = summing.claim(stacked) if summing else [None] * len(leaves)
    taken = (summing, positions)

    def run_forward(consts: tuple[Any, ...], stacked: Any, x: Any) -> tuple[Any, Any]:
        sums, gate = _taken_sums(taken)
        if len(indices) < leaves[0].shape[0]:  # some layers: their gradient added to sums
            _check_window_summed(window, leaves, sums)
        y, residuals = forward(consts, stacked, x, gate=gate)
        return y, (consts, stacked, residuals, (sums, gate), indices)

    run.defvjp(run_forward, functools.partial(_backward, converted, taken))
    return run(tuple(consts), stacked, x)


def _window_indices(window: tuple[Any, int] | None, layers: int) -> jax.Array:
    """The indices of `streamed_scan`'s ``window`` in a stack of ``layers``, or a
    `ValueError` naming it; a start given as an array (traced) is clamped into the stack, as
    slicing clamps; one given as an int is checked."""
    if window is None:
        return jnp.arange(layers)
    start, size = window
    fits = isinstance(size, int | np.integer) and not isinstance(size, bool)
    fits = fits and 0 < size <= layers and jnp.issubdtype(jnp.result_type(start), jnp.integer)
    if fits and isinstance(start, int | np.integer):  # else an array, maybe traced
        fits = 0 <= start <= layers - size
    if not fits:
        got = f"`window`={window!r} for a stack of {layers} layers"
        want = f"(start, size): ints, 0 < size, 0 <= start, start + size <= {layers}"
        raise ValueError(f"{got}; expected {want}.")
    return jnp.clip(start, 0, layers - size) + jnp.arange(size)


def _check_window_summed(window: tuple[Any, int], stacked: list[Any], sums: list[Any]) -> None:
    """Raises unless a loop's sums take the gradient of each float leaf of a window's stack
    (``stacked``'s leaves): a pipeline's do; its whole gradient would be made elsewhere."""
    for leaf, total in zip(stacked, sums):
        if total is None and _inexact(leaf):
            got = f"`window`={window!r}: a gradient of some layers of a stack"
            want = "a loop's sums to add them to (vjp_summed, summing_into: a pipeline's)"
            raise ValueError(f"{got}, taken outside one; expected {want}.")
