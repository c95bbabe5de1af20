"""The planner's streaming lever (issue 48): `jaxga.plan(stream=...)` tries every resident
candidate before a streamed one, `make_train_step(loss, "auto", stream="auto")` plans the
step resident when it fits, and a report counts the bytes a step moves between host and
device memory. The plan that picks streaming on a described GPU, whose compiler counts host
memory apart, is in tests/test_biggest_model.py."""

import functools
import itertools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxga
from jaxga.memory import program_counts
from jaxga.planner import InfeasibleBudgetError
from tests.test_streaming import (
    HOST,
    Stack,
    assert_equal,
    batch_of,
    kinds,
    model_params,
    nnx_loss,
    optimizer,
    step_loss,
    streamed,
)

# ------------------------------------------------------------------ jaxga.plan(stream=...)

STREAMS = (False, True, "layers")
PEAKS = {  # a compiled peak for each (stream, k): streaming smaller, fewer k larger
    (False, 1): 900, (False, 2): 800, (False, 4): 700,
    (True, 1): 650, (True, 2): 600, (True, 4): 560,
    ("layers", 1): 300, ("layers", 2): 250, ("layers", 4): 200,
}  # fmt: skip


def fake_plan(budget, exhaustive):
    """jaxga.plan over (stream, k) whose peaks are ``PEAKS``: the chosen (stream, k), None
    if none fits, and the candidates built, in order."""
    batch = jax.ShapeDtypeStruct((4, 1), jnp.float32)

    def build(k, remat, stream):
        return lambda: (stream, k)

    def report(step, *args):
        return jaxga.MemoryReport(0, 0, 0, 0, PEAKS[step()], 0, 0, True, "fake")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jaxga.planner, "memory_report", report)
        try:
            p = jaxga.plan(
                build, batch, budget=budget, remat=(None,), stream=STREAMS, exhaustive=exhaustive
            )
        except InfeasibleBudgetError as e:
            return None, [(c.stream, c.num_microbatches) for c in e.candidates]
    return (p.stream, p.num_microbatches), [(c.stream, c.num_microbatches) for c in p.candidates]


def first_fit(budget):
    """The reference: every k of one stream value, in turn, before the next value."""
    order = list(itertools.product(STREAMS, (1, 2, 4)))
    return next((config for config in order if PEAKS[config] <= budget), None), order


@pytest.mark.parametrize("exhaustive", [False, True])
def test_plan_tries_every_resident_candidate_before_a_streamed_one(exhaustive):
    for budget in sorted({b for peak in PEAKS.values() for b in (peak - 1, peak, 10**4)}):
        chosen, built = fake_plan(budget, exhaustive)
        want, order = first_fit(budget)
        assert chosen == want, budget
        stop = len(order) if exhaustive or want is None else order.index(want) + 1
        assert built == order[:stop], budget


def test_plan_refuses_a_stream_value_it_does_not_take():
    def build(k, remat, stream):
        return jax.jit(lambda x: x)

    x = jnp.ones((4, 1))
    with pytest.raises(TypeError, match=r"`stream` values must be False, True or 'layers'"):
        jaxga.plan(build, x, budget="1GiB", stream=(False, "yes"))
    with pytest.raises(ValueError, match=r"`search`='predict' needs one configuration per count"):
        jaxga.plan(build, x, budget="1GiB", remat=(None,), stream=STREAMS, search="predict")
    with pytest.raises(
        ValueError, match=r'`stream`="auto" needs num_microbatches="auto"; got num_microbatches=2'
    ):
        jaxga.make_train_step(
            functools.partial(step_loss, stream=True, policy=None), 2, stream="auto"
        )


# ------------------------------------------------------------------ bytes moved


def test_program_counts_each_copy_between_memories_once_per_loop_iteration():
    stack = jax.device_put(jnp.ones((5, 3, 2)), HOST)  # 5 layers of 24 bytes

    def run(stack, flag):
        def body(total, layer):  # each layer fetched, and written back doubled
            on_device = jax.device_put(layer, jax.memory.Space.Device)
            return total + on_device.sum(), jax.device_put(2 * on_device, jax.memory.Space.Host)

        total, doubled = jax.lax.scan(body, 0.0, stack)
        fetched = jax.lax.cond(  # one branch runs: the costlier counted
            flag,
            lambda: jax.device_put(doubled, jax.memory.Space.Device),
            lambda: jnp.zeros(stack.shape),
        )
        return total, fetched

    counts = program_counts(jax.make_jaxpr(run)(stack, True))
    assert counts.moved_bytes == 5 * (24 + 24) + 5 * 24  # the loop's both ways, the fetch
    assert counts.exact
    report = jaxga.memory_report(run, stack, True)
    assert report.moved_bytes == counts.moved_bytes


@pytest.mark.parametrize("k", [1, 4])
def test_a_streamed_step_moves_four_stacks_and_a_layer_per_micro_batch_and_six_once(k):
    """stream=True, per micro-batch: the layer fetched forward and backward, and the sum
    fetched and written back with the layer's gradient added in the backward pass (4
    stacks; the gradient itself never goes home), and one layer more (the backward pass's
    last prefetch, with no layer left to use it); once a step: the sums' zeros, the
    division (fetched, written) and the update's parameters and gradient fetched and
    parameters written (6)."""
    state = streamed(jaxga.TrainState.create(params=model_params(), tx=optimizer()))
    loss = functools.partial(step_loss, stream=True, policy="full")
    step = jaxga.make_train_step(loss, k, stream=True)
    leaves = jax.tree.leaves(state.params["layers"])
    stack, layer = sum(x.nbytes for x in leaves), sum(x[0].nbytes for x in leaves)
    moved = jaxga.memory_report(step, state, batch_of(0)).moved_bytes
    assert moved == (4 * k + 6) * stack + k * layer
    resident = jaxga.make_train_step(functools.partial(step_loss, stream=False, policy="full"), k)
    plain = jaxga.TrainState.create(params=model_params(), tx=optimizer())
    assert jaxga.memory_report(resident, plain, batch_of(0)).moved_bytes == 0


# ------------------------------------------------------------------ make_train_step "auto"


def test_auto_stream_plans_resident_when_it_fits_and_fetches_the_stack_for_good():
    loss = functools.partial(step_loss, stream=True, policy="full")
    step = jaxga.make_train_step(loss, "auto", stream="auto", memory_budget="1GiB")
    state = streamed(jaxga.TrainState.create(params=model_params(), tx=optimizer()))
    with jax.default_matmul_precision("highest"):
        state, metrics = step(state, batch_of(0))
        plan = step.plan
        state, metrics = step(state, batch_of(1))
        k = plan.num_microbatches
        fixed = jaxga.make_train_step(functools.partial(step_loss, stream=False, policy="full"), k)
        resident = jaxga.TrainState.create(params=model_params(), tx=optimizer())
        for i in range(2):
            resident, resident_metrics = fixed(resident, batch_of(i))
    assert plan.stream is False and {c.stream for c in plan.candidates} == {False}
    assert step.plan is plan  # the second call, on the device, kept the first call's plan
    assert kinds(state.params) == {"device"}
    assert_equal((state.params, state.opt_state), (resident.params, resident.opt_state))
    assert_equal(metrics, resident_metrics)
    np.testing.assert_array_equal(metrics["count"], resident_metrics["count"])


def test_auto_stream_plans_an_nnx_model_resident_and_fetches_its_blocks_in_place():
    def trained(k, stream):
        model = Stack(nnx.Rngs(0), stream=True)  # its loss streams: resident, as the scan
        opt = nnx.Optimizer(model, optimizer(), wrt=nnx.Param)
        if stream:
            nnx.update(model.blocks, jax.device_put(nnx.state(model.blocks), HOST))
        budget = {"memory_budget": "1GiB"} if k == "auto" else {}
        step = jaxga.nnx_train_step(nnx_loss, k, stream=stream, **budget)
        for i in range(2):
            metrics = step(model, opt, batch_of(i))
        return step, model, opt, metrics

    with jax.default_matmul_precision("highest"):
        step, model, opt, metrics = trained("auto", "auto")
        _, resident, resident_opt, resident_metrics = trained(step.plan.num_microbatches, False)
    assert step.plan.stream is False and {c.stream for c in step.plan.candidates} == {False}
    assert kinds(nnx.state(model)) == {"device"}
    assert_equal(nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(resident)))
    assert_equal(nnx.as_pure(opt.opt_state), nnx.as_pure(resident_opt.opt_state))
    assert_equal(metrics, resident_metrics)


def test_a_plan_of_shape_structs_in_host_memory_compiles_the_step_streamed():
    """A `jax.ShapeDtypeStruct` placed in host memory by a `SingleDeviceSharding` is planned
    where it lies: the plan's report counts what the concrete step moves."""
    state = streamed(jaxga.TrainState.create(params=model_params(), tx=optimizer()))
    loss = functools.partial(step_loss, stream=True, policy="full")
    concrete = jaxga.memory_report(jaxga.make_train_step(loss, 2, stream=True), state, batch_of(0))
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    assert kinds(shapes.params["layers"]) == {"pinned_host"}

    def build(k, remat, stream):
        return jaxga.make_train_step(loss, k, stream=stream)

    plan = jaxga.plan(build, shapes, batch_of(0), budget="1GiB", num_microbatches=2, stream=(True,))
    assert concrete.moved_bytes > 0 and plan.report.moved_bytes == concrete.moved_bytes


def test_tracing_an_auto_nnx_step_leaves_the_model_where_it_lies():
    model = Stack(nnx.Rngs(0), stream=True)
    opt = nnx.Optimizer(model, optimizer(), wrt=nnx.Param)
    nnx.update(model.blocks, jax.device_put(nnx.state(model.blocks), HOST))
    step = jaxga.nnx_train_step(nnx_loss, "auto", stream="auto", memory_budget="1GiB")
    step.lower(model, opt, batch_of(0))
    assert step.plan.stream is False
    assert kinds(nnx.state(model.blocks)) == {"pinned_host"}


@pytest.mark.parametrize("stream", [True, "layers"])
def test_a_streamed_call_that_counts_nothing_keeps_the_state(stream):
    """Every token masked: the update is skipped (a select, leaf by leaf or a layer at a
    time), the parameters and moments bit for bit as they were, and where they were."""
    loss = functools.partial(step_loss, stream=True, policy="full")
    step = jaxga.make_train_step(loss, 2, stream=stream, offload=True)
    state = streamed(jaxga.TrainState.create(params=model_params(), tx=optimizer()))
    state, _ = step(state, batch_of(0))
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    masked = batch_of(1) | {"mask": jnp.zeros_like(batch_of(1)["mask"])}
    state, metrics = step(state, masked)
    assert not bool(metrics["applied"]) and int(metrics["count"]) == 0
    assert_equal((state.params, state.opt_state), before)
    assert kinds(state.params["layers"]) == {"pinned_host"}
    assert kinds(state.opt_state) == {"pinned_host"}


def test_an_auto_step_with_offload_plans_once_for_the_state_it_returns(caplog):
    """The first call's optimiser state on the device, the next calls' in host memory (as
    the step returns it): one plan serves them all."""
    loss = functools.partial(step_loss, stream=False, policy="full")
    step = jaxga.make_train_step(loss, "auto", memory_budget="1GiB", offload=True)
    state = jaxga.TrainState.create(params=model_params(), tx=optimizer())
    with caplog.at_level(logging.INFO, logger="jaxga"):
        for i in range(3):
            state, _ = step(state, batch_of(i))
    planned = [r for r in caplog.records if "jaxga: planned" in r.getMessage()]
    assert len(planned) == 1 and kinds(state.opt_state) == {"pinned_host"}


def test_the_update_by_layer_refuses_a_tx_that_changes_a_stack_dtype():
    def init(params):
        return {"m": jax.tree.map(jnp.zeros_like, params)}

    def update(grads, state, params=None):
        m = jax.tree.map(lambda m, g: (m + g).astype(jnp.bfloat16), state["m"], grads)
        return grads, {"m": m}

    loss = functools.partial(step_loss, stream=True, policy="full")
    step = jaxga.make_train_step(loss, 2, stream="layers")
    state = streamed(
        jaxga.TrainState.create(
            params=model_params(), tx=optax.GradientTransformation(init, update)
        )
    )
    with pytest.raises(ValueError, match=r"changes a stack's dtype from float32 to bfloat16"):
        step(state, batch_of(0))


def test_the_lent_gpu_streaming_benchmark_runs_and_its_steps_agree():
    """benchmarks/streaming_step.py --quick (the script a lent GPU runs, here on CPU): every
    method trains from the same state, each step's loss after one update the resident
    step's (to float rounding: other programs, which a GPU may fuse otherwise; bit for bit
    on CPU in tests/test_streaming.py), and the bytes moved are counted, none resident."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import streaming_step

    rows = {row.method: row for row in streaming_step.main(["--quick"])}
    assert list(rows) == list(streaming_step.METHODS)
    resident = rows["resident"]
    assert resident.moved_bytes == 0 and rows["streaming"].moved_bytes > 0
    for method in ("offload=True", "streaming", "streaming, no prefetch"):  # other programs:
        np.testing.assert_allclose(rows[method].second_loss, resident.second_loss, rtol=1e-6)
    assert all(row.seconds > 0 and row.modelled_s > 0 for row in rows.values())
