"""The models the benchmark trains: a residual MLP and the example's transformer LM."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxga
from jaxga.planner import remat_options

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import train_lm

# The example's --remat table lacks this policy; the benchmark measures it too.
train_lm.REMAT.setdefault("dots_no_batch", ("dots_no_batch", 1))
Loss = Callable[[Any, Any], jaxga.Mean]


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, its parameters and one global batch.

    Attributes:
        name: short name (a table heading).
        description: the model's shape in words.
        params: the parameters (arrays).
        batch: the global batch (arrays with a leading batch axis).
        loss_for: ``loss_for(remat)`` is ``loss(params, batch) -> jaxga.Mean`` with the
            model's layers rematerialised by the remat name (``"none"``, ``"dots"``,
            ``"dots_no_batch"``, ``"full"``, ``"sqrt"``).
    """

    name: str
    description: str
    params: Any
    batch: dict[str, jax.Array]
    loss_for: Callable[[str], Loss]

    @property
    def batch_size(self) -> int:
        return int(jax.tree.leaves(self.batch)[0].shape[0])


def mlp(batch: int, features: int, dim: int, hidden: int, layers: int, classes: int) -> Workload:
    """A residual MLP ``x + W2 gelu(W1 norm(x))`` of ``layers`` blocks in ``remat_scan``."""
    keys = jax.random.split(jax.random.key(0), 6)

    def normal(key, shape):
        return jax.random.normal(key, shape) / np.sqrt(shape[-2])

    params = {
        "inp": normal(keys[0], (features, dim)),
        "blocks": {
            "scale": jnp.ones((layers, dim)),
            "w1": normal(keys[1], (layers, dim, hidden)),
            "w2": normal(keys[2], (layers, hidden, dim)),
        },
        "out": normal(keys[3], (dim, classes)),
    }
    data = {
        "x": jax.random.normal(keys[4], (batch, features)),
        "y": jax.random.randint(keys[5], (batch,), 0, classes),
    }

    def block(p, x):
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        h = (x - mean) * jax.lax.rsqrt(var + 1e-6) * p["scale"]
        return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]

    def loss_for(remat: str) -> Loss:
        def loss(params, batch):
            x = batch["x"] @ params["inp"]
            x = jaxga.remat_scan(block, params["blocks"], x, **remat_options(remat))
            logits = x @ params["out"]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
            return jaxga.Mean.of(ce)

        return loss

    n = sum(x.size for x in jax.tree.leaves(params))
    description = (
        f"residual MLP, {layers} blocks {dim}→{hidden}→{dim}, {n / 1e6:.2f}M params, batch {batch}"
    )
    return Workload("MLP", description, params, data, loss_for)


def transformer(name: str, batch: int, seq_len: int, dim: int, heads: int, layers: int) -> Workload:
    """The byte-level transformer of ``examples/train_lm.py`` on its own corpus."""
    cfg = train_lm.Config(seq_len, dim, heads, layers, dropout=0.0, remat="none")
    model = train_lm.Transformer(cfg, nnx.Rngs(0))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    tokens, lengths = train_lm.pack(train_lm.documents(None), seq_len)
    data = jax.tree.map(jnp.asarray, train_lm.batch_at(0, tokens, lengths, batch, seed=0))

    def loss_for(remat: str) -> Loss:
        candidate = dataclasses.replace(cfg, remat=remat)
        graphdef = nnx.split(
            nnx.eval_shape(lambda: train_lm.Transformer(candidate, nnx.Rngs(0))), nnx.Param, ...
        )[0]

        def loss(params, batch):
            return train_lm.loss(nnx.merge(graphdef, params, rest), batch, None)

        return loss

    n = sum(x.size for x in jax.tree.leaves(params))
    description = (
        f"decoder-only transformer (examples/train_lm.py), {layers} layers, dim {dim}, "
        f"{heads} heads, {n / 1e6:.2f}M params, batch {batch} × {seq_len} tokens"
    )
    return Workload(name, description, params, data, loss_for)


def remat_names(policy: str) -> str:
    """How a remat name reads in the table."""
    return {"sqrt": "full, √L segments"}.get(policy, policy)


def workloads(quick: bool, only: int | None = None) -> list[Workload]:
    """The benchmark's workloads (small enough for a CPU with ``quick``), or the ``only``-th."""
    if quick:
        makers = [
            lambda: mlp(batch=256, features=128, dim=256, hidden=1024, layers=4, classes=10),
            lambda: transformer("Transformer S", batch=32, seq_len=64, dim=64, heads=4, layers=2),
            lambda: transformer("Transformer M", batch=32, seq_len=64, dim=128, heads=4, layers=4),
        ]
    else:
        makers = [
            lambda: mlp(batch=4096, features=512, dim=1024, hidden=4096, layers=8, classes=1000),
            lambda: transformer("Transformer S", 64, seq_len=256, dim=256, heads=8, layers=4),
            lambda: transformer("Transformer M", 64, seq_len=512, dim=768, heads=12, layers=12),
        ]
    return [make() for i, make in enumerate(makers) if only is None or i == only]
