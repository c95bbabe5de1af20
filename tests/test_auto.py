"""num_microbatches="auto": the step plans the fewest micro-batches whose compiled peak fits
a memory budget, before its first call and for each new shape, and is then the explicit-k
step, bit for bit."""

import logging

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxga
from jaxga.planner import InfeasibleBudgetError

BATCH = 64


def loss(params, batch, model_state, rng):
    h = jnp.tanh(batch["x"] @ params["w1"])  # the activations a smaller micro-batch shrinks
    return jaxga.Mean.of((h @ params["w2"] - batch["y"]) ** 2), model_state


def make_state(tx=None):
    params = {"w1": jnp.full((16, 2048), 0.01), "w2": jnp.full((2048, 4), 0.01)}
    return jaxga.TrainState.create(params=params, tx=tx or optax.adam(1e-2))


def make_batch(i, rows=BATCH):
    kx, ky = jax.random.split(jax.random.key(i))
    return {"x": jax.random.normal(kx, (rows, 16)), "y": jax.random.normal(ky, (rows, 4))}


def explicit_peaks(state, batch, **options):
    """The compiled peak of each explicit-k step: the independent reference."""
    ks = [k for k in range(1, BATCH + 1) if BATCH % k == 0]
    steps = {k: jaxga.make_train_step(loss, k, **options) for k in ks}
    return {k: jaxga.memory_report(step, state, batch).peak_bytes for k, step in steps.items()}


@pytest.mark.parametrize("target", [1, 2, 4, 8])
def test_the_fewest_count_that_fits_is_chosen_and_trains_as_it(target):
    state, batch = make_state(), make_batch(0)
    peaks = explicit_peaks(state, batch)
    budget = peaks[target]
    expected = min(k for k, peak in peaks.items() if peak <= budget)
    assert expected == target  # the peak falls as k grows, at these shapes
    step = jaxga.make_train_step(loss, "auto", memory_budget=budget)
    explicit = jaxga.make_train_step(loss, target)
    ours, theirs = state, make_state()
    for i in range(3):
        ours, metrics = step(ours, make_batch(i))
        theirs, expected_metrics = explicit(theirs, make_batch(i))
    assert step.plan.num_microbatches == target and step.plan.report.peak_bytes <= budget
    chex.assert_trees_all_equal(ours.params, theirs.params)  # bit for bit
    chex.assert_trees_all_equal(ours.opt_state, theirs.opt_state)
    chex.assert_trees_all_equal(metrics, expected_metrics)
    # compiled: the fewest count, the most, and the count a line through their peaks predicts
    built = [c.num_microbatches for c in step.plan.candidates]
    assert len(built) <= 3 and built[: 2 if target > 1 else 1] == [1, BATCH][: len(built)]
    # plan_search="ordered": the counts up to the chosen one, fewest first, and no more
    ordered = jaxga.make_train_step(loss, "auto", memory_budget=budget)
    ordered.plan_search = "ordered"
    ordered.trace(state, batch)
    assert ordered.plan.num_microbatches == target
    assert [c.num_microbatches for c in ordered.plan.candidates] == [
        k for k in peaks if k <= target
    ]


def test_a_new_batch_size_replans_and_plans_are_bounded(caplog):
    state = make_state()
    peaks = explicit_peaks(state, make_batch(0), donate=False)
    step = jaxga.make_train_step(loss, "auto", memory_budget=peaks[4], donate=False)
    step.max_plans = 2
    with caplog.at_level(logging.INFO, logger="jaxga"):
        step(state, make_batch(0))
        step(state, make_batch(1))  # the same shapes: no new plan
        assert step.plan.num_microbatches == 4
        step(state, make_batch(2, rows=8))  # a last, smaller batch gets its own plan
        assert step.plan.batch_size == 8 and step.plan.num_microbatches == 1
        step(state, make_batch(3, rows=16))
        step(state, make_batch(4))  # evicted by the two before: planned again
    planned = [r.getMessage() for r in caplog.records if "jaxga: planned" in r.getMessage()]
    assert len(planned) == 4, planned
    assert "4 micro-batch(es) of 16 rows for a batch of 64" in planned[0]


def test_works_with_a_multisteps_and_an_nnx_step():
    tx = jaxga.MultiSteps(optax.sgd(0.1), every_k=2)
    state = make_state(tx)
    peaks = explicit_peaks(make_state(), make_batch(0))
    step = jaxga.make_train_step(loss, "auto", memory_budget=peaks[2])
    explicit = jaxga.make_train_step(loss, 2)
    ours, theirs = state, make_state(tx)
    for i in range(2):
        ours, _ = step(ours, make_batch(i))
        theirs, _ = explicit(theirs, make_batch(i))
    chex.assert_trees_all_equal(ours.params, theirs.params)

    models = [nnx.Linear(16, 4, rngs=nnx.Rngs(0)) for _ in range(2)]
    optimizers = [nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in models]

    def nnx_loss(model, batch):
        return jaxga.Mean.of((model(batch["x"]) - batch["y"]) ** 2)

    auto = jaxga.nnx_train_step(nnx_loss, "auto", memory_budget="1GiB")
    auto(models[0], optimizers[0], make_batch(0))
    jaxga.nnx_train_step(nnx_loss, 1)(models[1], optimizers[1], make_batch(0))
    assert auto.plan.num_microbatches == 1
    chex.assert_trees_all_equal(nnx.state(models[0]), nnx.state(models[1]))


def test_bad_input_is_named():
    with pytest.raises(
        ValueError, match=r"`memory_budget`=None, but .* (reports|has) no memory limit"
    ):
        jaxga.make_train_step(loss, "auto")  # a CPU reports none
    with pytest.raises(
        ValueError, match=r"`num_microbatches` must be a positive int or 'auto'; got 'Auto'"
    ):
        jaxga.make_train_step(loss, "Auto")
    with pytest.raises(
        ValueError, match=r"`num_microbatches` must be a positive int or 'auto'; got 0"
    ):
        jaxga.nnx_train_step(lambda m, b: m(b), 0)
    with pytest.raises(ValueError, match=r"`memory_budget`='lots' is not a size"):
        jaxga.make_train_step(loss, "auto", memory_budget="lots")
    with pytest.raises(ValueError, match=r"`memory_budget` needs num_microbatches=\"auto\""):
        jaxga.make_train_step(loss, 4, memory_budget="1GiB")
    step = jaxga.make_train_step(loss, "auto", memory_budget="1KiB")
    with pytest.raises(InfeasibleBudgetError, match=r"smallest peak, .* has 64 micro-batch"):
        step(make_state(), make_batch(0))
    step = jaxga.make_train_step(loss, "auto", memory_budget="1GiB")
    with pytest.raises(ValueError, match=r"cannot plan \(compile\) inside an enclosing jax.jit"):
        jax.jit(step)(make_state(), make_batch(0))
