"""Both train steps' one skeleton: offload in, accumulate, the optimiser's update, put back,
place, offload out; a step's kind supplies how it takes its model apart and puts it back."""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

from jaxga import sharding
from jaxga.engine import Accumulated
from jaxga.steps import Metrics, StepOptions, apply_update, metrics, tx_args


class OptimizerAccess(NamedTuple):
    """How a train step runs its optimiser: what `optimize` needs of the model's kind."""

    tx: Any  # the optax transformation (`state.tx`, `optimizer.tx`)
    update: Callable[..., Any]  # (state, grads, **extra) -> state: Flax's apply_gradients, NNX's
    opt_state: Callable[[Any], Any]  # the optimiser state in a state
    check: Callable[[dict[str, Any]], Any] | None = None  # raises unless `update` takes extra


def optimize(
    options: StepOptions, optimizer: OptimizerAccess, acc: Accumulated, state: Any, end_group: Any
) -> tuple[Any, Metrics]:
    """The tail both train steps share: ``optimizer.update`` of ``state`` by ``acc.grads``
    (with `weight` and `end_group` as `tx_args` says), and the step's metrics."""
    extra = tx_args(options, optimizer.tx, acc, end_group, optimizer.opt_state(state))
    if optimizer.check is not None:
        optimizer.check(extra)
    update = functools.partial(optimizer.update, **extra)
    new = apply_update(acc, update, state, always="weight" in extra)
    opt_state = optimizer.opt_state(new)
    return new, metrics(acc, optimizer.tx, opt_state, options, always="weight" in extra)


def train_step(
    kind: Any, options: StepOptions, state: Any, batch: Any, end_group: Any
) -> tuple[Any, Metrics]:
    """One train step of ``state`` (traced) on ``batch``; ``kind``, a small `NamedTuple`
    (`train._Flax`, `nnx_train._NNX`), takes the model apart and puts it back:
    ``kind.streamed(state)`` (None, or the leaves left where they lie), ``kind.specs(state,
    layout)`` (its specs on a mesh), ``kind.accumulate(state, batch,
    specs)`` (the accumulated loss, `layouts.on_mesh` on a mesh, and the state the optimiser
    updates), ``kind.optimizer(state)`` (an `OptimizerAccess`), ``kind.put_back(state, new,
    acc)`` (the new state). Returns the new state, placed and offloaded as it came, and the
    metrics."""
    keep = kind.streamed(state)  # the leaves that stay where they lie
    state = sharding.offload(state, "device", select=options.offload, keep=keep)
    layout, specs = options.layout, None
    if layout is not None:  # the strategy's layout, or the metadata's
        specs = kind.specs(state, layout)
        state = sharding.place(layout.mesh, state, specs)
    acc, updated = kind.accumulate(state, batch, specs)
    new, metrics = optimize(options, kind.optimizer(updated), acc, updated, end_group)
    new = kind.put_back(state, new, acc)
    if specs is not None:
        new = sharding.place(layout.mesh, new, specs)
    if options.has_aux:
        metrics["aux"] = acc.aux
    return sharding.offload(new, select=options.offload, keep=keep), metrics
