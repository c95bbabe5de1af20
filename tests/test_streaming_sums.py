"""The gradient sums of a streamed stack, added in the backward pass (issue 48): inside a
micro-batch loop, `remat_scan(stream=True)` adds each layer's gradient to its sum as the
backward pass produces it (`_streaming.summing_into`), where it can do so exactly and once,
and leaves the sum to the loop everywhere else; either way the gradients are the whole
batch's, checked against `jax.value_and_grad` and against the resident loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxga
from jaxga._streaming import summing_into
from tests.test_streaming import HOST, assert_equal

LAYERS, DIM, ROWS = 4, 8, 8


@pytest.fixture(autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def layer(w, h):
    return jnp.tanh(h @ w)


def stack(dtype=jnp.float32):
    w = jax.random.normal(jax.random.key(0), (LAYERS, DIM, DIM)) / np.sqrt(DIM)
    return w.astype(dtype)


def inputs():
    return jax.random.normal(jax.random.key(1), (ROWS, DIM))


def once(w, x, stream=True):
    """The stack used once: its gradient is added to its sum in the backward pass."""
    return jaxga.Mean.of(jaxga.remat_scan(layer, w, x, stream=stream) ** 2)


def twice(w, x, stream=True):
    """The stack run twice: the first scan adds the sum, the second its gradient alone."""
    h = jaxga.remat_scan(layer, w, x, stream=stream)
    return jaxga.Mean.of(jaxga.remat_scan(layer, w, h, stream=stream) ** 2)


@jax.custom_jvp
def reversed_gradient(w):
    """A gradient-reversal layer: the identity, its tangent negated."""
    return w


@reversed_gradient.defjvp
def _reversed_jvp(primals, tangents):
    return primals[0], -tangents[0]


@jax.custom_vjp
def halved_gradient(w):
    """The identity, its cotangent halved; its forward rule hands on ``w`` itself."""
    return w


halved_gradient.defvjp(lambda w: (w, None), lambda _, g: (0.5 * g,))


def reversed_(w, x, stream=True):
    """The stack through a user's `custom_jvp`, whose rule hands the scan the very primal:
    the sum must not go through the rule (the loop adds it)."""
    return once(reversed_gradient(w), x, stream=stream)


def halved(w, x, stream=True):
    """The stack through a user's `custom_vjp` that scales its gradient."""
    return once(halved_gradient(w), x, stream=stream)


def vmapped(w, x, stream=True):
    """The scan under `jax.vmap`, the stack closed over: its backward pass runs per row, so
    adding the sum there would add it once a row; it is added after the backward pass."""
    rows = jax.vmap(lambda r: jaxga.remat_scan(layer, w, r[None], stream=stream)[0])(x)
    return jaxga.Mean.of(rows**2)


def also_decayed(w, x, stream=True):
    """The stack used by the scan and, whole, by a penalty: both gradients summed."""
    penalty = 0.01 * jnp.sum(jax.device_put(w, jax.memory.Space.Device) ** 2)
    return jaxga.Mean.of(jaxga.remat_scan(layer, w, x, stream=stream) ** 2 + penalty)


def whole_batch(loss, w, x):
    """`jax.value_and_grad` of the whole batch's mean, the stack on the device, no stream."""
    value, grad = jax.value_and_grad(lambda w: loss(w, x, stream=False).value)(w)
    return value, grad


def accumulated(loss, w, x, *, k, stream):
    """`jaxga.value_and_grad` over ``k`` micro-batches, jitted."""
    grad = jaxga.value_and_grad(lambda w, x: loss(w, x, stream=stream), num_microbatches=k)
    return jax.jit(grad)(w, x)


@pytest.mark.parametrize("loss", [once, twice, vmapped, also_decayed, reversed_, halved])
@pytest.mark.parametrize("k", [1, 4])
def test_the_streamed_sums_are_the_whole_batch_gradient(loss, k):
    """However the loss uses the stack, the streamed loop's gradient is the whole batch's
    (to float32 rounding) and, where the stack is used once, the resident loop's bit for bit;
    the gradient lives in host memory, as the stack does."""
    w, x = stack(), inputs()
    value, grad = accumulated(loss, jax.device_put(w, HOST), x, k=k, stream=True)
    assert grad.sharding.memory_kind == "pinned_host"
    want_value, want = whole_batch(loss, w, x)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=2e-6, atol=1e-7)
    if loss is once:
        assert_equal(grad, accumulated(loss, w, x, k=k, stream=False)[1])


@pytest.mark.parametrize(
    "loss, added",
    [
        (once, True),
        (twice, True),
        (vmapped, False),
        (also_decayed, True),
        (reversed_, False),
        (halved, False),
    ],
)
def test_a_sum_is_added_in_the_backward_pass_only_where_it_is_added_once(loss, added):
    """`summing_into` adds a stack's sum in the scan's backward pass when the scan is traced
    at the gradient's own level (not under `jax.vmap`), and returns the new sum: the sum
    plus this gradient, whichever way it was added."""
    w, x = jax.device_put(stack(), HOST), inputs()
    sums = jax.device_put(jnp.full(w.shape, 0.5), HOST)

    def gradient(w, sums):
        def value(w):
            summing.enter(w)  # as jaxga's loop records the primals its loss receives
            return loss(w, x).value

        with summing_into(w, sums) as summing:
            grad = jax.grad(value)(w)
        return grad, summing.added_tree()

    grad, was_added = gradient(w, sums)
    assert was_added is added
    plain = jax.grad(lambda w: loss(w, x).value)(w)
    got = grad if added else sums + grad
    np.testing.assert_allclose(np.asarray(got), np.asarray(sums + plain), rtol=2e-6, atol=1e-7)


def test_a_sum_of_another_dtype_is_added_after_the_backward_pass():
    """A bfloat16 stack's gradient summed in float32 (`accumulator_dtype`): the sum cannot
    stand for the bfloat16 gradient, so the loop adds it, as the resident loop does."""
    w, x = stack(jnp.bfloat16), inputs()
    options = {"accumulator_dtype": jnp.float32}
    grad = jaxga.value_and_grad(lambda w, x: once(w, x), num_microbatches=4, **options)
    resident = jaxga.value_and_grad(
        lambda w, x: once(w, x, stream=False), num_microbatches=4, **options
    )
    got = jax.jit(grad)(jax.device_put(w, HOST), x)[1]
    assert got.dtype == jnp.bfloat16
    assert_equal(got, jax.jit(resident)(w, x)[1])


def test_the_loop_moves_no_gradient_of_the_stack_home():
    """With the sum added in the backward pass, each micro-batch moves the stack forward and
    backward and the sum in and out (4 stacks), and one layer more (the last prefetch):
    the micro-batch's gradient never goes to host memory on its own."""
    w, x = jax.device_put(stack(), HOST), inputs()
    k = 4
    grad = jaxga.value_and_grad(lambda w, x: once(w, x), num_microbatches=k)
    moved = jaxga.memory_report(grad, w, x).moved_bytes
    size = w.nbytes
    once_a_call = 3 * size  # the sums' zeros written, the division's fetch and write
    assert moved == 4 * k * size + k * size // LAYERS + once_a_call


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("k", [1, 4])
def test_the_sums_added_in_the_backward_pass_are_the_loops_bit_for_bit(stream, k):
    """The stack streamed from host memory, or on the device under remat "full" (the
    resident `remat_scan` takes the streamed scan's backward pass inside jaxga's loop): the
    gradient equals bit for bit the loop's that adds each micro-batch's gradient after the
    backward pass (with ``num_real_microbatches``, whose cond leaves the sums to the loop)."""
    w, x = stack(), inputs()
    w = jax.device_put(w, HOST) if stream else w

    def grad(**options):
        loss = jaxga.value_and_grad(
            lambda w, x: once(w, x, stream=stream), num_microbatches=k, **options
        )
        return jax.jit(loss)(w, x)

    assert_equal(grad(), grad(num_real_microbatches=k))


def test_the_resident_stack_adds_its_sums_in_the_backward_pass():
    """`remat_scan` on a stack on the device, remat "full", inside a gradient that
    `summing_into` wraps as jaxga's loop does (`Summing.enter`): the sum is added in the
    backward pass; with another policy (whose residuals the streamed scan would not keep),
    or outside the loop, the resident scan runs and the loop adds it."""
    w, x = stack(), inputs()
    sums = jnp.full(w.shape, 0.5)

    def gradient(policy):
        def loss(w):
            summing.enter(w)
            return jnp.sum(jaxga.remat_scan(layer, w, x, policy=policy) ** 2)

        with summing_into(w, sums) as summing:
            grad = jax.grad(loss)(w)
        return grad, summing.added_tree()

    plain = jax.grad(lambda w: jnp.sum(jaxga.remat_scan(layer, w, x) ** 2))(w)
    for policy, added in (("full", True), ("dots", False)):
        grad, was_added = gradient(policy)
        assert was_added is added
        got = grad if added else sums + grad
        np.testing.assert_allclose(np.asarray(got), np.asarray(sums + plain), rtol=2e-6)


def test_adding_in_the_backward_pass_keeps_no_gradient_of_the_stack_beside_its_sum():
    """XLA:CPU's compiled temporaries of `value_and_grad` over 4 micro-batches, a resident
    stack under remat "full": under the loop's that adds each micro-batch's gradient after
    the backward pass by at least most of the stack's gradient (the gradient and the new
    sum beside the old one)."""
    w = jax.random.normal(jax.random.key(0), (16, 64, 64)) / 8
    x = jax.random.normal(jax.random.key(1), (8, 64))

    def temporaries(**options):
        grad = jaxga.value_and_grad(
            lambda w, x: once(w, x, stream=False), num_microbatches=4, **options
        )
        return jaxga.memory_report(grad, w, x).temp_bytes

    assert temporaries() <= temporaries(num_real_microbatches=4) - 0.75 * w.nbytes


def test_one_array_given_as_two_primals_adds_to_its_own_sum():
    """The same array under two differentiated leaves, the scan over the second: its gradient
    goes to the second leaf's sum alone (the differentiated function sees two values), the
    first leaf's (zero) is left to the loop."""
    w, x = stack(), inputs()
    sums = (jnp.full(w.shape, 10.0), jnp.full(w.shape, 100.0))

    def value(pair):
        summing.enter(pair)
        return jnp.sum(jaxga.remat_scan(layer, pair[1], x, stream=True) ** 2)

    with summing_into((w, w), sums) as summing:
        grads = jax.grad(value)((w, w))
    assert summing.added_tree() == (False, True)
    plain = jax.grad(lambda w: jnp.sum(jaxga.remat_scan(layer, w, x) ** 2))(w)
    assert_equal(grads[0], jnp.zeros_like(w))
    np.testing.assert_allclose(np.asarray(grads[1]), np.asarray(sums[1] + plain), rtol=1e-6)


def both(w, x, stream=True):
    """One stack given twice in one scan's tree: its sum is taken once."""
    stacks = {"a": w, "b": w}
    h = jaxga.remat_scan(lambda p, h: jnp.tanh(h @ p["a"] + h @ p["b"]), stacks, x, stream=stream)
    return jaxga.Mean.of(h**2)


@pytest.mark.parametrize("stream", [True, False])
def test_a_stack_twice_in_one_scan_adds_its_sum_once(stream):
    """The same differentiated stack under two leaves of one scan's tree (host memory, or on
    the device under remat "full"): the first leaf takes the sum, the second adds its
    gradient alone; the whole batch's gradient to float32 rounding."""
    w, x = stack(), inputs()
    w_given = jax.device_put(w, HOST) if stream else w
    grad = jax.jit(jaxga.value_and_grad(lambda w, x: both(w, x, stream), num_microbatches=4))
    got = grad(w_given, x)[1]
    want = jax.grad(lambda w: both(w, x, stream=False).value)(w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-7)


def test_a_scan_takes_no_sum_of_a_value_two_primals_share():
    """Were one traced value two primals as the differentiated function sees them (JAX
    gives each leaf its own), a scan over it could not tell whose sum it is: it takes none."""
    w, x = stack(), inputs()
    sums = (jnp.full(w.shape, 10.0), jnp.full(w.shape, 100.0))

    def value(pair):
        summing.enter((pair[1], pair[1]))
        return jnp.sum(jaxga.remat_scan(layer, pair[1], x, stream=True) ** 2)

    with summing_into((w, w), sums) as summing:
        jax.grad(value)((w, w))
    assert summing.added_tree() == (False, False)
