"""Side by side: full batch, jaxga's in-step scan, optax.MultiSteps, a naive loop, remat.

For each workload (an MLP and the example's transformer at two sizes), one process
trains the same model on the same global batch with the same optimiser (Adam) in
every way below, interleaved round by round, and reports per global step: the median
time and its ratio to the full-batch step, XLA's compiled peak memory (and, with
``--measure`` on a GPU, the device's measured peak) and the matmul FLOPs.

* full batch: ``jax.value_and_grad`` on the whole batch, then the update; one jitted
  step, parameters and optimiser state donated.
* jaxga.value_and_grad, k micro-batches: the same step with ``jaxga.value_and_grad``,
  a ``lax.scan`` over the micro-batches inside the step.
* optax.MultiSteps, k calls: ``optax.MultiSteps(adam, every_k_schedule=k)``; a global
  step is k calls of a jitted micro-batch step.
* naive loop, k calls: k calls of a jitted ``jax.value_and_grad``, gradients summed by
  eager ``jax.tree.map(jnp.add, ...)`` from Python (the PyTorch/TF custom-loop style),
  divided by k, then a jitted update.
* jaxga + remat: the scan at k=4 with each ``jaxga.remat_scan`` policy.

    .venv/bin/python benchmarks/run.py --quick     # CPU, a few minutes
    .venv/bin/python benchmarks/run.py             # GPU: larger models, all k, more rounds

Writes ``benchmarks/results/<device>.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).parent))

import _report
import _workloads
from _timing import time_interleaved

import jaxga
from jaxga.memory import MemoryReport

SCAN_K = (2, 4, 8, 16)
REMAT_K = 4
REMATS = ("dots", "dots_no_batch", "full", "sqrt")
TARGET_TIME = {"cpu": 1.25, "gpu": 1.05}  # scan step time ≤ this × the full-batch step
TARGET_PEER = 0.75  # scan step time ≤ this × optax.MultiSteps at the same k
TARGET_MEMORY = 1.25  # compiled peak ≤ this × the memory model


@dataclasses.dataclass(frozen=True)
class Method:
    """One way to take a global step: ``kind`` in full, scan, optax, naive."""

    kind: str
    k: int = 1
    remat: str = "none"

    @property
    def key(self) -> str:
        return f"{self.kind}-k{self.k}-{self.remat}"

    @property
    def label(self) -> str:
        if self.kind == "scan" and self.remat != "none":
            return f"jaxga + remat {_workloads.remat_names(self.remat)}"
        return {
            "full": "full batch",
            "scan": "jaxga.value_and_grad",
            "optax": "optax.MultiSteps",
            "naive": "naive loop",
        }[self.kind]

    @classmethod
    def from_key(cls, key: str) -> Method:
        kind, k, remat = key.split("-", 2)
        return cls(kind, int(k[1:]), remat)


def methods(peer_k: tuple[int, ...]) -> list[Method]:
    """Every method of the benchmark, in table order."""
    out = [Method("full")]
    out += [Method("scan", k) for k in SCAN_K]
    out += [Method("optax", k) for k in peer_k]
    out += [Method("naive", k) for k in peer_k]
    out += [Method("scan", REMAT_K, r) for r in REMATS]
    return out


def tree_bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def copy(tree: Any) -> Any:
    return jax.tree.map(jnp.copy, tree)


def make_step(grad_fn: Callable[..., Any], tx: optax.GradientTransformation):
    """A jitted step: ``grad_fn`` then the optimiser; params and state donated."""

    def step(params, opt_state, batch):
        value, grads = grad_fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1))


def make_apply(tx: optax.GradientTransformation):
    """A jitted update on given gradients; params and state donated."""

    def apply(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(apply, donate_argnums=(0, 1))


@dataclasses.dataclass
class Prepared:
    """A method ready to run: ``run()`` takes one global step and returns the params."""

    run: Callable[[], Any]
    peak_bytes: int
    dot_flops: int
    calls: int  # jitted calls per global step
    reports: dict[str, MemoryReport]


def prepare(method: Method, w: _workloads.Workload, tx: optax.GradientTransformation) -> Prepared:
    """Builds ``method``'s step(s) for workload ``w``, compiles them and sizes them."""
    loss = w.loss_for(method.remat)

    def mean_loss(params, batch):
        return loss(params, batch).value

    k = method.k
    micro = [
        jax.tree.map(lambda x, i=i: x[i], jaxga.split_microbatches(w.batch, k)) for i in range(k)
    ]
    carry: dict[str, Any] = {"params": copy(w.params)}
    if method.kind in ("full", "scan"):
        grad_fn = jax.value_and_grad(mean_loss) if method.kind == "full" else None
        grad_fn = grad_fn or jaxga.value_and_grad(loss, num_microbatches=k)
        step = make_step(grad_fn, tx)
        carry["opt"] = tx.init(carry["params"])
        report = jaxga.memory_report(step, carry["params"], carry["opt"], w.batch)

        def run():
            carry["params"], carry["opt"], _ = step(carry["params"], carry["opt"], w.batch)
            return carry["params"]

        return Prepared(run, report.peak_bytes, report.dot_flops, 1, {"step": report})

    if method.kind == "optax":
        multi = optax.MultiSteps(tx, every_k_schedule=k)
        step = make_step(jax.value_and_grad(mean_loss), multi)
        carry["opt"] = multi.init(carry["params"])
        report = jaxga.memory_report(step, carry["params"], carry["opt"], micro[0])

        def run():
            for batch in micro:
                carry["params"], carry["opt"], _ = step(carry["params"], carry["opt"], batch)
            return carry["params"]

        return Prepared(run, report.peak_bytes, k * report.dot_flops, k, {"step": report})

    assert method.kind == "naive", method
    grad, grad_report = micro_grad(w, k)
    apply = make_apply(tx)
    carry["opt"] = tx.init(carry["params"])
    apply_report = jaxga.memory_report(apply, carry["params"], carry["opt"], carry["params"])
    # While a gradient call runs, the optimiser state and the running sum sit in memory too.
    resident = tree_bytes(carry["opt"]) + tree_bytes(carry["params"])
    peak = max(grad_report.peak_bytes + resident, apply_report.peak_bytes)

    def run():
        total = None
        for batch in micro:
            _, g = grad(carry["params"], batch)
            total = g if total is None else jax.tree.map(jnp.add, total, g)
        grads = jax.tree.map(lambda g: g / k, total)
        carry["params"], carry["opt"] = apply(carry["params"], carry["opt"], grads)
        return carry["params"]

    reports = {"grad": grad_report, "apply": apply_report}
    return Prepared(run, peak, k * grad_report.dot_flops + apply_report.dot_flops, k + 1, reports)


_MICRO_GRADS: dict[tuple[str, int], tuple[Callable[..., Any], MemoryReport]] = {}


def micro_grad(w: _workloads.Workload, k: int) -> tuple[Callable[..., Any], MemoryReport]:
    """``jax.jit(jax.value_and_grad(mean loss))`` and its report on one micro-batch of k."""
    if (w.name, k) not in _MICRO_GRADS:
        loss = w.loss_for("none")
        grad = jax.jit(jax.value_and_grad(lambda p, b: loss(p, b).value))
        micro = jax.tree.map(lambda x: x[0], jaxga.split_microbatches(w.batch, k))
        _MICRO_GRADS[w.name, k] = grad, jaxga.memory_report(grad, w.params, micro)
    return _MICRO_GRADS[w.name, k]


def memory_model(w: _workloads.Workload, tx: optax.GradientTransformation, k: int) -> dict:
    """params + optimiser state + one f32 accumulator + the batch + one micro-batch's
    activations (the temporaries of ``jax.value_and_grad`` on one micro-batch)."""
    parts = {
        "params": tree_bytes(w.params),
        "opt_state": tree_bytes(jax.eval_shape(tx.init, w.params)),
        "accumulator": sum(x.size * 4 for x in jax.tree.leaves(w.params)),
        "batch": tree_bytes(w.batch),
        "activations": micro_grad(w, k)[1].temp_bytes,
    }
    return {**parts, "total": sum(parts.values())}


def measured_peak(workload: int, method: Method, quick: bool) -> int | None:
    """The device's high-water mark in a fresh process that builds the method's state,
    compiles its step(s) and takes one global step; ``None`` without memory statistics."""
    cmd = [sys.executable, __file__, "--measure-one", str(workload), method.key]
    cmd += ["--quick"] if quick else []
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_bytes_in_use"]


def measure_one(workload: int, key: str, quick: bool) -> None:
    """Child process of :func:`measured_peak`: one global step, then the device's peak."""
    w = _workloads.workloads(quick, only=workload)[0]
    prepared = prepare(Method.from_key(key), w, optax.adam(1e-3))
    jax.block_until_ready(prepared.run())
    stats = jax.local_devices()[0].memory_stats() or {}
    print(json.dumps({"peak_bytes_in_use": stats.get("peak_bytes_in_use")}))


def device_name() -> str:
    device = jax.devices()[0]
    if device.platform == "cpu":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", f"{device.platform}-{device.device_kind}".lower()).strip("-")


def checks(row: dict, rows: list[dict], target_time: float) -> dict[str, Any]:
    """The targets a row is held to: only the plain scan rows have them."""
    if row["kind"] != "scan" or row["remat"] != "none":
        return {}
    out = {}
    if row["time_ratio"] is not None:
        out["time_vs_full"] = (row["time_ratio"], row["time_ratio"] <= target_time)
    peer = [r for r in rows if r["kind"] == "optax" and r["k"] == row["k"] and r["median_s"]]
    if peer and row["median_s"]:
        ratio = row["median_s"] / peer[0]["median_s"]
        out["time_vs_optax"] = (ratio, ratio <= TARGET_PEER)
    ratio = row["peak_bytes"] / row["memory_model"]["total"]
    out["memory_vs_model"] = (ratio, ratio <= TARGET_MEMORY)
    return out


def spread(times: list[float]) -> float:
    """The interquartile range relative to the median."""
    q1, _, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / statistics.median(times)


def benchmark_workload(
    index: int, w: _workloads.Workload, args: argparse.Namespace, target_time: float
) -> dict:
    """Prepares, compiles, sizes and times every method on workload ``w``."""
    tx = optax.adam(1e-3)
    peer_k = SCAN_K if not args.quick else (4, 16)
    todo = [m for m in methods(peer_k) if w.batch_size % m.k == 0]
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    print(f"\n{w.name}: {w.description}", flush=True)
    prepared, fits = {}, {}
    for m in todo:
        start = time.perf_counter()
        prepared[m] = prepare(m, w, tx)
        # Run only what fits the device, by the compiled peak: no out-of-memory crash.
        fits[m] = limit is None or prepared[m].peak_bytes <= limit
        if fits[m]:
            prepared[m].run()  # compiles (a cache hit: memory_report compiled it), warms up
        print(f"  prepared {m.label} k={m.k} in {time.perf_counter() - start:.1f}s", flush=True)
    runners = {m.key: prepared[m].run for m in todo if fits[m]}
    time_interleaved(runners, 1)
    times = time_interleaved(runners, args.rounds)
    models = {k: memory_model(w, tx, k) for k in SCAN_K if w.batch_size % k == 0}

    medians = {key: statistics.median(t) for key, t in times.items()}
    full_median = medians.get(Method("full").key)
    full = prepared[Method("full")]
    rows = []
    for m in todo:
        p = prepared[m]
        median = medians.get(m.key)
        row = {
            "method": m.label,
            "kind": m.kind,
            "k": m.k,
            "remat": m.remat,
            "microbatch_size": w.batch_size // m.k,
            "calls_per_global_step": p.calls,
            "fits": fits[m],
            "times_s": times.get(m.key),
            "median_s": median,
            "spread": spread(times[m.key]) if median else None,
            "time_ratio": median / full_median if median and full_median else None,
            "peak_bytes": p.peak_bytes,
            "peak_ratio": p.peak_bytes / full.peak_bytes,
            "dot_flops": p.dot_flops,
            "flops_ratio": p.dot_flops / full.dot_flops,
            "measured_peak_bytes": (
                measured_peak(index, m, args.quick) if args.measure and fits[m] else None
            ),
            "reports": {name: dataclasses.asdict(r) for name, r in p.reports.items()},
        }
        if m.kind == "scan" and m.remat == "none":
            row["memory_model"] = models[m.k]
        rows.append(row)
    for row in rows:
        row["targets"] = checks(row, rows, target_time)
    return {"name": w.name, "description": w.description, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, few rounds (CPU)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (10 quick, 20)")
    parser.add_argument("--measure", action="store_true", help="measured device peak (GPU)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--only", type=int, default=None, help="only the n-th workload (0, 1, 2)")
    parser.add_argument("--measure-one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure or args.measure_one:
        # Allocate as needed (no pool taken up front), so that peak_bytes_in_use is the
        # program's, and the measuring child process finds memory free.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    # memory_report compiles each step and its first call compiles it again: a persistent
    # cache, fresh for this run, makes the second a lookup.
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="jaxga-bench-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    if args.measure_one:
        measure_one(int(args.measure_one[0]), args.measure_one[1], args.quick)
        return 0
    args.rounds = args.rounds or (10 if args.quick else 20)
    backend = jax.default_backend()
    target_time = TARGET_TIME["cpu" if backend == "cpu" else "gpu"]
    start = time.perf_counter()
    results = [
        benchmark_workload(i, w, args, target_time)
        for i, w in enumerate(_workloads.workloads(args.quick))
        if args.only is None or i == args.only
    ]
    device = jax.devices()[0]
    out = {
        "device": device_name(),
        "device_kind": device.device_kind,
        "platform": backend,
        "cpu_count": len(os.sched_getaffinity(0)),
        "host": platform.machine(),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "quick": args.quick,
        "rounds": args.rounds,
        "targets": {
            "time_vs_full": target_time,
            "time_vs_optax": TARGET_PEER,
            "memory_vs_model": TARGET_MEMORY,
        },
        "seconds": time.perf_counter() - start,
        "workloads": results,
        "command": "python benchmarks/run.py" + (" --quick" if args.quick else ""),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / out["device"]
    stem.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    stem.with_suffix(".md").write_text(_report.markdown(out))
    _report.figure(out, stem.with_suffix(".png"))
    print("\n" + _report.markdown(out))
    print(f"wrote {stem}.json, .md, .png in {out['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main())
