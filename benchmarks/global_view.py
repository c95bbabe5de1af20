"""Flax's NNX FSDP toy example, its train step as written and ported to jaxga, on 8 host devices.

`examples/nnx_toy_examples/10_fsdp_and_optimizer.py` of Flax: an MLP whose parameters
carry a `"model"` layout in their metadata, an Auto mesh `("data", "model")` of 2 × 4
devices, the batch split over `"data"`, `nnx.jit` over the step. The port replaces
`nnx.value_and_grad(loss_fn)` with `jaxga.value_and_grad(loss_fn, num_microbatches=k,
axis_name="data")` and nothing else. Side by side, interleaved, median of ``--rounds``:

- the original step;
- jaxga with k = 1 and k = 4: k = 1 is the port's own overhead (a loop of one, its
  ``shard_map``); (k = 4 − k = 1) / 3 is the loop's cost per extra micro-batch;
- the gradient reductions inside the loop, read from the compiled HLO (none expected; the
  example's own tensor-parallel reductions of activations are not counted).

    .venv/bin/python benchmarks/global_view.py             # batch 32 and 8192
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).parents[1]))
import jaxga
from benchmarks._timing import time_interleaved
from tests._hlo import loop_reductions

jax.config.update("jax_num_cpu_devices", 8)

RESULTS = Path(__file__).parent / "results" / "global_view_cpu.json"


class MLP(nnx.Module):  # the example's, with its "model" layout
    def __init__(self, din, dmid, dout, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(init(rngs.params(), (din, dmid)), out_sharding=(None, "model"))
        self.b1 = nnx.Param(jnp.zeros((dmid,)), out_sharding=("model",))
        self.w2 = nnx.Param(init(rngs.params(), (dmid, dout)), out_sharding=(None, "model"))

    def __call__(self, x):
        return nnx.relu(x @ self.w1 + self.b1) @ self.w2


def loss_fn(model, x, y):
    return jnp.mean((y - model(x)) ** 2)


def create():
    model = MLP(1, 32, 1, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.01, momentum=0.9), wrt=nnx.Param)


def make_step(value_and_grad):
    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = value_and_grad(model, x, y)
        optimizer.update(model, grads)
        return loss

    return train_step


def gradient_reductions_in_loop(step, model, optimizer, x, y) -> int:
    graphdef, state = nnx.split((model, optimizer))

    def pure(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        return step(model, optimizer, x, y)

    compiled = jax.jit(pure).lower(state, x, y).compile()
    return len(loop_reductions(compiled, nnx.state(model, nnx.Param)))


def measure(batch_size: int, k: int, rounds: int) -> dict:
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, size=(batch_size, 1)).astype(np.float32)
    y = (0.8 * x**2 + 0.1).astype(np.float32)
    steps = {
        "original": make_step(nnx.value_and_grad(loss_fn)),
        "jaxga k=1": make_step(
            jaxga.value_and_grad(
                loss_fn, num_microbatches=1, batch_argnums=(1, 2), axis_name="data"
            )
        ),
        f"jaxga k={k}": make_step(
            jaxga.value_and_grad(
                loss_fn, num_microbatches=k, batch_argnums=(1, 2), axis_name="data"
            )
        ),
    }
    with jax.set_mesh(mesh):
        xs, ys = jax.device_put((x, y), NamedSharding(mesh, P("data")))
        states = {name: nnx.jit(create)() for name in steps}  # as the example creates them
        runners = {
            name: (lambda s=step, m=states[name]: s(*m, xs, ys)) for name, step in steps.items()
        }
        times = time_interleaved(runners, rounds)
        in_loop = {
            name: gradient_reductions_in_loop(step, *states[name], xs, ys)
            for name, step in steps.items()
            if name != "original"
        }
    ms = {name: 1e3 * statistics.median(t[1:]) for name, t in times.items()}
    base = ms["original"]
    per_microbatch = (ms[f"jaxga k={k}"] - ms["jaxga k=1"]) / (k - 1)
    return {
        "batch": batch_size,
        "ms": ms,
        "ratio_to_original": {name: v / base for name, v in ms.items()},
        "loop_ms_per_extra_microbatch": per_microbatch,
        "gradient_reductions_in_loop": in_loop,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 8192])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=41)
    args = parser.parse_args()
    rows = [measure(b, args.microbatches, args.rounds) for b in args.batches]
    for row in rows:
        ratios = ", ".join(f"{n} {r:.2f}x" for n, r in row["ratio_to_original"].items())
        print(
            f"batch {row['batch']}: original {row['ms']['original']:.3f} ms; {ratios}; loop "
            f"{row['loop_ms_per_extra_microbatch']:.3f} ms per extra micro-batch; gradient "
            f"reductions in the loop: {row['gradient_reductions_in_loop']}"
        )
    RESULTS.write_text(json.dumps({"device": "cpu (8 host devices)", "rows": rows}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
