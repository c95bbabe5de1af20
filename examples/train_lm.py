"""Trains a small decoder-only transformer (Flax NNX) with exact gradient accumulation.

The default corpus is the source of the Python standard library that runs this
script, split into top-level definitions: documents of very different lengths, padded
and masked, which is exactly where a mean of micro-batch means goes wrong and
``jaxga.Mean`` does not. Bytes are the tokens, so there is nothing to download.

    python examples/train_lm.py --steps 200 --batch-size 32 --microbatches 4 --remat full
    python examples/train_lm.py --data my_corpus.txt --resume

On a GPU the matrix products run in bfloat16 (float32 parameters, gradients and
accumulation), attention is cuDNN's fused kernel, and the progress bar shows tokens/s and
MFU. GPT-2-small's shape on an H100:

    python examples/train_lm.py --seq-len 512 --dim 768 --heads 12 --layers 12 \
        --batch-size 64 --microbatches 4 --remat dots

``--resume`` continues bit for bit: batches are a function of the step, and on a GPU the
script asks XLA for deterministic reductions (``--xla_gpu_deterministic_ops``).

A padded row wastes its padding (16 % of the default corpus's tokens). ``--pack`` packs
several documents to a row with Grain's first-fit packing, attention kept within each;
``--tokens-per-step`` fixes the global batch in real tokens rather than rows, skipping
the micro-batches a step leaves empty (one compiled step for every count):

    python examples/train_lm.py --pack --tokens-per-step 3072 --normalize sequence_mean

``--stages S`` (with ``--devices``) splits the blocks into a pipeline of S stages over a
``"stage"`` mesh axis beside ``"data"`` (``jaxga.pipeline_scan``; ``--schedule gpipe``,
``circular``, or ``1f1b``, whose loss head runs on the last stage through
``jaxga.pipeline_loss``), with the losses of one device, to float32 rounding
(docs/pipeline.md):

    python examples/train_lm.py --devices 8 --stages 4 --layers 8 --schedule circular
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import re
import sys
import sysconfig
import time
from itertools import chain, count
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

import jaxga
from jaxga.remat import REMAT, remat_options

VOCAB = 256  # bytes


class UsageError(Exception):
    """A bad command-line input: reported in one line, exit code 2, nothing written."""


# --------------------------------------------------------------------------- data


def documents(path: Path | None, min_bytes: int = 16) -> list[bytes]:
    """Returns the corpus as documents: the parts of each text file that a blank line and
    an unindented line begin (top-level definitions in code, paragraphs in prose)."""
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.glob("*.py"))
    elif not path.exists():
        raise UsageError(f"--data {path}: no such file or folder")
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        files = [path]
    docs = []
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for chunk in re.split(r"\n[ \t]*\n(?=\S)", text):
            if len(chunk.strip()) >= min_bytes:
                docs.append(chunk.encode("utf-8"))
    if not docs:
        raise UsageError(f"--data {path}: holds no UTF-8 text of at least {min_bytes} bytes")
    return docs


def pack(docs: list[bytes], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Truncates each document to ``seq_len + 1`` bytes and pads it to that length: the
    sequences that both row layouts hold. Returns tokens ``[docs, seq_len + 1]`` and lengths."""
    tokens = np.zeros((len(docs), seq_len + 1), np.int32)
    lengths = np.zeros(len(docs), np.int32)
    for i, doc in enumerate(docs):
        doc = doc[: seq_len + 1]
        tokens[i, : len(doc)] = np.frombuffer(doc, np.uint8)
        lengths[i] = len(doc)
    return tokens, lengths


def padded_rows(tokens: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
    """One sequence a row, padded at its end: ``[rows, seq_len]`` inputs, labels and mask.

    No ``segment_ids``: a row is one sequence, and the causal mask alone keeps its tokens
    from the padding after them (so on a GPU, cuDNN's causal kernel needs no mask tensor).
    """
    seq_len = tokens.shape[1] - 1
    real = np.arange(seq_len) < lengths[:, None] - 1
    return {"inputs": tokens[:, :-1], "labels": tokens[:, 1:], "mask": real.astype(np.float32)}


def packed_rows(tokens: np.ndarray, lengths: np.ndarray, bins: int = 1024) -> dict[str, np.ndarray]:
    """The same sequences packed several to a row by Grain's first-fit packing.

    Sequence ``i`` is ``inputs = tokens[i, :n - 1]``, ``labels = tokens[i, 1:n]`` with
    ``n = lengths[i]``; Grain numbers a row's sequences 1, 2, ... (``segment_ids``, 0 on
    padding) and restarts ``positions`` at each. Done once, before training: 0.2 s for the
    4.7k sequences of the default corpus on 2 CPU cores.
    """
    seq_len = tokens.shape[1] - 1
    sequences = [{"inputs": t[: n - 1], "labels": t[1:n]} for t, n in zip(tokens, lengths)]
    packed = grain.experimental.FirstFitPackIterDataset(
        # in memory already: no reading threads (Grain's advice; they would contend for the GIL)
        grain.MapDataset.source(sequences).to_iter_dataset(grain.ReadOptions(num_threads=0)),
        length_struct={"inputs": seq_len, "labels": seq_len},
        num_packing_bins=bins,
        shuffle_bins=False,  # rows are drawn at random per step anyway
    )
    rows = list(packed)
    column = {key: np.stack([row[key] for row in rows]) for key in rows[0]}
    return {
        "inputs": column["inputs"],
        "labels": column["labels"],
        "mask": (column["inputs_segment_ids"] > 0).astype(np.float32),
        "segment_ids": column["inputs_segment_ids"],
        "positions": column["inputs_positions"],
    }


def padding_fraction(rows: dict[str, np.ndarray]) -> float:
    """The fraction of the rows' label slots that count no token."""
    return 1.0 - float(rows["mask"].mean())


def rows_at(step: int, num_rows: int, size: int, seed: int) -> np.ndarray:
    """The rows of step ``step``: a function of the step alone, so resuming is exact."""
    return np.random.default_rng([seed, step]).choice(num_rows, size, replace=False)


def take(rows: dict[str, np.ndarray], index: np.ndarray) -> dict[str, np.ndarray]:
    """The rows ``index`` of every feature."""
    return {key: value[index] for key, value in rows.items()}


def batch_at(step: int, tokens: np.ndarray, lengths: np.ndarray, size: int, seed: int) -> dict:
    """The padded batch of step ``step`` (``pack``'s sequences, one a row)."""
    index = rows_at(step, len(tokens), size, seed)
    return padded_rows(tokens[index], lengths[index])


def token_budget_schedule(
    real_tokens: np.ndarray, budget: int, max_rows: int, steps: int, seed: int
) -> list[np.ndarray]:
    """The rows of steps ``0..steps-1`` when each step holds at most ``budget`` real tokens.

    The rows are walked in order, epoch after epoch, each epoch in the order of a
    permutation drawn from ``[seed, epoch]``; a step takes the next rows while their real
    tokens (``real_tokens[row]``) stay within the budget, at least one and at most
    ``max_rows``. Computed from step 0 on every start (cheap), so a resumed run takes the
    same rows.
    """
    epochs = (np.random.default_rng([seed, e]).permutation(len(real_tokens)) for e in count())
    order = chain.from_iterable(epochs)
    row = next(order)
    schedule = []
    for _ in range(steps):
        rows, total = [], 0
        while len(rows) < max_rows and (not rows or total + real_tokens[row] <= budget):
            rows.append(row)
            total += real_tokens[row]
            row = next(order)
        schedule.append(np.array(rows))
    return schedule


def budget_batch(
    rows: dict[str, np.ndarray], index: np.ndarray, k: int, m: int
) -> tuple[dict, int]:
    """The rows ``index`` as a batch of ``k`` micro-batches of ``m`` rows, and ``n``, the
    number that hold them: micro-batch ``i < n`` holds ``index[i·m : (i+1)·m]`` (the last
    filled up with all-zero rows, which count nothing), micro-batches ``n..k-1`` are all
    zeros, and ``jaxga.merge_microbatches`` lays them out as the train step splits them."""
    n = -(-len(index) // m)
    stacked = {}
    for key, value in rows.items():
        padded = np.zeros((k * m, *value.shape[1:]), value.dtype)
        padded[: len(index)] = value[index]
        stacked[key] = padded.reshape(k, m, *value.shape[1:])
    return jaxga.merge_microbatches(stacked), n


@dataclasses.dataclass(frozen=True)
class Batches:
    """The batches of a run, each a function of its step (so resuming is exact): ``size``
    rows drawn at random, or, with a ``schedule`` (``--tokens-per-step``), its rows in
    ``k`` micro-batches of ``size // k``."""

    rows: dict[str, np.ndarray]
    size: int
    seed: int
    k: int = 1
    schedule: list[np.ndarray] | None = None

    def __call__(self, step: int) -> tuple[dict, int | None, int]:
        """Step ``step``'s batch, its number of real micro-batches (None: all) and its
        real tokens (labels counted)."""
        if self.schedule is None:
            batch = take(self.rows, rows_at(step, len(self.rows["mask"]), self.size, self.seed))
            return batch, None, int(batch["mask"].sum())
        index = self.schedule[step]
        batch, n = budget_batch(self.rows, index, self.k, self.size // self.k)
        return batch, n, int(self.rows["mask"][index].sum())


# --------------------------------------------------------------------------- model


class Block(nnx.Module):
    """A pre-norm transformer block with causal self-attention.

    Activations and matrix products are in ``dtype``; parameters are float32 (mixed
    precision: float32 master weights, so float32 gradients), and layer norms compute
    their statistics in float32.
    """

    def __init__(self, dim: int, heads: int, dtype: str, rngs: nnx.Rngs):
        self.heads = heads
        self.norm1 = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(dim, dim, dtype=dtype, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, same_segment: jax.Array | None) -> jax.Array:
        """``same_segment`` ``[batch, 1, length, length]``: which tokens a token may attend
        to besides the causal mask (those of its own sequence); None: all."""
        batch, length, dim = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(batch, length, 3 * self.heads, dim // self.heads)
        q, k, v = jnp.split(qkv, 3, axis=2)
        # cuDNN's fused (flash) attention on a GPU in 16 bits; XLA's everywhere else. Packed
        # rows add a segment mask, which cuDNN takes as a dense additive bias (its
        # ScaleBiasSoftmax kernels; jax.nn.dot_product_attention exposes no packed layout);
        # padded rows need the causal mask alone. Not timed on a GPU.
        fused = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
        attn = jax.nn.dot_product_attention(
            q, k, v, mask=same_segment, is_causal=True, implementation="cudnn" if fused else None
        )
        x = x + self.out(attn.reshape(batch, length, dim))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Transformer(nnx.Module):
    """A byte-level decoder whose blocks are stacked and run by ``jaxga.remat_scan``."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(VOCAB, cfg.dim, dtype=cfg.dtype, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.seq_len, cfg.dim)))
        self.drop = nnx.Dropout(cfg.dropout)

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return Block(cfg.dim, cfg.heads, cfg.dtype, rngs)

        self.blocks = blocks(rngs)
        self.norm = nnx.LayerNorm(cfg.dim, dtype=cfg.dtype, rngs=rngs)

    def __call__(
        self,
        tokens: jax.Array,
        rng: jax.Array | None = None,
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        """Next-byte logits for ``tokens`` ``[batch, length]``.

        In packed rows ``segment_ids`` numbers each token's sequence (0: padding) and
        attention stays within a sequence; ``positions`` counts from each sequence's start.
        Without them, a row is one sequence at positions ``0, 1, ...``.
        """
        x, same_segment = self.inputs(tokens, rng, segment_ids, positions)
        graphdef, stacked = nnx.split(self.blocks)
        if self.cfg.stages > 1:  # the blocks split into stages, laid out over "stage"

            def block(layer: Any, carry: tuple) -> tuple:  # the mask streams with its rows
                h, same = carry
                return nnx.merge(graphdef, layer)(h, same), same

            x, _ = jaxga.pipeline_scan(
                block,
                stacked,
                (x, same_segment),
                num_microbatches=self.cfg.pipeline_microbatches,
                schedule=self.cfg.schedule,
                repeats=self.cfg.repeats,
                policy=remat_options(self.cfg.remat)["policy"],
            )
        else:
            x = jaxga.remat_scan(
                lambda layer, h: nnx.merge(graphdef, layer)(h, same_segment),
                stacked,
                x,
                **layer_options(self.cfg.remat),
            )
        return self.logits(x)

    def inputs(self, tokens: jax.Array, rng: Any, segment_ids: Any, positions: Any) -> tuple:
        """The first block's input ``[batch, length, dim]``, and which tokens may attend to
        which (``[batch, 1, length, length]``, None without ``segment_ids``)."""
        # A one-hot product rather than a gather: its gradient is a matrix product, not a
        # scatter-add, so it is deterministic on a GPU, and cheap for 256 tokens.
        onehot = jax.nn.one_hot(tokens, VOCAB, dtype=self.embed.embedding.dtype)
        x = onehot @ self.embed.embedding[...] + self.position(positions, tokens.shape[-1])
        x = self.drop(x.astype(self.cfg.dtype), deterministic=rng is None, rngs=rng)
        if segment_ids is None:
            return x, None
        return x, (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]

    def logits(self, x: jax.Array) -> jax.Array:
        """The last block's output to next-byte logits (the embedding, tied)."""
        return self.embed.attend(self.norm(x)).astype(jnp.float32)

    def pipelined_loss(self, batch: dict, rng: Any, normalize: str) -> jaxga.Mean:
        """``loss`` under 1F1B (``jaxga.pipeline_loss``): the head (final norm, the tied
        embedding and the cross-entropy) runs on the last stage as each micro-batch leaves
        it. Packed rows' segment ids stream with their rows (as float32, a carry the
        stages' gradients pass through), each block making its attention mask from them."""
        segment_ids = batch.get("segment_ids")
        x, _ = self.inputs(batch["inputs"], rng, None, batch.get("positions"))
        graphdef, stacked = nnx.split(self.blocks)
        head_graphdef, head = nnx.split((self.norm, self.embed))

        def block(layer: Any, carry: tuple) -> tuple:
            h, ids = carry
            same = None if ids is None else (ids[:, :, None] == ids[:, None, :])[:, None]
            return nnx.merge(graphdef, layer)(h, same), ids

        def head_fn(head: Any, carry: tuple, targets: dict) -> jaxga.Mean:
            (norm, embed), (y, _) = nnx.merge(head_graphdef, head), carry  # y: its rows
            logits = embed.attend(norm(y)).astype(jnp.float32)
            labels, mask, ids = targets["labels"], targets["mask"], targets.get("segment_ids")
            return jaxga.token_cross_entropy(
                logits, labels, mask, normalize=normalize, segment_ids=ids
            )

        targets = {k: batch[k] for k in ("labels", "mask", "segment_ids") if k in batch}
        ids = None if segment_ids is None else segment_ids.astype(jnp.float32)  # exact < 2**24
        return jaxga.pipeline_loss(
            block,
            head_fn,
            (stacked, head),
            (x, ids),
            targets,
            num_microbatches=self.cfg.pipeline_microbatches,
            policy=remat_options(self.cfg.remat)["policy"],
        )

    def position(self, positions: jax.Array | None, length: int) -> jax.Array:
        """The position embedding of ``positions`` (None: ``0..length-1``). A one-hot
        product, as for the tokens, at full precision: exactly the rows of ``self.pos``."""
        if positions is None:
            return self.pos[:length]
        onehot = jax.nn.one_hot(positions, self.cfg.seq_len, dtype=self.pos.dtype)
        return jnp.matmul(onehot, self.pos[...], precision=jax.lax.Precision.HIGHEST)


def layer_options(remat: str) -> dict[str, Any]:
    """``jaxga.remat_scan``'s options for a remat name; without remat the layers are unrolled
    (docs/remat.md#unrolled-layers)."""
    return remat_options(remat) | {"unroll": remat == "none"}


@dataclasses.dataclass(frozen=True)
class Config:
    """The model's shape; saved with checkpoints so that a resume uses the same model."""

    seq_len: int = 128
    dim: int = 128
    heads: int = 4
    layers: int = 4
    dropout: float = 0.1
    remat: str = "full"
    dtype: str = "float32"  # of the matrix products; parameters are always float32
    stages: int = 1  # pipeline stages (a "stage" mesh axis); 1: no pipeline
    schedule: str = "gpipe"  # with stages: "gpipe", "circular" (2 chunks a stage) or "1f1b"
    pipeline_microbatches: int = 1  # with stages: the pipeline's micro-batches

    @property
    def repeats(self) -> int:
        return 2 if self.schedule == "circular" else 1

    def flops_per_token(self) -> float:
        """Model FLOPs per token of a training step (PaLM, appendix B): 6 per parameter of
        the matrix products, plus 12·L·d·S for attention; recomputation not counted."""
        matmul_params = self.layers * 12 * self.dim**2 + VOCAB * self.dim
        return 6 * matmul_params + 12 * self.layers * self.dim * self.seq_len


# Dense tensor-core peaks of the SXM parts (vendors' datasheets), TFLOP/s: the MFU's
# denominator. At JAX's default precision these GPUs run float32 matmuls as TF32.
PEAK_TFLOPS = {
    "H100": {"bfloat16": 989.0, "float32": 494.7},
    "H200": {"bfloat16": 989.0, "float32": 494.7},
    "A100": {"bfloat16": 312.0, "float32": 156.0},
}


def peak_flops(dtype: str, device: jax.Device | None = None) -> float | None:
    """The device's peak FLOP/s for matrix products in ``dtype``; None where not known."""
    kind = (device or jax.devices()[0]).device_kind
    return next((v[dtype] * 1e12 for k, v in PEAK_TFLOPS.items() if k in kind), None)


def loss(
    model: Transformer, batch: dict, rng: jax.Array, normalize: str = "token_mean"
) -> jaxga.Mean:
    """Cross-entropy over the real tokens, kept as a ``jaxga.Mean``: a mean per token, or
    per sequence (``--normalize``). A batch without ``segment_ids`` (padded rows) holds one
    sequence a row."""
    if model.cfg.stages > 1 and model.cfg.schedule == "1f1b":
        return model.pipelined_loss(batch, rng, normalize)
    segment_ids = batch.get("segment_ids")
    logits = model(batch["inputs"], rng, segment_ids=segment_ids, positions=batch.get("positions"))
    return jaxga.token_cross_entropy(
        logits, batch["labels"], batch["mask"], normalize=normalize, segment_ids=segment_ids
    )


def sample(model: Transformer, prompt: str, length: int, key: jax.Array) -> str:
    """Draws ``length`` bytes after ``prompt`` at temperature 0.8."""
    seq_len = model.cfg.seq_len
    tokens = np.zeros((1, seq_len), np.int32)
    text = list(prompt.encode())[-seq_len:]
    tokens[0, : len(text)] = text
    step = nnx.jit(lambda m, t: m(t))
    out = bytearray(text)
    for i in range(length):
        pos = min(len(out), seq_len) - 1
        logits = step(model, jnp.asarray(tokens))[0, pos]
        nxt = int(jax.random.categorical(jax.random.fold_in(key, i), logits / 0.8))
        out.append(nxt)
        window = list(out[-seq_len:])
        tokens[0, : len(window)] = window
    return out.decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- training


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400, help="train until this step")
    p.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="global batch in rows: one document each, several with --pack",
    )
    p.add_argument(
        "--pack",
        action="store_true",
        help="pack several documents to a row (Grain's first-fit packing) instead of padding",
    )
    p.add_argument(
        "--tokens-per-step",
        type=int,
        default=None,
        metavar="N",
        help="at most N real tokens a step (labels counted), in as many rows as they fill, "
        "up to --batch-size: micro-batches left empty are skipped",
    )
    p.add_argument(
        "--normalize",
        choices=("token_mean", "sequence_mean", "sequence_sum"),
        default="token_mean",
        help="the loss: a mean over tokens, a mean over sequences of their token means, or "
        "the tokens' summed loss divided by the number of sequences",
    )
    p.add_argument(
        "--microbatches",
        type=microbatches,
        default=None,
        help="micro-batches per step, or 'auto': the fewest that fit --memory-budget "
        "(default: auto where the device reports a memory limit, else 4; 4 with "
        "--tokens-per-step)",
    )
    p.add_argument(
        "--memory-budget",
        default=None,
        help="with --microbatches auto: bytes per device, e.g. 40MiB (default: 90%% of its memory)",
    )
    p.add_argument(
        "--plan",
        metavar="BUDGET",
        default=None,
        help="choose --microbatches, --remat, --strategy and --offload (overriding them) with "
        "jaxga.plan for a per-device memory budget, e.g. 2GiB ('device': 90%% of its memory)",
    )
    p.add_argument("--remat", choices=tuple(REMAT), default=Config.remat)
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="of the matrix products (default: bfloat16 on a GPU, float32 elsewhere)",
    )
    p.add_argument("--seq-len", type=int, default=Config.seq_len)
    p.add_argument("--dim", type=int, default=Config.dim)
    p.add_argument("--heads", type=int, default=Config.heads)
    p.add_argument("--layers", type=int, default=Config.layers)
    p.add_argument("--dropout", type=float, default=Config.dropout)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, default=None, help="a text file or folder of your own")
    p.add_argument(
        "--checkpoint-dir", type=Path, default=Path("runs/train_lm"), help="orbax checkpoints"
    )
    p.add_argument("--save-every", type=int, default=50, help="also save at the last step")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--sample", type=int, default=120, help="bytes of sample text at the end")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--devices", type=int, default=1, help="data-parallel devices (a 'data' mesh)")
    p.add_argument(
        "--strategy",
        choices=jaxga.sharding.STRATEGIES,
        default="data_parallel",
        help="with --devices: the state replicated, or sharded (see docs/distributed.md)",
    )
    p.add_argument("--offload", action="store_true", help="keep the optimiser state in host memory")
    p.add_argument(
        "--stages",
        type=int,
        default=1,
        help="with --devices: pipeline stages of the blocks (docs/pipeline.md)",
    )
    p.add_argument("--schedule", choices=("gpipe", "circular", "1f1b"), default="gpipe")
    p.add_argument(
        "--pipeline-microbatches", type=int, default=None, help="with --stages; default: stages"
    )
    return p.parse_args(argv)


def microbatches(value: str) -> int | str:
    """``--microbatches``: a count, or ``auto``."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or 'auto'; got {value!r}") from None


def device_has_memory_limit() -> bool:
    return "bytes_limit" in (jax.local_devices()[0].memory_stats() or {})


def check_args(args: argparse.Namespace) -> None:
    if args.microbatches is None:
        auto = device_has_memory_limit() and args.tokens_per_step is None
        args.microbatches = "auto" if auto else 4
    if args.tokens_per_step is not None and (args.plan is not None or args.microbatches == "auto"):
        option = "--plan" if args.plan is not None else "--microbatches auto"
        raise UsageError(f"--tokens-per-step needs a fixed --microbatches; {option} chooses it")
    if args.microbatches == "auto" and args.memory_budget is None and not device_has_memory_limit():
        raise UsageError(
            f"--microbatches auto: the {jax.default_backend()} device reports no memory limit; "
            f"give --memory-budget, e.g. 40MiB"
        )
    if args.memory_budget is not None and args.microbatches != "auto":
        raise UsageError("--memory-budget is for --microbatches auto")
    if args.memory_budget is not None:
        try:
            jaxga.parse_bytes(args.memory_budget, name="memory-budget")
        except ValueError:
            raise UsageError(
                f"--memory-budget {args.memory_budget!r} is not a size; expected e.g. 40MiB"
            ) from None
    for name in (
        "steps",
        "batch_size",
        "seq_len",
        "dim",
        "heads",
        "layers",
        "save_every",
        "devices",
    ):
        if getattr(args, name) < 1:
            raise UsageError(
                f"--{name.replace('_', '-')} must be positive; got {getattr(args, name)}"
            )
    if args.devices > jax.device_count():
        raise UsageError(f"--devices {args.devices}: this machine has {jax.device_count()}")
    fixed = args.plan is None and args.microbatches != "auto"
    if fixed and (args.microbatches < 1 or args.batch_size % (args.devices * args.microbatches)):
        raise UsageError(
            f"--batch-size {args.batch_size} is not divisible by --devices {args.devices} × "
            f"--microbatches {args.microbatches}"
        )
    if args.dim % args.heads:
        raise UsageError(f"--dim {args.dim} is not divisible by --heads {args.heads}")
    if not 0 <= args.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1); got {args.dropout}")
    if args.tokens_per_step is not None:
        check_token_budget(args)
    check_stages(args)


def check_stages(args: argparse.Namespace) -> None:
    """``--stages``: a pipeline over a ``"stage"`` axis beside ``"data"``, checked."""
    if args.pipeline_microbatches is None:
        args.pipeline_microbatches = args.stages
    if args.stages == 1:
        return
    repeats = 2 if args.schedule == "circular" else 1
    if args.stages < 1 or args.devices % args.stages:
        raise UsageError(f"--stages {args.stages} must divide --devices {args.devices}")
    if args.layers % (args.stages * repeats):
        raise UsageError(
            f"--layers {args.layers} must be a multiple of --stages {args.stages} × {repeats} "
            f"(--schedule {args.schedule})"
        )
    if args.plan is not None or args.microbatches == "auto" or args.strategy != "data_parallel":
        raise UsageError("--stages needs a fixed --microbatches and --strategy data_parallel")
    rows = args.batch_size // (args.devices // args.stages) // args.microbatches
    if args.pipeline_microbatches < args.stages or rows % args.pipeline_microbatches:
        raise UsageError(
            f"--pipeline-microbatches {args.pipeline_microbatches} must be at least --stages "
            f"{args.stages} and divide a micro-batch's {rows} rows on a device"
        )


def pipeline_specs(params: Any) -> Any:
    """The layout of ``params`` over the ``("data", "stage")`` mesh: each stage's blocks on
    it (the stacked layer axis split over ``"stage"``), the rest on every device."""

    def spec(path: tuple, _: Any) -> jax.sharding.PartitionSpec:
        stacked = any(getattr(key, "key", None) == "blocks" for key in path)
        return jax.P("stage") if stacked else jax.P()

    return jax.tree_util.tree_map_with_path(spec, params)


def mesh_of(args: argparse.Namespace) -> jax.sharding.Mesh | None:
    """``("data",)`` over ``--devices``; with ``--stages``, ``("data", "stage")``."""
    if args.devices == 1:
        return None
    if args.stages > 1:
        return jax.make_mesh((args.devices // args.stages, args.stages), ("data", "stage"))
    return jax.make_mesh((args.devices,), ("data",))


def check_token_budget(args: argparse.Namespace) -> None:
    """``--tokens-per-step``: a budget that one sequence fits and a step's rows can carry."""
    n, rows = args.tokens_per_step, args.batch_size
    if n < args.seq_len:
        raise UsageError(
            f"--tokens-per-step {n} is less than one sequence (--seq-len {args.seq_len})"
        )
    if n > rows * args.seq_len:
        raise UsageError(
            f"--tokens-per-step {n} is more than --batch-size {rows} rows of --seq-len "
            f"{args.seq_len} carry ({rows * args.seq_len})"
        )


def optimizer(lr: float) -> optax.GradientTransformation:
    schedule = optax.linear_schedule(0.0, lr, transition_steps=20)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.01),
    )


def checkpointer(directory: Path) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    return ocp.CheckpointManager(directory.resolve(), options=options)


def restore(
    manager: ocp.CheckpointManager, state: jaxga.TrainState, shardings: Any = None
) -> jaxga.TrainState:
    """The latest checkpoint, laid out by ``shardings`` (any device count) if given."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    if shardings is not None:
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
        )
    return manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract))


def make_step(
    args: argparse.Namespace,
    graphdef: nnx.GraphDef,
    num_microbatches: int | str,
    strategy: str = "data_parallel",
    offload: bool = False,
):
    """The jaxga train step, on a mesh of ``--devices`` with ``strategy`` if more than one;
    with ``num_microbatches="auto"`` it plans its own for ``--memory-budget``."""
    mesh = mesh_of(args)
    auto = num_microbatches == "auto"
    return jaxga.make_train_step(
        jaxga.nnx_loss(graphdef, functools.partial(loss, normalize=args.normalize)),
        num_microbatches,
        memory_budget=args.memory_budget if auto else None,
        mesh=mesh,
        strategy=strategy if mesh is not None else "data_parallel",
        pipeline_axis="stage" if args.stages > 1 else None,
        offload=offload,
    )


def training_rows(args: argparse.Namespace) -> tuple[dict[str, np.ndarray], str]:
    """The rows trained on, one document each or packed (``--pack``), and a line about them."""
    tokens, lengths = pack(documents(args.data), args.seq_len)
    start = time.perf_counter()
    rows = (packed_rows if args.pack else padded_rows)(tokens, lengths)
    how = f"packed into {len(rows['mask'])} rows" if args.pack else "one a row"
    if len(rows["mask"]) < args.batch_size:
        raise UsageError(
            f"--data holds {len(tokens)} documents, {how}: fewer rows than --batch-size "
            f"{args.batch_size}"
        )
    if args.pack:
        how += f" by Grain in {time.perf_counter() - start:.1f} s"
    return rows, f"{len(tokens)} documents {how}, {padding_fraction(rows):.1%} padding"


def make_batches(args: argparse.Namespace, rows: dict[str, np.ndarray]) -> Batches:
    """The run's batches: ``--batch-size`` rows a step, or, with ``--tokens-per-step``, the
    rows of a budget of real tokens; prints what the budget gives."""
    if args.tokens_per_step is None:
        return Batches(rows, args.batch_size, args.seed)
    real = rows["mask"].sum(axis=1)
    schedule = token_budget_schedule(
        real, args.tokens_per_step, args.batch_size, args.steps, args.seed
    )
    k, m = args.microbatches, args.batch_size // args.microbatches
    tokens = np.array([real[index].sum() for index in schedule])
    used = np.array([-(-len(index) // m) for index in schedule])
    print(
        f"--tokens-per-step {args.tokens_per_step}: {tokens.mean():,.0f} real tokens a step "
        f"on average (fewest {tokens.min():,.0f}), in {used.mean():.2f} of {k} micro-batches "
        f"of {m} rows"
    )
    return Batches(rows, args.batch_size, args.seed, k, schedule)


def train(args: argparse.Namespace) -> dict:
    """Runs training; returns the final metrics, losses and parameters (for tests)."""
    check_args(args)
    rows, about_rows = training_rows(args)
    if args.dtype is None:
        args.dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    cfg = Config(
        args.seq_len, args.dim, args.heads, args.layers, args.dropout, args.remat, args.dtype
    )
    cfg = dataclasses.replace(
        cfg,
        stages=args.stages,
        schedule=args.schedule if args.stages > 1 else Config.schedule,
        pipeline_microbatches=args.pipeline_microbatches if args.stages > 1 else 1,
    )
    config_file = args.checkpoint_dir / "config.json"
    if args.resume and config_file.exists():
        saved = json.loads(config_file.read_text())
        if saved != dataclasses.asdict(cfg):
            raise UsageError(f"--resume: {config_file} holds another model: {saved}")

    model = nnx.jit(lambda: Transformer(cfg, nnx.Rngs(args.seed)))()  # one compile, not 100s of ops
    if cfg.repeats > 1:  # each stage's chunks of blocks together (docs/pipeline.md)
        nnx.update(model.blocks, jaxga.pipeline_order(nnx.state(model.blocks), cfg.stages, 2))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    strategy = pipeline_specs(params) if cfg.stages > 1 else args.strategy
    tx = optimizer(args.lr)
    state = jaxga.TrainState.create(params=params, tx=tx, model_state=rest, rng=args.seed + 1)
    example = Batches(rows, args.batch_size, args.seed)(0)[0]  # a full batch's shapes

    if args.plan is not None:
        graphdef = plan_step(args, cfg, state, example)
        cfg = dataclasses.replace(cfg, remat=args.remat)  # the model trained, as saved
    step_fn = make_step(args, graphdef, args.microbatches, strategy, args.offload)
    try:
        # per device ("auto" plans here); with --tokens-per-step, the program that skips
        real = () if args.tokens_per_step is None else (1,)
        report = jaxga.memory_report(step_fn, state, example, *real)
    except jaxga.planner.InfeasibleBudgetError as e:
        raise UsageError(f"--memory-budget {args.memory_budget}: {e}") from None
    if args.microbatches == "auto":
        print(step_fn.plan)
        args.microbatches = step_fn.plan.num_microbatches

    manager = checkpointer(args.checkpoint_dir)
    config_file.write_text(json.dumps(dataclasses.asdict(cfg)))
    state = resume_or_replace(args, manager, state, strategy)
    start = int(state.step)

    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"{n_params / 1e6:.2f}M parameters, {about_rows}, batch {args.batch_size} = "
        f"{args.microbatches} micro-batches × {args.batch_size // args.microbatches}, "
        f"remat {args.remat}, {args.dtype} matmuls, loss {args.normalize}, "
        f"steps {start}→{args.steps}"
        + (f", {args.devices} devices ({describe_layout(args)})" if args.devices > 1 else "")
        + (", optimiser state in host memory" if args.offload else "")
    )
    batches = make_batches(args, rows)
    state, history = run_steps(args, cfg, step_fn, state, batches, manager, start)
    losses, metrics = history["losses"], history["metrics"]

    print(
        f"compiled step{' per device' if args.devices > 1 else ''}: "
        f"peak {report.peak_bytes / 2**20:.1f} MiB "
        f"(arguments {report.argument_bytes / 2**20:.1f} MiB, "
        f"temporaries {report.temp_bytes / 2**20:.1f} MiB)"
        + (f", host {report.host_bytes / 2**20:.1f} MiB" if args.offload else "")
    )
    if metrics:
        counted = "tokens" if args.normalize == "token_mean" else "sequences"
        print(
            f"loss {losses[0]:.4f} at step {start + 1} → {losses[-1]:.4f} at step {args.steps} "
            f"(a uniform guess: {np.log(VOCAB):.3f}); the last batch counted "
            f"{int(metrics['count'])} {counted}"
        )
    print_speed(args, cfg, history)
    if args.sample:
        trained = nnx.merge(graphdef, *jax.device_get((state.params, state.model_state)))
        if cfg.stages > 1:  # on one device, the blocks in layer order, no pipeline
            if cfg.repeats > 1:
                layers = jaxga.pipeline_order(nnx.state(trained.blocks), 2, cfg.stages)
                nnx.update(trained.blocks, layers)
            trained.cfg = dataclasses.replace(cfg, stages=1)
        text = sample(trained, "def ", args.sample, jax.random.key(args.seed))
        print("sample:\n" + text)
    return {
        "losses": losses,
        "counts": history["counts"],
        "params": state.params,
        "metrics": metrics,
        "report": report,
    }


def describe_layout(args: argparse.Namespace) -> str:
    if args.stages == 1:
        return args.strategy
    data = args.devices // args.stages
    return f"{data} data × {args.stages} {args.schedule} pipeline stages"


def resume_or_replace(
    args: argparse.Namespace,
    manager: ocp.CheckpointManager,
    state: jaxga.TrainState,
    strategy: Any = "data_parallel",
) -> jaxga.TrainState:
    """The latest checkpoint's state with ``--resume``; else ``state``, and the checkpoints
    of an earlier run in the directory are deleted."""
    print(f"checkpoints: {args.checkpoint_dir} (every {args.save_every} steps and the last)")
    if args.resume and manager.latest_step() is None:
        print(f"--resume: no checkpoint in {args.checkpoint_dir} yet; starting from step 0")
    if not args.resume and manager.latest_step() is not None:
        # a fresh run replaces them: kept, they would hide its own (orbax saves no step
        # at or below the latest) and a later --resume would load another model
        print(
            f"replacing the checkpoints of an earlier run (up to step {manager.latest_step()}); "
            f"--resume continues them instead"
        )
        for old_step in manager.all_steps():
            manager.delete(old_step)
    if args.resume and manager.latest_step() is not None:
        shardings = None
        if args.devices > 1:  # a checkpoint from any device count, laid out for this one
            mesh = mesh_of(args)
            shardings = jaxga.sharding.state_shardings(state, mesh, strategy)
        state = restore(manager, state, shardings)
    return state


def run_steps(
    args: argparse.Namespace,
    cfg: Config,
    step_fn: Any,
    state: jaxga.TrainState,
    batches: Batches,
    manager: ocp.CheckpointManager,
    start: int,
) -> tuple[jaxga.TrainState, dict]:
    """Trains from step ``start`` to ``--steps``, saving checkpoints; returns the state and
    each step's loss, count, seconds, real and computed tokens, and the last step's metrics."""
    history: dict = {"losses": [], "counts": [], "seconds": [], "real": [], "computed": []}
    history["metrics"] = {}
    rows_per_microbatch = args.batch_size // args.microbatches
    peak = peak_flops(args.dtype)
    progress = range(start, args.steps)
    if not args.quiet:
        from tqdm import tqdm

        bar = dict(unit="step", dynamic_ncols=True, disable=None)  # None: no bar in a log file
        progress = tqdm(progress, initial=start, total=args.steps, **bar)
    for step in progress:
        batch, n, real = batches(step)
        t0 = time.perf_counter()
        skip = {} if n is None else {"num_real_microbatches": n}  # None: all (auto takes none)
        state, metrics = step_fn(state, batch, **skip)
        loss_value = float(metrics["loss"])  # waits for the step
        seconds = time.perf_counter() - t0
        computed = (n or args.microbatches) * rows_per_microbatch * args.seq_len
        history["losses"].append(loss_value)
        history["counts"].append(float(metrics["count"]))
        history["seconds"].append(seconds)
        history["real"].append(real)
        history["computed"].append(computed)
        history["metrics"] = metrics
        if not args.quiet:
            stats = {"loss": f"{loss_value:.3f}", "tok_s": f"{real / seconds:,.0f}"}
            if peak:
                stats["mfu"] = f"{cfg.flops_per_token() * computed / seconds / peak:.1%}"
            progress.set_postfix(stats, step_ms=f"{1e3 * seconds:.0f}")
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            manager.save(step + 1, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    return state, history


def print_speed(args: argparse.Namespace, cfg: Config, history: dict) -> None:
    """The median step time and the tokens per second of the steps after the first (which
    compiles): real tokens (labels counted), and the MFU of the tokens computed."""
    if len(history["seconds"]) < 2:
        return
    seconds = np.array(history["seconds"][1:])
    real, computed = np.mean(history["real"][1:]), np.mean(history["computed"][1:])
    speed = (
        f"median step {1e3 * np.median(seconds):.1f} ms, "
        f"{real / np.median(seconds):,.0f} real tokens/s ({real:,.0f} a step, "
        f"{1 - real / computed:.1%} of the tokens computed are padding)"
    )
    if peak := peak_flops(args.dtype):
        mfu = cfg.flops_per_token() * computed / np.median(seconds) / peak
        speed += f", MFU {mfu:.1%} of {jax.devices()[0].device_kind}'s {args.dtype} peak"
    print(speed)


def abstract_step_args(cfg: Config, batch_size: int) -> tuple[Any, Any, dict]:
    """The loss ``jaxga.make_train_step`` takes, and the shapes of a train state and batch.

    Nothing is allocated: for compiling the step ahead of time (``jaxga.memory_report``,
    the benchmarks, the compiled-for-H100 checks).
    """
    model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optimizer(3e-4)
    state = jax.eval_shape(
        lambda p, r: jaxga.TrainState.create(params=p, tx=tx, model_state=r), params, rest
    )
    tokens = jax.ShapeDtypeStruct((batch_size, cfg.seq_len), jnp.int32)
    batch = {"inputs": tokens, "labels": tokens, "mask": tokens.update(dtype=jnp.float32)}
    return jaxga.nnx_loss(graphdef, loss), state, batch


def plan_step(
    args: argparse.Namespace, cfg: Config, state: jaxga.TrainState, example: dict
) -> nnx.GraphDef:
    """Chooses the step with ``jaxga.plan`` for the budget ``--plan``; prints the plan.

    Every candidate train step is compiled ahead of time for the shapes of ``state`` and
    ``example``, nothing allocated: the first, in order of fewest micro-batches, then least
    communication (``--strategy``, with ``--devices``), recomputation (remat) and host
    traffic (``--offload``), whose compiled peak per device fits. The remat policy is a
    static part of the model (``Config.remat``), so a candidate's model is built anew,
    abstractly, with ``nnx.eval_shape``. Sets the chosen options on ``args``; returns the
    chosen model's graphdef.
    """
    budget = None if args.plan == "device" else args.plan
    if budget is None and "bytes_limit" not in (jax.local_devices()[0].memory_stats() or {}):
        raise UsageError(
            f"--plan device: the {jax.default_backend()} device reports no memory limit; "
            f"give a budget such as 2GiB"
        )
    try:
        budget = budget if budget is None else jaxga.parse_bytes(budget, name="plan")
    except ValueError:
        raise UsageError(
            f"--plan {args.plan!r} is not a size; expected e.g. 512MiB, 1.5GiB, 2GB or 'device'"
        ) from None

    def graphdef_for(remat: str) -> nnx.GraphDef:
        candidate = dataclasses.replace(cfg, remat=remat)
        model = nnx.eval_shape(lambda: Transformer(candidate, nnx.Rngs(0)))
        return nnx.split(model, nnx.Param, ...)[0]

    def build(num_microbatches: int, remat: str, **choice):
        return make_step(args, graphdef_for(remat), num_microbatches, **choice)

    strategy = jaxga.sharding.STRATEGIES if args.devices > 1 else None
    try:
        plan = jaxga.plan(
            build, state, example, budget=budget, strategy=strategy, offload=(False, True)
        )
    except jaxga.planner.InfeasibleBudgetError as e:
        message = str(e)
        raise UsageError(f"--plan {args.plan}: {message[0].lower()}{message[1:]}") from None
    print(plan)
    args.microbatches, args.remat, args.offload = plan.num_microbatches, plan.remat, plan.offload
    args.strategy = plan.strategy or args.strategy
    return graphdef_for(plan.remat)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.suppress(RuntimeError):  # JAX has started (a test): it keeps its devices
        jax.config.update("jax_num_cpu_devices", max(args.devices, 1))  # a mesh on a CPU too
    try:
        train(args)
    except UsageError as e:
        print(f"train_lm.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # Bit-for-bit resumes on a GPU; set before JAX starts its backend.
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true"
    sys.exit(main())
