"""Bad inputs to jaxga.Mean and token_cross_entropy give errors that name them."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxga


@pytest.mark.parametrize("where", [[1.0, -1.0], [1.0, np.nan], [1.0, np.inf]])
def test_mean_of_rejects_negative_or_nan_weights(where):
    with pytest.raises(ValueError, match=r"`where` must hold a mask or finite, non-negative"):
        jaxga.Mean.of(jnp.ones(2), where=jnp.asarray(where))


@pytest.mark.parametrize("values", ["abc", None, {"a": 1.0}])
def test_mean_of_names_values_that_are_not_numbers(values):
    """Issue 22: Mean.of('abc') gave jax's "is not a valid JAX type"."""
    with pytest.raises(
        TypeError, match=rf"^Mean.of: `values` must be an array of numbers; got {values!r} of type"
    ):
        jaxga.Mean.of(values)


def test_token_cross_entropy_rejects_labels_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"^counted `labels` must be in \[0, 5\); got 0 to 5\.$"):
        jaxga.token_cross_entropy(jnp.zeros((2, 5)), jnp.array([0, 5]))


@pytest.mark.parametrize(
    "logits, labels, match",
    [
        (
            jnp.zeros((2, 5)),
            jnp.array([0.0, 1.0]),
            r"`labels` must be integer token ids; .*float32",
        ),
        (jnp.zeros(()), jnp.zeros((), jnp.int32), r"`logits` \(\) must be \[\.\.\., vocab\] for"),
        (jnp.zeros((2, 5), jnp.int32), jnp.array([0, 1]), r"`logits` must be a float array; got"),
        (
            jnp.zeros((2, 5)),
            jnp.array([0, 1, 2]),
            r"`logits` \(2, 5\) must be \[\.\.\., vocab\] for labels \(3,\)\.",
        ),
    ],
)
def test_token_cross_entropy_names_bad_dtypes_and_shapes(logits, labels, match):
    with pytest.raises(TypeError, match=match):
        jaxga.token_cross_entropy(logits, labels)


def test_padding_labels_outside_the_vocabulary_are_left_out_with_their_tokens():
    """-100 on padding (Hugging Face's convention) under jit and inside jaxga: the loss and
    gradient are those of the counted tokens alone."""
    logits = jax.random.normal(jax.random.key(0), (4, 6, 5))
    labels = jax.random.randint(jax.random.key(1), (4, 6), 0, 5)
    mask = jnp.arange(6) < jnp.array([[6], [2], [4], [1]])
    padded = jnp.where(mask, labels, -100)

    def loss(logits, labels):
        return jaxga.token_cross_entropy(logits, labels, mask)

    def counted(logits):  # the reference: a sum over the counted tokens only
        rows, cols = np.nonzero(np.asarray(mask))
        picked = logits[rows, cols]
        return jnp.mean(
            jax.nn.logsumexp(picked, -1) - picked[jnp.arange(len(rows)), labels[rows, cols]]
        )

    expected = jax.value_and_grad(counted)(logits)
    actual = jax.jit(jax.value_and_grad(lambda lg: loss(lg, padded).value))(logits)
    chex.assert_trees_all_close(actual, expected, rtol=1e-6, atol=1e-7)
    eager = jaxga.token_cross_entropy(logits, padded, mask)  # eagerly: checked, accepted
    np.testing.assert_allclose(eager.value, expected[0], rtol=1e-6)


def test_mean_of_leaves_out_masked_nans():
    m = jaxga.Mean.of(jnp.array([1.0, jnp.nan, 3.0]), where=jnp.array([1, 0, 1]))
    assert float(m.value) == 2.0 and float(m.count) == 2.0


def test_token_cross_entropy_valid_labels_match_a_hand_computation():
    m = jaxga.token_cross_entropy(jnp.zeros((2, 4)), jnp.array([0, 3]))
    np.testing.assert_allclose(m.value, np.log(4.0), rtol=1e-6)


def test_a_mask_of_another_shape_is_named():
    with pytest.raises(ValueError, match=r"`mask` must broadcast to \(2, 5\); got \(2, 4\)"):
        jaxga.token_cross_entropy(
            jnp.zeros((2, 5, 7)), jnp.zeros((2, 5), jnp.int32), jnp.ones((2, 4))
        )
    with pytest.raises(
        ValueError, match=r"Mean.of: `where` must broadcast to \(2, 5\); got \(2, 4\)"
    ):
        jaxga.Mean.of(jnp.ones((2, 5)), where=jnp.ones((2, 4)))


def test_a_where_or_mask_of_no_numbers_is_named():
    expected = r"must be an array of numbers; got 'ab' of type str\.$"
    with pytest.raises(TypeError, match=r"^Mean.of: `where` " + expected):
        jaxga.Mean.of(jnp.ones(2), where="ab")
    with pytest.raises(TypeError, match=r"^`mask` " + expected):
        jaxga.token_cross_entropy(jnp.zeros((2, 5)), jnp.array([0, 3]), "ab")


def test_means_add_as_pytrees_and_refuse_other_operands():
    assert jaxga.Mean(6.0, 1.0) + jaxga.Mean(1.0, 2.0) == jaxga.Mean(7.0, 3.0)
    with pytest.raises(TypeError, match=r"unsupported operand type\(s\) for \+: 'Mean' and 'int'"):
        jaxga.Mean(1.0, 1.0) + 1


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5])
def test_label_smoothing_is_optax_smooth_labels_on_the_whole_batch(alpha):
    """Issue 38: targets (1 - α)·one-hot + α / vocab, as optax.smooth_labels (and Gemma's
    loss); the masked mean over the whole batch, and the same through micro-batches."""
    logits = jax.random.normal(jax.random.key(0), (8, 6, 7))
    labels = jax.random.randint(jax.random.key(1), (8, 6), 0, 7)
    mask = (jnp.arange(6) < jax.random.randint(jax.random.key(2), (8, 1), 1, 7)).astype(float)

    def reference(logits):
        targets = optax.smooth_labels(jax.nn.one_hot(labels, 7), alpha)
        losses = optax.softmax_cross_entropy(logits, targets)
        return jnp.sum(losses * mask) / jnp.sum(mask)

    def loss(logits, batch):
        labels, mask = batch
        return jaxga.token_cross_entropy(logits, labels, mask, label_smoothing=alpha)

    with jax.default_matmul_precision("float32"):
        expected = jax.value_and_grad(reference)(logits)
        whole = jax.value_and_grad(lambda lg: loss(lg, (labels, mask)).value)(logits)
        chex.assert_trees_all_close(whole, expected, rtol=1e-6, atol=1e-7)
        # logits as a batch argument too: the micro-batches' rows of the gradient
        value = jaxga.value_and_grad(
            lambda _, b: loss(b[0], b[1:]), num_microbatches=4, batch_argnums=1
        )(0.0, (logits, labels, mask))[0]
        np.testing.assert_allclose(value, expected[0], rtol=1e-6)


@pytest.mark.parametrize("alpha", [-0.1, 1.0, 1.5, float("nan"), "0.1", True, None])
def test_label_smoothing_must_be_a_float_in_0_1(alpha):
    message = f"`label_smoothing` must be a float in [0, 1); got {alpha!r}."
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        jaxga.token_cross_entropy(jnp.zeros((2, 5)), jnp.array([0, 3]), label_smoothing=alpha)


def test_bfloat16_values_are_summed_in_float32():
    values = jnp.full((4096,), 1.0 + 2**-7, jnp.bfloat16)  # bfloat16 alone would round sums
    m = jaxga.Mean.of(values, where=jnp.ones(4096, jnp.bfloat16))
    assert m.total.dtype == m.count.dtype == jnp.float32
    np.testing.assert_allclose(m.total, 4096 * float(values[0]), rtol=0)


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.int8, jnp.int16, jnp.int32])
def test_narrow_integer_labels_look_up_their_own_token(dtype):
    """A vocabulary larger than the labels' dtype holds: the one-hot compares ids in int32,
    so no id wraps round onto another (optax's integer cross-entropy is the reference)."""
    vocab, labels = 300, jnp.array([5, 44, 100], dtype)
    logits = jax.random.normal(jax.random.key(0), (3, vocab)).at[:, 5 + 256].set(9.0)
    got = jaxga.token_cross_entropy(logits, labels)
    want = optax.softmax_cross_entropy_with_integer_labels(logits, labels.astype(jnp.int32))
    np.testing.assert_allclose(got.value, want.mean(), rtol=1e-6)


def test_label_smoothing_takes_a_numpy_scalar():
    logits, labels = jnp.zeros((2, 4)), jnp.array([1, 2])
    got = jaxga.token_cross_entropy(logits, labels, label_smoothing=np.float32(0.1))
    want = jaxga.token_cross_entropy(logits, labels, label_smoothing=0.1)
    np.testing.assert_allclose(got.value, want.value, rtol=1e-6)
