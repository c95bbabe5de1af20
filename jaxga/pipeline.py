"""Pipeline parallelism: a stack of layers split into stages over a mesh axis, micro-batches
streamed through them, in one SPMD program.

A schedule is a row of `SCHEDULES`; `Schedule` (the row at S, m, r) says what every stage
runs at every tick. Two runners read it: `_autodiff_ticks` (GPipe, circular: JAX
differentiates the loop) and `_manual_ticks` (1F1B, interleaved 1F1B: a VJP per tick,
with the loss head, so a stage keeps only a ring of inputs). `_open` is the one opener.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxga import collectives
from jaxga._checks import check_arity, check_callable, positive_int
from jaxga.loss import Mean
from jaxga.microbatch import IndivisibleBatchError, merge_microbatches, split_microbatches
from jaxga.remat import Policy, remat_scan, stack_length


class Kind(NamedTuple):
    """A row of `SCHEDULES`: how a schedule runs."""

    manual: bool  # `_manual_ticks`, with a loss head; else `_autodiff_ticks`
    chunks: bool  # takes ``repeats`` r > 1: r chunks of layers a stage


SCHEDULES = {
    "gpipe": Kind(manual=False, chunks=False),
    "circular": Kind(manual=False, chunks=True),
    "1f1b": Kind(manual=True, chunks=False),
    "interleaved_1f1b": Kind(manual=True, chunks=True),
}


class Work(NamedTuple):
    """What a stage runs at a tick, forward or backward (`Schedule.forward`, `.backward`)."""

    microbatch: jax.Array
    chunk: jax.Array  # of the stage's r chunks of layers
    valid: jax.Array  # False in the bubble, where the indices still name real work
    slot: jax.Array  # where the stage keeps the work's input: its ring's entry


class Schedule(NamedTuple):
    """A pipeline's timing: the row ``name`` of `SCHEDULES` at S ``stages``, m
    ``microbatches`` and r ``repeats`` (the chunks of layers a stage holds).

    A stage's work items go in order, ``k = 0 … m · r - 1``; item ``k`` is micro-batch
    ``k // (g · r) · g + k % g`` through chunk ``k // g % r``, micro-batches going round the
    ring in groups of ``g`` = `group`. Stage ``s`` runs item ``t - s`` forward at tick
    ``t`` and, with a manual backward, item ``t - lag - (S - 1 - s)`` backward, chunks in
    reverse. Every row idles `bubble` of its time.
    """

    stages: int
    microbatches: int
    repeats: int
    name: str = "circular"

    @property
    def manual(self) -> bool:
        """Whether the backward passes run inside the ticks (`_manual_ticks`)."""
        return SCHEDULES[self.name].manual

    @property
    def group(self) -> int:
        """Micro-batches going round together: S for 1F1B's (each back at stage 0 as its
        next chunk starts), m for circular's (stage 0 keeps them until then)."""
        return self.stages if self.manual else self.microbatches

    @property
    def lag(self) -> int:
        """Ticks from the last stage's first forward to its first backward: ``r · S - 1``."""
        return self.repeats * self.stages - 1 if self.manual else 0

    @property
    def ticks(self) -> int:
        return self.microbatches * self.repeats + self.stages - 1 + self.lag

    @property
    def ring(self) -> int:
        """The inputs a stage keeps for its backward passes: ``2 r S - 1`` with a manual
        backward, whatever m is; every tick's otherwise."""
        return 2 * self.repeats * self.stages - 1 if self.manual else self.ticks

    @property
    def bubble(self) -> float:
        """The fraction of each stage's time that is idle: ``(S - 1) / (m · r + S - 1)``."""
        return (self.stages - 1) / (self.microbatches * self.repeats + self.stages - 1)

    def forward(self, tick: Any, stage: Any) -> Work:
        """What ``stage`` runs forward at ``tick``: its item ``tick - stage``."""
        return self._work(tick - stage, reverse=False)

    def backward(self, tick: Any, stage: Any) -> Work:
        """What ``stage`` runs backward at ``tick`` (a manual backward's)."""
        return self._work(tick - self.lag - (self.stages - 1 - stage), reverse=True)

    def _work(self, item: Any, reverse: bool) -> Work:
        m, r, g = self.microbatches, self.repeats, self.group
        valid = (item >= 0) & (item < m * r)
        item = jnp.clip(item, 0, m * r - 1)
        chunk = item // g % r
        chunk = r - 1 - chunk if reverse else chunk
        microbatch = item // (g * r) * g + item % g
        slot = (microbatch // g * g * r + chunk * g + microbatch % g) % self.ring
        return Work(microbatch, chunk, valid, slot)


def pipeline_order(stacked_params: Any, stages: int, repeats: int = 1) -> Any:
    """The layer stack reordered so that stage ``s`` holds, contiguously, the layers it runs.

    With ``repeats`` r, layer ``l`` belongs to chunk ``l // (L / (S · r))``, and chunk ``c``
    to stage ``c % S``: stage ``s`` runs chunks ``s, s + S, ...``. Laid out over the stage
    axis (``P(axis_name)`` on the layer axis), each stage then holds its own layers: the
    weights never move. With ``repeats=1`` this is the stack as it is.

    Args:
        stacked_params: a pytree of arrays with a leading layer axis L, in layer order.
        stages: S, the size of the stage axis.
        repeats: r, the chunks each stage holds (`pipeline_scan`'s ``repeats``).

    Returns:
        The same arrays, the layer axis reordered; `pipeline_scan` reads this order.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> jaxga.pipeline_order(jnp.arange(8), stages=2, repeats=2).tolist()
        [0, 1, 4, 5, 2, 3, 6, 7]
    """
    num_layers = stack_length(stacked_params)
    _check_layers(num_layers, stages, repeats)
    layers = np.arange(num_layers).reshape(repeats, stages, -1).swapaxes(0, 1).reshape(-1)

    def reorder(p: Any) -> jax.Array:  # a gather: laid out over Explicit axes, it stays so
        where = jax.typeof(p).sharding
        explicit = AxisType.Explicit in getattr(where.mesh, "axis_types", ())
        return jnp.asarray(p).at[layers].get(out_sharding=where if explicit else None)

    return jax.tree.map(reorder, stacked_params)


def _check_layers(num_layers: int, stages: int, repeats: int) -> None:
    if num_layers % (stages * repeats):
        got = f"L={num_layers} layers for S={stages} stages × r={repeats} repeats"
        raise ValueError(f"`stacked_params` must hold a multiple of S · r layers; got {got}.")


def _stage_mesh(axis_name: str, stacked_params: Any, mesh: Any) -> tuple[str, Any]:
    """Whether the stage axis is ``"manual"`` here or to be ``"opened"``, and its mesh."""
    context = jax.sharding.get_abstract_mesh()
    if axis_name in context.axis_names:
        manual = dict(zip(context.axis_names, context.axis_types))[axis_name] == AxisType.Manual
        if manual or mesh is None:
            return ("manual" if manual else "opened"), context
    if mesh is not None:
        if axis_name not in mesh.axis_names:
            got = f"{axis_name!r} is not an axis of `mesh` {mesh.axis_names}"
            raise ValueError(f"`axis_name`={got}.")
        return "opened", mesh
    for leaf in jax.tree.leaves(stacked_params):  # Explicit axes: the type says
        typed = getattr(jax.typeof(leaf), "sharding", None)
        if axis_name in getattr(getattr(typed, "mesh", None), "axis_names", ()):
            return "opened", typed.mesh
    raise ValueError(
        f"`axis_name`={axis_name!r} is not an axis of the mesh here: lay `stacked_params` out "
        f"on a mesh with it (Explicit axes), call under jax.set_mesh(mesh), or pass `mesh`."
    )


def take(tree: Any, index: Any) -> Any:
    """Each leaf's entry ``index`` of its leading axis (a traced index)."""

    def entry(x: jax.Array) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(x, index, keepdims=False)

    return jax.tree.map(entry, tree)


def put(tree: Any, index: Any, value: Any, where: Any) -> Any:
    """``tree`` with entry ``index`` of its leading axis set to ``value`` where ``where``."""

    def put(x, v):
        return jax.lax.dynamic_update_index_in_dim(x, jnp.where(where, v, x[index]), index, 0)

    return jax.tree.map(put, tree, value)


def select(where: Any, a: Any, b: Any) -> Any:
    """``a`` where ``where``, else ``b``: two trees alike."""
    return jax.tree.map(functools.partial(jnp.where, where), a, b)


def _zeros_varying(tree: Any, axis: str) -> Any:
    """Zeros like ``tree`` varying over ``axis`` and every manual axis here: a carry's start."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual}
    return collectives.varying(jax.tree.map(jnp.zeros_like, tree), tuple(manual | {axis}))


class Stages(NamedTuple):
    """What every stage runs: the layers, the schedule, the stage axis, the loss head."""

    layer_fn: Callable[..., Any]  # (params, x) or, with a key, (params, x, key)
    policy: Policy
    schedule: Schedule
    axis: str
    head_fn: Callable[..., Any] | None = None  # (head_params, y, targets) -> Mean


class Inputs(NamedTuple):
    """A pipeline's arguments: what its custom VJP differentiates, and what it reads."""

    params: Any  # the stack's (this stage's, inside the shard_map)
    head: Any  # the head's, or None
    x: Any
    targets: Any  # what the head compares with, or None
    key: Any  # a PRNG key or None


class Grads(NamedTuple):
    """A manual backward's gradients of the loss total: what the custom VJP scales."""

    params: Any  # this stage's layers'
    head: Any
    x: Any


def run_stage(stages: Stages, params: Any, chunk: Any, x: Any, key: Any) -> Any:
    """Chunk ``chunk`` of a stage's layers (``params``: its ``[L / S, ...]``) on ``x``."""
    plan = stages.schedule
    chunks = jax.tree.map(lambda p: jnp.reshape(p, (plan.repeats, -1, *p.shape[1:])), params)
    size = jax.tree.leaves(chunks)[0].shape[1]  # layers a chunk
    first = (chunk * plan.stages + jax.lax.axis_index(stages.axis)) * size  # in the stack

    def layer(params_and_id: tuple, x: Any) -> Any:
        params, layer_id = params_and_id
        if key is None:
            return stages.layer_fn(params, x)
        return stages.layer_fn(params, x, jax.random.fold_in(key, layer_id))

    ids = first + jnp.arange(size)
    return remat_scan(layer, (take(chunks, chunk), ids), x, policy=stages.policy)


def _micro_key(key: Any, microbatch: jax.Array) -> Any:
    return None if key is None else jax.random.fold_in(key, microbatch)


def _autodiff_ticks(stages: Stages, inputs: Inputs) -> Any:
    """One stage's part of a schedule JAX differentiates (inside a ``shard_map`` over the
    stage axis): returns the last stage's outputs, on every stage.

    A bubble tick runs the layers on a real micro-batch, never on what the stage holds
    (zeros, NaN, garbage), and drops the result; not in a ``cond``, which would keep the
    weights at every tick of the backward. Stage 0 keeps what comes back round the ring.
    """
    plan, axis = stages.schedule, stages.axis
    stage, last = jax.lax.axis_index(axis), plan.stages - 1
    xs = split_rows(inputs.x, plan.microbatches, "x")
    zeros = collectives.varying(jax.tree.map(jnp.zeros_like, xs), (axis,))
    ring = [(s, (s + 1) % plan.stages) for s in range(plan.stages)]
    run = jax.checkpoint(  # sliced inside: no weights saved a tick
        functools.partial(run_stage, stages), policy=jax.checkpoint_policies.nothing_saveable
    )

    def tick(carry: tuple, t: jax.Array) -> tuple:
        held, stored, outputs = carry  # from the stage before; stage 0's to go round; results
        work = plan.forward(t, stage)
        first = select(work.chunk == 0, take(xs, work.microbatch), take(stored, work.microbatch))
        given = select(work.valid, select(stage == 0, first, held), take(xs, work.microbatch))
        out = run(inputs.params, work.chunk, given, _micro_key(inputs.key, work.microbatch))
        done = work.valid & (stage == last) & (work.chunk == plan.repeats - 1)
        outputs = put(outputs, work.microbatch, out, done)
        passed = jax.lax.ppermute(out, axis, ring)  # stage S - 1's goes round to stage 0
        back = plan.forward(t, last)  # what stage 0 got: kept for its next chunk
        stored = put(stored, back.microbatch, passed, (stage == 0) & back.valid)
        return (passed, stored, outputs), None

    carry = (take(zeros, 0), zeros, zeros)
    (_, _, outputs), _ = jax.lax.scan(tick, carry, jnp.arange(plan.ticks))
    outputs = jax.lax.psum(select(stage == last, outputs, zeros), axis)  # on every stage
    return merge_microbatches(outputs)


def _checked_mean(head_fn: Callable[..., Any], head_params: Any, y: Any, targets: Any) -> Mean:
    mean = head_fn(head_params, y, targets)
    if not isinstance(mean, Mean):
        got = type(mean).__name__
        if hasattr(mean, "shape"):  # a traced or concrete array: a mean's .value, perhaps
            got = f"an array of shape {jnp.shape(mean)}: return the Mean itself, not its value"
        raise TypeError(f"`head_fn` must return a jaxga.Mean (its totals are summed); got {got}.")
    return mean


class _Stage(NamedTuple):
    """One stage's view of a manual backward's loop: what every tick of `_tick` reads."""

    stages: Stages
    inputs: Inputs
    index: jax.Array  # the stage's, along the stage axis
    xs: Any  # the micro-batches, [m, b, ...]
    targets: Any  # [m, b, ...]
    traced: dict  # the head's output types, for `_no_head`'s zeros


class _Sums(NamedTuple):
    total: jax.Array
    count: jax.Array
    grads: Grads


def _forward(stage: _Stage, params: Any, h: Any, chunk: Any, key: Any) -> Any:
    return run_stage(stage.stages, params, chunk, h, key)


def _skip_forward(stage: _Stage, params: Any, h: Any, chunk: Any, key: Any) -> Any:
    return h


def _head_total(stage: _Stage, head_params: Any, y: Any, targets: Any) -> tuple:
    mean = _checked_mean(stage.stages.head_fn, head_params, y, targets)
    return jnp.asarray(mean.total, jnp.float32), jax.lax.stop_gradient(mean.count)


def _head_step(stage: _Stage, y: Any, j: jax.Array) -> tuple:
    """The loss total of micro-batch ``j``, its count, and its gradients (head, ``y``)."""
    axis = stage.stages.axis
    grad = jax.value_and_grad(functools.partial(_head_total, stage), (0, 1), has_aux=True)
    here = collectives.varying(stage.inputs.head, (axis,))  # its gradient: no psum in a branch
    (total, count), (d_head, dy) = grad(here, y, take(stage.targets, j))
    out = collectives.varying((total, count, d_head, dy), (axis,))
    stage.traced["head"] = jax.tree.map(jax.typeof, out)
    return out


def _no_head(stage: _Stage, y: Any, j: jax.Array) -> tuple:  # cond traces _head_step first
    if "head" not in stage.traced:
        jax.eval_shape(functools.partial(_head_step, stage), y, j)
    return jax.tree.map(collectives.zeros_of, stage.traced["head"])


def _backward(stage: _Stage, chunk: Any, h: Any, dy: Any, key: Any) -> tuple:
    forward = functools.partial(_forward, stage, chunk=chunk, key=key)
    _, vjp = jax.vjp(forward, stage.inputs.params, h)
    return vjp(dy)


def _no_backward(stage: _Stage, chunk: Any, h: Any, dy: Any, key: Any) -> tuple:
    return jax.tree.map(lambda x: collectives.zeros_of(jax.typeof(x)), (stage.inputs.params, h))


def _tick(stage: _Stage, carry: tuple, t: jax.Array) -> tuple:
    """Tick ``t``: the forward and the backward `Schedule` gives the stage, the head's
    loss between them on the last stage, what each passed on round the ring."""
    arrived, returned, saved, sums = carry  # activations from s - 1, cotangents from s + 1
    plan, axis, s, key = stage.stages.schedule, stage.stages.axis, stage.index, stage.inputs.key
    last, final = plan.stages - 1, plan.repeats - 1
    f, b = plan.forward(t, s), plan.backward(t, s)
    h = select((s == 0) & (f.chunk == 0), take(stage.xs, f.microbatch), arrived)
    run = functools.partial(_forward, stage), functools.partial(_skip_forward, stage)
    y = jax.lax.cond(f.valid, *run, stage.inputs.params, h, f.chunk, _micro_key(key, f.microbatch))
    saved = put(saved, f.slot, h, f.valid)
    head = functools.partial(_head_step, stage), functools.partial(_no_head, stage)
    total, count, d_head, dy = jax.lax.cond(
        f.valid & (s == last) & (f.chunk == final), *head, y, f.microbatch
    )
    dy = select((s == last) & (b.chunk == final), dy, returned)
    back = functools.partial(_backward, stage), functools.partial(_no_backward, stage)
    d_params, dh = jax.lax.cond(
        b.valid, *back, b.chunk, take(saved, b.slot), dy, _micro_key(key, b.microbatch)
    )
    grads = Grads(
        params=jax.tree.map(jnp.add, sums.grads.params, d_params),
        head=jax.tree.map(jnp.add, sums.grads.head, d_head),
        x=put(sums.grads.x, b.microbatch, dh, b.valid & (s == 0) & (b.chunk == 0)),
    )
    sums = _Sums(total=sums.total + total, count=sums.count + count, grads=grads)
    arrived = jax.lax.ppermute(y, axis, _sends(plan, 1))
    returned = jax.lax.ppermute(dh, axis, _sends(plan, -1))
    return (arrived, returned, saved, sums), None


def _sends(plan: Schedule, step: int) -> list[tuple[int, int]]:
    """Each stage to the next (``step`` 1) or the one before (-1); round the ring if r > 1."""
    stages = (
        range(plan.stages) if plan.repeats > 1 else range(max(0, -step), plan.stages - max(0, step))
    )
    return [(s, (s + step) % plan.stages) for s in stages]


def _manual_ticks(stages: Stages, inputs: Inputs) -> tuple[jax.Array, jax.Array, Grads]:
    """One stage's part of a schedule whose backward passes run in its ticks (inside a
    ``shard_map`` over the stage axis), `_tick` by tick: a stage keeps its inputs from
    forward to backward in a ring of `Schedule.ring`, whatever m is. Returns the loss's
    total and count, and its gradients."""
    plan, axis = stages.schedule, stages.axis
    xs = split_rows(inputs.x, plan.microbatches, "x")
    targets = split_rows(inputs.targets, plan.microbatches, "targets")
    stage = _Stage(stages, inputs, jax.lax.axis_index(axis), xs, targets, {})
    zero = _zeros_varying(jnp.zeros((), jnp.float32), axis)
    grads = Grads(*(_zeros_varying(x, axis) for x in (inputs.params, inputs.head, xs)))
    one = _zeros_varying(take(xs, 0), axis)
    saved = jax.tree.map(lambda a: jnp.broadcast_to(a, (plan.ring, *a.shape)), one)
    carry = (one, one, saved, _Sums(zero, zero, grads))
    ticks = jnp.arange(plan.ticks)
    (_, _, _, sums), _ = jax.lax.scan(functools.partial(_tick, stage), carry, ticks)
    x_grads = merge_microbatches(sums.grads.x)
    summed = jax.lax.psum((sums.total, sums.count, sums.grads.head, x_grads), axis)
    total, count, head_grads, x_grads = summed  # from the last stage, or stage 0 (x)
    return total, count, Grads(params=sums.grads.params, head=head_grads, x=x_grads)


class _Halves(NamedTuple):
    """The pipeline's custom VJP, as `_open` made it."""

    forward: Callable[..., Any]  # (inputs) -> (output, residuals)
    backward: Callable[..., Any]  # (residuals, cotangent) -> the inputs' cotangents


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pipelined(halves: _Halves, inputs: Inputs) -> Any:
    return halves.forward(inputs)[0]


def _pipelined_forward(halves: _Halves, inputs: Inputs) -> tuple:
    return halves.forward(inputs)


def _pipelined_backward(halves: _Halves, residuals: Any, cotangent: Any) -> tuple:
    return (halves.backward(residuals, cotangent),)


_pipelined.defvjp(_pipelined_forward, _pipelined_backward)


def _with_grads(run: Callable[..., Any], inputs: Inputs) -> tuple[Mean, Grads]:
    total, count, grads = run(inputs)
    return Mean(total, count), grads


def _scaled(grads: Grads, cotangent: Mean) -> Inputs:
    scale = cotangent.total  # the loss total is linear in each micro-batch's: grads scale

    def scaled(g: jax.Array) -> jax.Array:
        return (g * scale).astype(g.dtype)

    grads = jax.tree.map(scaled, grads)
    return Inputs(grads.params, grads.head, grads.x, None, None)


def _recomputed(run: Callable[..., Any], inputs: Inputs, dy: Any) -> tuple[Any, Any]:
    def of(params: Any, x: Any) -> Any:
        return run(inputs._replace(params=params, x=x))

    return jax.vjp(of, inputs.params, inputs.x)[1](dy)


def _open(stages: Stages, kind: str, mesh: Any, inputs: Inputs) -> Any:
    """The pipeline on ``inputs``: its runner, in ``shard_map``s over the stage axis alone
    if ``kind`` is ``"opened"``, behind one custom VJP.

    A manual backward's runner gives the gradients with the loss; the custom VJP scales
    them. An opened autodiff runner's backward runs the forward again inside its own
    ``shard_map``: JAX cannot yet carry a nested ``shard_map``'s residuals out of it.
    """
    axis, manual = stages.axis, stages.schedule.manual
    specs = Inputs(params=P(axis), head=P(), x=P(), targets=P(), key=P())
    run = functools.partial(_manual_ticks if manual else _autodiff_ticks, stages)
    if kind == "manual" and not manual:
        return run(inputs)  # JAX differentiates the ticks where they are

    def shard(fun: Callable[..., Any], in_specs: tuple, out_specs: Any) -> Callable[..., Any]:
        if kind == "manual":
            return fun
        return jax.shard_map(
            fun, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={axis}
        )

    if manual:
        grads = Grads(params=P(axis), head=P(), x=P())
        run = shard(run, (specs,), (P(), P(), grads))
        return _pipelined(_Halves(functools.partial(_with_grads, run), _scaled), inputs)
    forward = shard(run, (specs,), P())
    backward = shard(functools.partial(_recomputed, run), (specs, P()), (P(axis), P()))

    def halves_forward(inputs: Inputs) -> tuple:
        return forward(inputs), inputs

    def halves_backward(inputs: Inputs, dy: Any) -> Inputs:
        d_params, d_x = backward(inputs, dy)
        return Inputs(d_params, None, d_x, None, None)

    return _pipelined(_Halves(halves_forward, halves_backward), inputs)


def split_rows(x: Any, m: int, name: str) -> Any:
    """``x``'s rows as the pipeline's m micro-batches (`split_microbatches`); an
    `IndivisibleBatchError` says that they are the pipeline's, not jaxga's accumulation's."""
    try:
        return split_microbatches(x, m, name=name)
    except IndivisibleBatchError as e:
        raise IndivisibleBatchError(f"{e} (the pipeline's micro-batches of `{name}`)") from None


def _check_schedule(schedule: str, repeats: int, head: bool) -> str:
    """``schedule`` checked against `SCHEDULES` for a pipeline with a ``head`` or not."""
    names = tuple(n for n, kind in SCHEDULES.items() if head or not kind.manual)
    if schedule not in names:
        if schedule in SCHEDULES:
            raise ValueError(
                f"`schedule`={schedule!r} needs a loss head: call jaxga.pipeline_loss."
            )
        raise ValueError(f"`schedule` must be one of {names}; got {schedule!r}.")
    if repeats != 1 and not SCHEDULES[schedule].chunks:
        raise ValueError(
            f"`repeats`={repeats} needs schedule='circular'; {schedule!r} runs one chunk."
        )
    return schedule


def plan_stages(
    layer_fn: Callable[..., Any],
    stacked_params: Any,
    *,
    num_microbatches: int,
    axis_name: str,
    policy: Policy,
    rng: Any,
    mesh: Any,
    repeats: int = 1,
    schedule: str = "gpipe",
    head_fn: Callable[..., Any] | None = None,
) -> tuple[Stages, str, Any]:
    """A pipeline's arguments checked: its `Stages`, whether the stage axis is
    ``"manual"`` here or to be ``"opened"``, and the mesh."""
    repeats = positive_int(repeats, "repeats")
    _check_schedule(schedule, repeats, head_fn is not None)
    signature = "layer_fn(params_of_one_layer, x" + (", key) -> x" if rng is not None else ") -> x")
    check_arity(layer_fn, "layer_fn", 2 if rng is None else 3, signature)
    kind, mesh = _stage_mesh(axis_name, stacked_params, mesh)
    m = positive_int(num_microbatches, "num_microbatches")
    plan = Schedule(mesh.shape[axis_name], m, repeats, schedule)
    if plan.microbatches < plan.stages:
        at_least = f"at least the S={plan.stages} stages (and divide x's rows)"
        raise ValueError(f"`num_microbatches`={m}; it must be {at_least}.")
    if plan.manual and repeats > 1 and m % plan.stages:
        multiple = f"a multiple of the S={plan.stages} stages"
        got = f"{m}; {schedule!r} with repeats={repeats} takes {multiple}"
        raise ValueError(f"`num_microbatches`={got}.")
    if kind == "manual" and any(
        axis_name not in collectives.varying_axes(x) for x in jax.tree.leaves(stacked_params)
    ):
        fix = (
            f"lay the layer axis out over it: P({axis_name!r}) in your shard_map's in_specs, "
            "a train step's strategy specs, or the variables' sharding metadata"
        )
        raise ValueError(f"`stacked_params` are the same on every stage of {axis_name!r}: {fix}.")
    layers = stack_length(stacked_params) * (plan.stages if kind == "manual" else 1)  # L
    _check_layers(layers, plan.stages, repeats)
    return Stages(layer_fn, policy, plan, axis_name, head_fn), kind, mesh


def pipeline_scan(
    layer_fn: Callable[..., Any],
    stacked_params: Any,
    x: Any,
    *,
    num_microbatches: int,
    axis_name: str = "stage",
    schedule: str = "gpipe",
    repeats: int = 1,
    policy: Policy = "full",
    rng: jax.Array | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> Any:
    """``for p in stacked_params: x = layer_fn(p, x)``, its layers split into pipeline stages.

    The S devices of ``axis_name`` each run L / S of the layers (their weights never move:
    lay ``stacked_params`` out with ``P(axis_name)`` on the layer axis, in
    [`pipeline_order`][jaxga.pipeline_order]); ``x``'s rows are split into m micro-batches
    (micro-batch ``i``: rows ``i, i + m, ...``) that stream through the stages, activations
    passed on with ``ppermute``. ``"gpipe"``: each micro-batch once through S stages;
    ``"circular"``: through each stage ``repeats`` times, a chunk of layers each time, which
    shrinks the idle bubble to ``(S - 1) / (r · m + S - 1)``. Each stage's layers run as
    [`remat_scan`][jaxga.remat_scan] with ``policy``; only a stage's inputs are kept for the
    backward pass. Results and gradients are those of the layers applied in order.

    Call it in jit's global view (jaxga opens a ``shard_map`` over ``axis_name`` alone),
    inside jaxga's accumulation or ``shard_map`` over other axes, or inside your own
    ``shard_map`` over ``axis_name``.

    Args:
        layer_fn: ``layer_fn(params_of_one_layer, x) -> x``, keeping ``x``'s shapes and
            dtypes; with ``rng``, ``layer_fn(params_of_one_layer, x, key)``.
        stacked_params: the layers' parameters, a leading layer axis L, in `pipeline_order`.
        x: the carry, an array or pytree of arrays with a leading batch axis.
        num_microbatches: m, at least S, dividing the batch.
        axis_name: the mesh axis of the stages.
        schedule: ``"gpipe"`` or ``"circular"``.
        repeats: r, the chunks of layers each stage holds (``"circular"``; 1 for ``"gpipe"``).
        policy: each layer's checkpoint policy, as for `remat_scan`.
        rng: a PRNG key: layer ``l`` on micro-batch ``i`` gets ``fold_in(fold_in(rng, i), l)``.
        mesh: the mesh, if neither the context (``jax.set_mesh``) nor the params' types say.

    Returns:
        The last layer's output, like ``x``, the same on every stage.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
        >>> stack = jnp.full((4, 3, 3), 0.1)  # 4 layers, 2 on each stage
        >>> w = jax.device_put(stack, jax.NamedSharding(mesh, jax.P("stage")))
        >>> def layer(w, x):
        ...     return jnp.tanh(x @ w)
        >>> def forward(w, x):
        ...     return jaxga.pipeline_scan(layer, w, x, num_microbatches=2)
        >>> y = jax.jit(forward)(w, jnp.ones((4, 3)))
        >>> bool(jnp.allclose(y, jaxga.remat_scan(layer, stack, jnp.ones((4, 3)))))
        True
    """
    options = {"num_microbatches": num_microbatches, "axis_name": axis_name, "policy": policy}
    options |= {"schedule": schedule, "repeats": repeats, "rng": rng, "mesh": mesh}
    stages, kind, mesh = plan_stages(layer_fn, stacked_params, **options)
    return _open(stages, kind, mesh, Inputs(stacked_params, None, x, None, rng))


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
    is. ``"interleaved_1f1b"`` does so with ``repeats`` r chunks of layers a stage, as
    circular: a micro-batch goes round the stages r times, the bubble shrinks to
    ``(S - 1) / (r · m + S - 1)``, a stage keeps at most ``2 r S - 1`` chunk inputs (m a
    multiple of S). Their gradients are computed in the forward pass (a ``jax.custom_vjp``
    scales them by the loss total's cotangent): differentiate the returned `Mean`'s total,
    or return it from a loss given to [`jaxga.value_and_grad`][jaxga.value_and_grad].

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
        schedule: ``"gpipe"``, ``"circular"`` (with ``repeats``), ``"1f1b"`` or
            ``"interleaved_1f1b"`` (with ``repeats``).
        repeats: as for `pipeline_scan`; 1 for ``"gpipe"`` and ``"1f1b"``.
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
    check_callable(head_fn, "head_fn")
    if not (isinstance(params, tuple | list) and len(params) == 2):
        got = f"a {type(params).__name__}" + (
            f" of length {len(params)}" if isinstance(params, tuple | list) else ""
        )
        raise TypeError(f"`params` must be a pair (stacked_params, head_params); got {got}.")
    stacked_params, head_params = params
    options = {"num_microbatches": num_microbatches, "axis_name": axis_name, "policy": policy}
    options |= {"schedule": schedule, "repeats": repeats, "rng": rng, "mesh": mesh}
    if schedule in SCHEDULES and not SCHEDULES[schedule].manual:
        y = pipeline_scan(layer_fn, stacked_params, x, **options)
        return _checked_mean(head_fn, head_params, y, targets)
    stages, kind, mesh = plan_stages(layer_fn, stacked_params, head_fn=head_fn, **options)
    return _open(stages, kind, mesh, Inputs(stacked_params, head_params, x, targets, rng))
