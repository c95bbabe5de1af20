"""Where the in-step scan's time goes on an H100: kernel launches and bytes moved.

Accumulating over k micro-batches adds no FLOPs, yet on an H100 the scan of Transformer M
took 1.19× the full batch's time at k = 4 and 1.69× at k = 8 (``run.py --only 2``). This
compiles Transformer M's train step (GPT-2 small's shape, batch 64 × 512, bfloat16
matmuls, Adam: ``run.py``'s) for a described H100 (``compiled_for_gpu.py``) and counts, in
the compiled HLO, what the GPU would do besides the matmuls: kernel launches and the bytes
they move, each loop body times its trip count (:func:`compiled_for_gpu.traffic`).

Each no-remat program is built twice: as the example builds it now, its layers unrolled
(``remat_scan(..., policy="none", unroll=True)``), and in a rolled scan (``unroll=False``,
``remat_scan``'s default), which the measured H100 rows of
``results/gpu-nvidia-h100-80gb-hbm3.json`` ran (each row is matched to the program whose
compiled peak is nearest its own). The programs with a remat policy are the same either
way. A least-squares fit of the measured times to the counts of the programs they ran,
ms ≈ a·GB + b·launches + c, gives every program a *modelled* time: a model, not a
measurement (the measured rows are jax 0.11.2's programs; these are this jax's).

    JAX_PLATFORMS=cpu PYTHONPATH=.venv/h100-plugin \\
        .venv/bin/python benchmarks/scan_cost.py [--layers L] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).parent))

import compiled_for_gpu as gpu
import run
import train_lm  # examples/, on the path through compiled_for_gpu

import jaxga

MEASURED = Path(__file__).parent / "results" / "gpu-nvidia-h100-80gb-hbm3.json"
TRANSFORMER_M = {"batch": 64, "seq_len": 512, "dim": 768, "heads": 12, "layers": 12}
CASES = [(k, "none") for k in (1, 2, 4, 8, 16)] + [(run.REMAT_K, r) for r in run.REMATS]


@contextlib.contextmanager
def rolled_layers() -> Iterator[None]:
    """While tracing, the example's layers without remat run in a rolled scan
    (``unroll=False``), as ``examples/train_lm.py`` ran them before it unrolled them."""
    options = train_lm.layer_options
    train_lm.layer_options = lambda remat: options(remat) | {"unroll": False}
    try:
        yield
    finally:
        train_lm.layer_options = options


def step_program(device: jax.Device, shape: dict[str, int], k: int, remat: str) -> Any:
    """``run.py``'s train step of the example's transformer at ``shape``, compiled for
    ``device``: the full batch for ``k = 1``, else ``jaxga.value_and_grad`` over k."""
    model = gpu.transformer(**shape)
    tx = optax.adam(1e-3)
    loss = model.loss_for(remat)
    grad = jaxga.value_and_grad(loss, num_microbatches=k)
    if k == 1:
        grad = jax.value_and_grad(lambda p, b: loss(p, b).value)
    args = gpu.on(device, (model.params, jax.eval_shape(tx.init, model.params), model.batch))
    return gpu.program(run.make_step(grad, tx, backend="gpu"), *args)


def counts(program: Any) -> dict[str, float]:
    """A compiled step's kernel launches, GB moved and compiled peak (MiB)."""
    moved = gpu.traffic(program)
    return {
        "launches": moved["launches"],
        "gb": moved["bytes"] / 1e9,
        "peak_mib": gpu.summary(program)["peak_bytes"] / 2**20,
    }


def measured() -> dict[tuple[int, str], dict[str, Any]]:
    """``run.py --only 2``'s full-batch and jaxga.value_and_grad rows on the H100."""
    rows = json.loads(MEASURED.read_text())["workloads"][0]["rows"]
    return {(r["k"], r["remat"]): r for r in rows if r["kind"] in ("full", "scan")}


def ran(rows: list[dict[str, Any]], run_row: dict[str, Any]) -> dict[str, Any]:
    """Of a case's programs (rolled and unrolled), the one a measured row ran: the one whose
    compiled peak is nearest the row's (they differ about 2×, jax versions a few %)."""
    return min(rows, key=lambda r: abs(np.log(r["peak_mib"] * 2**20 / run_row["peak_bytes"])))


def table(device: jax.Device, layers: int = 12) -> list[dict[str, Any]]:
    """Every case of ``CASES`` as jaxga builds it, and the no-remat ones rolled, with the
    seconds to compile it, the measured time where a row ran that program (12 layers) and
    the fit's modelled time."""
    shape = TRANSFORMER_M | {"layers": layers}
    rows = []
    for k, remat in CASES:
        rows.append({"k": k, "remat": remat, "layers": "unrolled" if remat == "none" else "scan"})
        if remat == "none":
            rows.append({"k": k, "remat": remat, "layers": "rolled scan"})
    for row in rows:
        rolled = rolled_layers() if row["layers"] == "rolled scan" else contextlib.nullcontext()
        with rolled:
            start = time.perf_counter()
            program = step_program(device, shape, row["k"], row["remat"])
            row |= counts(program) | {"compile_s": time.perf_counter() - start}
    if layers != TRANSFORMER_M["layers"]:  # nothing measured: no time model
        return rows
    for case, run_row in measured().items():
        programs = [r for r in rows if (r["k"], r["remat"]) == case]
        ran(programs, run_row)["measured_ms"] = 1e3 * run_row["median_s"]
    fitted = [r for r in rows if r.get("measured_ms") is not None]

    def features(r):
        return [r["gb"], r["launches"], 1.0]

    coef = np.linalg.lstsq(
        np.array([features(r) for r in fitted]), np.array([r["measured_ms"] for r in fitted])
    )[0]
    for row in rows:
        row["modelled_ms"] = float(np.dot(coef, features(row)))
    print(
        f"fit over {len(fitted)} measured rows: ms ≈ {coef[0]:.3f}·GB + "
        f"{1e3 * coef[1]:.2f} µs·launches + {coef[2]:.1f}"
    )
    return rows


def report(rows: list[dict[str, Any]], layers: int) -> None:
    print(f"Transformer M's step, {layers} layers, compiled for an H100 80GB HBM3 (nothing runs)")
    full = {r["layers"]: r.get("modelled_ms") for r in rows if r["k"] == 1}
    print(
        f"{'remat':14} {'k':>3} {'layers':12} {'compile s':>9} {'launches':>9} {'GB':>7} "
        f"{'peak MiB':>9} {'measured':>9} {'modelled':>9} {'× full':>7}"
    )
    for r in rows:

        def ms(key, r=r):
            return f"{r[key]:.1f}" if r.get(key) else "-"

        modelled = r.get("modelled_ms")
        over = f"{modelled / full.get(r['layers'], full['unrolled']):.2f}" if modelled else "-"
        print(
            f"{r['remat']:14} {r['k']:3d} {r['layers']:12} {r['compile_s']:9.1f} "
            f"{r['launches']:9d} {r['gb']:7.1f} {r['peak_mib']:9.1f} {ms('measured_ms'):>9} "
            f"{ms('modelled_ms'):>9} {over:>7}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="Transformer M's is 12")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)  # described devices: no reuse
    rows = table(gpu.h100(), args.layers)
    report(rows, args.layers)
    if args.json is not None:
        out = {"target": "NVIDIA H100 80GB HBM3", "jax": jax.__version__, "layers": args.layers}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out | {"rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
