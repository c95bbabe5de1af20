"""jaxga.MultiSteps against optax.MultiSteps, compiled for an NVIDIA H100 on any machine.

XLA can compile for a GPU it is told about (a target config: compute capability, SM
count, memory, ...) instead of one it finds attached. For a given jaxpr the program it
builds is the one an H100 would run, so its ``memory_analysis()`` is what
``benchmarks/run.py`` reports as the compiled peak on a real H100 (where the jaxpr is
the same: see the attention below) — read on a machine without a GPU. Nothing runs, so
there are no times; what is compared is the compiled peak and the kernels of the
program's top level (fusions and library calls outside loops, where the optimisers'
work is; a loop's body is not counted): the launch overhead of a small step.
:func:`traffic` counts every kernel, loops times their trip counts (``scan_cost.py``).

Both wrap ``optax.adam``, in two settings as in ``multisteps.py``: as built by default
(neither skips non-finite gradients) and both skipping them. Two workloads: the MLP of
``multisteps.py`` (one call: gradient, ``tx.update``, apply; and ``tx.update`` alone) and
Transformer M of ``run.py`` (GPT-2 small's shape, its layers unrolled as the example runs
them without remat, bfloat16 matmuls, one micro-batch call of k = 4), compiled with
``jaxga.compiler_options("gpu")``. The transformer picks its attention by the default
backend, here the CPU; under :func:`cudnn_attention` it takes cuDNN's fused kernel, as a
real GPU run does, so that its peaks are those of ``run.py`` on an H100 (within a few per
cent).

The functions here are also those of ``tests/h100/checks.py``, which holds the GPU memory
claims of the README and ``docs/`` on every test run.

Run with JAX's CUDA plugin on the path (it installs without a GPU and without the CUDA
libraries; ``scripts/test.sh`` installs it, at jax's version, into ``.venv/h100-plugin``,
not into ``.venv``, where every jax process would log that it found no GPU) and
``JAX_PLATFORMS=cpu``, or the plugin looks for a GPU:
    bash scripts/test.sh tests/test_h100_compiled.py  # installs the plugin, once
    JAX_PLATFORMS=cpu PYTHONPATH=.venv/h100-plugin \\
        .venv/bin/python benchmarks/compiled_for_gpu.py [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import topologies

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parents[1]))  # the repository: tests/_hlo.py

import _workloads
import multisteps
import run
import train_lm  # examples/, on the path through _workloads

import jaxga
from tests._hlo import parse_computations

# An H100 SXM (80 GB HBM3) as XLA's GPU compiler sees it: NVIDIA's published figures.
H100_SXM = """
gpu_device_info {
  cuda_compute_capability { major: 9 minor: 0 }
  core_count: 132
  fpus_per_core: 128
  threads_per_block_limit: 1024
  threads_per_warp: 32
  threads_per_core_limit: 2048
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  clock_rate_ghz: 1.98
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  device_memory_size: 84929347584
}
platform_name: "CUDA"
device_description_str: "NVIDIA H100 80GB HBM3"
runtime_version { major: 12 minor: 8 }
dnn_version_info { major: 9 minor: 7 }
"""


CUDNN_VERSION = 90700  # dnn_version_info above, as cuDNN reports it


def h100s(count: int) -> list[jax.Device]:
    """``count`` described (not attached) H100s of one host, for a mesh to compile for."""
    topology = topologies.get_topology_desc(
        "h100", "cuda", target_config=H100_SXM, topology=f"1x1x{count}"
    )
    return list(topology.devices)


def h100() -> jax.Device:
    """A described (not attached) H100 that ``jax.jit`` can compile for."""
    return h100s(1)[0]


@contextlib.contextmanager
def cudnn_attention() -> Iterator[None]:
    """While tracing, ``jax.nn.dot_product_attention`` of 16-bit inputs is cuDNN's fused
    kernel, as on a real GPU (``examples/train_lm.py`` picks it by the default backend,
    here the CPU), and the cuDNN version is the described one (the CUDA plugin alone
    ships no cuDNN to ask)."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    xla_attention, check = jax.nn.dot_product_attention, fused.check_cudnn_version

    def attention(query, key, value, *args, implementation=None, **kwargs):
        if query.dtype in (jnp.bfloat16, jnp.float16):
            implementation = "cudnn"
        return xla_attention(query, key, value, *args, implementation=implementation, **kwargs)

    jax.nn.dot_product_attention, fused.check_cudnn_version = attention, lambda: CUDNN_VERSION
    try:
        yield
    finally:
        jax.nn.dot_product_attention, fused.check_cudnn_version = xla_attention, check


def on(device: jax.Device, tree: Any) -> Any:
    """``tree``'s shapes and dtypes, placed on ``device``: arguments to compile for it."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding),
        tree,
    )


def on_mesh(devices: list[jax.Device], axis: str = "data") -> jax.sharding.Mesh:
    """A one-axis mesh of described devices (``h100s``)."""
    return jax.sharding.Mesh(np.array(devices), (axis,))


def program(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn`` (a ``jax.jit``) compiled for the devices its arguments are placed on, with
    cuDNN attention: the ``jax.stages.Compiled`` (``as_text()``, ``cost_analysis()``, ...)."""
    with cudnn_attention():
        return fn.lower(*args).compile()


def compiled(fn: Callable[..., Any], *args: Any) -> dict[str, int]:
    """The compiled peak (arguments + outputs + temporaries − aliased) and kernel count."""
    return summary(program(fn, *args))


def summary(program: Any) -> dict[str, int]:
    """A compiled program's peak and the kernels of its top level (see the module doc)."""
    entry = program.as_text().split("\nENTRY ", 1)[1].split("\n}", 1)[0]
    calls = re.findall(r"^\s*(?:ROOT )?%\S+ = .*? (?:fusion|custom-call)\(.*$", entry, re.M)
    return {
        "peak_bytes": multisteps.peak(program.memory_analysis()),
        # AllocateBuffer (an uninitialised buffer) reserves memory and launches nothing
        "kernels": sum('custom_call_target="AllocateBuffer"' not in c for c in calls),
    }


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^(ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
# Instructions that launch nothing: bookkeeping, and control flow (its bodies are walked).
_NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while",
              "conditional", "call", "after-all", "opt-barrier", "partition-id", "replica-id",
              "add-dependency", "copy-done", "async-done", "async-update"}  # fmt: skip


def _bytes(shapes: str) -> int:
    """Bytes of the arrays that an HLO shape (``bf16[16,512]{1,0}``, or a tuple) names."""
    sizes = [_DTYPE_BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
             for t, dims in _ARRAY.findall(shapes)]  # fmt: skip
    return sum(sizes)


def _instructions(lines: list[str]) -> list[dict[str, Any]]:
    """Each instruction's name, shape, opcode, operand names and attributes."""
    out = []
    for line in lines:
        if not (match := _INSTRUCTION.match(line)):
            continue
        root, name, shape, opcode, rest = match.groups()
        depth, end = 1, 0
        while depth:  # the operand list ends at the parenthesis that closes it
            depth += {"(": 1, ")": -1}.get(rest[end], 0)
            end += 1
        operands = re.findall(r"%([\w.\-]+)", rest[: end - 1])
        out.append(dict(root=bool(root), name=name, shape=shape, opcode=opcode,
                        operands=operands, attributes=rest[end:], line=line))  # fmt: skip
    return out


def _fusion_bytes(body: list[dict[str, Any]]) -> int:
    """Bytes a fusion reads and writes: a dynamic slice of an operand reads the slice, a
    dynamic update slice writes the update in place (a layer scan's residuals)."""
    by_name = {i["name"]: i for i in body}
    users: dict[str, list[tuple[dict[str, Any], int]]] = {}
    for i in body:
        for position, operand in enumerate(i["operands"]):
            users.setdefault(operand, []).append((i, position))
    moved = 0
    for param in (i for i in body if i["opcode"] == "parameter"):
        uses = users.get(param["name"], [])
        sliced = [u for u, at in uses if u["opcode"] == "dynamic-slice" and at == 0]
        updated = [u for u, at in uses if u["opcode"] == "dynamic-update-slice" and at == 0]
        if uses and len(sliced) + len(updated) == len(uses):  # read in part, written in place
            moved += sum(_bytes(u["shape"]) for u in sliced)
        else:
            moved += _bytes(param["shape"])
    root = next(i for i in body if i["root"])
    for out in [by_name[o] for o in root["operands"]] if root["opcode"] == "tuple" else [root]:
        while out["opcode"] == "bitcast" and out["operands"][0] in by_name:
            out = by_name[out["operands"][0]]
        in_place = out["opcode"] == "dynamic-update-slice"
        moved += _bytes(by_name[out["operands"][1]]["shape"] if in_place else out["shape"])
    return moved


def traffic(program: Any) -> dict[str, int]:
    """Kernel launches and the bytes they move in a compiled GPU program, each loop body
    counted as many times as it runs (its known trip count): what a GPU step does beyond
    its matmul FLOPs, read from HLO (``cost_analysis()`` is empty for a described GPU).
    Every branch of a conditional is counted (an upper bound); an asynchronous copy or
    collective as reading and writing its operands once."""
    text = program.as_text()
    body = {name: _instructions(lines) for name, lines in parse_computations(text).items()}
    total = {"launches": 0, "bytes": 0}

    def visit(name: str, times: int) -> None:
        shapes: dict[str, str] = {}
        for i in body[name]:
            shapes[i["name"]] = i["shape"]
            attributes, called = i["attributes"], None
            if i["opcode"] == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', attributes)
                if trips is None:
                    raise ValueError(f"a while loop without a known trip count: {i['line']}")
                called = [re.search(r"body=%([\w.\-]+)", attributes).group(1)]
                times_called = times * int(trips.group(1))
            elif i["opcode"] in ("call", "conditional"):  # every branch counted
                names = re.findall(r"(?:to_apply|_computation|computations)=(\{[^}]*\}|%\S+)",
                                   attributes)  # fmt: skip
                called = re.findall(r"%([\w.\-]+)", " ".join(names))
                times_called = times
            if called:
                for computation in called:
                    visit(computation, times_called)
            elif i["opcode"] not in _NO_KERNEL and "AllocateBuffer" not in attributes:
                fused = re.search(r"calls=%([\w.\-]+)", attributes)
                read = sum(_bytes(shapes.get(o, "")) for o in i["operands"])
                moved = read + _bytes(i["shape"])
                if i["opcode"] == "fusion" and fused:
                    moved = _fusion_bytes(body[fused.group(1)])
                elif i["opcode"].endswith("-start"):  # its shape holds the operands again
                    moved = 2 * read
                total["launches"] += times
                total["bytes"] += times * moved

    visit(re.search(r"^ENTRY %?([\w.\-]+)", text, re.M).group(1), 1)
    return total


@dataclasses.dataclass(frozen=True)
class Transformer:
    """``examples/train_lm.py``'s transformer as shapes: ``params`` and ``batch`` are
    ``jax.ShapeDtypeStruct`` trees, ``loss_for(remat)`` the loss with that remat name."""

    params: Any
    batch: dict[str, jax.ShapeDtypeStruct]
    loss_for: Callable[[str], Callable[[Any, Any], jaxga.Mean]]


def transformer(
    batch: int, seq_len: int, dim: int, heads: int, layers: int, dtype: str = "bfloat16"
) -> Transformer:
    """The main example's transformer at the given shape, its matrix products in ``dtype``
    (Transformer M is ``transformer(64, 512, 768, 12, 12)``); nothing is allocated."""
    cfg = train_lm.Config(seq_len, dim, heads, layers, dropout=0.0, remat="none", dtype=dtype)
    model = nnx.eval_shape(lambda: train_lm.Transformer(cfg, nnx.Rngs(0)))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, seq_len), jnp.float32)

    def loss_for(remat: str) -> Callable[[Any, Any], jaxga.Mean]:
        candidate = dataclasses.replace(cfg, remat=remat)
        graphdef = nnx.split(
            nnx.eval_shape(lambda: train_lm.Transformer(candidate, nnx.Rngs(0))), nnx.Param, ...
        )[0]
        return lambda params, batch: train_lm.loss(nnx.merge(graphdef, params, rest), batch, None)

    return Transformer(params, {"inputs": tokens, "labels": tokens, "mask": mask}, loss_for)


def mlp(device: jax.Device) -> dict[str, dict[str, dict[str, int]]]:
    """multisteps.py's MLP and k (its defaults): one train-step call, one update call."""
    args = multisteps.parse([])
    sizes = [args.width_in] + [args.hidden] * args.layers + [args.classes]
    params = jax.eval_shape(lambda: multisteps.init_mlp(jax.random.key(0), sizes))
    batch = {
        "x": jax.ShapeDtypeStruct((args.batch, args.width_in), jnp.float32),
        "y": jax.ShapeDtypeStruct((args.batch,), jnp.int32),
    }
    out: dict[str, dict[str, dict[str, int]]] = {"train_step": {}, "update_only": {}}
    for name, tx in multisteps.transformations(args.k).items():
        state = jax.eval_shape(tx.init, params)
        out["train_step"][name] = compiled(
            multisteps.make_train_step(tx), *on(device, (params, state, batch))
        )
        out["update_only"][name] = compiled(
            multisteps.make_update(tx), *on(device, (params, state, params))
        )
    return out


def transformer_m(device: jax.Device, k: int = 4) -> dict[str, dict[str, int]]:
    """One micro-batch call of Transformer M (``run.py --only 2``, bfloat16) at ``k``."""
    w = _workloads.workloads(False, "bfloat16", only=2)[0]
    loss = w.loss_for("none")
    micro = jax.tree.map(lambda x: x[0], jaxga.split_microbatches(w.batch, k))
    params = jax.eval_shape(lambda: w.params)
    out = {}
    grad_fn = jax.value_and_grad(lambda p, batch: loss(p, batch).value)
    for name, tx in multisteps.transformations(k).items():
        step = run.make_step(grad_fn, tx, backend="gpu")  # run.py's MultiSteps step
        state = jax.eval_shape(tx.init, params)
        out[name] = compiled(step, *on(device, (params, state, micro)))
    return out


def report(results: dict[str, dict[str, dict[str, int]]]) -> None:
    print("compiled for an NVIDIA H100 80GB HBM3 (XLA target config; nothing runs)")
    print(
        f"{'':28} {'setting':10} {'jaxga MiB':>10} {'optax MiB':>10} {'ratio':>6} "
        f"{'kernels':>8} {'optax':>6}"
    )
    for program, rows in results.items():
        for setting, (ours, theirs) in multisteps.PAIRS.items():
            a, b = rows[ours], rows[theirs]
            print(
                f"{program:28} {setting:10} {a['peak_bytes'] / 2**20:10.1f} "
                f"{b['peak_bytes'] / 2**20:10.1f} {a['peak_bytes'] / b['peak_bytes']:6.3f} "
                f"{a['kernels']:8d} {b['kernels']:6d}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()
    device = h100()
    ms = mlp(device)
    results = {
        "MLP train step (k=8)": ms["train_step"],
        "MLP update only (k=8)": ms["update_only"],
        "Transformer M call (k=4)": transformer_m(device),
    }
    report(results)
    if args.json is not None:
        out = {"target": "NVIDIA H100 80GB HBM3", "jax": jax.__version__, "results": results}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
