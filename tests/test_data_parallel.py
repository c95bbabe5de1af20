"""Data parallelism: ``jaxga.value_and_grad(..., axis_name=...)`` across devices and processes.

The main pytest process has one CPU device, and the host device count can only be
set before jax is imported, so the 8-device checks (``tests/multidevice/dp_checks.py``)
run in one pytest subprocess and the multi-host check runs two processes of
``tests/multidevice/two_process.py`` joined by ``jax.distributed`` on localhost.
The tests here that need no extra devices run in this process.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxga
from jaxga.microbatch import IndivisibleBatchError
from jaxga.sharding import replicate, shard_batch
from tests._hlo import hlo_collectives

ROOT = Path(__file__).resolve().parent.parent
MULTIDEVICE = ROOT / "tests" / "multidevice"
# a hang's limit, not a speed test: far beyond what a loaded 2-core machine needs
TIMEOUT_S = 3000


def child_env(**extra):
    """The environment of a child process: CPU only, no pytest/xdist variables; conftest's
    XLA_FLAGS, and those of ``extra`` after them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    flags = " ".join([os.environ.get("XLA_FLAGS", ""), extra.pop("XLA_FLAGS", "")]).strip()
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS=flags, **extra)
    return env


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- subprocesses


@pytest.mark.multidevice
def test_eight_devices(tmp_path):
    """Runs tests/multidevice/dp_checks.py on 8 host devices and requires it to pass."""
    result = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", str(MULTIDEVICE / "dp_checks.py"), "-q", "-rfEs"),
            *("-p", "no:cacheprovider", "-o", "addopts=", "--basetemp", str(tmp_path / "inner")),
        ],
        cwd=ROOT,
        env=child_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAXGA_MULTIDEVICE="1"),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    summary = output.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, output


def run_processes(commands, logs, timeout):
    """Runs commands concurrently; kills all of them once one fails or time is up."""
    procs = []
    try:
        for command, log in zip(commands, logs):
            with open(log, "w") as f:
                procs.append(
                    subprocess.Popen(
                        command, cwd=ROOT, env=child_env(), stdout=f, stderr=subprocess.STDOUT
                    )
                )
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return [p.returncode for p in procs]


@pytest.mark.multidevice
def test_two_processes_match_single_process(tmp_path):
    """Two jax.distributed processes (2 CPU devices each, gloo) train like one process,
    with value_and_grad under shard_map and with make_train_step(mesh=...)."""
    script = str(MULTIDEVICE / "two_process.py")
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    outs = [tmp_path / f"process{i}.json" for i in range(2)]
    for _attempt in range(3):  # another program may take the free port before we bind it
        port = str(free_port())
        commands = [
            [sys.executable, script, str(i), "2", port, "2", str(outs[i])] for i in range(2)
        ]
        codes = run_processes(commands, logs, timeout=TIMEOUT_S / 2)
        if "Failed to add port" not in logs[0].read_text():
            break
    output = "\n".join(
        f"--- process {i} (exit {code}):\n{log.read_text()}"
        for i, (code, log) in enumerate(zip(codes, logs))
    )
    assert codes == [0, 0], output
    results = [json.loads(out.read_text()) for out in outs]
    # Both processes hold the same replicated result (each also checked it against the
    # single-process reference before exiting 0).
    for key in ("losses", "params", "train_step_losses", "train_step_params"):
        assert results[0][key] == results[1][key], output


# ----------------------------------------------------------------------------- in process


def run_docs_quick_start():
    """Runs the quick start, FSDP and HLO blocks of docs/distributed.md."""
    text = (ROOT / "docs" / "distributed.md").read_text()
    shard_map_part = text.split("## Quick start with `shard_map`")[1]  # its first three blocks
    namespace = {}
    for block in re.findall(r"```python\n(.*?)```", shard_map_part, re.S)[:3]:
        exec(block, namespace)
    return namespace


@pytest.mark.skipif(
    len(jax.devices()) < 2, reason="one device of the default backend: nothing to reduce"
)
def test_docs_quick_start_runs_and_reduces_once(capsys):
    namespace = run_docs_quick_start()
    assert np.isfinite(float(capsys.readouterr().out))
    found = namespace["found"]
    assert [(c.opcode, c.in_loop) for c in found] == [("all-reduce", False)]


def mean_loss(w, batch):
    return jaxga.Mean.of((batch["x"] @ w - batch["y"]) ** 2, where=batch["mask"])


def small_batch(rows):
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(rows, 3)).astype(np.float32),
        "y": rng.normal(size=rows).astype(np.float32),
        "mask": (rng.uniform(size=rows) > 0.3).astype(np.float32),
    }


def test_unbound_axis_name_outside_shard_map():
    vg = jaxga.value_and_grad(mean_loss, num_microbatches=2, axis_name="data")
    with pytest.raises(ValueError) as error:
        jax.jit(vg)(jnp.ones(3), small_batch(4))
    message = str(error.value)
    assert "`axis_name`='data' is not bound" in message
    assert "shard_map" in message and "jax.set_mesh" in message and "axis_name=None" in message


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_axis_name_of_the_mesh_set_with_set_mesh(axis_type):
    """Under jax.set_mesh, axis_name names the mesh axis to split the batch over (Explicit:
    reduced types; Auto: a shard_map jaxga opens) and the result is the whole batch's."""
    mesh = jax.make_mesh((1,), ("data",), axis_types=(axis_type,))
    vg = jaxga.value_and_grad(mean_loss, num_microbatches=2, axis_name="data")
    batch, w = small_batch(4), jnp.arange(3.0)
    with jax.set_mesh(mesh):
        value, grads = jax.jit(vg)(w, batch)
    expected = jax.value_and_grad(lambda w: mean_loss(w, batch).value)(w)
    np.testing.assert_allclose(value, expected[0], rtol=2e-5)
    np.testing.assert_allclose(grads, expected[1], rtol=2e-5, atol=1e-6)


def test_one_device_mesh_matches_full_batch():
    mesh = jax.make_mesh((1,), ("data",))
    batch = small_batch(8)
    vg = jaxga.value_and_grad(mean_loss, num_microbatches=4, axis_name="data")
    step = jax.jit(jax.shard_map(vg, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    w = jnp.arange(3.0)
    value, grads = step(replicate(w, mesh), shard_batch(batch, mesh))
    expected = jax.value_and_grad(lambda w: mean_loss(w, batch).value)(w)
    np.testing.assert_allclose(value, expected[0], rtol=2e-5)
    np.testing.assert_allclose(grads, expected[1], rtol=2e-5, atol=1e-6)


def test_indivisible_batch_on_one_device_names_all_numbers():
    mesh = jax.make_mesh((1,), ("data",))
    vg = jaxga.value_and_grad(mean_loss, num_microbatches=4, axis_name="data")
    step = jax.jit(jax.shard_map(vg, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    with pytest.raises(ValueError) as error:
        step(replicate(jnp.ones(3), mesh), shard_batch(small_batch(6), mesh))
    message = str(error.value)
    assert "batch size 6 (6 per device on 1 devices" in message
    assert "num_microbatches=4 × 1 devices = 4" in message


def test_shard_batch_rejects_a_scalar_leaf():
    mesh = jax.make_mesh((1,), ("data",))
    with pytest.raises(ValueError, match=r"batch\['step'\] has shape \(\); its leading axis"):
        shard_batch({"x": np.ones((2, 3)), "step": np.int32(3)}, mesh)


HLO = """HloModule m

%fused_inner (p: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  ROOT %ag = f32[2]{0} all-gather(%p), dimensions={0}
}

%body.1 (t: (s32[], f32[])) -> (s32[], f32[]) {
  %t = (s32[], f32[]) parameter(0)
  %f = f32[] fusion(%t), kind=kLoop, calls=%fused_inner
  ROOT %out = (s32[], f32[]) tuple(%t, %f)
}

%cond.1 (t: (s32[], f32[])) -> pred[] {
  %t = (s32[], f32[]) parameter(0)
  ROOT %lt = pred[] constant(true)
}

%while_wrapper (t: (s32[], f32[])) -> (s32[], f32[]) {
  %t = (s32[], f32[]) parameter(0)
  ROOT %w = (s32[], f32[]) while(%t), condition=%cond.1, body=%body.1
}

ENTRY %main (x: (s32[], f32[])) -> (f32[], f32[]) {
  %x = (s32[], f32[]) parameter(0)
  %c = (s32[], f32[]) call(%x), to_apply=%while_wrapper
  %all-reduce = f32[] get-tuple-element(%c), index=1
  %ars = (f32[], f32[]) all-reduce-start(%all-reduce), to_apply=%add
  %ard = (f32[], f32[]) all-reduce-done(%ars)
  ROOT %cp = f32[] collective-permute(%ard), source_target_pairs={{0,1}}
}
"""


def test_hlo_collectives_follows_calls_out_of_and_into_loops():
    found = [(c.opcode, c.computation, c.in_loop) for c in hlo_collectives(HLO)]
    assert found == [
        ("all-gather", "fused_inner", True),  # a fusion called from the loop body
        ("all-reduce", "main", False),  # -start counted once, -done and names ignored
        ("collective-permute", "main", False),
    ]


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda m: shard_batch(np.ones((4, 2)), "data"), TypeError, r"`mesh` must be a .*'data'"),
        (lambda m: replicate(np.ones(2), None), TypeError, r"`mesh` must be a .* got None"),
        (lambda m: shard_batch(np.ones((4, 2)), m, "model"), ValueError, r"'model' is not an axis"),
        (lambda m: jaxga.sharding.fsdp_specs({"w": jnp.ones(4)}, m, "x"), ValueError, "'x'"),
        (lambda m: jaxga.sharding.fsdp_spec((8, 4), 0), ValueError, "`size` must be a positive"),
        (lambda m: jaxga.sharding.fsdp_spec((8, 4), -1), ValueError, "`size` .* got -1"),
        (
            lambda m: jaxga.sharding.state_specs({"params": 1}, m, "fsdp"),
            TypeError,
            r"`state` must be a train state .* got dict",
        ),
    ],
)
def test_sharding_helpers_name_bad_arguments(call, error, match):
    mesh = jax.make_mesh((1,), ("data",))
    with pytest.raises(error, match=match):
        call(mesh)


def test_state_specs_none_keeps_every_array_where_it_lies():
    """strategy=None (docs/distributed.md): the layout the state's arrays already have, the
    optimiser's leaves not shaped like a parameter included (they were split over "data")."""
    mesh = jax.make_mesh((8,), ("data",))

    def init(params):
        return {"hist": jnp.zeros(8), "split": jnp.zeros(16)}

    tx = optax.GradientTransformation(init, lambda u, s, p=None: (u, s))
    state = jaxga.TrainState.create(params={"w": jnp.zeros((8, 16))}, tx=tx)
    placed = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    state = state.replace(
        params={"w": jax.device_put(state.params["w"], placed[1])},
        opt_state={
            "hist": jax.device_put(state.opt_state["hist"], placed[0]),
            "split": jax.device_put(state.opt_state["split"], placed[1]),
        },
    )
    specs = jaxga.sharding.state_specs(state, mesh, None)
    assert specs.params["w"] == P("data")
    assert specs.opt_state == {"hist": P(), "split": P("data")}


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_strategy_none_keeps_a_split_parameter_split_on_auto_and_explicit_axes(axis_type):
    """strategy=None reads each leaf's spec from the arrays before the trace (a traced
    array's type does not say how Auto axes split it): a state laid out as "fsdp" stays
    split, the step compiles "fsdp"'s collectives, and its update is the whole batch's
    (plain jax.value_and_grad and optax.adam)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    tx, params = optax.adam(0.1), {"w": jnp.arange(128.0).reshape(8, 16) / 100}
    state = jaxga.TrainState.create(params=params, tx=tx)
    state = jaxga.sharding.put(state, jaxga.sharding.state_shardings(state, mesh, "fsdp"))
    split = state.params["w"].sharding

    def loss(params, batch, model_state, rng):
        return jaxga.Mean.of(((batch @ params["w"]) ** 2).sum(-1)), model_state

    batch = jnp.arange(128.0).reshape(16, 8) / 50
    with jax.set_mesh(mesh), jax.default_matmul_precision("float32"):
        steps = {
            strategy: jaxga.make_train_step(loss, 2, mesh=mesh, strategy=strategy, donate=False)
            for strategy in (None, "fsdp")
        }
        new, metrics = steps[None](state, batch)
        again, _ = steps[None](new, batch)  # the layout it returned (and a strong `step`)
        compiled = steps[None]._jitted._cache_size()
        steps[None](again, batch)  # ... compiles no more
        ops = {
            s: sorted(c.opcode for c in hlo_collectives(step.lower(state, batch).compile()))
            for s, step in steps.items()
        }
        value, grads = jax.value_and_grad(lambda p: loss(p, batch, None, None)[0].value)(params)
        updates, _ = tx.update(grads, tx.init(params), params)
    assert new.params["w"].sharding.is_equivalent_to(split, 2)
    assert new.opt_state[0].mu["w"].sharding.is_equivalent_to(split, 2)
    assert ops[None] == ops["fsdp"] and "reduce-scatter" in ops[None]
    assert steps[None]._jitted._cache_size() == compiled
    np.testing.assert_allclose(metrics["loss"], value, rtol=1e-6)
    want = optax.apply_updates(params, updates)["w"]
    np.testing.assert_allclose(new.params["w"], want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_strategy_none_inside_your_own_jit_warns_where_auto_axes_hide_the_layout(axis_type):
    """Inside an enclosing jax.jit the step has only the state's types, which say nothing
    of Auto axes' splits: strategy=None warns there (the state comes back replicated), and
    not on Explicit axes, whose types keep the split."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    state = jaxga.TrainState.create(params={"w": jnp.ones((8, 16))}, tx=optax.sgd(0.1))
    state = jaxga.sharding.put(state, jaxga.sharding.state_shardings(state, mesh, "fsdp"))

    def loss(params, batch, model_state, rng):
        return jaxga.Mean.of(((batch @ params["w"]) ** 2).sum(-1)), model_state

    step = jaxga.make_train_step(loss, 2, mesh=mesh, strategy=None, donate=False)
    with jax.set_mesh(mesh), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new, _ = jax.jit(step)(state, jnp.ones((16, 8)))
    said = [w for w in caught if "strategy=None inside" in str(w.message)]
    assert len(said) == (axis_type == AxisType.Auto), [str(w.message) for w in said]
    assert all(w.filename == __file__ for w in said)  # the user's line, not jaxga's or JAX's
    split = new.params["w"].sharding.is_equivalent_to(state.params["w"].sharding, 2)
    assert split == (axis_type == AxisType.Explicit)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_a_batch_on_one_device_is_laid_out_on_the_mesh(axis_type):
    """A batch committed to one device (jax.device_put(batch, device)), where jit refuses
    arrays on other devices than the state's: the step puts it on the mesh and trains as
    the whole batch's jax.grad and optax.sgd; an indivisible one still gets the named error."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    params, tx = {"w": jnp.arange(32.0).reshape(8, 4) / 100}, optax.sgd(0.1)

    def loss(params, batch, model_state, rng):
        return jaxga.Mean.of(((batch["x"] @ params["w"]) ** 2).sum(-1)), model_state

    x = jnp.arange(128.0).reshape(16, 8) / 100
    step = jaxga.make_train_step(loss, 2, mesh=mesh, donate=False)
    state = jaxga.TrainState.create(params=params, tx=tx)
    with jax.set_mesh(mesh), jax.default_matmul_precision("float32"):
        new, _ = step(state, {"x": jax.device_put(x, jax.devices()[0])})
        grads = jax.grad(lambda p: loss(p, {"x": x}, None, None)[0].value)(params)
        with pytest.raises(IndivisibleBatchError, match="batch size 12"):
            step(state, {"x": jax.device_put(x[:12], jax.devices()[0])})
    want = optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])
    np.testing.assert_allclose(new.params["w"], want["w"], rtol=1e-6, atol=1e-7)
    # the mesh's devices in another order; a traced batch, left to the enclosing jit
    devices = list(mesh.devices.flat)[::-1]
    reordered = NamedSharding(jax.sharding.Mesh(np.array(devices), ("data",)), P("data"))
    with jax.set_mesh(mesh), jax.default_matmul_precision("float32"):
        again, _ = step(state, {"x": jax.device_put(x, reordered)})
        traced, _ = jax.jit(step)(state, {"x": x})
    for got in (again, traced):
        np.testing.assert_allclose(got.params["w"], want["w"], rtol=1e-6, atol=1e-7)


def test_an_nnx_step_on_a_mesh_inside_nnx_jit_takes_a_traced_batch():
    """An NNX step on a mesh called inside nnx.jit (its batch traced, left as the enclosing
    jit has it): one update of the whole batch's nnx.value_and_grad and nnx.Optimizer."""
    from flax import nnx

    mesh = jax.make_mesh((8,), ("data",))
    models = [nnx.Linear(8, 4, rngs=nnx.Rngs(0)) for _ in range(2)]
    optimizers = [nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in models]
    x = jnp.arange(128.0).reshape(16, 8) / 100

    def loss(model, batch):
        return jaxga.Mean.of((model(batch["x"]) ** 2).sum(-1))

    step = jaxga.nnx_train_step(loss, 2, mesh=mesh)
    with jax.set_mesh(mesh), jax.default_matmul_precision("float32"):
        nnx.jit(step)(models[0], optimizers[0], {"x": x})
        grads = nnx.grad(lambda m: loss(m, {"x": x}).value)(models[1])
        optimizers[1].update(models[1], grads)
    for got, want in zip(
        jax.tree.leaves(nnx.state(models[0])), jax.tree.leaves(nnx.state(models[1]))
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_state_specs_none_keeps_a_zero1_optimiser_state_split():
    """A state laid out as "zero1" (moments split over "data", parameters replicated): with
    strategy=None its moments keep their split, not the parameters' layout, and a train step
    with strategy=None returns them split."""
    mesh = jax.make_mesh((8,), ("data",))
    state = jaxga.TrainState.create(params={"w": jnp.zeros((8, 4))}, tx=optax.adam(0.1))
    state = jaxga.sharding.put(state, jaxga.sharding.state_shardings(state, mesh, "zero1"))
    split, where = state.opt_state[0].mu["w"].sharding.spec, state.opt_state[0].mu["w"].sharding
    assert split[0] == "data"
    specs = jaxga.sharding.state_specs(state, mesh, None)
    assert specs.params["w"] == P() and specs.opt_state[0].mu["w"] == split

    def loss(params, batch, model_state, rng):
        return jaxga.Mean.of((batch @ params["w"]) ** 2), model_state

    step = jaxga.make_train_step(loss, 2, mesh=mesh, strategy=None)
    new, _ = step(state, jnp.ones((16, 8)))
    assert new.opt_state[0].mu["w"].sharding.is_equivalent_to(where, 2)


def _adam_of(state, kind):
    """Adam's state inside a `multi_transform`'s ("adam" group) or an `optax.masked`'s."""
    if kind == "multi_transform":
        return state.inner_states["adam"].inner_state[0]  # optax.adam: a chain
    return state[0].inner_state


@pytest.mark.parametrize("kind", ["multi_transform", "masked"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_a_tree_of_specs_lays_out_a_state_that_leaves_parameters_out(axis_type, kind):
    """`optax.multi_transform` and `optax.masked` keep an ``optax.MaskedNode`` where Adam
    leaves a parameter out: a tree of specs still lays out Adam's moments as their
    parameter, and the step on 8 devices is `jax.grad` of the whole batch with the same optax
    update."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    params = {"w": jnp.arange(32.0).reshape(8, 4) / 32, "b": jnp.ones(4)}
    if kind == "multi_transform":
        tx = optax.multi_transform(
            {"adam": optax.adam(0.1), "sgd": optax.sgd(0.1)}, {"w": "adam", "b": "sgd"}
        )
    else:  # Adam's scaling for w alone, b's gradient as it is: sgd
        adam = optax.masked(optax.scale_by_adam(), {"w": True, "b": False})
        tx = optax.chain(adam, optax.scale(-0.1))
    state = jaxga.TrainState.create(params=params, tx=tx)
    specs = jaxga.sharding.state_specs(state, mesh, {"w": P("data"), "b": P()})
    assert _adam_of(specs.opt_state, kind).mu == {"w": P("data"), "b": optax.MaskedNode()}

    def loss(params, batch, model_state, rng):
        return jaxga.Mean.of(((batch @ params["w"]) + params["b"]) ** 2), model_state

    batch = jnp.arange(128.0).reshape(16, 8) / 128
    step = jaxga.make_train_step(loss, 2, mesh=mesh, strategy={"w": P("data"), "b": P()})
    with jax.default_matmul_precision("highest"):
        new, metrics = step(state, batch)
        value, grads = jax.value_and_grad(lambda p: jnp.mean(((batch @ p["w"]) + p["b"]) ** 2))(
            params
        )
        updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(metrics["loss"], value, rtol=1e-6)
    for got, want in zip(
        jax.tree.leaves(new.params), jax.tree.leaves(optax.apply_updates(params, updates))
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    split = _adam_of(new.opt_state, kind).mu["w"].sharding
    assert split.is_equivalent_to(NamedSharding(mesh, P("data")), 2)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_a_tree_of_specs_replicates_the_factored_moments_of_a_parameter(axis_type):
    """Adafactor's factored moments of a parameter (its rows', its columns') are not shaped
    as it: replicated (the parameter's spec would not fit them), and the step on 8 devices
    is `jax.grad` of the whole batch with the same optax update. A state optax cannot map
    (L-BFGS's) is named."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    params = {"w": jnp.arange(128 * 256.0).reshape(128, 256) / 1e5, "b": jnp.zeros(256)}
    specs = {"w": P(None, "data"), "b": P()}
    tx = optax.adafactor(1e-2)
    state = jaxga.TrainState.create(params=params, tx=tx)
    laid_out = jaxga.sharding.state_specs(state, mesh, specs).opt_state[0]
    assert laid_out.v_row["w"] == laid_out.v_col["w"] == P() and laid_out.v["b"] == P()

    def loss(params, batch, model_state, rng):
        return jaxga.Mean.of(((batch @ params["w"]) + params["b"]) ** 2), model_state

    batch = jnp.arange(16 * 128.0).reshape(16, 128) / 1e3
    step = jaxga.make_train_step(loss, 2, mesh=mesh, strategy=specs)
    with jax.default_matmul_precision("highest"):
        new, _ = step(state, batch)
        grads = jax.grad(lambda p: jnp.mean(((batch @ p["w"]) + p["b"]) ** 2))(params)
        updates, _ = tx.update(grads, tx.init(params), params)
    for got, want in zip(
        jax.tree.leaves(new.params), jax.tree.leaves(optax.apply_updates(params, updates))
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    lbfgs = jaxga.TrainState.create(params=params, tx=optax.lbfgs())
    with pytest.raises(ValueError, match=r"`strategy`, a tree of specs, .*tree_map_params cannot"):
        jaxga.sharding.state_specs(lbfgs, mesh, specs)
