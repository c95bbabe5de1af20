"""jaxga.remat_scan against a plain Python loop over the layers, and its memory."""

import functools
import math
import re
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.ad_checkpoint import checkpoint_name

import jaxga
from jaxga._checks import check_arity
from jaxga.remat import REMAT, Remat, remat_options, resolve_segments, stack_length

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

import flax_remat

RTOL = 2e-5
ATOL = 2e-6
LAYERS = 4


def assert_trees_close(actual, expected):
    """chex's closeness at RTOL and ATOL, with equal shapes and dtypes."""
    chex.assert_trees_all_equal_shapes_and_dtypes(actual, expected)
    chex.assert_trees_all_close(actual, expected, rtol=RTOL, atol=ATOL)


def attention_block(p, x):
    """A tiny attention-like block: unbatched (``x @ w``) and batched (einsum) matmuls."""
    q = checkpoint_name(x @ p["w"], "query")
    scores = checkpoint_name(jnp.tanh(jnp.einsum("btd,bsd->bts", q, x)), "scores")
    return x + 0.3 * jnp.einsum("bts,bsd->btd", scores, x) * p["g"]


def block_params(key, layers=LAYERS, dim=6):
    k1, k2 = jax.random.split(key)
    return {
        "w": jax.random.normal(k1, (layers, dim, dim)) / math.sqrt(dim),
        "g": 1 + 0.1 * jax.random.normal(k2, (layers, dim)),
    }


def python_loop(layer_fn, stacked, x):
    for i in range(stack_length(stacked)):
        x = layer_fn(jax.tree.map(lambda p: p[i], stacked), x)
    return x


def loss_of(apply):
    return lambda params, x: jnp.mean(jnp.sin(apply(params, x)))


@pytest.fixture(scope="module")
def problem():
    params = block_params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 3, 6))
    reference = jax.jit(
        jax.value_and_grad(loss_of(lambda p, x: python_loop(attention_block, p, x)), argnums=(0, 1))
    )
    return params, x, reference(params, x)


POLICY_CASES = {
    "none": "none",
    "None": None,  # what checkpoint_policy("none") and REMAT["none"].policy give
    "full": "full",
    "dots": "dots",
    "dots_no_batch": "dots_no_batch",
    "names": ["scores", "query"],
    "callable": jax.checkpoint_policies.save_only_these_names("scores"),
}


@pytest.mark.parametrize("segments", [1, "sqrt", LAYERS])
@pytest.mark.parametrize("policy", list(POLICY_CASES))
def test_value_and_grads_match_python_loop(problem, policy, segments):
    params, x, expected = problem

    def apply(p, x):
        return jaxga.remat_scan(
            attention_block, p, x, policy=POLICY_CASES[policy], segments=segments
        )

    actual = jax.jit(jax.value_and_grad(loss_of(apply), argnums=(0, 1)))(params, x)
    assert_trees_close(actual, expected)


def test_forward_matches_python_loop_without_jit(problem):
    params, x, _ = problem
    expected = python_loop(attention_block, params, x)
    assert_trees_close(jaxga.remat_scan(attention_block, params, x, segments=2), expected)


def test_offload_policy_matches_python_loop(problem):
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if "pinned_host" not in kinds:
        pytest.skip(f"the {jax.default_backend()} backend has no pinned_host memory")
    params, x, expected = problem

    def apply(p, x):
        return jaxga.remat_scan(attention_block, p, x, policy="offload_dots", segments="sqrt")

    actual = jax.jit(jax.value_and_grad(loss_of(apply), argnums=(0, 1)))(params, x)
    assert_trees_close(actual, expected)


def test_pytree_carry_and_per_layer_keys_match_python_loop():
    """A dict carry, and dropout whose per-layer keys make recomputation reproducible."""

    def layer(p, carry):
        keep = jax.random.bernoulli(p["key"], 0.8, carry["x"].shape)
        x = jnp.tanh(carry["x"] @ p["w"]) * keep / 0.8
        return {"x": x, "total": carry["total"] + jnp.sum(x)}

    stacked = {
        "w": jax.random.normal(jax.random.key(2), (4, 4, 4)) / 2,
        "key": jax.random.split(jax.random.key(3), 4),
    }
    carry = {"x": jnp.ones((3, 4)), "total": jnp.zeros(())}

    def loss(apply):
        return lambda w, carry: apply({"w": w, "key": stacked["key"]}, carry)["total"]

    def grad(apply):
        return jax.jit(jax.grad(loss(apply), argnums=(0, 1)))

    expected = grad(lambda p, c: python_loop(layer, p, c))(stacked["w"], carry)
    for segments in (1, 2):

        def apply(p, c):
            return jaxga.remat_scan(layer, p, c, segments=segments)

        assert_trees_close(grad(apply)(stacked["w"], carry), expected)


def test_composes_with_microbatch_accumulation(problem):
    params, _, _ = problem
    batch = jax.random.normal(jax.random.key(4), (8, 3, 6))
    whole = loss_of(lambda p, x: python_loop(attention_block, p, x))
    remat = loss_of(lambda p, x: jaxga.remat_scan(attention_block, p, x, segments="sqrt"))
    expected = jax.jit(jax.value_and_grad(whole))(params, batch)
    actual = jax.jit(jaxga.value_and_grad(remat, num_microbatches=4))(params, batch)
    assert_trees_close(actual, expected)


def mlp_block(p, x):
    return x + jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"]


def mlp_temp_bytes(layers, policy, segments, tokens=256, dim=64, hidden=256):
    shapes = {"w1": (dim, hidden), "b1": (hidden,), "w2": (hidden, dim)}
    params = {k: jax.ShapeDtypeStruct((layers, *s), jnp.float32) for k, s in shapes.items()}
    x = jax.ShapeDtypeStruct((tokens, dim), jnp.float32)

    def apply(p, x):
        return jaxga.remat_scan(mlp_block, p, x, policy=policy, segments=segments)

    step = jax.grad(lambda p, x: jnp.sum(apply(p, x)), argnums=(0, 1))
    return jaxga.memory_report(step, params, x).temp_bytes


def test_sqrt_segments_need_less_memory_than_per_layer_than_none():
    none = mlp_temp_bytes(64, "none", 1)
    per_layer = mlp_temp_bytes(64, "full", 1)
    sqrt = mlp_temp_bytes(64, "full", "sqrt")
    assert sqrt < per_layer < none
    # How much less is the compiler's: ≥ 5× on XLA's CPU compiler, 3.2× on an H100's.
    assert sqrt <= none / (5 if jax.default_backend() == "cpu" else 3)


@given(st.integers(1, 400))
@settings(max_examples=60, deadline=None)
def test_sqrt_segments_is_the_divisor_nearest_sqrt(layers):
    s = resolve_segments("sqrt", layers)
    assert layers % s == 0
    nearest = min(abs(d - math.sqrt(layers)) for d in range(1, layers + 1) if layers % d == 0)
    assert abs(s - math.sqrt(layers)) == nearest


def test_checkpoint_policy_names():
    cp = jax.checkpoint_policies
    assert jaxga.checkpoint_policy("none") is None
    assert jaxga.checkpoint_policy("full") is cp.nothing_saveable
    assert jaxga.checkpoint_policy("dots") is cp.dots_saveable
    assert jaxga.checkpoint_policy("dots_no_batch") is cp.dots_with_no_batch_dims_saveable
    assert callable(jaxga.checkpoint_policy("offload_dots"))
    assert jaxga.checkpoint_policy(cp.everything_saveable) is cp.everything_saveable


def test_remat_table_orders_names_from_least_to_most_recomputation():
    assert tuple(REMAT) == ("none", "dots", "dots_no_batch", "offload_dots", "full", "sqrt")
    for name, row in REMAT.items():
        options = remat_options(name)
        assert jaxga.checkpoint_policy(options["policy"]) is row.policy
        assert options["segments"] == row.segments
    assert remat_options("sqrt") == {"policy": "full", "segments": "sqrt"}


@pytest.mark.parametrize("helper", [Remat, remat_options, stack_length, resolve_segments])
def test_the_remat_helpers_examples_use_are_documented_with_an_example(helper):
    assert ">>>" in (helper.__doc__ or ""), f"{helper.__name__} has no runnable example"


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: remat_options("most"), ValueError, r"`name`='most' is not a remat name.*'sqrt'"),
        (lambda: remat_options(None), ValueError, r"`name`=None is not a remat name"),
        (
            lambda: jaxga.checkpoint_policy("sqrt"),
            ValueError,
            r"^`policy` must be one of \[.*\], None, .*; got 'sqrt'\.$",
        ),
        (
            lambda: jaxga.checkpoint_policy("most"),
            ValueError,
            r"^`policy` must be .*; got 'most'\.$",
        ),
    ],
)
def test_remat_name_errors_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


# --- errors -------------------------------------------------------------------------


def layer(w, x):
    return jnp.tanh(x @ w)


W = jnp.ones((6, 3, 3))
X = jnp.ones((2, 3))


def test_error_on_leaves_with_different_leading_sizes():
    params = {"w": jnp.ones((6, 3, 3)), "b": jnp.ones((5, 3))}
    with pytest.raises(ValueError, match=r"different leading sizes.*\['b'\]: 5.*\['w'\]: 6"):
        jaxga.remat_scan(lambda p, x: layer(p["w"], x) + p["b"], params, X)


def test_error_on_scalar_leaf_and_empty_params():
    with pytest.raises(ValueError, match=r"stacked_params\['s'\] is a scalar"):
        jaxga.remat_scan(layer, {"w": W, "s": jnp.ones(())}, X)
    with pytest.raises(ValueError, match="`stacked_params` has no array leaves"):
        jaxga.remat_scan(layer, {}, X)


@pytest.mark.parametrize(("segments", "nearest"), [(4, "3 or 6"), (5, "3 or 6"), (7, "6")])
def test_error_on_segments_not_dividing_layers(segments, nearest):
    expected = rf"^`segments`={segments} does not divide L=6; try {nearest}\.$"
    with pytest.raises(ValueError, match=expected):
        jaxga.remat_scan(layer, W, X, segments=segments)


@pytest.mark.parametrize(
    ("segments", "error"),
    [(0, ValueError), (-2, ValueError), ("cube", TypeError), (2.0, TypeError), (True, TypeError)],
)
def test_error_on_bad_segments(segments, error):
    with pytest.raises(error, match="`segments` must be a positive int or 'sqrt'"):
        jaxga.remat_scan(layer, W, X, segments=segments)


def test_error_on_unknown_policy_name_lists_known_ones():
    known = r"\['none', 'dots', 'dots_no_batch', 'offload_dots', 'full'\]"
    with pytest.raises(ValueError, match=rf"^`policy` must be one of {known}, .*; got 'dot'\.$"):
        jaxga.remat_scan(layer, W, X, policy="dot")


@pytest.mark.parametrize("policy", [3, ["hidden", 3]])
def test_error_on_policy_of_wrong_type(policy):
    expected = r"^`policy` must be one of .*, None, a list of names or a policy; got "
    expected += re.escape(repr(policy)) + r"\.$"
    with pytest.raises(TypeError, match=expected):
        jaxga.remat_scan(layer, W, X, policy=policy)


@pytest.mark.parametrize(
    ("bad_layer", "match"),
    [
        (
            lambda w, x: (x @ w)[:, :2],
            r"^`layer_fn` must return a carry like x; it returned float32\[2, 2\] "
            r"for x of float32\[2, 3\] \(L=6\)\.",
        ),
        (lambda w, x: (x @ w).astype(jnp.float16), r"returned float16\[2, 3\] for x of float32"),
        (
            lambda w, x: (x, x),
            r"like x; it returned \('float32\[2, 3\]', 'float32\[2, 3\]'\) for x of float32",
        ),
    ],
)
@pytest.mark.parametrize("policy", ["none", "full"])
def test_error_when_layer_changes_the_carry(bad_layer, match, policy):
    with pytest.raises(TypeError, match=match):
        jaxga.remat_scan(bad_layer, W, X, policy=policy)


def test_error_on_one_layer_not_stacked_says_unstacked_and_how_to_stack():
    """Issue 38: one layer's weights, where L layers' go, blamed `layer_fn` with "(L=3)"."""
    expected = (
        "`stacked_params` looks like one layer's parameters: its leading axis was read as L=3 "
        "layers, layer_fn(stacked_params[i], x) returned float32[2] for x of float32[2, 3], but "
        "layer_fn(stacked_params, x) gives a carry like x. Stack the layers' parameters: "
        "jax.tree.map(lambda *p: jnp.stack(p), *layers)."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}"):  # then jax's traceback note
        jaxga.remat_scan(lambda w, x: jnp.tanh(x @ w), W[0], X)
    # a layer that raises on a slice: the same error, after it raised

    def layer(p, x):
        return jnp.tanh(jnp.einsum("bi,io->bo", x, p["w"]) + p["b"])

    layers = [{"w": W[i], "b": jnp.ones(3)} for i in range(2)]
    with pytest.raises(ValueError, match=r"read as L=3 layers, layer_fn.* raised ValueError, but"):
        jaxga.remat_scan(layer, layers[0], X)
    stacked = jax.tree.map(lambda *p: jnp.stack(p), *layers)  # the advice, followed
    expected = jnp.tanh(jnp.tanh(X @ W[0] + 1) @ W[1] + 1)
    chex.assert_trees_all_close(jaxga.remat_scan(layer, stacked, X), expected, rtol=1e-6)


@pytest.mark.parametrize(
    "carry, where, got",
    [
        (1.0, "x", r"1\.0 of type float"),
        ({"h": X, "total": 0}, r"x\['total'\]", r"0 of type int"),
        ("x", "x", r"'x' of type str"),
    ],
)
def test_error_on_a_carry_that_is_not_arrays(carry, where, got):
    expected = rf"^Every leaf of the carry `x` must be an array; {where} is {got}\.$"
    with pytest.raises(TypeError, match=expected):
        jaxga.remat_scan(lambda w, x: x, W, carry)


def x_first(x, w):
    return jnp.tanh(x @ w)


def x_first_gain(x, g):
    return x * g[None, :]


@pytest.mark.parametrize(
    "swapped, params, got",
    [
        (x_first, W, r"raised TypeError"),  # x @ w: (3, 3) @ (2, 3)
        (x_first_gain, jnp.ones((6, 3)), r"returned float32\[1, 2, 3\] for x of float32\[2, 3\]"),
    ],
)
@pytest.mark.parametrize("policy", ["none", "full"])
def test_error_on_layer_fn_with_its_arguments_swapped(swapped, params, got, policy):
    expected = rf"^`layer_fn` takes its arguments swapped: as layer_fn\(params, x\) it {got}\."
    with pytest.raises(TypeError, match=expected):
        jaxga.remat_scan(swapped, params, X, policy=policy)

    def in_order(p, x):
        return swapped(x, p)

    assert_trees_close(jaxga.remat_scan(in_order, params, X), python_loop(in_order, params, X))


@pytest.mark.parametrize(
    "factory",
    [
        "save_only_these_names",
        "save_any_names_but_these",
        "save_from_both_policies",
        "offload_dot_with_no_batch_dims",
    ],
)
def test_error_on_a_policy_factory_not_called(factory):
    name = rf"jax\.checkpoint_policies\.{factory}"
    expected = rf"^`policy`={name} makes a policy when called; pass e\.g\. {name}\(\.\.\.\)\.$"
    with pytest.raises(TypeError, match=expected):
        jaxga.remat_scan(layer, W, X, policy=getattr(jax.checkpoint_policies, factory))


def test_error_on_layer_fn_not_callable():
    with pytest.raises(TypeError, match="`layer_fn` must be callable"):
        jaxga.remat_scan("layer", W, X)


@pytest.mark.parametrize(
    "wrong", [lambda x: x, lambda w, x, scale: x, functools.partial(layer, W[0])]
)
def test_error_on_layer_fn_with_the_wrong_arity_says_the_signature(wrong):
    expected = r"`layer_fn` must be callable as layer_fn\(params_of_one_layer, x\) -> x; it takes"
    with pytest.raises(TypeError, match=expected):
        jaxga.remat_scan(wrong, W, X)


@pytest.mark.parametrize(
    "layer_fn",
    [
        functools.partial(lambda scale, w, x: layer(w, x) * scale, 0.5),
        lambda w, x, scale=0.5: layer(w, x) * scale,
        lambda *args: layer(*args) * 0.5,
    ],
)
def test_layer_fn_as_partial_with_defaults_or_varargs_is_accepted(layer_fn):
    expected = X
    for w in W:
        expected = layer(w, expected) * 0.5
    assert_trees_close(jaxga.remat_scan(layer_fn, W, X), expected)


def test_a_ufunc_is_a_layer_fn():
    halves = jnp.full((6, *X.shape), 0.5)
    assert_trees_close(jaxga.remat_scan(jnp.multiply, halves, X), X * 0.5**6)


def test_callables_without_a_readable_signature_are_not_rejected():
    assert check_arity(max, "layer_fn", 2, "layer_fn(params_of_one_layer, x) -> x") is max


# --- the Flax example ---------------------------------------------------------------


def test_flax_example_gradients_match(capsys):
    diffs = flax_remat.main(depth=2, dim=4, batch=2, segments=2)
    assert diffs["nnx"] < 1e-5 and diffs["linen"] < 1e-5
    assert "match" in capsys.readouterr().out


def test_zero_layers_with_sqrt_segments_say_there_is_no_layer():
    """Issue 22: "min() arg is an empty sequence"."""
    with pytest.raises(ValueError, match=r"^`segments`='sqrt' needs at least one layer; .* has 0"):
        jaxga.remat_scan(layer, jnp.ones((0, 3, 3)), X, segments="sqrt")
    assert_trees_close(jaxga.remat_scan(layer, jnp.ones((0, 3, 3)), X), X)  # segments=1: x


STACK = r"jax.tree.map\(lambda \*p: jnp.stack\(p\), \*layers\)"


def test_a_list_of_per_layer_trees_is_named_with_how_to_stack_it():
    """Issue 22: unstacked parameters were blamed on layer_fn."""
    layers = [{"w": jnp.ones((3, 3))} for _ in range(4)]  # every leaf's leading size is 3
    with pytest.raises(ValueError, match=rf"^`stacked_params` has 4 per-layer trees; .*{STACK}"):
        jaxga.remat_scan(lambda p, x: layer(p["w"], x), layers, X)
    stacked = jax.tree.map(lambda *p: jnp.stack(p), *layers)  # as the message says
    assert stack_length(stacked) == 4


def test_leaves_of_different_leading_sizes_say_how_to_stack():
    params = [{"w": jnp.ones((3, 3)), "b": jnp.ones(3)}, {"w": jnp.ones((4, 3))}]
    with pytest.raises(ValueError, match=rf"stacked_params.*different leading sizes.*{STACK}"):
        jaxga.remat_scan(lambda p, x: x, params, X)


@pytest.mark.parametrize("segments", [1, 2])
def test_unrolled_layers_match_python_loop(problem, segments):
    params, x, expected = problem

    def apply(p, x):
        return jaxga.remat_scan(
            attention_block, p, x, policy="none", segments=segments, unroll=True
        )

    actual = jax.jit(jax.value_and_grad(loss_of(apply), argnums=(0, 1)))(params, x)
    assert_trees_close(actual, expected)


def test_unrolled_layers_have_no_loop_and_keep_less_than_a_rolled_scan():
    # docs/remat.md#unrolled-layers: a rolled scan stacks every residual of a layer;
    # policy=None is "none"
    shapes = {"w1": (64, 256), "b1": (256,), "w2": (256, 64)}
    params = {k: jax.ShapeDtypeStruct((8, *s), jnp.float32) for k, s in shapes.items()}
    x = jax.ShapeDtypeStruct((256, 64), jnp.float32)

    def compiled(unroll, policy="none", segments=1):
        def apply(p, x):
            return jaxga.remat_scan(
                mlp_block, p, x, policy=policy, segments=segments, unroll=unroll
            )

        step = jax.grad(lambda p, x: jnp.sum(apply(p, x)), argnums=(0, 1))
        return jax.jit(step).lower(params, x).compile()

    rolled, unrolled = compiled(False), compiled(True, policy=None)

    def loop(c):
        return re.search(r"\swhile\(", c.as_text())

    assert loop(rolled) and not loop(unrolled)
    assert loop(compiled(True, segments=2))  # the checkpointed segments keep their loop

    def temp(c):
        return c.memory_analysis().temp_size_in_bytes

    assert temp(unrolled) < 0.8 * temp(rolled)  # CPU: 7.2 MB against 13.8 MB


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"unroll": "yes"}, TypeError, r"^`unroll` must be a bool; got 'yes' of type str\.$"),
        ({"unroll": 1}, TypeError, r"^`unroll` must be a bool; got 1 of type int\.$"),
        ({"unroll": True}, ValueError,
         r"^`unroll`=True needs policy='none' or None; got policy='full'\.$"),
        ({"unroll": True, "policy": "dots"}, ValueError, r"; got policy='dots'\.$"),
        ({"unroll": True, "policy": jax.checkpoint_policies.everything_saveable}, ValueError,
         r"; got policy=everything_saveable\.$"),
    ],
)  # fmt: skip
def test_error_on_bad_unroll(options, error, message):
    params, x = block_params(jax.random.key(0)), jnp.ones((2, 3, 6))
    with pytest.raises(error, match=message):
        jaxga.remat_scan(attention_block, params, x, **options)
