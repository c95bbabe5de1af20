"""A pipelined layer stack and its loss head together: GPipe, circular, and 1F1B, whose
forward and backward passes of different micro-batches interleave in one SPMD program."""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxga import collectives, pipeline
from jaxga._checks import check_callable
from jaxga.loss import Mean
from jaxga.microbatch import merge_microbatches, split_microbatches
from jaxga.remat import Policy

SCHEDULES = (*pipeline.SCHEDULES, "1f1b")


class Grads(NamedTuple):
    """The 1F1B loop's gradients of the loss total: what its custom VJP scales."""

    params: Any  # this stage's layers'
    head: Any
    x: Any


class Head(NamedTuple):
    """The loss head of a pipeline: ``head_fn(head_params, y, targets) -> Mean``."""

    fn: Callable[..., Any]
    stages: pipeline.Stages


def _zeros_varying(tree: Any, axis: str) -> Any:
    """Zeros like ``tree`` varying over every manual axis here: a loop carry's start."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual}
    return collectives.varying(jax.tree.map(jnp.zeros_like, tree), tuple(manual | {axis}))


def _head_total(head: Head, head_params: Any, y: Any, targets: Any) -> tuple[jax.Array, Any]:
    mean = head.fn(head_params, y, targets)
    if not isinstance(mean, Mean):
        got = type(mean).__name__
        raise TypeError(f"`head_fn` must return a jaxga.Mean (its totals are summed); got {got}.")
    return jnp.asarray(mean.total, jnp.float32), jax.lax.stop_gradient(mean.count)


def _one_f_one_b(head: Head, params: Any, head_params: Any, x: Any, targets: Any, key: Any):
    """One stage's part of 1F1B (inside a ``shard_map`` over the stage axis).

    At tick ``t`` stage ``s`` runs the forward of micro-batch ``t - s`` and the backward of
    micro-batch ``t - (2S - 2 - s)``: the last stage computes a micro-batch's loss and its
    backward in the tick its forward ends. A stage keeps the inputs of the micro-batches
    between its forward and backward, at most ``2S - 1``: a ring buffer whatever m is.
    Returns the loss's total and count, and its gradients (`Grads`).
    """
    stages, plan = head.stages, head.stages.plan
    axis, S, m = stages.axis, plan.stages, plan.microbatches
    stage, last, ring = jax.lax.axis_index(axis), S - 1, 2 * S - 1
    size = jax.tree.leaves(params)[0].shape[0]  # layers a stage
    ids = stage * size + jnp.arange(size)
    xs, ts = split_microbatches(x, m, name="x"), split_microbatches(targets, m, name="targets")
    one = _zeros_varying(pipeline.take(xs, 0), axis)

    def forward(params: Any, h: Any, key: Any) -> Any:
        return pipeline.run_stage(stages, params, ids, h, key)

    def micro_key(i: jax.Array) -> Any:
        return None if key is None else jax.random.fold_in(key, i)

    traced = {}  # the head's output types, for no_head's zeros

    def head_step(y: Any, j: jax.Array) -> tuple:
        total_of = functools.partial(_head_total, head)
        grad = jax.value_and_grad(total_of, argnums=(0, 1), has_aux=True)
        here = collectives.varying(head_params, (axis,))  # its gradient: no psum in a branch
        (total, count), (d_head, dy) = grad(here, y, pipeline.take(ts, j))
        out = collectives.varying((total, count, d_head, dy), (axis,))
        traced["head"] = jax.tree.map(jax.typeof, out)
        return out

    def no_head(y: Any, j: jax.Array) -> tuple:  # cond traces head_step first
        types = traced.get("head") or (jax.eval_shape(head_step, y, j) and traced["head"])
        return jax.tree.map(collectives.zeros_of, types)

    def backward(h: Any, dy: Any, key: Any) -> tuple:
        _, vjp = jax.vjp(lambda p, h: forward(p, h, key), params, h)
        return vjp(dy)

    def no_backward(h: Any, dy: Any, key: Any) -> tuple:  # cotangents typed as the primals
        return jax.tree.map(lambda x: collectives.zeros_of(jax.typeof(x)), (params, h))

    def tick(carry: tuple, t: jax.Array) -> tuple:
        arrived, returned, saved, sums = carry  # activations from s - 1, cotangents from s + 1
        f, b = t - stage, t - (2 * S - 2 - stage)
        f_ok, b_ok = (f >= 0) & (f < m), (b >= 0) & (b < m)
        f, b = jnp.clip(f, 0, m - 1), jnp.clip(b, 0, m - 1)
        h = pipeline.select(stage == 0, pipeline.take(xs, f), arrived)
        y = jax.lax.cond(f_ok, forward, lambda p, h, k: h, params, h, micro_key(f))
        saved = pipeline.put(saved, f % ring, h, f_ok)
        total, count, d_head, dy = jax.lax.cond(f_ok & (stage == last), head_step, no_head, y, f)
        dy = pipeline.select(stage == last, dy, returned)
        d_params, dh = jax.lax.cond(
            b_ok, backward, no_backward, pipeline.take(saved, b % ring), dy, micro_key(b)
        )
        sums = sums._replace(
            total=sums.total + total,
            count=sums.count + count,
            grads=Grads(
                params=jax.tree.map(jnp.add, sums.grads.params, d_params),
                head=jax.tree.map(jnp.add, sums.grads.head, d_head),
                x=pipeline.put(sums.grads.x, b, dh, b_ok & (stage == 0)),
            ),
        )
        arrived = jax.lax.ppermute(y, axis, [(s, s + 1) for s in range(S - 1)])
        returned = jax.lax.ppermute(dh, axis, [(s + 1, s) for s in range(S - 1)])
        return (arrived, returned, saved, sums), None

    zero = _zeros_varying(jnp.zeros((), jnp.float32), axis)
    sums = _Sums(
        total=zero,
        count=zero,
        grads=Grads(
            params=_zeros_varying(params, axis),
            head=_zeros_varying(head_params, axis),
            x=_zeros_varying(xs, axis),
        ),
    )
    saved = jax.tree.map(lambda a: jnp.broadcast_to(a, (ring, *a.shape)), one)
    carry = (one, one, saved, sums)
    (_, _, _, sums), _ = jax.lax.scan(tick, carry, jnp.arange(m + 2 * S - 2))
    grads = sums.grads._replace(x=merge_microbatches(sums.grads.x))
    total, count, head_grads, x_grads = jax.lax.psum(
        (sums.total, sums.count, grads.head, grads.x), axis
    )
    return total, count, Grads(params=grads.params, head=head_grads, x=x_grads)


class _Sums(NamedTuple):
    total: jax.Array
    count: jax.Array
    grads: Grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _interleaved(run: Callable[..., Any], params, head_params, x, targets, key) -> Mean:
    total, count, _ = run(params, head_params, x, targets, key)
    return Mean(total, count)


def _interleaved_forward(run, params, head_params, x, targets, key) -> tuple[Mean, Grads]:
    total, count, grads = run(params, head_params, x, targets, key)
    return Mean(total, count), grads


def _interleaved_backward(run, grads: Grads, cotangent: Mean) -> tuple:
    scale = cotangent.total  # the loss total is linear in each micro-batch's: grads scale

    def scaled(tree: Any) -> Any:
        return jax.tree.map(lambda g: (g * scale).astype(g.dtype), tree)

    return scaled(grads.params), scaled(grads.head), scaled(grads.x), None, None


_interleaved.defvjp(_interleaved_forward, _interleaved_backward)


def pipeline_loss(
    layer_fn: Callable[..., Any],
    head_fn: Callable[..., Any],
    stacked_params: Any,
    head_params: Any,
    x: Any,
    targets: Any,
    *,
    num_microbatches: int,
    axis_name: str = "stage",
    schedule: str = "1f1b",
    repeats: int = 1,
    policy: Policy = "full",
    rng: jax.Array | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> Mean:
    """The loss of a pipelined layer stack: ``head_fn`` on `pipeline_scan`'s output, summed.

    ``"gpipe"`` and ``"circular"`` run `pipeline_scan`, then ``head_fn`` on the whole batch.
    ``"1f1b"`` computes each micro-batch's loss on the last stage as soon as its forward
    pass ends and starts its backward pass in the same tick: stages interleave one forward
    and one backward, and each keeps at most ``2S - 1`` micro-batches' inputs, whatever m
    is. Its gradients are computed in the forward pass (a ``jax.custom_vjp`` scales them by
    the loss total's cotangent): differentiate the returned `Mean`'s total, or return it
    from a loss given to [`jaxga.value_and_grad`][jaxga.value_and_grad].

    Args:
        layer_fn: as for `pipeline_scan`.
        head_fn: ``head_fn(head_params, y, targets) -> jaxga.Mean`` on the last layer's
            output ``y`` (the head and the loss: e.g. `jaxga.token_cross_entropy`).
        stacked_params: the layers' parameters, in `pipeline_order`, laid out over the stages.
        head_params: the head's parameters (on every stage).
        x: the first layer's input, a leading batch axis.
        targets: what ``head_fn`` compares with, a leading batch axis (labels, a mask).
        num_microbatches: m, at least S, dividing the batch.
        axis_name: the mesh axis of the stages.
        schedule: ``"gpipe"``, ``"circular"`` (with ``repeats``) or ``"1f1b"``.
        repeats: as for `pipeline_scan`; 1 for ``"1f1b"``.
        policy: as for `pipeline_scan`.
        rng: as for `pipeline_scan`.
        mesh: as for `pipeline_scan`.

    Returns:
        A `jaxga.Mean`: the totals and counts of every micro-batch, summed.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
        >>> stack = jnp.full((4, 3, 3), 0.1)
        >>> w = jax.device_put(stack, jax.NamedSharding(mesh, jax.P("stage")))
        >>> def layer(w, x):
        ...     return jnp.tanh(x @ w)
        >>> def head(v, y, t):
        ...     return jaxga.Mean.of((y @ v - t) ** 2)
        >>> def total(w, v, x, t):
        ...     return jaxga.pipeline_loss(layer, head, w, v, x, t, num_microbatches=4).total
        >>> x, t, v = jnp.ones((8, 3)), jnp.zeros(8), jnp.ones(3)
        >>> grads = jax.jit(jax.grad(total))(w, v, x, t)
        >>> def plain(w, v, x, t):
        ...     return head(v, jaxga.remat_scan(layer, w, x), t).total
        >>> bool(jnp.allclose(grads, jax.grad(plain)(stack, v, x, t), rtol=1e-5))
        True
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"`schedule` must be one of {SCHEDULES}; got {schedule!r}.")
    check_callable(head_fn, "head_fn")
    options = {"num_microbatches": num_microbatches, "axis_name": axis_name, "policy": policy}
    options |= {"rng": rng, "mesh": mesh}
    if schedule != "1f1b":
        y = pipeline.pipeline_scan(
            layer_fn, stacked_params, x, schedule=schedule, repeats=repeats, **options
        )
        return _head_total_mean(head_fn, head_params, y, targets)
    if repeats != 1:
        raise ValueError(f"`repeats`={repeats} needs schedule='circular'; '1f1b' runs one chunk.")
    stages, kind, mesh = pipeline.plan_stages(layer_fn, stacked_params, **options)
    run = functools.partial(_one_f_one_b, Head(head_fn, stages))
    if kind == "opened":
        stage_axis = P(axis_name)
        grads = Grads(params=stage_axis, head=P(), x=P())
        specs = {"in_specs": (stage_axis, P(), P(), P(), P()), "out_specs": (P(), P(), grads)}
        run = jax.shard_map(run, mesh=mesh, axis_names={axis_name}, **specs)
    return _interleaved(run, stacked_params, head_params, x, targets, rng)


def _head_total_mean(head_fn: Callable[..., Any], head_params: Any, y: Any, targets: Any) -> Mean:
    mean = head_fn(head_params, y, targets)
    if not isinstance(mean, Mean):
        got = type(mean).__name__
        raise TypeError(f"`head_fn` must return a jaxga.Mean (its totals are summed); got {got}.")
    return mean
