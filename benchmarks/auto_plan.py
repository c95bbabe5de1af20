"""What `num_microbatches="auto"` costs before the first step: planning time, in seconds and
as a multiple of one compile of the step it chooses, for the main example at two budgets,
with each of `jaxga.plan`'s searches.

The example's transformer (`examples/train_lm.py`'s defaults: 4 layers, dim 128, sequences
of 128 tokens, batch 32, remat "full", AdamW) is planned by `jaxga.make_train_step(loss,
"auto", memory_budget=...)` on abstract inputs (nothing allocated), once with each search
(`step.plan_search`): "ordered" compiles the counts dividing the batch, fewest first, until
one fits; "predict" (the default) compiles the first and last counts, fits a line through
their peaks, and then does the same but for the counts the line puts well over the budget
(docs/planner.md). Both must choose the same count. Each plan and the reference compile
start from empty caches.

    .venv/bin/python benchmarks/auto_plan.py      # minutes on 2 CPU cores; --repeats 1: a third
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


def measure(loss, state, batch, budget: str, search: str) -> dict:
    """Plans the example with one search, then compiles the chosen count alone."""
    step = jaxga.make_train_step(loss, "auto", memory_budget=budget)
    step.plan_search = search
    planning = seconds(lambda: step.trace(state, batch))
    plan = step.plan
    explicit = jaxga.make_train_step(loss, plan.num_microbatches)
    one = seconds(lambda: explicit.lower(state, batch).compile())
    return {
        "budget": budget,
        "search": search,
        "num_microbatches": plan.num_microbatches,
        "compiled": [c.num_microbatches for c in plan.candidates],
        "peak_bytes": plan.report.peak_bytes,
        "planning_s": planning,
        "one_compile_s": one,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", nargs="+", default=["40MiB", "20MiB"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="times: the least of these")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    loss, state, batch = train_lm.abstract_step_args(train_lm.Config(), args.batch_size)
    runs = {}  # (budget, search) -> its measurements, one per repeat
    for _ in range(args.repeats):  # interleaved, so that a busy moment touches every row
        for budget in args.budgets:
            for search in ("ordered", "predict"):
                runs.setdefault((budget, search), []).append(
                    measure(loss, state, batch, budget, search)
                )
    rows = []
    for (budget, _), repeats in runs.items():
        row = repeats[0] | {
            "planning_s": round(min(r["planning_s"] for r in repeats), 2),
            "one_compile_s": round(min(r["one_compile_s"] for r in repeats), 2),
        }
        row["ratio"] = round(row["planning_s"] / row["one_compile_s"], 2)
        rows.append(row)
        if row["num_microbatches"] != runs[budget, "ordered"][0]["num_microbatches"]:
            raise AssertionError(f"at {budget} the searches disagree: {rows}")
    print(f"{jax.devices()[0].device_kind}, batch {args.batch_size}, example transformer,")
    print(f"the least time of {args.repeats}:")
    heading = "budget  search   k   compiled  (counts)              peak       planning"
    print(heading + "  one compile  ratio")
    for r in rows:
        peak = jaxga.memory.format_bytes(r["peak_bytes"])
        counts = "(" + ", ".join(map(str, r["compiled"])) + ")"
        print(
            f"{r['budget']:<7} {r['search']:<8} {r['num_microbatches']:<3} {len(r['compiled']):<9} "
            f"{counts:<21} {peak:<10} {r['planning_s']:>6.2f} s  {r['one_compile_s']:>6.2f} s"
            f"     {r['ratio']:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
