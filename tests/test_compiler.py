"""jaxga.compiler_options: the XLA options jaxga compiles with change no result."""

import chex
import jax
import jax.numpy as jnp
import pytest

import jaxga
from jaxga.compiler import _GPU_OPTIONS


def test_options_are_for_gpus_only():
    assert jaxga.compiler_options("cpu") == {}
    assert jaxga.compiler_options("tpu") == {}
    # A GPU gets them, as a copy.
    options = jaxga.compiler_options("gpu")
    assert options == _GPU_OPTIONS and options is not _GPU_OPTIONS
    assert jaxga.compiler_options("cuda") == jaxga.compiler_options("rocm") == _GPU_OPTIONS
    assert jaxga.compiler_options() == jaxga.compiler_options(jax.default_backend())
    with pytest.raises(TypeError, match=r"`backend` must be a platform name .* got 123"):
        jaxga.compiler_options(123)


def test_this_jaxlib_compiles_with_the_gpu_options():
    """Option names are checked on every backend: this one takes what a GPU would get."""
    options = jaxga.compiler_options("gpu")
    compiled = jax.jit(lambda x: x + 1, compiler_options=options).lower(1.0).compile()
    assert compiled(1.0) == 2.0


def test_options_change_no_result_of_a_scan_with_stacked_outputs():
    # The option's target: buffers a scan stacks per-layer residuals into, nested in the
    # micro-batch loop. Compiled with the GPU options (inert off a GPU; on one, the
    # buffers are left uninitialised), results must equal a plain jit's bit for bit.
    w = jax.random.normal(jax.random.key(0), (6, 8, 8)) / 3
    batch = jax.random.normal(jax.random.key(1), (16, 8))

    def loss(w, x):
        y = jaxga.remat_scan(lambda w, h: jnp.tanh(h @ w), w, x, policy="none")
        return jaxga.Mean.of(jnp.sum(y**2, -1))

    grad_fn = jaxga.value_and_grad(loss, num_microbatches=4)
    plain = jax.jit(grad_fn)(w, batch)
    options = jaxga.compiler_options("gpu")
    tuned = jax.jit(grad_fn, compiler_options=options)(w, batch)
    chex.assert_trees_all_equal(plain, tuned)
