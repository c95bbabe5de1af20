"""benchmarks/biggest_model.py's size grid and bisection, without compiling for a GPU."""

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import optax
import pytest

import jaxga

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import biggest_model as bm

from tests.test_h100_compiled import ROOT, plugin_folder

GiB = 2**30


@pytest.mark.parametrize(
    ("size", "published"),
    [(64, 6_738_415_616), (80, 13_015_864_320)],  # Llama 2 7B and 13B, as Meta counts them
    ids=["llama-2-7b", "llama-2-13b"],
)
def test_the_grid_holds_llama_2(size, published):
    model = bm.Llama.of(size)
    leaves = jax.tree.leaves(bm.abstract_params(model))
    assert model.num_params() == published
    assert sum(math.prod(x.shape) for x in leaves) == published


def fake_compile(bytes_per_param, card):
    """A step whose peak is bytes_per_param a parameter plus 1 GiB, as a compile would say."""

    def compile_step(setting, model, card_, batch):
        assert card_ == card
        return bm.fit_for(bytes_per_param * model.num_params() + GiB, 0, card)

    return compile_step


@pytest.mark.parametrize("bytes_per_param", [16, 20, 28])
@pytest.mark.parametrize("card", list(bm.CARDS.values()), ids=list(bm.CARDS))
def test_bisection_finds_the_largest_fitting_size(monkeypatch, bytes_per_param, card):
    monkeypatch.setattr(bm, "compile_step", fake_compile(bytes_per_param, card))
    args = argparse.Namespace(min_size=8, max_size=256, probe_size=32, seq_len=2048, batch=128)
    setting = bm.Setting("jaxga resident", "full", 1)
    first = bm.compile_step(setting, bm.Llama.of(args.probe_size), card, args.batch)
    found = bm.largest(setting, card, args, lambda *a: None, first)
    fitting = [  # every size tried, the reference
        size
        for size in range(args.min_size, args.max_size + 1)
        if bytes_per_param * bm.Llama.of(size).num_params() + GiB <= card.device_bytes
    ]
    assert found.size == max(fitting)
    assert found.fit.fits and not found.next_fit.fits
    assert found.probes <= 6  # a line through the probes lands next to the answer


@pytest.mark.parametrize("micro", [1, 2])
def test_the_streaming_cost_model(micro):
    """Per stack parameter, 12k + 24 bytes to the device and 4k + 20 to the host a step (k
    micro-batches), and one layer's 4 bytes a parameter to the device a micro-batch (the
    backward's last prefetch); the embedding, norm and head move their moments as
    offload=True does (the program's count: the test below)."""
    model, card = bm.Llama.of(32), bm.CARDS["H100 80GB"]
    tokens, k = 128 * model.seq_len, 128 // micro
    stack = bm.stack_params(model)
    assert stack == model.layers * sum(
        math.prod(x.shape[1:]) for x in jax.tree.leaves(bm.abstract_params(model)["layers"])
    )
    rest = model.num_params() - stack
    cost = bm.modelled(bm.Setting("jaxga streaming", "full", micro), model, card, tokens)
    to_device, to_host = (12 * k + 24) * stack + 8 * rest, (4 * k + 20) * stack + 8 * rest
    to_device += 4 * k * stack // model.layers
    assert cost.moved_bytes == to_device + to_host
    assert cost.transfer_s == to_device / card.link
    assert cost.compute_s == 8 * model.num_params() * tokens / card.flops
    assert cost.step_s == max(cost.compute_s, cost.transfer_s)
    offload = bm.modelled(bm.Setting("jaxga offload=True", "full", micro), model, card, tokens)
    assert offload.moved_bytes == 16 * model.num_params()  # 8 bytes each way, as before
    resident = bm.modelled(bm.Setting("jaxga resident", "full", micro), model, card, tokens)
    assert resident.moved_bytes == 0 and resident.step_s == resident.compute_s


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_streaming_cost_model_counts_what_the_step_moves(prefetch, monkeypatch):
    """The cost model's bytes moved a step are what the streamed train step of a small
    decoder moves on CPU (`jaxga.memory_report`'s ``moved_bytes``, every copy between
    memories in the program, each loop iteration counted), but for AdamW's step count (an
    int32 moved in and out with ``offload=True``)."""
    monkeypatch.setattr(bm, "VOCAB", 256)  # a small embedding and head
    model, micro, sequences = bm.Llama(layers=4, dim=128, hidden=384, seq_len=16), 2, 8
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")

    def placed(path, x):
        zeros = jax.numpy.zeros(x.shape, x.dtype)
        return jax.device_put(zeros, host) if bm.streamed(path) else zeros

    params = jax.tree.map(lambda x: jax.numpy.zeros(x.shape, x.dtype), bm.abstract_params(model))
    state = jaxga.TrainState.create(params=params, tx=optax.adamw(3e-4, weight_decay=0.1))
    state = jax.tree_util.tree_map_with_path(placed, state)
    batch = jax.tree.map(
        lambda x: jax.numpy.zeros(x.shape, x.dtype), bm.abstract_batch(sequences, model.seq_len)
    )
    loss = bm.step_loss(bm.loss_for("full", stream=True, prefetch=prefetch))
    step = jaxga.make_train_step(loss, sequences // micro, stream="layers", offload=True)
    moved = jaxga.memory_report(step, state, batch).moved_bytes
    method = "jaxga streaming" if prefetch else "jaxga streaming, no prefetch"
    tokens = sequences * model.seq_len
    cost = bm.modelled(bm.Setting(method, "full", micro), model, bm.CARDS["24GB"], tokens)
    assert moved == cost.moved_bytes + 2 * 4


STREAMING_COMPILE = """
import sys
sys.path.insert(0, "benchmarks")
import biggest_model as bm
bm.VOCAB = 256  # a small embedding and head: the stack's bytes dominate
model = bm.Llama(layers=8, dim=512, hidden=1536, seq_len=128)
for name in ("streaming", "offload=True"):
    fit = bm.compile_step(bm.Setting("jaxga " + name, "full", 1), model, bm.CARDS["24GB"], 2)
    print(name, fit.peak_bytes, fit.host_bytes, bm.stack_params(model))
"""


def test_a_streaming_step_compiles_for_a_described_gpu():
    """With JAX's CUDA plugin: the streamed step of a small decoder compiles for the described
    24 GB card, its stack and optimiser state in host memory (host bytes), the device's peak
    under half the stack's float32 bytes (never whole on the device); offload=True's holds
    the stack on the device."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_FLAGS"))}
    path = os.pathsep.join(p for p in (str(plugin_folder()), str(ROOT)) if p)
    env.update(PYTHONPATH=path, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", STREAMING_COMPILE],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line.split() for line in result.stdout.splitlines()]
    got = {words[0]: [int(n) for n in words[1:]] for words in lines}
    peak, host, stack = got["streaming"]
    assert peak < 4 * stack / 2  # the stack's float32 bytes never whole on the device
    assert host >= 12 * stack  # the stack and its two moments, at least, in host memory
    offload_peak, _, _ = got["offload=True"]
    assert offload_peak > 4 * stack


def test_the_planner_streams_only_when_nothing_resident_fits():
    """With JAX's CUDA plugin, `make_train_step(loss, "auto", stream="auto")` on the
    described 24 GB card (benchmarks/streaming_plan.py): with a budget under every resident
    peak it plans the stack streamed, every resident candidate built first and over the
    budget (tests/test_streaming_plan.py: with room, the resident plan, nothing streamed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_FLAGS"))}
    path = os.pathsep.join(p for p in (str(plugin_folder()), str(ROOT)) if p)
    env.update(PYTHONPATH=path, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "benchmarks/streaming_plan.py", "--json", "100MiB"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    (tight,) = (json.loads(line) for line in result.stdout.splitlines())
    resident = [c for c in tight["candidates"] if c["stream"] is False]
    assert resident and tight["candidates"][: len(resident)] == resident  # built first
    assert all(c["peak_bytes"] > tight["budget"] for c in resident)
    (chosen,) = [c for c in tight["candidates"] if c["chosen"]]
    assert chosen["stream"] in (True, "layers") and chosen["peak_bytes"] <= tight["budget"]
    stack = tight["stack"]
    assert chosen["host_bytes"] >= 12 * stack  # the stack and its two moments in host memory
    assert chosen["moved_bytes"] >= 3 * 4 * stack  # fetched forward, backward, and updated
