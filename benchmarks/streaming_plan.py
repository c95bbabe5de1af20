"""The planner's streaming lever, compiled for a described 24 GB card (nothing runs).

A small Llama-shaped decoder (8 layers of width 512, a vocabulary of 256: 27M stack
parameters), AdamW with ``offload=True``, the stack and the optimiser state in pinned host
memory, the loss's layers ``jaxga.remat_scan(..., stream=True)``: for each budget, the plan
of ``make_train_step(loss, "auto", stream="auto", memory_budget=budget)`` — every k
resident, then with ``stream=True``, then ``"layers"``, the first that fits — printed as
its table (``print(step.plan)``), or with ``--json`` one row per candidate built. Needs
JAX's CUDA plugin on the path (``scripts/test.sh`` installs it in ``.venv/h100-plugin``):

    JAX_PLATFORMS=cpu PYTHONPATH=.venv/h100-plugin .venv/bin/python \\
        benchmarks/streaming_plan.py 2GiB 100MiB
"""

import argparse
import functools
import json

import biggest_model as bm
import jax
import optax

import jaxga

MODEL = bm.Llama(layers=8, dim=512, hidden=1536, seq_len=128)
SEQUENCES = 4  # a step's


def planned(budget: str) -> jaxga.Plan:
    """The plan of the streamed-if-need-be step of `MODEL` within ``budget``."""
    device = bm.described(bm.CARDS["24GB"])
    create = functools.partial(jaxga.TrainState.create, tx=optax.adamw(3e-4))
    state = jax.eval_shape(create, bm.abstract_params(MODEL))
    state, batch = bm.gpu.on(device, (state, bm.abstract_batch(SEQUENCES, MODEL.seq_len)))
    state = bm.on_host(device, state, bm.streamed)  # the stack and the optimiser state
    loss = bm.step_loss(bm.loss_for("full", stream=True))
    step = jaxga.make_train_step(loss, "auto", stream="auto", memory_budget=budget, offload=True)
    with bm.gpu.cudnn_attention():
        step.lower(state, batch)
    return step.plan


def rows(plan: jaxga.Plan) -> list[dict]:
    """One row per candidate built: its stream, k, peak, host and moved bytes, verdict."""
    return [
        {
            "stream": c.stream,
            "num_microbatches": c.num_microbatches,
            "peak_bytes": c.report.peak_bytes,
            "host_bytes": c.report.host_bytes,
            "moved_bytes": c.report.moved_bytes,
            "chosen": c.reason == "",
        }
        for c in plan.candidates
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("budgets", nargs="+", help="memory budgets, e.g. 2GiB 100MiB")
    parser.add_argument("--json", action="store_true", help="rows as JSON, one line a budget")
    args = parser.parse_args(argv)
    bm.VOCAB = 256  # a small embedding and head: the stack's bytes dominate
    for budget in args.budgets:
        plan = planned(budget)
        if args.json:
            found = {"budget": plan.budget, "stack": bm.stack_params(MODEL)}
            print(json.dumps(found | {"candidates": rows(plan)}))
        else:
            print(plan)


if __name__ == "__main__":
    main()
