"""Data-parallel checks on 8 host devices, against single-device references.

Run by ``tests/test_data_parallel.py`` in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and ``JAXGA_MULTIDEVICE=1``
(the flag must be set before jax is imported, so these cannot run in the main pytest
process). By hand::

    JAXGA_MULTIDEVICE=1 XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        .venv/bin/python -m pytest tests/multidevice/dp_checks.py
"""

import functools
import os
import re
from pathlib import Path

import pytest

if os.environ.get("JAXGA_MULTIDEVICE") != "1":
    pytest.skip(
        "run by tests/test_data_parallel.py in a subprocess with 8 host devices",
        allow_module_level=True,
    )

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxga
from jaxga.sharding import replicate, shard_batch
from tests import test_streaming as streaming
from tests._hlo import hlo_collectives

DEVICES = 8
K = 4  # micro-batches per device
ROWS = 2  # rows per micro-batch
LOCAL = K * ROWS  # rows per device
GLOBAL = DEVICES * LOCAL
SEQ, VOCAB, DIM = 12, 11, 8
RTOL, ATOL = 2e-5, 1e-6

assert jax.device_count() == DEVICES, jax.devices()
MESH = jax.make_mesh((DEVICES,), ("data",))


# ----------------------------------------------------------------------------- data, model


def make_params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "embed": jax.random.normal(k1, (VOCAB, DIM)),
        "out": jax.random.normal(k2, (DIM, VOCAB)) / np.sqrt(DIM),
        "bias": jnp.zeros(VOCAB),
    }


def make_batch(seed=0, rows=GLOBAL):
    """Token sequences whose lengths grow with the device that holds them (skewed)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (rows, SEQ + 1)).astype(np.int32)
    device = np.arange(rows) // (rows // DEVICES)
    lengths = np.clip(1 + device * SEQ // DEVICES + rng.integers(0, 3, rows), 1, SEQ)
    mask = (np.arange(SEQ)[None] < lengths[:, None]).astype(np.float32)
    return {"inputs": tokens[:, :-1], "labels": tokens[:, 1:], "mask": mask}


def logits_fn(params, inputs, shift=0.0):
    hidden = jnp.tanh(params["embed"][inputs] + shift)
    return hidden @ params["out"] + params["bias"]


def mean_loss(params, batch):
    return jaxga.token_cross_entropy(
        logits_fn(params, batch["inputs"]), batch["labels"], batch["mask"]
    )


def scalar_loss(params, batch):
    return mean_loss(params, {**batch, "mask": jnp.ones_like(batch["mask"])}).value


def microbatch(batch, device, index):
    """Rows of global micro-batch ``device * K + index``, as jaxga splits them."""
    local = jax.tree.map(lambda x: x[device * LOCAL : (device + 1) * LOCAL], batch)
    return jax.tree.map(lambda x: x[index::K], local)


def microbatches(batch, index):
    """Micro-batch ``index`` of every device, stacked: leaves ``[DEVICES, ROWS, ...]``."""
    return jax.tree.map(lambda x: x.reshape(DEVICES, LOCAL, *x.shape[1:])[:, index::K], batch)


def data_parallel(fun, in_specs, out_specs, **options):
    return jax.jit(jax.shard_map(fun, mesh=MESH, in_specs=in_specs, out_specs=out_specs, **options))


def assert_close(actual, expected, rtol=RTOL, atol=ATOL):
    """chex's tree closeness on host copies, with equal shapes (no broadcasting)."""
    actual, expected = jax.tree.map(np.asarray, actual), jax.tree.map(np.asarray, expected)
    chex.assert_trees_all_equal_shapes(actual, expected)
    chex.assert_trees_all_close(actual, expected, rtol=rtol, atol=atol)


def assert_no_collective_in_the_loop(compiled_text):
    assert " while(" in compiled_text, "no while loop in the compiled HLO"
    found = hlo_collectives(compiled_text)
    inside = [c.line for c in found if c.in_loop]
    assert not inside, "collectives inside the micro-batch loop:\n" + "\n".join(inside)
    return found


def assert_reduces_once_after_the_loop(compiled_text):
    found = assert_no_collective_in_the_loop(compiled_text)
    assert any(c.opcode == "all-reduce" for c in found), "no all-reduce after the loop"
    return found


PARAMS = make_params()
BATCH = make_batch()
SHARDED = shard_batch(BATCH, MESH)
REPLICATED = replicate(PARAMS, MESH)


@pytest.fixture(scope="module")
def mean_reference():
    return jax.jit(jax.value_and_grad(lambda p, b: mean_loss(p, b).value))(PARAMS, BATCH)


@pytest.fixture(scope="module")
def mean_step():
    vg = jaxga.value_and_grad(mean_loss, num_microbatches=K, axis_name="data")
    return data_parallel(vg, (P(), P("data")), P()).lower(REPLICATED, SHARDED).compile()


# ----------------------------------------------------------------------------- tests


def test_shard_batch_places_rows_on_devices():
    assert SHARDED["inputs"].sharding.spec == P("data")
    for shard in SHARDED["inputs"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), BATCH["inputs"][shard.index])
        assert shard.data.shape == (LOCAL, SEQ)
    shards = jax.local_device_count()
    message = (
        f"shard_batch: batch['x'] has shape ({shards + 1}, 2); its leading axis must be "
        f"divisible by the {shards} local shard(s) of axis 'data'."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        shard_batch({"x": np.ones((shards + 1, 2))}, MESH)


def test_mean_loss_with_skewed_lengths_matches_full_batch(mean_step, mean_reference):
    assert_close(mean_step(REPLICATED, SHARDED), mean_reference)

    # The skew matters: the gradient of the mean of micro-batch means is far off.
    def mean_of_means(params):
        values = [jax.vmap(mean_loss, (None, 0))(params, microbatches(BATCH, i)) for i in range(K)]
        return jnp.mean(jnp.stack([v.value for v in values]))

    naive, expected = jax.jit(jax.grad(mean_of_means))(PARAMS), mean_reference[1]
    error = global_norm(jax.tree.map(jnp.subtract, naive, expected))
    assert error > 0.1 * global_norm(expected)


def global_norm(tree):
    return jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree.leaves(tree)))


def test_grad_matches_full_batch(mean_reference):
    g = jaxga.grad(mean_loss, num_microbatches=K, axis_name="data")
    assert_close(data_parallel(g, (P(), P("data")), P())(REPLICATED, SHARDED), mean_reference[1])


def test_scalar_loss_matches_full_batch():
    vg = jaxga.value_and_grad(scalar_loss, num_microbatches=K, axis_name="data")
    expected = jax.jit(jax.value_and_grad(scalar_loss))(PARAMS, BATCH)
    assert_close(data_parallel(vg, (P(), P("data")), P())(REPLICATED, SHARDED), expected)


def test_has_aux_is_local_and_stacked(mean_reference):
    def loss(params, batch):
        mean = mean_loss(params, batch)
        return mean, {"count": mean.count, "tokens": jnp.sum(batch["inputs"])}

    vg = jaxga.value_and_grad(loss, num_microbatches=K, axis_name="data", has_aux=True)
    (value, aux), grads = data_parallel(vg, (P(), P("data")), ((P(), P("data")), P()))(
        REPLICATED, SHARDED
    )
    assert_close((value, grads), mean_reference)
    # Device d's aux holds its K micro-batches: global micro-batch d * K + i.
    expected_count, expected_tokens = [], []
    for d in range(DEVICES):
        for i in range(K):
            mb = microbatch(BATCH, d, i)
            expected_count.append(mb["mask"].sum())
            expected_tokens.append(mb["inputs"].sum())
    np.testing.assert_allclose(aux["count"], expected_count)
    np.testing.assert_array_equal(aux["tokens"], expected_tokens)


def test_state_is_threaded_per_device():
    def loss(params, batch, state):
        mean = jaxga.token_cross_entropy(
            logits_fn(params, batch["inputs"], state), batch["labels"], batch["mask"]
        )
        new_state = 0.5 * state + 0.5 * jnp.mean(params["embed"][batch["inputs"]], axis=(0, 1))
        return mean, jax.lax.stop_gradient(new_state)

    state0 = jax.random.normal(jax.random.key(7), (DEVICES, DIM))  # one state per device

    def local(params, batch, state):
        (value, grads), new_state = jaxga.value_and_grad(
            loss, num_microbatches=K, axis_name="data", state_argnums=2
        )(params, batch, state[0])
        return value, grads, new_state[None]

    step = data_parallel(local, (P(), P("data"), P("data")), (P(), P(), P("data")))
    value, grads, state = step(REPLICATED, SHARDED, shard_batch(state0, MESH))

    def reference(params):  # a Python loop over micro-batches, vmapped over devices
        total, count, state = 0.0, 0.0, state0
        for i in range(K):
            mean, state = jax.vmap(loss, (None, 0, 0))(params, microbatches(BATCH, i), state)
            total, count = total + mean.total.sum(), count + mean.count.sum()
        return total / count, state

    (ref_value, ref_state), ref_grads = jax.jit(jax.value_and_grad(reference, has_aux=True))(PARAMS)
    assert_close((value, grads, state), (ref_value, ref_grads, ref_state))


def test_rng_keys_distinct_across_devices_and_microbatches():
    def loss(params, batch, key):
        # A noise scale drawn from the key (cheaper to compile than dropout masks).
        scale = 0.5 + (jax.random.key_data(key)[-1] % 16).astype(jnp.float32) / 16
        hidden = jnp.tanh(params["embed"][batch["inputs"]]) * scale
        logits = hidden @ params["out"] + params["bias"]
        mean = jaxga.token_cross_entropy(logits, batch["labels"], batch["mask"])
        return mean, jax.random.key_data(key)

    key = jax.random.key(42)
    vg = jaxga.value_and_grad(
        loss, num_microbatches=K, axis_name="data", has_aux=True, rng_argnums=2, aux="stack"
    )
    step = data_parallel(vg, (P(), P("data"), P()), ((P(), P("data")), P()))
    step = step.lower(REPLICATED, SHARDED, key).compile()
    (value, key_data), grads = step(REPLICATED, SHARDED, key)

    def reference(params):  # micro-batch i of device d gets fold_in(key, d * K + i)
        total, count = 0.0, 0.0
        for i in range(K):
            keys = jax.vmap(lambda d: jax.random.fold_in(key, d * K + i))(jnp.arange(DEVICES))
            mean, _ = jax.vmap(loss, (None, 0, 0))(params, microbatches(BATCH, i), keys)
            total, count = total + mean.total.sum(), count + mean.count.sum()
        return total / count

    expected_keys = [jax.random.key_data(jax.random.fold_in(key, g)) for g in range(DEVICES * K)]
    np.testing.assert_array_equal(key_data, np.stack(expected_keys))
    assert len({tuple(np.asarray(k)) for k in key_data}) == DEVICES * K
    assert_close((value, grads), jax.jit(jax.value_and_grad(reference))(PARAMS))
    assert_reduces_once_after_the_loop(step.as_text())


def test_hlo_reduces_once_after_the_microbatch_loop(mean_step):
    text = mean_step.as_text()
    found = assert_reduces_once_after_the_loop(text)
    print("\n".join(f"jaxga: in_loop={c.in_loop} {c.line[:160]}" for c in found))


def test_naive_shard_map_reduces_inside_the_loop(mean_reference):
    """Without jaxga, jax.grad of replicated params in a scan all-reduces per micro-batch."""

    def naive(params, batch):
        micro = jax.tree.map(lambda x: x.reshape(LOCAL // K, K, *x.shape[1:]).swapaxes(0, 1), batch)

        def body(carry, mb):
            (total, count), grads = carry
            (t, c), g = jax.value_and_grad(
                lambda p: (mean_loss(p, mb).total, mean_loss(p, mb).count), has_aux=True
            )(params)
            return ((total + t, count + c), jax.tree.map(jnp.add, grads, g)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        totals = jax.lax.pcast((jnp.zeros(()), jnp.zeros(())), "data", to="varying")
        ((total, count), grads), _ = jax.lax.scan(body, (totals, zeros), micro)
        total, count = jax.lax.psum((total, count), "data")
        return total / count, jax.tree.map(lambda g: g / count, grads)

    step = data_parallel(naive, (P(), P("data")), P()).lower(REPLICATED, SHARDED).compile()
    assert_close(step(REPLICATED, SHARDED), mean_reference)  # right, but slow:
    text = step.as_text()
    found = hlo_collectives(text)
    print("\n".join(f"naive: in_loop={c.in_loop} {c.line[:160]}" for c in found))
    assert any(c.opcode == "all-reduce" and c.in_loop for c in found)


def test_check_vma_false(mean_reference):
    vg = jaxga.value_and_grad(mean_loss, num_microbatches=K, axis_name="data")
    step = data_parallel(vg, (P(), P("data")), P(), check_vma=False)
    step = step.lower(REPLICATED, SHARDED).compile()
    assert_close(step(REPLICATED, SHARDED), mean_reference)
    assert_reduces_once_after_the_loop(step.as_text())


def test_pmap(mean_reference):
    vg = jaxga.value_and_grad(mean_loss, num_microbatches=K, axis_name="data")
    step = jax.pmap(vg, axis_name="data", in_axes=(None, 0))
    per_device = jax.tree.map(lambda x: x.reshape(DEVICES, LOCAL, *x.shape[1:]), BATCH)
    step = step.lower(PARAMS, per_device).compile()
    value, grads = step(PARAMS, per_device)
    for d in range(DEVICES):
        assert_close((value[d], jax.tree.map(lambda g: g[d], grads)), mean_reference)
    assert_reduces_once_after_the_loop(step.as_text())


def test_two_dimensional_mesh_and_tuple_axis_name(mean_reference):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    for axis_name, spec in (("data", P("data")), (("data", "model"), P(("data", "model")))):
        batch = shard_batch(BATCH, mesh, axis_name)
        vg = jaxga.value_and_grad(mean_loss, num_microbatches=2, axis_name=axis_name)
        step = jax.jit(jax.shard_map(vg, mesh=mesh, in_specs=(P(), spec), out_specs=P()))
        params = replicate(PARAMS, mesh)
        step = step.lower(params, batch).compile()
        assert_close(step(params, batch), mean_reference)
        assert_reduces_once_after_the_loop(step.as_text())


def test_indivisible_global_batch_names_all_three_numbers():
    batch = shard_batch(make_batch(rows=DEVICES * 6), MESH)  # 6 rows per device, K = 4
    vg = jaxga.value_and_grad(mean_loss, num_microbatches=K, axis_name="data")
    with pytest.raises(ValueError) as error:
        data_parallel(vg, (P(), P("data")), P())(REPLICATED, batch)
    message = str(error.value)
    assert "batch size 48 (6 per device on 8 devices" in message
    assert "num_microbatches=4 × 8 devices = 32" in message


def test_unbound_axis_name_inside_shard_map():
    vg = jaxga.value_and_grad(mean_loss, num_microbatches=K, axis_name="batch")
    with pytest.raises(ValueError, match="`axis_name`='batch' is not bound"):
        data_parallel(vg, (P(), P("data")), P())(REPLICATED, SHARDED)


def test_docs_quick_start_on_eight_devices(capsys):
    """The code of docs/distributed.md: quick start, FSDP, HLO (as tests/test_data_parallel.py
    runs them), the train step on a mesh and MultiSteps under shard_map."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text()
    namespace = {}
    shard_map_part = text.split("## Quick start with `shard_map`")[1]  # its first three blocks
    for block in re.findall(r"```python\n(.*?)```", shard_map_part, re.S)[:3]:
        exec(block, namespace)
    assert np.isfinite(float(capsys.readouterr().out))
    assert namespace["mesh"].size == DEVICES
    assert [(c.opcode, c.in_loop) for c in namespace["found"]] == [("all-reduce", False)]
    # The FSDP recipe gives the gradients of the replicated quick start.
    ns = namespace
    specs = {"w": P("data"), "b": P()}
    fsdp = data_parallel(ns["fsdp_grads"], (specs, P("data")), (P(), specs))
    batch = ns["shard_batch"](ns["host_batch"], MESH)
    params = {
        "w": shard_batch(ns["host_params"]["w"], MESH),
        "b": replicate(ns["host_params"]["b"], MESH),
    }
    expected = ns["compiled"](replicate(ns["host_params"], MESH), batch)
    assert_close(fsdp(params, batch), expected)

    # The train step and MultiSteps sections equal full-batch AdamW steps on one device
    # (two calls of MultiSteps on the same batch: one step on their merged tokens).
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)

    def block(start):
        return next(b for b in blocks if b.startswith(start))

    exec(block("def loss("), namespace)
    host_batch, host_params = ns["host_batch"], ns["host_params"]
    value_and_grad = jax.value_and_grad(lambda p: ns["loss_fn"](p, host_batch).value)
    optimizer = optax.adamw(1e-3)

    @jax.jit
    def reference_step(params, opt_state):
        (value, grads) = value_and_grad(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    history, opt_state, values = [host_params], optimizer.init(host_params), []
    for _ in range(3):
        params, opt_state, value = reference_step(history[-1], opt_state)
        history.append(params)
        values.append(value)
    assert_close(ns["state"].params, history[3], rtol=1e-5)
    assert_close(ns["metrics"]["loss"], values[2], rtol=1e-5)
    assert float(ns["metrics"]["count"]) == host_batch["mask"].sum()
    assert np.isclose(float(capsys.readouterr().out.split()[0]), ns["metrics"]["loss"])
    # The FSDP section: one step from the same start, with the state split over devices.
    exec(
        block('step = jaxga.make_train_step(loss, num_microbatches, mesh=mesh, strategy="fsdp")'),
        namespace,
    )
    assert_close(ns["state"].params, history[1], rtol=1e-5)
    assert not ns["state"].params["w"].sharding.is_fully_replicated
    exec(block("multi = "), namespace)
    assert_close(ns["params"], history[2], rtol=1e-5)
    assert int(ns["opt_state"].gradient_step) == 2


def test_fsdp_sharded_parameters_get_their_own_gradient_shard(mean_reference):
    """A parameter sharded over the axis (all-gathered in the loss) is not summed again."""

    def loss(params, batch):
        full = {**params, "out": jax.lax.all_gather(params["out"], "data", tiled=True)}
        return mean_loss(full, batch)

    specs = {"embed": P(), "out": P("data"), "bias": P()}
    params = {
        k: shard_batch(v, MESH) if k == "out" else replicate(v, MESH) for k, v in PARAMS.items()
    }
    vg = jaxga.value_and_grad(loss, num_microbatches=K, axis_name="data")
    step = data_parallel(vg, (specs, P("data")), (P(), specs))
    step = step.lower(params, SHARDED).compile()
    assert_close(step(params, SHARDED), mean_reference)
    found = hlo_collectives(step.as_text())
    print("\n".join(f"fsdp-gather-in-loss: in_loop={c.in_loop} {c.line[:160]}" for c in found))
    # The gradient of the all-gather, a reduce-scatter, runs once per micro-batch (and
    # keeps the accumulator sharded); the one all-reduce still follows the loop.
    assert any(c.opcode == "all-reduce" and not c.in_loop for c in found)
    assert not any(c.opcode == "all-reduce" and c.in_loop for c in found)


def test_fsdp_gather_once_reduce_scatter_once(mean_reference):
    """Sharded parameters gathered before jaxga, gradients reduce-scattered after it."""
    specs = {"embed": P(), "out": P("data"), "bias": P()}
    vg = jaxga.value_and_grad(mean_loss, num_microbatches=K, axis_name="data")

    def fsdp(params, batch):
        full = {**params, "out": jax.lax.all_gather(params["out"], "data", tiled=True)}
        value, grads = vg(full, batch)
        out = jax.lax.psum_scatter(grads["out"], "data", scatter_dimension=0, tiled=True)
        return value, {**grads, "out": out}

    params = {
        k: shard_batch(v, MESH) if k == "out" else replicate(v, MESH) for k, v in PARAMS.items()
    }
    step = data_parallel(fsdp, (specs, P("data")), (P(), specs))
    step = step.lower(params, SHARDED).compile()
    assert_close(step(params, SHARDED), mean_reference)
    found = assert_reduces_once_after_the_loop(step.as_text())
    print("\n".join(f"fsdp-gather-once: in_loop={c.in_loop} {c.line[:160]}" for c in found))
    assert {c.opcode for c in found} == {"all-gather", "all-reduce", "reduce-scatter"}


# ----------------------------------------------------------------------------- train step


class NNXTokenModel(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.out = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        return self.out(jnp.tanh(self.embed(tokens)))


class LinenTokenModel(nn.Module):
    train: bool

    @nn.compact
    def __call__(self, tokens):
        hidden = nn.BatchNorm(use_running_average=not self.train, momentum=0.8)(
            nn.Embed(VOCAB, DIM)(tokens)
        )
        return nn.Dense(VOCAB)(jnp.tanh(hidden))


def token_mean(logits, batch):
    return jaxga.token_cross_entropy(logits, batch["labels"], batch["mask"])


def nnx_setup():
    graphdef, params, rest = nnx.split(NNXTokenModel(nnx.Rngs(0)), nnx.Param, ...)
    return params, rest, jaxga.nnx_loss(graphdef, lambda m, b, rng: token_mean(m(b["inputs"]), b))


def linen_setup(train):
    variables = LinenTokenModel(True).init(jax.random.key(0), BATCH["inputs"][:2])
    # Non-trivial running statistics, so that eval mode depends on them.
    stats = jax.tree.map(lambda x: x + 0.3, variables["batch_stats"])
    model = LinenTokenModel(train)

    def loss(params, batch, model_state, rng):
        logits, updates = model.apply(
            {"params": params, "batch_stats": model_state["batch_stats"]},
            batch["inputs"],
            mutable=["batch_stats"],
        )
        return token_mean(logits, batch), {**model_state, **updates}

    return variables["params"], {"batch_stats": stats}, loss


def inner_optimizer():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(0.05, weight_decay=1e-2))


def full_batch_steps(loss, params, model_state, optimizer, batches):
    """The hand-written single-device loop: jax.value_and_grad of each whole batch, optax.

    Returns the parameters before the first and after every step.
    """

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: loss(p, batch, model_state, None)[0].value)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state, history = optimizer.init(params), [params]
    for batch in batches:
        params, opt_state = step(params, opt_state, batch)
        history.append(params)
    return history


def full_batch_metrics(loss, model_state):
    @jax.jit
    def metrics(params, batch):
        def value(p):
            mean, _ = loss(p, batch, model_state, None)
            return mean.value, mean.count

        (value, count), grads = jax.value_and_grad(value, has_aux=True)(params)
        return {"loss": value, "count": count, "grad_norm": optax.tree.norm(grads)}

    return metrics


def merge(*batches):
    return jax.tree.map(lambda *xs: np.concatenate(xs), *batches)


@pytest.mark.parametrize("setup", ["nnx", "linen-eval"])
@pytest.mark.parametrize("multisteps", [False, True], ids=["optax", "multisteps"])
@pytest.mark.parametrize("strategy", ["data_parallel", "zero1", "fsdp", "zero3"])
def test_train_step_on_a_mesh_matches_full_batch_training(setup, multisteps, strategy):
    """make_train_step(mesh=...) with skewed token lengths equals a one-device full-batch loop.

    With jaxga.MultiSteps(every_k=2), calls 2j and 2j + 1 together make
    one full-batch step on their merged batches. The batch comes as host numpy arrays, as
    a batch already sharded with shard_batch, and as a one-device jax array. Under every
    strategy the compiled step has no collective inside the micro-batch loop; with a
    sharded state the gradient is reduce-scattered after it, and the state keeps its
    layout.
    """
    params, model_state, loss = nnx_setup() if setup == "nnx" else linen_setup(train=False)
    calls = 4 if multisteps else 3
    batches = [make_batch(seed) for seed in range(calls)]
    if multisteps:
        optimizer = jaxga.MultiSteps(inner_optimizer(), every_k=2)
        merged = [merge(batches[i], batches[i + 1]) for i in range(0, calls, 2)]
        groups = full_batch_steps(loss, params, model_state, inner_optimizer(), merged)
        history = [params] + [groups[(call + 1) // 2] for call in range(calls)]
    else:
        optimizer = inner_optimizer()
        history = full_batch_steps(loss, params, model_state, optimizer, batches)
    metrics_of = full_batch_metrics(loss, model_state)

    step = jaxga.make_train_step(loss, K, mesh=MESH, strategy=strategy)
    state = jaxga.TrainState.create(params=params, tx=optimizer, model_state=model_state)
    found = hlo_collectives(step.lower(state, batches[0]).compile().as_text())
    inside = {c.opcode for c in found if c.in_loop}
    after = [c.opcode for c in found if not c.in_loop]
    if strategy == "zero3":  # each micro-batch gathers its parameters, scatters its gradient
        assert inside == {"all-gather", "reduce-scatter"}, [c.line[:160] for c in found]
    else:
        assert not inside, [c.line[:160] for c in found if c.in_loop]
    if strategy == "data_parallel":
        assert after == ["all-reduce"], [c.line[:160] for c in found]
    elif strategy != "zero3":
        assert "reduce-scatter" in after, [c.line[:160] for c in found]

    place = [lambda b: b, lambda b: shard_batch(b, MESH), lambda b: jax.tree.map(jnp.array, b)]
    for call, batch in enumerate(batches):
        state, metrics = step(state, place[call % 3](batch))
        assert_close(state.params, history[call + 1], rtol=1e-5)
        expected = metrics_of(history[call], batch)  # each call's own batch and loss
        assert_close({k: metrics[k] for k in expected}, expected, rtol=1e-5)
        assert bool(metrics["applied"]) == (not multisteps or call % 2 == 1)
    assert_close(state.model_state, model_state, rtol=0, atol=0)  # eval mode: unchanged
    assert int(state.step) == calls
    shardings = jaxga.sharding.state_shardings(state, MESH, strategy)
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.sharding, sharding)

    def sharded(tree):
        return any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(tree))

    assert sharded(state.params) == (strategy in ("fsdp", "zero3"))
    assert sharded(state.opt_state) == (strategy != "data_parallel")


def test_train_step_on_a_mesh_averages_batch_norm_statistics_over_devices():
    """BatchNorm in train mode: each device threads its statistics through its own K
    micro-batches; the step returns their mean over devices. Integer state (a counter)
    takes the maximum, and a PRNG key passes through."""
    params, model_state, bn_loss = linen_setup(train=True)
    model_state = {**model_state, "calls": jnp.zeros((), jnp.int32), "key": jax.random.key(3)}

    def loss(params, batch, model_state, rng):
        mean, new_state = bn_loss(params, batch, model_state, rng)
        return mean, {**new_state, "calls": model_state["calls"] + 1}

    optimizer = optax.adam(0.05)
    batches = [make_batch(seed) for seed in range(2)]

    @jax.jit
    def reference_step(params, opt_state, model_state, batch):
        """Each device's shard on its own (vmapped), a Python loop over its micro-batches."""

        def value(params):
            total, count = 0.0, 0.0
            stats = jax.tree.map(lambda x: jnp.stack([x] * DEVICES), model_state["batch_stats"])
            for i in range(K):
                mean, stats = jax.vmap(device_loss, (None, 0, 0))(
                    params, microbatches(batch, i), stats
                )
                total, count = total + mean.total.sum(), count + mean.count.sum()
            return total / count, jax.tree.map(lambda x: x.mean(0), stats)

        (_, stats), grads = jax.value_and_grad(value, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (
            optax.apply_updates(params, updates),
            opt_state,
            {**model_state, "batch_stats": stats},
        )

    def device_loss(params, batch, stats):
        mean, new_state = bn_loss(params, batch, {"batch_stats": stats}, None)
        return mean, new_state["batch_stats"]

    step = jaxga.make_train_step(loss, K, mesh=MESH)
    state = jaxga.TrainState.create(params=params, tx=optimizer, model_state=model_state)
    ref_params, ref_opt_state, ref_state = params, optimizer.init(params), model_state
    for batch in batches:
        state, _ = step(state, batch)
        ref_params, ref_opt_state, ref_state = reference_step(
            ref_params, ref_opt_state, ref_state, batch
        )
        assert_close(state.params, ref_params, rtol=1e-5)
        assert_close(state.model_state["batch_stats"], ref_state["batch_stats"], rtol=1e-5)
    assert int(state.model_state["calls"]) == len(batches) * K  # max over devices
    np.testing.assert_array_equal(
        jax.random.key_data(state.model_state["key"]), jax.random.key_data(jax.random.key(3))
    )


# ----------------------------------------------------------------------------- MultiSteps


def poisoned(grads, poison):
    """One gradient entry set to NaN when ``poison``."""
    first = jnp.arange(grads["bias"].size) == 0
    return {**grads, "bias": jnp.where(poison & first, jnp.nan, grads["bias"])}


def test_multisteps_under_shard_map_matches_optax_multisteps():
    """Gradients reduced by jaxga.value_and_grad(axis_name=...), then jaxga.MultiSteps in the
    same shard_map, equal optax.MultiSteps on full-batch gradients; a non-finite call is
    skipped and counted once, not once per device."""
    calls, poison = 5, 2
    batches = [make_batch(seed) for seed in range(calls)]
    tx = jaxga.MultiSteps(optax.adam(0.05), every_k=2, should_skip_update_fn=jaxga.skip_not_finite)
    vg = jaxga.value_and_grad(mean_loss, num_microbatches=K, axis_name="data")

    def train(params, state, batch, poison):
        _, grads = vg(params, batch)
        updates, state = tx.update(poisoned(grads, poison), state, params)
        return optax.apply_updates(params, updates), state

    step = data_parallel(train, (P(), P(), P("data"), P()), P())
    params, state = REPLICATED, replicate(tx.init(PARAMS), MESH)

    reference = optax.MultiSteps(optax.adam(0.05), 2, should_skip_update_fn=optax.skip_not_finite)

    @jax.jit
    def reference_step(params, state, batch, poison):  # full-batch gradients, one device
        grads = poisoned(jax.grad(lambda p: mean_loss(p, batch).value)(params), poison)
        updates, state = reference.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    ref_params, ref_state = PARAMS, reference.init(PARAMS)
    for call, batch in enumerate(batches):
        params, state = step(params, state, shard_batch(batch, MESH), call == poison)
        ref_params, ref_state = reference_step(ref_params, ref_state, batch, call == poison)
        assert_close(params, ref_params)
        assert int(state.mini_step) == int(ref_state.mini_step)
        assert int(state.skip_state["num_not_finite"]) == (call == poison)
    assert int(state.num_skipped) == 1 and int(state.gradient_step) == (calls - 1) // 2


def test_multisteps_with_sharded_gradients_skips_on_every_device():
    """Gradients sharded over "data" (FSDP-style), NaN on one device only: every device
    skips the call, as optax.MultiSteps does on the whole gradient, because the devices'
    reports are summed over the axis the gradients vary over."""
    size, calls, poison = 8 * DEVICES, 5, 2
    rng = np.random.default_rng(1)
    params0 = rng.normal(size=size).astype(np.float32)
    grads = rng.normal(size=(calls, size)).astype(np.float32)
    grads[poison, 3 * size // DEVICES + 1] = np.nan  # in device 3's shard only

    def run(tx):
        state0 = tx.init(params0)
        specs = jax.tree.map(lambda x: P("data") if np.shape(x) == (size,) else P(), state0)

        def update(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        step = data_parallel(update, (P("data"), specs, P("data")), (P("data"), specs))
        place = jax.tree.map(lambda s: NamedSharding(MESH, s), specs)
        params, state, history = shard_batch(params0, MESH), jax.device_put(state0, place), []
        for g in grads:
            params, state = step(params, state, shard_batch(g, MESH))
            history.append((params, state))
        return history

    reference = optax.MultiSteps(optax.adam(0.05), 2, should_skip_update_fn=optax.skip_not_finite)

    @jax.jit
    def reference_step(params, state, grads):  # the whole gradient on one device
        updates, state = reference.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    ref_params, ref_state = params0, reference.init(params0)
    history = run(
        jaxga.MultiSteps(optax.adam(0.05), every_k=2, should_skip_update_fn=jaxga.skip_not_finite)
    )
    for call, (params, state) in enumerate(history):
        ref_params, ref_state = reference_step(ref_params, ref_state, grads[call])
        assert_close(params, ref_params)
        assert int(state.mini_step) == int(ref_state.mini_step)
        assert bool(state.skip_state["should_skip"]) == (call == poison)
        assert int(state.skip_state["num_not_finite"]) == (call == poison)  # summed


# ----------------------------------------------------------------------------- sharded state


def wide_setup():
    """A state whose parameters dwarf the batch: what FSDP is for."""
    params = {"w1": jnp.ones((64, 128)) / 8, "w2": jnp.ones((128, 64)) / 11, "b": jnp.zeros(7)}

    def loss(params, batch, model_state, rng):
        hidden = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"] + params["b"].sum()
        return jaxga.Mean.of((hidden - batch["x"]) ** 2, where=batch["w"][:, None]), model_state

    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.normal(size=(GLOBAL, 64)).astype(np.float32),
            "w": rng.integers(0, 3, GLOBAL).astype(np.float32),  # skewed weights
        }
        for _ in range(3)
    ]
    return params, loss, batches


def test_fsdp_state_per_device_is_an_eighth_of_the_replicated_one():
    params, loss, batches = wide_setup()
    state = jaxga.TrainState.create(params=params, tx=jaxga.MultiSteps(optax.adam(1e-3), 2))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batches[0])
    reports = {
        strategy: jaxga.memory_report(
            jaxga.make_train_step(loss, K, mesh=MESH, strategy=strategy), state, abstract
        )
        for strategy in ("data_parallel", "zero1", "fsdp", "zero3")
    }
    batch_bytes = sum(x.nbytes for x in jax.tree.leaves(batches[0])) // DEVICES
    state_bytes = {k: r.argument_bytes - batch_bytes for k, r in reports.items()}
    replicated = state_bytes["data_parallel"]
    assert replicated > 4 * 4 * 64 * 128  # params, two moments and the accumulator
    assert state_bytes["fsdp"] == state_bytes["zero3"] <= 0.2 * replicated, state_bytes
    assert 0.2 * replicated < state_bytes["zero1"] < 0.5 * replicated, state_bytes
    # zero3 holds neither the gathered parameters nor a whole gradient sum through the loop
    assert reports["zero3"].temp_bytes < reports["fsdp"].temp_bytes, reports


def test_plan_fits_a_sharded_state_per_device():
    """The planner sizes the compiled SPMD program per device: a budget that only the
    sharded state meets is met with strategy="fsdp" and not with data parallelism."""
    params, loss, batches = wide_setup()
    state = jaxga.TrainState.create(params=params, tx=optax.adam(1e-3))

    def build(strategy):
        return lambda k, remat: jaxga.make_train_step(loss, k, mesh=MESH, strategy=strategy)

    def peak(strategy):
        return jaxga.memory_report(build(strategy)(K, "none"), state, batches[0]).peak_bytes

    budget = (peak("fsdp") + peak("data_parallel")) // 2
    options = {"budget": budget, "remat": ("none",)}  # counts: those the 8 devices divide
    plan = jaxga.plan(build("fsdp"), state, batches[0], **options)
    assert plan.report.peak_bytes <= budget
    with pytest.raises(jaxga.planner.InfeasibleBudgetError):
        jaxga.plan(build("data_parallel"), state, batches[0], **options)


def test_auto_microbatches_with_fsdp_plan_per_device():
    """num_microbatches="auto" on 8 devices with FSDP: the fewest count (dividing each
    device's rows) whose explicit step's per-device peak fits, then that step bit for bit."""
    params, loss, batches = wide_setup()
    state = jaxga.TrainState.create(params=params, tx=optax.adam(1e-3))
    counts = [k for k in range(1, LOCAL + 1) if LOCAL % k == 0]
    peaks = {
        k: jaxga.memory_report(
            jaxga.make_train_step(loss, k, mesh=MESH, strategy="fsdp"), state, batches[0]
        ).peak_bytes
        for k in counts
    }
    budget = sorted(peaks.values())[len(peaks) // 2]
    expected = min(k for k, peak in peaks.items() if peak <= budget)
    step = jaxga.make_train_step(loss, "auto", memory_budget=budget, mesh=MESH, strategy="fsdp")
    explicit = jaxga.make_train_step(loss, expected, mesh=MESH, strategy="fsdp")
    ours, theirs = state, jaxga.TrainState.create(params=params, tx=optax.adam(1e-3))
    for batch in batches[:2]:
        ours, _ = step(ours, batch)
        theirs, _ = explicit(theirs, batch)
    assert step.plan.num_microbatches == expected
    assert step.plan.report.peak_bytes == peaks[expected]
    chex.assert_trees_all_equal(jax.device_get(ours.params), jax.device_get(theirs.params))


def test_sharded_checkpoint_restores_on_four_devices_and_continues(tmp_path):
    """Saved from 8 devices (FSDP), restored onto 4 with orbax, resharded on restore: the
    next step equals the one the 8 devices take."""
    import orbax.checkpoint as ocp

    params, loss, batches = wide_setup()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    state = jaxga.TrainState.create(params=params, tx=tx, rng=3)
    eight = jaxga.make_train_step(loss, K, mesh=MESH, strategy="fsdp")
    state, _ = eight(state, batches[0])
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "state", state)
    checkpointer.wait_until_finished()

    mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    shardings = jaxga.sharding.state_shardings(state, mesh4, "fsdp")
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )
    restored = checkpointer.restore(tmp_path / "state", abstract)
    assert restored.params["w1"].sharding.mesh == mesh4
    assert restored.params["w1"].addressable_shards[0].data.shape == (64, 128 // 4)
    four = jaxga.make_train_step(loss, 2 * K, mesh=mesh4, strategy="fsdp")
    on_four, metrics4 = four(restored, batches[1])
    on_eight, metrics8 = eight(state, batches[1])
    assert_close(on_four.params, on_eight.params, rtol=1e-5)
    assert_close(on_four.opt_state, on_eight.opt_state, rtol=1e-5)
    assert_close(metrics4["loss"], metrics8["loss"], rtol=1e-6)


def test_bad_sharding_strategies_are_named():
    params, loss, batches = wide_setup()
    state = jaxga.TrainState.create(params=params, tx=optax.sgd(0.1))
    bad = [
        (
            "zero2",
            ValueError,
            r"`strategy` must be one of .data_parallel., .zero1., .fsdp., .zero3.",
        ),
        (
            {"w1": P("data")},
            ValueError,
            r"^`strategy`.s specs must have the params. tree PyTreeDef\(.*\); "
            r"got PyTreeDef\(",
        ),
        (
            {"w1": P(None, "data"), "w2": P("data"), "b": P("data")},
            ValueError,
            r"params\['b'\], .*\('data',\), splits its axis 0 of size 7 over the 8 devices",
        ),
        (
            {"w1": P("model"), "w2": P(), "b": P()},
            ValueError,
            r"params\['w1'\] must be a PartitionSpec .* each None or axes of the mesh \('data',\); "
            r"got P\('model',\)",
        ),
    ]
    for strategy, error, match in bad:
        with pytest.raises(error, match=match):
            jaxga.make_train_step(loss, K, mesh=MESH, strategy=strategy)(state, batches[0])
    with pytest.raises(ValueError, match=r"`axis_name`='batch' is not an axis of `mesh`"):
        jaxga.sharding.state_shardings(state, MESH, "fsdp", axis_name="batch")
    with pytest.raises(ValueError, match=r"`strategy`='fsdp' shards the state over a mesh"):
        jaxga.make_train_step(loss, K, strategy="fsdp")


def test_skip_not_finite_counts_each_leaf_once_over_its_shards():
    """A replicated leaf's NaN is one NaN, not one per device; a sharded leaf's are summed."""
    tx = jaxga.MultiSteps(optax.sgd(0.1), 2, should_skip_update_fn=jaxga.skip_not_finite)
    params = {"w": np.zeros((8, 2), np.float32), "b": np.zeros(3, np.float32)}
    specs = {"w": P("data"), "b": P()}
    state_specs = jax.tree.map(lambda _: P(), tx.init(params))
    state_specs = state_specs._replace(acc_grads=specs)

    def update(params, state, grads):
        return tx.update(grads, state, params)[1]

    step = data_parallel(update, (specs, state_specs, specs), state_specs)

    def place(tree, s):
        return jax.tree.map(lambda x, p: jax.device_put(x, NamedSharding(MESH, p)), tree, s)

    grads = {"w": np.zeros((8, 2), np.float32), "b": np.array([np.nan, 0, 0], np.float32)}
    grads["w"][[1, 6], 0] = np.inf  # on two devices' shards
    state = step(place(params, specs), place(tx.init(params), state_specs), place(grads, specs))
    assert int(state.skip_state["num_not_finite"]) == 3 and int(state.num_skipped) == 1


def test_mesh_step_names_bad_batches_and_reused_states():
    params, loss, batches = wide_setup()
    step = jaxga.make_train_step(loss, 2, mesh=MESH, strategy="fsdp")
    state = jaxga.TrainState.create(params, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"batch\['x'\] is a scalar"):
        step(state, {"x": np.float32(1.0), "w": np.ones(GLOBAL, np.float32)})
    twelve = jax.tree.map(lambda x: x[:12], batches[0])
    with pytest.raises(
        jaxga.sharding.IndivisibleBatchError,
        match=r"batch size 12 .* num_microbatches=2 × 8 devices = 16",
    ):
        step(state, twelve)
    new, _ = step(state, batches[0])
    with pytest.raises(ValueError, match="an earlier call deleted: it donates"):
        step(state, batches[0])  # donated by the call before; no segfault, no XLA error
    step(new, batches[1])


def test_a_leaf_moved_off_the_mesh_is_laid_out_again():
    """A state whose parameter was moved to one device by hand between steps: the step lays
    it out again (every leaf is checked, not the first alone) and trains as if unmoved."""
    params, loss, batches = wide_setup()
    step = jaxga.make_train_step(loss, 2, mesh=MESH, strategy="data_parallel")
    state, _ = step(jaxga.TrainState.create(params, optax.sgd(0.1)), batches[0])
    copy = jax.tree.map(jnp.copy, state)  # the step donates its state (device 3's shard too)
    w2 = jax.device_put(copy.params["w2"], jax.devices()[3])  # "w2": the last leaf, not the first
    assert isinstance(w2.sharding, jax.sharding.SingleDeviceSharding)
    again, _ = step(copy.replace(params=copy.params | {"w2": w2}), batches[1])
    unmoved, _ = step(state, batches[1])
    chex.assert_trees_all_equal(again.params, unmoved.params)


# ----------------------------------------------------- streaming a layer stack, data parallel


def stream_batch(step):
    """`streaming.batch_of`'s token batch at 64 rows: 2 per micro-batch on each device."""
    tokens = jax.random.randint(jax.random.key(10 + step), (GLOBAL, streaming.SEQ + 1), 0, VOCAB)
    lengths = jnp.arange(GLOBAL) % streaming.SEQ + 1  # every row a different count of tokens
    mask = jnp.arange(streaming.SEQ)[None, :] < lengths[:, None]
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def stream_train(mesh, stream, steps=2):
    loss = functools.partial(streaming.step_loss, stream=bool(stream), policy="full")
    step = jaxga.make_train_step(loss, K, stream=stream, offload=bool(stream), mesh=mesh)
    state = jaxga.TrainState.create(params=streaming.model_params(), tx=streaming.optimizer())
    state = streaming.streamed(state) if stream else state
    for i in range(steps):
        state, metrics = step(state, stream_batch(i))
    return state, metrics, step.lower(state, stream_batch(steps)).compile().as_text()


def stream_reference(steps=2):
    """`jax.grad` of the whole batch's token mean on one device, and optax."""

    def loss(params, batch):
        losses = streaming.token_losses(params, batch, stream=False, policy=None)
        return jnp.sum(losses * batch["mask"]) / jnp.sum(batch["mask"])

    params, tx = streaming.model_params(), streaming.optimizer()
    opt_state = tx.init(params)
    for i in range(steps):
        updates, opt_state = tx.update(jax.grad(loss)(params, stream_batch(i)), opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, opt_state


@pytest.mark.parametrize(
    "stream, axis_type", [(True, "Explicit"), ("layers", "Explicit"), (True, "Auto")]
)
def test_streamed_step_on_eight_devices(stream, axis_type):
    """Each device streams its own copy of the stack from host memory: the step is the
    resident one on the mesh (True: bit for bit; "layers": to rounding) and the one-device
    whole batch's; no collective in the micro-batch loop, and the stack's sums reduced once
    after it, a layer at a time (one all-reduce of a layer of each stack, in a loop)."""
    mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(getattr(AxisType, axis_type),))
    with jax.default_matmul_precision("highest"):
        state, metrics, text = stream_train(mesh, stream)
        resident, resident_metrics, _ = stream_train(mesh, False)
        params, opt_state = stream_reference()
    same = streaming.assert_equal if stream is True else streaming.assert_rounding
    got = (state.params, state.opt_state, metrics["loss"])
    same(got, (resident.params, resident.opt_state, resident_metrics["loss"]))
    assert_close((state.params, state.opt_state), (params, opt_state), rtol=2e-5, atol=2e-6)
    assert streaming.kinds(state.params["layers"]) == {"pinned_host"}
    assert streaming.kinds(state.opt_state) == {"pinned_host"}
    found = hlo_collectives(text)
    layers = sorted(str(list(x.shape[1:])) for x in jax.tree.leaves(state.params["layers"]))
    in_loops = [c for c in found if c.in_loop]  # over the layers alone: none in the micro-batches'
    assert [c.opcode for c in in_loops] == ["all-reduce"], in_loops
    result = in_loops[0].line.split(" all-reduce(")[0]  # one layer of every stack
    shapes = sorted(re.findall(r"f32(\[[\d,]*\])", result))
    assert shapes == [s.replace(" ", "") for s in layers], result
    assert any(c.opcode == "all-reduce" and not c.in_loop for c in found)


@pytest.mark.parametrize("stream", [True, "layers"])
def test_streamed_nnx_step_on_eight_devices(stream):
    """An NNX model's blocks in host memory on each device (with "layers", their moments too):
    the resident step (True: bit for bit; "layers": to rounding)."""
    results = []
    with jax.default_matmul_precision("highest"):
        for streamed in (stream, False):
            model = streaming.Stack(nnx.Rngs(0), stream=bool(streamed))
            opt = nnx.Optimizer(model, streaming.optimizer(), wrt=nnx.Param)
            if streamed:
                nnx.update(model.blocks, jax.device_put(nnx.state(model.blocks), streaming.HOST))
            offload = streamed == "layers"
            options = {"stream": streamed, "offload": offload, "mesh": MESH}
            step = jaxga.nnx_train_step(streaming.nnx_loss, K, **options)
            metrics = [step(model, opt, stream_batch(i)) for i in range(2)][-1]
            state = nnx.to_pure_dict(nnx.state(model)), nnx.as_pure(opt.opt_state)
            results.append((*state, metrics["loss"]))
            if streamed:  # the blocks' sums reduced a layer at a time: one all-reduce in a loop
                text = step.lower(model, opt, stream_batch(2)).compile().as_text()
                found = [c.opcode for c in hlo_collectives(text) if c.in_loop]
                assert found == ["all-reduce"], found
    same = streaming.assert_equal if stream is True else streaming.assert_rounding
    same(*results)
    assert streaming.kinds(results[0][0]["blocks"]) == {"pinned_host"}
    if stream == "layers":  # offload=True: the optimiser state in host memory too
        assert streaming.kinds(results[0][1]) == {"pinned_host"}
