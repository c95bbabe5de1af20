"""XLA options for the programs jaxga compiles (and for your own ``jax.jit`` around jaxga)."""

import jax

# GPU only: a scan's stacked outputs are left uninitialised instead of zero-filled.
_GPU_OPTIONS = {"xla_gpu_enable_dus_accumulator_zero_init_elimination": True}
_PROBE = jax.jit(lambda: 0, compiler_options=_GPU_OPTIONS)  # compiled once, at the first GPU call


def compiler_options(backend: str | None = None) -> dict[str, bool]:
    """Returns jaxga's XLA options for ``jax.jit(compiler_options=)`` on ``backend`` (GPU only).

    Example:
        >>> import jaxga
        >>> jaxga.compiler_options("cpu")
        {}
    """
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"`backend` must be a platform name ('gpu') or None; got {backend!r}.")
    if (backend or jax.default_backend()) not in ("gpu", "cuda", "rocm"):
        return {}
    try:  # older jaxlibs reject unknown option names, with varying exception types
        _PROBE.lower().compile()
    except Exception:
        return {}
    return dict(_GPU_OPTIONS)
