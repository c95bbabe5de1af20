"""jaxga.MultiSteps against optax.MultiSteps: time per global step and compiled memory.

Both wrap the same ``optax.adam`` and train the same MLP of a few million parameters
with k micro-batch calls per global step, each in two settings: as built by default
(neither skips non-finite gradients) and with both skipping them
(``should_skip_update_fn=skip_not_finite``), so that the cost of the check is seen apart. Each call
is one jitted train step (gradient, ``tx.update``, ``optax.apply_updates``) with params
and optimiser state donated. They are timed in one process, interleaved round by round
(alternating the order), and the medians are compared. A second comparison times
``tx.update`` alone on fixed gradients, where the optimiser's own memory traffic is all there is.

Run:  .venv/bin/python benchmarks/multisteps.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).parent))

from _timing import time_interleaved

import jaxga

# jaxga's runs compared with optax's: as built by default, and both skipping non-finite calls
PAIRS = {"defaults": ("jaxga", "optax"), "both skip": ("jaxga_skip", "optax_skip")}


def init_mlp(key: jax.Array, sizes: list[int]) -> list[dict[str, jax.Array]]:
    """Returns the weights of an MLP with the given layer sizes."""
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:])
    ]


def loss_fn(params: list[dict[str, jax.Array]], batch: dict[str, jax.Array]) -> jax.Array:
    """Softmax cross-entropy of a GELU MLP."""
    x = batch["x"]
    for layer in params[:-1]:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make_train_step(tx: optax.GradientTransformation) -> Callable[..., Any]:
    """One micro-batch call: gradient, ``tx.update``, apply; params and state donated."""

    def step(params, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def make_update(tx: optax.GradientTransformation) -> Callable[..., Any]:
    """``tx.update`` and apply alone, on given gradients; params and state donated."""

    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(update, donate_argnums=(0, 1))


def peak(stats: Any) -> int:
    """A compiled program's peak from its ``memory_analysis()``: arguments + outputs +
    temporaries − aliased."""
    return (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
    )


def peak_bytes(fn: Callable[..., Any], *args: Any) -> int:
    """Compiled peak memory of one call of ``fn`` on ``args``."""
    return peak(fn.lower(*args).compile().memory_analysis())


def transformations(k: int) -> dict[str, optax.GradientTransformation]:
    """The four MultiSteps of the comparison around ``optax.adam``, named as in ``PAIRS``."""
    inner, skip = optax.adam(1e-3), optax.skip_not_finite
    return {
        "jaxga": jaxga.MultiSteps(inner, k),
        "optax": optax.MultiSteps(inner, k, use_grad_mean=True),
        "jaxga_skip": jaxga.MultiSteps(inner, k, should_skip_update_fn=skip),
        "optax_skip": optax.MultiSteps(inner, k, True, should_skip_update_fn=skip),
    }


def copy_tree(tree: Any) -> Any:
    return jax.tree.map(jnp.copy, tree)


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [args.width_in] + [args.hidden] * args.layers + [args.classes]
    params = init_mlp(jax.random.key(0), sizes)
    num_params = sum(x.size for x in jax.tree.leaves(params))
    kx, ky = jax.random.split(jax.random.key(1))
    batches = [
        {
            "x": jax.random.normal(jax.random.fold_in(kx, i), (args.batch, args.width_in)),
            "y": jax.random.randint(jax.random.fold_in(ky, i), (args.batch,), 0, args.classes),
        }
        for i in range(args.k)
    ]
    grads = [jax.grad(loss_fn)(params, b) for b in batches]
    txs = transformations(args.k)

    results: dict[str, Any] = {}
    for mode, make, inputs in (
        ("train_step", make_train_step, batches),
        ("update_only", make_update, grads),
    ):
        fns = {name: make(tx) for name, tx in txs.items()}
        carry = {name: (copy_tree(params), tx.init(params)) for name, tx in txs.items()}
        memory = {name: peak_bytes(fns[name], *carry[name], inputs[0]) for name in txs}

        def global_step(name, fns=fns, carry=carry, inputs=inputs):
            p, s = carry[name]
            for x in inputs:  # k calls: the last one applies the inner optimiser
                p, s, *_ = fns[name](p, s, x)
            carry[name] = (p, s)
            return p

        runners = {name: (lambda name=name: global_step(name)) for name in txs}
        time_interleaved(runners, 1)  # compile and warm up
        times = time_interleaved(runners, args.rounds)
        median = {name: statistics.median(t) for name, t in times.items()}
        diff = max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(jax.tree.leaves(carry["jaxga"][0]), jax.tree.leaves(carry["optax"][0]))
        )
        results[mode] = {
            "median_s_per_global_step": median,
            "all_s": times,
            "peak_bytes_one_call": memory,
            "max_abs_param_difference": diff,
            "ratios_jaxga_over_optax": {
                setting: {
                    "time": median[ours] / median[theirs],
                    "memory": memory[ours] / memory[theirs],
                }
                for setting, (ours, theirs) in PAIRS.items()
            },
        }
    return {
        "device": str(jax.devices()[0].device_kind),
        "platform": jax.default_backend(),
        "host": platform.machine(),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "num_params": int(num_params),
        "k": args.k,
        "micro_batch": args.batch,
        "rounds": args.rounds,
        "results": results,
    }


def report(out: dict[str, Any]) -> None:
    print(
        f"jaxga.MultiSteps vs optax.MultiSteps(adam), k={out['k']}, "
        f"{out['num_params'] / 1e6:.2f}M params, micro-batch {out['micro_batch']}, "
        f"{out['rounds']} interleaved rounds, {out['platform']} ({out['device']})"
    )
    print(
        f"{'':12} {'setting':14} {'jaxga ms':>9} {'optax ms':>9} {'ratio':>6} "
        f"{'jaxga MiB':>10} {'optax MiB':>10} {'ratio':>6}"
    )
    for mode, r in out["results"].items():
        t, m = r["median_s_per_global_step"], r["peak_bytes_one_call"]
        for setting, (ours, theirs) in PAIRS.items():
            ratio = r["ratios_jaxga_over_optax"][setting]
            print(
                f"{mode:12} {setting:14} {t[ours] * 1e3:9.2f} {t[theirs] * 1e3:9.2f} "
                f"{ratio['time']:6.3f} {m[ours] / 2**20:10.1f} {m[theirs] / 2**20:10.1f} "
                f"{ratio['memory']:6.3f}"
            )
    print("(times: median per global step of k calls; memory: compiled peak of one call)")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``parse([])`` gives the defaults."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (CPU smoke run)")
    parser.add_argument("--k", type=int, default=8, help="calls per global step")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 15)")
    parser.add_argument("--batch", type=int, default=16, help="rows per micro-batch")
    parser.add_argument("--width-in", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4, help="hidden layers")
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 5 if args.quick else 15
    return args


def main() -> None:
    args = parse()
    out = benchmark(args)
    report(out)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
