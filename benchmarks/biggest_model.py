"""The largest Llama-shaped decoder whose train step fits one GPU, compiled for a described
H100 80 GB and a described 24 GB card: nothing runs, nothing is allocated.

The model is Llama 2's shape grown by depth and width in turn: size s has L = ⌈s/2⌉
layers of width d = 128·⌊s/2⌋ (head size 128, d/128 heads, SwiGLU hidden 256·⌈8d/3/256⌉,
RMSNorm, rotary positions, untied embedding and head, vocabulary 32,000), so that s = 64
is Llama 2 7B (6.74B parameters) and s = 80 Llama 2 13B, and a step of s adds 4 to 8 % of
parameters; its layers are one ``jaxga.remat_scan``. Master weights, gradient sums and
AdamW's two moments are float32; the matrix products and the activations bfloat16
(attention cuDNN's fused kernel, as on a real GPU). A step is 128 sequences of 2,048
tokens (262,144 tokens), its loss a token-weighted ``jaxga.Mean`` (``optax.MultiSteps``
takes each micro-batch's mean, as it averages the micro-batches' gradients).

Each row is the largest size (on that grid, by bisection) whose step compiles, for the
described card, to a device peak (XLA's ``memory_analysis()``: arguments + outputs +
temporaries − aliased) within the card's memory, and to host bytes within the host memory
beside it (1 TiB beside the 80 GB card, 256 GiB beside the 24 GB one):

- ``optax.MultiSteps``: ``optax.MultiSteps(optax.adamw, k)``, one call (one micro-batch,
  its gradient, ``tx.update``) per micro-batch, the state donated;
- ``jaxga resident``: ``jaxga.make_train_step(loss, k)``, the whole step in one call;
- ``jaxga offload=True``: the same with AdamW's state in pinned host memory between steps
  (its bytes counted as host bytes by ``jaxga.memory_report``);
- ``jaxga streaming``: ``jaxga.make_train_step(loss, k, stream="layers", offload=True)``,
  the loss's layers ``remat_scan(..., stream=True)``: the layer stack (``params["layers"]``)
  and the whole optimiser state in pinned host memory, each layer fetched in the forward and
  the backward pass, its gradient added to the gradient sums in host memory as the backward
  pass produces it, the update a layer at a time. A
  described device has no memories, so ``SingleDeviceSharding(device,
  memory_kind="pinned_host")`` loses its memory kind; the host-resident arguments take
  ``_PinnedHost``, a sharding that keeps it, and XLA's GPU compiler then reports their bytes
  (and the host temporaries: the gradient sums) as host bytes.

For each row the remat and micro-batch are the candidates' (``--remats``, ``--micro``)
with the smallest compiled peak at the first size probed; a smaller peak fits a larger
model, so that candidate is the best for this question.

Each row also gives a modelled step time, labelled as a model: the larger of the compute
at the card's peak (bfloat16 dense: 8·N·T FLOPs with remat ``full``, 6·N·T with a remat
that saves the matrix products, 10·N·T with ``sqrt``; N parameters, T tokens a step;
attention's own FLOPs left out) and the host↔device transfers at the card's host link
(PCIe, per direction, full duplex: the larger direction counts), overlapped with the
compute. ``offload=True`` moves AdamW's two moments in and out once a step (8 bytes a
parameter each way); the resident steps move nothing but the batch (left out).

``jaxga streaming`` (``MOVED_EACH_WAY``), read from the compiled program's loops, per float32
parameter of the layer stack and step of k micro-batches: each micro-batch fetches the layer
in the forward pass (4 bytes to the device) and again in the backward (4), where the layer's
gradient is added to the gradient sum (the sum's layer fetched, 4 to the device; written
back, 4 to the host): 12 bytes to the device and 4 to the host a micro-batch, and one
layer's 4 bytes a parameter more to the device (each pass fetches the next layer while one
runs: the backward pass's last fetch has no layer left to use it). Once a step: the sums'
zeros written (4 to the host), divided by the count (4 and 4), their norm for
``grad_norm`` (4 to the device) and the update (parameters, gradient and two moments
fetched, 16; parameters and moments written back, 12). In all 12k + 24 bytes (and k
layers' 4) to the device and 4k + 20 to the host.
The parameters outside the stack (embedding, final norm, head) stay on the device; their
moments move as ``offload=True``'s (8 bytes each way).

The H100 is ``compiled_for_gpu.H100_SXM``. The 24 GB card is an NVIDIA GeForce RTX 4090
described the same way (``RTX_4090`` below, XLA's target config from NVIDIA's published
figures: compute capability 8.9, 128 SMs, 24 GiB of GDDR6X at 1,008 GB/s, 72 MiB of L2):
JAX's CUDA plugin compiles for either without a GPU. Peaks and links of the model: H100
SXM 989 TFLOP/s and PCIe 5.0 x16 (64 GB/s), RTX 4090 165 TFLOP/s (bfloat16 with float32
accumulation) and PCIe 4.0 x16 (32 GB/s).

    JAX_PLATFORMS=cpu PYTHONPATH=.venv/h100-plugin .venv/bin/python benchmarks/biggest_model.py
    ... --quick    # short sequences and a small batch: a smoke test, not the answer
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.experimental import topologies

sys.path.insert(0, str(Path(__file__).parent))
import compiled_for_gpu as gpu
import multisteps
import run

import jaxga
from jaxga.remat import REMAT, remat_options

GiB, TiB = 2**30, 2**40
VOCAB = 32_000
HEAD = 128  # head size; the width is a multiple of it

# An NVIDIA GeForce RTX 4090 (24 GB GDDR6X) as XLA's GPU compiler sees it.
RTX_4090 = """
gpu_device_info {
  cuda_compute_capability { major: 8 minor: 9 }
  core_count: 128
  fpus_per_core: 128
  threads_per_block_limit: 1024
  threads_per_warp: 32
  threads_per_core_limit: 1536
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 101376
  shared_memory_per_core: 102400
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  clock_rate_ghz: 2.52
  memory_bandwidth: 1008000000000
  l2_cache_size: 75497472
  device_memory_size: 25757220864
}
platform_name: "CUDA"
device_description_str: "NVIDIA GeForce RTX 4090"
runtime_version { major: 12 minor: 8 }
dnn_version_info { major: 9 minor: 7 }
"""


class Card(NamedTuple):
    """A described GPU: its name, XLA target config, memory, the host memory beside it, its
    bfloat16 dense peak (FLOP/s) and its host link's bandwidth per direction (bytes/s)."""

    name: str
    target_config: str
    device_bytes: int
    host_bytes: int
    flops: float
    link: float


CARDS = {
    "H100 80GB": Card("H100 80GB", gpu.H100_SXM, 84_929_347_584, TiB, 989.4e12, 64e9),
    "24GB": Card("24GB", RTX_4090, 25_757_220_864, 256 * GiB, 165.2e12, 32e9),
}


def described(card: Card) -> jax.Device:
    """``card`` as a device ``jax.jit`` can compile for (none is attached)."""
    topology = topologies.get_topology_desc(
        card.name, "cuda", target_config=card.target_config, topology="1x1x1"
    )
    return topology.devices[0]


@dataclasses.dataclass(frozen=True)
class Llama:
    """A Llama-shaped decoder's sizes; ``Llama.of(size)`` grows depth and width in turn."""

    layers: int
    dim: int
    hidden: int
    seq_len: int

    @classmethod
    def of(cls, size: int, seq_len: int = 2048) -> Llama:
        dim = HEAD * (size // 2)
        return cls((size + 1) // 2, dim, 256 * math.ceil(8 * dim / 3 / 256), seq_len)

    def num_params(self) -> int:
        d, f = self.dim, self.hidden
        return self.layers * (4 * d * d + 3 * d * f + 2 * d) + 2 * VOCAB * d + d


def abstract_params(model: Llama) -> dict[str, Any]:
    """The parameters' shapes (float32 master weights), the layers stacked on axis 0."""
    L, d, f = model.layers, model.dim, model.hidden

    def array(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    layer = {"attn_norm": array(L, d), "mlp_norm": array(L, d), "wq": array(L, d, d),
             "wk": array(L, d, d), "wv": array(L, d, d), "wo": array(L, d, d),
             "w1": array(L, d, f), "w3": array(L, d, f), "w2": array(L, f, d)}  # fmt: skip
    return {"embed": array(VOCAB, d), "layers": layer, "norm": array(d), "head": array(d, VOCAB)}


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
    return (x32 * scale).astype(jnp.bfloat16)


def rotary(x: jax.Array) -> jax.Array:
    """Rotary positions on ``x`` of shape [batch, seq, heads, head]."""
    seq, half = x.shape[1], x.shape[-1] // 2
    angle = jnp.arange(seq)[:, None] * 10_000.0 ** (-jnp.arange(half) / half)
    cos, sin = jnp.cos(angle)[:, None], jnp.sin(angle)[:, None]
    a, b = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1).astype(x.dtype)


def decoder_layer(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """One Llama layer on the residual stream ``x`` [batch, seq, dim] (bfloat16)."""
    b, s, d = x.shape
    w = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
    h = rms_norm(x, p["attn_norm"])
    q, k, v = ((h @ w[n]).reshape(b, s, d // HEAD, HEAD) for n in ("wq", "wk", "wv"))
    attention = jax.nn.dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
    x = x + attention.reshape(b, s, d) @ w["wo"]
    h = rms_norm(x, p["mlp_norm"])
    return x + (jax.nn.silu(h @ w["w1"]) * (h @ w["w3"])) @ w["w2"]


def loss_for(remat: str, stream: bool = False, prefetch: bool = True) -> Callable[..., jaxga.Mean]:
    """The token-weighted next-token loss, its layers a ``remat_scan`` with remat ``remat``
    (``stream``: each layer fetched from host memory, ``remat_scan(stream=True)``, one layer
    ahead if ``prefetch``)."""
    options = remat_options(remat) | ({"stream": True, "prefetch": prefetch} if stream else {})

    def loss(params: dict[str, Any], batch: dict[str, jax.Array]) -> jaxga.Mean:
        x = params["embed"][batch["inputs"]].astype(jnp.bfloat16)
        x = jaxga.remat_scan(decoder_layer, params["layers"], x, **options)
        logits = (rms_norm(x, params["norm"]) @ params["head"].astype(jnp.bfloat16)).astype(
            jnp.float32
        )
        labels = jnp.take_along_axis(logits, batch["labels"][..., None], -1)[..., 0]
        return jaxga.Mean.of(jax.nn.logsumexp(logits, -1) - labels, batch["mask"])

    return loss


def abstract_batch(sequences: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    tokens = jax.ShapeDtypeStruct((sequences, seq_len), jnp.int32)
    return {"inputs": tokens, "labels": tokens, "mask": tokens.update(dtype=jnp.float32)}


class Setting(NamedTuple):
    """How one train step is built: the method, its remat and micro-batch (sequences)."""

    method: str
    remat: str
    micro: int


class Fit(NamedTuple):
    """One compiled step: device peak and host bytes, and whether they fit the card."""

    peak_bytes: int
    host_bytes: int
    fits: bool


def step_loss(loss: Callable[..., jaxga.Mean]) -> Callable[..., Any]:
    """``loss(params, batch)`` as a train step's loss: ``(params, batch, model_state, rng)``."""

    def train_loss(params, batch, model_state, rng):
        return loss(params, batch), model_state

    return train_loss


def compile_step(setting: Setting, model: Llama, card: Card, batch: int) -> Fit:
    """Compiles ``setting``'s train step of ``model`` for ``card``: its peak and host bytes."""
    device = described(card)
    loss = loss_for(setting.remat)
    params = abstract_params(model)
    k = batch // setting.micro
    adamw = optax.adamw(3e-4, weight_decay=0.1)
    if setting.method == "optax.MultiSteps":
        tx = optax.MultiSteps(adamw, k)
        grad_fn = jax.value_and_grad(functools.partial(_mean_value, loss))
        step = run.make_step(grad_fn, tx, backend="gpu")
        args = (
            params,
            jax.eval_shape(tx.init, params),
            abstract_batch(setting.micro, model.seq_len),
        )
        stats = gpu.program(step, *gpu.on(device, args)).memory_analysis()
        return fit_for(multisteps.peak(stats), 0, card)
    state = jax.eval_shape(functools.partial(jaxga.TrainState.create, tx=adamw), params)
    state, batch_ = gpu.on(device, (state, abstract_batch(batch, model.seq_len)))
    if setting.method in STREAMING:
        state = on_host(device, state, streamed)
        loss = loss_for(setting.remat, stream=True, prefetch=STREAMING[setting.method])
        step = jaxga.make_train_step(step_loss(loss), k, stream="layers", offload=True)
    else:
        offload = setting.method == "jaxga offload=True"
        step = jaxga.make_train_step(step_loss(loss), k, offload=offload)
    with gpu.cudnn_attention():
        report = jaxga.memory_report(step, state, batch_)
    return fit_for(report.peak_bytes, report.host_bytes, card)


class _PinnedHost(jax.sharding.NamedSharding):
    """A one-device sharding in pinned host memory that a described device keeps.

    ``SingleDeviceSharding(device, memory_kind="pinned_host")`` (or a ``NamedSharding``'s)
    drops the memory kind to None for a described device, which has no memories
    (``addressable_memories()`` is empty), and an abstract argument's memory space comes
    from a ``NamedSharding``'s memory kind alone; this one reports ``"pinned_host"``, so that
    the argument is traced in host memory (``float32<host>``) and lowered with
    ``mhlo.memory_kind = "pinned_host"``, which XLA's GPU compiler takes (host arguments
    and outputs counted apart, ``host_*_size_in_bytes``)."""

    @property
    def memory_kind(self) -> str:
        return "pinned_host"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _PinnedHost) and super().__eq__(other)

    def __hash__(self) -> int:
        return hash((super().__hash__(), "pinned_host"))


def on_host(
    where: jax.Device | jax.sharding.Mesh,
    tree: Any,
    select: Callable[[Any], bool],
    spec: jax.sharding.PartitionSpec | None = None,
) -> Any:
    """``tree``'s leaves whose path ``select`` picks placed in pinned host memory: a device's,
    or (a mesh) each device's, laid out by ``spec`` (None: replicated)."""
    mesh = where if isinstance(where, jax.sharding.Mesh) else jax.sharding.Mesh([where], ("host",))
    host = _PinnedHost(mesh, jax.sharding.PartitionSpec() if spec is None else spec)

    def place(path: Any, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return x.update(sharding=host) if select(path) else x

    return jax.tree_util.tree_map_with_path(place, tree)


def streamed(path: Any) -> bool:
    """The leaves ``jaxga streaming`` keeps in host memory: the layer stack's parameters and
    the optimiser state (``offload=True``'s leaves, where the step leaves them)."""
    names = [getattr(key, "name", getattr(key, "key", None)) for key in path]
    return names[:2] == ["params", "layers"] or names[:1] == ["opt_state"]


def _mean_value(loss: Callable[..., jaxga.Mean], params: Any, batch: Any) -> jax.Array:
    return loss(params, batch).value


def fit_for(peak_bytes: int, host_bytes: int, card: Card) -> Fit:
    """Whether a step of these device and host bytes fits ``card`` and the host beside it."""
    fits = peak_bytes <= card.device_bytes and host_bytes <= card.host_bytes
    return Fit(peak_bytes, host_bytes, fits)


class Largest(NamedTuple):
    """The largest fitting model of a column, the first that does not fit, and the compiles."""

    setting: Setting
    size: int | None  # None: not even the smallest fits
    fit: Fit | None
    next_fit: Fit | None  # of size + 1: what binds
    probes: int


def usage(fit: Fit, card: Card) -> float:
    """The larger of the device peak's and the host bytes' share of the card's and host's."""
    return max(fit.peak_bytes / card.device_bytes, fit.host_bytes / card.host_bytes)


def predicted(fits: dict[int, Fit], card: Card, seq_len: int) -> int:
    """The largest size whose usage stays within 1 on a line through the last two probes (or
    through the one probe and zero): usage grows nearly linearly in the parameter count."""
    points = [
        (Llama.of(size, seq_len).num_params(), usage(fit, card)) for size, fit in fits.items()
    ]
    (n0, u0), (n1, u1) = [(0, 0.0), *points][-2:]
    target = n1 + (1 - u1) * (n1 - n0) / max(u1 - u0, 1e-9)
    within = [size for size in range(2, 1024) if Llama.of(size, seq_len).num_params() <= target]
    return max(within, default=2)


def largest(
    setting: Setting, card: Card, args: argparse.Namespace, log: Callable, first: Fit
) -> Largest:
    """Bisection over sizes in [args.min_size, args.max_size], each probe the size a line
    through the last two predicts (``first``: the fit at ``args.probe_size``) when it
    lies strictly inside the bracket, else its middle."""
    lo, hi = args.min_size - 1, args.max_size + 1  # lo fits (or none), hi does not
    fits: dict[int, Fit] = {args.probe_size: first}
    if first.fits:
        lo = max(lo, args.probe_size)
    else:
        hi = min(hi, args.probe_size)
    while hi - lo > 1:
        guess = predicted(fits, card, args.seq_len)
        probe = guess if lo < guess < hi and guess not in fits else (lo + hi) // 2
        if guess == lo and lo + 1 < hi:  # the line's answer is the known fit: try one above
            probe = lo + 1
        fits[probe] = compile_step(setting, Llama.of(probe, args.seq_len), card, args.batch)
        log(setting, card, probe, fits[probe])
        if fits[probe].fits:
            lo = probe
        else:
            hi = probe
    found = lo if lo >= args.min_size else None
    return Largest(setting, found, fits.get(lo), fits.get(hi), len(fits))


def best_setting(
    method: str, card: Card, args: argparse.Namespace, log: Callable
) -> tuple[Setting, Fit]:
    """The candidate remat and micro-batch of ``method`` with the smallest compiled peak at
    ``args.probe_size``, and that peak."""
    remats = [r for r in args.remats if method not in STREAMING or r in STREAMABLE]
    candidates = [Setting(method, r, m) for r in remats for m in args.micro]
    model = Llama.of(args.probe_size, args.seq_len)
    peaks = {}
    for setting in candidates:
        peaks[setting] = compile_step(setting, model, card, args.batch)
        log(setting, card, args.probe_size, peaks[setting])
    best = min(candidates, key=lambda s: peaks[s].peak_bytes)
    return best, peaks[best]


STREAMING = {"jaxga streaming": True, "jaxga streaming, no prefetch": False}  # prefetch=
METHODS = ("optax.MultiSteps", "jaxga resident", "jaxga offload=True", *STREAMING)
FLOPS_PER_PARAM_TOKEN = {"full": 8, "sqrt": 10}  # others (saving the matmuls): 6
STREAMABLE = [name for name, row in REMAT.items() if row.segments == 1]  # remat_scan(stream=)
# Bytes a parameter moves a step with k micro-batches, (to the device, to the host), for a
# parameter of the layer stack and for one outside it (embedding, norm, head): the module doc.
MOVED_EACH_WAY: dict[str, Callable[[int], tuple[tuple[int, int], tuple[int, int]]]] = {
    "jaxga offload=True": lambda k: ((8, 8), (8, 8)),  # AdamW's moments, once a step
    "jaxga streaming": lambda k: ((12 * k + 24, 4 * k + 20), (8, 8)),
    "jaxga streaming, no prefetch": lambda k: ((12 * k + 24, 4 * k + 20), (8, 8)),
}


class Modelled(NamedTuple):
    """The cost model of one step (not a measurement): bytes moved, seconds."""

    moved_bytes: int  # host to device plus device to host
    compute_s: float  # matmul FLOPs at the card's peak
    transfer_s: float  # the larger direction at the host link's bandwidth
    step_s: float  # the larger of the two (transfers overlap compute), or their sum if not


def stack_params(model: Llama) -> int:
    """The parameters of the layer stack (``params["layers"]``)."""
    return model.num_params() - (2 * VOCAB * model.dim + model.dim)


def modelled(setting: Setting, model: Llama, card: Card, tokens: int) -> Modelled:
    """The modelled step time of ``setting`` for ``model`` on ``card`` (see the module doc)."""
    n, stack = model.num_params(), stack_params(model)
    compute = FLOPS_PER_PARAM_TOKEN.get(setting.remat, 6) * n * tokens / card.flops
    k = tokens // (model.seq_len * setting.micro)
    (in_stack, out_stack), (in_rest, out_rest) = MOVED_EACH_WAY.get(
        setting.method, lambda k: ((0, 0), (0, 0))
    )(k)
    to_device = in_stack * stack + in_rest * (n - stack)
    if STREAMING.get(setting.method):  # the backward's last prefetch: a layer unused
        to_device += 4 * k * stack // model.layers
    to_host = out_stack * stack + out_rest * (n - stack)
    transfer = max(to_device, to_host) / card.link
    waits = STREAMING.get(setting.method) is False  # each layer waits for its copy: no overlap
    step = compute + transfer if waits else max(compute, transfer)
    return Modelled(to_device + to_host, compute, transfer, step)


def billions(size: int | None, seq_len: int) -> float:
    return 0.0 if size is None else Llama.of(size, seq_len).num_params() / 1e9


def row(card: Card, found: Largest, args: argparse.Namespace) -> str:
    """One line of the table: the largest model of ``found``, its bytes and modelled time."""
    s, fit, nxt = found.setting, found.fit, found.next_fit
    model = Llama.of(found.size or args.min_size, args.seq_len)
    cost = modelled(s, model, card, args.batch * args.seq_len)
    peak = f"{fit.peak_bytes / GiB:8.2f} {fit.host_bytes / GiB:8.2f}" if fit else " " * 17
    beyond = f"{nxt.peak_bytes / GiB:.1f} / {nxt.host_bytes / GiB:.1f}" if nxt else "-"
    return (f"{card.name:10} {s.method:28} {s.remat:5} {s.micro:5d} {model.layers:3d} "
            f"{model.dim:6d} {billions(found.size, args.seq_len):7.2f}B {peak} "
            f"{cost.moved_bytes / GiB:7.1f} {cost.step_s:7.2f}  {beyond}")  # fmt: skip


def table(results: dict[str, dict[str, Largest]], args: argparse.Namespace) -> list[str]:
    """The printed table: a header, then a row per card and method."""
    lines = [
        f"compiled for described GPUs (XLA target configs; nothing ran): Llama-shaped, "
        f"sequence {args.seq_len}, {args.batch} sequences a step "
        f"({args.batch * args.seq_len:,} tokens), AdamW, f32 master weights and moments",
        f"{'card':10} {'method':28} {'remat':5} {'micro':>5} {'L':>3} {'d':>6} {'params':>8} "
        f"{'peak GiB':>8} {'host GiB':>8} {'moved':>7} {'model s':>7}  next size: peak / host GiB",
    ]
    for card in CARDS.values():
        for method in METHODS:
            found = results[card.name].get(method)
            if found is None:
                lines.append(f"{card.name:10} {method:28} not built")
            else:
                lines.append(row(card, found, args))
    lines.append(
        "moved: GiB host<->device a step; model s: modelled step time, max(compute at the "
        "card's bf16 peak, transfers at its PCIe link) (their sum with no prefetch: each layer "
        "waits for its copy), a model, not a measurement"
    )
    return lines


def last_line(results: dict[str, dict[str, Largest]], seq_len: int) -> str:
    """The required last line: jaxga's best and optax.MultiSteps' on each card."""

    def best(card: str, methods: tuple[str, ...]) -> float:
        found = [results[card][m].size for m in methods if m in results[card]]
        return max(billions(size, seq_len) for size in found)

    jaxga_methods = tuple(m for m in METHODS if m != "optax.MultiSteps")
    return (
        f"biggest model: H100 80GB {best('H100 80GB', jaxga_methods):.1f}B "
        f"(optax.MultiSteps {best('H100 80GB', ('optax.MultiSteps',)):.1f}B), "
        f"24GB {best('24GB', jaxga_methods):.1f}B"
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke test (seconds)")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--remats", nargs="+", default=["full", "sqrt"])
    parser.add_argument(
        "--micro", nargs="+", type=int, default=[1, 2], help="sequences per micro-batch"
    )
    args = parser.parse_args(argv)
    args.seq_len, args.batch = (256, 8) if args.quick else (2048, 128)
    args.min_size, args.max_size = (4, 48) if args.quick else (8, 256)
    args.probe_size = 8 if args.quick else 32
    return args


def write_json(args: argparse.Namespace, results: dict[str, dict[str, Largest]], secs: float):
    """The table's figures, with the arguments, jax's version and the run's seconds."""
    out = {"target": "described GPUs (XLA target configs; compiled, nothing ran)",
           "jax": jax.__version__, "seconds": round(secs), "seq_len": args.seq_len,
           "sequences": args.batch, "cards": {}}  # fmt: skip
    for card in CARDS.values():
        out["cards"][card.name] = {}
        for method, found in results[card.name].items():
            model = Llama.of(found.size or args.min_size, args.seq_len)
            cost = modelled(found.setting, model, card, args.batch * args.seq_len)
            out["cards"][card.name][method] = {
                "setting": found.setting._asdict(), "model": dataclasses.asdict(model),
                "num_params": model.num_params() if found.size else 0,
                "fit": found.fit._asdict() if found.fit else None,
                "next_fit": found.next_fit._asdict() if found.next_fit else None,
                "compiles": found.probes, "modelled": cost._asdict(),
            }  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    start = time.perf_counter()

    def log(setting: Setting, card: Card, size: int, fit: Fit) -> None:
        print(f"[{time.perf_counter() - start:6.0f}s] {card.name} {setting.method} "
              f"{setting.remat} micro={setting.micro} size={size} "
              f"({billions(size, args.seq_len):.2f}B): peak {fit.peak_bytes / GiB:.2f} GiB, "
              f"host {fit.host_bytes / GiB:.2f} GiB, fits={fit.fits}",
              file=sys.stderr, flush=True)  # fmt: skip

    results: dict[str, dict[str, Largest]] = {}
    chosen: dict[str, Setting] = {}
    for card in CARDS.values():
        results[card.name] = {}
        for method in METHODS:
            if method not in chosen:  # chosen on the first card, kept for the other
                chosen[method], first = best_setting(method, card, args, log)
            else:
                model = Llama.of(args.probe_size, args.seq_len)
                first = compile_step(chosen[method], model, card, args.batch)
            results[card.name][method] = largest(chosen[method], card, args, log, first)
    for line in table(results, args):
        print(line)
    print(f"({time.perf_counter() - start:.0f} s on this machine, jax {jax.__version__})")
    if args.json is not None:
        write_json(args, results, time.perf_counter() - start)
    print(last_line(results, args.seq_len))


if __name__ == "__main__":
    main()
