"""Device peak of the train step with the optimiser state kept on the device or offloaded
to host memory (``offload=True``), compiled for a described H100: nothing runs.

The main example's transformer at GPT-2 small's shape (12 layers, dim 768, sequences of
512 tokens, batch 64, bfloat16 matmuls, remat "full", AdamW), at k = 1, 4, 8 and 16
micro-batches, one device. Each figure is XLA's ``memory_analysis()`` of the program an
H100 would run (``compiled_for_gpu.py``, JAX's CUDA plugin on the path, no GPU needed):

    JAX_PLATFORMS=cpu PYTHONPATH=.venv/h100-plugin .venv/bin/python benchmarks/offload_memory.py
    ... --quick    # a small model, seconds

Step time with offload needs a GPU (``benchmarks/run.py``); it is not measured here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

import jaxga

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import compiled_for_gpu as gpu
import train_lm


def measure(shape: tuple[int, ...], counts: tuple[int, ...]) -> dict:
    batch_size, seq_len, dim, heads, layers = shape
    cfg = train_lm.Config(seq_len, dim, heads, layers, 0.0, "full", "bfloat16")
    model = nnx.eval_shape(lambda: train_lm.Transformer(cfg, nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = train_lm.optimizer(3e-4)
    state = jax.eval_shape(
        lambda p, r: jaxga.TrainState.create(params=p, tx=tx, model_state=r), params, rest
    )
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    batch = {"inputs": tokens, "labels": tokens, "mask": tokens.update(dtype=jnp.float32)}
    args = gpu.on(gpu.h100(), (state, batch))
    loss = jaxga.nnx_loss(graphdef, train_lm.loss)
    rows = []
    for k in counts:
        for offload in (False, True):
            step = jaxga.make_train_step(loss, k, offload=offload)
            with gpu.cudnn_attention():
                r = jaxga.memory_report(step, *args)
            rows.append({"k": k, "offload": offload, "peak_bytes": r.peak_bytes,
                         "host_bytes": r.host_bytes, "temp_bytes": r.temp_bytes})  # fmt: skip
            print(f"compiled k={k} offload={offload}", file=sys.stderr, flush=True)
    n = sum(x.size for x in jax.tree.leaves(params))
    return {"device": "described NVIDIA H100 (compiled, not run)", "jax": jax.__version__,
            "num_params": int(n), "shape": shape, "rows": rows}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()
    shape = (16, 16, 64, 2, 2) if args.quick else (64, 512, 768, 12, 12)
    out = measure(shape, (1, 4, 8, 16))
    mib = lambda b: f"{b / 2**20:9.1f} MiB"
    print(f"{out['num_params'] / 1e6:.2f}M parameters, batch {shape[0]} × {shape[1]} tokens; "
          f"{out['device']}, jax {out['jax']}")  # fmt: skip
    print(f"{'k':>3} {'offload':>8} {'device peak':>13} {'host':>13} {'peak ÷ no offload':>18}")
    for row in out["rows"]:
        base = next(r for r in out["rows"] if r["k"] == row["k"] and not r["offload"])
        ratio = row["peak_bytes"] / base["peak_bytes"]
        print(f"{row['k']:>3} {row['offload']!s:>8} {mib(row['peak_bytes'])} "
              f"{mib(row['host_bytes'])} {ratio:18.2f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
