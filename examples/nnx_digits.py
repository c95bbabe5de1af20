"""Trains a Flax NNX MLP with BatchNorm and Dropout on scikit-learn's digits, k micro-batches.

The whole jaxga change to an NNX training loop is one line: ``nnx.value_and_grad(loss)``
becomes ``jaxga.value_and_grad(loss, num_microbatches=k)``. BatchNorm statistics and the
Dropout ``Rngs`` advance from micro-batch to micro-batch as over k sequential steps. The
script checks that, in eval mode (running statistics, no dropout), the k-micro-batch step
equals the full-batch step, and that training moved the BatchNorm statistics.

    python examples/nnx_digits.py --steps 300 --batch-size 64 --microbatches 4
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import jaxga


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, hidden: int = 128):
        self.hidden = nnx.Linear(64, hidden, rngs=rngs)
        self.norm = nnx.BatchNorm(hidden, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.drop(nnx.relu(self.norm(self.hidden(x)))))


def loss(model: MLP, batch: dict) -> jax.Array:
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def train(steps: int, batch_size: int, num_microbatches: int, seed: int = 0) -> dict:
    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]
    model = MLP(nnx.Rngs(params=seed, dropout=seed + 1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    grad_fn = jaxga.value_and_grad(loss, num_microbatches=num_microbatches)

    @nnx.jit
    def step(model, optimizer, batch):
        value, grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        return value

    # Eval mode: the k-micro-batch gradient equals the full-batch one to float32 rounding.
    model.eval()
    check = {"x": x_train[:batch_size], "y": y_train[:batch_size]}
    with jax.default_matmul_precision("highest"):
        full = nnx.value_and_grad(loss)(nnx.clone(model), check)
        micro = grad_fn(nnx.clone(model), check)
    gap = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(*map(jax.tree.leaves, (full, micro))))
    model.train()

    order = np.random.default_rng(seed).permutation(len(x_train))
    mean_before = np.asarray(model.norm.mean[...])
    losses = []
    for i in range(steps):
        rows = order[(i * batch_size + np.arange(batch_size)) % len(x_train)]
        losses.append(float(step(model, optimizer, {"x": x_train[rows], "y": y_train[rows]})))
    stats_moved = float(np.max(np.abs(np.asarray(model.norm.mean[...]) - mean_before)))

    model.eval()
    accuracy = float(jnp.mean(jnp.argmax(model(x_test), -1) == y_test))
    return {"losses": losses, "gap": gap, "stats_moved": stats_moved, "accuracy": accuracy}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size % args.microbatches:
        parser.error("--steps must be ≥ 1 and --batch-size divisible by --microbatches")
    result = train(args.steps, args.batch_size, args.microbatches)
    k = args.microbatches
    print(f"k={k} vs full batch, eval mode: max |Δ(loss, grads)| = {result['gap']:.1e}")
    print(f"BatchNorm running mean moved by up to {result['stats_moved']:.3f}")
    print(f"loss {result['losses'][0]:.3f} → {result['losses'][-1]:.3f}")
    print(f"test accuracy {result['accuracy']:.3f}")
    return result


if __name__ == "__main__":
    main()
