"""A CNN's k-way step against its full batch on CPU: Flax's NNX MNIST tutorial model.

XLA:CPU runs a convolution's weight gradient many times slower inside a loop. This
compares, per step (median of ``--repeats``), and by compiled temporaries, the full
batch's ``nnx.value_and_grad``, jaxga's default (the micro-batch loop rolled: one
micro-batch's activations at a time) and ``unroll=True`` (no loop: faster on a CPU, but the
micro-batches' activations may all be live at once).

    .venv/bin/python benchmarks/cnn_cpu.py
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


def median_ms(fn, *args, repeats):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    model = CNN(nnx.Rngs(0))
    batch = {"x": jnp.ones((args.batch_size, 28, 28, 1)), "y": jnp.zeros(args.batch_size, int)}
    k = args.microbatches
    full = median_ms(nnx.jit(nnx.value_and_grad(loss)), model, batch, repeats=args.repeats)

    def step(unroll):
        return nnx.jit(jaxga.value_and_grad(loss, num_microbatches=k, unroll=unroll))

    def temp_mb(fn):
        return jaxga.memory_report(fn, model, batch).temp_bytes / 2**20

    rolled = median_ms(step(1), model, batch, repeats=args.repeats)
    unrolled = median_ms(step(True), model, batch, repeats=args.repeats)
    full_fn = nnx.jit(nnx.value_and_grad(loss))
    temps = [temp_mb(full_fn), temp_mb(step(1)), temp_mb(step(True))]
    print(f"{jax.devices()[0].device_kind}, batch {args.batch_size}, k={k}:")
    print(f"  full batch                  {full:7.1f} ms  1.00x   temp {temps[0]:6.1f} MiB")
    print(
        f"  jaxga (default: rolled)     {rolled:7.1f} ms  {rolled / full:5.2f}x   "
        f"temp {temps[1]:6.1f} MiB"
    )
    print(
        f"  jaxga, unroll=True          {unrolled:7.1f} ms  {unrolled / full:5.2f}x   "
        f"temp {temps[2]:6.1f} MiB"
    )


if __name__ == "__main__":
    main()
