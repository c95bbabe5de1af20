"""XLA options for the programs jaxga compiles (and for your own ``jax.jit`` around jaxga)."""

import jax

_GPUS = ("gpu", "cuda", "rocm")  # the platform names of a GPU
_GPU_OPTIONS = {"xla_gpu_enable_dus_accumulator_zero_init_elimination": True}  # see docs/gpus.md


def compiler_options(backend: str | None = None) -> dict[str, bool]:
    """Returns the XLA options jaxga compiles its train steps with, for ``jax.jit``.

    Args:
        backend: the platform, e.g. ``"gpu"``; default: ``jax.default_backend()``.

    Returns:
        A new dict: the GPU options on ``"gpu"``, ``"cuda"`` or ``"rocm"`` (in any case),
        else ``{}``.

    Raises:
        ValueError: a name that holds one of these and is not one (``"cuda12"``), which
            would otherwise give a GPU no options.

    Examples:
        >>> import jaxga
        >>> jaxga.compiler_options("cpu")
        {}
    """
    if not isinstance(backend, str | None):
        raise TypeError(f"`backend` must be a platform name ('gpu') or None; got {backend!r}.")
    platform = (backend or jax.default_backend()).lower()
    if platform not in _GPUS and any(name in platform for name in _GPUS):  # "cuda12", "gpu:0"
        raise ValueError(f"`backend` must be a platform name, {_GPUS} for a GPU; got {backend!r}.")
    return dict(_GPU_OPTIONS) if platform in _GPUS else {}
