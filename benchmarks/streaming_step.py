"""A streamed train step run and timed beside the resident one, each with the cost model's
step time beside it (``biggest_model.modelled``, for the card given): the measurement the
model waits for. Prepared for a lent GPU; on CPU it is a smoke test, its times say nothing
of a GPU's.

A Llama-shaped decoder (``--size`` on ``biggest_model``'s grid), AdamW, a token-weighted
`jaxga.Mean`, ``--sequences`` sequences a step in micro-batches of ``--micro`` sequences
(one: transfer-bound; enough that compute covers the transfers, docs/streaming.md's "When
streaming pays": where prefetching shows); every method starts from the same parameters
and takes the same batches:

- ``resident``: ``make_train_step(loss, k)``;
- ``offload=True``: the optimiser state in pinned host memory between steps;
- ``streaming``: the layer stack and the optimiser state in pinned host memory,
  ``make_train_step(..., stream="layers", offload=True)``, the loss's layers
  ``remat_scan(..., stream=True)`` (each layer prefetched); ``streaming, no prefetch``
  the same with ``prefetch=False``.

Each row: the median wall time of ``--rounds`` steps after a first (compiling) one, the
bytes the step moves between host and device (``MemoryReport.moved_bytes``), the modelled
step time and measured ÷ modelled, and the loss of the second step (after one update)
against the resident step's: the streamed updates are exact (``offload=True`` and
``prefetch`` change no bit; ``stream="layers"`` updates a layer at a time, to rounding).

    python benchmarks/streaming_step.py --card "H100 80GB" --size 16 --micro 16  # a GPU
    JAX_PLATFORMS=cpu python benchmarks/streaming_step.py --quick              # a smoke test

An H200 has the H100's bfloat16 peak and PCIe 5.0 link: model it with ``--card "H100 80GB"``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, NamedTuple

import biggest_model as bm
import jax
import jax.numpy as jnp
import optax
from _timing import time_interleaved

import jaxga
from jaxga.memory import program_counts


class Method(NamedTuple):
    """How a row's step is built: ``make_train_step``'s ``stream`` and ``offload``, and
    ``remat_scan``'s ``prefetch``; ``modelled_as``: its row of ``biggest_model``'s model."""

    stream: bool | str
    offload: bool
    prefetch: bool
    modelled_as: str


METHODS = {
    "resident": Method(False, False, True, "jaxga resident"),
    "offload=True": Method(False, True, True, "jaxga offload=True"),
    "streaming": Method("layers", True, True, "jaxga streaming"),
    "streaming, no prefetch": Method("layers", True, False, "jaxga streaming, no prefetch"),
}


def initial_params(model: bm.Llama) -> dict[str, Any]:
    """Parameters of ``model``'s shapes: norms 1, weights normal with standard deviation 0.02."""
    shapes = bm.abstract_params(model)
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(shapes))))

    def init(path: Any, shape: jax.ShapeDtypeStruct) -> jax.Array:
        if "norm" in jax.tree_util.keystr(path):
            return jnp.ones(shape.shape, shape.dtype)
        return 0.02 * jax.random.normal(next(keys), shape.shape, shape.dtype)

    return jax.tree_util.tree_map_with_path(init, shapes)


def batch_of(sequences: int, seq_len: int, seed: int) -> dict[str, jax.Array]:
    """Random tokens, each sequence of its own length (a token-weighted mean counts them)."""
    tokens = jax.random.randint(jax.random.key(seed), (sequences, seq_len + 1), 0, bm.VOCAB)
    lengths = jax.random.randint(jax.random.key(seed + 1), (sequences, 1), 1, seq_len + 1)
    mask = (jnp.arange(seq_len) < lengths).astype(jnp.float32)
    return {"inputs": tokens[:, :-1], "labels": tokens[:, 1:], "mask": mask}


def state_for(method: Method, params: dict[str, Any]) -> jaxga.TrainState:
    """The train state ``method`` starts from: the streamed leaves in pinned host memory."""
    state = jaxga.TrainState.create(params=params, tx=optax.adamw(3e-4, weight_decay=0.1))
    if not method.stream:
        return state
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")

    def place(path: Any, leaf: Any) -> Any:
        return jax.device_put(leaf, host) if bm.streamed(path) else leaf

    return jax.tree_util.tree_map_with_path(place, state)


class Row(NamedTuple):
    """One method's figures (see the module doc)."""

    method: str
    seconds: float
    moved_bytes: int
    modelled_s: float
    second_loss: float


def measure(name: str, model: bm.Llama, args: argparse.Namespace) -> Row:
    """``name``'s step built, its bytes read, and timed over ``args.rounds`` steps."""
    method, k = METHODS[name], args.sequences // args.micro
    loss = bm.step_loss(bm.loss_for("full", stream=bool(method.stream), prefetch=method.prefetch))
    step = jaxga.make_train_step(loss, k, stream=method.stream, offload=method.offload)
    batches = [batch_of(args.sequences, model.seq_len, seed) for seed in (1, 2)]
    state = state_for(method, initial_params(model))
    traced = step.trace(state, batches[0])  # no second compile: the moves are the jaxpr's
    moved = program_counts(getattr(traced, "traced", traced).jaxpr).moved_bytes
    held = {"state": step(state, batches[0])[0]}  # the first step compiles

    def one_step() -> jax.Array:
        held["state"], metrics = step(held["state"], batches[1])
        return metrics["loss"]

    second = float(one_step())
    seconds = time_interleaved({name: one_step}, args.rounds)[name]
    setting = bm.Setting(method.modelled_as, "full", args.micro)
    modelled = bm.modelled(setting, model, bm.CARDS[args.card], args.sequences * model.seq_len)
    return Row(name, statistics.median(seconds), moved, modelled.step_s, second)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--card", default="H100 80GB", choices=list(bm.CARDS))
    parser.add_argument("--size", type=int, default=16, help="biggest_model's size grid")
    parser.add_argument("--sequences", type=int, default=16, help="a step's, of 2048 tokens")
    parser.add_argument("--micro", type=int, default=1, help="sequences a micro-batch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a tiny model: a smoke test")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    args.model = bm.Llama.of(args.size)
    if args.quick:
        args.model = bm.Llama(layers=2, dim=128, hidden=256, seq_len=16)
        args.sequences, args.micro, args.rounds = 2, 1, 1
    if args.sequences % args.micro:
        parser.error(f"--sequences {args.sequences} is not divisible by --micro {args.micro}")
    return args


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse(argv)
    model = args.model
    device = jax.devices()[0].device_kind
    print(
        f"{device}, jax {jax.__version__}: {model}, {model.num_params() / 1e9:.2f}B "
        f"parameters, {args.sequences} sequences a step, {args.micro} a micro-batch; "
        f"modelled for {args.card}",
        file=sys.stderr,
    )
    rows = [measure(name, model, args) for name in METHODS]
    base = rows[0]
    print(
        f"{'method':24} {'s a step':>9} {'moved GiB':>10} {'modelled s':>11} "
        f"{'measured/modelled':>18} {'loss after one update - resident':>34}"
    )
    for r in rows:
        figures = f"{r.seconds:9.3f} {r.moved_bytes / bm.GiB:10.2f} {r.modelled_s:11.3f}"
        ratio, diff = r.seconds / r.modelled_s, r.second_loss - base.second_loss
        print(f"{r.method:24} {figures} {ratio:18.2f} {diff:34.3g}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"device": device, "jax": jax.__version__, "card_modelled": args.card}
        payload |= {"micro": args.micro, "rows": [r._asdict() for r in rows]}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
