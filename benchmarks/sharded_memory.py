"""Per-device memory of the train step under each sharding strategy, read from the compiler.

The main example's transformer (GPT-2 small's shape by default: 12 layers, dim 768,
sequences of 512 tokens, batch 64, 4 micro-batches, remat "full", AdamW) is compiled for
a mesh of ``--devices`` host CPU devices with ``jaxga.make_train_step(...,
strategy=...)``, and for one device without a mesh. Nothing is allocated: every figure
is XLA's ``memory_analysis()`` of the compiled SPMD program, which is per device —
arguments (the train state's share and the batch's), temporaries, and the peak.

    .venv/bin/python benchmarks/sharded_memory.py            # about 3 minutes on 2 cores
    .venv/bin/python benchmarks/sharded_memory.py --quick    # a small model, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

import jaxga

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import train_lm

DEVICES = 8


def measure(args: argparse.Namespace) -> dict:
    cfg = train_lm.Config(args.seq_len, args.dim, args.heads, args.layers, 0.0, "full")
    loss, state, batch = train_lm.abstract_step_args(cfg, args.batch_size)
    mesh = jax.make_mesh((args.devices,), ("data",))

    rows = {}
    runs = [("one device", None, "data_parallel")]
    runs += [(s, mesh, s) for s in jaxga.sharding.STRATEGIES]
    for name, on, strategy in runs:
        step = jaxga.make_train_step(loss, args.microbatches, mesh=on, strategy=strategy)
        report = jaxga.memory_report(step, state, batch)
        rows[name] = {
            "argument_bytes": report.argument_bytes,
            "temp_bytes": report.temp_bytes,
            "peak_bytes": report.peak_bytes,
        }
        print(f"compiled {name}", file=sys.stderr, flush=True)
    num_params = sum(x.size for x in jax.tree.leaves(state.params))
    return {
        "devices": args.devices,
        "num_params": int(num_params),
        "config": {k: getattr(args, k) for k in ("seq_len", "dim", "heads", "layers")},
        "batch_size": args.batch_size,
        "microbatches": args.microbatches,
        "jax": jax.__version__,
        "per_device": rows,
    }


def report(out: dict) -> None:
    def mib(b):
        return b / 2**20

    print(
        f"{out['num_params'] / 1e6:.2f}M parameters, batch {out['batch_size']} in "
        f"{out['microbatches']} micro-batches, AdamW, remat full; per device of "
        f"{out['devices']} (XLA's compiled memory, CPU)"
    )
    print(f"{'':15} {'arguments':>12} {'temporaries':>12} {'peak':>12} {'peak ÷ DP':>10}")
    dp = out["per_device"]["data_parallel"]["peak_bytes"]
    for name, r in out["per_device"].items():
        print(
            f"{name:15} {mib(r['argument_bytes']):9.1f} MiB {mib(r['temp_bytes']):9.1f} MiB "
            f"{mib(r['peak_bytes']):9.1f} MiB {r['peak_bytes'] / dp:10.2f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model")
    p.add_argument("--devices", type=int, default=DEVICES)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()
    # host CPU devices, set before jax starts its backend: compile-only, nothing runs
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    shape = (64, 16, 32, 2, 4, 2) if args.quick else (64, 512, 768, 12, 12, 4)
    args.batch_size, args.seq_len, args.dim, args.heads, args.layers, args.microbatches = shape
    out = measure(args)
    report(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
