"""The pipeline's loss dtype under x64, what each schedule returns on each stage inside a
``shard_map``, GPipe's collective-permutes, and bad arguments of `pipeline_order` and
`Schedule` named (8 host devices, as in tests/test_pipeline.py)."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxga
from jaxga.pipeline import Schedule
from tests._hlo import hlo_collectives

L, D = 8, 6
HEAD_SCHEDULES = [("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved_1f1b", 2)]


def stack(dtype=np.float32) -> dict:
    rng = np.random.default_rng(0)
    return {
        "w": (rng.normal(size=(L, D, D)) / 3).astype(dtype),
        "b": (rng.normal(size=(L, D)) / 3).astype(dtype),
    }


def layer(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def head_fn(v, y, t):
    return jaxga.Mean.of((y @ v - t) ** 2)


def stage_mesh(stages: int) -> jax.sharding.Mesh:
    return jax.make_mesh((stages,), ("stage",), devices=jax.devices()[:stages])


def on_stages(params, mesh, repeats=1):
    ordered = jaxga.pipeline_order(params, mesh.shape["stage"], repeats)
    return jax.device_put(ordered, NamedSharding(mesh, P("stage")))


@pytest.mark.parametrize("schedule, repeats", HEAD_SCHEDULES)
def test_every_schedule_sums_a_float64_loss_under_x64(schedule, repeats):
    with jax.enable_x64(True):
        params, v = stack(np.float64), np.linspace(-1.0, 1.0, D)
        x = np.random.default_rng(1).normal(size=(16, D))
        t = np.random.default_rng(2).normal(size=16)
        options = {"num_microbatches": 4, "schedule": schedule, "repeats": repeats}

        def loss(params, v):
            return jaxga.pipeline_loss(layer, head_fn, (params, v), x, t, **options).value

        def reference(params, v):
            return head_fn(v, jaxga.remat_scan(layer, params, x), t).value

        placed = on_stages(params, stage_mesh(2), repeats)
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(placed, v)
        want_value, want_grads = jax.value_and_grad(reference, argnums=(0, 1))(params, v)
        assert value.dtype == jnp.float64
        np.testing.assert_allclose(value, want_value, rtol=1e-12)
        want_grads = (jaxga.pipeline_order(want_grads[0], 2, repeats), want_grads[1])
        chex.assert_trees_all_close(grads, want_grads, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("schedule, repeats", HEAD_SCHEDULES)
def test_inside_a_shard_map_each_schedule_returns_what_its_docstring_says(schedule, repeats):
    """1F1B's `Mean`: the whole batch's on every stage; GPipe's and circular's: on the last
    stage (the others: the head on their input)."""
    stages, mesh = 2, stage_mesh(2)
    params, v = stack(), np.linspace(-1.0, 1.0, D).astype(np.float32)
    x = np.random.default_rng(1).normal(size=(16, D)).astype(np.float32)
    t = np.zeros(16, np.float32)
    options = {"num_microbatches": 4, "schedule": schedule, "repeats": repeats}

    def per_stage(params, v, x, t):
        mean = jaxga.pipeline_loss(layer, head_fn, (params, v), x, t, **options)
        return jnp.reshape(mean.total, (1,))

    specs = (P("stage"), P(), P(), P())
    run = jax.jit(jax.shard_map(per_stage, mesh=mesh, in_specs=specs, out_specs=P("stage")))
    totals = np.asarray(run(on_stages(params, mesh, repeats), v, x, t))
    want = head_fn(v, jaxga.remat_scan(layer, params, x), t).total
    np.testing.assert_allclose(totals[-1], want, rtol=1e-5)
    if jaxga.pipeline.SCHEDULES[schedule].manual:
        np.testing.assert_allclose(totals, np.full(stages, want), rtol=1e-5)
    else:
        np.testing.assert_allclose(totals[0], head_fn(v, x, t).total, rtol=1e-5)


def permute_pairs(compiled) -> set:
    pairs = set()
    for c in hlo_collectives(compiled):
        if c.opcode == "collective-permute":
            listed = re.search(r"source_target_pairs=\{(.*?)\}\}", c.line).group(1)
            pairs |= {tuple(map(int, p)) for p in re.findall(r"(\d+),(\d+)", listed)}
    return pairs


@pytest.mark.parametrize("schedule, repeats, wraps", [("gpipe", 1, False), ("circular", 2, True)])
def test_gpipe_sends_nothing_from_the_last_stage_back_to_the_first(schedule, repeats, wraps):
    """S = 4: forward pairs (s, s + 1), their transposes (s + 1, s) in the backward; the
    wrap-around (3, 0) and its transpose (0, 3) only where micro-batches go round."""
    mesh, x = stage_mesh(4), jnp.ones((16, D))
    options = {"num_microbatches": 4, "schedule": schedule, "repeats": repeats}

    def loss(params):
        return jnp.mean(jaxga.pipeline_scan(layer, params, x, **options) ** 2)

    placed = on_stages(stack(), mesh, repeats)
    pairs = permute_pairs(jax.jit(jax.grad(loss)).lower(placed).compile())
    assert {(0, 1), (1, 2), (2, 3)} <= pairs
    assert bool({(3, 0), (0, 3)} & pairs) == wraps
    assert Schedule(4, 4, repeats, schedule).sends[-1] == ((3, 0) if wraps else (2, 3))


@pytest.mark.parametrize(
    "stages, repeats, error, message",
    [
        (0, 1, ValueError, r"`stages` must be a positive int; got 0 of type int"),
        (2, 0, ValueError, r"`repeats` must be a positive int; got 0 of type int"),
        (2.0, 1, TypeError, r"`stages` must be a positive int; got 2.0 of type float"),
    ],
)
def test_pipeline_order_names_a_bad_stages_or_repeats(stages, repeats, error, message):
    with pytest.raises(error, match=message):
        jaxga.pipeline_order(jnp.arange(8), stages=stages, repeats=repeats)


def test_a_schedule_names_its_bad_fields():
    names = re.escape(str(tuple(jaxga.pipeline.SCHEDULES)))
    with pytest.raises(ValueError, match=rf"`name` must be one of {names}; got 'foo'"):
        Schedule(2, 4, 1, "foo")
    with pytest.raises(ValueError, match=r"`stages` must be a positive int; got 0"):
        Schedule(0, 4, 1, "gpipe")
    with pytest.raises(ValueError, match=r"`microbatches` must be a positive int; got -1"):
        Schedule(2, -1, 1, "1f1b")
    assert Schedule(2, 4, 1, "gpipe").ticks == 5
