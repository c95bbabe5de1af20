"""Pipeline schedules as data: a row of `SCHEDULES` each; `Schedule`, a row at S, m and r,
says what every stage runs at every tick; its runner, `autodiff_ticks` (JAX differentiates
the loop) or `manual_ticks` (a VJP a tick, with the loss head: a stage keeps a ring of
inputs), behind one custom VJP and ``shard_map`` (`pipelined`)."""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxga import collectives, meshes
from jaxga._branches import when
from jaxga._checks import positive_int
from jaxga._host_stacks import layerwise, zeros_placed_like
from jaxga._streaming import vjp_summed
from jaxga.convolution import with_vjp
from jaxga.loss import Mean
from jaxga.microbatch import IndivisibleBatchError, merge_microbatches, split_microbatches
from jaxga.remat import Policy, remat_scan, stack_length, streamed_window


class ScheduleRow(NamedTuple):
    """A row of `SCHEDULES`: how a schedule runs."""

    manual: bool  # backward passes in the ticks, with the loss head; else JAX's autodiff
    chunks: bool  # takes ``repeats`` r > 1: r chunks of layers a stage


SCHEDULES = {
    "gpipe": ScheduleRow(manual=False, chunks=False),
    "circular": ScheduleRow(manual=False, chunks=True),
    "1f1b": ScheduleRow(manual=True, chunks=False),
    "interleaved_1f1b": ScheduleRow(manual=True, chunks=True),
}


class Work(NamedTuple):
    """What a stage runs at a tick, forward or backward (`Schedule.forward`, `.backward`)."""

    microbatch: jax.Array
    chunk: jax.Array  # of the stage's r chunks of layers
    valid: jax.Array  # False in the bubble, where the indices still name real work
    slot: jax.Array  # where the stage keeps the work's input: its ring's entry


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline's timing: the row ``name`` of `SCHEDULES` at S ``stages``, m
    ``microbatches`` and r ``repeats`` (the chunks of layers a stage holds).

    A stage's work items go in order, ``k = 0 … m · r - 1``; item ``k`` is micro-batch
    ``k // (g · r) · g + k % g`` through chunk ``k // g % r``: micro-batches go round the
    ring in groups of ``g``: S with a manual backward (each back at stage 0 as its next
    chunk starts), else m (stage 0 keeps them until then). Stage ``s`` runs item ``t - s``
    forward at tick ``t`` and, with a manual backward, item ``t - lag - (S - 1 - s)``
    backward, chunks in reverse. Every row idles `bubble` of its time.

    Attributes:
        stages: S, the size of the stage axis.
        microbatches: m, the micro-batches streamed through the stages.
        repeats: r, the chunks of layers each stage holds (1: one).
        name: the schedule, a key of `SCHEDULES`: ``"gpipe"``, ``"circular"`` (the
            default), ``"1f1b"`` or ``"interleaved_1f1b"``.

    Examples:
        >>> from jaxga.pipeline import Schedule
        >>> plan = Schedule(4, 8, 1, "gpipe")  # S = 4 stages, m = 8 micro-batches
        >>> plan.ticks, round(plan.bubble, 3)
        (11, 0.273)
        >>> work = plan.forward(5, 2)  # stage 2 at tick 5: micro-batch 3
        >>> int(work.microbatch), int(work.chunk), bool(work.valid)
        (3, 0, True)
    """

    stages: int
    microbatches: int
    repeats: int
    name: str = "circular"

    def __post_init__(self) -> None:
        for field in ("stages", "microbatches", "repeats"):
            positive_int(getattr(self, field), field)
        if self.name not in SCHEDULES:
            raise ValueError(f"`name` must be one of {tuple(SCHEDULES)}; got {self.name!r}.")

    @property
    def manual(self) -> bool:
        """Whether the backward passes run in the ticks, or by JAX's autodiff of them."""
        return SCHEDULES[self.name].manual

    @property
    def lag(self) -> int:
        """Ticks from the last stage's first forward to its first backward: ``r · S - 1``."""
        return self.repeats * self.stages - 1 if self.manual else 0

    @property
    def ticks(self) -> int:
        """The loop's length: ``m · r + S - 1`` forward ticks, and `lag` more with a manual
        backward (its last backward passes)."""
        return self.microbatches * self.repeats + self.stages - 1 + self.lag

    @property
    def ring(self) -> int:
        """The inputs a stage keeps for its backward passes: ``2 r S - 1`` with a manual
        backward, whatever m is; every tick's otherwise."""
        return 2 * self.repeats * self.stages - 1 if self.manual else self.ticks

    @property
    def sends(self) -> list[tuple[int, int]]:
        """Each stage to the next, and the last to the first where micro-batches go round
        (r > 1: their next chunk)."""
        wrap = self.repeats > 1
        return [(s, (s + 1) % self.stages) for s in range(self.stages - 1 + wrap)]

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
        m, r = self.microbatches, self.repeats
        g = self.stages if self.manual else m
        valid = (item >= 0) & (item < m * r)
        item = jnp.clip(item, 0, m * r - 1)
        chunk = r - 1 - item // g % r if reverse else item // g % r
        microbatch = item // (g * r) * g + item % g
        slot = (microbatch // g * g * r + chunk * g + microbatch % g) % self.ring
        return Work(microbatch, chunk, valid, slot)


def take(tree: Any, index: Any) -> Any:
    """Each leaf's entry ``index`` of its leading axis (a traced index)."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False), tree)


def written(tree: Any, index: Any, value: Any, where: Any) -> Any:
    """``tree`` with entry ``index`` of its leading axis set to ``value`` where ``where``."""

    def write(x, v):
        return jax.lax.dynamic_update_index_in_dim(x, jnp.where(where, v, x[index]), index, 0)

    return jax.tree.map(write, tree, value)


def select(where: Any, a: Any, b: Any) -> Any:
    """``a`` where ``where``, else ``b``: two trees alike."""
    return jax.tree.map(functools.partial(jnp.where, where), a, b)


def split_rows(x: Any, m: int, name: str) -> Any:
    """``x``'s rows as the pipeline's m micro-batches (`split_microbatches`); an
    `IndivisibleBatchError` says that they are the pipeline's, not jaxga's accumulation's."""
    try:
        return split_microbatches(x, m, name=name)
    except IndivisibleBatchError as e:
        raise IndivisibleBatchError(f"{e} (the pipeline's micro-batches of `{name}`)") from None


class Stages(NamedTuple):
    """What every stage runs: the layers, the schedule, the stage axis, the loss head."""

    layer_fn: Callable[..., Any]  # (params, x) or, with a key, (params, x, key)
    policy: Policy
    schedule: Schedule
    axis: str
    head_fn: Callable[..., Any] | None = None  # (head_params, y, targets) -> Mean
    embed_fn: Callable[..., Any] | None = None  # (embed_params, x of a micro-batch) -> input
    stream: bool = False  # each layer fetched, its gradient added to a sum where the stack lies


class Inputs(NamedTuple):
    """A pipeline's arguments, what its custom VJP differentiates; or their cotangents."""

    params: Any  # the stack's (this stage's, inside the shard_map)
    head: Any  # the head's, or None
    x: Any
    targets: Any  # what the head compares with, or None
    key: Any  # a PRNG key or None
    embed: Any = None  # the embedding's, with `Stages.embed_fn`; else None


def _on_stages(stages: Stages, tree: Any) -> Any:
    """``tree`` varying over the stage axis: its gradient there needs no ``psum`` in a branch."""
    return collectives.varying(tree, (stages.axis,))


def run_stage(stages: Stages, params: Any, x: Any, work: Work, key: Any) -> Any:
    """A stage's chunk ``work.chunk`` of layers (``params``: all its ``[L / S, ...]``) on
    ``x``, micro-batch ``work.microbatch``: layer ``l`` gets ``fold_in(fold_in(key, i), l)``.
    A streamed stack stays whole where it lies: the chunk's layers are fetched from it."""
    schedule, stage = stages.schedule, jax.lax.axis_index(stages.axis)
    size = stack_length(params) // schedule.repeats  # layers a chunk
    at = jnp.arange(schedule.repeats * size)  # in the stage's stack: chunk c's from c · size
    ids = (at // size * schedule.stages + stage) * size + at % size  # their places in the model
    key = None if key is None else jax.random.fold_in(key, work.microbatch)

    def layer(params_and_id: tuple, x: Any) -> Any:
        params, layer_id = params_and_id
        if key is None:
            return stages.layer_fn(params, x)
        return stages.layer_fn(params, x, jax.random.fold_in(key, layer_id))

    if stages.stream:  # the chunk's layers fetched one at a time
        window = (work.chunk * size, size)
        return streamed_window(layer, (params, ids), x, policy=stages.policy, window=window)
    chunks = jax.tree.map(lambda p: jnp.reshape(p, (schedule.repeats, size, *p.shape[1:])), params)
    chunk = take((chunks, jnp.reshape(ids, (schedule.repeats, size))), work.chunk)
    return remat_scan(layer, chunk, x, policy=stages.policy)


class _AutodiffCarry(NamedTuple):
    """What `autodiff_ticks`' loop carries from tick to tick."""

    held: Any  # from the stage before: this stage's input at the next tick
    stored: Any  # stage 0's: what came round, ``[m, ...]``, kept for its next chunk; r = 1: None
    outputs: Any  # the last stage's outputs so far, ``[m, ...]``


def autodiff_ticks(stages: Stages, inputs: Inputs, *, everywhere: bool = True) -> Any:
    """One stage's part of a schedule JAX differentiates: the last stage's outputs, on
    every stage (``everywhere``: a ``psum``), else on the last stage alone (the others
    return their input ``x``: no collective but the ``ppermute``s, forward or backward).
    A bubble tick runs the layers on a real micro-batch, never on what the stage holds
    (zeros, NaN, garbage), and drops the result; not in a ``cond``, which would keep the
    weights at every tick of the backward. With r > 1, stage 0 keeps what comes round."""
    schedule, axis = stages.schedule, stages.axis
    stage, last = jax.lax.axis_index(axis), schedule.stages - 1
    xs = split_rows(inputs.x, schedule.microbatches, "x")
    zeros = _on_stages(stages, jax.tree.map(jnp.zeros_like, xs))
    run = jax.checkpoint(  # sliced inside: no weights saved a tick
        functools.partial(run_stage, stages), policy=jax.checkpoint_policies.nothing_saveable
    )

    goes_round = schedule.repeats > 1  # else nothing comes back to stage 0, nor is kept

    def tick(carry: _AutodiffCarry, t: jax.Array) -> tuple[_AutodiffCarry, None]:
        held, stored, outputs = carry
        work = schedule.forward(t, stage)
        first = take(xs, work.microbatch)
        if goes_round:
            first = select(work.chunk == 0, first, take(stored, work.microbatch))
        given = select(work.valid, select(stage == 0, first, held), take(xs, work.microbatch))
        out = run(inputs.params, given, work, inputs.key)
        done = work.valid & (stage == last) & (work.chunk == schedule.repeats - 1)
        outputs = written(outputs, work.microbatch, out, done)
        passed = jax.lax.ppermute(out, axis, schedule.sends)  # r > 1: S - 1's goes round to 0
        if goes_round:
            back = schedule.forward(t, last)  # what stage 0 got: kept for its next chunk
            stored = written(stored, back.microbatch, passed, (stage == 0) & back.valid)
        return _AutodiffCarry(passed, stored, outputs), None

    stored = zeros if goes_round else None
    carry = _AutodiffCarry(take(zeros, 0), stored, zeros if everywhere else _on_stages(stages, xs))
    outputs = jax.lax.scan(tick, carry, jnp.arange(schedule.ticks))[0].outputs
    if everywhere:
        outputs = jax.lax.psum(select(stage == last, outputs, zeros), axis)
    return merge_microbatches(outputs)


def checked_mean(head_fn: Callable[..., Any], head_params: Any, y: Any, targets: Any) -> Mean:
    """``head_fn(head_params, y, targets)``, a `Mean`, or a `TypeError` that says so."""
    mean = head_fn(head_params, y, targets)
    if not isinstance(mean, Mean):
        got = type(mean).__name__
        if hasattr(mean, "shape"):  # a traced or concrete array: a mean's .value, perhaps
            got = f"an array of shape {jnp.shape(mean)}: return the Mean itself, not its value"
        raise TypeError(f"`head_fn` must return a jaxga.Mean (its totals are summed); got {got}.")
    return mean


def _zeros_varying(tree: Any, axis: str, *, where: Any = None) -> Any:
    """Zeros like ``tree`` varying over ``axis`` and every manual axis here: a carry's start;
    each leaf in its leaf of ``where``'s memory if given (a stack in host memory made there,
    a layer at a time)."""
    manual = meshes.manual_axes(jax.sharding.get_abstract_mesh()) | {axis}
    zeros = jax.tree.map(jnp.zeros_like, tree)
    zeros = zeros if where is None else zeros_placed_like(zeros, where)
    return collectives.varying(zeros, tuple(manual))


def _head_step(stages: Stages, split: Inputs, y: Any, j: jax.Array) -> tuple:
    """Micro-batch ``j``'s loss (a `Mean`, its total and count in the dtype they are summed
    in: the total's, at least float32) and its gradients (the head's, ``y``'s)."""

    def total(head_params: Any, y: Any) -> tuple:
        mean = checked_mean(stages.head_fn, head_params, y, take(split.targets, j))
        dtype = jnp.result_type(mean.total, jnp.float32)
        return jnp.asarray(mean.total, dtype), jax.lax.stop_gradient(jnp.asarray(mean.count, dtype))

    here = _on_stages(stages, split.head)
    (total, count), grads = jax.value_and_grad(total, (0, 1), has_aux=True)(here, y)
    return _on_stages(stages, (Mean(total, count), *grads))


def _backward(stages: Stages, primals: tuple, dy: Any, work: Work, key: Any) -> tuple:
    forward = functools.partial(run_stage, stages, work=work, key=key)
    return jax.vjp(forward, *primals)[1](dy)


def _summed_backward(
    stages: Stages, primals: tuple, dy: Any, work: Work, sums: Any, *, key: Any
) -> tuple:
    """`_backward` of a streamed stack (``primals``: the stack's, the input's), its gradient
    added to ``sums`` a layer at a time where they lie, where ``work.valid``: the new sums,
    the input's gradient (zeros in a bubble). Run at every tick, a bubble's dropped by a
    select a layer at a time: a ``lax.cond`` would copy the stage's sums whole each tick."""
    forward = functools.partial(run_stage, stages, work=work, key=key)
    zeros = jax.tree.map(jnp.zeros_like, primals[1])
    return vjp_summed(forward, primals, dy, (sums, zeros), gate=work.valid)


def _stack_input(stages: Stages, split: Inputs, work: Work, where: jax.Array) -> Any:
    """Micro-batch ``work.microbatch``'s input to the stack: its rows of ``x``, or
    ``embed_fn`` of them, computed in a ``cond`` where ``where`` (stage 0, its first chunk)."""
    x = take(split.x, work.microbatch)
    if stages.embed_fn is None:
        return x
    here = _on_stages(stages, split.embed)
    return when(where & work.valid, stages.embed_fn, here, x)


def _embed_backward(stages: Stages, split: Inputs, work: Work, dh: Any) -> Any:
    """The embedding's gradient on micro-batch ``work.microbatch``, its output's ``dh``."""
    x = take(split.x, work.microbatch)

    def embedded(params: Any) -> Any:
        return stages.embed_fn(params, x)

    here = _on_stages(stages, split.embed)
    return jax.vjp(embedded, here)[1](dh)[0]


def _input_grads(stages: Stages, split: Inputs, grads: Inputs, dh: Any, work: Work) -> Inputs:
    """``grads`` with the stack input's gradient ``dh`` (micro-batch ``work.microbatch``,
    on stage 0 at its first chunk) added: to ``x``'s, or through ``embed_fn`` to its own."""
    where = work.valid & (jax.lax.axis_index(stages.axis) == 0) & (work.chunk == 0)
    if stages.embed_fn is None:
        return grads._replace(x=written(grads.x, work.microbatch, dh, where))
    backward = functools.partial(_embed_backward, stages, split)
    d_embed = when(where, backward, work, dh)
    return grads._replace(embed=jax.tree.map(jnp.add, grads.embed, d_embed))


class _TickCarry(NamedTuple):
    """What `manual_ticks`' loop carries from tick to tick (`_tick`)."""

    arrived: Any  # the activation stage s - 1 passed on
    returned: Any  # the cotangent stage s + 1 passed back
    saved: Any  # the ring of inputs kept for the backward passes, ``[ring, ...]``
    grads: Inputs  # the gradient sums so far


def _tick(stages: Stages, split: Inputs, carry: _TickCarry, t: jax.Array) -> tuple:
    """Tick ``t`` of `manual_ticks` (``split``: its inputs, in micro-batches): the forward
    and the backward the `Schedule` gives the stage, the loss head between them on the last
    stage; activations and cotangents passed on. Its output: the tick's loss (a `Mean`,
    zeros but at the head), summed after the loop in the head's dtype."""
    arrived, returned, saved, grads = carry
    schedule, s, key = stages.schedule, jax.lax.axis_index(stages.axis), split.key
    last, final = schedule.stages - 1, schedule.repeats - 1
    f, b = schedule.forward(t, s), schedule.backward(t, s)
    first = (s == 0) & (f.chunk == 0)
    h = select(first, _stack_input(stages, split, f, first), arrived)
    y = when(f.valid, functools.partial(run_stage, stages), split.params, h, f, key)
    saved = written(saved, f.slot, h, f.valid)
    at_head = f.valid & (s == last) & (f.chunk == final)
    head = functools.partial(_head_step, stages, split)
    micro_mean, d_head, dy = when(at_head, head, y, f.microbatch)
    dy = select((s == last) & (b.chunk == final), dy, returned)
    primals, backward = (split.params, take(saved, b.slot)), functools.partial(_backward, stages)
    if stages.stream:  # each layer's gradient added to its sum as the backward makes it
        sums, dh = _summed_backward(stages, primals, dy, b, grads.params, key=key)
    else:
        d_params, dh = when(b.valid, backward, primals, dy, b, key)
        sums = jax.tree.map(jnp.add, grads.params, d_params)
    grads = grads._replace(params=sums, head=jax.tree.map(jnp.add, grads.head, d_head))
    grads = _input_grads(stages, split, grads, dh, b)
    arrived = jax.lax.ppermute(y, stages.axis, schedule.sends)
    returned = jax.lax.ppermute(dh, stages.axis, [(j, i) for i, j in schedule.sends])
    return _TickCarry(arrived, returned, saved, grads), micro_mean


def manual_ticks(stages: Stages, inputs: Inputs) -> tuple[Mean, Inputs]:
    """One stage's part of a schedule whose backward passes run in its ticks (`_tick`): a
    stage keeps its inputs from forward to backward in a ring of `Schedule.ring`, whatever
    m is. Returns the loss, and its gradients (the custom VJP's residuals)."""
    schedule, axis = stages.schedule, stages.axis
    xs = split_rows(inputs.x, schedule.microbatches, "x")
    targets = split_rows(inputs.targets, schedule.microbatches, "targets")
    split = inputs._replace(x=xs, targets=targets)
    embedded = stages.embed_fn is not None  # then x's rows go in; no gradient for them
    sums = _zeros_varying(inputs.params, axis, where=inputs.params if stages.stream else None)
    grads = Inputs(
        sums,
        _zeros_varying(inputs.head, axis),
        x=None if embedded else _zeros_varying(xs, axis),
        targets=None,
        key=None,
        embed=_zeros_varying(inputs.embed, axis),
    )
    stack_input = functools.partial(_stack_input, stages, split, schedule.forward(0, 0), True)
    one = _zeros_varying(jax.eval_shape(stack_input), axis)  # one micro-batch's input
    saved = jax.tree.map(lambda a: jnp.broadcast_to(a, (schedule.ring, *a.shape)), one)
    tick, start = functools.partial(_tick, stages, split), _TickCarry(one, one, saved, grads)
    end, means = jax.lax.scan(tick, start, jnp.arange(schedule.ticks))  # a loss a tick
    grads = end.grads
    x_grads = None if embedded else merge_microbatches(grads.x)
    mean = jax.lax.psum(jax.tree.map(jnp.sum, means), axis)  # from the last stage
    summed = (grads.head, x_grads, grads.embed)  # from the last stage, or stage 0; kept
    like = (inputs.head, None if embedded else inputs.x, inputs.embed)  # where they vary
    head_grads, x_grads, embed_grads = collectives.psum_invariant(summed, like, axis)
    return mean, grads._replace(head=head_grads, x=x_grads, embed=embed_grads)


def _times(g: jax.Array, scale: jax.Array) -> jax.Array:
    """``g`` times ``scale``, in ``g``'s dtype."""
    return (g * scale).astype(g.dtype)


def _scaled(grads: Inputs, scale: jax.Array) -> tuple[Inputs]:
    """``grads`` times ``scale`` (the loss total is linear in each micro-batch's: gradients
    scale), a layer at a time for a stack in host memory."""
    return (layerwise(_times, grads, consts=(scale,)),)


def _total(scaled: Callable[..., Any], grads: Inputs, cotangent: Mean) -> tuple[Inputs]:
    """The custom VJP's backward pass: ``scaled`` by the loss total's cotangent."""
    return scaled(grads, cotangent.total)


def _keeping_inputs(run: Callable[..., Any], inputs: Inputs) -> tuple[Any, Inputs]:
    return run(inputs), inputs


def _recomputed(run: Callable[..., Any], inputs: Inputs, dy: Any) -> tuple[Inputs]:
    def of(params: Any, x: Any) -> Any:
        return run(inputs._replace(params=params, x=x))

    d_params, d_x = jax.vjp(of, inputs.params, inputs.x)[1](dy)
    return (Inputs(d_params, None, d_x, None, None),)


def pipelined(stages: Stages, route_kind: str, mesh: Any, inputs: Inputs) -> Any:
    """The pipeline on ``inputs``: its runner behind one custom VJP, in ``shard_map``s over
    the stage axis alone if ``route_kind`` (a `Route.kind`) is ``"opened"``. A manual
    backward's runner gives the gradients with the loss, which the VJP scales; an opened
    autodiff runner's backward runs the forward again in its own ``shard_map`` (JAX cannot
    yet carry a nested ``shard_map``'s residuals out of it)."""
    axis, manual = stages.axis, stages.schedule.manual
    run = functools.partial(manual_ticks if manual else autodiff_ticks, stages)
    if route_kind == "manual":  # jaxga's loop counts this loss once over the stages
        collectives.note_stage_axis(axis)
    if route_kind == "manual" and not manual:  # JAX differentiates the ticks where they are
        return run(inputs, everywhere=False)  # the output stays on the last stage
    specs = Inputs(params=P(axis), head=P(), x=P(), targets=P(), key=P(), embed=P())

    def shard(fun: Callable[..., Any], in_specs: tuple, out_specs: Any) -> Callable[..., Any]:
        if route_kind == "manual":
            return fun
        names = {"in_specs": in_specs, "out_specs": out_specs, "axis_names": {axis}}
        return jax.shard_map(fun, mesh=mesh, **names)

    if manual:  # scaled where the gradients lie, each stage its own
        scaled = functools.partial(_total, shard(_scaled, (specs, P()), (specs,)))
        return with_vjp(shard(run, (specs,), (P(), specs)), scaled)(inputs)
    forward = functools.partial(_keeping_inputs, shard(run, (specs,), P()))
    backward = shard(functools.partial(_recomputed, run), (specs, P()), (specs,))
    return with_vjp(forward, backward)(inputs)
