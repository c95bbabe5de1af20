"""What users tripped on (issue 22), each against an independent reference or its exact error."""

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxga


def dropout_loss(w, batch, key):  # a Linen-style loss with its dropout key as an argument
    keep = jax.random.bernoulli(key, 0.5, batch.shape)
    return jnp.mean(jnp.where(keep, batch * w, 0.0)), keep


def test_a_key_argument_gets_a_key_per_microbatch_by_default():
    x, key, k = jnp.ones((8, 16)), jax.random.key(3), 4
    vg = jaxga.value_and_grad(dropout_loss, num_microbatches=k, has_aux=True, aux="rows")
    (_, keep), _ = vg(2.0, x, key)
    parts = jaxga.split_microbatches(x, k)
    expected = [
        jax.random.bernoulli(jax.random.fold_in(key, i), 0.5, parts[i].shape) for i in range(k)
    ]
    np.testing.assert_array_equal(keep, jaxga.merge_microbatches(jnp.stack(expected)))


def test_a_raw_key_argument_is_named_with_what_to_pass():
    vg = jaxga.value_and_grad(dropout_loss, num_microbatches=2, has_aux=True)
    with pytest.raises(
        TypeError,
        match=r"args\[2\] holds a uint32\[2\] PRNG key: pass rng_argnums=2, or \(\)\.",
    ):
        vg(2.0, jnp.ones((4, 3)), jax.random.PRNGKey(0))
    shared = jaxga.value_and_grad(
        lambda w, x, key: jnp.mean(x * w) + 0 * jnp.sum(key), num_microbatches=2, rng_argnums=()
    )
    value, _ = shared(2.0, jnp.ones((4, 3)), jax.random.PRNGKey(0))  # opted in: no error
    assert float(value) == 2.0


@pytest.mark.parametrize(
    "batch, message",
    [
        ({"x": jnp.ones((4, 2)), "split": "train"}, r"args\[1\]\['split'\] is a str"),
        ({"x": jnp.ones((4, 2)), "n": 3}, r"args\[1\]\['n'\] is a scalar"),
        (
            {"x": jnp.ones((4, 2)), "id": np.array(list("abcd"))},
            r"\['id'\] must hold numbers or bools; got dtype <U1",
        ),
        (
            {"x": jnp.ones((0, 2))},
            r"`batch_argnums` names args\[1\], with no array leaves or rows",
        ),
    ],
)
def test_bad_batch_leaves_are_named(batch, message):
    with pytest.raises((TypeError, ValueError), match=message):
        jaxga.grad(lambda w, b: jnp.mean(b["x"] * w), num_microbatches=2)(1.0, batch)


def test_an_argument_of_examples_left_whole_is_named_in_the_error():
    def loss(p, x, y):
        return jnp.mean((x @ p - y) ** 2)

    p, x, y = jnp.arange(3.0), jnp.ones((8, 3)), jnp.arange(8.0)
    with pytest.raises(TypeError, match="incompatible shapes") as error:
        jaxga.value_and_grad(loss, num_microbatches=2)(p, x, y)
    assert error.value.__notes__[0] == (
        "jaxga: not split, yet of the batch's 8 rows: args[2]; to split them too, pass "
        "batch_argnums=(1, 2)."
    )
    split = jaxga.value_and_grad(loss, num_microbatches=2, batch_argnums=(1, 2))(p, x, y)
    chex.assert_trees_all_close(split, jax.value_and_grad(loss)(p, x, y), rtol=1e-6)


def test_the_note_names_no_module_and_never_hides_the_error():
    teacher = nnx.Linear(3, 3, rngs=nnx.Rngs(0))  # a frozen module of 3 rows, as the batch

    def loss(p, x, model):
        return jnp.mean(model(x) @ p[:2])

    with pytest.raises(TypeError, match="dot_general requires contracting") as error:
        jaxga.value_and_grad(loss, num_microbatches=3)(jnp.ones(3), jnp.ones((3, 3)), teacher)
    assert not [note for note in error.value.__notes__ if note.startswith("jaxga")]
    with pytest.raises(TypeError, match="dot_general requires contracting"):  # nothing split
        jaxga.value_and_grad(
            lambda p, x: jnp.mean(x @ p[:2]), num_microbatches=2, batch_argnums=()
        )(jnp.ones(3), jnp.ones((4, 3)))


def test_a_model_given_as_the_loss_is_named():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    expected = r"must be .*; got a Flax NNX Linear\.$"
    with pytest.raises(TypeError, match=r"^`fun` " + expected):
        jaxga.value_and_grad(model, num_microbatches=2)
    with pytest.raises(TypeError, match=r"^`loss` " + expected):
        jaxga.nnx_train_step(model, 2)


def test_a_train_step_checks_its_accumulator_dtype_when_built():
    def loss(params, batch, model_state, rng):
        return (jnp.mean(batch * params), model_state)

    with pytest.raises(TypeError, match=r"^`accumulator_dtype` must be a floating dtype"):
        jaxga.make_train_step(loss, 2, accumulator_dtype=jnp.int8)


@pytest.mark.parametrize(
    "out, message",
    [
        (lambda x: jnp.sum(x).astype(jnp.int32), r"it returned shape \(\) and dtype int32"),
        (lambda x: None, r"it returned None of type NoneType"),
        (lambda x: jaxga.Mean(jnp.sum(x), jnp.float32(-2.0)), r"counts summed to -4.0 items"),
        (lambda x: jaxga.Mean(jnp.sum(x), jnp.nan), r"counts summed to nan items"),
    ],
)
def test_bad_loss_outputs_are_named(out, message):
    with pytest.raises((TypeError, ValueError), match=message):
        jaxga.grad(lambda w, x: out(w * x), num_microbatches=2)(1.0, jnp.ones(4))


def test_a_batch_read_from_a_closure_is_told_to_pass_the_batch():
    batch = jnp.ones(4)
    with pytest.raises(
        ValueError,
        match=r"`batch_argnums`=\(1,\), but `fun` got 1 arguments\. Pass the batch as an argument",
    ):
        jaxga.grad(lambda w: jnp.mean(w * batch), num_microbatches=2)(1.0)


def test_per_example_aux_needs_no_second_call():
    """Flax's own metrics call (logits [B, C] against labels [B]) takes the aux as it is,
    named `"rows"` (by default it would be `[k, B // k, C]`, each micro-batch's)."""
    w, x = (
        jax.random.normal(jax.random.key(0), (3, 5)),
        jax.random.normal(jax.random.key(1), (8, 3)),
    )
    labels = jnp.arange(8) % 5

    def loss(w, batch):
        logits = batch[0] @ w
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean(), logits

    vg = jaxga.value_and_grad(loss, num_microbatches=4, has_aux=True, aux="rows")
    (_, logits), _ = vg(w, (x, labels))
    metrics = nnx.metrics.Accuracy()
    metrics.update(logits=logits, labels=labels)  # raised "expected logits.ndim == 2" before
    chex.assert_trees_all_close(logits, x @ w, rtol=1e-6)


class EqxMLP(eqx.Module):
    layers: list
    activation: callable = eqx.field(static=False)  # a non-array leaf (a custom_jvp)
    steps: jax.Array  # an integer leaf: not differentiated

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.layers = [eqx.nn.Linear(3, 8, key=k1), eqx.nn.Linear(8, 2, key=k2)]
        self.activation = jax.nn.relu
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        return self.layers[1](self.activation(self.layers[0](x)))


def eqx_loss(model, batch):
    preds = jax.vmap(model)(batch["x"])
    return jaxga.Mean.of(jnp.sum((preds - batch["y"]) ** 2, -1), where=batch["w"])


def test_equinox_modules_are_exact_against_filter_value_and_grad():
    model = EqxMLP(jax.random.key(0))
    keys = jax.random.split(jax.random.key(1), 3)
    batch = {
        "x": jax.random.normal(keys[0], (12, 3)),
        "y": jax.random.normal(keys[1], (12, 2)),
        "w": (jax.random.uniform(keys[2], (12,)) > 0.4).astype(jnp.float32),
    }
    value, grads = eqx.filter_jit(jaxga.value_and_grad(eqx_loss, num_microbatches=4))(model, batch)
    expected = eqx.filter_value_and_grad(lambda m, b: eqx_loss(m, b).value)(model, batch)
    assert isinstance(grads, EqxMLP) and grads.steps is None
    chex.assert_trees_all_close((value, grads), expected, rtol=2e-5, atol=1e-6)


def conv_loss(params, batch):
    y = jax.lax.conv_general_dilated(
        batch, params, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return jnp.mean(jnp.tanh(y) ** 2)


@pytest.mark.parametrize("unroll", [1, True])
def test_the_micro_batch_loop_unrolls_only_when_asked_and_stays_exact(unroll):
    """`unroll` is lax.scan's: the default keeps the loop (one micro-batch's activations at
    a time) on every backend; `unroll=True` removes it (faster convolutions on XLA:CPU,
    benchmarks/cnn_cpu.py)."""
    params = jax.random.normal(jax.random.key(0), (3, 3, 2, 4))
    batch = jax.random.normal(jax.random.key(1), (8, 6, 6, 2))
    step = jax.jit(jaxga.value_and_grad(conv_loss, num_microbatches=4, unroll=unroll))
    has_loop = " while(" in step.lower(params, batch).as_text(dialect="hlo")
    assert has_loop == (unroll is not True)
    chex.assert_trees_all_close(
        step(params, batch), jax.value_and_grad(conv_loss)(params, batch), rtol=2e-5, atol=1e-6
    )


def train_loss(params, batch, model_state, rng):
    return jnp.mean((batch["x"] @ params["w"]) ** 2), model_state


@pytest.mark.parametrize(
    "create, error, message",
    [
        (lambda m: dict(params=m), TypeError, r"`params` is \(or holds\) a module; split it as"),
        (
            lambda m: dict(params=nnx.split(m)[1]),
            ValueError,
            r"holds \['BatchStat'\] besides nnx.Param",
        ),
        (lambda m: dict(params={"w": "abc"}), TypeError, r"params\['w'\] is 'abc' of type str"),
        (
            lambda m: dict(params={"w": jnp.ones(2)}, model_state="bn"),
            TypeError,
            r"model_state is 'bn'",
        ),
    ],
)
def test_train_state_create_names_what_it_was_given(create, error, message):
    model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.BatchNorm(2, rngs=nnx.Rngs(0)))
    with pytest.raises(error, match=message):
        jaxga.TrainState.create(tx=optax.sgd(0.1), **create(model))


def test_nnx_step_names_a_state_given_as_the_model_and_an_optimizer_of_another_model():
    model, other = nnx.Linear(3, 1, rngs=nnx.Rngs(0)), nnx.Linear(5, 2, rngs=nnx.Rngs(0))
    step = jaxga.nnx_train_step(lambda m, b: jnp.mean(m(b) ** 2), 2)
    optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    with pytest.raises(
        TypeError, match=r"`model` must be the NNX module `optimizer` updates; got State"
    ):
        step(nnx.state(model), optimizer, jnp.ones((4, 3)))
    with pytest.raises(ValueError, match=r"was it built for these parameters"):
        step(model, nnx.Optimizer(other, optax.adam(0.1), wrt=nnx.Param), jnp.ones((4, 3)))


@pytest.mark.parametrize("stream", [False, "layers"])
def test_an_optimiser_that_wants_other_parameters_is_named(stream):
    """`optax.lookahead` updates `optax.LookaheadParams` (its ``.fast``); given a dict, its
    update raised a bare AttributeError from optax, on every route."""
    from tests.test_streaming import train

    tx = optax.lookahead(optax.adam(0.05), 2, 0.5)
    message = (
        r"The optimiser's update fails on these parameters \('dict' object has no attribute "
        r"'fast'\): was it built for these parameters\?"
    )
    with pytest.raises(ValueError, match=message):
        train(1, "full", stream=stream, tx=tx, steps=1)


def test_an_equinox_module_passed_along_is_not_taken_apart():
    model = EqxMLP(jax.random.key(0))

    def loss(w, model, x):
        return jnp.mean(jax.vmap(model)(x * w) ** 2)

    x = jax.random.normal(jax.random.key(1), (8, 3))
    vg = eqx.filter_jit(jaxga.value_and_grad(loss, num_microbatches=2, batch_argnums=2))
    chex.assert_trees_all_close(
        vg(1.5, model, x), jax.value_and_grad(loss)(1.5, model, x), rtol=2e-5
    )


def test_a_flattened_per_token_aux_keeps_its_micro_batch_axis():
    """A (B*T,) leaf is not a row per example: stacked by default, `[k, B // k * T]`, and
    refused, its path named, if called `"rows"`."""
    x = jax.random.normal(jax.random.key(0), (8, 3, 2))

    def loss(w, x):
        return jnp.mean(x * w), (x * w).reshape(-1)

    as_rows = jaxga.value_and_grad(loss, num_microbatches=4, has_aux=True, aux="rows")
    with pytest.raises(TypeError, match=r"aux of shape \(12,\) .*'rows' leaf needs 2 rows"):
        as_rows(2.0, x)
    (_, aux), _ = jaxga.value_and_grad(loss, num_microbatches=4, has_aux=True)(2.0, x)
    parts = jaxga.split_microbatches(x, 4)
    chex.assert_trees_all_close(aux, jnp.stack([loss(2.0, parts[i])[1] for i in range(4)]))


def test_an_infinite_count_is_named_and_argnums_quoted_once():
    with pytest.raises(ValueError, match=r"counts summed to inf items"):
        jaxga.grad(lambda w, x: jaxga.Mean(jnp.sum(w * x), jnp.inf), num_microbatches=2)(
            1.0, jnp.ones(4)
        )
    with pytest.raises(TypeError, match=r"got '0'\.$"):
        jaxga.grad(lambda w, x: jnp.mean(w * x), argnums="0", num_microbatches=2)


def test_plan_names_a_batch_no_candidate_divides():
    def build(k, remat):
        raise jaxga.microbatch.IndivisibleBatchError.of(4, k, 8, "data")

    with pytest.raises(
        ValueError, match=r"^No num_microbatches splits the batch: The batch size 4 "
    ):
        jaxga.plan(build, jnp.ones(3), jnp.ones((4, 3)), budget="1MiB", remat=(None,))


def test_an_argument_left_whole_is_named_on_a_mesh_too():
    """jaxga's own shard_map over the batch's axes (an Explicit mesh, jit's global view):
    an argument left whole holds the whole batch's rows, and the note says so as on one
    device."""
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))

    def loss(p, x, y):
        return jnp.mean((x @ p - y) ** 2)

    with jax.set_mesh(mesh):
        p = jnp.arange(3.0)
        x = jax.device_put(jnp.ones((8, 3)), jax.P("data"))
        y = jax.device_put(jnp.arange(8.0), jax.P("data"))
        with pytest.raises(TypeError, match="incompatible shapes") as error:
            jax.jit(jaxga.value_and_grad(loss, num_microbatches=2))(p, x, y)
    assert (
        "jaxga: not split, yet of the batch's 8 rows: args[2]; to split them too, pass "
        "batch_argnums=(1, 2)." in error.value.__notes__
    )


def test_a_traced_num_real_microbatches_out_of_range_counts_nothing():
    """Traced, a `num_real_microbatches` outside 1..k cannot raise: no micro-batch counts,
    a Mean of no item, 0 / 0, its value and gradient NaN (never a plausible number); eagerly
    it raises."""
    x = jnp.arange(8.0)

    def run(n):
        def loss(w, x):
            return jaxga.Mean.of(x * w)

        return jaxga.value_and_grad(loss, num_microbatches=4, num_real_microbatches=n)(1.0, x)

    for n in (0, 5, -1):
        value, grad = jax.jit(run)(jnp.int32(n))
        assert jnp.isnan(value) and jnp.isnan(grad)
        with pytest.raises(ValueError, match=r"`num_real_microbatches` must be in 1\.\.4"):
            run(n)
    good = jax.jit(run)(jnp.int32(4))
    chex.assert_trees_all_close(good, jax.value_and_grad(lambda w: jnp.mean(x * w))(1.0))


def test_batch_arguments_of_different_sizes_are_named():
    loss = jaxga.value_and_grad(
        lambda w, x, y: jnp.mean(x * w) + jnp.mean(y), num_microbatches=2, batch_argnums=(1, 2)
    )
    with pytest.raises(ValueError, match=r"one batch size; got args\[1\] 8, args\[2\] 6"):
        loss(1.0, jnp.ones(8), jnp.ones(6))


def test_jaxgas_keywords_given_to_fun_are_accumulates_own():
    """The keywords a call of `fun` is checked against are `jaxga.accumulate`'s own."""
    import inspect

    from jaxga.arguments import _KEYWORDS

    assert set(inspect.signature(jaxga.accumulate).parameters) - {"fun"} == _KEYWORDS


# What a probe of the public API with a user's mistakes found (2026-11-29): each named.


def _loss(p, b, model_state, rng):  # make_train_step's loss
    return jnp.mean(b @ p), model_state


def test_an_axis_name_must_be_a_string_and_named_once():
    message = r"`axis_name` must be None, a mesh axis name \(a string\) .*; got 0, of type int"
    with pytest.raises(TypeError, match=message):  # JAX's collectives take 0 as a position
        jax.jit(jaxga.value_and_grad(lambda w, x: jnp.mean(x @ w), num_microbatches=2, axis_name=0))
    with pytest.raises(TypeError, match=message):
        jaxga.make_train_step(_loss, 2, axis_name=0)
    with pytest.raises(ValueError, match=r"`axis_name`=\('data', 'data'\) names an axis twice"):
        jaxga.make_train_step(_loss, 2, axis_name=("data", "data"))


@pytest.mark.parametrize(
    "batch, error, message",
    [
        (jnp.ones((6, 3)), ValueError, r"`batch`: The batch size 6 is not divisible by num_mic"),
        ({"x": jnp.ones((8, 3)), "n": 8}, ValueError, r"batch\['n'\] is a scalar \(8\)"),
        (jnp.ones((0, 3)), ValueError, r"`batch` must hold rows to split .*; got 0"),
    ],
)
def test_a_train_steps_batch_is_named_as_the_steps(batch, error, message):
    state = jaxga.TrainState.create(params=jnp.ones(3), tx=optax.sgd(0.1))
    step = jaxga.make_train_step(lambda p, b, s, r: _loss(p, jnp.asarray(b["x"]), s, r), 4)
    with pytest.raises(error, match=message):
        step(state, batch if isinstance(batch, dict) else {"x": batch})
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    nnx_step = jaxga.nnx_train_step(lambda m, b: jnp.mean(m(b["x"])), 4)
    with pytest.raises(error, match=message):
        nnx_step(model, optimizer, batch if isinstance(batch, dict) else {"x": batch})


def test_a_traced_scalar_leaf_is_named_by_its_dtype_not_its_tracer():
    step = jaxga.make_train_step(_loss, 2)
    state = jaxga.TrainState.create(params=jnp.ones(3), tx=optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"batch\['n'\] is a scalar \(int32\)") as error:
        jax.jit(step)(state, {"x": jnp.ones((4, 3)), "n": 4})
    assert "Tracer" not in str(error.value)


def test_complex_parameters_get_a_real_loss_as_jax_value_and_grad():
    def loss(p, x):
        return jnp.mean(jnp.abs(x @ p))

    p = jnp.arange(3.0).astype(jnp.complex64) * (1 + 2j)
    x = jnp.arange(24.0).reshape(8, 3)
    value, grads = jaxga.value_and_grad(loss, num_microbatches=4)(p, x)
    expected_value, expected_grads = jax.value_and_grad(loss)(p, x)
    assert value.dtype == expected_value.dtype == jnp.float32
    np.testing.assert_allclose(value, expected_value, rtol=1e-6)
    np.testing.assert_allclose(grads, expected_grads, rtol=1e-5)


def test_a_means_count_that_is_not_a_number_is_named():
    def loss(w, x):
        return jaxga.Mean(jnp.sum(x @ w), "4")

    with pytest.raises(TypeError, match=r"a jaxga.Mean whose count is '4' of type str"):
        jaxga.value_and_grad(loss, num_microbatches=2)(jnp.ones(3), jnp.ones((8, 3)))


def test_pipeline_loss_checks_its_heads_arity_and_its_targets_rows():
    def layer(w, x):
        return jnp.tanh(x @ w)

    params, x = (jnp.ones((2, 3, 3)), None), jnp.ones((4, 3))
    with pytest.raises(TypeError, match=r"`head_fn` must be callable as head_fn\(head_params, y"):
        jaxga.pipeline_loss(layer, lambda y, t: y, params, x, x, num_microbatches=2)
    with pytest.raises(ValueError, match=r"got \{'x': 4, 'targets': 6\}"):
        jaxga.pipeline_loss(layer, lambda p, y, t: y, params, x, jnp.ones(6), num_microbatches=2)


def test_smaller_helpers_name_what_they_were_given():
    with pytest.raises(TypeError, match=r"`learning_rate` must be callable as learning_rate\("):
        jaxga.make_train_step(_loss, 2, learning_rate=lambda: 0.1)
    with pytest.raises(TypeError, match=r"`fun` must be a function of arrays"):
        jaxga.canonical_convolutions(None)
    assert jaxga.compiler_options("GPU") == jaxga.compiler_options("gpu") != {}
    with pytest.raises(ValueError, match=r"`backend` must be a platform name, .*; got 'cuda12'"):
        jaxga.compiler_options("cuda12")  # before: {} (no GPU options), silently
    with pytest.raises(TypeError, match=r"`shape` must be a tuple of ints.*; got 8"):
        jaxga.sharding.fsdp_spec(8, 4)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    with pytest.raises(TypeError, match=r"`tree\['name'\]` must be an array or a number; got 'l"):
        jaxga.sharding.replicate({"w": jnp.ones(3), "name": "lin"}, mesh)
    with pytest.raises(TypeError, match=r"`keys` must hold arrays .*; got 4, a number: for 4 l"):
        jaxga.sharding.stacked_on_host(lambda key: jax.random.normal(key, (2,)), 4)


def test_an_offloaded_optimiser_state_keeps_its_prng_keys_in_host_memory():
    """The check on PRNG keys in host memory is for streamed variables (JAX aborted on
    those); an optimiser state the step offloads itself keeps its keys there and trains as
    the state kept on the device, bit for bit."""
    if "key" not in optax.noisy_sgd.__code__.co_varnames:
        pytest.skip("optax's noisy_sgd takes no typed key")

    def loss(params, batch, model_state, rng):
        return jaxga.Mean.of((batch @ params["w"]) ** 2), model_state

    results = {}
    for offload in (False, True):
        tx = optax.noisy_sgd(0.1, key=jax.random.key(0))
        state = jaxga.TrainState.create(params={"w": jnp.ones((3, 2))}, tx=tx)
        step = jaxga.make_train_step(loss, 2, offload=offload)
        for _ in range(3):
            state, _ = step(state, jnp.ones((4, 3)))
        results[offload] = state
    np.testing.assert_array_equal(results[True].params["w"], results[False].params["w"])


def test_the_reviews_edge_cases_are_taken_or_named():
    class Scaled(eqx.Module):
        linear: eqx.nn.Linear
        scale: float = 2.0  # a Python float: a leaf, not a parameter

    module = Scaled(eqx.nn.Linear(3, 2, key=jax.random.key(0)))
    with pytest.raises(TypeError, match=r"`params` holds an Equinox module with leaves that"):
        jaxga.TrainState.create(params=module, tx=optax.sgd(0.1))  # scale would be trained
    assert jaxga.compiler_options("neuron") == {}  # a plugin's platform: no GPU options
    assert jaxga.sharding.fsdp_spec(tuple(np.array([8, 4])), 4) == jax.P("data")
    with pytest.raises(TypeError, match=r"got 0, of type int, in \('data', 0\)"):
        jaxga.make_train_step(_loss, 2, axis_name=("data", 0))
    unpinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="unpinned_host")
    assert not jaxga.steps.mistyped(jax.device_put(jnp.ones(3), unpinned))  # typed as device
