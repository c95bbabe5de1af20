"""Both train steps' one skeleton: offload in, accumulate, the optimiser's update, put back,
place, offload out, streaming included; a step's kind supplies how it takes its model apart,
reaches its parameters and optimiser state, and puts it back."""

import functools
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, Protocol

from jaxga import sharding
from jaxga._layerwise import streamed_leaves, updated_by_layer
from jaxga._streaming import on_device, placed_like
from jaxga.engine import Accumulated
from jaxga.steps import Metrics, StepOptions, apply_update, metrics, selected, tx_args


class OptimizerAccess(NamedTuple):
    """How a train step runs its optimiser: what `optimize` (and the update a layer at a
    time, `_layerwise`) needs of the model's kind."""

    tx: Any  # the optax transformation (`state.tx`, `optimizer.tx`)
    update: Callable[..., Any]  # (state, grads, **extra) -> state: Flax's apply_gradients, NNX's
    opt_state: Callable[[Any], Any]  # the (pure) optimiser state in a state
    params: Callable[[Any], Any]  # the (pure) parameters `update` updates, in a state
    replace: Callable[[Any, Any, Any], Any]  # (state, params, opt_state) -> state holding them
    check: Callable[[dict[str, Any]], Any] | None = None  # raises unless `update` takes extra
    static: Hashable = None  # what besides `tx` decides `update` (the layer probe's cache key)


class Kind(Protocol):
    """What `train_step` needs of a step's kind (`train._Flax`, `nnx_train._NNX`)."""

    def specs(self, state: Any, layout: sharding.MeshLayout) -> Any:
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
    optimizer = optimizer._replace(update=functools.partial(selected, optimizer.update))
    update = optimizer.update  # keeps the state where nothing counted, leaf by leaf
    if options.stream == "layers":  # the streamed stacks' update a layer at a time
        update = functools.partial(updated_by_layer, optimizer)
    new = apply_update(acc, functools.partial(update, **extra), state, always="weight" in extra)
    opt_state = optimizer.opt_state(new)
    return new, metrics(acc, optimizer.tx, opt_state, options, always="weight" in extra)


def train_step(
    kind: Kind, options: StepOptions, state: Any, batch: Any, end_group: Any
) -> tuple[Any, Metrics]:
    """One train step of ``state`` (traced) on ``batch``; ``kind`` (a `Kind`) takes the model
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
    acc, updated = kind.accumulate(state, batch, specs)
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
