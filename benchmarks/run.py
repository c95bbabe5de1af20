"""Side by side: full batch, jaxga's in-step scan, its peers, a naive loop, remat.

For each workload (an MLP and the example's transformer at two sizes), every method
below trains the same model on the same global batch with the same optimiser (Adam),
each **in its own fresh process** (so nothing of one method is resident while another
runs, and the device's peak is that method's alone), and reports per global step: the
median time and its ratio to the full-batch step, XLA's compiled peak, the device's
measured peak where it has one, matmul FLOPs and MFU.

* full batch: ``jax.value_and_grad`` on the whole batch, then the update; one jitted
  step, parameters and optimiser state donated.
* jaxga.value_and_grad, k: the same step with ``jaxga.value_and_grad``, a ``lax.scan``
  over the micro-batches inside the step.
* optax.microbatching, k: the same step with ``optax.microbatching.microbatch`` (a
  ``fori_loop`` over micro-batches) summing ``jax.value_and_grad`` of the loss's total.
* optax.MultiSteps / jaxga.MultiSteps, k: a global step is k calls of a jitted
  micro-batch step whose optimiser is ``MultiSteps(adam, every_k_schedule=k)``.
* naive loop, k: k calls of a jitted ``jax.value_and_grad``, gradients summed by eager
  ``jax.tree.map(jnp.add, ...)`` from Python (the PyTorch/TF custom-loop style), divided
  by k, then a jitted update.
* jaxga + remat: the scan at k=4 with each ``jaxga.remat_scan`` policy.

Every method's programs are compiled with the same XLA options,
``jaxga.compiler_options()`` (on a GPU: scans' stacked outputs not zero-filled first; see
``jaxga/compiler.py``), the options ``jaxga.make_train_step`` compiles with.

    .venv/bin/python benchmarks/run.py --quick     # CPU, small models (about 6 min on 2 cores)
    python benchmarks/run.py --only 2              # GPU: Transformer M alone

Writes ``benchmarks/results/<device>.json``, ``.md`` and ``.png``, after each workload
(a run of ``--only`` replaces that workload's table and keeps the others).
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

import jaxga
from jaxga.memory import MemoryReport

SCAN_K = (2, 4, 8, 16)
PEER_K = (4, 8)  # k of optax.microbatching, the two MultiSteps and the naive loop
REMAT_K = 4
REMATS = ("dots", "dots_no_batch", "full", "sqrt")
TARGET_TIME = {"cpu": 1.25, "gpu": 1.05}  # scan step time ≤ this × the full-batch step
TARGET_PEER = 1.0  # scan step time ≤ this × optax.MultiSteps at the same k
TARGET_MEMORY = 1.25  # compiled peak ≤ this × the memory model
LABELS = {
    "full": "full batch",
    "scan": "jaxga.value_and_grad",
    "microbatch": "optax.microbatching",
    "optax": "optax.MultiSteps",
    "jaxga": "jaxga.MultiSteps",
    "naive": "naive loop",
}


@dataclasses.dataclass(frozen=True)
class Method:
    """One way to take a global step: ``kind`` is a key of :data:`LABELS`."""

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
        return LABELS[self.kind]

    @classmethod
    def from_key(cls, key: str) -> Method:
        kind, k, remat = key.split("-", 2)
        return cls(kind, int(k[1:]), remat)


def methods() -> list[Method]:
    """Every method of the benchmark, in table order."""
    out = [Method("full")]
    out += [Method("scan", k) for k in SCAN_K]
    out += [Method(kind, k) for kind in ("microbatch", "optax", "jaxga") for k in PEER_K]
    out += [Method("naive", REMAT_K)]
    out += [Method("scan", REMAT_K, r) for r in REMATS]
    return out


def tree_bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def make_step(
    grad_fn: Callable[..., Any], tx: optax.GradientTransformation, backend: str | None = None
):
    """A jitted step: ``grad_fn`` then the optimiser; params and state donated; compiled
    with jaxga's options for ``backend`` (the default backend's if ``None``)."""

    def step(params, opt_state, batch):
        value, grads = grad_fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    options = jaxga.compiler_options(backend)
    return jax.jit(step, donate_argnums=(0, 1), compiler_options=options)


def make_apply(tx: optax.GradientTransformation):
    """A jitted update on given gradients; params and state donated."""

    def apply(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(apply, donate_argnums=(0, 1), compiler_options=jaxga.compiler_options())


def optax_microbatched(loss: Callable[..., jaxga.Mean], k: int, batch_size: int):
    """``value_and_grad`` of the mean loss by ``optax.microbatching.microbatch``: the sums
    of the totals, counts and gradients over micro-batches, divided once at the end."""

    def total_grad(params, batch):
        (total, count), grads = jax.value_and_grad(
            lambda p: (lambda m: (m.total, m.count))(loss(p, batch)), has_aux=True
        )(params)
        return total, count, grads

    summed = optax.microbatching.microbatch(total_grad, argnums=1, microbatch_size=batch_size // k)

    def grad_fn(params, batch):
        total, count, grads = summed(params, batch)
        return total / count, jax.tree.map(lambda g: g / count, grads)

    return grad_fn


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
    carry: dict[str, Any] = {"params": w.params}
    if method.kind in ("full", "scan", "microbatch"):
        grad_fn = {
            "full": lambda: jax.value_and_grad(mean_loss),
            "scan": lambda: jaxga.value_and_grad(loss, num_microbatches=k),
            "microbatch": lambda: optax_microbatched(loss, k, w.batch_size),
        }[method.kind]()
        step = make_step(grad_fn, tx)
        carry["opt"] = tx.init(carry["params"])
        report = jaxga.memory_report(step, carry["params"], carry["opt"], w.batch)

        def run():
            carry["params"], carry["opt"], _ = step(carry["params"], carry["opt"], w.batch)
            return carry["params"]

        return Prepared(run, report.peak_bytes, report.dot_flops, 1, {"step": report})

    if method.kind in ("optax", "jaxga"):
        wrapper = optax.MultiSteps if method.kind == "optax" else jaxga.MultiSteps
        multi = wrapper(tx, every_k_schedule=k)
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


def micro_grad(w: _workloads.Workload, k: int) -> tuple[Callable[..., Any], MemoryReport]:
    """``jax.jit(jax.value_and_grad(mean loss))`` and its report on one micro-batch of k."""
    loss = w.loss_for("none")
    grad = jax.jit(
        jax.value_and_grad(lambda p, b: loss(p, b).value), compiler_options=jaxga.compiler_options()
    )
    micro = jax.tree.map(lambda x: x[0], jaxga.split_microbatches(w.batch, k))
    return grad, jaxga.memory_report(grad, w.params, micro)


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


def device_name() -> str:
    device = jax.devices()[0]
    if device.platform == "cpu":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", f"{device.platform}-{device.device_kind}".lower()).strip("-")


def run_one(index: int, method: Method, args: argparse.Namespace) -> dict:
    """In the method's own process: build, compile, size, then time ``args.rounds`` global
    steps (after one to warm up) unless the compiled peak exceeds the device's memory."""
    w = _workloads.workloads(args.quick, args.dtype, only=index)[0]
    tx = optax.adam(1e-3)
    row: dict[str, Any] = {
        "workload": w.name,
        "description": w.description,
        "model_flops": w.model_flops,
        "method": method.label,
        **dataclasses.asdict(method),
        "microbatch_size": w.batch_size // method.k,
    }
    if method.kind == "scan" and method.remat == "none":
        row["memory_model"] = memory_model(w, tx, method.k)
    p = prepare(method, w, tx)
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    row |= {
        "calls_per_global_step": p.calls,
        "peak_bytes": p.peak_bytes,
        "dot_flops": p.dot_flops,
        "fits": limit is None or p.peak_bytes <= limit,
        "reports": {name: dataclasses.asdict(r) for name, r in p.reports.items()},
    }
    if row["fits"]:
        jax.block_until_ready(p.run())  # compiles (a cache hit: memory_report compiled it)
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            jax.block_until_ready(p.run())
            times.append(time.perf_counter() - start)
        row["times_s"] = times
        stats = jax.local_devices()[0].memory_stats() or {}
        row["measured_peak_bytes"] = stats.get("peak_bytes_in_use")
    return row


def run_in_child(index: int, method: Method, args: argparse.Namespace) -> dict:
    """Runs :func:`run_one` in a fresh process; a crash becomes a row with its error."""
    cmd = [sys.executable, __file__, "--one", str(index), method.key, "--dtype", args.dtype]
    cmd += ["--rounds", str(args.rounds)] + ["--quick"] * args.quick
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        error = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"  {method.label} k={method.k}: FAILED in {seconds:.0f}s: {error}", flush=True)
        return {"method": method.label, **dataclasses.asdict(method), "error": error}
    row = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"  {method.label} k={method.k}: {seconds:.0f}s", flush=True)
    return row


def summarise(rows: list[dict], backend: str, peak: float | None) -> dict:
    """A workload's rows with medians, ratios to the full batch, MFU (against ``peak``
    FLOP/s, if known) and targets."""
    ok = [r for r in rows if "error" not in r]
    for r in ok:
        times = r.get("times_s")
        r["median_s"] = statistics.median(times) if times else None
        r["spread"] = spread(times) if times and len(times) >= 2 else None
        r["mfu"] = r["model_flops"] / r["median_s"] / peak if peak and times else None
    full = next(r for r in ok if r["kind"] == "full")
    for r in ok:
        timed = r["median_s"] and full["median_s"]
        r["time_ratio"] = r["median_s"] / full["median_s"] if timed else None
        r["peak_ratio"] = r["peak_bytes"] / full["peak_bytes"]
        r["flops_ratio"] = r["dot_flops"] / full["dot_flops"]
    for r in rows:
        r["targets"] = checks(r, ok, TARGET_TIME["cpu" if backend == "cpu" else "gpu"])
    return {"name": ok[0]["workload"], "description": ok[0]["description"], "rows": rows}


def checks(row: dict, rows: list[dict], target_time: float) -> dict[str, Any]:
    """The targets a row is held to: only the plain scan rows have them."""
    if "error" in row or row["kind"] != "scan" or row["remat"] != "none":
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models (CPU)")
    parser.add_argument("--rounds", type=int, default=10, help="timed global steps per method")
    parser.add_argument("--only", type=int, default=None, help="only the n-th workload (0, 1, 2)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="of the matrix products (default: bfloat16 on a GPU, float32 elsewhere)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    backend = jax.default_backend()
    args.dtype = args.dtype or ("bfloat16" if backend == "gpu" else "float32")
    if args.one:
        # Allocate as needed (no pool taken up front), so that peak_bytes_in_use is the
        # program's own; memory_report compiles each step and its first call compiles it
        # again: the persistent cache makes the second a lookup.
        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="jaxga-bench-"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        row = run_one(int(args.one[0]), Method.from_key(args.one[1]), args)
        print(json.dumps(row))
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / device_name()
    saved = stem.with_suffix(".json")
    previous = json.loads(saved.read_text()) if saved.exists() else {}
    names = _workloads.names(args.quick)
    done = {w["name"]: w for w in previous.get("workloads", [])}
    if previous.get("quick") != args.quick or previous.get("dtype") != args.dtype:
        done = {}  # another run's sizes: nothing to keep
    device = jax.devices()[0]
    for index, name in enumerate(names):
        if args.only is not None and index != args.only:
            continue
        print(f"\n{name}", flush=True)
        start = time.perf_counter()
        rows = [run_in_child(index, m, args) for m in methods()]
        peak = _workloads.peak_flops(args.dtype)
        done[name] = summarise(rows, backend, peak) | {"seconds": time.perf_counter() - start}
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
            "dtype": args.dtype,
            "targets": {
                "time_vs_full": TARGET_TIME["cpu" if backend == "cpu" else "gpu"],
                "time_vs_optax": TARGET_PEER,
                "memory_vs_model": TARGET_MEMORY,
            },
            "workloads": [done[n] for n in names if n in done],
            "command": "python benchmarks/run.py" + " --quick" * args.quick,
        }
        stem.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
        stem.with_suffix(".md").write_text(_report.markdown(out))
        _report.figure(out, stem.with_suffix(".png"))
        print(f"### {name}" + _report.markdown(out).split(f"### {name}")[-1], flush=True)
        print(f"wrote {stem}.json, .md, .png", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(main())
