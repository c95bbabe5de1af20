"""Device peak of the train step with the optimiser state kept on the device or offloaded
to host memory (``offload=True``), compiled for a described H100: nothing runs.

The main example's transformer at GPT-2 small's shape (12 layers, dim 768, sequences of
512 tokens, batch 64, bfloat16 matmuls, remat "full", AdamW), at k = 1, 4, 8 and 16
micro-batches, one device. Each figure is XLA's ``memory_analysis()`` of the program an
H100 would run (``compiled_for_gpu.py``, JAX's CUDA plugin on the path, no GPU needed):

    JAX_PLATFORMS=cpu PYTHONPATH=.venv/h100-plugin .venv/bin/python benchmarks/offload_memory.py
    ... --quick    # a small model, seconds

With ``--time`` the steps are built for, run and timed on this machine's own device
instead (a GPU: the step-time cost of offload, median of 10 steps after a warm-up):

    .venv/bin/python benchmarks/offload_memory.py --time --json offload_time_gpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

import jaxga

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import compiled_for_gpu as gpu
import train_lm


def seconds(step, state, batch, repeats: int = 10) -> float:
    """Median seconds of a step, after one call that compiles (the state is donated)."""
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(shape: tuple[int, ...], counts: tuple[int, ...], timed: bool = False) -> dict:
    batch_size, seq_len, dim, heads, layers = shape
    cfg = train_lm.Config(seq_len, dim, heads, layers, 0.0, "full", "bfloat16")
    loss, state, batch = train_lm.abstract_step_args(cfg, batch_size)
    if not timed:  # compiled for a described H100
        args = gpu.on(gpu.h100(), (state, batch))
    else:  # this machine's device: real arrays
        model = nnx.jit(lambda: train_lm.Transformer(cfg, nnx.Rngs(0)))()
        _, params, rest = nnx.split(model, nnx.Param, ...)
        state = jaxga.TrainState.create(params=params, tx=state.tx, model_state=rest, rng=0)
        args = (state, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), batch))
    rows = []
    for k in counts:
        for offload in (False, True):
            step = jaxga.make_train_step(loss, k, offload=offload)
            with contextlib.nullcontext() if timed else gpu.cudnn_attention():
                r = jaxga.memory_report(step, *args)
            rows.append({"k": k, "offload": offload, "peak_bytes": r.peak_bytes,
                         "host_bytes": r.host_bytes, "temp_bytes": r.temp_bytes})  # fmt: skip
            if timed:
                copy = jax.tree.map(jnp.copy, args)  # the step donates its state
                rows[-1]["seconds"] = seconds(step, *copy)
            print(f"compiled k={k} offload={offload}", file=sys.stderr, flush=True)
    n = sum(x.size for x in jax.tree.leaves(state.params))
    device = jax.devices()[0].device_kind if timed else "described NVIDIA H100 (compiled, not run)"
    return {"device": device, "jax": jax.__version__,
            "num_params": int(n), "shape": shape, "rows": rows}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--time", action="store_true", help="run and time on this machine's device")
    args = p.parse_args()
    shape = (16, 16, 64, 2, 2) if args.quick else (64, 512, 768, 12, 12)
    out = measure(shape, (1, 4, 8, 16), args.time)

    def mib(b):
        return f"{b / 2**20:9.1f} MiB"

    print(f"{out['num_params'] / 1e6:.2f}M parameters, batch {shape[0]} × {shape[1]} tokens; "
          f"{out['device']}, jax {out['jax']}")  # fmt: skip
    timed = "seconds" in out["rows"][0]
    print(f"{'k':>3} {'offload':>8} {'device peak':>13} {'host':>13} {'peak ÷ no offload':>18}"
          + ("        ms  time ÷ no offload" if timed else ""))  # fmt: skip
    for row in out["rows"]:
        base = next(r for r in out["rows"] if r["k"] == row["k"] and not r["offload"])
        ratio = row["peak_bytes"] / base["peak_bytes"]
        line = f"{row['k']:>3} {row['offload']!s:>8} {mib(row['peak_bytes'])} "
        line += f"{mib(row['host_bytes'])} {ratio:18.2f}"
        if timed:
            line += f" {1e3 * row['seconds']:9.1f} {row['seconds'] / base['seconds']:18.2f}"
        print(line)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
