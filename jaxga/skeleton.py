"""Both train steps' one skeleton: offload in, accumulate, the optimiser's update, put back,
place, offload out, streaming included; a step's kind supplies how it takes its model apart,
reaches its parameters and optimiser state, and puts it back."""

import functools
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import optax

from jaxga import collectives, layouts, sharding
from jaxga._branches import when
from jaxga._host_stacks import global_norm, layerwise, on_device, placed_like
from jaxga._layerwise import StreamError, streamed_leaves, updated_by_layer
from jaxga.engine import Accumulated
from jaxga.multistep import MultiStepsTransformation, states_in
from jaxga.steps import Metrics, StepOptions

_HINT = "was it built for these parameters?"


def apply_update(
    acc: Accumulated, update: Callable[..., Any], state: Any, *, always: bool, keeps: bool = False
) -> Any:
    """``update(state, grads)``, checked and traced once; with no items counted, ``state``
    unless ``always`` (then with zero gradients: a transformation given ``weight`` weighs
    the call 0 itself). Kept by a ``lax.cond`` on CPU and a select leaf by leaf elsewhere
    (`jax.lax.platform_dependent`): each the one its compiler writes in place; with
    ``keeps``, by ``update`` itself, given ``counted=`` (a layer at a time, `_selecting`)."""
    counted = acc.mean.count > 0

    def updated(state: Any, grads: Any, **keep: Any) -> Any:  # nnx.Optimizer may rebuild
        paths = jax.tree_util.tree_flatten_with_path(state)[0]  # subtrees, in place, with
        shapes = [jnp.shape(x) for _, x in paths]  # other node types
        try:
            new = update(state, grads, **keep)
        except StreamError:
            raise
        except (AttributeError, TypeError, ValueError) as e:  # optax.lookahead wants .fast
            raise ValueError(
                f"The optimiser's update fails on these parameters ({e}): {_HINT}"
            ) from e
        for (path, _), before, after in zip(paths, shapes, jax.tree.leaves(new), strict=True):
            if before != jnp.shape(after):
                change = f"{jax.tree_util.keystr(path)} from {before} to {jnp.shape(after)}"
                raise ValueError(f"The optimiser's update changes the shape of {change}: {_HINT}")
        return new

    if always:
        zero = jax.lax.optimization_barrier(jnp.zeros((), jnp.float32))  # not a constant
        # streamed: by layer (each device over its own, split by stage); its dtype kept
        grads = layerwise(_zeroed, acc.grads, consts=(counted, zero))
        return updated(state, grads)
    if keeps:
        return updated(state, acc.grads, counted=counted)
    run, consts = jax.closure_convert(updated, state, acc.grads)  # traced once, run twice
    operands = (state, acc.grads, *consts)
    skipped = functools.partial(when, counted, run, otherwise=_kept)
    selected = functools.partial(_selected, counted, run)
    return jax.lax.platform_dependent(*operands, cpu=skipped, default=selected)


def _zeroed(grad: jax.Array, counted: jax.Array, zero: jax.Array) -> jax.Array:
    """``grad`` where ``counted``, else ``zero`` in its dtype."""
    return jnp.where(counted, grad, zero.astype(grad.dtype))


def _kept(types: Any, state: Any, *_: Any) -> Any:
    """``state`` as the update's output ``types`` (cast; laid out on Explicit axes as it)."""
    pairs = zip(jax.tree.leaves(state), jax.tree.leaves(types), strict=True)
    kept = jax.tree.unflatten(jax.tree.structure(types), [x.astype(t.dtype) for x, t in pairs])
    return collectives.laid_out_as(kept, types)


def _selected(counted: Any, run: Callable[..., Any], state: Any, *operands: Any) -> Any:
    """``run(state, *operands)`` where ``counted``, else ``state``, chosen leaf by leaf: XLA's
    GPU compiler fuses the choice into the update, which writes the donated state in place,
    where it copies a ``lax.cond``'s outputs into it; XLA:CPU fuses a ``lax.cond`` better
    (`apply_update` takes the cond there; docs/streaming.md, "What binds")."""
    new = run(state, *operands)
    kept = _kept(jax.tree.map(jax.typeof, new), state)
    return jax.tree.map(functools.partial(jnp.where, counted), new, kept)


def _selecting(
    update: Callable[..., Any], state: Any, grads: Any, *, counted: Any = None, **extra: Any
) -> Any:
    """``update(state, grads, **extra)``, kept as `_selected` keeps it where ``counted`` is
    given (a layer's slices, in place); without it (a probe's call), as it is."""
    if counted is None:
        return update(state, grads, **extra)
    return _selected(counted, functools.partial(update, **extra), state, grads)


def _groups_ended(opt_state: Any) -> list[jax.Array]:
    """Whether each MultiSteps in ``opt_state`` ran its inner optimiser in this call: a
    `jaxga.MultiSteps`' ``applied``; an `optax.MultiSteps`' (its ``gradient_transformation()``
    in a chain), optax's own rule: a group just ended, ``mini_step`` back to 0."""
    theirs = states_in(opt_state, optax.MultiStepsState)
    ended = [(s.mini_step == 0) & (s.gradient_step > 0) for s in theirs]
    return [s.applied for s in states_in(opt_state)] + ended


def metrics(
    acc: Accumulated, tx: Any, opt_state: Any, options: "StepOptions", *, always: bool
) -> Metrics:
    """The step's metrics; ``applied``: whether the update ran (``always``, or items counted)
    and applied: ``tx.has_updated(opt_state)`` if ``tx`` has one, else whether every
    MultiSteps it holds (a chain's: `_groups_ended`) ran its inner optimiser, else whether
    items counted."""
    counted = acc.mean.count > 0
    if (has_updated := getattr(tx, "has_updated", None)) is not None:
        applied = has_updated(opt_state)
    elif held := _groups_ended(opt_state):
        applied = jnp.all(jnp.stack(held))
    else:
        applied = counted
    return {
        "loss": acc.mean.value,
        "count": acc.mean.count,
        "grad_norm": (global_norm if options.stream == "layers" else optax.tree.norm)(acc.grads),
        "learning_rate": _learning_rate(options.learning_rate, opt_state),
        "applied": (counted | always) & applied,
    }


def _learning_rate(rate: Callable[[Any], Any], opt_state: Any) -> jax.Array:
    """``rate(opt_state)``, checked: one number."""
    value = rate(opt_state)
    try:
        array = jnp.asarray(value, jnp.float32)
    except (TypeError, ValueError):  # None, a dict, a string
        raise TypeError(f"`learning_rate` must return a number; got {value!r:.60}.") from None
    if array.shape != ():
        raise ValueError(f"`learning_rate` must return a scalar; got shape {array.shape}.")
    return array


def tx_args(
    options: StepOptions, tx: Any, acc: Accumulated, end_group: Any, opt_state: Any
) -> dict[str, Any]:
    """What the step passes to ``tx.update`` besides the gradient: ``weight``, ``end_group``;
    ``weight=None`` weighs a `jaxga.MultiSteps` at the top of ``tx`` or inside (a chain)."""
    held = isinstance(tx, MultiStepsTransformation) or bool(states_in(opt_state))
    weigh = held if options.weight is None else options.weight
    extra = {"weight": acc.mean.count} if weigh else {}
    if end_group is not None:
        extra["end_group"] = end_group
    plain = not isinstance(tx, optax.GradientTransformationExtraArgs)
    if extra and plain and isinstance(tx, optax.GradientTransformation):
        got = f"{', '.join(extra)} to an optax {type(tx).__name__}, which takes no extra args"
        fix = "one that does (jaxga.MultiSteps), or build the step with weight=False"
        if held and options.weight is None:  # unweighed, the MultiSteps inside weighs a call 1
            fix = "one that hands them to the jaxga.MultiSteps it holds (optax.chain does)"
            fix += ", or build the step with weight=False (then each call weighs 1)"
        raise TypeError(f"The step passes {got}: expected {fix}.")
    return extra


class OptimizerAccess(NamedTuple):
    """How a train step runs its optimiser: what `optimize` (and the update a layer at a
    time, `_layerwise`) needs of the model's kind."""

    tx: Any  # the optax transformation (`state.tx`, `optimizer.tx`)
    update: Callable[..., Any]  # (state, grads, **extra) -> state: Flax's apply_gradients, NNX's
    opt_state: Callable[[Any], Any]  # the (pure) optimiser state in a state
    params: Callable[[Any], Any]  # the (pure) parameters `update` updates, in a state
    rebuild: Callable[[Any, Any, Any], Any]  # (state, params, opt_state) -> state holding them
    check: Callable[[dict[str, Any]], Any] | None = None  # raises unless `update` takes extra
    static: Hashable = None  # what besides `tx` decides `update` (the layer probe's cache key)


class StepKind(Protocol):
    """What `train_step` needs of a step's kind (`train._Flax`, `nnx_train._NNX`)."""

    def specs(self, state: Any, layout: layouts.MeshLayout) -> Any:
        """``state``'s specs on ``layout``'s mesh."""

    def accumulate(self, state: Any, batch: Any, specs: Any) -> tuple[Accumulated, Any]:
        """The loss accumulated over ``batch`` (`layouts.on_mesh` on a mesh), and the state
        the optimiser updates."""

    def optimizer(self, state: Any) -> OptimizerAccess:
        """How to run ``state``'s optimiser and reach its parameters and optimiser state."""

    def put_back(self, given: Any, new: Any, acc: Accumulated) -> Any:
        """The step's new state, from the ``given`` one and the optimiser's ``new`` one."""


def optimize(
    options: StepOptions, optimizer: OptimizerAccess, acc: Accumulated, state: Any, end_group: Any
) -> tuple[Any, Metrics]:
    """The tail both train steps share: ``optimizer.update`` of ``state`` by ``acc.grads``
    (with `weight` and `end_group` as `tx_args` says; with ``stream="layers"``, a layer at a
    time, `_layerwise.updated_by_layer`), and the step's metrics."""
    extra = tx_args(options, optimizer.tx, acc, end_group, optimizer.opt_state(state))
    if optimizer.check is not None:
        optimizer.check(extra)
    update, keeps = optimizer.update, options.stream == "layers"
    if keeps:  # the stacks' update a layer at a time, each layer kept where nothing counted
        selecting = functools.partial(_selecting, optimizer.update)
        update = functools.partial(updated_by_layer, optimizer._replace(update=selecting))
    update = functools.partial(update, **extra)
    new = apply_update(acc, update, state, always="weight" in extra, keeps=keeps)
    opt_state = optimizer.opt_state(new)
    return new, metrics(acc, optimizer.tx, opt_state, options, always="weight" in extra)


def train_step(
    kind: StepKind, options: StepOptions, state: Any, batch: Any, end_group: Any
) -> tuple[Any, Metrics]:
    """One train step of ``state`` (traced) on ``batch``; ``kind`` (a `StepKind`) takes the model
    apart and puts it back. With ``options.stream``, the leaves in host memory stay there:
    ``True`` fetches them whole for the update; ``"layers"`` leaves the streamed stacks and
    their optimiser-state mirrors where they lie (`_layerwise.streamed_leaves`). Returns the
    new state, placed and offloaded as it came, and the metrics."""
    keep = None  # the leaves that stay where they lie
    if options.stream == "layers":
        keep = streamed_leaves(kind.optimizer(state), state)
    state = sharding.offload(state, "device", select=options.offload, keep=keep)
    layout, specs = options.layout, None
    if layout is not None:  # the strategy's layout, or the metadata's
        specs = kind.specs(state, layout)
        state = sharding.place(layout.mesh, state, specs)
    acc, updated = _accumulated(kind, state, batch, specs)
    if options.stream is True:  # the update on the device, whole
        acc, updated = acc._replace(grads=on_device(acc.grads)), on_device(updated)
    new, metrics = optimize(options, kind.optimizer(updated), acc, updated, end_group)
    new = kind.put_back(state, new, acc)
    if options.stream:  # back where each leaf lived
        new = placed_like(new, state)
    if specs is not None:
        new = sharding.place(layout.mesh, new, specs)
    if options.has_aux:
        metrics["aux"] = acc.aux
    return sharding.offload(new, select=options.offload, keep=keep), metrics


def _accumulated(kind: StepKind, state: Any, batch: Any, specs: Any) -> tuple[Accumulated, Any]:
    """``kind.accumulate(state, batch, specs)``; JAX's error for a collective over an axis no
    map binds gets a note naming the step's ``axis_name``."""
    try:
        return kind.accumulate(state, batch, specs)
    except NameError as e:
        if "axis name" in str(e):
            fix = "pass the step's axis_name=NAME (without a `mesh`: a one-device mesh of it)"
            e.add_note(f"jaxga: a named axis needs a mesh: {fix}.")
        raise
