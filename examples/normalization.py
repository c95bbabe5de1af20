"""The figure that motivates jaxga: a mean of micro-batch means is not the batch's mean.

Trains one small byte-level model four times on variable-length documents (the Python
standard library's source, split into top-level definitions) with the same data,
optimiser and seed:

* batch 16 in one micro-batch, and 16 micro-batches of one document each,
* each with the naive loss (every micro-batch returns its own token mean, micro-batches
  weigh equally) and with ``jaxga.Mean`` (totals and token counts summed, divided once).

The naive pair diverges — one-document micro-batches give a short document's tokens as
much weight as a long one's — while the exact pair coincides. Saves the training loss and
gradient norm per step of all four runs in one PNG.

    python examples/normalization.py --steps 150 --out docs/normalization.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxga

sys.path.insert(0, str(Path(__file__).parent))
from train_lm import batch_at, documents, pack


class BigramMLP(nnx.Module):
    """Predicts the next byte from the last four: small enough to train four times quickly."""

    def __init__(self, rngs: nnx.Rngs, dim: int = 32, context: int = 4):
        self.context = context
        self.embed = nnx.Embed(256, dim, rngs=rngs)
        self.hidden = nnx.Linear(context * dim, 128, rngs=rngs)
        self.out = nnx.Linear(128, 256, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        padded = jnp.pad(tokens, ((0, 0), (self.context - 1, 0)))
        windows = jnp.stack(
            [padded[:, i : i + tokens.shape[1]] for i in range(self.context)], axis=-1
        )
        h = self.embed(windows).reshape(*tokens.shape, -1)
        return self.out(jax.nn.gelu(self.hidden(h)))


def token_loss(model: BigramMLP, batch: dict, rng: jax.Array) -> jaxga.Mean:
    logits = model(batch["inputs"])
    return jaxga.token_cross_entropy(logits, batch["labels"], batch["mask"])


def naive_loss(model: BigramMLP, batch: dict, rng: jax.Array) -> jax.Array:
    return token_loss(model, batch, rng).value  # the micro-batch's own mean: the classic bug


def run(loss, microbatches: int, steps: int, data, batch_size: int, lr: float) -> dict:
    graphdef, params, rest = nnx.split(BigramMLP(nnx.Rngs(0)), nnx.Param, ...)
    step_fn = jaxga.make_train_step(jaxga.nnx_loss(graphdef, loss), microbatches)
    state = jaxga.TrainState.create(params=params, tx=optax.adam(lr), model_state=rest)
    history = {"loss": [], "grad_norm": []}
    for step in range(steps):
        state, metrics = step_fn(state, batch_at(step, *data, batch_size, seed=0))
        history["loss"].append(float(metrics["loss"]))
        history["grad_norm"].append(float(metrics["grad_norm"]))
    return history


def plot(runs: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    styles = {
        "naive, batch 16 × 1": ("tab:red", "-", 2.5),
        "naive, 16 micro-batches × 1": ("tab:orange", "--", 1.5),
        "jaxga.Mean, batch 16 × 1": ("tab:blue", "-", 2.5),
        "jaxga.Mean, 16 micro-batches × 1": ("tab:cyan", "--", 1.5),
    }
    for name, history in runs.items():
        color, style, width = styles[name]
        for ax, key in zip(axes, ("loss", "grad_norm")):
            ax.plot(history[key], color=color, linestyle=style, linewidth=width, label=name)
    for label, color in (("naive", "tab:orange"), ("jaxga.Mean", "tab:cyan")):
        one, many = runs[f"{label}, batch 16 × 1"], runs[f"{label}, 16 micro-batches × 1"]
        gap = np.abs(np.subtract(many["loss"], one["loss"])) + 1e-9
        axes[2].plot(gap, color=color, label=label)
    axes[0].set(title="training loss (as each run reports it)", xlabel="step", ylabel="loss")
    axes[1].set(title="gradient L2 norm", xlabel="step", ylabel="‖g‖", yscale="log")
    axes[2].set(
        title="|loss(16 micro-batches) − loss(batch 16)|",
        xlabel="step",
        ylabel="gap",
        yscale="log",
    )
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.suptitle("Variable-length documents: naive micro-batch means vs exact jaxga.Mean")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", type=Path, default=Path("docs/normalization.png"))
    args = p.parse_args(argv)
    batch_size = 16
    data = pack(documents(None), args.seq_len)
    runs = {}
    for label, loss in (("naive", naive_loss), ("jaxga.Mean", token_loss)):
        runs[f"{label}, batch 16 × 1"] = run(loss, 1, args.steps, data, batch_size, args.lr)
        runs[f"{label}, 16 micro-batches × 1"] = run(
            loss, batch_size, args.steps, data, batch_size, args.lr
        )
    gaps = {}
    for label in ("naive", "jaxga.Mean"):
        a, b = runs[f"{label}, batch 16 × 1"], runs[f"{label}, 16 micro-batches × 1"]
        gaps[label] = float(np.max(np.abs(np.subtract(a["loss"], b["loss"]))))
        print(
            f"{label:>10}: max |loss(k=1) − loss(k=16)| over {args.steps} steps = {gaps[label]:.2e}"
        )
    plot(runs, args.out)
    args.out.with_suffix(".json").write_text(json.dumps({"runs": runs, "max_loss_gap": gaps}))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
