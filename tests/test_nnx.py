"""Flax NNX modules as arguments of jaxga.value_and_grad, against nnx.value_and_grad."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxga
from jaxga.microbatch import IndivisibleBatchError

RTOL = 2e-5
assert_close = functools.partial(chex.assert_trees_all_close, rtol=RTOL, atol=1e-6)
BATCH = 16


class Net(nnx.Module):
    """Linear → BatchNorm → Dropout → Linear, with a call counter of its own."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(5, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, momentum=0.8, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.out = nnx.Linear(8, 3, rngs=rngs)
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls[...] += 1
        return self.out(self.drop(jax.nn.relu(self.norm(self.hidden(x)))))


def make_net(seed=0):
    return Net(nnx.Rngs(params=seed, dropout=seed + 1))


def make_batch(seed=1, n=BATCH):
    kx, ky = jax.random.split(jax.random.key(seed))
    return {"x": jax.random.normal(kx, (n, 5)), "y": jax.random.randint(ky, (n,), 0, 3)}


def loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def state_of(model):
    """Everything but the parameters (BatchNorm statistics, Rngs, the call counter), as data."""

    def as_data(x):
        return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x

    return jax.tree.map(as_data, nnx.state(model, nnx.Not(nnx.Param)))


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_eval_mode_matches_full_batch(k):
    model, batch = make_net(), make_batch()
    model.eval()  # BatchNorm uses its running averages, Dropout is off
    expected = nnx.value_and_grad(loss)(nnx.clone(model), batch)
    actual = jaxga.value_and_grad(loss, num_microbatches=k)(model, batch)
    assert isinstance(actual[1], nnx.State)
    assert_close(actual, expected)


@pytest.mark.parametrize("k", [2, 4])
def test_train_mode_matches_microbatches_run_one_after_another(k):
    model, batch = make_net(), make_batch()
    reference = nnx.clone(model)
    value, grads = nnx.jit(jaxga.value_and_grad(loss, num_microbatches=k))(model, batch)

    # The documented order: micro-batch i holds rows i, i + k, i + 2k, ...
    parts = jaxga.split_microbatches(batch, k)
    results = [
        nnx.value_and_grad(loss)(reference, jax.tree.map(lambda x: x[i], parts)) for i in range(k)
    ]
    expected_value = np.mean([v for v, _ in results])
    expected_grads = jax.tree.map(lambda *g: sum(g) / k, *[g for _, g in results])
    assert_close((value, grads), (expected_value, expected_grads))
    assert_close(state_of(model), state_of(reference))  # statistics, counters, Rngs
    assert int(model.calls[...]) == k
    assert not np.allclose(model.norm.mean[...], 0.0)  # the statistics moved


def test_dropout_differs_between_microbatches_and_calls():
    model = make_net()
    half = make_batch(n=BATCH // 2)
    # Rows 2i and 2i + 1 are equal, so micro-batches 0 and 1 hold the same examples.
    twice = jax.tree.map(lambda x: jnp.repeat(x, 2, axis=0), half)
    has_aux = jaxga.value_and_grad(
        lambda m, b: (loss(m, b), loss(m, b)), num_microbatches=2, has_aux=True
    )
    model.norm.eval()  # keep BatchNorm from changing between the two micro-batches
    (first, per_micro), _ = has_aux(model, twice)
    assert per_micro.shape == (2,)
    assert not np.isclose(per_micro[0], per_micro[1])  # different dropout masks
    (second, _), _ = has_aux(model, twice)
    assert not np.isclose(first, second)  # the stream advanced between calls
    model.eval()
    (_, eval_micro), _ = has_aux(model, twice)
    np.testing.assert_allclose(eval_micro[0], eval_micro[1], rtol=1e-6)  # no dropout: equal


def test_reproducible_from_the_seed():
    batch = make_batch()
    grad_fn = jaxga.value_and_grad(loss, num_microbatches=4)
    a, b = make_net(seed=3), make_net(seed=3)
    chex.assert_trees_all_equal(grad_fn(a, batch), grad_fn(b, batch))


def test_inside_jax_jit_the_updated_module_is_returned():
    model, batch = make_net(), make_batch()
    reference = nnx.clone(model)
    grad_fn = jaxga.value_and_grad(loss, num_microbatches=4)

    @jax.jit
    def step(model, batch):
        value, grads = grad_fn(model, batch)
        return value, grads, model

    value, grads, updated = step(model, batch)
    expected = nnx.jit(grad_fn)(reference, batch)
    assert_close((value, grads), expected)
    assert_close(state_of(updated), state_of(reference))


def test_diffstate_chooses_what_is_differentiated():
    model, batch = make_net(), make_batch()
    model.eval()
    only_out = nnx.All(nnx.Param, nnx.PathContains("out"))
    value, grads = jaxga.value_and_grad(loss, nnx.DiffState(0, only_out), num_microbatches=4)(
        model, batch
    )
    expected = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, only_out))(model, batch)
    assert set(grads) == {"out"}
    assert_close((value, grads), expected)


def test_a_list_of_modules_and_a_second_argument():
    a, b, batch = make_net(0), make_net(5), make_batch()
    a.eval()
    b.eval()

    def two(models, scale, batch):
        return scale * (loss(models[0], batch) + loss(models[1], batch))

    expected = nnx.value_and_grad(two, argnums=(0, 1))([a, b], 2.0, batch)
    actual = jaxga.value_and_grad(two, (0, 1), num_microbatches=4, batch_argnums=2)(
        [a, b], 2.0, batch
    )
    assert_close(actual, expected)


@pytest.mark.parametrize("k", [1, 4])
def test_nnx_optimizer_matches_the_full_batch_loop(k):
    model, batch = make_net(), make_batch()
    model.eval()
    reference = nnx.clone(model)
    tx = optax.adam(1e-2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    expected_optimizer = nnx.Optimizer(reference, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        value, grads = jaxga.value_and_grad(loss, num_microbatches=k)(model, batch)
        optimizer.update(model, grads)
        return value

    @nnx.jit
    def expected_step(model, optimizer, batch):
        value, grads = nnx.value_and_grad(loss)(model, batch)
        optimizer.update(model, grads)
        return value

    for i in range(3):
        batch = make_batch(seed=10 + i)
        assert_close(
            step(model, optimizer, batch), expected_step(reference, expected_optimizer, batch)
        )
    assert_close(nnx.state(model, nnx.Param), nnx.state(reference, nnx.Param), rtol=1e-5)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs several (host) devices")
def test_data_parallel_batch_norm_statistics_are_the_mean_over_devices():
    devices, k = jax.device_count(), 2
    mesh = jax.make_mesh((devices,), ("data",))
    model, host_batch = make_net(), make_batch(n=4 * devices)
    batch = jaxga.sharding.shard_batch(host_batch, mesh)
    reference = nnx.clone(model)
    grad_fn = jaxga.value_and_grad(loss, num_microbatches=k, axis_name="data")

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    def step(model, batch):
        value, grads = grad_fn(model, batch)
        return value, grads, model

    value, grads, updated = step(model, batch)
    assert int(updated.calls[...]) == k  # counters as on one device
    # Each device runs its rows' micro-batches (strided) through its own copy of the
    # statistics, in order; the step returns their mean over devices.
    stats = []
    for rows in np.split(np.arange(len(host_batch["x"])), devices):
        copy = nnx.clone(reference)
        for i in range(k):
            copy(host_batch["x"][rows[i::k]])
        stats.append(nnx.state(copy.norm, nnx.BatchStat))
    expected = jax.tree.map(lambda *s: sum(s) / devices, *stats)
    assert_close(nnx.state(updated.norm, nnx.BatchStat), expected)
    # Eval mode: equal to the single-device full batch.
    reference.eval()
    model.eval()
    value, grads, _ = step(model, batch)
    assert_close((value, grads), nnx.value_and_grad(loss)(reference, host_batch))


def test_module_named_as_batch_is_rejected():
    model, batch = make_net(), make_batch()
    with pytest.raises(TypeError, match=r"`batch_argnums` names args\[0\], a Flax NNX graph node"):
        jaxga.value_and_grad(lambda b, m: loss(m, b), 1, num_microbatches=2, batch_argnums=0)(
            model, batch
        )


def test_filter_that_selects_nothing_is_rejected():
    model, batch = make_net(), make_batch()
    with pytest.raises(ValueError, match=r"args\[0\] .* selects none of its state"):
        jaxga.value_and_grad(loss, nnx.DiffState(0, nnx.Intermediate), num_microbatches=2)(
            model, batch
        )


def test_returning_the_module_is_rejected():
    model, batch = make_net(), make_batch()
    with pytest.raises(TypeError, match=r"returned an NNX graph node in its value or aux"):
        jaxga.value_and_grad(lambda m, b: (loss(m, b), m), num_microbatches=2, has_aux=True)(
            model, batch
        )


def test_module_as_keyword_argument_is_rejected():
    batch = make_batch()
    with pytest.raises(TypeError, match=r"kwargs\['model'\] holds a Flax NNX graph node"):
        jaxga.value_and_grad(lambda w, b, model: w * loss(model, b), num_microbatches=2)(
            1.0, batch, model=make_net()
        )


def test_the_nnx_example_runs_and_checks_itself():
    import runpy
    from pathlib import Path

    example = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "nnx_digits.py"))
    result = example["main"](["--steps", "20", "--batch-size", "32", "--microbatches", "4"])
    assert result["gap"] < 1e-5  # k micro-batches == full batch in eval mode
    assert result["stats_moved"] > 1e-3  # BatchNorm statistics were updated
    assert result["losses"][-1] < result["losses"][0]


def test_a_module_shared_between_arguments_is_named():
    model, batch = make_net(), make_batch()
    model.eval()

    def twice(models, batch):
        return loss(models[0], batch) + loss(models[1], batch)

    with pytest.raises(ValueError, match=r"args\[0\]\[0\] and args\[0\]\[1\] share state"):
        jaxga.value_and_grad(twice, num_microbatches=2)([model, model], batch)
    with pytest.raises(ValueError, match=r"args\[0\] and args\[1\] share state"):
        jaxga.value_and_grad(
            lambda a, b, batch: twice([a, b], batch), (0, 1), num_microbatches=2, batch_argnums=2
        )(model, model, batch)


@pytest.mark.parametrize("k", [1, 4])
def test_a_module_shared_inside_one_container_is_taken_apart_once(k):
    """nnx.List([m, m]): one gradient for the shared parameters, and its state (the call
    counter) advanced by both uses in every micro-batch, as nnx runs it."""
    model, batch = make_net(), make_batch()
    model.eval()

    def twice(models, batch):
        return loss(models[0], batch) + loss(models[1], batch)

    reference = nnx.clone(model)
    actual = jaxga.value_and_grad(twice, num_microbatches=k)(nnx.List([model, model]), batch)
    expected = nnx.value_and_grad(twice)(nnx.List([reference, reference]), batch)
    assert_close(actual, expected)
    assert int(model.calls[...]) == 2 * k


def test_indivisible_batch_on_a_mesh_in_the_global_view_names_all_numbers():
    # the one wiring onto a mesh (layouts.on_mesh) checks the rows for both steps, and for
    # NNX with reduce_once=False too
    mesh = jax.make_mesh((1,), ("data",))
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = jaxga.nnx_train_step(lambda m, x: jnp.mean(m(x) ** 2), 4, mesh=mesh, reduce_once=False)
    with pytest.raises(IndivisibleBatchError, match=r"num_microbatches=4 × 1 devices = 4"):
        step(model, optimizer, jnp.ones((6, 3)))


def test_a_loss_returning_a_vector_is_named_as_the_step_calls_it():
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = jaxga.nnx_train_step(lambda m, x: m(x), 2)
    with pytest.raises(TypeError, match=r"^`loss\(model, batch\)` must return a float scalar"):
        step(model, optimizer, jnp.ones((4, 3)))


def test_axis_name_without_a_mesh_binds_the_axis_in_both_steps():
    """`axis_name` alone: a one-device mesh of it, in both steps (steps.step_options), so that
    a loss's `pmean` over it runs; without it, JAX's NameError gets jaxga's note."""
    batch = jax.random.normal(jax.random.key(0), (8, 3))

    def pmeaned(model, x):
        return jax.lax.pmean(jnp.mean(model(x) ** 2), "data")

    def plain(model, x):
        return jnp.mean(model(x) ** 2)

    def run(loss, **options):
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        metrics = jaxga.nnx_train_step(loss, 2, donate=False, **options)(model, optimizer, batch)
        return metrics["loss"], nnx.state(model, nnx.Param)

    chex.assert_trees_all_close(run(pmeaned, axis_name="data"), run(plain), rtol=1e-6)
    step = jaxga.nnx_train_step(pmeaned, 2, axis_name="data")
    assert step.options.layout is not None and step.options.layout.mesh.shape == {"data": 1}
    with pytest.raises(NameError) as error:
        run(pmeaned)
    assert "axis_name=NAME" in "".join(error.value.__notes__)

    def flax_loss(params, x, model_state, rng):
        model = nnx.merge(graphdef, params)
        return pmeaned(model, x), model_state

    graphdef, params = nnx.split(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), nnx.Param)
    state = jaxga.TrainState.create(params=params, tx=optax.sgd(0.1))
    flax_step = jaxga.make_train_step(flax_loss, 2, axis_name="data", donate=False)
    new, metrics = flax_step(state, batch)
    chex.assert_trees_all_close(
        (metrics["loss"], nnx.State(new.params)), run(pmeaned, axis_name="data"), rtol=1e-6
    )
