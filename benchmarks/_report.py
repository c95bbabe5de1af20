"""The benchmark's markdown table and figure, from its JSON results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {
    "full": "#555555",
    "scan": "#1f77b4",
    "microbatch": "#9467bd",
    "optax": "#d62728",
    "jaxga": "#17becf",
    "naive": "#ff7f0e",
}
REMAT_COLOR = "#2ca02c"


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def machine(out: dict[str, Any]) -> str:
    """The machine the figures came from, in words."""
    if out["platform"] == "cpu":
        return f"CPU, {out['cpu_count']} cores ({out['host']})"
    return f"{out['platform'].upper()}: {out['device_kind']}"


def row_label(row: dict[str, Any]) -> str:
    return row["method"] if row["kind"] == "full" else f"{row['method']}, k={row['k']}"


def _check(result: Any) -> str:
    if not result:
        return ""
    ratio, ok = result
    return f"{'✓' if ok else '✗'} {ratio:.2f}×"


def markdown(out: dict[str, Any]) -> str:
    """The results as markdown: one table per workload, ✓/✗ against the targets."""
    t = out["targets"]
    rows = [r for w in out["workloads"] for r in w["rows"] if "error" not in r]
    met = [ok for r in rows for _, ok in r["targets"].values()]
    measured = any(r.get("measured_peak_bytes") for r in rows)
    mfu = any(r.get("mfu") for r in rows)
    seconds = sum(w.get("seconds", 0) for w in out["workloads"])
    lines = [
        f"# jaxga benchmark — {machine(out)}",
        "",
        f"`{out['command']}` · jax {out['jax']}, optax {out['optax']} · {out['dtype']} matrix "
        f"products · each method in its own process: one warm-up global step, then "
        f"{out['rounds']} timed, medians · {seconds:.0f} s in all.",
        "",
        "Per global step (the whole batch, whatever k). **ms**: median wall-clock time "
        "± half the interquartile range. "
        + ("**MFU**: model FLOPs (no recomputation) per second ÷ the device's peak. " * mfu)
        + "**peak**: XLA's compiled peak (arguments + outputs + temporaries − donated); for "
        "the MultiSteps and the naive loop, one call's peak (naive: plus the optimiser "
        "state and the running gradient sum that stay in memory meanwhile). "
        + ("**measured**: the device's peak bytes in use in the method's process. " * measured)
        + "**FLOPs**: matmul FLOPs of the jaxpr, every scan iteration and recomputation "
        "counted, × the full batch's. **model**: params + optimiser state + one f32 "
        "accumulator + the batch + one micro-batch's activations.",
        "",
        f"Targets, held by the plain `jaxga.value_and_grad` rows: time ≤ "
        f"{t['time_vs_full']}× full batch; time ≤ {t['time_vs_optax']}× optax.MultiSteps at "
        f"the same k; peak ≤ {t['memory_vs_model']}× the memory model. "
        f"**Met: {sum(met)} of {len(met)}.**",
    ]
    for w in out["workloads"]:
        lines += ["", f"### {w['name']}: {w['description']}", ""]
        head = ["method", "micro-batch", "ms", "× full"] + ["MFU"] * mfu + ["peak"]
        head += ["measured peak"] * measured
        head += ["× full", "FLOPs ×", "model", "time ≤ full", "time ≤ MultiSteps", "peak ≤ model"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in w["rows"]:
            if "error" in r:
                cells = [row_label(r), "", f"failed: {r['error'][:120]}"]
                lines.append("| " + " | ".join(cells + [""] * (len(head) - 3)) + " |")
                continue
            model = r.get("memory_model", {}).get("total")
            cells = [
                row_label(r),
                str(r["microbatch_size"]),
                f"{1e3 * r['median_s']:.1f} ±{50 * r['spread']:.0f}%" if r["median_s"] else "",
                f"{r['time_ratio']:.2f}" if r["time_ratio"] else "",
            ]
            if mfu:
                cells.append(f"{r['mfu']:.1%}" if r.get("mfu") else "")
            cells.append(mib(r["peak_bytes"]) + ("" if r["fits"] else " (does not fit: not run)"))
            if measured:
                m = r.get("measured_peak_bytes")
                cells.append(mib(m) if m else "")
            cells += [
                f"{r['peak_ratio']:.2f}",
                f"{r['flops_ratio']:.2f}",
                mib(model) if model else "",
                _check(r["targets"].get("time_vs_full")),
                _check(r["targets"].get("time_vs_optax")),
                _check(r["targets"].get("memory_vs_model")),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def figure(out: dict[str, Any], path: Path) -> None:
    """Time ratio and compiled peak per method, one row of panels per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = out["workloads"]
    height = max(len(w["rows"]) for w in workloads) * 0.28 + 1.2
    fig, axes = plt.subplots(
        len(workloads), 2, figsize=(12, height * len(workloads)), squeeze=False
    )
    for (ax_t, ax_m), w in zip(axes, workloads):
        rows = [r for r in w["rows"][::-1] if "error" not in r]
        labels = [row_label(r) for r in rows]
        colors = [
            REMAT_COLOR if r["kind"] == "scan" and r["remat"] != "none" else COLORS[r["kind"]]
            for r in rows
        ]
        y = range(len(rows))
        ax_t.barh(y, [r["time_ratio"] or 0 for r in rows], color=colors)
        ax_t.axvline(1.0, color="black", lw=0.8)
        ax_t.axvline(out["targets"]["time_vs_full"], color="black", ls="--", lw=0.8)
        ax_t.set_yticks(list(y), labels, fontsize=8)
        ax_t.set_xlabel("time per global step ÷ full batch (dashed: target for jaxga)")
        ax_t.set_title(w["name"], loc="left", fontsize=10)
        ax_m.barh(y, [r["peak_bytes"] / 2**20 for r in rows], color=colors)
        model = [(i, r["memory_model"]["total"]) for i, r in enumerate(rows) if "memory_model" in r]
        if model:
            ax_m.scatter(
                [m / 2**20 for _, m in model],
                [i for i, _ in model],
                marker="|",
                s=200,
                color="black",
                zorder=3,
                label="memory model",
            )
            ax_m.legend(fontsize=8, loc="lower right")
        ax_m.set_yticks(list(y), [""] * len(rows))
        ax_m.set_xlabel("compiled peak memory (MiB)")
    fig.suptitle(f"jaxga benchmark, {machine(out)} — {out['command']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
