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
from jaxga.remat import remat_options

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import train_lm
from train_lm import peak_flops

__all__ = ["Workload", "names", "peak_flops", "workloads"]
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
        model_flops: FLOPs of one training step on the whole batch, no recomputation
            (6 per parameter of the matrix products per example, plus attention): MFU's
            numerator.
    """

    name: str
    description: str
    params: Any
    batch: dict[str, jax.Array]
    loss_for: Callable[[str], Loss]
    model_flops: float

    @property
    def batch_size(self) -> int:
        return int(jax.tree.leaves(self.batch)[0].shape[0])


def mlp(
    batch: int, features: int, dim: int, hidden: int, layers: int, classes: int, dtype: str
) -> Workload:
    """A residual MLP ``x + W2 gelu(W1 norm(x))`` of ``layers`` blocks in ``remat_scan``,
    its matrix products in ``dtype`` (float32 parameters)."""
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
        h = jax.nn.gelu(h.astype(dtype) @ p["w1"].astype(dtype))
        return x + (h @ p["w2"].astype(dtype)).astype(x.dtype)

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
        f"residual MLP, {layers} blocks {dim}→{hidden}→{dim}, {n / 1e6:.2f}M params, "
        f"batch {batch}, {dtype} matmuls"
    )
    matmul_params = features * dim + 2 * layers * dim * hidden + dim * classes
    return Workload("MLP", description, params, data, loss_for, 6.0 * matmul_params * batch)


def transformer(
    name: str, batch: int, seq_len: int, dim: int, heads: int, layers: int, dtype: str
) -> Workload:
    """The byte-level transformer of ``examples/train_lm.py`` on its own corpus."""
    cfg = train_lm.Config(seq_len, dim, heads, layers, dropout=0.0, remat="none", dtype=dtype)
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
        f"{heads} heads, {n / 1e6:.2f}M params, batch {batch} × {seq_len} tokens, "
        f"{dtype} matmuls"
    )
    flops = cfg.flops_per_token() * batch * seq_len
    return Workload(name, description, params, data, loss_for, flops)


def remat_names(policy: str) -> str:
    """How a remat name reads in the table."""
    return {"sqrt": "full, √L segments"}.get(policy, policy)


def _makers(quick: bool, dtype: str) -> dict[str, Callable[[], Workload]]:
    if quick:
        return {
            "MLP": lambda: mlp(
                256, features=128, dim=256, hidden=1024, layers=4, classes=10, dtype=dtype
            ),
            "Transformer S": lambda: transformer("Transformer S", 32, 64, 64, 4, 2, dtype),
            "Transformer M": lambda: transformer("Transformer M", 32, 64, 128, 4, 4, dtype),
        }
    return {
        "MLP": lambda: mlp(
            4096, features=512, dim=1024, hidden=4096, layers=8, classes=1000, dtype=dtype
        ),
        "Transformer S": lambda: transformer("Transformer S", 64, 256, 256, 8, 4, dtype),
        "Transformer M": lambda: transformer("Transformer M", 64, 512, 768, 12, 12, dtype),
    }


def names(quick: bool) -> list[str]:
    """The workloads' names, in order."""
    return list(_makers(quick, "float32"))


def workloads(quick: bool, dtype: str = "float32", only: int | None = None) -> list[Workload]:
    """The benchmark's workloads (small enough for a CPU with ``quick``), or the ``only``-th."""
    makers = list(_makers(quick, dtype).values())
    return [make() for i, make in enumerate(makers) if only is None or i == only]
