"""One rule for bad values (issue 38): a value jaxga can read (not traced) is checked and
raises a ValueError; a traced one cannot be read, so the same check is recorded for
`checkify.checkify` (which raises the same message) and the result is a documented
sentinel: NaN for a `Mean`'s total and count, a skipped call for `jaxga.MultiSteps`."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import checkify

import jaxga

WHERE = "Mean.of: `where` must hold a mask or finite, non-negative weights; got {}."
VALUES = jnp.array([[1.0, 3.0, 4.0, 8.0]])


def checkify_messages(fn, *args):
    """The error messages of ``fn(*args)`` under ``checkify(jit(fn))`` and ``jit(checkify(fn))``."""
    messages = []

    def fresh(*args):  # a function JAX has not traced yet: traced within checkify_values
        return fn(*args)

    for run in (checkify.checkify(jax.jit(fresh)), jax.jit(checkify.checkify(fresh))):
        with jaxga.checkify_values():
            error, _ = run(*args)
        messages.append(error.get())
        if messages[-1] is None:
            error.throw()  # raises nothing
            continue
        with pytest.raises(ValueError) as raised:  # checkify's JaxRuntimeError is a ValueError
            error.throw()
        assert str(raised.value).startswith(messages[-1])
    return messages


def assert_checkify_reports(message, fn, *args):
    for got in checkify_messages(fn, *args):
        assert got == f"{message} (`check` failed)"


def assert_nan_mean(mean):
    assert np.isnan(mean.total) and np.isnan(mean.count) and np.isnan(mean.value)


@pytest.mark.parametrize("bad, shown", [(-1.0, "-1.0"), (np.nan, "nan"), (np.inf, "inf")])
def test_bad_weights_of_mean_of(bad, shown):
    where = jnp.array([[1.0, bad, 1.0, 0.0]])

    def mean(where):
        return jaxga.Mean.of(VALUES, where=where)

    message = WHERE.format(shown)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        mean(where)
    assert_nan_mean(jax.jit(mean)(where))  # never -inf, nor a plausible number
    assert_checkify_reports(message, mean, where)
    # the gradient of its value is NaN too (but for the item of weight 0): nothing trains on it
    grad = jax.jit(jax.grad(lambda v, w: jaxga.Mean.of(v, where=w).value))(VALUES, where)
    assert np.all(np.isnan(grad[where != 0])) and grad[0, 3] == 0
    # good weights: the same mean as a plain weighted average, traced or not, under checkify
    good = jnp.array([[1.0, 2.0, 1.0, 0.0]])
    expected = np.average(np.asarray(VALUES), weights=np.asarray(good))
    for run in (mean, jax.jit(mean)):
        np.testing.assert_allclose(run(good).value, expected, rtol=1e-6)
    assert checkify_messages(mean, good) == [None, None]


@pytest.mark.parametrize("normalize", ["token_mean", "sequence_mean", "sequence_sum"])
def test_segment_ids_out_of_range(normalize):
    ids = jnp.array([[1, 1, 7, 7]])  # rows of 4 tokens: ids up to 4

    def mean(ids):
        return jaxga.Mean.of(VALUES, segment_ids=ids, normalize=normalize)

    message = "`segment_ids` must be at most 4, the tokens a row; got 7."
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        mean(ids)
    assert_nan_mean(jax.jit(mean)(ids))
    assert_checkify_reports(message, mean, ids)


def test_a_negative_weight_in_token_cross_entropys_mask():
    """Issue 38: the error named `Mean.of`'s `where`, not `mask`, without the value."""
    logits = jax.random.normal(jax.random.key(0), (2, 3, 5))
    labels = jnp.array([[0, 1, 4], [2, 3, 0]])
    mask = jnp.array([[1, 1, -1], [1, 0, 0]])

    def loss(mask):
        return jaxga.token_cross_entropy(logits, labels, mask)

    message = "`mask` must hold a mask or finite, non-negative weights; got -1.0."
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        loss(mask)
    assert_nan_mean(jax.jit(loss)(mask))
    assert_checkify_reports(message, loss, mask)


def test_counted_labels_outside_the_vocabulary():
    """Traced, a label past the vocabulary gave a one-hot of zeros: a loss of 0, plausible."""
    logits = jax.random.normal(jax.random.key(0), (2, 3, 5))
    labels = jnp.array([[0, 1, 9], [2, 3, -100]])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])  # -100 is left out; 9 is counted

    def loss(labels):
        return jaxga.token_cross_entropy(logits, labels, mask)

    message = "counted `labels` must be in [0, 5); got 0 to 9."
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        loss(labels)
    assert_nan_mean(jax.jit(loss)(labels))
    assert_checkify_reports(message, loss, labels)


def test_checkify_reports_a_bad_weight_inside_jaxgas_micro_batch_loop():
    """The loss runs traced inside jaxga's lax.scan: eagerly, the summed count is NaN and
    jaxga says so; under checkify the loss's own check names the weight."""

    def loss(w, batch):
        return jaxga.Mean.of((batch["x"] @ w) ** 2, where=batch["weight"])

    batch = {"x": jnp.arange(8.0).reshape(4, 2), "weight": jnp.array([1.0, 2.0, -3.0, 1.0])}
    grad_fn = jaxga.value_and_grad(loss, num_microbatches=2)
    with pytest.raises(ValueError, match=r"Mean counts summed to nan items"):
        grad_fn(jnp.ones(2), batch)
    value, grads = jax.jit(grad_fn)(jnp.ones(2), batch)
    assert np.isnan(value) and np.all(np.isnan(grads))
    assert_checkify_reports(WHERE.format("-3.0"), grad_fn, jnp.ones(2), batch)


def test_a_bad_where_known_before_the_trace_is_named_inside_a_step():
    """Issue 46: a list or NumPy `where` is traced with the loss: its check gave only a NaN
    count ("Mean counts summed to nan items"), or in a train step a NaN loss. It is read
    before the trace and named."""
    message = re.escape(WHERE.format("-1.0"))

    def loss(w, batch):
        return jaxga.Mean.of((batch @ w) ** 2, where=[1, -1])

    with pytest.raises(ValueError, match=f"^{message}"):  # and JAX's note on its frames
        jaxga.value_and_grad(loss, num_microbatches=2)(jnp.ones(2), jnp.ones((4, 2)))

    def step_loss(params, batch, model_state, rng):
        return jaxga.Mean.of((batch @ params) ** 2, where=np.array([1.0, -1.0])), model_state

    state = jaxga.TrainState.create(params=jnp.ones(2), tx=optax.sgd(0.1))
    with pytest.raises(ValueError, match=f"^{message}"):
        jaxga.make_train_step(step_loss, 2)(state, jnp.ones((4, 2)))
    with pytest.raises(ValueError, match=re.escape(WHERE.format("nan"))):
        jax.jit(lambda v: jaxga.Mean.of(v, where=[1.0, np.nan]))(jnp.ones(2))
    good = jax.jit(lambda v: jaxga.Mean.of(v, where=[1, 0, 3]))(jnp.array([2.0, 5.0, 6.0]))
    assert float(good.value) == 5.0 and float(good.count) == 4.0


def multisteps(every_k=2):
    tx = jaxga.MultiSteps(optax.sgd(1.0), every_k)
    params = jnp.zeros(3)
    return tx, params, tx.init(params)


@pytest.mark.parametrize("bad, shown", [(-1.0, "-1.0"), (np.nan, "nan"), (np.inf, "inf")])
def test_a_bad_multisteps_weight(bad, shown):
    tx, params, state = multisteps()
    grads = jnp.array([1.0, 2.0, 3.0])

    def update(weight, state):
        return tx.update(grads, state, params, weight=weight)

    message = f"`weight` must be finite and non-negative; got {shown}."
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        update(bad, state)
    # traced: the call is skipped, and counted in num_skipped
    _, skipped = jax.jit(update)(bad, state)
    assert int(skipped.num_skipped) == 1 and int(skipped.mini_step) == 0
    np.testing.assert_array_equal(skipped.acc_grads, state.acc_grads)
    assert_checkify_reports(message, update, bad, state)
    # the next calls are the group: the mean of the two kept gradients
    _, state = jax.jit(update)(2.0, skipped)
    updates, state = jax.jit(update)(1.0, state)
    assert bool(tx.has_updated(state))
    np.testing.assert_allclose(updates, -grads, rtol=1e-6)


def test_a_schedule_below_one():
    tx = jaxga.MultiSteps(optax.sgd(1.0), lambda step: step * 0)
    params = jnp.zeros(3)
    message = "The `every_k` schedule must return an int scalar >= 1; got {}"

    def update(state):
        return tx.update(jnp.ones(3), state, params)

    with pytest.raises(ValueError, match=re.escape(message.format("Array(0, dtype=int32"))):
        update(tx.init(params))
    _, state = jax.jit(update)(tx.init(params))  # traced: taken as 1, as documented
    assert bool(tx.has_updated(state))
    for got in checkify_messages(update, tx.init(params)):
        assert got.startswith(message.format("Array(0, dtype=int32"))


def test_a_group_mixing_weighted_and_unweighted_calls_under_checkify():
    tx, params, state = multisteps()
    _, weighted = tx.update(jnp.ones(3), state, params, weight=3.0)
    message = (
        "`weight` must be given to all calls of a group or none; got none after weighted calls."
    )

    def update(state):
        return tx.update(jnp.ones(3), state, params)

    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        update(weighted)
    assert_checkify_reports(message, update, weighted)  # traced: it weighs 1, as documented
