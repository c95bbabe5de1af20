"""Activation memory and compute against depth, for five rematerialisation strategies.

The classic figure of the gradient-checkpointing literature (Chen et al., 2016;
cybertronai/gradient-checkpointing), made with ``jaxga.remat_scan`` and
``jaxga.memory_report``. The model is a stack of pre-norm residual MLP blocks
``x + W₂ gelu(W₁ norm(x))`` on a batch of ``tokens × dim`` activations; the program
measured is one gradient of a loss with respect to all parameters and the input.

* activation memory = XLA's compiled temporary bytes (``MemoryReport.temp_bytes``):
  everything the step allocates beyond its arguments and outputs. Compiled only,
  never run, so depth 256 costs seconds.
* compute = matmul FLOPs counted from the jaxpr of the gradient, with every scan
  iteration and every rematerialised recomputation (``MemoryReport.dot_flops``),
  relative to no remat. XLA's own cost analysis counts a loop body once, so it cannot
  compare scans of different depths.
* time (``--time``): median wall-clock seconds of the compiled step on this machine.

    .venv/bin/python examples/remat_memory.py            # writes docs/remat_memory.{png,json}
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxga
from jaxga.remat import resolve_segments

# label -> (policy, segments)
STRATEGIES: dict[str, tuple[str, int | str]] = {
    "no remat": ("none", 1),
    "per layer (policy='full')": ("full", 1),
    "√L segments (policy='full', segments='sqrt')": ("full", "sqrt"),
    "√L segments, store inside (policy='none', segments='sqrt')": ("none", "sqrt"),
    "dots saved (policy='dots')": ("dots", 1),
}
GOAL_MEMORY, GOAL_FLOPS, GOAL_DEPTH = 8.0, 1.35, 64


def block(params: dict, x: jax.Array) -> jax.Array:
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    h = (x - mean) * jax.lax.rsqrt(var + 1e-6) * params["scale"]
    h = jax.nn.gelu(h @ params["w1"] + params["b1"])
    return x + h @ params["w2"]


def stacked_params(depth: int, dim: int, hidden: int, key: jax.Array | None = None) -> dict:
    """Stacked block parameters: arrays with ``key``, else shapes only."""
    shapes = {"scale": (dim,), "w1": (dim, hidden), "b1": (hidden,), "w2": (hidden, dim)}
    if key is None:
        return {k: jax.ShapeDtypeStruct((depth, *s), jnp.float32) for k, s in shapes.items()}
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    return {k: jax.random.normal(keys[k], (depth, *s)) / jnp.sqrt(s[0]) for k, s in shapes.items()}


def grad_step(policy: str, segments: int | str):
    def loss(params, x):
        return jnp.mean(
            jnp.square(jaxga.remat_scan(block, params, x, policy=policy, segments=segments))
        )

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def measure(depth: int, policy: str, segments, tokens: int, dim: int, hidden: int, timed: bool):
    step = grad_step(policy, segments)
    x = jax.ShapeDtypeStruct((tokens, dim), jnp.float32)
    report = jaxga.memory_report(step, stacked_params(depth, dim, hidden), x)
    row = {
        "depth": depth,
        "policy": policy,
        "segments": segments,
        "num_segments": resolve_segments(segments, depth),
        "temp_bytes": report.temp_bytes,
        "argument_bytes": report.argument_bytes,
        "output_bytes": report.output_bytes,
        "dot_flops": report.dot_flops,
        "seconds": None,
    }
    if timed:
        params = stacked_params(depth, dim, hidden, jax.random.key(0))
        xs = jax.random.normal(jax.random.key(1), (tokens, dim))
        jax.block_until_ready(step(params, xs))
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(step(params, xs))
            runs.append(time.perf_counter() - start)
        row["seconds"] = statistics.median(runs)
    return row


def goal_table(rows: list[dict]) -> list[dict]:
    """Per strategy and depth: memory saved and FLOPs spent relative to no remat."""
    base = {r["depth"]: r for r in rows if r["label"] == "no remat"}
    out = []
    for r in rows:
        b = base[r["depth"]]
        out.append(
            {
                "label": r["label"],
                "depth": r["depth"],
                "memory_saving": b["temp_bytes"] / r["temp_bytes"],
                "flops_ratio": r["dot_flops"] / b["dot_flops"],
            }
        )
    return out


def goal_met_by(table: list[dict]) -> list[str]:
    """The strategies within both goals at every depth >= GOAL_DEPTH."""
    deep = [g for g in table if g["depth"] >= GOAL_DEPTH]
    labels = dict.fromkeys(g["label"] for g in deep)
    return [
        label
        for label in labels
        if all(
            g["memory_saving"] >= GOAL_MEMORY and g["flops_ratio"] <= GOAL_FLOPS
            for g in deep
            if g["label"] == label
        )
    ]


STYLES = {
    "no remat": {"color": "black", "marker": "s", "lw": 2.2},
    "per layer (policy='full')": {"color": "C1", "marker": "o"},
    "√L segments (policy='full', segments='sqrt')": {"color": "C2", "marker": "^"},
    "√L segments, store inside (policy='none', segments='sqrt')": {"color": "C3", "marker": "v"},
    "dots saved (policy='dots')": {"color": "C0", "marker": "x", "ls": "--"},
}


def plot(rows: list[dict], config: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = any(r["seconds"] is not None for r in rows)
    fig, axes = plt.subplots(1, 3 if timed else 2, figsize=(17 if timed else 12, 5.8))
    table = goal_table(rows)
    ratios = {(g["label"], g["depth"]): g for g in table}
    for label in STRATEGIES:
        mine = [r for r in rows if r["label"] == label]
        depths = [r["depth"] for r in mine]
        style = {**STYLES[label], "label": label}
        axes[0].plot(depths, [r["temp_bytes"] / 2**20 for r in mine], **style)
        extra = [100 * (ratios[label, d]["flops_ratio"] - 1) for d in depths]
        axes[1].plot(depths, extra, **style)
        if timed:
            axes[2].plot(depths, [r["seconds"] for r in mine], **style)
    base = [r for r in rows if r["label"] == "no remat"]
    axes[0].plot(
        [r["depth"] for r in base],
        [r["temp_bytes"] / 2**20 / GOAL_MEMORY for r in base],
        color="gray",
        ls=":",
        label=f"goal: {GOAL_MEMORY:g}× below no remat",
    )
    axes[1].axhline(
        100 * (GOAL_FLOPS - 1), color="gray", ls=":", label=f"goal: ≤ {100 * (GOAL_FLOPS - 1):.0f}%"
    )
    axes[0].set(
        yscale="log",
        ylabel="activation memory = XLA temp bytes (MiB)",
        title="Activation memory of one gradient step",
    )
    axes[1].set(
        ylabel="extra matmul FLOPs vs. no remat (%)",
        title="Recomputation cost (counted from the jaxpr)",
        ylim=(-3, 60),
    )
    if timed:
        axes[2].set(yscale="log", ylabel="seconds per step (median of 3)", title="Step time")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("depth L (layers)")
        ax.set_xticks(config["depths"], [str(d) for d in config["depths"]])
        ax.grid(True, which="both", alpha=0.3)
    met = goal_met_by(table)
    axes[1].text(
        0.02,
        0.97,
        f"goal at L ≥ {GOAL_DEPTH}: ≥ {GOAL_MEMORY:g}× less memory for ≤ "
        f"{100 * (GOAL_FLOPS - 1):.0f}% more FLOPs\nmet by: " + ("; ".join(met) or "none"),
        transform=axes[1].transAxes,
        va="top",
        fontsize=8.5,
        bbox={"facecolor": "white", "alpha": 0.9, "edgecolor": "gray"},
    )
    handles, labels = axes[0].get_legend_handles_labels()
    handles.append(axes[1].get_lines()[-1])
    labels.append(f"goal: ≤ {100 * (GOAL_FLOPS - 1):.0f}% more FLOPs")
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8.5, frameon=False)
    fig.suptitle(
        f"jaxga.remat_scan on pre-norm MLP blocks: {config['tokens']} tokens × {config['dim']}"
        f" (hidden {config['hidden']}), float32, jit(grad) compiled for {config['backend']}"
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(
    depths=(8, 16, 32, 64, 128, 256),
    tokens: int = 512,
    dim: int = 128,
    hidden: int = 512,
    timed: bool = False,
    png: str | Path = "docs/remat_memory.png",
    json_path: str | Path = "docs/remat_memory.json",
) -> dict:
    config = {
        "depths": list(depths),
        "tokens": tokens,
        "dim": dim,
        "hidden": hidden,
        "backend": jax.default_backend(),
        "activation_memory": "XLA compiled temp_size_in_bytes of jit(grad(loss))",
        "flops": "matmul FLOPs from the jaxpr, every scan iteration and recomputation counted",
    }
    rows = []
    for depth in depths:
        for label, (policy, segments) in STRATEGIES.items():
            row = measure(depth, policy, segments, tokens, dim, hidden, timed)
            rows.append({"label": label, **row})
    table = goal_table(rows)

    print(f"{'strategy':<60} {'L':>4} {'s':>3} {'temp MiB':>9} {'saving':>7} {'FLOPs':>6}")
    for r, g in zip(rows, table):
        t = f"  {r['seconds']:.3f}s" if r["seconds"] is not None else ""
        print(
            f"{r['label']:<60} {r['depth']:>4} {r['num_segments']:>3} "
            f"{r['temp_bytes'] / 2**20:>9.1f} {g['memory_saving']:>6.1f}x "
            f"{g['flops_ratio']:>6.3f}{t}"
        )
    meets = goal_met_by(table)
    print(
        f"\nGoal: >= {GOAL_MEMORY:g}x less activation memory than no remat at every depth >= "
        f"{GOAL_DEPTH} for <= {100 * (GOAL_FLOPS - 1):.0f}% more matmul FLOPs."
    )
    print("Met by: " + (", ".join(meets) if meets else "no strategy"))

    result = {"config": config, "rows": rows, "relative": table, "goal_met_by": meets}
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
    if png:
        plot(rows, config, Path(png))
        print(f"Wrote {png}" + (f" and {json_path}" if json_path else ""))
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    parser.add_argument("--tokens", type=int, default=512, help="rows of the activations")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--time", action="store_true", help="also run and time each step")
    parser.add_argument("--png", default="docs/remat_memory.png")
    parser.add_argument("--json", default="docs/remat_memory.json")
    args = parser.parse_args()
    main(args.depths, args.tokens, args.dim, args.hidden, args.time, args.png, args.json)
