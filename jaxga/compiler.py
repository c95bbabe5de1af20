"""XLA options for the programs jaxga compiles (and for your own ``jax.jit`` around jaxga).

One option, on GPUs only: ``xla_gpu_enable_dus_accumulator_zero_init_elimination``.
A ``lax.scan`` stacks its per-iteration outputs — in a backward pass, the residuals the
forward pass of a layer scan keeps for every layer — into buffers that JAX creates
zero-filled and the loop then overwrites slice by slice. XLA merges the identical zero
broadcasts into one and copies it into every such buffer before the loop runs: for
GPT-2-small's shape (``benchmarks/run.py --only 2``, 16 sequences of 512 tokens per
micro-batch, no remat) 26 copies, 4.4 GiB, per micro-batch, in front of every layer scan.
The option (off by default in XLA) proves such a buffer is fully overwritten before it
is read and leaves it uninitialised instead: no copy, the same results. On an H100 it
took ``jaxga.value_and_grad`` with 4 micro-batches from 99.2 to 85.8 ms a step (and
``optax.MultiSteps`` from 93.6 to 88.6 ms; README, Benchmarks). It does nothing on other
backends, so
:func:`compiler_options` returns no options there.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

__all__ = ["compiler_options"]

_GPU_OPTIONS = {"xla_gpu_enable_dus_accumulator_zero_init_elimination": True}


@functools.cache
def _accepted() -> bool:
    """Whether this jaxlib's XLA knows the options (older ones reject unknown names; every
    backend's compiler reads the same table of names)."""
    try:
        jax.jit(lambda: 0, compiler_options=_GPU_OPTIONS).lower().compile()
    except Exception:  # an unknown option; the exception's type varies with the jaxlib
        return False
    return True


def compiler_options(backend: str | None = None) -> dict[str, Any]:
    """The XLA options jaxga compiles its train step with, for ``jax.jit(compiler_options=)``.

    On a GPU backend (``"gpu"``, ``"cuda"``, ``"rocm"``; the default backend when
    ``None``) these are the options described in :mod:`jaxga.compiler`: XLA stops
    zero-filling the buffers a scan stacks its outputs into, which in a step of
    ``jaxga.value_and_grad`` over a ``jaxga.remat_scan`` model is copies of gigabytes
    per micro-batch. Elsewhere, or with a jaxlib whose XLA does not know them, ``{}``.
    Pass them to the ``jax.jit`` of your own step::

        step = jax.jit(train_step, donate_argnums=(0, 1),
                       compiler_options=jaxga.compiler_options())

    :func:`jaxga.make_train_step` does this itself. The options change no result, only
    what XLA copies.

    Example:
        >>> import jaxga
        >>> jaxga.compiler_options("cpu")
        {}
    """
    if backend is not None and not isinstance(backend, str):
        raise TypeError(
            f"`backend` must be a platform name such as 'gpu' or 'cpu', or None for the "
            f"default backend; got {backend!r} of type {type(backend).__name__}."
        )
    backend = backend or jax.default_backend()
    if backend not in ("gpu", "cuda", "rocm") or not _accepted():
        return {}
    return dict(_GPU_OPTIONS)
