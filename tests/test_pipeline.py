"""`jaxga.pipeline_scan` on 8 host devices against the same layers on one device.

The reference is `jaxga.remat_scan` (a plain `lax.scan` over the layers) and
`jax.value_and_grad` on the whole batch: loss and the gradient of every layer, to float32
rounding, for every schedule.
"""

import contextlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxga
from jaxga.pipeline import Schedule
from tests._hlo import hlo_collectives

L, D = 8, 6


@pytest.fixture(autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def stack(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(size=(L, D, D)).astype(np.float32) / 3,
        "b": rng.normal(size=(L, D)).astype(np.float32) / 3,
    }


def layer(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def stage_mesh(stages: int) -> jax.sharding.Mesh:
    return jax.make_mesh((stages,), ("stage",), devices=jax.devices()[:stages])


def on_stages(params, mesh, repeats=1):
    stages = mesh.shape["stage"]
    ordered = jaxga.pipeline_order(params, stages, repeats)
    return jax.device_put(ordered, NamedSharding(mesh, P("stage")))


@pytest.mark.parametrize("schedule, repeats", [("gpipe", 1), ("circular", 2)])
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("times", [1, 2, 3])  # m = S, 2S, 3S
def test_every_schedule_gives_the_layers_loss_and_gradients(schedule, repeats, stages, times):
    params, m = stack(), stages * times
    x = jax.random.normal(jax.random.key(1), (4 * m, D))

    def reference(params):
        return jnp.mean(jaxga.remat_scan(layer, params, x) ** 2)

    def loss(params):
        options = {"num_microbatches": m, "schedule": schedule, "repeats": repeats}
        return jnp.mean(jaxga.pipeline_scan(layer, params, x, **options) ** 2)

    value, grads = jax.jit(jax.value_and_grad(loss))(on_stages(params, stage_mesh(stages), repeats))
    want_value, want_grads = jax.value_and_grad(reference)(params)
    chex.assert_trees_all_close(value, want_value, rtol=1e-5)
    want_grads = jaxga.pipeline_order(want_grads, stages, repeats)  # as the stages hold them
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-4, atol=1e-6)


def test_pipeline_order_puts_each_stages_chunks_together():
    layers = jnp.arange(8)  # S = 2, r = 2: chunks of 2 layers, chunk c on stage c % 2
    ordered = jaxga.pipeline_order(layers, stages=2, repeats=2)
    assert ordered.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert jaxga.pipeline_order(layers, stages=4).tolist() == list(range(8))
    # a stack already laid out over the stages on Explicit axes (an NNX variable made under
    # jax.set_mesh): reordered, and still laid out so
    mesh = jax.make_mesh((2, 4), ("data", "stage"))
    placed = jax.device_put(layers.astype(jnp.float32), NamedSharding(mesh, P("stage")))
    with jax.set_mesh(mesh):
        again = jaxga.pipeline_order(placed, stages=4, repeats=2)
    assert again.tolist() == [0, 4, 1, 5, 2, 6, 3, 7] and again.sharding.spec == P("stage")


@pytest.mark.parametrize("repeats", [1, 2])
def test_pipeline_order_of_a_stack_laid_out_over_the_stages_gathers_nothing(repeats):
    """On Explicit axes, a stack split over the stages: r = 1 is the stack as it is; r = 2
    moves chunks between stages (an all-to-all), never the whole stack to every device (an
    all-gather); the layout is kept."""
    mesh = jax.make_mesh((2, 4), ("data", "stage"))
    placed = jax.device_put(jnp.asarray(stack()["w"]), NamedSharding(mesh, P("stage")))

    def order(w):
        return jaxga.pipeline_order(w, stages=4, repeats=repeats)

    compiled = jax.jit(order).lower(placed).compile()
    again = jax.jit(order)(placed)
    assert not [c for c in hlo_collectives(compiled) if c.opcode == "all-gather"]
    assert again.sharding.spec[0] == "stage"
    chex.assert_trees_all_equal(again, jaxga.pipeline_order(stack()["w"], 4, repeats))


def skewed_batch(rows: int = 32, seed: int = 2):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(rows, D)).astype(np.float32),
        "labels": rng.integers(0, 5, size=rows),
        # skewed token counts: a mean of micro-batch means would be wrong
        "mask": ((np.arange(rows) % 7 == 0) | (np.arange(rows) < 5)).astype(np.float32),
    }


def test_pipeline_accumulation_and_data_parallel_equal_one_whole_batch_step():
    """S = 4 stages (circular, r = 2) × k = 2 accumulation micro-batches × 2 data devices,
    in one shard_map over both axes: the whole batch's token mean and gradients; activations
    move by collective-permute, and no stage's weights are gathered."""
    mesh = jax.make_mesh((2, 4), ("data", "stage"))
    params, head = stack(), np.random.default_rng(3).normal(size=(D, 5)).astype(np.float32)
    batch = skewed_batch()

    def loss(params, head, batch):
        options = {"num_microbatches": 4, "schedule": "circular", "repeats": 2}
        h = jaxga.pipeline_scan(layer, params, batch["x"], **options)
        return jaxga.token_cross_entropy(h @ head, batch["labels"], batch["mask"])

    def reference(params, head):
        h = jaxga.remat_scan(layer, params, batch["x"])
        return jaxga.token_cross_entropy(h @ head, batch["labels"], batch["mask"]).value

    vg = jaxga.value_and_grad(loss, argnums=(0, 1), num_microbatches=2, batch_argnums=2)
    specs = (P("stage"), P(), P("data"))
    step = jax.jit(jax.shard_map(vg, mesh=mesh, in_specs=specs, out_specs=(P(), specs[:2])))
    placed = jax.device_put(
        (head, batch), (NamedSharding(mesh, P()), NamedSharding(mesh, P("data")))
    )
    args = (on_stages(params, mesh, 2), *placed)
    value, (grads, head_grad) = step(*args)
    want_value, (want_grads, want_head) = jax.value_and_grad(reference, argnums=(0, 1))(
        params, head
    )
    chex.assert_trees_all_close(value, want_value, rtol=1e-5)
    chex.assert_trees_all_close(head_grad, want_head, rtol=1e-4, atol=1e-6)
    chex.assert_trees_all_close(grads, jaxga.pipeline_order(want_grads, 4, 2), rtol=1e-4, atol=1e-6)
    hlo = step.lower(*args).compile().as_text()
    assert "collective-permute" in hlo
    assert " all-gather(" not in hlo


def test_jit_global_view_moves_activations_and_never_gathers_weights():
    mesh, x = stage_mesh(4), jax.random.normal(jax.random.key(1), (16, D))

    def loss(params):
        return jnp.mean(jaxga.pipeline_scan(layer, params, x, num_microbatches=4) ** 2)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(on_stages(stack(), mesh)).compile()
    hlo = compiled.as_text()
    assert "collective-permute" in hlo and " all-gather(" not in hlo


def test_num_real_microbatches_skips_around_a_pipeline():
    mesh, batch = stage_mesh(2), skewed_batch(16)

    def loss(params, batch):
        h = jaxga.pipeline_scan(layer, params, batch["x"], num_microbatches=2)
        return jaxga.Mean.of(jnp.sum(h**2, -1), batch["mask"])

    vg = jaxga.value_and_grad(loss, num_microbatches=4, num_real_microbatches=1)
    value, grads = jax.jit(vg)(on_stages(stack(), mesh), batch)
    first = jax.tree.map(lambda x: x[0], jaxga.split_microbatches(batch, 4))  # the one run

    def reference(params):
        h = jaxga.remat_scan(layer, params, first["x"])
        return jaxga.Mean.of(jnp.sum(h**2, -1), first["mask"]).value

    want_value, want_grads = jax.value_and_grad(reference)(stack())
    chex.assert_trees_all_close(value, want_value, rtol=1e-5)
    chex.assert_trees_all_close(grads, jaxga.pipeline_order(want_grads, 2), rtol=1e-4, atol=1e-6)


def test_bubbles_never_reach_a_value_or_a_gradient():
    """A layer that gives NaN on a zero input (the bubbles' start): still exact, finite."""

    def normalise(p, x):
        y = x @ p["w"] + p["b"]
        return y / jnp.linalg.norm(y, axis=-1, keepdims=True)

    assert jnp.isnan(normalise(jax.tree.map(lambda p: p[0] * 0, stack()), jnp.zeros((1, D)))).all()
    x = jax.random.normal(jax.random.key(1), (16, D))

    def loss(params, pipelined):
        if pipelined:
            h = jaxga.pipeline_scan(normalise, params, x, num_microbatches=8)
        else:
            h = jaxga.remat_scan(normalise, params, x)
        return jnp.mean(h[:, 0])

    mesh = stage_mesh(4)
    value, grads = jax.jit(jax.value_and_grad(loss), static_argnums=1)(
        on_stages(stack(), mesh), True
    )
    want_value, want_grads = jax.value_and_grad(loss)(stack(), False)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    chex.assert_trees_all_close(value, want_value, rtol=1e-5)
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-4, atol=1e-6)


def test_dropout_keys_differ_per_micro_batch_and_per_layer():
    """Layer l on micro-batch i draws fold_in(fold_in(rng, i), l): the Python loop's masks."""
    mesh, rng = stage_mesh(2), jax.random.key(7)
    x, m = jnp.ones((8, D)), 4

    def dropout(p, x, key):
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        return jnp.where(keep, layer(p, x), 0.0)

    got = jax.jit(
        lambda params: jaxga.pipeline_scan(dropout, params, x, num_microbatches=m, rng=rng)
    )(on_stages(stack(), mesh))
    micro = []
    for i, xi in enumerate(jaxga.split_microbatches(x, m)):
        for layer_index in range(L):
            xi = dropout(
                jax.tree.map(lambda p: p[layer_index], stack()),
                xi,
                jax.random.fold_in(jax.random.fold_in(rng, i), layer_index),
            )
        micro.append(xi)
    chex.assert_trees_all_close(got, jaxga.merge_microbatches(jnp.stack(micro)), rtol=1e-5)
    rows = jaxga.split_microbatches(got != 0, m)  # equal inputs, different masks
    assert not all(bool(jnp.array_equal(rows[0], rows[i])) for i in range(1, m))


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"num_microbatches": 2}, ValueError, r"`num_microbatches`=2; it must be at least the S=4"),
        ({"num_microbatches": 4, "schedule": "1F1B"}, ValueError, r"`schedule` must be one of"),
        (
            {"num_microbatches": 4, "repeats": 2},
            ValueError,
            r"`repeats`=2 needs schedule='circular'",
        ),
        (
            {"num_microbatches": 4, "schedule": "circular", "repeats": 3},
            ValueError,
            r"multiple of S · r layers; got L=8 layers for S=4 stages × r=3",
        ),
        (
            {"num_microbatches": 4, "axis_name": "pipe"},
            ValueError,
            r"`axis_name`='pipe' is not an axis of the mesh here \(axes \('stage',\)\)",
        ),
    ],
)
def test_bad_input_is_named(options, error, message):
    params, x = on_stages(stack(), stage_mesh(4)), jnp.ones((8, D))
    with pytest.raises(error, match=message):
        jaxga.pipeline_scan(layer, params, x, **options)


def test_a_layer_changing_the_carry_is_named():
    params, x = on_stages(stack(), stage_mesh(2)), jnp.ones((8, D))
    with pytest.raises(TypeError, match=r"`layer_fn` must return a carry like x"):
        jaxga.pipeline_scan(lambda p, x: x[:, :2], params, x, num_microbatches=2)


def head_fn(head, y, targets):
    return jaxga.token_cross_entropy(y @ head, targets["labels"], targets["mask"])


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("times", [1, 2, 3])  # m = S, 2S, 3S
def test_1f1b_gives_the_whole_batchs_loss_and_gradients(stages, times):
    params, head, m = (
        stack(),
        np.random.default_rng(3).normal(size=(D, 5)).astype(np.float32),
        stages * times,
    )
    batch = skewed_batch(4 * m)

    def loss(params, head, x):
        return jaxga.pipeline_loss(
            layer, head_fn, (params, head), x, batch, num_microbatches=m
        ).value

    def reference(params, head, x):
        return head_fn(head, jaxga.remat_scan(layer, params, x), batch).value

    args = (on_stages(params, stage_mesh(stages)), head, batch["x"])
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
    want = jax.value_and_grad(reference, argnums=(0, 1, 2))(params, head, batch["x"])
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("schedule, repeats", [("gpipe", 1), ("circular", 2), ("1f1b", 1)])
def test_pipeline_loss_accumulation_and_data_parallel_equal_one_whole_batch_step(schedule, repeats):
    """Every schedule × k = 2 accumulation micro-batches × 2 data devices, skewed tokens."""
    mesh = jax.make_mesh((2, 4), ("data", "stage"))
    params, head = stack(), np.random.default_rng(3).normal(size=(D, 5)).astype(np.float32)
    batch = skewed_batch()

    def loss(params, head, batch):
        options = {"num_microbatches": 4, "schedule": schedule, "repeats": repeats}
        return jaxga.pipeline_loss(layer, head_fn, (params, head), batch["x"], batch, **options)

    def reference(params, head):
        return head_fn(head, jaxga.remat_scan(layer, params, batch["x"]), batch).value

    vg = jaxga.value_and_grad(loss, argnums=(0, 1), num_microbatches=2, batch_argnums=2)
    specs = (P("stage"), P(), P("data"))
    step = jax.jit(jax.shard_map(vg, mesh=mesh, in_specs=specs, out_specs=(P(), specs[:2])))
    placed = jax.device_put(
        (head, batch), (NamedSharding(mesh, P()), NamedSharding(mesh, P("data")))
    )
    args = (on_stages(params, mesh, repeats), *placed)
    value, (grads, head_grad) = step(*args)
    want_value, (want_grads, want_head) = jax.value_and_grad(reference, argnums=(0, 1))(
        params, head
    )
    chex.assert_trees_all_close(value, want_value, rtol=1e-5)
    chex.assert_trees_all_close(head_grad, want_head, rtol=1e-4, atol=1e-6)
    want_grads = jaxga.pipeline_order(want_grads, 4, repeats)
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-4, atol=1e-6)
    assert " all-gather(" not in step.lower(*args).compile().as_text()


def test_1f1b_bubbles_never_reach_a_gradient_and_dropout_matches_gpipe():
    def normalise(p, x, key):  # NaN on a zero input; a dropout mask from `key`
        y = x @ p["w"] + p["b"]
        keep = jax.random.bernoulli(key, 0.8, y.shape)
        return jnp.where(keep, y / jnp.linalg.norm(y, axis=-1, keepdims=True), 0.0)

    head = np.random.default_rng(3).normal(size=(D, 5)).astype(np.float32)
    batch, rng = skewed_batch(16), jax.random.key(4)
    params = on_stages(stack(), stage_mesh(4))

    def loss(params, head, schedule):
        options = {"num_microbatches": 8, "schedule": schedule, "rng": rng}
        return jaxga.pipeline_loss(
            normalise, head_fn, (params, head), batch["x"], batch, **options
        ).value

    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(params, head, "1f1b")
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(
        params, head, "gpipe"
    )
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(got))
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-6)


def compiled_temp(schedule: str, m: int, repeats: int = 1) -> int:
    """The compiled scratch bytes of one gradient step: micro-batches of 64 rows, a wide MLP
    block per layer (activations, not the batch itself, are what a pipeline keeps)."""
    width, rows = 128, 64
    params = {"w": jnp.ones((L, width, 4 * width)), "v": jnp.ones((L, 4 * width, width))}
    head, x = jnp.ones((width, 5)), jnp.ones((rows * m, width))
    targets = {"labels": jnp.zeros(rows * m, jnp.int32), "mask": jnp.ones(rows * m)}

    def block(p, x):
        return x + jnp.tanh(x @ p["w"]) @ p["v"]

    def loss(params, head, x):
        options = {"num_microbatches": m, "schedule": schedule, "repeats": repeats}
        return jaxga.pipeline_loss(block, head_fn, (params, head), x, targets, **options).value

    args = (on_stages(params, stage_mesh(4), repeats), head, x)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_1f1b_keeps_its_compiled_peak_as_micro_batches_grow():
    """GPipe keeps every micro-batch's stage input until the backward pass; 1F1B at most
    2S - 1 of them: from m = 4 to 16, its scratch memory stays nearly flat."""
    gpipe = compiled_temp("gpipe", 16) / compiled_temp("gpipe", 4)
    one_f_one_b = compiled_temp("1f1b", 16) / compiled_temp("1f1b", 4)
    assert gpipe > 1.5 and one_f_one_b < 1.25, (gpipe, one_f_one_b)


@pytest.mark.parametrize("name, repeats", [("1f1b", 1), ("interleaved_1f1b", 2)])
@pytest.mark.parametrize("stages, times", [(2, 1), (4, 1), (4, 2), (4, 3)])
def test_a_schedule_rows_ticks_run_each_item_once_in_order_within_its_ring(
    name, repeats, stages, times
):
    """`Schedule`'s index arithmetic, tick by tick: every stage runs each (micro-batch,
    chunk) forward and backward once; a forward after the stage before it (stage 0's next
    chunk after stage S - 1's), a backward after the stage after it and after its forward;
    a stage's inputs in flight fit its ring, no slot reused before its backward; the bubble
    is the time a stage idles, lockstep ticks costing a forward and a backward."""
    plan = Schedule(stages, stages * times, repeats, name)
    m, r, last = plan.microbatches, plan.repeats, stages - 1
    done, slots = {}, {}
    for t in range(plan.ticks):
        for s in range(stages):
            for kind in ("F", "B"):
                work = (plan.forward if kind == "F" else plan.backward)(t, s)
                if not bool(work.valid):
                    continue
                i, c, slot = int(work.microbatch), int(work.chunk), int(work.slot)
                assert (kind, s, i, c) not in done
                done[kind, s, i, c] = t
                if kind == "F":
                    before = (s - 1, c) if s else (last, c - 1)
                    assert before[1] < 0 or done["F", before[0], i, before[1]] == t - 1
                    assert slots.setdefault((s, slot), (i, c)) == (i, c)
                else:
                    assert done["F", s, i, c] <= t and slots.pop((s, slot)) == (i, c)
                    after = (s + 1, c) if s < last else (0, c + 1)
                    if after[1] < r and not (s == last and c == r - 1):
                        assert done["B", after[0], i, after[1]] == t - 1
        assert all(len([k for k in slots if k[0] == s]) <= plan.ring for s in range(stages))
    assert len(done) == 2 * stages * m * r and not slots
    busy = [
        any(bool(getattr(plan, kind)(t, s).valid) for s in range(stages))
        for kind in ("forward", "backward")
        for t in range(plan.ticks)
    ]
    assert sum(busy) / 2 == m * r + stages - 1  # ticks a forward, ticks a backward, each
    assert plan.bubble == pytest.approx(1 - m * r / (m * r + stages - 1))


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("times", [1, 2])  # m = S, 2S
def test_interleaved_1f1b_with_accumulation_and_data_parallel_equals_one_device(stages, times):
    """Interleaved 1F1B (v = 2 chunks a stage) × k = 2 accumulation micro-batches × 2 data
    devices beside the S stages, skewed tokens: the whole batch's loss and gradients."""
    mesh = jax.make_mesh((2, stages), ("data", "stage"), devices=jax.devices()[: 2 * stages])
    params, head = stack(), np.random.default_rng(3).normal(size=(D, 5)).astype(np.float32)
    m = stages * times
    batch = skewed_batch(8 * m)

    def loss(params, head, batch):
        options = {"num_microbatches": m, "schedule": "interleaved_1f1b", "repeats": 2}
        return jaxga.pipeline_loss(layer, head_fn, (params, head), batch["x"], batch, **options)

    def reference(params, head):
        return head_fn(head, jaxga.remat_scan(layer, params, batch["x"]), batch).value

    vg = jaxga.value_and_grad(loss, argnums=(0, 1), num_microbatches=2, batch_argnums=2)
    specs = (P("stage"), P(), P("data"))
    step = jax.jit(jax.shard_map(vg, mesh=mesh, in_specs=specs, out_specs=(P(), specs[:2])))
    placed = jax.device_put(
        (head, batch), (NamedSharding(mesh, P()), NamedSharding(mesh, P("data")))
    )
    value, (grads, head_grad) = step(on_stages(params, mesh, 2), *placed)
    want_value, (want_grads, want_head) = jax.value_and_grad(reference, argnums=(0, 1))(
        params, head
    )
    chex.assert_trees_all_close(value, want_value, rtol=1e-5)
    chex.assert_trees_all_close(head_grad, want_head, rtol=1e-4, atol=1e-6)
    want_grads = jaxga.pipeline_order(want_grads, stages, 2)
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-4, atol=1e-6)


def test_interleaved_1f1b_in_jits_global_view_matches_circular_with_dropout_and_nan_bubbles():
    """S = 4, v = 2, m = 8 in jit's global view (jaxga opens the shard_map): a layer that
    gives NaN on zeros and draws dropout masks gives circular's (r = 2) loss and gradients,
    the input's included: the same layers, keys and order."""

    def normalise(p, x, key):
        y = x @ p["w"] + p["b"]
        keep = jax.random.bernoulli(key, 0.8, y.shape)
        return jnp.where(keep, y / jnp.linalg.norm(y, axis=-1, keepdims=True), 0.0)

    head = np.random.default_rng(3).normal(size=(D, 5)).astype(np.float32)
    batch, rng = skewed_batch(16), jax.random.key(4)
    params = on_stages(stack(), stage_mesh(4), 2)

    def loss(params, head, x, schedule):
        options = {"num_microbatches": 8, "schedule": schedule, "repeats": 2, "rng": rng}
        return jaxga.pipeline_loss(normalise, head_fn, (params, head), x, batch, **options).value

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    got = grad(params, head, batch["x"], "interleaved_1f1b")
    want = grad(params, head, batch["x"], "circular")
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(got))
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-6)


def test_interleaved_1f1b_keeps_its_compiled_peak_as_micro_batches_grow():
    """A stage keeps at most 2vS - 1 chunk inputs whatever m is: from m = 4 to 16, the
    scratch memory of interleaved 1F1B (v = 2) stays nearly flat, as 1F1B's does."""
    ratio = compiled_temp("interleaved_1f1b", 16, 2) / compiled_temp("interleaved_1f1b", 4, 2)
    assert ratio < 1.3, ratio


def test_pipeline_loss_names_bad_input():
    params, x = on_stages(stack(), stage_mesh(2)), jnp.ones((8, D))
    targets = {"labels": jnp.zeros(8, jnp.int32), "mask": jnp.ones(8)}
    with pytest.raises(ValueError, match=r"`repeats`=2 needs schedule='circular'; '1f1b'"):
        jaxga.pipeline_loss(
            layer, head_fn, (params, jnp.ones((D, 5))), x, targets, num_microbatches=2, repeats=2
        )
    with pytest.raises(TypeError, match=r"`head_fn` must return a jaxga.Mean"):
        jax.grad(
            lambda p: (
                jaxga.pipeline_loss(
                    layer, lambda h, y, t: jnp.sum(y), (p, None), x, targets, num_microbatches=2
                ).total
            )
        )(params)


@pytest.mark.parametrize("placed", ["replicated", "host"])
def test_pipeline_loss_names_a_stack_not_laid_out_over_the_stages(placed):
    """On an Explicit stage axis the pipeline's shard_map takes the stack as it lies: one
    typed otherwise than split over the stages is named (JAX's own error was a mismatch of
    in_specs; a stack on no mesh is put over the stages, the next test)."""
    mesh = stage_mesh(2)
    where = {
        "replicated": NamedSharding(mesh, P()),
        "host": jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"),
    }[placed]
    params = jax.device_put(stack(), where)
    x, targets = jnp.ones((8, D)), {"labels": jnp.zeros(8, jnp.int32), "mask": jnp.ones(8)}

    def total(params):
        pair, options = (params, jnp.ones((D, 5))), {"num_microbatches": 2, "mesh": mesh}
        options |= {"schedule": "1f1b", "stream": placed == "host"}
        loss = jaxga.pipeline_loss(layer, head_fn, pair, x, targets, **options)
        return loss.total

    message = r"`stacked_params`\['b'\] is laid out as .*its layers not split over the stages; "
    message += r"expected its layer axis split over the Explicit stage axis 'stage'"
    with pytest.raises(ValueError, match=message):
        jax.jit(jax.grad(total))(params)


@pytest.mark.parametrize("shape", [(2,), (2, 2)], ids=["stages", "stages_and_data"])
def test_a_stack_on_no_mesh_is_put_over_the_explicit_stage_axis(shape):
    """A NumPy stack with `mesh=`: put over the stage axis, on a mesh of the stages alone
    too (where it was JAX's mismatch of in_specs); the gradient is `jax.grad` of one scan's."""
    names = ("stage", "data")[: len(shape)]
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])
    params, head = stack(), np.random.default_rng(3).normal(size=(D, 5)).astype(np.float32)
    batch = skewed_batch()

    def total(params, mesh=mesh):
        options = {"num_microbatches": 4, "mesh": mesh, "schedule": "1f1b"}
        loss = jaxga.pipeline_loss(layer, head_fn, (params, head), batch["x"], batch, **options)
        return loss.value

    def reference(params):
        return head_fn(head, jaxga.remat_scan(layer, params, batch["x"]), batch).value

    got = jax.jit(jax.value_and_grad(total))(params)
    chex.assert_trees_all_close(got, jax.value_and_grad(reference)(params), rtol=1e-4, atol=1e-6)


def test_interleaved_1f1b_and_a_head_schedule_name_bad_input():
    params, x = on_stages(stack(), stage_mesh(4), 2), jnp.ones((24, D))
    targets = {"labels": jnp.zeros(24, jnp.int32), "mask": jnp.ones(24)}
    options = {"schedule": "interleaved_1f1b", "repeats": 2, "num_microbatches": 6}
    with pytest.raises(ValueError, match=r"`num_microbatches`=6; it must be a multiple of the S=4"):
        jaxga.pipeline_loss(layer, head_fn, (params, jnp.ones((D, 5))), x, targets, **options)
    with pytest.raises(ValueError, match=r"`schedule`='1f1b' needs a loss head: call jaxga.pipe"):
        jaxga.pipeline_scan(layer, params, x, num_microbatches=4, schedule="1f1b")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_inside_jaxgas_own_shard_map_over_the_batch(schedule):
    """An Explicit-axes batch in jit's global view: jaxga opens a shard_map over "data", and
    the pipeline one over "stage" inside it (the nested case the custom VJPs are for)."""
    mesh = jax.make_mesh((2, 4), ("data", "stage"))
    params, head = stack(), np.random.default_rng(3).normal(size=(D, 5)).astype(np.float32)
    batch = skewed_batch()

    def loss(params, head, batch):
        options = {"num_microbatches": 4, "schedule": schedule}
        return jaxga.pipeline_loss(layer, head_fn, (params, head), batch["x"], batch, **options)

    def reference(params, head):
        return head_fn(head, jaxga.remat_scan(layer, params, batch["x"]), batch).value

    vg = jaxga.value_and_grad(loss, argnums=(0, 1), num_microbatches=2, batch_argnums=2)
    placed = jax.device_put(
        (head, batch), (NamedSharding(mesh, P()), NamedSharding(mesh, P("data")))
    )
    got = jax.jit(vg)(on_stages(params, mesh), *placed)
    want = jax.value_and_grad(reference, argnums=(0, 1))(params, head)
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_make_train_step_keeps_each_stages_weights_on_it(schedule):
    """make_train_step(pipeline_axis="stage") on a ("data", "stage") mesh: one SGD step of
    the whole batch, the state laid out by stage, and no weights gathered."""
    import optax

    mesh = jax.make_mesh((2, 4), ("data", "stage"))
    head = np.random.default_rng(3).normal(size=(D, 5)).astype(np.float32)
    params, batch = {"stack": stack(), "head": head}, skewed_batch()

    def loss(params, batch, model_state, rng):
        pair, options = (
            (params["stack"], params["head"]),
            {"num_microbatches": 4, "schedule": schedule},
        )
        return jaxga.pipeline_loss(layer, head_fn, pair, batch["x"], batch, **options), model_state

    def reference(params):
        h = jaxga.remat_scan(layer, params["stack"], batch["x"])
        return head_fn(params["head"], h, batch).value

    specs = {"stack": {"w": P("stage"), "b": P("stage")}, "head": P()}
    step = jaxga.make_train_step(
        loss, 2, mesh=mesh, axis_name="data", strategy=specs, pipeline_axis="stage"
    )
    state = jaxga.TrainState.create(params=jax.tree.map(jnp.asarray, params), tx=optax.sgd(0.1))
    hlo = step.lower(state, batch).compile().as_text()
    state, metrics = step(state, batch)
    value, grads = jax.value_and_grad(reference)(params)
    chex.assert_trees_all_close(metrics["loss"], value, rtol=1e-5)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    chex.assert_trees_all_close(state.params, want, rtol=1e-4, atol=1e-6)
    assert state.params["stack"]["w"].sharding.spec[0] == "stage"
    assert "collective-permute" in hlo and " all-gather(" not in hlo
    with pytest.raises(ValueError, match=r"`pipeline_axis`='pipe' is not an axis of `mesh`"):
        jaxga.make_train_step(loss, 2, mesh=mesh, strategy=specs, pipeline_axis="pipe")


class _Staged(nnx.Module):
    """A layer stack laid out by stage through its variables' sharding metadata, and a head."""

    def __init__(self, stages: int, axis: str | None = "stage", head: tuple | None = None):
        names = (axis, None, None) if axis else None
        self.w = nnx.Param(
            jaxga.pipeline_order(jnp.asarray(stack()["w"]), stages, 1), out_sharding=names
        )
        self.head = nnx.Param(
            jnp.asarray(np.random.default_rng(3).normal(size=(D, 5)), jnp.float32),
            out_sharding=head,
        )


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_nnx_train_step_keeps_each_stages_weights_on_it(axis_type):
    """nnx_train_step(pipeline_axis="stage") on jax.make_mesh's default (Explicit) axes and
    on Auto ones: one SGD step of 1F1B × k = 2 × 2 data devices equals plain SGD on the whole
    batch; the stack stays split by stage, the HLO permutes activations and gathers no weights."""
    import optax

    types = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}
    mesh = jax.make_mesh((2, 4), ("data", "stage"), axis_types=(types[axis_type],) * 2)
    with jax.set_mesh(mesh):
        model = _Staged(4)
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    batch = skewed_batch()

    def loss(model, batch):
        pair = (model.w[...], model.head[...])
        return jaxga.pipeline_loss(
            lambda w, x: jnp.tanh(x @ w), head_fn, pair, batch["x"], batch, num_microbatches=4
        )

    def reference(w, head):
        h = jaxga.remat_scan(lambda w, x: jnp.tanh(x @ w), w, batch["x"])
        return head_fn(head, h, batch).value

    step = jaxga.nnx_train_step(loss, 2, mesh=mesh, pipeline_axis="stage")
    hlo = step.lower(model, optimizer, batch).compile().as_text()
    w, head = stack()["w"], np.asarray(model.head[...])
    metrics = step(model, optimizer, batch)
    value, (grad_w, grad_head) = jax.value_and_grad(reference, argnums=(0, 1))(w, head)
    chex.assert_trees_all_close(metrics["loss"], value, rtol=1e-5)
    want_w = jaxga.pipeline_order(jnp.asarray(w - 0.1 * grad_w), 4, 1)
    chex.assert_trees_all_close(model.w[...], want_w, rtol=1e-4, atol=1e-6)
    chex.assert_trees_all_close(model.head[...], head - 0.1 * grad_head, rtol=1e-4, atol=1e-6)
    assert model.w[...].sharding.spec[0] == "stage"
    assert "collective-permute" in hlo and " all-gather(" not in hlo


def test_nnx_train_step_names_a_bad_pipeline_axis():
    mesh = jax.make_mesh((2, 4), ("data", "stage"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with pytest.raises(ValueError, match=r"`pipeline_axis`='pipe' is not an axis of `mesh`"):
        jaxga.nnx_train_step(lambda m, b: m(b), 2, mesh=mesh, pipeline_axis="pipe")
    with pytest.raises(ValueError, match=r"`pipeline_axis` with has_aux=True"):
        jaxga.nnx_train_step(lambda m, b: m(b), 2, mesh=mesh, pipeline_axis="stage", has_aux=True)
    with pytest.raises(ValueError, match=r"needs a `mesh` with that axis"):
        jaxga.nnx_train_step(lambda m, b: m(b), 2, pipeline_axis="stage")
    import optax

    model = _Staged(4, axis=None)  # no metadata: the stack would be replicated
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = jaxga.nnx_train_step(
        lambda m, b: jnp.mean(b @ m.w[0]), 2, mesh=mesh, pipeline_axis="stage"
    )
    with pytest.raises(
        ValueError,
        match=r"splits no parameter: name 'stage' in the stacked.*"
        r"nnx.with_partitioning",
    ):
        step(model, optimizer, jnp.ones((8, D)))


def test_auto_plans_a_pipelined_step_by_a_stages_compiled_peak():
    """num_microbatches="auto" with pipeline_axis: the planner compiles the pipelined step,
    so the peak it counts is a stage's (each device's), and it picks the fewest
    accumulation micro-batches whose stage peak fits, as the fixed steps' reports say."""
    import optax

    mesh = jax.make_mesh((2, 4), ("data", "stage"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    head = np.random.default_rng(3).normal(size=(D, 5)).astype(np.float32)
    params, batch = {"stack": stack(), "head": head}, skewed_batch(64)

    def loss(params, batch, model_state, rng):
        pair = (params["stack"], params["head"])
        return jaxga.pipeline_loss(layer, head_fn, pair, batch["x"], batch, num_microbatches=4), (
            model_state
        )

    specs = {"stack": {"w": P("stage"), "b": P("stage")}, "head": P()}
    options = {"mesh": mesh, "strategy": specs, "pipeline_axis": "stage"}
    state = jaxga.TrainState.create(params=jax.tree.map(jnp.asarray, params), tx=optax.adam(0.1))
    peaks = {
        k: jaxga.memory_report(jaxga.make_train_step(loss, k, **options), state, batch).peak_bytes
        for k in (1, 2, 4)
    }
    budget = sorted(peaks.values())[0]  # the smallest: met by one count alone, maybe not k = 1
    step = jaxga.make_train_step(loss, "auto", memory_budget=budget, **options)
    _, metrics = step(state, batch)
    first = next(k for k in (1, 2, 4) if peaks[k] <= budget)
    assert step.plan.num_microbatches == first
    assert step.plan.report.peak_bytes == peaks[first]
    value = head_fn(head, jaxga.remat_scan(layer, params["stack"], batch["x"]), batch).value
    chex.assert_trees_all_close(metrics["loss"], value, rtol=1e-5)


def test_nnx_pipeline_route_threads_dropout_keys_and_batchnorm_as_the_nested_route():
    """With an nnx.Rngs (dropout keys per micro-batch, folded per device), BatchNorm
    statistics and a head split over "data": nnx_train_step(pipeline_axis="stage") leaves
    the model, its statistics and the key count as the step without it does (the pipeline
    nested in jaxga's shard_map); and trains the head alone (`wrt`) as that step does."""
    import optax

    class Model(_Staged):  # its head split over the batch's axis, as Flax's FSDP example
        def __init__(self):
            super().__init__(4, head=("data", None))
            self.norm = nnx.BatchNorm(D, rngs=nnx.Rngs(0))

    def dropped(w, x, key):
        return jnp.tanh(x @ w) * jax.random.bernoulli(key, 0.8, x.shape)

    def loss(model, batch, rngs):
        pair, x = (model.w[...], model.head[...]), model.norm(batch["x"])
        options = {"num_microbatches": 4, "rng": rngs.dropout()}
        return jaxga.pipeline_loss(dropped, head_fn, pair, x, batch, **options)

    mesh = jax.make_mesh((2, 4), ("data", "stage"))
    batch = skewed_batch()
    for wrt in (nnx.Param, nnx.PathContains("head")):  # all, or the head alone
        models = []
        for axis in ("stage", None):
            with jax.set_mesh(mesh):
                model = Model()
                optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=wrt)
            rngs = nnx.Rngs(dropout=1)
            step = jaxga.nnx_train_step(loss, 2, mesh=mesh, pipeline_axis=axis)
            step(model, optimizer, batch, rngs=rngs)
            assert model.head[...].sharding.spec == P("data", None)  # its layout, kept
            models.append((nnx.state(model), int(rngs.dropout.count[...])))
        (piped, piped_keys), (nested, nested_keys) = models
        chex.assert_trees_all_close(piped, nested, rtol=1e-5, atol=1e-6)
        assert piped_keys == nested_keys == 2  # a key per micro-batch


def test_nnx_vmap_stack_named_but_whole_trains_as_one_device():
    """Blocks made by nnx.vmap with transform_metadata={PARTITION_NAME: "stage"}: their
    metadata names the stage axis, their arrays are whole; the step slices them on entry and
    one SGD step equals the same step on one device."""
    import optax

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs, named: bool):
            init = nnx.initializers.lecun_normal()
            init = nnx.with_partitioning(init, (None, None)) if named else init
            self.up = nnx.Linear(D, D, kernel_init=init, use_bias=False, rngs=rngs)

        def __call__(self, x):
            return jnp.tanh(self.up(x))

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs, named: bool):
            meta = {nnx.PARTITION_NAME: "stage"} if named else {}

            @nnx.split_rngs(splits=L)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=meta)
            def blocks(rngs):
                return Block(rngs, named)

            self.blocks = blocks(rngs)
            self.head = nnx.Linear(D, 5, rngs=rngs)

    def loss(model, batch, pipelined):
        graphdef, stack = nnx.split(model.blocks)
        head_graphdef, head = nnx.split(model.head)

        def layer(p, h):
            return nnx.merge(graphdef, p)(h)

        def head_fn(head, y, t):
            return jaxga.token_cross_entropy(
                nnx.merge(head_graphdef, head)(y), t["labels"], t["mask"]
            )

        if pipelined:
            options = {"num_microbatches": 4}
            return jaxga.pipeline_loss(layer, head_fn, (stack, head), batch["x"], batch, **options)
        return head_fn(head, jaxga.remat_scan(layer, stack, batch["x"]), batch)

    mesh, batch, states = jax.make_mesh((2, 4), ("data", "stage")), skewed_batch(), []
    for pipelined in (True, False):
        with jax.set_mesh(mesh) if pipelined else contextlib.nullcontext():
            model = Model(nnx.Rngs(0), named=pipelined)
            optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        options = {"mesh": mesh, "pipeline_axis": "stage"} if pipelined else {}
        step = jaxga.nnx_train_step(lambda m, b, p=pipelined: loss(m, b, p), 2, **options)
        value = step(model, optimizer, batch)["loss"]
        states.append((value, nnx.to_pure_dict(nnx.state(model, nnx.Param))))  # no metadata
    piped, one_device = states
    chex.assert_trees_all_close(piped, one_device, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stages", [2, 4])
def test_a_data_axis_of_one_device_runs_with_pipeline_axis_or_is_refused(stages):
    """data 1 × stage S: the nested route (a pipeline opened inside jaxga's loop over a
    batch axis of one device) is one XLA cannot partition: refused, naming
    `pipeline_axis=`; with it, both steps run exact against the whole batch."""
    import optax

    mesh = jax.make_mesh((1, stages), ("data", "stage"), axis_types=(AxisType.Auto,) * 2)
    head = np.random.default_rng(3).normal(size=(D, 5)).astype(np.float32)
    params, batch = {"stack": stack(), "head": head}, skewed_batch()

    def loss(params, batch, model_state, rng):
        pair = (params["stack"], params["head"])
        return jaxga.pipeline_loss(layer, head_fn, pair, batch["x"], batch, num_microbatches=4), (
            model_state
        )

    def reference(params):
        return head_fn(params["head"], jaxga.remat_scan(layer, params["stack"], batch["x"]), batch)

    specs = {"stack": {"w": P("stage"), "b": P("stage")}, "head": P()}
    state = jaxga.TrainState.create(params=jax.tree.map(jnp.asarray, params), tx=optax.sgd(0.1))
    nested = jaxga.make_train_step(loss, 2, mesh=mesh, strategy=specs)
    with pytest.raises(ValueError, match=r"of one device.*pass the train step pipeline_axis="):
        nested(state, batch)
    step = jaxga.make_train_step(loss, 2, mesh=mesh, strategy=specs, pipeline_axis="stage")
    state, metrics = step(state, batch)
    value, grads = jax.value_and_grad(lambda p: reference(p).value)(params)
    chex.assert_trees_all_close(metrics["loss"], value, rtol=1e-5)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    chex.assert_trees_all_close(state.params, want, rtol=1e-4, atol=1e-6)
    with jax.set_mesh(mesh):
        model = _Staged(stages)
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def nnx_loss(model, batch):
        pair = (model.w[...], model.head[...])
        return jaxga.pipeline_loss(
            lambda w, x: jnp.tanh(x @ w), head_fn, pair, batch["x"], batch, num_microbatches=4
        )

    with pytest.raises(ValueError, match=r"of one device.*pass the train step pipeline_axis="):
        jaxga.nnx_train_step(nnx_loss, 2, mesh=mesh)(model, optimizer, batch)
    metrics = jaxga.nnx_train_step(nnx_loss, 2, mesh=mesh, pipeline_axis="stage")(
        model, optimizer, batch
    )

    def nnx_reference(w, head):
        h = jaxga.remat_scan(lambda w, x: jnp.tanh(x @ w), w, batch["x"])
        return head_fn(head, h, batch).value

    w = stack()["w"]  # pipeline_order(w, S, 1) is w
    value, (grad_w, grad_head) = jax.value_and_grad(nnx_reference, argnums=(0, 1))(w, head)
    chex.assert_trees_all_close(metrics["loss"], value, rtol=1e-5)
    chex.assert_trees_all_close(model.w[...], w - 0.1 * grad_w, rtol=1e-4, atol=1e-6)
    chex.assert_trees_all_close(model.head[...], head - 0.1 * grad_head, rtol=1e-4, atol=1e-6)
