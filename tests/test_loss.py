"""Bad inputs to jaxga.Mean, as_mean and token_cross_entropy give errors that name them."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxga


@pytest.mark.parametrize("where", [[1.0, -1.0], [1.0, np.nan]])
def test_mean_of_rejects_negative_or_nan_weights(where):
    with pytest.raises(ValueError, match=r"`where` must hold a mask or finite, non-negative"):
        jaxga.Mean.of(jnp.ones(2), where=jnp.asarray(where))


@pytest.mark.parametrize("value", ["x", jnp.int32(2)])
def test_as_mean_rejects_what_is_not_a_float(value):
    with pytest.raises(TypeError, match=r"as_mean: `value` must be a jaxga.Mean or a float"):
        jaxga.as_mean(value)


def test_token_cross_entropy_rejects_labels_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"`labels` must lie in \[0, 5\) .* from 0 to 5"):
        jaxga.token_cross_entropy(jnp.zeros((2, 5)), jnp.array([0, 5]))


def test_token_cross_entropy_valid_labels_match_a_hand_computation():
    m = jaxga.token_cross_entropy(jnp.zeros((2, 4)), jnp.array([0, 3]))
    np.testing.assert_allclose(m.value, np.log(4.0), rtol=1e-6)


def test_a_mask_of_another_shape_is_named():
    with pytest.raises(
        ValueError, match=r"`mask` must broadcast to the shape of `labels` \(2, 5\)"
    ):
        jaxga.token_cross_entropy(
            jnp.zeros((2, 5, 7)), jnp.zeros((2, 5), jnp.int32), jnp.ones((2, 4))
        )
    with pytest.raises(
        ValueError, match=r"Mean.of: `where` must broadcast .* \(2, 5\); got \(2, 4\)"
    ):
        jaxga.Mean.of(jnp.ones((2, 5)), where=jnp.ones((2, 4)))
