"""jaxga.make_train_step against hand-written full-batch optax steps."""

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

BATCH = 16


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6):
    def key_data(x):
        return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x

    actual, expected = jax.tree.map(key_data, (actual, expected))
    chex.assert_trees_all_close(actual, expected, rtol=rtol, atol=atol)


def batches(n, seed=0, size=BATCH):
    out = []
    for i in range(n):
        kx, ky, kw = jax.random.split(jax.random.key(seed * 1000 + i), 3)
        out.append(
            {
                "x": jax.random.normal(kx, (size, 4)),
                "y": jax.random.randint(ky, (size,), 0, 3),
                # Skewed per-example weights: a mean of micro-batch means would be wrong.
                "w": jnp.where(jnp.arange(size) % 4 == 0, 5.0, 0.5)
                * jax.random.bernoulli(kw, 0.8, (size,)),
            }
        )
    return out


def xent(logits, batch):
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return jaxga.Mean.of(losses, where=batch["w"])


class NNXMLP(nnx.Module):
    def __init__(self, rate: float, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.drop = nnx.Dropout(rate)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x, rng=None):
        h = jax.nn.relu(self.hidden(x))
        return self.out(self.drop(h, deterministic=rng is None, rngs=rng))


def nnx_setup(rate=0.0):
    model = NNXMLP(rate, nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss = jaxga.nnx_loss(graphdef, lambda m, b, rng: xent(m(b["x"], rng if rate else None), b))
    return params, rest, loss


class LinenBN(nn.Module):
    train: bool

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not self.train, momentum=0.8)(x)
        return nn.Dense(3)(nn.relu(x))


def linen_setup(train):
    model = LinenBN(train)
    variables = LinenBN(True).init(jax.random.key(0), jnp.ones((2, 4)))
    params, model_state = variables["params"], {"batch_stats": variables["batch_stats"]}

    def loss(params, batch, model_state, rng):
        logits, updates = model.apply(
            {"params": params, **model_state}, batch["x"], mutable=list(model_state)
        )
        return xent(logits, batch), {**model_state, **updates}

    return params, model_state, loss


def reference_run(loss, params, model_state, optimizer, data):
    """A hand-written full-batch loop: jax.value_and_grad on the whole batch, then optax."""
    opt_state = optimizer.init(params)
    for batch in data:

        def value(p):
            mean, new_state = loss(p, batch, model_state, None)
            return mean.value, new_state

        (_, model_state), grads = jax.value_and_grad(value, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, model_state


def optimizer_fn():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-2))


@pytest.mark.parametrize("setup", ["nnx", "linen-eval"])
def test_matches_full_batch_training(setup):
    params, model_state, loss = nnx_setup() if setup == "nnx" else linen_setup(train=False)
    data = batches(3)
    expected_params, expected_state = reference_run(loss, params, model_state, optimizer_fn(), data)

    step = jaxga.make_train_step(loss, num_microbatches=4)
    # TrainState.create copies: the step donates the state's buffers, and the reference
    # still holds these.
    state = jaxga.TrainState.create(params=params, tx=optimizer_fn(), model_state=model_state)
    for batch in data:
        state, metrics = step(state, batch)
    assert_trees_close(state.params, expected_params)
    assert_trees_close(state.model_state, expected_state)
    assert int(state.step) == 3 and bool(metrics["applied"])
    np.testing.assert_allclose(metrics["count"], jnp.sum(data[-1]["w"]), rtol=1e-6)


def test_metrics_are_exact():
    params, rest, loss = nnx_setup()
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=optax.linear_schedule(0.1, 0.0, 10))
    batch = batches(1)[0]
    state = jaxga.TrainState.create(params=params, tx=tx, model_state=rest)
    _, metrics = jaxga.make_train_step(loss, 8, donate=False)(state, batch)

    def value(p):
        return loss(p, batch, rest, None)[0].value

    expected_loss, expected_grads = jax.value_and_grad(value)(params)
    np.testing.assert_allclose(metrics["loss"], expected_loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(expected_grads), rtol=1e-5)
    np.testing.assert_allclose(metrics["learning_rate"], 0.1, rtol=1e-6)


def test_dropout_key_per_microbatch():
    k, rate = 4, 0.5
    params, rest, loss = nnx_setup(rate)
    batch = batches(1)[0]
    tx = optax.sgd(0.1)
    state = jaxga.TrainState.create(params=params, tx=tx, model_state=rest, rng=7)
    new_state, _ = jaxga.make_train_step(loss, k, donate=False)(state, batch)

    # Reference: micro-batch i of step 0 uses fold_in(fold_in(key, 0), i).
    key = jax.random.fold_in(jax.random.key(7), 0)
    parts = jaxga.split_microbatches(batch, k)
    total, count = 0.0, 0.0
    for i in range(k):
        micro = jax.tree.map(lambda x: x[i], parts)
        g = jax.grad(lambda p: loss(p, micro, rest, jax.random.fold_in(key, i))[0].total)(params)
        total = jax.tree.map(lambda a, b: a + b, total, g) if i else g
        count += float(jnp.sum(micro["w"]))
    expected = jax.tree.map(lambda p, g: p - 0.1 * g / count, params, total)
    assert_trees_close(new_state.params, expected)

    # The same key for every micro-batch (the bug) gives different parameters.
    same_key_grads = [
        jax.grad(lambda p: loss(p, jax.tree.map(lambda x: x[i], parts), rest, key)[0].total)(params)
        for i in range(k)
    ]
    wrong = jax.tree.map(lambda p, *g: p - 0.1 * sum(g) / count, params, *same_key_grads)
    diffs = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(wrong), jax.tree.leaves(expected))]
    assert max(diffs) > 1e-4


def test_batchnorm_statistics_are_threaded():
    k = 4
    params, model_state, loss = linen_setup(train=True)
    batch = batches(1)[0]
    tx = optax.sgd(0.1)
    state = jaxga.TrainState.create(params=params, tx=tx, model_state=model_state)
    new_state, _ = jaxga.make_train_step(loss, k, donate=False)(state, batch)

    # Reference: a Python loop that threads batch_stats from one micro-batch to the next.
    parts = jaxga.split_microbatches(batch, k)
    stats, grads, count = model_state, [], 0.0
    for i in range(k):
        micro = jax.tree.map(lambda x: x[i], parts)
        (_, stats), g = jax.value_and_grad(
            lambda p, micro=micro, stats=stats: (lambda m, s: (m.total, s))(
                *loss(p, micro, stats, None)
            ),
            has_aux=True,
        )(params)
        grads.append(g)
        count += float(jnp.sum(micro["w"]))
    assert_trees_close(new_state.model_state, stats)
    expected = jax.tree.map(lambda p, *g: p - 0.1 * sum(g) / count, params, *grads)
    assert_trees_close(new_state.params, expected)
    # Four updates of the running mean, not one.
    one_update = loss(params, batch, model_state, None)[1]
    assert not np.allclose(
        stats["batch_stats"]["BatchNorm_0"]["mean"],
        one_update["batch_stats"]["BatchNorm_0"]["mean"],
    )


def test_variable_sequence_length_retraces_instead_of_failing():
    def loss(params, batch, model_state, rng):
        return jaxga.Mean.of(batch["x"] * params, where=batch["mask"]), model_state

    step = jaxga.make_train_step(loss, 2, donate=False)
    state = jaxga.TrainState.create(params=jnp.ones(()), tx=optax.sgd(0.1))
    for length in (4, 8):  # length buckets
        x = jnp.arange(4.0 * length).reshape(4, length)
        mask = jnp.ones((4, length)).at[0, 1:].set(0.0)
        _, metrics = step(state, {"x": x, "mask": mask})
        np.testing.assert_allclose(metrics["loss"], jnp.sum(x * mask) / jnp.sum(mask))


class NNXStateful(nnx.Module):
    """BatchNorm in training mode and a Dropout that owns its Rngs: state that changes."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, momentum=0.8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jax.nn.relu(self.norm(self.hidden(x)))))


def test_nnx_model_that_updates_its_state():
    k = 4
    model = NNXStateful(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss = jaxga.nnx_loss(graphdef, lambda m, b, rng: xent(m(b["x"]), b))
    batch = batches(1)[0]
    tx = optax.sgd(0.1)
    state = jaxga.TrainState.create(params=params, tx=tx, model_state=rest)
    new_state, _ = jaxga.make_train_step(loss, k)(state, batch)

    # Reference: a Python loop over the micro-batches threading the model's state.
    parts = jaxga.split_microbatches(batch, k)
    threaded, grads, count = rest, [], 0.0
    for i in range(k):
        micro = jax.tree.map(lambda x: x[i], parts)
        (_, threaded), g = jax.value_and_grad(
            lambda p, m=micro, s=threaded: (lambda out: (out[0].total, out[1]))(
                loss(p, m, s, None)
            ),
            has_aux=True,
        )(params)
        grads.append(g)
        count += float(jnp.sum(micro["w"]))
    expected = jax.tree.map(lambda p, *g: p - 0.1 * sum(g) / count, params, *grads)
    assert_trees_close(new_state.params, expected)
    assert_trees_close(new_state.model_state, threaded)
    # The user's model is untouched by the donation and still runs.
    assert jnp.isfinite(model(batch["x"])).all()


def _noisy_loss_with(rng):
    """The loss of one step whose loss draws noise from the step's key."""

    def loss(params, batch, model_state, rng):
        noise = jax.random.normal(rng, batch["x"].shape)
        return jaxga.Mean.of((batch["x"] + noise) * params), model_state

    state = jaxga.TrainState.create(params=jnp.ones(()), tx=optax.sgd(0.1), rng=rng)
    new_state, metrics = jaxga.make_train_step(loss, 2)(state, {"x": jnp.ones((4, 3))})
    assert int(new_state.step) == 1
    return float(metrics["loss"])


@pytest.mark.parametrize(
    "rng", [np.int64(3), jnp.int32(3), 3, jax.random.key_data(jax.random.key(3))]
)
def test_a_seed_or_key_data_is_the_key_it_names(rng):
    assert _noisy_loss_with(rng) == _noisy_loss_with(jax.random.key(3))


def test_the_key_is_used():
    losses = {_noisy_loss_with(rng) for rng in (3, 4, jax.random.key(3, impl="rbg"))}
    assert len(losses) == 3


def test_bad_arguments():
    tx = optax.sgd(0.1)
    with pytest.raises(TypeError, match="`rng` must be an integer seed or a single PRNG key"):
        jaxga.TrainState.create(params=jnp.ones(()), tx=tx, rng=1.5)
    with pytest.raises(TypeError, match=r"`rng` must be an integer seed .* got 'a'"):
        jaxga.TrainState.create(params=jnp.ones(()), tx=tx, rng="a")
    with pytest.raises(ValueError, match=r"`params` must be a pytree holding .* got None"):
        jaxga.TrainState.create(params=None, tx=tx)
    with pytest.raises(TypeError, match=r"`tx` must be an optax GradientTransformation.*'adam'"):
        jaxga.TrainState.create(jnp.ones(()), "adam")
    with pytest.raises(
        ValueError, match="`num_microbatches` must be a positive int or 'auto'; got 0"
    ):
        jaxga.make_train_step(lambda *a: a, 0)
    with pytest.raises(TypeError, match="`loss` must be callable as"):
        jaxga.make_train_step("loss", 2)
    with pytest.raises(
        TypeError, match=r"`loss\(params, batch, model_state, rng\)`; it takes \(p, b\)"
    ):
        jaxga.make_train_step(lambda p, b: (p, b), 2)
    with pytest.raises(
        TypeError,
        match=r"`loss\(model, batch\)` or `loss\(model, batch, rngs\)`; it takes \(model\)",
    ):
        jaxga.nnx_train_step(lambda model: 0.0, 2)
    with pytest.raises(TypeError, match=r"`mesh` must be a jax.sharding.Mesh .* got 'data'"):
        jaxga.make_train_step(lambda *a: a, 2, mesh="data")
    abstract = jax.sharding.AbstractMesh((1,), ("data",))
    with pytest.raises(TypeError, match=r"`mesh` must be a jax.sharding.Mesh .* AbstractMesh"):
        jaxga.make_train_step(lambda *a: a, 2, mesh=abstract)
    mesh = jax.make_mesh((1,), ("batch",))
    with pytest.raises(ValueError, match=r"`axis_name`='data' is not an axis of `mesh`"):
        jaxga.make_train_step(lambda *a: a, 2, mesh=mesh)
    with pytest.raises(ValueError, match=r"`strategy` must be one of 'data_parallel', .*'bogus'"):
        jaxga.make_train_step(lambda *a: a, 2, strategy="bogus")
    one = jax.make_mesh((1,), ("data",))
    for bad in (3, {"w": 3}):  # neither a name nor PartitionSpecs
        with pytest.raises(TypeError, match=rf"`strategy` must be one of .* got {bad!r}"):
            jaxga.make_train_step(lambda *a: a, 2, mesh=one, strategy=bad)
    state = jaxga.TrainState.create(params={"w": jnp.ones((2, 3))}, tx=optax.sgd(0.1))
    whole = jaxga.sharding.state_specs(state, one, "fsdp")  # not its .params

    def loss(params, batch, model_state, rng):
        return jnp.mean(batch @ params["w"]), model_state

    with pytest.raises(ValueError, match=r"got a TrainState of specs, .* pass its `.params`"):
        jaxga.make_train_step(loss, 1, mesh=one, strategy=whole)
    jaxga.make_train_step(loss, 1, mesh=one, strategy=whole.params)(state, jnp.ones((2, 2)))
    with pytest.raises(ValueError, match=r"`strategy`='fsdp' shards the state .* pass `mesh`"):
        jaxga.make_train_step(lambda *a: a, 2, strategy="fsdp")


def test_nnx_loss_names_a_bad_split():
    model = NNXStateful(nnx.Rngs(0))
    graphdef, params, _ = nnx.split(model, nnx.Param, ...)
    with pytest.raises(TypeError, match=r"`graphdef` must be an nnx GraphDef; got str"):
        jaxga.nnx_loss("mse", lambda m, b, rng: 0.0)
    with pytest.raises(TypeError, match=r"`loss` must be callable as `loss\(model, batch, rng\)`"):
        jaxga.nnx_loss(graphdef, "mse")
    loss = jaxga.nnx_loss(graphdef, lambda m, b, rng: xent(m(b["x"]), b))
    state = jaxga.TrainState.create(params=params, tx=optax.sgd(0.1))  # model_state forgotten
    with pytest.raises(
        ValueError,
        match=r"cannot rebuild the model from `params` and `model_state` \(Incorrect number of "
        r".*\): pass `model_state=rest`, from `graphdef, params, rest = nnx.split\(model, "
        r"nnx.Param, ...\)`, to jaxga.TrainState.create",
    ):
        jaxga.make_train_step(loss, 2)(state, batches(1)[0])


def test_bad_calls_name_what_was_wrong():
    batch = {"x": jnp.ones((4, 3))}
    state = jaxga.TrainState.create(params=jnp.ones(()), tx=optax.sgd(0.1))
    bare = jaxga.make_train_step(lambda p, b, s, r: jaxga.Mean.of(b["x"] * p), 2)
    with pytest.raises(TypeError, match=r"must return a pair \(loss, new_model_state\).*Mean"):
        bare(state, batch)

    def with_aux(p, b, s, r):
        return ((jaxga.Mean.of(b["x"] * p), {"acc": 1.0}), s)

    with pytest.raises(
        TypeError,
        match=r"`loss\(params, batch, model_state, rng\)` must give the loss alone.* no aux",
    ):
        jaxga.make_train_step(with_aux, 2)(state, batch)

    def aux_as_state(p, b, s, r):
        return (jaxga.Mean.of(b["x"] * p), {"acc": 1.0})

    with pytest.raises(
        TypeError, match=r"returned a new_state with extra keys \['acc'\] and missing keys \[\]"
    ):
        jaxga.make_train_step(aux_as_state, 2)(state, batch)
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def nnx_with_aux(m, b):
        return (jnp.mean(m(b["x"]) ** 2), {"y": m(b["x"])})

    with pytest.raises(TypeError, match=r"`loss\(model, batch\)` must give the loss alone"):
        jaxga.nnx_train_step(nnx_with_aux, 2)(model, optimizer, batch)
    step = jaxga.make_train_step(lambda p, b, s, r: (jaxga.Mean.of(b["x"] * p), s), 2)
    with pytest.raises(TypeError, match=r"`state` must be a flax.training.train_state.TrainState"):
        step({"params": jnp.ones(())}, batch)
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"got Linear; for a Flax NNX model .*jaxga.nnx_train_step"):
        step(model, batch)
    new_state, _ = step(state, batch)
    with pytest.raises(ValueError, match="an earlier call deleted: it donates"):
        step(state, batch)  # the state given to the first call was donated
    for empty in (None, {}):
        with pytest.raises(ValueError, match=rf"`batch` must hold arrays, .* got {empty!r}"):
            step(new_state, empty)
    step(new_state, batch)
    counted = jaxga.TrainState.create(params={"w": jnp.ones(()), "n": 3}, tx=optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"`state.params`\['n'\] has shape \(\) and dtype int"):
        step(counted, batch)
    flax_state = train_state.TrainState.create(
        apply_fn=None, params=jnp.ones(()), tx=optax.sgd(0.1)
    )
    step(flax_state, batch)  # its `step` a Python int: its parameters tell
    with pytest.raises(ValueError, match="an earlier call deleted: it donates"):
        step(flax_state, batch)


def test_memory_report_of_a_step_on_a_mesh():
    params, rest, loss = nnx_setup()
    mesh = jax.make_mesh((1,), ("data",))
    step = jaxga.make_train_step(loss, 2, mesh=mesh)
    state = jaxga.TrainState.create(params=params, tx=optax.sgd(0.1), model_state=rest)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batches(1)[0])
    report = jaxga.memory_report(step, state, abstract)
    plain = jaxga.memory_report(jaxga.make_train_step(loss, 2), state, abstract)
    assert report.argument_bytes == plain.argument_bytes > 0
    new_state, metrics = step(state, batches(1)[0])  # and it runs
    assert int(new_state.step) == 1 and jnp.isfinite(metrics["loss"])


@pytest.mark.parametrize("nested", [False, True], ids=["outermost", "in-a-chain"])
def test_multisteps_train_step_matches_full_batch(nested):
    """k=2 micro-batches in each call × MultiSteps over 2 calls == one step on both batches.

    The examples' weights differ between calls, so this only holds because the step
    hands MultiSteps the call's total weight (its Mean.count) as ``weight``, by itself for
    a jaxga.MultiSteps and for one in a chain.
    """
    params, rest, loss = nnx_setup()
    halves = batches(6, seed=3, size=BATCH // 2)
    wholes = [
        jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *halves[i : i + 2])
        for i in range(0, 6, 2)
    ]
    expected_params, _ = reference_run(loss, params, rest, optimizer_fn(), wholes)

    tx = jaxga.MultiSteps(optimizer_fn(), every_k=2)
    tx = optax.chain(optax.identity(), tx) if nested else tx
    step = jaxga.make_train_step(loss, num_microbatches=2)
    state = jaxga.TrainState.create(params=params, tx=tx, model_state=rest)
    applied = []
    for batch in halves:
        state, metrics = step(state, batch)
        applied.append(bool(metrics["applied"]))
    # in a chain too, `applied` reads the MultiSteps' state: the calls that ran its inner
    assert applied == [False, True] * 3
    assert_trees_close(state.params, expected_params)


class LinenState(train_state.TrainState):
    """A Linen user's own state: flax's TrainState with a batch_stats field."""

    batch_stats: dict


def test_a_linen_users_own_train_state_threads_its_batch_stats():
    params, model_state, loss = linen_setup(train=True)
    tx = optax.sgd(0.1)
    step = jaxga.make_train_step(loss, 4, donate=False)
    named = jaxga.make_train_step(loss, 4, donate=False, model_state_fields=["batch_stats"])
    ours = jaxga.TrainState.create(params=params, tx=tx, model_state=model_state)
    theirs = LinenState.create(
        apply_fn=None, params=params, tx=tx, batch_stats=model_state["batch_stats"]
    )
    for batch in batches(2):
        ours, _ = step(ours, batch)
        theirs, _ = named(theirs, batch)
    # the jaxga.TrainState run is checked against a Python loop above
    assert isinstance(theirs, LinenState) and int(theirs.step) == 2
    assert_trees_close(theirs.params, ours.params, rtol=0, atol=0)
    assert_trees_close(theirs.batch_stats, ours.model_state["batch_stats"], rtol=0, atol=0)
    assert not np.allclose(
        theirs.batch_stats["BatchNorm_0"]["mean"], model_state["batch_stats"]["BatchNorm_0"]["mean"]
    )


# ---------------------------------------------------------------- Flax NNX: nnx_train_step


class NNXEval(nnx.Module):
    """Linear, BatchNorm in eval mode and a counter of its own: the full batch's mathematics."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, use_running_average=True, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls[...] += 1
        return self.out(jax.nn.relu(self.norm(self.hidden(x))))


def nnx_loss_fn(model, batch):
    return xent(model(batch["x"]), batch)


def nnx_reference(tx, data):
    """The hand-written full-batch NNX loop: nnx.value_and_grad, then nnx.Optimizer."""
    model = NNXEval(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        grads = nnx.grad(lambda m: nnx_loss_fn(m, batch).value)(model)
        optimizer.update(model, grads)

    for batch in data:
        step(model, optimizer, batch)
    return nnx.as_pure(nnx.state(model, nnx.Param))


def wholes_and_halves(steps):
    halves = batches(2 * steps, seed=5, size=BATCH // 2)
    wholes = [
        jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *halves[i : i + 2])
        for i in range(0, 2 * steps, 2)
    ]
    return wholes, halves


def test_nnx_train_step_with_plain_optax_equals_the_full_batch_loop():
    data = batches(3)
    model = NNXEval(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optimizer_fn(), wrt=nnx.Param)
    step = jaxga.nnx_train_step(nnx_loss_fn, num_microbatches=4)
    for batch in data:
        metrics = step(model, optimizer, batch)
    chex.assert_trees_all_close(
        nnx.as_pure(nnx.state(model, nnx.Param)), nnx_reference(optimizer_fn(), data), rtol=1e-5
    )
    assert int(model.calls[...]) == 3 * 4  # the counter advanced once per micro-batch
    assert int(optimizer.step[...]) == 3 and bool(metrics["applied"])
    np.testing.assert_allclose(metrics["count"], jnp.sum(data[-1]["w"]), rtol=1e-6)


def test_nnx_optimizer_with_weighted_multisteps_equals_the_full_batch_loop():
    """Two calls of two micro-batches each == one full-batch step, with skewed weights."""
    wholes, halves = wholes_and_halves(3)
    model = NNXEval(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jaxga.MultiSteps(optimizer_fn(), 2), wrt=nnx.Param)
    step = jaxga.nnx_train_step(nnx_loss_fn, num_microbatches=2)
    applied = [bool(step(model, optimizer, batch)["applied"]) for batch in halves]
    assert applied == [False, True] * 3
    chex.assert_trees_all_close(
        nnx.as_pure(nnx.state(model, nnx.Param)), nnx_reference(optimizer_fn(), wholes), rtol=1e-5
    )


def test_nnx_optimizer_with_unweighted_multisteps_equals_the_full_batch_loop():
    """A user's own step: value_and_grad, then optimizer.update without a weight."""
    wholes, halves = wholes_and_halves(3)

    def unweighted(batch):
        return {**batch, "w": jnp.ones_like(batch["w"])}

    model = NNXEval(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jaxga.MultiSteps(optimizer_fn(), 2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        _, grads = jaxga.value_and_grad(nnx_loss_fn, num_microbatches=2)(model, batch)
        optimizer.update(model, grads)

    for batch in halves:
        step(model, optimizer, unweighted(batch))
    expected = nnx_reference(optimizer_fn(), [unweighted(b) for b in wholes])
    chex.assert_trees_all_close(nnx.as_pure(nnx.state(model, nnx.Param)), expected, rtol=1e-5)


def test_nnx_train_step_bad_optimizers():
    model = NNXEval(nnx.Rngs(0))
    step = jaxga.nnx_train_step(nnx_loss_fn, num_microbatches=2)
    batch = batches(1)[0]
    with pytest.raises(
        ValueError, match=r"`optimizer.wrt` must select floats; got .*\['calls'\] of dtype int32"
    ):
        step(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Variable), batch)
    with pytest.raises(TypeError, match=r"`optimizer` must be an nnx.Optimizer.*got Linear"):
        step(model, nnx.Linear(2, 2, rngs=nnx.Rngs(0)), batch)
    with pytest.raises(TypeError, match=r"`loss` must be callable as `loss\(model, batch\)"):
        jaxga.nnx_train_step("mse")
    # built for another model, whose kernel broadcasts against this one's
    small = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    other = nnx.Optimizer(nnx.Linear(3, 2, rngs=nnx.Rngs(1)), optax.adam(0.1), wrt=nnx.Param)
    small_step = jaxga.nnx_train_step(lambda m, b: jnp.mean(m(b["x"]) ** 2), 2)
    with pytest.raises(ValueError, match=r"changes the shape of .*bias.* from \(1,\) to \(2,\)"):
        small_step(small, other, {"x": jnp.ones((4, 3))})
    assert small.kernel.shape == (3, 1)


def test_steps_with_xla_options_run_inside_an_enclosing_jit():
    """XLA options belong to the outermost jit: under one, the steps inline themselves.

    The GPU options are given here (the CPU compiler accepts and ignores them), so that
    the test means the same on every backend.
    """
    from jaxga.compiler import _GPU_OPTIONS

    params, rest, loss = nnx_setup()
    batch = batches(1)[0]
    step = jaxga.make_train_step(loss, 2, donate=False, compiler_options=_GPU_OPTIONS)
    state = jaxga.TrainState.create(params=params, tx=optax.sgd(0.1), model_state=rest)
    direct, _ = step(state, batch)
    nested, _ = jax.jit(step)(state, batch)
    assert_trees_close(nested.params, direct.params, rtol=1e-6)

    models = [NNXEval(nnx.Rngs(0)) for _ in range(2)]
    optimizers = [nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in models]
    nnx_step = jaxga.nnx_train_step(nnx_loss_fn, 2, compiler_options=_GPU_OPTIONS)
    nnx_step(models[0], optimizers[0], batch)
    nnx.jit(nnx_step)(models[1], optimizers[1], batch)
    chex.assert_trees_all_close(*(nnx.as_pure(nnx.state(m, nnx.Param)) for m in models), rtol=1e-6)


def test_create_copies_what_the_step_donates():
    params, key = {"w": jnp.ones(3)}, jax.random.key(5)

    def loss(params, batch, model_state, rng):
        return jaxga.Mean.of(batch["x"] @ params["w"] + jax.random.normal(rng)), model_state

    state = jaxga.TrainState.create(params=params, tx=optax.sgd(0.1), rng=key)
    jaxga.make_train_step(loss, 2)(state, {"x": jnp.ones((4, 3))})
    assert not params["w"].is_deleted() and not jax.random.key_data(key).is_deleted()
    assert state.params["w"].is_deleted()  # the state's own copy was donated


class KeyedState(train_state.TrainState):
    """As the Flax dropout guide writes it: a `key` field, plus a field that is no
    variable collection (a counter standing in for Flax's dynamic_scale)."""

    batch_stats: dict
    key: jax.Array
    scale: jax.Array


def test_a_flax_state_with_a_key_field_draws_from_it_and_leaves_other_fields_alone():
    params, model_state, bn_loss = linen_setup(train=True)
    seen = {}

    def loss(params, batch, model_state, rng):
        seen["model_state"], seen["rng"] = sorted(model_state), rng
        return bn_loss(params, batch, model_state, rng)

    state = KeyedState.create(
        apply_fn=None,
        params=jax.tree.map(jnp.copy, params),
        tx=optax.sgd(0.1),
        batch_stats=model_state["batch_stats"],
        key=jax.random.key(4),
        scale=jnp.float32(2.0),
    )
    step = jaxga.make_train_step(
        loss, 2, donate=False, model_state_fields=("batch_stats",), rng_field="key"
    )
    new, _ = step(state, batches(1)[0])
    assert seen["model_state"] == ["batch_stats"] and seen["rng"] is not None
    assert float(new.scale) == 2.0 and int(new.step) == 1
    assert not np.allclose(
        new.batch_stats["BatchNorm_0"]["mean"], model_state["batch_stats"]["BatchNorm_0"]["mean"]
    )


def test_late_bad_options_are_named_when_the_step_is_built():
    mesh = jax.make_mesh((1,), ("data",))

    def loss(p, b, s, r):
        return (jaxga.Mean.of(b["x"] * p), s)

    with pytest.raises(ValueError, match=r"`strategy` must be one of .* got 'fsdpp'"):
        jaxga.make_train_step(loss, 2, mesh=mesh, strategy="fsdpp")
    with pytest.raises(TypeError, match=r"`donate` must be a bool; got 'no'"):
        jaxga.make_train_step(loss, 2, donate="no")
    with pytest.raises(TypeError, match=r"`donate` must be a bool; got 1"):
        jaxga.nnx_train_step(nnx_loss_fn, 2, donate=1)
    bare = jaxga.make_train_step(lambda p, b, s, r: jnp.mean(b["x"] * p), 2)
    state = jaxga.TrainState.create(jnp.ones(()), optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"must return a pair .* got an array of shape \(\)"):
        bare(state, {"x": jnp.ones((4, 3))})


def test_nnx_train_step_donates_unless_told_not_to():
    batch = batches(1)[0]
    for donate in (True, False):
        model = NNXEval(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
        kernel = model.out.kernel[...]
        jaxga.nnx_train_step(nnx_loss_fn, 2, donate=donate)(model, optimizer, batch)
        assert kernel.is_deleted() == donate
        assert jnp.isfinite(model.out.kernel[...]).all()


def test_an_optimiser_where_the_micro_batch_count_goes_is_explained():
    with pytest.raises(TypeError, match=r"make_train_step takes no optimiser .*state.tx"):
        jaxga.make_train_step(lambda p, b, s, r: (0.0, s), optax.adam(1e-3))


def test_nnx_train_step_is_sized_without_running():
    """memory_report takes the NNX step's own arguments: fewer bytes with more
    micro-batches, and the model is neither run nor donated."""
    model = NNXEval(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    before = jax.tree.map(jnp.copy, nnx.as_pure(nnx.state(model)))
    batch = {
        "x": jax.ShapeDtypeStruct((512, 4), jnp.float32),
        "y": jax.ShapeDtypeStruct((512,), jnp.int32),
        "w": jax.ShapeDtypeStruct((512,), jnp.float32),
    }
    reports = [
        jaxga.memory_report(jaxga.nnx_train_step(nnx_loss_fn, k), model, optimizer, batch)
        for k in (1, 8)
    ]
    assert reports[1].temp_bytes < reports[0].temp_bytes
    chex.assert_trees_all_equal(nnx.as_pure(nnx.state(model)), before)
    assert int(optimizer.step[...]) == 0


def test_nnx_train_step_threads_dropout_and_batchnorm_as_value_and_grad_does():
    """BatchNorm in training mode and a Dropout with its own Rngs: the step equals a
    user's nnx.jit step of jaxga.value_and_grad + optimizer.update (itself checked against
    sequential micro-batches in test_nnx.py); statistics move, masks advance per call."""
    batch, k = batches(1)[0], 4

    def loss(m, b):
        return xent(m(b["x"]), b)

    models = [NNXStateful(nnx.Rngs(0)) for _ in range(2)]
    optimizers = [nnx.Optimizer(m, optax.adam(0.05), wrt=nnx.Param) for m in models]

    @nnx.jit
    def by_hand(model, optimizer, batch):
        acc = jaxga.accumulate(loss, num_microbatches=k)(model, batch)
        optimizer.update(model, acc.grads, weight=acc.mean.count)
        return acc.mean.value

    step = jaxga.nnx_train_step(loss, k)
    losses = [[], []]
    for _ in range(2):
        losses[0].append(float(step(models[0], optimizers[0], batch)["loss"]))
        losses[1].append(float(by_hand(models[1], optimizers[1], batch)))
    state = [nnx.as_pure(nnx.state(m)) for m in models]
    assert_trees_close(state[0], state[1], rtol=1e-6)
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    assert losses[0][0] != losses[0][1]  # new masks (and parameters) on the second call
    fresh = nnx.as_pure(nnx.state(NNXStateful(nnx.Rngs(0))))
    assert not np.allclose(state[0]["norm"]["mean"], fresh["norm"]["mean"])

    def count(s):
        return int(s["drop"]["rngs"]["count"])

    assert count(state[0]) == count(fresh) + 2 * k  # one draw per micro-batch


def test_a_call_that_counts_no_items_leaves_the_parameters_and_optimiser_alone():
    """An all-padding batch (count 0) has no gradient (0 / 0): the optimiser does not
    run, and the next call goes on as if it had not happened, as optax alone would."""

    def loss(params, batch, model_state, rng):
        return jaxga.Mean.of((batch["x"] @ params) ** 2, where=batch["m"]), model_state

    tx = optax.adamw(0.1, weight_decay=0.1)
    params = jnp.arange(3.0)
    padding = {"x": jnp.ones((4, 3)), "m": jnp.zeros(4)}
    counted = {"x": jnp.arange(12.0).reshape(4, 3) / 10, "m": jnp.ones(4)}
    step = jaxga.make_train_step(loss, 2)
    state = jaxga.TrainState.create(params=params, tx=tx)
    state, metrics = step(state, padding)
    assert not metrics["applied"] and int(state.step) == 1
    chex.assert_trees_all_equal((state.params, state.opt_state), (params, tx.init(params)))
    state, metrics = step(state, counted)
    grads = jax.grad(lambda p: jnp.mean((counted["x"] @ p) ** 2))(params)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert metrics["applied"]
    chex.assert_trees_all_close(state.params, optax.apply_updates(params, updates), rtol=1e-6)

    # donated or not (a cond or a select); sm3's state holds lists, which nnx.Optimizer
    # hands back as nnx.States
    for donate in (True, False):
        for nnx_tx in (tx, optax.sm3(0.1)):
            model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, nnx_tx, wrt=nnx.Param)
            before = jax.tree.map(jnp.copy, nnx.state((model, optimizer)))

            def nnx_loss(m, b):
                return jaxga.Mean.of(m(b["x"])[:, 0] ** 2, where=b["m"])

            nnx_step = jaxga.nnx_train_step(nnx_loss, 2, donate=donate)
            assert not nnx_step(model, optimizer, padding)["applied"]
            # leaves: nnx.Optimizer itself turns sm3's lists into nnx.States on update
            chex.assert_trees_all_equal(
                jax.tree.leaves(nnx.state((model, optimizer))), jax.tree.leaves(before)
            )
            assert nnx_step(model, optimizer, counted)["applied"]
    not_donated = jaxga.make_train_step(loss, 2, donate=False)
    state = jaxga.TrainState.create(params=params, tx=tx)
    state, metrics = not_donated(state, padding)
    chex.assert_trees_all_equal((state.params, state.opt_state), (params, tx.init(params)))


def test_a_call_that_counts_no_items_reaches_a_multisteps_with_zero_gradients():
    """The call is one of the MultiSteps group's (weight 0); a partition beside it sees a
    zero gradient, not 0 / 0."""

    def loss(params, batch, model_state, rng):
        value = (batch["x"] @ params["w"] + params["b"]) ** 2
        return jaxga.Mean.of(value, where=batch["m"]), model_state

    sgd_beside = optax.sgd(0.1)
    tx = optax.multi_transform(
        {"acc": jaxga.MultiSteps(optax.sgd(0.1), every_k=2), "sgd": sgd_beside},
        {"w": "acc", "b": "sgd"},
    )
    params = {"w": jnp.arange(3.0), "b": jnp.ones(())}
    state = jaxga.TrainState.create(params=params, tx=tx)
    step = jaxga.make_train_step(loss, 2, weight=True)  # the chain holding MultiSteps: told
    counted = {"x": jnp.arange(12.0).reshape(4, 3) / 10, "m": jnp.ones(4)}
    state, _ = step(state, counted)
    state, metrics = step(state, {"x": jnp.ones((4, 3)), "m": jnp.zeros(4)})
    # the group of two calls is complete: it applies the first's (the MultiSteps' state in
    # the multi_transform's says so)
    assert metrics["applied"]
    grads = jax.grad(lambda p: jnp.mean((counted["x"] @ p["w"] + p["b"]) ** 2))(params)
    expected_b = params["b"] - 0.1 * grads["b"]  # the second call gave b a zero gradient
    chex.assert_trees_all_close(
        state.params, {"w": params["w"] - 0.1 * grads["w"], "b": expected_b}, rtol=1e-6
    )


def test_an_optimiser_holding_the_parameters_themselves_can_be_donated():
    """optax.contrib.prodigy keeps the initial parameters in its state: the very arrays,
    which a call may not donate twice. Both steps still train as plain optax does."""
    tx = optax.contrib.prodigy(0.5)
    x = jnp.arange(12.0).reshape(4, 3) / 10

    def loss(params, batch, model_state, rng):
        return jnp.mean((batch["x"] @ params) ** 2), model_state

    params = jnp.ones((3, 2))
    state = jaxga.TrainState.create(params=params, tx=tx)
    step = jaxga.make_train_step(loss, 2)
    expected, opt_state = params, tx.init(params)
    for _ in range(2):
        state, _ = step(state, {"x": x})
        grads = jax.grad(lambda p: jnp.mean((x @ p) ** 2))(expected)
        updates, opt_state = tx.update(grads, opt_state, expected)
        expected = optax.apply_updates(expected, updates)
    chex.assert_trees_all_close(state.params, expected, rtol=1e-5)

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    reference = nnx.Linear(3, 2, rngs=nnx.Rngs(0))  # not a clone: that shares the arrays
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    reference_optimizer = nnx.Optimizer(reference, tx, wrt=nnx.Param)
    nnx_step = jaxga.nnx_train_step(lambda m, b: jnp.mean(m(b["x"]) ** 2), 2)
    for _ in range(2):
        nnx_step(model, optimizer, {"x": x})
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(reference)
        reference_optimizer.update(reference, grads)
    chex.assert_trees_all_close(
        nnx.state(model, nnx.Param), nnx.state(reference, nnx.Param), rtol=1e-5
    )


def test_a_call_that_counts_no_items_keeps_the_dtypes_the_optimiser_gives():
    """inject_hyperparams keeps float32 moments for bfloat16 parameters: a kept state
    takes the update's dtypes (values unchanged), as plain optax's first update does."""
    params = {"w": jnp.ones((3, 2), jnp.bfloat16), "b": jnp.zeros(2)}
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2)

    def loss(params, batch, model_state, rng):
        out = batch["x"] @ params["w"].astype(jnp.float32) + params["b"]
        return jaxga.Mean.of(jnp.sum(out**2, -1), where=batch["m"]), model_state

    x = jnp.arange(12.0).reshape(4, 3) / 10
    state = jaxga.TrainState.create(params=params, tx=tx)
    step = jaxga.make_train_step(loss, 2)
    state, metrics = step(state, {"x": x, "m": jnp.zeros(4)})
    assert not metrics["applied"]
    chex.assert_trees_all_equal(state.params, params)
    state, _ = step(state, {"x": x, "m": jnp.ones(4)})
    grads = jax.grad(
        lambda p: jnp.mean(jnp.sum((x @ p["w"].astype(jnp.float32) + p["b"]) ** 2, -1))
    )(params)
    updates, _ = tx.update(grads, tx.init(params), params)
    chex.assert_trees_all_close(state.params, optax.apply_updates(params, updates), rtol=1e-2)


def test_a_state_holding_one_buffer_twice_is_donated_on_a_mesh_and_after_device_put():
    def loss(params, batch, model_state, rng):
        return jnp.mean((batch["x"] @ params) ** 2), model_state

    def aliased():
        state = jaxga.TrainState.create(params=jnp.ones((3, 2)), tx=optax.contrib.prodigy(0.5))
        # prodigy's initial parameters as another array object over the params' buffer
        params0 = jax.device_put(state.params, jax.devices()[0])
        return state.replace(opt_state=state.opt_state._replace(params0=params0))

    batch = {"x": jnp.ones((4, 3))}
    for mesh in (None, jax.make_mesh((1,), ("data",))):
        _, metrics = jaxga.make_train_step(loss, 2, mesh=mesh)(aliased(), batch)
        assert metrics["applied"] and jnp.isfinite(metrics["loss"])


def test_nnx_train_step_takes_a_model_and_optimizer():
    """nnx.ModelAndOptimizer holds its model and updates it with update(grads)."""
    x = jnp.arange(12.0).reshape(4, 3) / 10

    def loss(m, b):
        return jnp.mean(m(b["x"]) ** 2)

    model, reference = (nnx.Linear(3, 2, rngs=nnx.Rngs(0)) for _ in range(2))
    optimizer = nnx.ModelAndOptimizer(model, optax.adam(0.1))
    reference_optimizer = nnx.Optimizer(reference, optax.adam(0.1), wrt=nnx.Param)
    step = jaxga.nnx_train_step(loss, 2)
    for _ in range(2):
        step(optimizer.model, optimizer, {"x": x})
        reference_optimizer.update(reference, nnx.grad(lambda m: loss(m, {"x": x}))(reference))
    chex.assert_trees_all_close(
        nnx.state(model, nnx.Param), nnx.state(reference, nnx.Param), rtol=1e-5
    )
    with pytest.raises(ValueError, match=r"ModelAndOptimizer of another model"):
        step(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optimizer, {"x": x})


def test_applied_follows_optax_multisteps_too():
    def loss(params, batch, model_state, rng):
        return jnp.mean((batch["x"] @ params) ** 2), model_state

    tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=3)
    params = jnp.ones((3, 2))
    state = jaxga.TrainState.create(params=params, tx=tx)
    step = jaxga.make_train_step(loss, 2)
    opt_state = tx.init(params)
    for i in range(6):
        x = jnp.full((4, 3), i / 10)
        state, metrics = step(state, {"x": x})
        grads = jax.grad(lambda p: jnp.mean((x @ p) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        assert bool(metrics["applied"]) == bool(tx.has_updated(opt_state))
    chex.assert_trees_all_close(state.params, params, rtol=1e-6)


# ------------------------------------------------- a train step's loss, named as the step calls it


def test_a_train_step_names_its_loss_not_fun_and_notes_rng_none_only_where_it_explains():
    def vector(params, batch, model_state, rng):
        return batch * params, model_state

    def new_state(params, batch, model_state, rng):
        return jnp.mean(batch * params), {"x": 1.0}

    def uses_key(params, batch, model_state, rng):
        return jnp.mean(batch * params * jax.random.normal(rng, (3,))), model_state

    flax_state = train_state.TrainState.create(apply_fn=None, params=jnp.ones(3), tx=optax.sgd(0.1))
    called_as = r"^`loss\(params, batch, model_state, rng\)` "
    with pytest.raises(TypeError, match=called_as + "must return a float scalar or a Mean") as e:
        jaxga.make_train_step(vector, 2)(flax_state, jnp.ones((4, 3)))
    assert not [n for n in getattr(e.value, "__notes__", []) if "rng=None" in n]

    def complex_valued(params, batch, model_state, rng):  # jax.grad takes no complex output
        return jnp.mean(batch * params).astype(jnp.complex64), model_state

    with pytest.raises(TypeError, match=called_as + r"must return a float .* dtype complex64"):
        jaxga.make_train_step(complex_valued, 2)(flax_state, jnp.ones((4, 3)))
    ours = jaxga.TrainState.create(params=jnp.ones(3), tx=optax.sgd(0.1))
    with pytest.raises(TypeError, match=called_as + r"returned a new_state with extra keys"):
        jaxga.make_train_step(new_state, 2)(ours, jnp.ones((4, 3)))
    with pytest.raises(TypeError, match="NoneType") as e:  # the key was None: noted
        jaxga.make_train_step(uses_key, 2)(flax_state, jnp.ones((4, 3)))
    assert [n for n in e.value.__notes__ if "the loss was given rng=None" in n]


def test_a_flax_step_inside_a_jit_checks_end_group():
    def loss(params, batch, model_state, rng):
        return jnp.mean((batch * params) ** 2), model_state

    step = jaxga.make_train_step(loss, 2, donate=False)
    state = jaxga.TrainState.create(params=jnp.ones(3), tx=optax.sgd(0.1))

    def in_jit(end_group):
        return jax.jit(lambda s, b: step(s, b, end_group=end_group))(state, jnp.ones((4, 3)))

    with pytest.raises(TypeError, match=r"^`end_group` must be a bool; got 3\."):
        in_jit(3)
    new, _ = in_jit(True)  # a bool, concrete or traced, passes
    _, metrics = jax.jit(lambda s, b, e: step(s, b, end_group=e))(state, jnp.ones((4, 3)), True)
    assert int(new.step) == 1 and bool(metrics["applied"])


def test_state_step_counts_calls_and_nnx_optimizer_step_counts_updates():
    """As documented (TrainStep, NNXTrainStep): a call counting nothing, unweighed, updates
    nothing; Flax's `state.step` counts it, NNX's `optimizer.step` does not."""
    batch = {"x": jnp.ones((4, 3)), "m": jnp.zeros(4)}

    def loss(params, batch, model_state, rng):
        return jaxga.Mean.of((batch["x"] @ params) ** 2, where=batch["m"]), model_state

    state = jaxga.TrainState.create(params=jnp.ones(3), tx=optax.sgd(0.1))
    new, metrics = jaxga.make_train_step(loss, 2)(state, batch)
    assert int(new.step) == 1 and not bool(metrics["applied"])
    chex.assert_trees_all_equal(new.params, jnp.ones(3))
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def nnx_loss(model, batch):
        return jaxga.Mean.of(model(batch["x"])[:, 0] ** 2, where=batch["m"])

    metrics = jaxga.nnx_train_step(nnx_loss, 2)(model, optimizer, batch)
    assert int(optimizer.step[...]) == 0 and not bool(metrics["applied"])


def _linear_loss(params, batch, model_state, rng):
    y = batch["x"] @ params["w"].astype(jnp.float32)
    return jaxga.Mean.of((y - batch["y"]) ** 2), model_state


def _linear_batch():
    x = jax.random.normal(jax.random.key(0), (8, 3))
    return {"x": x, "y": x @ jnp.arange(3.0)}


def test_a_weighted_update_keeps_each_gradients_dtype():
    """weight=True masks the gradient of a call that counted nothing: the mask keeps a
    bfloat16 gradient bfloat16, so Adam's moments keep the parameters' dtype, as unweighted."""
    params = {"w": jnp.ones(3, jnp.bfloat16)}
    states = {}
    for weight in (False, True):
        state = jaxga.TrainState.create(params=params, tx=optax.adam(1e-2))
        state, _ = jaxga.make_train_step(_linear_loss, 2, weight=weight)(state, _linear_batch())
        states[weight] = state
    assert states[True].opt_state[0].mu["w"].dtype == jnp.bfloat16
    chex.assert_trees_all_equal(states[True].params, states[False].params)
    chex.assert_trees_all_equal(states[True].opt_state, states[False].opt_state)


def test_applied_reads_an_optax_multisteps_in_a_chain():
    """`metrics["applied"]` with optax.MultiSteps(...).gradient_transformation() (no
    has_updated on the tx): optax's own rule, a group just ended, call by call; the
    parameters change only then."""
    inner = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    state = jaxga.TrainState.create(
        params={"w": jnp.zeros(3)}, tx=optax.chain(inner.gradient_transformation())
    )
    step = jaxga.make_train_step(_linear_loss, 2)
    for call in range(4):
        before = np.asarray(state.params["w"])  # the step donates the state
        state, metrics = step(state, _linear_batch())
        want = bool(inner.has_updated(state.opt_state[0]))
        assert bool(metrics["applied"]) == want == (call % 2 == 1)
        assert bool(jnp.any(state.params["w"] != before)) == want
