"""The engine: one pass over the micro-batches in phases: prepare, scan, reduce and finish."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxga import _checks, arguments, auxiliary, collectives, meshes, modules
from jaxga._branches import when, zeros_of
from jaxga._host_stacks import is_streamed, layerwise, zeros_placed_like
from jaxga._streaming import value_and_summed_grad
from jaxga.arguments import Options
from jaxga.convolution import canonical_convolutions, rewrites
from jaxga.loss import Mean, check_value
from jaxga.microbatch import split_microbatches


class Accumulated(NamedTuple):
    """What one pass over the micro-batches produced.

    Attributes:
        mean: `Mean(Σ total, Σ count)` over micro-batches and devices.
        grads: the gradient of `mean.value`, as `jax.grad` gives it (NNX: an `nnx.State`).
        aux: the auxiliary output as [`jaxga.value_and_grad`][jaxga.value_and_grad] returns it.
        state: the `state_argnums` after the last micro-batch, or `None`.
    """

    mean: Mean
    grads: Any
    aux: Any
    state: Any


class Threaded(NamedTuple):
    """What each micro-batch hands to the next."""

    user: tuple[Any, ...]  # the values at state_argnums, in order
    modules: dict[int, Any]  # by argument position: its NNX modules' non-differentiated state


class Call(NamedTuple):
    """One call, prepared: everything the scan and the finish need besides the options."""

    args: tuple[Any, ...]  # as the caller passed them
    kwargs: dict[str, Any]
    parts: dict[int, Any]  # by argument position: the modules in it, taken apart
    primals: tuple[Any, ...]  # the differentiated values, in `argnums` order
    microbatches: tuple[Any, ...]  # the batch arguments, split: leaves [k, B // k, ...]
    rows: int  # rows of one micro-batch (of this device's, once `scan_on_axes` has opened)
    rng_argnums: tuple[int, ...]  # the PRNG key arguments, a key per micro-batch
    route: collectives.Route  # how the sums stay partial in the loop and are reduced after
    sum_dtype: Any  # the dtype loss totals and counts are summed in
    threaded: Threaded  # before the first micro-batch
    device: Any = 0  # this device's index along a manual route's axes
    opened: Any = None  # where values lie in the shard_map jaxga opened (`Opened`)


class MicroOutput(NamedTuple):
    """One micro-batch's count, aux and threaded state (the aux of its ``value_and_grad``)."""

    count: jax.Array
    aux: Any
    threaded: Threaded


class Carry(NamedTuple):
    """The scan's carry: sums so far, and the state for the next micro-batch."""

    index: jax.Array
    grads: Any
    total: jax.Array
    count: jax.Array
    threaded: Threaded


def fold_keys(tree: Any, index: Any, *, raw: bool = True) -> Any:
    """``tree`` with each PRNG key folded with ``index`` (a micro-batch's, on its device):
    typed keys, and with ``raw`` the old uint32 ones too; other leaves as they are."""
    return jax.tree.map(
        lambda x: jax.random.fold_in(x, index) if arguments.is_key(x, raw) else x, tree
    )


def prepare(options: Options, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """The prepare phase: checks a call's arguments and binds them into a `Call`."""
    rows, route = arguments.check_call(options, args, kwargs)
    parts = {
        i: modules.take_apart(arg, f"args[{i}]", options.filters.get(i))
        for i, arg in enumerate(args)
        if modules.holds_module(arg)
    }
    modules.check_unshared(parts)
    primals = tuple(modules.diff_of(parts[i]) if i in parts else args[i] for i in options.argnums)
    arguments.check_primals(primals, options.argnums)
    k = options.num_microbatches
    microbatches = tuple(
        split_microbatches(args[i], k, name=f"args[{i}]") for i in options.batch_argnums
    )
    user_state = jax.tree.map(jnp.asarray, tuple(args[i] for i in options.state_argnums))
    dtypes = [options.accumulator_dtype or jnp.float32, jnp.float32]
    call = Call(
        args=args,
        kwargs=kwargs,
        parts=parts,
        primals=primals,
        microbatches=microbatches,
        rows=rows // k,
        rng_argnums=arguments.rng_positions(options, args),
        route=route,
        sum_dtype=jnp.result_type(*dtypes, *map(_real_dtype, jax.tree.leaves(primals))),
        threaded=Threaded(user=user_state, modules=modules.rest_of(parts)),
    )
    return on_device(call, route) if route.kind == "manual" else call


def _real_dtype(x: Any) -> Any:
    """The real dtype of ``x``'s: a complex parameter's loss is real, as `jax.grad` wants."""
    return jnp.finfo(jnp.result_type(x)).dtype


def on_device(call: Call, route: collectives.Route) -> Call:
    """``call`` as one device of a manual ``route`` runs it: its index, its own NNX streams."""
    device = jax.lax.axis_index(route.axes)
    modules_state = fold_keys(call.threaded.modules, device, raw=False)
    threaded = call.threaded._replace(modules=modules_state)
    return call._replace(device=device, route=route, threaded=threaded)


def _arguments_of(
    options: Options, call: Call, primals: Any, batches: Any, threaded: Threaded, *, index: Any
) -> list[Any]:
    """``fun``'s arguments on micro-batch ``index``: ``call``'s, with ``primals``, ``batches``
    and ``threaded``'s state in their places, keys folded, modules put together."""
    given = dict(zip(options.argnums, primals))
    given |= dict(zip(options.batch_argnums, batches))
    given |= dict(zip(options.state_argnums, threaded.user))
    args = [given.get(i, arg) for i, arg in enumerate(call.args)]
    for i in call.rng_argnums:
        args[i] = fold_keys(call.args[i], call.device * options.num_microbatches + index)
    for i, parts in call.parts.items():
        diff = given[i] if i in options.argnums else None
        args[i] = modules.put_together(parts, diff, threaded.modules[i])
    return args


def micro_loss(fun: Callable[..., Any], options: Options, call: Call) -> Callable[..., Any]:
    """``fun`` on one micro-batch: ``(primals, batches, index, threaded) -> (total, micro)``."""

    if call.opened is None:  # the user's shard_map: the axes the batch is the same over
        once = collectives.rows_invariant_axes(
            call.route, [call.args[i] for i in options.batch_argnums]
        )
    else:  # jaxga's: the stage axes manual beside the batch's (a train step's pipeline_axis)
        once = tuple(axis for axis in call.opened.manual if axis not in call.route.axes)

    def loss(primals, batches, index, threaded):
        if call.opened is not None and call.opened.gather_each:  # ZeRO-3: not hoisted
            primals, batches = jax.lax.optimization_barrier((primals, batches))
            primals = collectives.all_gathered(primals, call.opened.gather)
        args = _arguments_of(options, call, primals, batches, threaded, index=index)
        try:
            with collectives.stage_axes_seen() as stage_axes:  # pipelines: counted once
                out = fun(*args, **call.kwargs)
        except Exception as e:  # often an argument of examples left whole: say which
            whole = call.rows * options.num_microbatches  # rows of an argument not split:
            if call.opened is not None:  # jaxga's shard_map passes it whole, over its devices
                whole *= collectives.axis_size(call.route)
            arguments.note_unsplit(e, fun, options, call.args, whole)
            arguments.note_host_memory(e, call.args)
            raise
        output = arguments.parse_output(out, options, threaded.user, rows=call.rows)
        module_state = {
            i: modules.new_rest(args[i], parts, options.filters.get(i))
            for i, parts in call.parts.items()
        }
        module_state = arguments.cast_like(
            module_state, threaded.modules, "left its modules", called_as=options.called_as
        )
        stage_axes += [axis for axis in once if axis not in stage_axes]
        total, count = collectives.counted_once(output.mean, stage_axes, call.route)
        count = jax.lax.stop_gradient(count.astype(call.sum_dtype))
        micro = MicroOutput(count, output.aux, Threaded(user=output.state, modules=module_state))
        return total, micro

    return loss


def micro_gradient(loss: Callable[..., Any], options: Options, call: Call) -> Callable[..., Any]:
    """``loss`` (`micro_loss`'s) differentiated, its gradient added to the sums so far
    (`_streaming.value_and_summed_grad`): in a layer scan's backward pass where it can be,
    but not in `_branches.when`'s cond (``num_real_microbatches``), where XLA would copy
    sums written in place, nor with one micro-batch and every primal on the device, where
    XLA folds the addition to zeros away."""
    on_host = any(is_streamed(x) for x in jax.tree.leaves(call.primals))
    enabled = options.num_real_microbatches is None and (options.num_microbatches > 1 or on_host)
    grad_fn = value_and_summed_grad(loss, in_backward=enabled)
    if rewrites(options.canonical_convolutions):  # XLA:CPU, see docs/gpus.md
        return canonical_convolutions(grad_fn)
    return grad_fn


def scan(loss: Callable[..., Any], options: Options, call: Call) -> tuple[Carry, Any]:
    """The scan phase: this device's sums over its micro-batches (a `Carry`), and aux `[k, ...]`."""
    grad_fn = micro_gradient(loss, options, call)

    def step(carry: Carry, batches: tuple) -> tuple[Carry, Any]:
        primals = collectives.inside_loop(call.primals, call.route)  # reduced after the loop
        (total, micro), grads = grad_fn(primals, batches, carry.index, carry.threaded, carry.grads)
        new = Carry(
            index=carry.index + 1,
            grads=grads,
            total=carry.total + total.astype(call.sum_dtype),
            count=carry.count + micro.count,
            threaded=micro.threaded,
        )
        return new, micro.aux

    def skip(types: Any, carry: Carry, batches: tuple) -> tuple[Carry, Any]:  # nothing counted
        _, aux_types = types  # the step's (Carry, aux)
        return carry._replace(index=carry.index + 1), jax.tree.map(zeros_of, aux_types)

    def body(carry: Carry, batches: tuple) -> tuple[Carry, Any]:
        if options.num_real_microbatches is None:
            return step(carry, batches)
        real = carry.index < options.num_real_microbatches
        return when(real, step, carry, batches, otherwise=skip)

    def grad_dtype(x):
        return _checks.grad_sum_dtype(options.accumulator_dtype, jnp.result_type(x))

    zero = jnp.zeros((), call.sum_dtype)
    init = Carry(
        index=jnp.zeros((), jnp.int32),
        grads=zeros_placed_like(  # each sum where its parameter lives (host memory: streamed)
            collectives.zeros_like_sums(call.primals, grad_dtype), call.primals
        ),
        total=zero,
        count=zero,
        threaded=call.threaded,
    )
    init = collectives.inside_loop(init, call.route)  # its sums stay partial over the route
    return jax.lax.scan(
        body, init, call.microbatches, length=options.num_microbatches, unroll=options.unroll
    )


def _reduce_threaded(threaded: Threaded, options: Options, call: Call) -> Threaded:
    """The threaded state replicated again over the route's axes, by `state_reduction`."""
    given = options.state_reduction

    def reduce(x: jax.Array, old: jax.Array) -> jax.Array:
        over = collectives.invariant_axes(old, call.route.axes)
        if not over:
            return x
        if given == "mean":
            return collectives.mean_over_devices(x, over, old=old)
        return given(x, over)

    def callers_key(x: Any, before: Any) -> Any:  # each device folded its index into the keys
        return before if arguments.is_key(x, raw=False) else x

    reduced = jax.tree.map(reduce, threaded, call.threaded)
    given_keys = modules.rest_of(call.parts)
    return reduced._replace(modules=jax.tree.map(callers_key, reduced.modules, given_keys))


class Sums(NamedTuple):
    """The sums over every micro-batch of every device, reduced: what the division needs."""

    grads: Any
    total: jax.Array
    count: jax.Array
    threaded: Threaded


def reduce(carry: Carry, options: Options, call: Call) -> Sums:
    """The reduce phase: the one reduction across devices, after the loop, as the call's
    route says."""
    grads = collectives.reduce_after(carry.grads, call.primals, call.route)
    total, count, threaded = carry.total, carry.count, carry.threaded
    if call.route.kind == "manual":  # else totals and counts are the whole batch's already
        total, count = jax.lax.psum((total, count), call.route.axes)
        threaded = _reduce_threaded(threaded, options, call)
    return Sums(grads=grads, total=total, count=count, threaded=threaded)


def _divided(grad: jax.Array, primal: Any, count: jax.Array) -> jax.Array:
    """A gradient sum divided by the count, in its primal's dtype."""
    return (grad / count).astype(jnp.result_type(primal))


def finish(sums: Sums, options: Options, call: Call, *, aux: Any) -> Accumulated:
    """The finish phase: one division, modules' state written back."""
    grads, total, count, threaded = sums
    bad = "Mean counts summed to {} items; expected finite and >= 0."
    valid = check_value(jnp.isfinite(count) & (count >= 0), bad, count)  # the rule: traced,
    count = jnp.where(valid, count, jnp.nan)  # a NaN count
    grads = layerwise(_divided, grads, call.primals, consts=(count,))
    modules.write_back(call.parts, threaded.modules)
    return Accumulated(
        mean=Mean(total, count),
        grads=grads[0] if options.single_argnum else grads,
        aux=aux,
        state=threaded.user[0] if options.single_state else (threaded.user or None),
    )


class Reduced(NamedTuple):
    """The scan and reduce phases' result on one route."""

    sums: Sums  # over the micro-batches, reduced once over the route's axes
    aux: Any  # combined over this device's micro-batches, as its kinds say; None without aux
    kinds: Any  # `auxiliary.kinds`' names, a tree like aux; None without aux


def scan_and_reduce(fun: Callable[..., Any], options: Options, call: Call) -> Reduced:
    """The scan and reduce phases: the sums over the micro-batches, reduced once, and aux
    combined over them (`auxiliary.combine`) as its kinds say."""
    loss = micro_loss(fun, options, call)
    with jax.named_scope("jaxga.scan"):
        carry, aux = scan(loss, options, call)
    with jax.named_scope("jaxga.reduce"):
        kinds = auxiliary.kinds(options.aux, aux, rows=call.rows) if options.has_aux else None
        aux = None if kinds is None else auxiliary.combine(aux, kinds)
        return Reduced(reduce(carry, options, call), aux, kinds)


class Given(NamedTuple):
    """What the ``shard_map`` that jaxga opens gets of a call (each part with its specs)."""

    primals: tuple[Any, ...]  # split as they lie over the manual axes
    microbatches: tuple[Any, ...]  # split over the batch's axes
    threaded: Threaded  # whole over the batch's axes, split as they lie over the stages
    arrays: list[Any]  # the array leaves of the call's other arguments and keywords: whole


class Opened(NamedTuple):
    """How the values of an opened route lie inside its ``shard_map``: specs, and its axes."""

    manual: tuple[Any, ...]  # the shard_map's axes: the batch's, and a pipeline's stages
    kept: tuple[Any, ...]  # the axes split primals stay split over (the others: gathered)
    gather_each: bool  # ZeRO-3: primals gathered in every micro-batch
    gather: Any  # over the batch's axes: what the primals are gathered along inside
    scatter: Any  # over the batch's axes: what the gradient sums are reduce-scattered along
    given: Given  # the shard_map's in specs: primals over the manual axes, state over the stages
    sums: Sums  # its out specs: the gradient sums over the manual axes, state as it came in


def opened(options: Options, call: Call) -> Opened:
    """Where each value of an opened ``call`` lies in its ``shard_map`` (`Opened`): as a
    `collectives.Placement` says, else as the values' types or NNX metadata say. Primals split
    over the batch's axes stay split there, unless the mesh has other Explicit axes (then:
    gathered on entry, all-reduced once after)."""
    placement = options.placement or collectives.Placement()
    mesh, batch_axes, stages = call.route.mesh, call.route.axes, placement.stage_axes
    manual = (*batch_axes, *stages)
    # JAX reduce-scatters beside Auto axes: split primals stay split, unless others are Explicit
    split_kept = not meshes.explicit_axes(mesh, meshes.global_axes(mesh, manual))
    kept = manual if split_kept else stages
    lies = placement.primal_specs
    lies = modules.specs_of(call.primals) if lies is None else lies
    grads = lies if placement.grad_specs is None else placement.grad_specs
    threaded = meshes.specs_over(modules.specs_of(call.threaded), stages)
    return Opened(
        manual=manual,
        kept=kept,
        gather_each=placement.gather_each,
        gather=meshes.specs_over(lies, batch_axes if split_kept else ()),
        scatter=meshes.specs_over(grads, batch_axes if split_kept else ()),
        given=Given(meshes.specs_over(lies, kept), P(None, batch_axes), threaded, arrays=P()),
        sums=Sums(meshes.specs_over(grads, kept), total=P(), count=P(), threaded=threaded),
    )


def _other_leaves(call: Call, taken: set[int]) -> tuple[list[Any], Any]:
    """The leaves of ``call``'s arguments but ``taken`` and of its keywords, and their treedef."""
    others = (tuple(None if i in taken else a for i, a in enumerate(call.args)), call.kwargs)
    return jax.tree.flatten(others)


def _array_leaves(call: Call, taken: set[int]) -> list[Any]:
    """The array leaves of ``call``'s arguments but ``taken``, and of its keywords."""
    return [x for x in _other_leaves(call, taken)[0] if _checks.is_array(x)]


def _with_array_leaves(call: Call, taken: set[int], arrays: list[Any]) -> Call:
    """``call`` with the leaves `_array_leaves` gives replaced by ``arrays``, in order."""
    leaves, treedef = _other_leaves(call, taken)
    given = iter(arrays)
    args, kwargs = jax.tree.unflatten(
        treedef, [next(given) if _checks.is_array(x) else x for x in leaves]
    )
    args = tuple(call.args[i] if i in taken else a for i, a in enumerate(args))
    return call._replace(args=args, kwargs=kwargs)


def scan_on_axes(fun: Callable[..., Any], options: Options, call: Call) -> tuple[Sums, Any]:
    """`scan_and_reduce` in the one ``shard_map`` jaxga opens over the route's axes (and a
    train step's pipeline stages), each value laid out as `opened` says: the micro-batches
    split, split primals gathered inside (`Opened.gather_each`: in every micro-batch) and
    their gradients reduce-scattered once after the loop, the rest whole. Aux as the whole
    batch gives it: a `Mean` summed, rows in order, a stacked leaf ``[devices · k, ...]``
    (docs/architecture.md, "One loop onto a mesh" and "Across devices")."""
    axes, lay = call.route.axes, opened(options, call)
    rows = call.rows // collectives.axis_size(call.route)
    taken = {*call.parts, *options.argnums, *options.batch_argnums, *options.state_argnums}
    given = Given(
        primals=collectives.whole_over(call.primals, [a for a in axes if a not in lay.kept]),
        microbatches=collectives.split_over(call.microbatches, call.route),
        threaded=collectives.whole_over(call.threaded, axes),
        arrays=collectives.whole_over(_array_leaves(call, taken), axes),
    )
    found = {}  # the aux kinds, known once the loss is traced inside

    def local(given: Given) -> tuple[Sums, Any]:
        primals = given.primals
        if not lay.gather_each:  # gathered once; summed in place where scattered after the loop
            primals = collectives.all_gathered(primals, lay.gather)
            primals = collectives.varying_where_split(primals, lay.scatter)
        here = _with_array_leaves(call, taken, given.arrays)._replace(
            primals=primals,
            opened=lay,
            microbatches=given.microbatches,
            threaded=given.threaded,
            rows=rows,
        )
        here = on_device(here, collectives.Route("manual", axes))
        reduced = scan_and_reduce(fun, options, here)
        sums, found["kinds"] = reduced.sums, reduced.kinds
        if not lay.gather_each:
            sums = sums._replace(grads=collectives.reduce_scattered(sums.grads, lay.scatter))
        return sums, auxiliary.with_device_axis(reduced.aux, reduced.kinds)

    specs = {"in_specs": (lay.given,), "out_specs": (lay.sums, P(axes))}
    try:
        mapped = jax.shard_map(local, mesh=call.route.mesh, axis_names=set(lay.manual), **specs)
        sums, aux = mapped(given)
    except Exception as e:
        if "Manual" in str(e):  # JAX's word for a loss naming the axes in its own layout
            e.add_note(_OPENED_NOTE.format(axes=axes))
        raise
    if options.placement is None or options.placement.grad_specs is None:  # as they came
        sums = sums._replace(grads=collectives.laid_out_as(sums.grads, call.primals))
    return sums, auxiliary.without_device_axis(aux, found["kinds"])


_OPENED_NOTE = (
    "jaxga: the loss ran in a shard_map over the batch's mesh axes {axes} (Manual there, so "
    "that the gradient is reduced once, after the loop). If the loss names them in its own "
    "sharding annotations, pass axis_name=() to run the loop in jit's global view instead "
    "(the train steps: reduce_once=False). Exact; JAX then reduces the gradient in every "
    "micro-batch."
)


def run(fun: Callable[..., Any], options: Options, args: tuple, kwargs: dict) -> Accumulated:
    """``fun``'s loss and gradients over the micro-batches of one call: the phases in order."""
    with jax.named_scope("jaxga.prepare"):
        arguments.check_kwargs(fun, kwargs)
        call = prepare(options, args, kwargs)
    if call.route.kind == "opened":
        sums, aux = scan_on_axes(fun, options, call)
    else:
        sums, aux, _ = scan_and_reduce(fun, options, call)
    with jax.named_scope("jaxga.finish"):
        return finish(sums, options, call, aux=aux)
