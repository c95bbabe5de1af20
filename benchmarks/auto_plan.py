"""What `num_microbatches="auto"` costs before the first step: planning time, in seconds and
as a multiple of one compile of the step it chooses, for the main example at two budgets.

The example's transformer (`examples/train_lm.py`'s defaults: 4 layers, dim 128, sequences
of 128 tokens, batch 32, remat "full", AdamW) is planned by `jaxga.make_train_step(loss,
"auto", memory_budget=...)` on abstract inputs (nothing allocated): the step compiles the
counts dividing the batch, fewest first, until one fits. Each plan and the reference
compile start from empty caches.

    .venv/bin/python benchmarks/auto_plan.py        # about a minute on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax

import jaxga

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import train_lm


def seconds(fn) -> float:
    jax.clear_caches()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", nargs="+", default=["40MiB", "20MiB"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    loss, state, batch = train_lm.abstract_step_args(train_lm.Config(), args.batch_size)
    rows = []
    for budget in args.budgets:
        step = jaxga.make_train_step(loss, "auto", memory_budget=budget)
        planning = seconds(lambda step=step: step.trace(state, batch))
        plan = step.plan
        explicit = jaxga.make_train_step(loss, plan.num_microbatches)
        one = seconds(lambda explicit=explicit: explicit.lower(state, batch).compile())
        rows.append(
            {
                "budget": budget,
                "num_microbatches": plan.num_microbatches,
                "compiled": len(plan.candidates),
                "peak_bytes": plan.report.peak_bytes,
                "planning_s": round(planning, 2),
                "one_compile_s": round(one, 2),
                "ratio": round(planning / one, 2),
            }
        )
    print(f"{jax.devices()[0].device_kind}, batch {args.batch_size}, example transformer:")
    print("budget   k  compiled  peak        planning   one compile  planning / compile")
    for r in rows:
        peak = jaxga.memory.format_bytes(r["peak_bytes"])
        print(
            f"{r['budget']:<8} {r['num_microbatches']:<2} {r['compiled']:<9} {peak:<11} "
            f"{r['planning_s']:>6.2f} s   {r['one_compile_s']:>6.2f} s     {r['ratio']:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
