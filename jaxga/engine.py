"""The engine: one pass over the micro-batches, in three phases.

``prepare`` binds and checks a call's arguments into a [`Call`]: modules taken apart, the
batch split, what each micro-batch's keys fold in. ``scan`` runs ``value_and_grad`` of the
loss on each micro-batch in one ``lax.scan`` whose [`Carry`] sums gradients, loss totals and
counts and threads state. ``finish`` reduces the sums across devices once, divides once, and
puts the modules' new state back. Everything public that accumulates runs through [`run`].
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxga import _checks, arguments, collectives, modules
from jaxga.arguments import Options
from jaxga.loss import Mean
from jaxga.microbatch import IndivisibleBatchError, merge_microbatches, split_microbatches


class Accumulated(NamedTuple):
    """What one pass over the micro-batches produced.

    Attributes:
        mean: `Mean(Σ total, Σ count)` over micro-batches and devices.
        grads: the gradient of `mean.value`, as `jax.grad` gives it (NNX: an `nnx.State`).
        aux: the auxiliary output as [`jaxga.value_and_grad`][jaxga.value_and_grad] returns
            it, or `None`.
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
    rows: int  # rows of one micro-batch (on this device)
    rng_argnums: tuple[int, ...]  # the PRNG key arguments, a key per micro-batch
    device: Any  # this device's index along `axis_name`; 0 without one
    sum_dtype: Any  # the dtype loss totals and counts are summed in
    threaded: Threaded  # before the first micro-batch


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


class Sums(NamedTuple):
    """What the scan leaves: sums over this device's micro-batches, and aux per micro-batch."""

    grads: Any
    total: jax.Array
    count: jax.Array
    threaded: Threaded
    aux: Any  # leaves [k, ...]


def fold_keys(tree: Any, index: Any, *, raw: bool = True) -> Any:
    """``tree`` with each PRNG key ``fold_in(key, index)`` (``raw``: ``uint32[2]`` ones too)."""

    def fold(x):
        return jax.random.fold_in(x, index) if arguments.is_key(x, raw) else x

    return jax.tree.map(fold, tree)


# -- prepare ------------------------------------------------------------------------------


def _local_rows(options: Options, args: tuple[Any, ...]) -> int:
    """This device's batch rows, checked to split into the micro-batches."""
    batches = [args[i] for i in options.batch_argnums]
    rows = next((jnp.shape(x)[0] for x in jax.tree.leaves(batches)), 0)
    k, axis = options.num_microbatches, options.axis_name
    if axis is not None and rows % k:  # name the global batch
        devices = jax.lax.axis_size(axis)
        raise IndivisibleBatchError.of(rows * devices, k, devices, axis)
    return rows


def prepare(options: Options, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """Checks a call's arguments and binds them into a [`Call`]."""
    arguments.check_call(options, args, kwargs)
    parts = {
        i: modules.take_apart(arg, f"args[{i}]", options.filters.get(i))
        for i, arg in enumerate(args)
        if modules.holds_module(arg)
    }
    modules.check_unshared(parts)
    primals = tuple(modules.diff_of(parts[i]) if i in parts else args[i] for i in options.argnums)
    arguments.check_primals(primals, options.argnums)
    rows = _local_rows(options, args)
    k = options.num_microbatches
    microbatches = tuple(
        split_microbatches(args[i], k, name=f"args[{i}]") for i in options.batch_argnums
    )
    device = 0 if options.axis_name is None else jax.lax.axis_index(options.axis_name)
    module_state = modules.rest_of(parts)
    if options.axis_name is not None:  # NNX Rngs: a stream of their own on each device
        module_state = fold_keys(module_state, device, raw=False)
    user_state = jax.tree.map(jnp.asarray, tuple(args[i] for i in options.state_argnums))
    dtypes = [options.accumulator_dtype or jnp.float32, jnp.float32]
    return Call(
        args=args,
        kwargs=kwargs,
        parts=parts,
        primals=primals,
        microbatches=microbatches,
        rows=rows // k,
        rng_argnums=arguments.rng_positions(options, args),
        device=device,
        sum_dtype=jnp.result_type(*dtypes, *jax.tree.leaves(primals)),
        threaded=Threaded(user=user_state, modules=module_state),
    )


# -- scan -----------------------------------------------------------------------------------


def _bind(
    options: Options, call: Call, primals: tuple, batches: tuple, *, index: Any, threaded: Threaded
) -> list[Any]:
    """The arguments of ``fun``'s call on micro-batch ``index``."""
    given = dict(zip(options.argnums, primals))
    given |= dict(zip(options.batch_argnums, batches))
    given |= dict(zip(options.state_argnums, threaded.user))
    bound = [given.get(i, arg) for i, arg in enumerate(call.args)]
    for i in call.rng_argnums:
        bound[i] = fold_keys(call.args[i], call.device * options.num_microbatches + index)
    for i, parts in call.parts.items():
        diff = primals[options.argnums.index(i)] if i in options.argnums else None
        bound[i] = modules.put_together(parts, diff, threaded.modules[i])
    return bound


def micro_loss(fun: Callable[..., Any], options: Options, call: Call) -> Callable[..., Any]:
    """``fun`` on one micro-batch: ``(primals, batches, index, threaded) -> (total, micro)``."""

    def loss(primals, batches, index, threaded):
        bound = _bind(options, call, primals, batches, index=index, threaded=threaded)
        try:
            out = fun(*bound, **call.kwargs)
        except Exception as e:  # often an argument of examples left whole: say which
            arguments.note_unsplit(e, options, call.args)
            raise
        output = arguments.parse_output(out, options, threaded.user)
        module_state = {
            i: modules.new_rest(bound[i], parts, options.filters.get(i))
            for i, parts in call.parts.items()
        }
        module_state = arguments.cast_like(
            module_state, threaded.modules, "left its modules (by position) a state"
        )
        count = jax.lax.stop_gradient(jnp.asarray(output.mean.count, call.sum_dtype))
        micro = MicroOutput(count, output.aux, Threaded(user=output.state, modules=module_state))
        return jnp.asarray(output.mean.total), micro

    return loss


def _zero_sums(options: Options, call: Call) -> Carry:
    def zeros(x):
        dtype = _checks.sum_dtype(options.accumulator_dtype, jnp.result_type(x))
        return jnp.zeros(jnp.shape(x), dtype)

    zero = jnp.zeros((), call.sum_dtype)
    carry = Carry(
        index=jnp.zeros((), jnp.int32),
        grads=jax.tree.map(zeros, call.primals),
        total=zero,
        count=zero,
        threaded=call.threaded,
    )
    return collectives.varying(carry, options.axis_name)


def scan(loss: Callable[..., Any], options: Options, call: Call) -> Sums:
    """Sums of gradients, totals and counts over the micro-batches; aux per micro-batch."""
    grad_fn = jax.value_and_grad(loss, has_aux=True)

    def body(carry: Carry, batches: tuple) -> tuple[Carry, Any]:
        # local sums: one reduction across devices after the loop, not one per micro-batch
        primals = collectives.varying(call.primals, options.axis_name)
        (total, micro), grads = grad_fn(primals, batches, carry.index, carry.threaded)
        summed = jax.tree.map(lambda a, g: a + g.astype(a.dtype), carry.grads, grads)
        new = Carry(
            index=carry.index + 1,
            grads=summed,
            total=carry.total + total.astype(call.sum_dtype),
            count=carry.count + micro.count,
            threaded=micro.threaded,
        )
        return new, micro.aux

    carry, aux = jax.lax.scan(
        body,
        _zero_sums(options, call),
        call.microbatches,
        length=options.num_microbatches,
        unroll=options.unroll,
    )
    return Sums(carry.grads, carry.total, carry.count, carry.threaded, aux)


# -- finish -----------------------------------------------------------------------------------


def _aux_leaf(path: Any, x: Any, whole: Any, *, k: int, rows: int) -> Any:
    """One aux leaf ``[k, ...]`` as the whole batch (``whole``, its shape) gives it."""
    if isinstance(x, Mean):
        return _sum_mean(x)
    if k == 1:
        return x[0]
    if jnp.shape(x)[1:2] == (rows,) and whole.shape == (k * rows, *x.shape[2:]):
        return merge_microbatches(x)  # one row per example: the batch's rows, in order
    if whole.shape == ():
        return x
    raise TypeError(
        f"`fun` returned aux{jax.tree_util.keystr(path)} of shape {whole.shape} for the whole "
        f"batch, neither one row per example nor a scalar, so jaxga cannot combine its "
        f"{k} micro-batches' values as the whole batch would. Return it as a jaxga.Mean for "
        f"the whole batch's mean; thread model state (batch_stats) through `state_argnums`; "
        f"or pass aux='stack' to get one value per micro-batch, [k, ...]."
    )


def _is_mean(x: Any) -> bool:
    return isinstance(x, Mean)


def _sum_mean(x: Any) -> Any:
    """A stacked ``Mean`` summed over its micro-batches; other leaves as they are."""
    return Mean(jnp.sum(x.total, 0), jnp.sum(x.count, 0)) if isinstance(x, Mean) else x


def finish_aux(loss: Callable[..., Any], options: Options, call: Call, aux: Any) -> Any:
    """``aux``, stacked by the scan, as ``options.aux`` asks: see `jaxga.accumulate`."""
    if options.aux == "stack":
        return jax.tree.map(_sum_mean, aux, is_leaf=_is_mean)
    batches = tuple(merge_microbatches(m) for m in call.microbatches)
    _, whole = jax.eval_shape(loss, call.primals, batches, 0, call.threaded)

    def leaf(path, x, shape):
        return _aux_leaf(path, x, shape, k=options.num_microbatches, rows=call.rows)

    return jax.tree_util.tree_map_with_path(leaf, aux, whole.aux, is_leaf=_is_mean)


def _reduce_threaded(threaded: Threaded, call: Call, axis_name: Any) -> Threaded:
    """Replicated threaded state made the same again: floats averaged, the rest maxed.

    The NNX modules' PRNG keys go back to the caller's, as each device folded in its index.
    """
    axes = collectives.axes(axis_name)

    def reduce(x, old):
        over = tuple(a for a in axes if a not in collectives.varying_axes(old))
        if not over:
            return x
        if jnp.issubdtype(x.dtype, jnp.floating):
            return old + jax.lax.pmean(x - old, over)
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = jax.lax.pmax(jax.random.key_data(x), over)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.lax.pmax(x, over)

    def callers_key(x, given):
        return given if arguments.is_key(x, raw=False) else x

    reduced = jax.tree.map(reduce, threaded, call.threaded)
    given = modules.rest_of(call.parts)
    return reduced._replace(modules=jax.tree.map(callers_key, reduced.modules, given))


def _check_count(count: jax.Array) -> None:
    if not isinstance(count, jax.core.Tracer) and not (jnp.isfinite(count) and count >= 0):
        raise ValueError(  # under jit: NaN
            f"The loss's jaxga.Mean counts summed to {float(count)} items; expected a finite, "
            f"non-negative number of items or total weight."
        )


def finish(sums: Sums, options: Options, call: Call, *, aux: Any) -> Accumulated:
    """Reduces ``sums`` across devices, divides once and writes modules' state back."""
    grads, total, count, threaded = sums.grads, sums.total, sums.count, sums.threaded
    if options.axis_name is not None:
        like = (call.primals, 0.0, 0.0)  # a leaf varying over an axis is not summed over it
        sums_over_devices = collectives.psum_invariant(
            (grads, total, count), like, options.axis_name
        )
        grads, total, count = sums_over_devices
        threaded = _reduce_threaded(threaded, call, options.axis_name)
    _check_count(count)

    def normalise(g, p):
        return (g / count).astype(jnp.result_type(p))

    grads = jax.tree.map(normalise, grads, call.primals)
    modules.write_back(call.parts, threaded.modules)
    state = threaded.user[0] if options.single_state else (threaded.user or None)
    return Accumulated(
        mean=Mean(total, count),
        grads=grads[0] if options.single_argnum else grads,
        aux=aux,
        state=state,
    )


def run(fun: Callable[..., Any], options: Options, args: tuple, kwargs: dict) -> Accumulated:
    """``fun``'s loss and gradients over the micro-batches of one call: the three phases."""
    with jax.named_scope("jaxga.prepare"):
        call = prepare(options, args, kwargs)
        loss = micro_loss(fun, options, call)
    with jax.named_scope("jaxga.scan"):
        sums = scan(loss, options, call)
    with jax.named_scope("jaxga.finish"):
        aux = finish_aux(loss, options, call, sums.aux) if options.has_aux else None
        return finish(sums, options, call, aux=aux)
