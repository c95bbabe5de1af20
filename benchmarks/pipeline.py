"""Pipeline schedules side by side on 8 host CPU devices: compiled peak, time and bubble.

A stack of L = 8 residual MLP blocks (width 256, hidden 1024) and a token cross-entropy
head, one gradient step of a global batch of m micro-batches of 128 rows, m ∈ {4, 8, 16}:

- **FSDP, no pipeline**: the blocks' weights split over 4 devices (their output axis), the
  stack run by ``jaxga.remat_scan`` in jit's global view (XLA gathers each layer's weights),
  the batch split into the same m micro-batches by ``jaxga.value_and_grad``;
- **GPipe**, **circular** (r = 2), **1F1B** and **interleaved 1F1B** (v = 2 chunks a stage)
  over a stage axis of S = 4 devices (``jaxga.pipeline_loss``), each stage holding its
  L / S blocks.

Per device: XLA's compiled peak (arguments + outputs + scratch − aliased) and its scratch
(``temp``), the median step time of ``--rounds`` interleaved runs, and the bubble the
schedule leaves, ``(S − 1) / (r · m + S − 1)`` (r: circular's repeats, interleaved 1F1B's
v; 1 for GPipe and 1F1B), against the fraction of a step's time a stage idles, counted by
running the schedule row's own index arithmetic (``jaxga.pipeline.Schedule``; the 1F1B
rows: lockstep ticks, a backward taking two forwards' time; `idle_fraction`). Host
"devices" share this machine's cores, so an idle stage frees a core for another rather
than wasting it: the times here show the work, not the bubble. The last line: the
compiled-peak ratios m = 16 / m = 4 of GPipe, 1F1B and interleaved 1F1B.

``--h100`` gives instead, compiled for described H100s with ``compiled_for_gpu.py``'s
machinery (nothing runs; its CUDA plugin on the path), the per-device peak of the main example's
train step (``examples/train_lm.py``'s transformer and optimiser) at GPT-2 small's shape
(12 blocks of width 768, 12 heads, 1024 tokens a row, bfloat16 matrix products, full remat;
a byte vocabulary; XLA's attention, not cuDNN's, whose partitioning rule needs concrete
devices inside a ``shard_map``): on one H100 unpipelined (``m``: jaxga's accumulation
micro-batches), and over S stages (``make_train_step(..., pipeline_axis="stage")``: each
stage's blocks and their optimiser state; ``m``: the pipeline's) under GPipe at
S ∈ {2, 4}, circular (r = 2) at S = 2 (12 blocks do not split into 4 × 2 chunks) and
1F1B at S = 4, at m ∈ {4, 16}, the same 16 rows a step:

    .venv/bin/python benchmarks/pipeline.py            # about 3 minutes on 2 cores
    .venv/bin/python benchmarks/pipeline.py --microbatches 4 16 --rounds 3  # quicker
    bash scripts/test.sh tests/test_h100_compiled.py  # installs the plugin, once
    JAX_PLATFORMS=cpu PYTHONPATH=.venv/h100-plugin .venv/bin/python benchmarks/pipeline.py --h100
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(1, str(Path(__file__).parent))
import jaxga
from benchmarks._timing import time_interleaved

jax.config.update("jax_num_cpu_devices", 8)

RESULTS = Path(__file__).parent / "results" / "pipeline_cpu.json"
H100_RESULTS = Path(__file__).parent / "results" / "pipeline_h100_compiled.json"
EMBEDDED_RESULTS = Path(__file__).parent / "results" / "pipeline_embedded_cpu.json"
L, WIDTH, VOCAB, ROWS, S = 8, 256, 64, 128, 4


def block(p, x):
    return x + jnp.tanh(x @ p["w"]) @ p["v"]


def head_fn(head, y, targets):
    return jaxga.token_cross_entropy(y @ head, targets, None)


def model(seed: int = 0) -> tuple[dict, jax.Array]:
    rng = np.random.default_rng(seed)
    stack = {
        "w": rng.normal(size=(L, WIDTH, 4 * WIDTH)).astype(np.float32) / WIDTH**0.5,
        "v": rng.normal(size=(L, 4 * WIDTH, WIDTH)).astype(np.float32) / (4 * WIDTH) ** 0.5,
    }
    return stack, rng.normal(size=(WIDTH, VOCAB)).astype(np.float32) / WIDTH**0.5


PIPELINES = [  # name, schedule, repeats
    ("GPipe", "gpipe", 1),
    ("circular r=2", "circular", 2),
    ("1F1B", "1f1b", 1),
    ("interleaved 1F1B v=2", "interleaved_1f1b", 2),
]


def idle_fraction(schedule: str, m: int, repeats: int, backward: float = 2.0) -> float:
    """The fraction of a step's time a stage idles, from the schedule row's own index
    arithmetic (`jaxga.pipeline.Schedule`'s ``forward`` and ``backward``, tick by tick).

    1F1B's rows: the stages run in lockstep (a tick ends with the ``ppermute``s), their
    ``cond``s skip what a stage has no micro-batch for, so a tick takes a chunk's forward if
    any stage runs one, plus a chunk's backward (``backward`` forwards' time) if any stage
    runs one. GPipe and circular: the stage-ticks without a micro-batch (the backward pass
    is the loop's reverse).
    """
    plan, stages = jaxga.pipeline.Schedule(S, m, repeats, schedule), range(S)
    ticks = range(plan.ticks)
    if plan.manual:
        forwards = sum(any(bool(plan.forward(t, s).valid) for s in stages) for t in ticks)
        backwards = sum(any(bool(plan.backward(t, s).valid) for s in stages) for t in ticks)
        return 1 - m * repeats * (1 + backward) / (forwards + backward * backwards)
    busy = sum(bool(plan.forward(t, s).valid) for s in stages for t in ticks)
    return 1 - busy / (S * plan.ticks)


def formula(schedule: str, m: int, repeats: int) -> float:
    """``(S − 1) / (r · m + S − 1)``: every schedule's (`jaxga.pipeline.Schedule.bubble`)."""
    return jaxga.pipeline.Schedule(S, m, repeats, schedule).bubble


def pipelined(schedule: str, m: int, repeats: int, stack, head, x, labels):
    mesh = jax.make_mesh((S,), ("stage",), devices=jax.devices()[:S])
    ordered = jaxga.pipeline_order(stack, S, repeats)
    params = jax.device_put(ordered, NamedSharding(mesh, P("stage")))

    def loss(params, head, x):
        options = {"num_microbatches": m, "schedule": schedule, "repeats": repeats}
        return jaxga.pipeline_loss(block, head_fn, (params, head), x, labels, **options).value

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (params, head, x)


def fsdp(m: int, stack, head, x, labels):
    mesh = jax.make_mesh((S,), ("fsdp",), (AxisType.Auto,), devices=jax.devices()[:S])
    params = jax.device_put(stack, NamedSharding(mesh, P(None, None, "fsdp")))

    def loss(params, head, x, labels):
        return head_fn(head, jaxga.remat_scan(block, params, x), labels)

    vg = jaxga.value_and_grad(loss, (0, 1), num_microbatches=m, batch_argnums=(2, 3))
    return jax.jit(vg), (params, head, x, labels)


def measure(m: int, rounds: int) -> list[dict]:
    stack, head = model()
    x = np.random.default_rng(1).normal(size=(ROWS * m, WIDTH)).astype(np.float32)
    labels = np.random.default_rng(2).integers(0, VOCAB, size=ROWS * m)
    setups = {"FSDP, no pipeline": fsdp(m, stack, head, x, labels)}
    for name, schedule, repeats in PIPELINES:
        setups[name] = pipelined(schedule, m, repeats, stack, head, x, labels)
    runners = {name: (lambda f=f, a=a: f(*a)) for name, (f, a) in setups.items()}
    times = time_interleaved(runners, rounds)
    rows = []
    for name, (f, args) in setups.items():
        memory = f.lower(*args).compile().memory_analysis()
        peak = (
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            + memory.temp_size_in_bytes
            - memory.alias_size_in_bytes
        )
        row = {
            "method": name,
            "m": m,
            "peak_mib": peak / 2**20,
            "temp_mib": memory.temp_size_in_bytes / 2**20,
        }
        row["ms"] = 1e3 * statistics.median(times[name][1:])
        for _, schedule, repeats in (p for p in PIPELINES if p[0] == name):
            row["bubble_formula"] = formula(schedule, m, repeats)
            row["bubble_counted"] = idle_fraction(schedule, m, repeats)
        rows.append(row)
    return rows


def h100_report(stages: int, schedule: str, m: int, rows: int = 16) -> jaxga.MemoryReport:
    """The example's train step at GPT-2 small's shape, ``rows`` a step, compiled for
    described H100s: on one (``stages`` = 1, ``m`` accumulation micro-batches), or over
    ``stages`` (``m`` pipeline micro-batches). ``tests/h100/checks.py`` holds one."""
    import compiled_for_gpu as gpu  # benchmarks/, and examples/ through its _workloads
    import train_lm

    cfg = train_lm.Config(1024, 768, 12, 12, 0.0, "full", "bfloat16", stages, schedule, m)
    loss, state, batch = train_lm.abstract_step_args(cfg, rows)
    devices = gpu.h100s(stages)
    if stages == 1:
        return jaxga.memory_report(
            jaxga.make_train_step(loss, m), *gpu.on(devices[0], (state, batch))
        )
    mesh = jax.sharding.Mesh(np.array(devices).reshape(1, stages), ("data", "stage"))
    specs = train_lm.pipeline_specs(state.params)
    step = jaxga.make_train_step(loss, mesh=mesh, strategy=specs, pipeline_axis="stage")
    return jaxga.memory_report(step, state, batch)


def h100_stage_peaks() -> list[dict]:
    """`h100_report`'s peak and state per device, unpipelined and per stage (module doc)."""
    out = []
    setups = [(2, "gpipe"), (4, "gpipe"), (2, "circular"), (4, "1f1b")]  # circular, S=4: 8 ∤ 12
    for stages, schedule, m in [(1, "gpipe", k) for k in (1, 4, 16)] + [
        (*s, m) for s in setups for m in (4, 16)
    ]:
        report = h100_report(stages, schedule, m)
        name = "one H100, no pipeline" if stages == 1 else f"{schedule}, S={stages}"
        peak, state = report.peak_bytes / 2**30, report.argument_bytes / 2**30
        out.append({"method": name, "m": m, "peak_gib": peak, "state_gib": state})
        print(f"| {name} | {m} | {peak:.2f} | {state:.2f} |")
    return out


def embed(table, ids):
    return table[ids]


def embedded_step(schedule: str, m: int, per_microbatch: bool):
    """A step whose stack input is computed in it: token ids, an embedding table. With
    ``per_microbatch``, `pipeline_loss`'s ``embed_fn`` (stage 0, a micro-batch at a time);
    else the loss embeds the whole batch first."""
    stack, head = model()
    table = np.random.default_rng(3).normal(size=(VOCAB, WIDTH)).astype(np.float32)
    ids = np.random.default_rng(1).integers(0, VOCAB, size=ROWS * m)
    labels = np.random.default_rng(2).integers(0, VOCAB, size=ROWS * m)
    mesh = jax.make_mesh((S,), ("stage",), devices=jax.devices()[:S])
    params = (jax.device_put(stack, NamedSharding(mesh, P("stage"))), head, table)

    def loss(params):
        options = {"num_microbatches": m, "schedule": schedule}
        if per_microbatch:
            mean = jaxga.pipeline_loss(
                block, head_fn, params, ids, labels, embed_fn=embed, **options
            )
        else:
            x = embed(params[2], ids)
            mean = jaxga.pipeline_loss(block, head_fn, params[:2], x, labels, **options)
        return mean.value

    return jax.jit(jax.value_and_grad(loss)), (params,)


EMBEDDED = [  # name, schedule, embed_fn
    ("GPipe, the batch embedded first", "gpipe", False),
    ("1F1B, the batch embedded first", "1f1b", False),
    ("1F1B, embed_fn per micro-batch", "1f1b", True),
]


def embedded_rows(microbatches: list[int]) -> list[dict]:
    """Compiled scratch per device of `embedded_step`'s setups, nothing run."""
    rows = []
    for m in microbatches:
        for name, schedule, per_microbatch in EMBEDDED:
            f, args = embedded_step(schedule, m, per_microbatch)
            memory = f.lower(*args).compile().memory_analysis()
            rows.append({"method": name, "m": m, "temp_mib": memory.temp_size_in_bytes / 2**20})
    return rows


def print_embedded(microbatches: list[int]) -> None:
    rows = embedded_rows(microbatches)
    print("| method (embedding inside the step) | m | scratch MiB |\n| --- | --- | --- |")
    for r in rows:
        print(f"| {r['method']} | {r['m']} | {r['temp_mib']:.1f} |")
    temps = {(r["method"], r["m"]): r["temp_mib"] for r in rows}
    low, high = min(microbatches), max(microbatches)
    each = ", ".join(f"{n} {temps[n, high] / temps[n, low]:.2f}x" for n, _, _ in EMBEDDED)
    print(f"compiled scratch m={high} / m={low}: {each} (CPU, 8 host devices)")
    out = {"device": "cpu (8 host devices)", "rows": rows}
    EMBEDDED_RESULTS.write_text(json.dumps(out, indent=1))
    print(f"wrote {EMBEDDED_RESULTS}")


def handwritten_gpipe(stack, head, x, labels, m: int):
    """GPipe as a port writes it by hand, in its own ``shard_map`` over ``"stage"`` (the UvA
    tutorials' pipeline): m + S − 1 ticks, stage 0 reading micro-batch t, each stage's
    layers a ``scan`` (a checkpoint per layer, one per stage: its inputs alone kept), the
    activations sent on by ``ppermute``, the last stage's outputs gathered for the head, the
    loss masked to it and summed over the stages."""
    stages, index = jax.lax.axis_size("stage"), jax.lax.axis_index("stage")
    micro = jnp.reshape(x, (-1, m, x.shape[-1])).swapaxes(0, 1)  # micro-batch i: rows i::m

    @jax.checkpoint
    def stage(h):
        def layer(h, p):
            return jax.checkpoint(block)(p, h), None

        return jax.lax.scan(layer, h, stack)[0]

    def tick(carry, t):
        passed, outputs = carry
        out = stage(jnp.where(index == 0, micro[jnp.minimum(t, m - 1)], passed))
        done = (index == stages - 1) & (t >= stages - 1)
        slot = jnp.clip(t - stages + 1, 0, m - 1)
        outputs = outputs.at[slot].set(jnp.where(done, out, outputs[slot]))
        ring = [(i, (i + 1) % stages) for i in range(stages)]
        return (jax.lax.ppermute(out, "stage", ring), outputs), None

    start = jax.lax.pcast((jnp.zeros_like(micro[0]), jnp.zeros_like(micro)), "stage", to="varying")
    outputs = jax.lax.scan(tick, start, jnp.arange(m + stages - 1))[0][1]
    y = jnp.reshape(outputs.swapaxes(0, 1), x.shape)
    loss = jnp.where(index == stages - 1, head_fn(head, y, labels).value, 0.0)
    return jax.lax.psum(loss, "stage")


def jaxga_gpipe(stack, head, x, labels, m: int):
    """The same GPipe, written with `jaxga.pipeline_scan` in the same ``shard_map``."""
    y = jaxga.pipeline_scan(block, stack, x, num_microbatches=m, axis_name="stage")
    index = jax.lax.axis_index("stage")
    loss = jnp.where(index == jax.lax.axis_size("stage") - 1, head_fn(head, y, labels).value, 0)
    return jax.lax.psum(loss, "stage")


def handwritten_temporaries(m: int, rows: int = ROWS) -> dict[str, float]:
    """Per device, the compiled scratch (MiB) of one gradient step of a hand-written GPipe and
    of jaxga's (`handwritten_gpipe`, `jaxga_gpipe`) on S stages of host devices."""
    mesh = jax.make_mesh((S,), ("stage",), devices=jax.devices()[:S])

    def shaped(x, spec=None):  # nothing allocated: the step is compiled, not run
        return jax.ShapeDtypeStruct(
            jnp.shape(x), jnp.result_type(x), sharding=NamedSharding(mesh, spec or P())
        )

    stack, head = model()
    stack, head = jax.tree.map(lambda w: shaped(w, P("stage")), stack), shaped(head)
    x = shaped(np.zeros((rows * m, WIDTH), np.float32))
    labels = shaped(np.zeros(rows * m, np.int32))
    found = {}
    for name, fn in (("hand-written", handwritten_gpipe), ("jaxga", jaxga_gpipe)):

        def loss(stack, head, x, labels, fn=fn):
            return fn(stack, head, x, labels, m)

        specs = (P("stage"), P(), P(), P())
        mapped = jax.shard_map(loss, mesh=mesh, in_specs=specs, out_specs=P())
        step = jax.jit(jax.value_and_grad(mapped, argnums=(0, 1)))
        memory = step.lower(stack, head, x, labels).compile().memory_analysis()
        found[name] = memory.temp_size_in_bytes / 2**20
    return found


def print_handwritten(microbatches: list[int]) -> None:
    print("| GPipe in your own shard_map | m | scratch MiB, hand-written | jaxga | jaxga / hand |")
    print("| --- | --- | --- | --- | --- |")
    ratios = []
    for m in microbatches:
        found = handwritten_temporaries(m)
        ratios.append(found["jaxga"] / found["hand-written"])
        sizes = f"{found['hand-written']:.1f} | {found['jaxga']:.1f} | {ratios[-1]:.2f}"
        print(f"| S={S} | {m} | {sizes} |")
    print(f"jaxga / hand-written GPipe scratch: at most {max(ratios):.2f}x (CPU, 8 host devices)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--h100", action="store_true", help="the compiled-for-H100 rows alone")
    parser.add_argument("--embedded", action="store_true", help="the embedding-inside rows alone")
    parser.add_argument("--handwritten", action="store_true", help="jaxga's GPipe against a port's")
    args = parser.parse_args()
    if args.handwritten:
        return print_handwritten(args.microbatches)
    if args.embedded:
        return print_embedded(args.microbatches)
    if args.h100:
        print("compiled for NVIDIA H100s (XLA target config; nothing runs), per device:")
        print("| method | m | peak GiB | state GiB |\n| --- | --- | --- | --- |")
        rows = h100_stage_peaks()
        device = "described NVIDIA H100 80GB HBM3 (compiled, not run)"
        H100_RESULTS.write_text(json.dumps({"device": device, "rows": rows}, indent=1))
        print(f"wrote {H100_RESULTS}")
        return
    rows = [row for m in args.microbatches for row in measure(m, args.rounds)]
    print("| method | m | peak MiB | scratch MiB | ms | bubble (formula) | bubble (counted) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        bubble = (
            f"{r['bubble_formula']:.3f} | {r['bubble_counted']:.3f}"
            if "bubble_formula" in r
            else "– | –"
        )
        sizes = f"{r['peak_mib']:.1f} | {r['temp_mib']:.1f} | {r['ms']:.1f}"
        print(f"| {r['method']} | {r['m']} | {sizes} | {bubble} |")
    peaks = {(r["method"], r["m"]): (r["peak_mib"], r["temp_mib"]) for r in rows}
    low, high = min(args.microbatches), max(args.microbatches)
    ratios = {
        name: [a / b for a, b in zip(peaks[name, high], peaks[name, low])]
        for name in ("GPipe", "1F1B", "interleaved 1F1B v=2")
    }
    each = ", ".join(f"{name} {r[0]:.2f}x ({r[1]:.2f}x)" for name, r in ratios.items())
    print(f"compiled peak (scratch) m={high} / m={low}: {each} (CPU, 8 host devices)")
    out = {"device": "cpu (8 host devices)", "rows": rows, "peak_and_scratch_ratios": ratios}
    RESULTS.write_text(json.dumps(out, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
