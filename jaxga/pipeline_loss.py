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
from jaxga.microbatch import merge_microbatches
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


def _checked_mean(head_fn: Callable[..., Any], head_params: Any, y: Any, targets: Any) -> Mean:
    mean = head_fn(head_params, y, targets)
    if not isinstance(mean, Mean):
        got = type(mean).__name__
        if hasattr(mean, "shape"):  # a traced or concrete array: a mean's .value, perhaps
            got = f"an array of shape {jnp.shape(mean)}: return the Mean itself, not its value"
        raise TypeError(f"`head_fn` must return a jaxga.Mean (its totals are summed); got {got}.")
    return mean


def _head_total(head: Head, head_params: Any, y: Any, targets: Any) -> tuple[jax.Array, Any]:
    mean = _checked_mean(head.fn, head_params, y, targets)
    return jnp.asarray(mean.total, jnp.float32), jax.lax.stop_gradient(mean.count)


class Inputs(NamedTuple):
    """What 1F1B differentiates, and what it reads: its custom VJP's arguments."""

    params: Any  # the stack's (this stage's, inside the shard_map)
    head: Any
    x: Any
    targets: Any
    key: Any  # a PRNG key or None


class _Sums(NamedTuple):
    total: jax.Array
    count: jax.Array
    grads: Grads


class _Stage(NamedTuple):
    """One stage's view of a 1F1B loop: what every tick of `_tick` reads."""

    head: Head
    inputs: Inputs
    index: jax.Array  # the stage's, along the stage axis
    ids: jax.Array  # its layers', in the whole stack
    xs: Any  # the micro-batches, [m, b, ...]
    targets: Any  # [m, b, ...]
    traced: dict  # the head's output types, for `_no_head`'s zeros


def _micro_key(stage: _Stage, i: jax.Array) -> Any:
    key = stage.inputs.key
    return None if key is None else jax.random.fold_in(key, i)


def _forward(stage: _Stage, params: Any, h: Any, key: Any) -> Any:
    return pipeline.run_stage(stage.head.stages, params, stage.ids, h, key)


def _skip_forward(stage: _Stage, params: Any, h: Any, key: Any) -> Any:
    return h


def _head_step(stage: _Stage, y: Any, j: jax.Array) -> tuple:
    """The loss total of micro-batch ``j``, its count, and its gradients (head, ``y``)."""
    axis = stage.head.stages.axis
    total_of = functools.partial(_head_total, stage.head)
    grad = jax.value_and_grad(total_of, argnums=(0, 1), has_aux=True)
    here = collectives.varying(stage.inputs.head, (axis,))  # its gradient: no psum in a branch
    (total, count), (d_head, dy) = grad(here, y, pipeline.take(stage.targets, j))
    out = collectives.varying((total, count, d_head, dy), (axis,))
    stage.traced["head"] = jax.tree.map(jax.typeof, out)
    return out


def _no_head(stage: _Stage, y: Any, j: jax.Array) -> tuple:  # cond traces _head_step first
    if "head" not in stage.traced:
        jax.eval_shape(functools.partial(_head_step, stage), y, j)
    types = stage.traced["head"]
    return jax.tree.map(collectives.zeros_of, types)


def _backward(stage: _Stage, h: Any, dy: Any, key: Any) -> tuple:
    _, vjp = jax.vjp(functools.partial(_forward, stage, key=key), stage.inputs.params, h)
    return vjp(dy)


def _no_backward(stage: _Stage, h: Any, dy: Any, key: Any) -> tuple:  # typed as the primals
    return jax.tree.map(lambda x: collectives.zeros_of(jax.typeof(x)), (stage.inputs.params, h))


def _tick(stage: _Stage, carry: tuple, t: jax.Array) -> tuple:
    """Tick ``t``: the forward of micro-batch ``t - s``, the backward of ``t - (2S - 2 - s)``."""
    arrived, returned, saved, sums = carry  # activations from s - 1, cotangents from s + 1
    plan, axis, s = stage.head.stages.schedule, stage.head.stages.axis, stage.index
    m, last, ring = plan.microbatches, plan.stages - 1, 2 * plan.stages - 1
    f, b = t - s, t - (2 * plan.stages - 2 - s)
    f_ok, b_ok = (f >= 0) & (f < m), (b >= 0) & (b < m)
    f, b = jnp.clip(f, 0, m - 1), jnp.clip(b, 0, m - 1)
    h = pipeline.select(s == 0, pipeline.take(stage.xs, f), arrived)
    run, skip = functools.partial(_forward, stage), functools.partial(_skip_forward, stage)
    y = jax.lax.cond(f_ok, run, skip, stage.inputs.params, h, _micro_key(stage, f))
    saved = pipeline.put(saved, f % ring, h, f_ok)
    head = functools.partial(_head_step, stage), functools.partial(_no_head, stage)
    total, count, d_head, dy = jax.lax.cond(f_ok & (s == last), *head, y, f)
    dy = pipeline.select(s == last, dy, returned)
    back = functools.partial(_backward, stage), functools.partial(_no_backward, stage)
    d_params, dh = jax.lax.cond(
        b_ok, *back, pipeline.take(saved, b % ring), dy, _micro_key(stage, b)
    )
    grads = Grads(
        params=jax.tree.map(jnp.add, sums.grads.params, d_params),
        head=jax.tree.map(jnp.add, sums.grads.head, d_head),
        x=pipeline.put(sums.grads.x, b, dh, b_ok & (s == 0)),
    )
    sums = _Sums(total=sums.total + total, count=sums.count + count, grads=grads)
    arrived = jax.lax.ppermute(y, axis, [(i, i + 1) for i in range(plan.stages - 1)])
    returned = jax.lax.ppermute(dh, axis, [(i + 1, i) for i in range(plan.stages - 1)])
    return (arrived, returned, saved, sums), None


def _one_f_one_b(head: Head, inputs: Inputs) -> tuple[jax.Array, jax.Array, Grads]:
    """One stage's part of 1F1B (inside a ``shard_map`` over the stage axis).

    At tick ``t`` stage ``s`` runs the forward of micro-batch ``t - s`` and the backward of
    micro-batch ``t - (2S - 2 - s)`` (`_tick`): the last stage computes a micro-batch's
    loss and starts its backward in the tick its forward ends. A stage keeps the inputs of
    the micro-batches between their forward and backward, at most ``2S - 1``: a ring
    buffer whatever m is. Returns the loss's total and count, and its gradients.
    """
    axis, plan = head.stages.axis, head.stages.schedule
    index, m = jax.lax.axis_index(axis), plan.microbatches
    size = jax.tree.leaves(inputs.params)[0].shape[0]  # layers a stage
    xs = pipeline.split_rows(inputs.x, m, "x")
    targets = pipeline.split_rows(inputs.targets, m, "targets")
    stage = _Stage(head, inputs, index, index * size + jnp.arange(size), xs, targets, {})
    zero = _zeros_varying(jnp.zeros((), jnp.float32), axis)
    grads = Grads(*(_zeros_varying(x, axis) for x in (inputs.params, inputs.head, xs)))
    one = _zeros_varying(pipeline.take(xs, 0), axis)
    saved = jax.tree.map(lambda a: jnp.broadcast_to(a, (2 * plan.stages - 1, *a.shape)), one)
    carry = (one, one, saved, _Sums(zero, zero, grads))
    ticks = jnp.arange(m + 2 * plan.stages - 2)
    (_, _, _, sums), _ = jax.lax.scan(functools.partial(_tick, stage), carry, ticks)
    x_grads = merge_microbatches(sums.grads.x)
    summed = jax.lax.psum((sums.total, sums.count, sums.grads.head, x_grads), axis)
    total, count, head_grads, x_grads = summed  # from the last stage, or stage 0 (x)
    return total, count, Grads(params=sums.grads.params, head=head_grads, x=x_grads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _interleaved(run: Callable[[Inputs], tuple], inputs: Inputs) -> Mean:
    total, count, _ = run(inputs)
    return Mean(total, count)


def _interleaved_forward(run: Callable[[Inputs], tuple], inputs: Inputs) -> tuple[Mean, Grads]:
    total, count, grads = run(inputs)
    return Mean(total, count), grads


def _interleaved_backward(run: Callable[..., Any], grads: Grads, cotangent: Mean) -> tuple:
    scale = cotangent.total  # the loss total is linear in each micro-batch's: grads scale

    def scaled(tree: Any) -> Any:
        return jax.tree.map(lambda g: (g * scale).astype(g.dtype), tree)

    return (Inputs(scaled(grads.params), scaled(grads.head), scaled(grads.x), None, None),)


_interleaved.defvjp(_interleaved_forward, _interleaved_backward)


def pipeline_loss(
    layer_fn: Callable[..., Any],
    head_fn: Callable[..., Any],
    params: tuple[Any, Any],
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
        params: ``(stacked_params, head_params)``: the layers' parameters (in
            `pipeline_order`, laid out over the stages) and the head's (on every stage).
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
        >>> x, t, v = jnp.ones((8, 3)), jnp.zeros(8), jnp.ones(3)
        >>> def total(params):
        ...     return jaxga.pipeline_loss(layer, head, params, x, t, num_microbatches=4).total
        >>> grads, _ = jax.jit(jax.grad(total))((w, v))
        >>> def plain(w):
        ...     return head(v, jaxga.remat_scan(layer, w, x), t).total
        >>> bool(jnp.allclose(grads, jax.grad(plain)(stack), rtol=1e-5))
        True
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"`schedule` must be one of {SCHEDULES}; got {schedule!r}.")
    check_callable(head_fn, "head_fn")
    if not (isinstance(params, tuple | list) and len(params) == 2):
        got = f"a {type(params).__name__}" + (
            f" of length {len(params)}" if isinstance(params, tuple | list) else ""
        )
        raise TypeError(f"`params` must be a pair (stacked_params, head_params); got {got}.")
    stacked_params, head_params = params
    options = {"num_microbatches": num_microbatches, "axis_name": axis_name, "policy": policy}
    options |= {"rng": rng, "mesh": mesh}
    if schedule != "1f1b":
        y = pipeline.pipeline_scan(
            layer_fn, stacked_params, x, schedule=schedule, repeats=repeats, **options
        )
        return _checked_mean(head_fn, head_params, y, targets)
    if repeats != 1:
        raise ValueError(f"`repeats`={repeats} needs schedule='circular'; '1f1b' runs one chunk.")
    stages, kind, mesh = pipeline.plan_stages(layer_fn, stacked_params, **options)
    run = functools.partial(_one_f_one_b, Head(head_fn, stages))
    if kind == "opened":
        stage_axis = P(axis_name)
        inputs = Inputs(params=stage_axis, head=P(), x=P(), targets=P(), key=P())
        grads = Grads(params=stage_axis, head=P(), x=P())
        specs = {"in_specs": (inputs,), "out_specs": (P(), P(), grads)}
        run = jax.shard_map(run, mesh=mesh, axis_names={axis_name}, **specs)
    return _interleaved(run, Inputs(stacked_params, head_params, x, targets, rng))
