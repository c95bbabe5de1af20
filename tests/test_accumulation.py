"""jaxga.value_and_grad / grad against jax.value_and_grad on the whole batch."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import jaxga
from tests._models import mlp, mlp_params

RTOL = 2e-5
ATOL = 1e-6
BATCH = 24


# Exact to float32 rounding: tests run at "highest" matmul precision (tests/conftest.py).
assert_trees_close = functools.partial(chex.assert_trees_all_close, rtol=RTOL, atol=ATOL)


def mlp_scalar_loss(params, batch):
    return jnp.mean(optax_xent(mlp(params, batch["x"]), batch["y"]))


def mlp_mean_loss(params, batch):
    return jaxga.Mean.of(optax_xent(mlp(params, batch["x"]), batch["y"]), where=batch["w"])


def optax_xent(logits, labels):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]


def mlp_batch(key, n=BATCH):
    kx, ky, kw = jax.random.split(key, 3)
    return {
        "x": jax.random.normal(kx, (n, 6)),
        "y": jax.random.randint(ky, (n,), 0, 3),
        "w": jax.random.uniform(kw, (n,)) * (jax.random.uniform(kw, (n,)) > 0.3),
    }


def embed_params(key, vocab=11, dim=8):
    k1, k2 = jax.random.split(key)
    return {
        "embed": jax.random.normal(k1, (vocab, dim)),
        "out": jax.random.normal(k2, (dim, vocab)),
    }


def embed_loss(params, batch):
    logits = params["embed"][batch["tokens"]] @ params["out"]
    return jaxga.token_cross_entropy(logits, batch["labels"], batch["mask"])


def token_batch(key, n=BATCH, length=10, vocab=11, skew=True):
    k1, k2, k3 = jax.random.split(key, 3)
    if skew:  # one long sequence per four, the rest very short: the mean of means is off
        lengths = jnp.where(jnp.arange(n) % 4 == 0, length, 1 + jnp.arange(n) % 2)
    else:
        lengths = jax.random.randint(k3, (n,), 1, length + 1)
    return {
        "tokens": jax.random.randint(k1, (n, length), 0, vocab),
        "labels": jax.random.randint(k2, (n, length), 0, vocab),
        "mask": (jnp.arange(length)[None, :] < lengths[:, None]).astype(jnp.float32),
    }


def full_batch(loss):
    def value_and_grad(params, batch):
        out = loss(params, batch)
        return out.value if isinstance(out, jaxga.Mean) else out

    return jax.value_and_grad(value_and_grad)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8, BATCH])
@pytest.mark.parametrize(
    "loss, make_params, make_batch",
    [
        (mlp_scalar_loss, mlp_params, mlp_batch),
        (mlp_mean_loss, mlp_params, mlp_batch),
        (embed_loss, embed_params, token_batch),
    ],
    ids=["mlp-scalar", "mlp-mean", "embedding-mean"],
)
def test_matches_full_batch(k, loss, make_params, make_batch):
    params = make_params(jax.random.key(0))
    batch = make_batch(jax.random.key(1))
    expected = full_batch(loss)(params, batch)
    actual = jax.jit(jaxga.value_and_grad(loss, num_microbatches=k))(params, batch)
    assert_trees_close(actual, expected)


def test_grad_matches_jax_grad():
    params, batch = mlp_params(jax.random.key(0)), mlp_batch(jax.random.key(1))
    expected = jax.grad(mlp_scalar_loss)(params, batch)
    assert_trees_close(jaxga.grad(mlp_scalar_loss, num_microbatches=4)(params, batch), expected)


def test_mean_of_means_is_wrong_and_jaxga_is_exact():
    params, batch = embed_params(jax.random.key(0)), token_batch(jax.random.key(1))
    k = 8
    expected_value, expected_grads = full_batch(embed_loss)(params, batch)

    def naive(params, batch):  # the bug jaxga exists to kill: average of per-micro-batch means
        return embed_loss(params, batch).value

    naive_value, naive_grads = jaxga.value_and_grad(naive, num_microbatches=k)(params, batch)
    assert abs(float(naive_value) - float(expected_value)) > 1e-2 * abs(float(expected_value))
    gap = jnp.linalg.norm(naive_grads["out"] - expected_grads["out"])
    assert gap > 1e-2 * jnp.linalg.norm(expected_grads["out"])

    value, grads = jaxga.value_and_grad(embed_loss, num_microbatches=k)(params, batch)
    assert_trees_close((value, grads), (expected_value, expected_grads))


@functools.cache
def jitted_value_and_grad(k):
    """One compiled function per k, so hypothesis examples of one shape reuse it."""
    if k == 0:
        return jax.jit(full_batch(embed_loss))
    return jax.jit(jaxga.value_and_grad(embed_loss, num_microbatches=k))


@settings(max_examples=25, deadline=None)
@given(
    k=st.sampled_from([1, 2, 3, 4, 6, 12]),
    keep=st.floats(0.05, 1.0),
    seed=st.integers(0, 2**16),
)
def test_property_masked_tokens(k, keep, seed):
    """Random masks (many all-padding rows among them) over a 12 × 6 batch, any k."""
    key = jax.random.key(seed)
    params = embed_params(key)
    batch = token_batch(jax.random.fold_in(key, 1), n=12, length=6, skew=False)
    mask = batch["mask"] * jax.random.bernoulli(jax.random.fold_in(key, 2), keep, (12, 6))
    batch["mask"] = mask.at[seed % 12, 0].set(1.0)  # at least one counted token
    expected = jitted_value_and_grad(0)(params, batch)
    assert_trees_close(jitted_value_and_grad(k)(params, batch), expected, rtol=5e-5)


def test_tuple_argnums_and_several_batch_args():
    params, batch = mlp_params(jax.random.key(0)), mlp_batch(jax.random.key(1))
    first, rest = params[:1], params[1:]

    def loss(first, rest, x, y):
        return jnp.mean(optax_xent(mlp(first + rest, x), y))

    expected = jax.value_and_grad(loss, argnums=(0, 1))(first, rest, batch["x"], batch["y"])
    actual = jaxga.value_and_grad(loss, num_microbatches=3, argnums=(0, 1), batch_argnums=(2, 3))(
        first, rest, batch["x"], batch["y"]
    )
    assert isinstance(actual[1], tuple) and len(actual[1]) == 2
    assert_trees_close(actual, expected)


def test_has_aux_comes_back_as_the_whole_batch_gives_it():
    params, batch = mlp_params(jax.random.key(0)), mlp_batch(jax.random.key(1))

    def loss(params, batch):
        logits = mlp(params, batch["x"])
        losses = optax_xent(logits, batch["y"])
        aux = {"logits": logits, "mean": jaxga.Mean.of(losses), "max": jnp.max(losses)}
        return jnp.mean(losses), aux

    k, kinds = 4, {"logits": "rows", "mean": None, "max": None}  # None: the default
    (value, aux), grads = jaxga.value_and_grad(loss, num_microbatches=k, has_aux=True, aux=kinds)(
        params, batch
    )
    (expected_value, expected_aux), expected_grads = jax.value_and_grad(loss, has_aux=True)(
        params, batch
    )
    assert_trees_close((value, grads), (expected_value, expected_grads))
    # per-example leaves in batch order, Means summed: as the whole batch gives them
    assert_trees_close(aux["logits"], expected_aux["logits"])
    assert_trees_close(aux["mean"], expected_aux["mean"])
    # other leaves, by default: one per micro-batch (a Python loop over the micro-batches)
    parts = jaxga.split_microbatches(batch, k)
    expected_max = [loss(params, jax.tree.map(lambda x: x[i], parts))[1]["max"] for i in range(k)]
    assert_trees_close(aux["max"], jnp.stack(expected_max))


def test_rng_key_per_microbatch():
    k = 4
    x = jnp.ones((8, 64))

    def loss(w, x, key):
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        return jnp.mean(jnp.where(keep, x * w, 0.0)), keep

    key = jax.random.key(42)
    options = {"num_microbatches": k, "has_aux": True, "rng_argnums": 2, "aux": "rows"}
    (_, masks), grads = jaxga.value_and_grad(loss, **options)(2.0, x, key)
    # Reference: a Python loop drawing fold_in(key, i) for micro-batch i.
    parts = jaxga.split_microbatches(x, k)
    expected = [
        jax.random.bernoulli(jax.random.fold_in(key, i), 0.5, parts[i].shape) for i in range(k)
    ]
    np.testing.assert_array_equal(masks, jaxga.merge_microbatches(jnp.stack(expected)))
    per_micro = jaxga.split_microbatches(masks, k)
    assert len({np.asarray(m).tobytes() for m in per_micro}) == k  # every micro-batch differs
    expected_grad = np.mean([np.mean(np.where(m, p, 0.0)) for m, p in zip(expected, parts)])
    np.testing.assert_allclose(grads, expected_grad, rtol=1e-6)


def test_state_is_threaded_through_microbatches():
    k = 4
    params, batch = mlp_params(jax.random.key(0)), mlp_batch(jax.random.key(1))

    def loss(params, batch, stats):
        h = batch["x"] @ params[0]["w"]
        new_stats = {
            "mean": 0.9 * stats["mean"] + 0.1 * jnp.mean(h, 0),
            "steps": stats["steps"] + 1,
        }
        return jnp.mean(optax_xent(mlp(params, batch["x"]), batch["y"])), new_stats

    stats = {"mean": jnp.zeros(16), "steps": jnp.zeros((), jnp.int32)}
    (value, grads), new_stats = jax.jit(
        jaxga.value_and_grad(loss, num_microbatches=k, state_argnums=2)
    )(params, batch, stats)
    # Reference: a Python loop over the same micro-batches.
    parts = jaxga.split_microbatches(batch, k)
    expected_stats, values, all_grads = stats, [], []
    for i in range(k):
        micro = jax.tree.map(lambda x: x[i], parts)
        (v, expected_stats), g = jax.value_and_grad(loss, has_aux=True)(
            params, micro, expected_stats
        )
        values.append(v)
        all_grads.append(g)
    assert int(new_stats["steps"]) == k
    assert_trees_close(new_stats, expected_stats)
    mean_grads = jax.tree.map(lambda *g: sum(g) / k, *all_grads)
    assert_trees_close((value, grads), (sum(values) / k, mean_grads))


def test_state_with_aux_output_structure():
    def loss(w, x, state):
        return (jnp.mean(w * x), jnp.sum(x)), state + 1.0

    ((value, aux), grads), state = jaxga.value_and_grad(
        loss, num_microbatches=2, has_aux=True, state_argnums=2
    )(1.0, jnp.arange(4.0), 0.0)
    assert float(value) == 1.5 and aux.shape == (2,) and float(state) == 2.0
    (g, aux2), state2 = jaxga.grad(loss, num_microbatches=2, has_aux=True, state_argnums=2)(
        1.0, jnp.arange(4.0), 0.0
    )
    assert float(g) == float(grads) == 1.5 and float(state2) == 2.0
    np.testing.assert_array_equal(aux, aux2)


def test_low_precision_params_accumulate_in_float32():
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), mlp_params(jax.random.key(0)))
    batch = mlp_batch(jax.random.key(1))
    grads = jaxga.grad(mlp_scalar_loss, num_microbatches=8)(params, batch)
    assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
    # The float32 accumulator makes the result match a float32 sum of bfloat16 micro-gradients.
    parts = jaxga.split_microbatches(batch, 8)
    micro = [
        jax.grad(mlp_scalar_loss)(params, jax.tree.map(lambda x: x[i], parts)) for i in range(8)
    ]
    expected = jax.tree.map(
        lambda *g: (sum(x.astype(jnp.float32) for x in g) / 8).astype(jnp.bfloat16), *micro
    )
    assert_trees_close(grads, expected, rtol=1e-2, atol=1e-3)


def test_works_inside_user_jit_without_retracing():
    params, batch = mlp_params(jax.random.key(0)), mlp_batch(jax.random.key(1))
    grad_fn = jaxga.value_and_grad(mlp_mean_loss, num_microbatches=4)
    traces = []

    @jax.jit
    def step(params, batch):
        traces.append(None)
        value, grads = grad_fn(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    new_params, value = step(params, batch)
    step(new_params, mlp_batch(jax.random.key(2)))
    assert len(traces) == 1
    expected_value, expected_grads = full_batch(mlp_mean_loss)(params, batch)
    expected_params = jax.tree.map(lambda p, g: p - 0.1 * g, params, expected_grads)
    assert_trees_close((new_params, value), (expected_params, expected_value))


def test_aux_merges_back_to_batch_order():
    params, batch = mlp_params(jax.random.key(0)), mlp_batch(jax.random.key(1))

    def loss(params, batch):
        logits = mlp(params, batch["x"])
        return jnp.mean(optax_xent(logits, batch["y"])), logits

    vg = jaxga.value_and_grad(loss, num_microbatches=6, has_aux=True, aux="rows")
    (_, aux), _ = vg(params, batch)
    np.testing.assert_allclose(aux, mlp(params, batch["x"]), rtol=1e-5, atol=1e-6)


def test_integer_counts_and_no_batch_argument():
    x = jnp.arange(8.0)

    def loss(w, x):
        return jaxga.Mean(jnp.sum(w * x), jnp.int32(x.shape[0]))

    value, g = jaxga.value_and_grad(loss, num_microbatches=4)(2.0, x)
    np.testing.assert_allclose((value, g), (2.0 * jnp.mean(x), jnp.mean(x)), rtol=1e-6)
    # Nothing to split: every micro-step sees the same arguments, so the mean is unchanged.
    value, g = jaxga.value_and_grad(
        lambda w, x: jnp.mean(w * x), num_microbatches=3, batch_argnums=()
    )(2.0, x)
    np.testing.assert_allclose((value, g), (2.0 * jnp.mean(x), jnp.mean(x)), rtol=1e-6)


def test_low_precision_mean_counts_exactly():
    values = jnp.ones(1001, jnp.bfloat16)
    mean = jaxga.Mean.of(values, where=jnp.ones(1001, bool))
    assert float(mean.count) == 1001.0 and float(jaxga.Mean.of(values).count) == 1001.0


def test_float64_parameters_sum_in_float64():
    with jax.enable_x64(True):
        w = jnp.float64(1.0 + 1e-12)
        x = jnp.concatenate([jnp.full(4, 1e8), jnp.full(4, 1.0)])

        def loss(w, x):
            return jnp.mean(w * x)

        value, g = jaxga.value_and_grad(loss, num_microbatches=4)(w, x)
        expected_value, expected_g = jax.value_and_grad(loss)(w, x)
        assert value.dtype == jnp.float64 and g.dtype == jnp.float64
        np.testing.assert_allclose((value, g), (expected_value, expected_g), rtol=1e-14)


def deep_mlp_loss(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.mean(x**2)


def test_memory_of_eight_microbatches_is_under_half_of_one():
    depth, width, batch = 16, 256, 512
    params = [jax.ShapeDtypeStruct((width, width), jnp.float32)] * depth
    x = jax.ShapeDtypeStruct((batch, width), jnp.float32)

    def temp_bytes(k):
        f = jax.jit(jaxga.value_and_grad(deep_mlp_loss, num_microbatches=k))
        return f.lower(params, x).compile().memory_analysis().temp_size_in_bytes

    one, eight = temp_bytes(1), temp_bytes(8)
    assert eight < 0.5 * one, (one, eight)


@pytest.mark.parametrize(
    "num_microbatches, error, match",
    [
        (0, ValueError, r"`num_microbatches` must be a positive int; got 0"),
        (-2, ValueError, r"`num_microbatches` must be a positive int; got -2"),
        (2.0, TypeError, r"`num_microbatches` must be a positive int; got 2.0 of type float"),
        (True, TypeError, r"`num_microbatches` must be a positive int; got True"),
    ],
)
def test_bad_num_microbatches(num_microbatches, error, match):
    with pytest.raises(error, match=match):
        jaxga.value_and_grad(mlp_scalar_loss, num_microbatches=num_microbatches)


def test_indivisible_batch_names_both_numbers():
    params, batch = mlp_params(jax.random.key(0)), mlp_batch(jax.random.key(1), n=10)
    with pytest.raises(ValueError, match=r"batch size 10 .* not divisible by num_microbatches=4"):
        jaxga.value_and_grad(mlp_scalar_loss, num_microbatches=4)(params, batch)


def test_mismatched_leading_sizes_are_listed():
    params, batch = mlp_params(jax.random.key(0)), mlp_batch(jax.random.key(1))
    batch["y"] = batch["y"][:20]
    with pytest.raises(ValueError, match=r"different leading sizes .*\['x'\]: 24.*\['y'\]: 20"):
        jaxga.value_and_grad(mlp_scalar_loss, num_microbatches=4)(params, batch)


def test_scalar_batch_leaf_is_rejected():
    params, batch = mlp_params(jax.random.key(0)), mlp_batch(jax.random.key(1))
    batch["temperature"] = jnp.float32(1.0)
    with pytest.raises(ValueError, match=r"args\[1\]\['temperature'\] is a scalar"):
        jaxga.value_and_grad(mlp_scalar_loss, num_microbatches=4)(params, batch)


def test_overlapping_argnums():
    with pytest.raises(ValueError, match=r"`argnums`=\(1,\) and `batch_argnums`=\(1,\)"):
        jaxga.value_and_grad(mlp_scalar_loss, num_microbatches=2, argnums=1)
    with pytest.raises(ValueError, match=r"`batch_argnums`=\(1,\) and `rng_argnums`=\(1,\)"):
        jaxga.value_and_grad(mlp_scalar_loss, num_microbatches=2, rng_argnums=1)


def test_out_of_range_batch_argnums():
    params, batch = mlp_params(jax.random.key(0)), mlp_batch(jax.random.key(1))
    with pytest.raises(
        ValueError,
        match=r"`batch_argnums`=\(3,\), but `fun` got 2 arguments\.",
    ):
        jaxga.value_and_grad(mlp_scalar_loss, num_microbatches=2, batch_argnums=3)(params, batch)


def test_bad_argnums_type():
    with pytest.raises(TypeError, match=r"`argnums` must be a non-negative int"):
        jaxga.value_and_grad(mlp_scalar_loss, num_microbatches=2, argnums="0")
    with pytest.raises(ValueError, match=r"`argnums` must name at least one"):
        jaxga.value_and_grad(mlp_scalar_loss, num_microbatches=2, argnums=())


def test_non_scalar_loss_is_rejected():
    with pytest.raises(TypeError, match=r"float scalar .* shape \(3,\)"):
        jaxga.value_and_grad(lambda w, x: w * x, num_microbatches=1)(1.0, jnp.ones(3))


def test_changed_state_structure_is_rejected():
    with pytest.raises(TypeError, match=r"new_state with tree structure"):
        jaxga.value_and_grad(
            lambda w, x, s: (jnp.mean(w * x), (s, s)), num_microbatches=1, state_argnums=2
        )(1.0, jnp.ones(3), 0.0)


@pytest.mark.parametrize(
    "state, new_state, match",
    [
        (
            jnp.ones(2, jnp.int32),
            lambda s: s + 0.5,
            r"leaf \[0\] has shape \(2,\) and dtype float32",
        ),
        ({"a": jnp.ones(2)}, lambda s: {"a": jnp.ones(3)}, r"leaf \[0\]\['a'\] has shape \(3,\)"),
    ],
)
def test_changed_state_shape_or_kind_of_dtype_is_rejected(state, new_state, match):
    def loss(w, x, s):
        return (jnp.mean(w * x), new_state(s))

    with pytest.raises(TypeError, match=match):
        jaxga.value_and_grad(loss, num_microbatches=2, state_argnums=2)(1.0, jnp.ones(4), state)


def test_a_python_float_loss_is_a_constant_as_in_jax():
    def loss(w, x):
        return 1.0

    expected = jax.value_and_grad(loss)(1.0, jnp.ones(4))
    assert_trees_close(jaxga.value_and_grad(loss, num_microbatches=2)(1.0, jnp.ones(4)), expected)


def test_positional_argnums_means_what_it_means_in_jax():
    def loss(x, w):
        return jnp.mean(x @ w)

    x, w = jnp.ones((4, 3)), jnp.arange(3.0)
    expected = jax.value_and_grad(loss, 1)(x, w)
    assert_trees_close(
        jaxga.value_and_grad(loss, 1, num_microbatches=2, batch_argnums=0)(x, w), expected
    )
    assert_trees_close(jaxga.grad(loss, 1, num_microbatches=2, batch_argnums=0)(x, w), expected[1])


def test_num_microbatches_is_required():
    with pytest.raises(TypeError, match="num_microbatches"):
        jaxga.value_and_grad(mlp_scalar_loss)


def test_not_a_function_is_rejected_when_built():
    with pytest.raises(TypeError, match=r"`fun` must be a function; got 3"):
        jaxga.value_and_grad(3, 2, num_microbatches=2)


def test_tuple_output_without_has_aux_says_so():
    def loss(w, x):
        return (jnp.mean(w * x), x)

    with pytest.raises(TypeError, match=r"returned a tuple of length 2, but has_aux=False"):
        jaxga.value_and_grad(loss, num_microbatches=2)(1.0, jnp.ones(4))


@pytest.mark.parametrize("batch", [None, {}, {"x": None}])
def test_batch_without_arrays_is_rejected(batch):
    with pytest.raises(
        ValueError, match=r"`batch_argnums` names args\[1\], with no array leaves or rows"
    ):
        jaxga.value_and_grad(lambda w, b: w, num_microbatches=2)(1.0, batch)


def test_integer_parameters_are_rejected():
    params = {"w": jnp.ones(3), "step": jnp.int32(0)}
    with pytest.raises(
        TypeError,
        match=r"differentiates args\[0\]\['step'\], shape \(\) and dtype int32; expected float",
    ):
        jaxga.grad(lambda p, x: jnp.mean(p["w"] * x), num_microbatches=2)(params, jnp.ones((4, 3)))


def test_rng_argnums_must_point_at_keys():
    def loss(w, x, key):
        return jnp.mean(w * x)

    with pytest.raises(
        TypeError, match=r"`rng_argnums` names args\[2\], 7 of type int; expected a PRNG key\."
    ):
        jaxga.grad(loss, num_microbatches=2, rng_argnums=2)(1.0, jnp.ones(4), 7)


@pytest.mark.parametrize("dtype", ["banana", jnp.int32])
def test_bad_accumulator_dtype(dtype):
    with pytest.raises(TypeError, match=r"`accumulator_dtype` must be a floating dtype"):
        jaxga.grad(mlp_scalar_loss, num_microbatches=2, accumulator_dtype=dtype)


def test_inside_shard_map_the_axis_is_read_from_the_batch():
    """No axis_name: the batch varies over 'data', so the sums are reduced over it, once."""
    mesh = jax.make_mesh((1,), ("data",))

    def loss(w, x):
        return jnp.mean(w * x**2)

    grad_fn = jaxga.grad(loss, num_microbatches=2)
    step = jax.shard_map(
        lambda w, x: grad_fn(w, x), mesh=mesh, in_specs=(P(), P("data")), out_specs=P()
    )
    x = jaxga.sharding.shard_batch(jnp.arange(4.0), mesh)
    np.testing.assert_allclose(jax.jit(step)(1.0, x), jax.grad(loss)(1.0, jnp.arange(4.0)))


def test_explicit_accumulator_dtype_is_used_as_it_is():
    """bfloat16 sums of many small gradients lose what float32 sums keep."""
    w = jnp.float32(1.0)
    x = jnp.full(64, 1e-3, jnp.float32).at[0].set(1.0)

    def loss(w, x):  # micro-batch 0 contributes 1.0, the others 1e-3 each
        return jnp.sum(w * x)

    exact = jaxga.grad(loss, num_microbatches=64)(w, x)
    low = jaxga.grad(loss, num_microbatches=64, accumulator_dtype=jnp.bfloat16)(w, x)
    np.testing.assert_allclose(exact, (1.0 + 63e-3) / 64, rtol=1e-5)
    assert abs(float(low) - float(exact)) > 1e-3 * float(exact)


def test_a_loss_with_attributes_named_fun_and_options_keeps_its_own():
    """`accumulate` copies the loss's attributes (functools.update_wrapper) before it sets
    its own `fun` and `options`, so a callable carrying such names is not mistaken for them."""

    class Loss:
        fun, options = "the user's", "the user's"

        def __call__(self, w, x):
            return jnp.mean((x @ w) ** 2)

    w, x = jnp.ones((3, 2)), jnp.arange(12.0).reshape(4, 3)
    loss = Loss()
    loss.__dict__.update(fun="the user's", options="the user's")
    value, grad = jaxga.value_and_grad(loss, num_microbatches=2)(w, x)
    want_value, want_grad = jax.value_and_grad(loss)(w, x)
    chex.assert_trees_all_close((value, grad), (want_value, want_grad), rtol=1e-6)
