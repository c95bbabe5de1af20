"""Pipelines as other people write them (issue 47), ported to jaxga on 8 host devices.

The UvA deep-learning tutorials' GPipe pipeline: a user's own ``shard_map`` over
``("data", "model")`` (2 × 4), the layer stack split over ``"model"``, a head run on every
stage and its loss masked to the last one, k = 2 accumulation micro-batches. Every way of
returning that loss gives the whole batch's mean and gradients on one device (float32
rounding, tolerances below); what cannot work is refused, naming what to do.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxga
from tests._hlo import hlo_collectives

L, D, B, CLASSES = 8, 8, 32, 3
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def problem() -> tuple:
    rng = np.random.default_rng(0)
    stack = {"w": rng.normal(size=(L, D, D)).astype(np.float32) / D**0.5}
    head = rng.normal(size=(D, CLASSES)).astype(np.float32)
    batch = {
        "x": rng.normal(size=(B, D)).astype(np.float32),
        "y": rng.integers(0, CLASSES, size=B),
    }
    return stack, head, batch


def layer(p, h):
    return h + jnp.tanh(h @ p["w"])


def cross_entropy(logits, labels):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1)[:, 0]


def on_one_device(stack, head, batch):
    y = jaxga.remat_scan(layer, stack, batch["x"])
    return cross_entropy(y @ head, batch["y"]).mean()


def uva_loss(returns: str):
    """The head on every stage, its loss masked to the last; ``returns`` says how the port
    hands it to jaxga."""

    def loss(stack, head, batch):
        y = jaxga.pipeline_scan(layer, stack, batch["x"], num_microbatches=4, axis_name="model")
        last = jax.lax.axis_index("model") == jax.lax.axis_size("model") - 1
        losses = jnp.where(last, cross_entropy(y @ head, batch["y"]), 0.0)
        if returns == "mean":  # the notebook's scalar
            return losses.mean()
        if returns == "psum":
            return jax.lax.psum(losses.mean(), "model")
        if returns == "masked":  # the notebook's (sum, count)
            return jaxga.Mean(losses.sum(), jnp.where(last, losses.shape[0], 0))
        return jaxga.Mean(losses.sum(), losses.shape[0])  # every stage's rows counted

    return loss


def uva_step(loss, axis_name, check_vma: bool = True):
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    vg = jaxga.value_and_grad(
        loss, argnums=(0, 1), num_microbatches=2, batch_argnums=2, axis_name=axis_name
    )
    specs = (P("model"), P(), P("data"))
    step = jax.shard_map(
        vg, mesh=mesh, in_specs=specs, out_specs=(P(), specs[:2]), check_vma=check_vma
    )
    stack, head, batch = problem()
    placed = jax.device_put(
        (stack, head, batch), tuple(NamedSharding(mesh, spec) for spec in specs)
    )
    return jax.jit(step), placed


@pytest.mark.parametrize(
    "returns, axis_name",
    [
        ("mean", ("data", "model")),
        ("psum", ("data", "model")),
        ("masked", ("data", "model")),
        ("every_stages_rows", ("data", "model")),
        ("mean", "data"),
        ("psum", "data"),
    ],
)
def test_a_loss_computed_per_stage_counts_each_micro_batch_once(returns, axis_name):
    step, placed = uva_step(uva_loss(returns), axis_name)
    value, grads = step(*placed)
    want_value, want_grads = jax.value_and_grad(on_one_device, argnums=(0, 1))(*problem())
    np.testing.assert_allclose(value, want_value, rtol=RTOL, atol=ATOL)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@jax.checkpoint
def _remat_pipeline(stack, x):
    return jaxga.pipeline_scan(layer, stack, x, num_microbatches=4, axis_name="model")


def _remat_loss(stack, head, batch):
    y = _remat_pipeline(stack, batch["x"])  # traced once: JAX reuses it on the next trace
    last = jax.lax.axis_index("model") == jax.lax.axis_size("model") - 1
    return jnp.where(last, cross_entropy(y @ head, batch["y"]), 0.0).mean()


def test_a_pipeline_traced_once_by_jax_counts_once_on_every_trace():
    """A pipeline inside ``jax.checkpoint``: the second trace reuses JAX's cached jaxpr, so no
    Python of the pipeline runs; its stages still count each micro-batch once, the stage
    axis in `axis_name` (the batch the same on every stage), and a stage axis left out of
    `axis_name` is refused, never summed."""
    want_value, want_grads = jax.value_and_grad(on_one_device, argnums=(0, 1))(*problem())
    for _ in range(2):  # a fresh step and trace each time
        step, placed = uva_step(_remat_loss, ("data", "model"))
        value, grads = step(*placed)
        np.testing.assert_allclose(value, want_value, rtol=RTOL, atol=ATOL)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    step, placed = uva_step(_remat_loss, "data")
    try:  # the stage axis outside `axis_name`: the pipeline's note, or an error naming it
        value = step(*placed)[0]
    except ValueError as e:
        assert re.search(r"varies over the mesh axes \['model'\]", str(e)), e
    else:
        np.testing.assert_allclose(value, want_value, rtol=RTOL, atol=ATOL)


def test_a_pipeline_in_a_shard_map_without_its_check_is_refused_saying_so():
    step, placed = uva_step(uva_loss("mean"), ("data", "model"), check_vma=False)
    with pytest.raises(ValueError, match=r"check_vma=False.*check_vma=True"):
        step(*placed)


def test_a_loss_varying_over_an_axis_not_summed_names_it():
    """No pipeline: a loss that differs over "model", which `axis_name` leaves out."""

    def loss(w, batch):
        return jnp.mean(batch @ w) * (1.0 + jax.lax.axis_index("model"))

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    vg = jaxga.value_and_grad(loss, num_microbatches=2, batch_argnums=1, axis_name="data")
    step = jax.shard_map(vg, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
    w = jax.device_put(jnp.ones((D,)), NamedSharding(mesh, P()))
    batch = jax.device_put(jnp.ones((B, D)), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"varies over the mesh axes \['model'\].*\('data',\)"):
        jax.jit(step)(w, batch)


def result_shapes(line: str) -> set[tuple[int, ...]]:
    """The shapes of an HLO instruction's results: ``= (f32[8,3]{1,0}, f32[]) op(...)``."""
    result = line.split("=", 1)[1].split(")", 1)[0] if "=" in line else ""
    found = re.findall(r"\w+\[([\d,]*)\]", result)
    return {tuple(int(n) for n in shape.split(",") if n) for shape in found}


@pytest.mark.parametrize("axis_name", [("data", "model"), "data"])
def test_the_stacks_output_moves_point_to_point_only(axis_name):
    """The UvA step's loop moves activations by collective-permutes alone: no all-reduce
    of the stack's output over the stages (forward), nor of its cotangent (backward). With
    "model" outside `axis_name`, the head's gradient and the loss are summed over the
    stages in each micro-batch (the head's weights are the same on every stage there)."""
    step, placed = uva_step(uva_loss("mean"), axis_name)
    collectives = [c for c in hlo_collectives(step.lower(*placed).compile()) if c.in_loop]
    assert "collective-permute" in {c.opcode for c in collectives}
    allowed = {()} if axis_name == ("data", "model") else {(), (D, CLASSES)}
    others = [
        c.line
        for c in collectives
        if c.opcode != "collective-permute" and not result_shapes(c.line) <= allowed
    ]
    assert not others, others


def embedded_problem() -> tuple:
    stack, head, batch = problem()
    rng = np.random.default_rng(1)
    table = rng.normal(size=(11, D)).astype(np.float32)
    return (stack, head, table), {"ids": rng.integers(0, 11, size=B), "y": batch["y"]}


def embed(table, ids):
    return table[ids]


def token_head(head, y, labels):
    return jaxga.Mean(cross_entropy(y @ head, labels).sum(), labels.shape[0])


def embedded_on_one_device(params, batch):
    stack, head, table = params
    y = jaxga.remat_scan(layer, stack, embed(table, batch["ids"]))
    return token_head(head, y, batch["y"]).value


@pytest.mark.parametrize("schedule, repeats", [("1f1b", 1), ("interleaved_1f1b", 2), ("gpipe", 1)])
def test_1f1b_embeds_each_micro_batch_on_the_first_stage(schedule, repeats):
    """`embed_fn`: the stack's input made per micro-batch on stage 0, its gradient there."""
    params, batch = embedded_problem()
    mesh = jax.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    stack = jaxga.pipeline_order(params[0], 4, repeats)
    placed = (jax.device_put(stack, NamedSharding(mesh, P("stage"))), *params[1:])

    def loss(params):
        options = {"num_microbatches": 4, "schedule": schedule, "repeats": repeats}
        mean = jaxga.pipeline_loss(
            layer, token_head, params, batch["ids"], batch["y"], embed_fn=embed, **options
        )
        return mean.value

    value, grads = jax.jit(jax.value_and_grad(loss))(placed)
    want_value, want = jax.value_and_grad(embedded_on_one_device)(params, batch)
    want = (jaxga.pipeline_order(want[0], 4, repeats), *want[1:])
    np.testing.assert_allclose(value, want_value, rtol=RTOL, atol=ATOL)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("axis_name", [("data", "model"), "data"])
def test_1f1b_with_an_embedding_in_a_users_shard_map_equals_one_device(axis_name):
    params, batch = embedded_problem()
    mesh = jax.make_mesh((2, 4), ("data", "model"))

    def loss(params, batch):
        return jaxga.pipeline_loss(
            layer,
            token_head,
            params,
            batch["ids"],
            batch["y"],
            embed_fn=embed,
            num_microbatches=4,
            axis_name="model",
        )

    vg = jaxga.value_and_grad(loss, num_microbatches=2, batch_argnums=1, axis_name=axis_name)
    specs = ((P("model"), P(), P()), P("data"))
    step = jax.shard_map(vg, mesh=mesh, in_specs=specs, out_specs=(P(), specs[0]))
    placed = jax.device_put(
        (params, batch),
        jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)),
    )
    value, grads = jax.jit(step)(*placed)
    want_value, want = jax.value_and_grad(embedded_on_one_device)(params, batch)
    np.testing.assert_allclose(value, want_value, rtol=RTOL, atol=ATOL)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def embedded_temp(m: int, per_microbatch: bool) -> int:
    """The compiled scratch bytes of a 1F1B gradient step whose stack input is made in it
    (token ids through a table), micro-batches of 64 rows of width 128."""
    width, rows, vocab = 128, 64, 32
    stack = {"w": jnp.ones((L, width, 4 * width)), "v": jnp.ones((L, 4 * width, width))}
    head, table = jnp.ones((width, 5)), jnp.ones((vocab, width))
    ids, labels = jnp.zeros(rows * m, jnp.int32), jnp.zeros(rows * m, jnp.int32)

    def block(p, x):
        return x + jnp.tanh(x @ p["w"]) @ p["v"]

    def loss(params):
        if per_microbatch:
            mean = jaxga.pipeline_loss(
                block, token_head, params, ids, labels, embed_fn=embed, num_microbatches=m
            )
        else:
            x = embed(params[2], ids)
            mean = jaxga.pipeline_loss(block, token_head, params[:2], x, labels, num_microbatches=m)
        return mean.value

    mesh = jax.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    params = (jax.device_put(stack, NamedSharding(mesh, P("stage"))), head, table)
    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_1f1b_with_embed_fn_keeps_its_scratch_flat_as_micro_batches_grow():
    """Embedding the whole batch first keeps it and its gradient, m micro-batches' worth;
    `embed_fn` makes one micro-batch's at a time on stage 0."""
    first = embedded_temp(16, per_microbatch=False) / embedded_temp(4, per_microbatch=False)
    each = embedded_temp(16, per_microbatch=True) / embedded_temp(4, per_microbatch=True)
    assert each <= 1.1 and first > 1.2, (each, first)


def test_gpipe_in_your_own_shard_map_is_within_1_2x_of_a_hand_written_one():
    """benchmarks/pipeline.py --handwritten: the UvA-style hand-written GPipe and
    `jaxga.pipeline_scan` in the same shard_map give the same loss and gradients, and
    jaxga's compiled scratch per device is within 1.2× of the hand-written one's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import pipeline as bench

    m, rows = 4, 8
    mesh = jax.make_mesh((bench.S,), ("stage",), devices=jax.devices()[: bench.S])
    stack, head = bench.model()
    rng = np.random.default_rng(5)
    x = rng.normal(size=(rows * m, bench.WIDTH)).astype(np.float32)
    labels = rng.integers(0, bench.VOCAB, size=rows * m)
    placed = jax.device_put(stack, NamedSharding(mesh, P("stage")))
    results = []
    for fn in (bench.handwritten_gpipe, bench.jaxga_gpipe):

        def loss(stack, head, x, labels, fn=fn):
            return fn(stack, head, x, labels, m)

        mapped = jax.shard_map(loss, mesh=mesh, in_specs=(P("stage"), P(), P(), P()), out_specs=P())
        results.append(jax.jit(jax.value_and_grad(mapped, argnums=(0, 1)))(placed, head, x, labels))
    (hand_loss, hand_grads), (our_loss, our_grads) = results
    np.testing.assert_allclose(our_loss, hand_loss, rtol=RTOL)
    for ours, theirs in zip(jax.tree.leaves(our_grads), jax.tree.leaves(hand_grads)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=ATOL)
    for m in (4, 16):
        found = bench.handwritten_temporaries(m, rows=32)
        assert found["jaxga"] <= 1.2 * found["hand-written"], (m, found)


def test_the_uva_port_in_flax_linen_is_exact_with_a_scalar_loss_per_stage():
    """As the notebook writes it in Flax Linen: the stack's blocks a Linen module whose
    parameters are initialised apart (a vmap of `init` over the layers), the head a Linen
    `nn.Dense` run on every stage, its scalar loss masked to the last; data 2 × model 4,
    k = 2. Exact against the Linen model on one device."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h):
            return h + jnp.tanh(nn.Dense(D, use_bias=False)(h))

    block, head_module = Block(), nn.Dense(CLASSES)
    _, _, batch = problem()
    keys = jax.random.split(jax.random.key(0), L)
    stack = jax.vmap(lambda k: block.init(k, batch["x"][:1])["params"])(keys)
    head = head_module.init(jax.random.key(1), batch["x"][:1])["params"]

    def layer_fn(p, h):
        return block.apply({"params": p}, h)

    def loss(stack, head, batch):
        y = jaxga.pipeline_scan(layer_fn, stack, batch["x"], num_microbatches=4, axis_name="model")
        logits = head_module.apply({"params": head}, y)  # on every stage
        last = jax.lax.axis_index("model") == jax.lax.axis_size("model") - 1
        return jnp.where(last, cross_entropy(logits, batch["y"]), 0.0).mean()

    def reference(stack, head):
        y = jaxga.remat_scan(layer_fn, stack, batch["x"])
        return cross_entropy(head_module.apply({"params": head}, y), batch["y"]).mean()

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    vg = jaxga.value_and_grad(
        loss, argnums=(0, 1), num_microbatches=2, batch_argnums=2, axis_name=("data", "model")
    )
    specs = (P("model"), P(), P("data"))
    step = jax.jit(jax.shard_map(vg, mesh=mesh, in_specs=specs, out_specs=(P(), specs[:2])))
    placed = jax.device_put((stack, head, batch), tuple(NamedSharding(mesh, s) for s in specs))
    value, grads = step(*placed)
    want_value, want_grads = jax.value_and_grad(reference, argnums=(0, 1))(stack, head)
    np.testing.assert_allclose(value, want_value, rtol=RTOL, atol=ATOL)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
