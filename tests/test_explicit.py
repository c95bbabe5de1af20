"""What jaxga used to guess is now asked: aux treatment, train-state fields, unrolling, XLA
options; train steps are objects; what a LoRA optimizer updates is what is trained."""

import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jaxga
from jaxga.compiler import _GPU_OPTIONS


class BN(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.BatchNorm(use_running_average=False, momentum=0.5)(x))


def bn_setup():
    model = BN()
    variables = model.init(jax.random.key(0), jnp.ones((4, 8)))
    x = jax.random.normal(jax.random.key(1), (32, 8))
    return model, variables["params"], variables["batch_stats"], x


def test_model_state_left_in_aux_comes_back_stacked():
    """Flax's ImageNet step ported without state_argnums: its new batch_stats in aux are aux,
    stacked per micro-batch, each from the step's first statistics (no shape is read to tell
    state from aux). Threaded through `state_argnums`, they are the Python loop's."""
    model, params, stats, x = bn_setup()

    def loss(params, x, stats):
        y, updates = model.apply(
            {"params": params, "batch_stats": stats}, x, mutable=["batch_stats"]
        )
        return jnp.mean(y**2), updates

    (_, aux), _ = jaxga.value_and_grad(loss, has_aux=True, num_microbatches=4)(params, x, stats)
    firsts = [loss(params, micro, stats)[1] for micro in jaxga.split_microbatches(x, 4)]
    chex.assert_trees_all_close(aux, jax.tree.map(lambda *s: jnp.stack(s), *firsts), rtol=1e-5)

    # the state threaded, as a Python loop over micro-batches does
    def threaded(params, x, stats):
        value, updates = loss(params, x, stats)
        return value, updates["batch_stats"]

    vg = jaxga.value_and_grad(threaded, num_microbatches=4, state_argnums=2)
    _, new_stats = vg(params, x, stats)
    expected = stats
    for micro in jaxga.split_microbatches(x, 4):
        expected = threaded(params, micro, expected)[1]
    chex.assert_trees_all_close(new_stats, expected, rtol=1e-5)


def test_aux_stack_is_one_value_per_micro_batch():
    x = jnp.arange(16.0).reshape(8, 2)

    def loss(w, x):
        return jnp.mean(w * x), {"sum": jnp.sum(x, 0), "mean": jaxga.Mean.of(x[:, 0])}

    (_, aux), _ = jaxga.value_and_grad(loss, has_aux=True, num_microbatches=4, aux="stack")(1.0, x)
    micro = jaxga.split_microbatches(x, 4)
    chex.assert_trees_all_close(aux["sum"], jnp.sum(micro, 1))
    chex.assert_trees_all_close(aux["mean"].value, jnp.mean(micro[..., 0], 1))  # named: stacked
    (_, aux), _ = jaxga.value_and_grad(loss, has_aux=True, num_microbatches=4)(1.0, x)
    chex.assert_trees_all_close(aux["mean"].value, jnp.mean(x[:, 0]))  # by default, the batch's
    with pytest.raises(ValueError, match=r"`aux\['sum'\]` must be None or a tree of kinds.*'cat'"):
        jaxga.value_and_grad(loss, has_aux=True, num_microbatches=4, aux={"sum": "cat"})


def test_string_leaves_are_named():
    params = {"w": jnp.ones(3), "name": "mlp"}
    with pytest.raises(TypeError, match=r"args\[0\]\['name'\], 'mlp' of type str; expected float"):
        jaxga.grad(lambda p, x: jnp.mean(p["w"] * x), num_microbatches=2)(params, jnp.ones((4, 3)))

    def loss(w, x):
        return jnp.mean(w * x), {"tag": "train"}

    with pytest.raises(
        TypeError, match=r"aux\['tag'\], 'train' of type str; expected arrays or numbers"
    ):
        jaxga.value_and_grad(loss, has_aux=True, num_microbatches=2)(1.0, jnp.ones(4))


class Stats(train_state.TrainState):
    stats: dict
    dropout_key: jax.Array


def test_train_state_fields_can_be_named():
    """A Flax TrainState that adds fields: jaxga does not guess which hold what, it asks;
    named, a key field holding raw key data gives each step fold_in(key, step) and each
    micro-batch fold_in of that."""

    def loss(params, batch, model_state, rng):
        noise = jax.random.normal(rng, batch.shape)
        new = {"stats": {"n": model_state["stats"]["n"] + 1.0}}
        return jnp.mean((batch + noise) * params["w"]), new

    state = Stats.create(
        apply_fn=None,
        params={"w": jnp.float32(1.0)},
        tx=optax.sgd(0.1),
        stats={"n": jnp.float32(0.0)},
        dropout_key=jax.random.key_data(jax.random.key(3)),
    )
    batch = jnp.ones((4, 2))
    unnamed = jaxga.make_train_step(loss, 2, donate=False)
    with pytest.raises(
        ValueError,
        match=r"`state`, a Stats, adds fields \['dropout_key', 'stats'\]: pass make_train_step's "
        r"`model_state_fields=` .* and `rng_field=`",
    ):
        unnamed(state, batch)
    step = jaxga.make_train_step(
        loss, 2, donate=False, model_state_fields=["stats"], rng_field="dropout_key"
    )
    assert step.options.model_state_fields == ("stats",)
    new, metrics = step(state, batch)
    assert float(new.stats["n"]) == 2.0  # threaded through both micro-batches
    key = jax.random.fold_in(jax.random.wrap_key_data(state.dropout_key), 0)
    noise = [jax.random.normal(jax.random.fold_in(key, i), (2, 2)) for i in range(2)]
    expected = np.mean([np.mean(m + n) for m, n in zip(jaxga.split_microbatches(batch, 2), noise)])
    np.testing.assert_allclose(metrics["grad_norm"], abs(expected), rtol=1e-5)
    with pytest.raises(ValueError, match=r"has no field 'stat'"):
        jaxga.make_train_step(loss, 2, model_state_fields="stat")(state, batch)
    with pytest.raises(TypeError, match=r"`rng_field` must be a field name"):
        jaxga.make_train_step(loss, 2, rng_field=3)


class SowingBN(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.BatchNorm(use_running_average=False)(x)
        self.sow("intermediates", "h", h)
        return nn.Dense(2)(h)


def test_an_extra_collection_is_named():
    _, params, stats, x = bn_setup()
    model = SowingBN()
    params = model.init(jax.random.key(0), x)["params"]

    def loss(params, batch, model_state, rng):
        y, updates = model.apply(
            {"params": params, **model_state}, batch, mutable=["batch_stats", "intermediates"]
        )
        return jnp.mean(y**2), updates

    state = jaxga.TrainState.create(
        params=params, tx=optax.sgd(0.1), model_state={"batch_stats": stats}
    )
    with pytest.raises(TypeError, match=r"extra keys \['intermediates'\] and missing keys \[\]"):
        jaxga.make_train_step(loss, 4)(state, x)


def test_a_train_step_is_an_object_with_its_options():
    def loss(params, batch, model_state, rng):
        return jnp.mean((batch @ params) ** 2), model_state

    state = jaxga.TrainState.create(params=jnp.ones((3, 2)), tx=optax.sgd(0.1))
    batch = jnp.ones((8, 3))
    step = jaxga.make_train_step(loss, 4, donate=False, unroll=True, compiler_options={})
    assert isinstance(step, jaxga.TrainStep) and step.options.unroll is True
    assert step.options.compiler_options == {}
    assert " while(" not in step.lower(state, batch).as_text(dialect="hlo")
    rolled = jaxga.make_train_step(loss, 4, donate=False)
    assert rolled.options.compiler_options == jaxga.compiler_options()
    assert " while(" in rolled.lower(state, batch).as_text(dialect="hlo")
    chex.assert_trees_all_close(step(state, batch)[0].params, rolled(state, batch)[0].params)
    forced = jaxga.make_train_step(loss, 4, donate=False, compiler_options=_GPU_OPTIONS)
    assert forced.options.compiler_options == _GPU_OPTIONS
    report = jaxga.memory_report(step, state, batch)  # the program the step runs
    assert report.peak_bytes > 0
    with pytest.raises(TypeError, match=r"`compiler_options` must be a dict"):
        jaxga.make_train_step(loss, 4, compiler_options="fast")
    with pytest.raises(TypeError, match=r"`unroll` must be a bool or a positive int"):
        jaxga.nnx_train_step(lambda m, b: m(b), 2, unroll="yes")


def test_sharding_put_names_a_bad_sharding():
    with pytest.raises(TypeError, match=r"`sharding` must be a Sharding or a tree .*got None"):
        jaxga.sharding.put({"w": jnp.ones(2)}, None)


class LoRAModel(nnx.Module):
    def __init__(self, rngs):
        self.base = nnx.Linear(6, 5, rngs=rngs)
        self.lora = nnx.LoRA(6, 2, 5, rngs=rngs)

    def __call__(self, x):
        return self.base(x) + self.lora(x)


def lora_loss(model, batch):
    return jaxga.Mean.of((model(batch["x"]) - batch["y"]) ** 2)


def test_nnx_train_step_trains_what_a_lora_optimizer_updates():
    """nnx.Optimizer(..., wrt=nnx.LoRAParam): only the adapters change, by the gradient
    nnx.value_and_grad takes with the same filter, and the frozen weights' gradients are
    not computed."""
    batch = {
        "x": jax.random.normal(jax.random.key(1), (16, 6)),
        "y": jax.random.normal(jax.random.key(2), (16, 5)),
    }
    model = LoRAModel(nnx.Rngs(0))
    reference = nnx.clone(model)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.LoRAParam)
    frozen = nnx.clone(nnx.state(model, nnx.Not(nnx.LoRAParam)))
    step = jaxga.nnx_train_step(lora_loss, 4, donate=False)
    step(model, optimizer, batch)
    chex.assert_trees_all_equal(nnx.state(model, nnx.Not(nnx.LoRAParam)), frozen)

    def value(m, b):
        return lora_loss(m, b).value

    grads = nnx.grad(value, argnums=nnx.DiffState(0, nnx.LoRAParam))(reference, batch)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(reference, nnx.LoRAParam), grads)
    chex.assert_trees_all_close(nnx.state(model, nnx.LoRAParam), expected, rtol=1e-5, atol=1e-6)

    def frozen_kernel_grads(optimizer):  # dy^T · x for the base kernel, (5, 6)
        text = str(step.trace(optimizer.model, optimizer, batch).jaxpr)
        return len(re.findall(r"f32\[5,6\] = dot_general", text))

    assert frozen_kernel_grads(nnx.ModelAndOptimizer(model, optax.sgd(0.1), wrt=nnx.LoRAParam)) == 0
    assert frozen_kernel_grads(nnx.ModelAndOptimizer(model, optax.sgd(0.1), wrt=nnx.Param)) > 0


def test_count_counts_items_for_every_kind_of_loss():
    """A scalar loss is a mean over its micro-batch's rows: count is the batch's rows, and a
    MultiSteps weighs each call by them (a last, smaller batch weighs less)."""
    x = jnp.arange(12.0).reshape(12, 1)

    def scalar(w, x):
        return jnp.mean(w * x)

    acc = jaxga.accumulate(scalar, num_microbatches=4)(2.0, x)
    assert float(acc.mean.count) == 12.0
    np.testing.assert_allclose(acc.mean.value, 2.0 * jnp.mean(x), rtol=1e-6)
    np.testing.assert_allclose(acc.grads, jnp.mean(x), rtol=1e-6)
    acc = jaxga.accumulate(
        lambda w, x: jaxga.Mean.of(w * x[:, 0], where=x[:, 0] > 3), num_microbatches=4
    )
    assert float(acc(2.0, x).mean.count) == 8.0

    def train_loss(params, batch, model_state, rng):
        return jnp.mean((batch @ params) ** 2), model_state

    state = jaxga.TrainState.create(params=jnp.ones(1), tx=optax.sgd(0.1))
    _, metrics = jaxga.make_train_step(train_loss, 4, donate=False)(state, x)
    assert int(metrics["count"]) == 12
    tx = jaxga.MultiSteps(optax.sgd(1.0), every_k=2)
    state = jaxga.TrainState.create(params=jnp.ones(1), tx=tx)
    step = jaxga.make_train_step(train_loss, 2, donate=False)
    state, _ = step(state, x)  # 12 rows
    state, _ = step(state, x[:4])  # 4 rows
    grads = [jax.grad(lambda p, b: jnp.mean((b @ p) ** 2))(jnp.ones(1), b) for b in (x, x[:4])]
    expected = 1.0 - (12 * grads[0] + 4 * grads[1]) / 16  # the mean over the 16 rows
    np.testing.assert_allclose(state.params, expected, rtol=1e-5)


class AxisBN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.BatchNorm(use_running_average=False, momentum=0.5, axis_name="batch")(x)
        return nn.Dense(2)(x)


def test_a_named_batchnorm_axis_runs_on_one_device():
    """Flax's ImageNet ResNet names its BatchNorm axis: without a mesh the step says to pass
    axis_name, and with it runs on a one-device mesh, as a Python loop over the strided
    micro-batches (each normalised by its own rows, the statistics threaded)."""
    model = AxisBN()
    x = jax.random.normal(jax.random.key(1), (16, 3))
    init = AxisBN().init  # binding "batch" needs a map: initialise under vmap's axis
    variables = jax.vmap(init, axis_name="batch", in_axes=(None, 0))(jax.random.key(0), x[None])
    variables = jax.tree.map(lambda v: v[0], variables)

    def loss(params, batch, model_state, rng):
        y, updates = model.apply({"params": params, **model_state}, batch, mutable=["batch_stats"])
        return jnp.mean(y**2), updates

    state = jaxga.TrainState.create(
        params=variables["params"],
        tx=optax.sgd(0.1),
        model_state={"batch_stats": variables["batch_stats"]},
    )
    with pytest.raises(NameError) as error:
        jaxga.make_train_step(loss, 2, donate=False)(state, x)
    assert "axis_name=NAME" in "".join(error.value.__notes__)
    new, _ = jaxga.make_train_step(loss, 2, donate=False, axis_name="batch")(state, x)

    def on_axis(fn):  # the reference binds the axis the same way, on one "device"
        return jax.vmap(fn, axis_name="batch", in_axes=None, axis_size=1)

    stats, grads = state.model_state, []
    for micro in jaxga.split_microbatches(x, 2):
        (_, stats), g = on_axis(jax.value_and_grad(loss, has_aux=True))(
            state.params, micro, stats, None
        )
        stats, g = jax.tree.map(lambda v: v[0], (stats, g))
        grads.append(g)
    expected = jax.tree.map(lambda p, a, b: p - 0.1 * (a + b) / 2, state.params, *grads)
    chex.assert_trees_all_close(new.params, expected, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(new.model_state, stats, rtol=1e-5, atol=1e-6)


class TwoKeys(train_state.TrainState):
    dropout_key: jax.Array
    noise_key: jax.Array


def test_rng_field_chooses_between_two_key_fields():
    state = TwoKeys.create(
        apply_fn=None,
        params={"w": jnp.float32(1.0)},
        tx=optax.sgd(0.1),
        dropout_key=jax.random.key(1),
        noise_key=jax.random.key(2),
    )

    def loss(params, batch, model_state, rng):
        return jnp.mean(batch * params["w"] * jax.random.uniform(rng)), model_state

    with pytest.raises(ValueError, match=r"adds fields \['dropout_key', 'noise_key'\]"):
        jaxga.make_train_step(loss, 2, donate=False)(state, jnp.ones((4, 2)))
    step = jaxga.make_train_step(
        loss, 2, donate=False, model_state_fields=(), rng_field="noise_key"
    )
    new, _ = step(state, jnp.ones((4, 2)))
    key = jax.random.fold_in(state.noise_key, 0)
    scale = [jax.random.uniform(jax.random.fold_in(key, i)) for i in range(2)]
    np.testing.assert_allclose(new.params["w"], 1.0 - 0.1 * np.mean(scale), rtol=1e-6)
