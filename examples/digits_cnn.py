"""Trains an MNIST-style CNN with BatchNorm (Flax Linen) on scikit-learn's digits, k micro-batches.

The state is a Linen user's own ``flax.training.train_state.TrainState`` with a
``batch_stats`` field; ``jaxga.make_train_step`` threads those statistics from one
micro-batch to the next. In training mode each micro-batch normalises with its own
statistics (as it would on a smaller device), so the result depends on k; with
BatchNorm in eval mode a k-micro-batch step equals the full-batch step, which the
script checks and prints.

    python examples/digits_cnn.py --steps 300 --batch-size 64 --microbatches 4
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from sklearn.datasets import load_digits

import jaxga


class CNN(nn.Module):
    """Conv 32-64-64, dense 64, ten classes, BatchNorm after every convolution."""

    train: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for features in (32, 64, 64):
            x = nn.Conv(features, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not self.train, momentum=0.9)(x)
            x = nn.relu(x)
            if features == 32:
                x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(x)


class TrainState(train_state.TrainState):
    """Flax's TrainState and the BatchNorm statistics, as Linen users write it."""

    batch_stats: Any


FIELDS = ("batch_stats",)  # make_train_step's model_state: {"batch_stats": ...}; no key field


def data(test_size: int = 297):
    """Returns ((x_train, y_train), (x_test, y_test)) as 8×8×1 images in [0, 1]."""
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[test_size:], y[test_size:]), (x[:test_size], y[:test_size])


def loss_fn(model: CNN):
    """The loss ``make_train_step`` takes; ``model_state`` is ``{"batch_stats": ...}``."""

    def loss(params, batch, model_state, rng):
        logits, updates = model.apply(
            {"params": params, **model_state}, batch["x"], mutable=list(model_state)
        )
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return jaxga.Mean.of(losses), {**model_state, **updates}

    return loss


def accuracy(state: TrainState, x, y) -> float:
    logits = CNN(train=False).apply({"params": state.params, "batch_stats": state.batch_stats}, x)
    return float(jnp.mean(jnp.argmax(logits, -1) == y))


def eval_mode_check(state: TrainState, batch, k: int) -> float:
    """Max |Δparam| between one k-micro-batch step and one full-batch step, BatchNorm frozen."""
    results = []
    for num_microbatches in (k, 1):
        step = jaxga.make_train_step(
            loss_fn(CNN(train=False)), num_microbatches, donate=False, model_state_fields=FIELDS
        )
        results.append(step(state, batch)[0].params)
    return max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]))
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args(argv)
    if args.steps < 1 or args.microbatches < 1 or args.batch_size % args.microbatches:
        print(
            f"digits_cnn.py: error: --batch-size {args.batch_size} must be divisible by "
            f"--microbatches {args.microbatches}, and --steps positive",
            file=sys.stderr,
        )
        return 2

    (x_train, y_train), (x_test, y_test) = data()
    variables = CNN().init(jax.random.key(0), x_train[:1])
    state = TrainState.create(
        apply_fn=None,
        params=variables["params"],
        tx=optax.adam(args.lr),
        batch_stats=variables["batch_stats"],
    )
    first_batch = {"x": x_train[: args.batch_size], "y": y_train[: args.batch_size]}
    delta = eval_mode_check(state, first_batch, args.microbatches)
    print(
        f"one step with {args.microbatches} micro-batches vs the full batch, BatchNorm in eval "
        f"mode: max |Δparam| = {delta:.2e}"
    )

    # The micro-batch loop stays rolled: on a CPU its convolutions are put in the layout
    # XLA's fast kernels take (canonical_convolutions="auto", docs/gpus.md).
    step = jaxga.make_train_step(
        loss_fn(CNN(train=True)), args.microbatches, model_state_fields=FIELDS
    )
    rng = np.random.default_rng(1)
    for i in range(args.steps):
        rows = rng.choice(len(x_train), args.batch_size, replace=False)
        state, metrics = step(state, {"x": x_train[rows], "y": y_train[rows]})
        if (i + 1) % 100 == 0 or i + 1 == args.steps:
            print(f"step {i + 1}: loss {float(metrics['loss']):.4f}")
    acc = accuracy(state, x_test, y_test)
    print(f"test accuracy: {acc:.3f} on {len(x_test)} held-out digits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
