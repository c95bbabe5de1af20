"""Optimiser state in host memory (`offload=True`), host bytes counted apart, and plan's
search over micro-batches × strategy × remat × offload on 8 CPU devices."""

import functools
import itertools
import logging
import operator

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxga
from jaxga import layouts
from jaxga.remat import remat_options

MESH = jax.make_mesh((8,), ("data",))
LAYOUTS = [(None, "data_parallel")] + [(MESH, s) for s in jaxga.sharding.STRATEGIES]
STRATEGY_IDS = [f"8-devices-{s}" for s in jaxga.sharding.STRATEGIES]
OPTIMIZERS = {
    "adam": lambda: optax.adam(0.05),
    "jaxga.MultiSteps": lambda: jaxga.MultiSteps(optax.adam(0.05), 2),
    "optax.MultiSteps": lambda: optax.MultiSteps(optax.adam(0.05), 2),
}


def loss(params, batch, model_state, rng):
    h = jnp.tanh(batch["x"] @ params["a"]) @ params["b"]
    return jaxga.Mean.of(jnp.square(h - batch["y"])), model_state


def make_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"a": jax.random.normal(k1, (8, 32)), "b": jax.random.normal(k2, (32, 2))}


def make_batch(step):
    x = jax.random.normal(jax.random.key(step + 1), (32, 8))
    return {"x": x, "y": jnp.sin(x[:, :2])}


def host_arrays(tree):
    """numpy copies: arrays in host memory cannot meet device arrays in one jnp op."""
    return jax.tree.map(np.asarray, tree)


def kinds(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): x.sharding.memory_kind for p, x in leaves}


def train(tx, mesh, strategy, offload, steps=3, state=None, start=0):
    step = jaxga.make_train_step(loss, 2, mesh=mesh, strategy=strategy, offload=offload)
    state = state or jaxga.TrainState.create(params=make_params(), tx=tx)
    for i in range(start, steps):
        state, _ = step(state, make_batch(i))
    return state


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("mesh, strategy", LAYOUTS, ids=["one-device", *STRATEGY_IDS])
def test_offload_is_bit_exact_and_keeps_the_inner_state_on_the_host(
    name, mesh, strategy, monkeypatch
):
    reference = train(OPTIMIZERS[name](), mesh, strategy, offload=False)
    state = train(OPTIMIZERS[name](), mesh, strategy, offload=True)
    chex.assert_trees_all_equal(
        host_arrays((state.params, state.opt_state)),
        host_arrays((reference.params, reference.opt_state)),
    )
    assert set(kinds(state.params).values()) == {"device"}
    for path, kind in kinds(state.opt_state).items():  # a MultiSteps' accumulator stays
        on_host = "inner_opt_state" in path or "MultiSteps" not in name
        assert kind == ("pinned_host" if on_host else "device"), (path, kind)
    if mesh is not None:  # each device holds its shard, as without offload

        def specs(tree):
            return [x.sharding.spec for x in jax.tree.leaves(tree)]

        assert specs(state.opt_state) == specs(reference.opt_state)
        # the state a step returned is laid out as the next call wants: not put again
        layout = layouts.MeshLayout(mesh, "data", strategy)
        monkeypatch.setattr(layouts, "put", None)  # a call of it raises
        for laid_out, offload in ((state, True), (reference, False)):
            again = layouts.lay_out(laid_out, layout, offload_state=offload)
            assert all(map(operator.is_, jax.tree.leaves(again), jax.tree.leaves(laid_out)))


def test_offload_of_an_optimiser_without_state_moves_nothing():
    """`optax.sgd` keeps no state: `offload=True` leaves the parameters on the device (the
    rule took every leaf of a train state whose `opt_state` holds no array, and the second
    step refused its own output), and the steps equal those without offload bit for bit."""
    state = train(optax.sgd(0.05), None, "data_parallel", offload=True)
    assert set(kinds(state.params).values()) == {"device"}
    expected = train(optax.sgd(0.05), None, "data_parallel", offload=False)
    chex.assert_trees_all_equal(host_arrays(state.params), host_arrays(expected.params))


def test_offload_keeps_the_leaves_keep_names_and_refuses_a_keep_of_another_shape():
    state = jaxga.TrainState.create(params={"w": jnp.ones(3), "b": jnp.ones(2)}, tx=optax.adam(0.1))
    keep = jax.tree.map(lambda x: False, state)
    keep = keep.replace(
        opt_state=(keep.opt_state[0]._replace(mu={"w": True, "b": False}), *keep.opt_state[1:])
    )
    moved = jaxga.sharding.offload(state, keep=keep)
    kinds = jax.tree.map(lambda x: x.sharding.memory_kind, moved.opt_state[0])
    assert kinds.mu == {"w": "device", "b": "pinned_host"}
    assert kinds.nu == {"w": "pinned_host", "b": "pinned_host"}
    assert moved.params["w"].sharding.memory_kind == "device"
    chex.assert_trees_all_equal(jaxga.sharding.offload(moved, "device"), state)
    message = r"`keep` has another structure than `state` \(leaves: 1 against 9\); expected a bool"
    with pytest.raises(ValueError, match=message):
        jaxga.sharding.offload(state, keep={"w": True})


def test_nnx_offload_of_an_optimiser_without_state_is_refused():
    """NNX: an `nnx.Optimizer` over `optax.sgd` has no state to offload; `offload=True` says
    so, naming the argument (its rule would otherwise take the model's variables)."""
    model = nnx.Linear(8, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)

    def nnx_loss(model, batch):
        return jaxga.Mean.of(jnp.square(model(batch["x"]) - batch["y"]))

    step = jaxga.nnx_train_step(nnx_loss, 2, offload=True)
    with pytest.raises(ValueError, match=r"`offload`=True has nothing to offload.*offload=False"):
        step(model, optimizer, make_batch(0))
    assert model.kernel.get_value().sharding.memory_kind == "device"


def test_offload_compiles_the_step_once(caplog):
    step = jaxga.make_train_step(loss, 2, offload=True)
    state = jaxga.TrainState.create(params=make_params(), tx=optax.adam(0.1))
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        for i in range(3):
            state, _ = step(state, make_batch(i))
    compiled = [r for r in caplog.records if r.message.startswith("Compiling jit(train_step) ")]
    assert len(compiled) == 1, [r.message for r in compiled]


def test_nnx_train_step_offload_compiles_once(caplog):
    model = nnx.Linear(8, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)

    def lossfn(m, b):
        return jaxga.Mean.of(jnp.square(m(b["x"]) - b["y"]))

    step = jaxga.nnx_train_step(lossfn, 4, offload=True)
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        for i in range(3):
            step(model, optimizer, make_batch(i))
    compiled = [r for r in caplog.records if r.message.startswith("Compiling jit(train_step) ")]
    assert len(compiled) == 1, [r.message for r in compiled]


def test_offload_moves_everything_but_a_multisteps_accumulator():
    """Adam before a MultiSteps in a chain goes to the host too; a bare optimiser state (no
    `opt_state` key) moves whole; back to the device with "device"."""
    tx = optax.chain(optax.scale_by_adam(), jaxga.MultiSteps(optax.sgd(0.1, momentum=0.9), 2))
    state = jaxga.sharding.offload(jaxga.TrainState.create(params=make_params(), tx=tx))
    adam, multisteps = state.opt_state
    assert set(kinds(adam).values()) == {"pinned_host"}
    assert set(kinds(multisteps.inner_opt_state).values()) == {"pinned_host"}
    assert set(kinds(multisteps.acc_grads).values()) == {"device"}
    assert set(kinds(state.params).values()) == {"device"}
    bare = jaxga.sharding.offload(optax.adam(0.1).init(make_params()))
    assert set(kinds(bare).values()) == {"pinned_host"}
    back = jaxga.sharding.offload(bare, "device")
    assert set(kinds(back).values()) == {"device"}
    chex.assert_trees_all_equal(host_arrays(back), host_arrays(bare))


def test_a_step_without_offload_names_an_offloaded_state():
    state = train(optax.adam(0.05), None, "data_parallel", offload=True, steps=1)
    step = jaxga.make_train_step(loss, 2)
    with pytest.raises(ValueError, match=r"is in host memory \(pinned_host\): pass offload=True"):
        step(state, make_batch(1))
    resumed, _ = step(jaxga.sharding.offload(state, "device"), make_batch(1))
    expected = train(optax.adam(0.05), None, "data_parallel", offload=False, steps=2)
    chex.assert_trees_all_equal(host_arrays(resumed.params), host_arrays(expected.params))


def test_nnx_train_step_offload_is_bit_exact():
    def run(offload):
        model = nnx.Linear(8, 2, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, jaxga.MultiSteps(optax.adam(0.1), 2), wrt=nnx.Param)

        def lossfn(m, b):
            return jaxga.Mean.of(jnp.square(m(b["x"]) - b["y"]))

        step = jaxga.nnx_train_step(lossfn, 4, offload=offload)
        for i in range(3):
            step(model, optimizer, make_batch(i))
        return nnx.state((model, optimizer))

    state = run(offload=True)
    chex.assert_trees_all_equal(host_arrays(state), host_arrays(run(offload=False)))
    for path, kind in kinds(state).items():
        assert kind == ("pinned_host" if "inner_opt_state" in path else "device"), path


def test_checkpoint_of_an_offloaded_state_restores_and_goes_on(tmp_path):
    """Saved after 2 steps, restored into host memory, 2 more steps: as 4 without a stop."""
    tx = optax.adam(0.05)
    state = train(tx, MESH, "zero1", offload=True, steps=2)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", state)
        checkpointer.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    assert kinds(restored.opt_state) == kinds(state.opt_state)
    assert set(kinds(restored.opt_state).values()) == {"pinned_host"}
    resumed = train(tx, MESH, "zero1", offload=True, steps=4, state=restored, start=2)
    straight = train(tx, MESH, "zero1", offload=False, steps=4)
    chex.assert_trees_all_equal(host_arrays(resumed.params), host_arrays(straight.params))
    chex.assert_trees_all_equal(host_arrays(resumed.opt_state), host_arrays(straight.opt_state))


@pytest.mark.parametrize("mesh, strategy, shards", [(None, "data_parallel", 1), (MESH, "zero1", 8)])
def test_memory_report_counts_the_offloaded_state_as_host_bytes(mesh, strategy, shards):
    state = jaxga.TrainState.create(params=make_params(), tx=optax.adam(0.1))
    adam = sum(x.nbytes for x in jax.tree.leaves(state.opt_state[0]))  # count, mu, nu
    reports = {
        offload: jaxga.memory_report(
            jaxga.make_train_step(loss, 2, mesh=mesh, strategy=strategy, offload=offload),
            state,
            make_batch(0),
        )
        for offload in (False, True)
    }
    # the count is one scalar on every device; mu and nu are split over `shards` devices
    expected = 4 + (adam - 4) // shards
    assert reports[False].host_bytes == 0
    assert reports[True].host_bytes == expected
    assert reports[False].peak_bytes - reports[True].peak_bytes == expected


def test_offload_arguments_are_checked():
    with pytest.raises(
        ValueError, match=r"`memory_kind` must be 'pinned_host' or 'device'; got 'host'"
    ):
        jaxga.sharding.offload({"opt_state": jnp.ones(2)}, "host")
    expected = r"must be a bool or a function of \(path, leaf\)"
    with pytest.raises(TypeError, match=rf"`offload` {expected}; got 'yes'"):
        jaxga.make_train_step(loss, 2, offload="yes")
    with pytest.raises(TypeError, match=rf"`offload` {expected}; got 1"):
        jaxga.nnx_train_step(lambda m, b: 0.0, 2, offload=1)
    with pytest.raises(TypeError, match=rf"`select` {expected}; got 'all'"):
        jaxga.sharding.offload({"opt_state": jnp.ones(2)}, select="all")


def test_offload_takes_a_function_picking_the_leaves():
    """offload=select(path, leaf): Adam's first moment alone in host memory, the second on
    the device; bit-exact with the state kept on the device."""

    def first_moment(path, leaf):
        return "mu" in jax.tree_util.keystr(path)

    reference = train(optax.adam(0.05), None, "data_parallel", offload=False)
    state = train(optax.adam(0.05), None, "data_parallel", offload=first_moment)
    assert set(kinds(state.opt_state[0].mu).values()) == {"pinned_host"}
    assert set(kinds(state.opt_state[0].nu).values()) == {"device"}
    assert set(kinds(state.params).values()) == {"device"}
    fields = (state.params, state.opt_state)
    chex.assert_trees_all_equal(
        host_arrays(fields), host_arrays((reference.params, reference.opt_state))
    )
    moved = jaxga.sharding.offload(reference, select=first_moment)
    assert set(kinds(moved.opt_state[0].mu).values()) == {"pinned_host"}
    assert set(kinds(jaxga.sharding.offload(reference, select=False)).values()) == {"device"}


# --------------------------------------------------------------------------- plan

DIM, LAYERS = 64, 4
STRATEGIES = jaxga.sharding.STRATEGIES
REMATS = ("none", "full")


@functools.cache
def build(k, remat, strategy="data_parallel", offload=False):
    def scanned(params, batch, model_state, rng):
        def layer(w, x):
            return jnp.tanh(x @ w)

        y = jaxga.remat_scan(layer, params["w"], batch["x"], **remat_options(remat))
        return jaxga.Mean.of(jnp.square(y - batch["y"])), model_state

    return jaxga.make_train_step(scanned, k, mesh=MESH, strategy=strategy, offload=offload)


STATE = jax.eval_shape(
    lambda: jaxga.TrainState.create(params={"w": jnp.zeros((LAYERS, DIM, DIM))}, tx=optax.adam(1))
)
BATCH = {"x": jax.ShapeDtypeStruct((128, DIM), jnp.float32)}
BATCH["y"] = BATCH["x"]
COUNTS = (1, 4, 16)  # three counts, each of 16 configurations: 48 compiles in `peaks`
ORDER = list(itertools.product(COUNTS, STRATEGIES, REMATS, (False, True)))


@pytest.fixture(scope="module")
def peaks():
    """Every candidate's compiled peak per device, by an exhaustive loop in the documented
    order: fewest micro-batches, then least communication, recomputation, host traffic."""
    return {
        (k, s, r, o): jaxga.memory_report(build(k, r, s, o), STATE, BATCH).peak_bytes
        for k, s, r, o in ORDER
    }


def search(budget, exhaustive=False):
    return jaxga.plan(
        build,
        STATE,
        BATCH,
        budget=budget,
        num_microbatches=COUNTS,
        remat=REMATS,
        strategy=STRATEGIES,
        offload=(False, True),
        exhaustive=exhaustive,
    )


def test_plan_picks_the_first_fit_of_an_exhaustive_search(peaks):
    values = sorted(set(peaks.values()))
    for budget in values[:: max(1, len(values) // 6)]:
        first = next(c for c in ORDER if peaks[c] <= budget)
        p = search(budget)
        assert (p.num_microbatches, p.strategy, p.remat, p.offload) == first, budget
        assert p.report.peak_bytes == peaks[first] <= budget
        rejected = p.candidates[:-1]
        assert [(c.num_microbatches, c.strategy, c.remat, c.offload) for c in rejected] == ORDER[
            : len(rejected)
        ]
        for c in rejected:
            assert c.reason == "over the budget" and c.report.peak_bytes > budget, c
        assert p.num_skipped == len(ORDER) - len(p.candidates)
        assert "verdict" in str(p) and (not rejected or "over the budget" in str(p))


def test_plan_offload_lowers_the_device_peak_by_the_host_bytes(peaks):
    for k, s, r in itertools.product((1, 4), STRATEGIES, REMATS):
        saved = peaks[k, s, r, False] - peaks[k, s, r, True]
        host = jaxga.memory_report(build(k, r, s, True), STATE, BATCH).host_bytes
        assert saved == host > 0, (k, s, r)


def test_plan_exhaustive_builds_every_candidate_and_keeps_the_first_fit(peaks):
    budget = sorted(peaks.values())[len(peaks) // 2]
    first = next(c for c in ORDER if peaks[c] <= budget)
    p = search(budget, exhaustive=True)
    assert (p.num_microbatches, p.strategy, p.remat, p.offload) == first and p.num_skipped == 0
    for c in p.candidates:
        assert c.report.peak_bytes == peaks[c.num_microbatches, c.strategy, c.remat, c.offload]
    later = [c for c in p.candidates if c.fits and c.reason]
    assert later and all(c.reason == "fits; an earlier one is the choice" for c in later)


def test_plan_says_why_a_count_the_devices_do_not_divide_was_rejected():
    with pytest.raises(jaxga.planner.InfeasibleBudgetError) as info:
        jaxga.plan(build, STATE, BATCH, budget=1, remat=("none",), strategy="zero1")
    indivisible = [c for c in info.value.candidates if c.report is None]
    # 128 rows, 16 per device: 32, 64 and 128 micro-batches are each tried once
    assert [c.num_microbatches for c in indivisible] == [32, 64, 128]
    assert "not divisible by num_microbatches=32 × 8 devices" in indivisible[0].reason


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"strategy": ("zero2",)}, ValueError, r"`strategy` must be one of 'data_parallel'"),
        ({"strategy": ()}, ValueError, r"`strategy` must hold at least one value; got \(\)"),
        ({"offload": (0,)}, TypeError, r"`offload` must be a bool; got 0"),
    ],
)
def test_plan_checks_its_search_axes(kwargs, error, message):
    with pytest.raises(error, match=message):
        jaxga.plan(build, STATE, BATCH, budget="1GiB", **kwargs)


def test_plan_takes_a_tree_of_specs_as_one_strategy():
    specs = {"w": jax.sharding.PartitionSpec(None, None, "data")}
    p = jaxga.plan(build.__wrapped__, STATE, BATCH, budget="1GiB", num_microbatches=1, remat="none",
                   strategy=specs, offload=False)  # fmt: skip
    assert p.strategy == specs and len(p.candidates) == 1


def test_plan_needs_a_build_that_takes_the_searched_keywords():
    expected = r"`build` must be callable as build\(num_microbatches, remat, strategy=\.\.\., "
    with pytest.raises(TypeError, match=expected + r"offload=\.\.\.\) -> step; it takes \(k, r\)"):
        jaxga.plan(lambda k, r: None, STATE, BATCH, budget="1GiB", strategy="fsdp", offload=True)
