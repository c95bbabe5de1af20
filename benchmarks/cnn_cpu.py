"""A CNN's k-way step against its full batch on CPU: Flax's NNX MNIST tutorial model.

XLA:CPU runs the backward convolutions slowly inside a loop: it puts convolutions in the
layout its fast kernels take in its entry computation only (docs/gpus.md). This compares,
per step (the median of ``--repeats`` rounds, each timing every step once, in turn), and
by compiled temporaries, the full batch's ``nnx.value_and_grad`` with jaxga's default (the
micro-batch loop rolled, its convolutions rewritten to NHWC/HWIO on a CPU:
``canonical_convolutions="auto"``), with ``canonical_convolutions=False`` (the loop as
JAX emits it) and with ``unroll=True`` (no loop: the micro-batches' activations may all
be live at once). ``--layers L`` also times ``jax.grad`` of a ``jaxga.remat_scan`` over L
3x3 convolutions (a rolled layer loop outside jaxga's micro-batch loop), with
``canonical_convolutions`` False (its default) and True.

    .venv/bin/python benchmarks/cnn_cpu.py [--layers 8]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxga


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        def pool(x):
            return nnx.avg_pool(x, (2, 2), (2, 2))

        x = pool(nnx.relu(self.conv2(pool(nnx.relu(self.conv1(x))))))
        return self.linear2(nnx.relu(self.linear1(x.reshape(x.shape[0], -1))))


def loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def median_ms(steps, args, *, repeats):
    """Each step's median time in ms, timing every step once per round, in turn."""
    for fn in steps.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def conv_layer(w, x):
    numbers = ("NHWC", "HWIO", "NHWC")
    return jnp.tanh(jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=numbers))


def remat_scan_rows(num_layers: int, batch_size: int, repeats: int) -> None:
    """``jax.grad`` of a remat_scan of 3x3, 32-channel convolutions on 28x28 images."""
    stacked = 0.05 * jax.random.normal(jax.random.key(0), (num_layers, 3, 3, 32, 32))
    x = jax.random.normal(jax.random.key(1), (batch_size, 28, 28, 32))

    def grad(canonical):
        def loss(stacked, x):
            y = jaxga.remat_scan(conv_layer, stacked, x, canonical_convolutions=canonical)
            return jnp.mean(y**2)

        return jax.jit(jax.grad(loss))

    steps = {f"canonical_convolutions={c}": grad(c) for c in (False, True)}
    ms = median_ms(steps, (stacked, x), repeats=repeats)
    print(f"jax.grad of remat_scan, {num_layers} conv layers, batch {batch_size}:")
    for name, fn in steps.items():
        temp = fn.lower(stacked, x).compile().memory_analysis().temp_size_in_bytes / 2**20
        print(f"  {name:36} {ms[name]:7.1f} ms  temp {temp:6.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--layers", type=int, default=0, help="also time a remat_scan")
    args = parser.parse_args()
    model = CNN(nnx.Rngs(0))
    batch = {"x": jnp.ones((args.batch_size, 28, 28, 1)), "y": jnp.zeros(args.batch_size, int)}
    k = args.microbatches

    def step(**options):
        return nnx.jit(jaxga.value_and_grad(loss, num_microbatches=k, **options))

    steps = {
        "full batch": nnx.jit(nnx.value_and_grad(loss)),
        "jaxga (default)": step(),
        "jaxga, canonical_convolutions=False": step(canonical_convolutions=False),
        "jaxga, unroll=True": step(unroll=True),
    }
    ms = median_ms(steps, (model, batch), repeats=args.repeats)
    temp = {name: jaxga.memory_report(fn, model, batch).temp_bytes for name, fn in steps.items()}
    print(f"{jax.devices()[0].device_kind}, batch {args.batch_size}, k={k}, {jax.__version__=}:")
    print(f"  {'':36} {'ms':>7} {'x time':>7} {'temp MiB':>9} {'x temp':>7}")
    for name in steps:
        time_ratio = ms[name] / ms["full batch"]
        temp_ratio = temp[name] / temp["full batch"]
        print(
            f"  {name:36} {ms[name]:7.1f} {time_ratio:7.2f} {temp[name] / 2**20:9.1f} "
            f"{temp_ratio:7.2f}"
        )
    if args.layers:
        remat_scan_rows(args.layers, args.batch_size // k, args.repeats)


if __name__ == "__main__":
    main()
