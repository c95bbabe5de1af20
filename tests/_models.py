"""Small models that several test modules share: plain JAX functions of pytrees."""

import jax
import jax.numpy as jnp


def mlp_params(key: jax.Array, sizes: tuple[int, ...] = (6, 16, 16, 3)) -> list[dict]:
    """Returns the layers of a tanh MLP: ``[{"w": (m, n), "b": (n,)}, ...]``, LeCun-scaled.

    Example:
        >>> import jax
        >>> [p["w"].shape for p in mlp_params(jax.random.key(0), (5, 8, 3))]
        [(5, 8), (8, 3)]
    """
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (m, n)) / jnp.sqrt(m), "b": jnp.zeros(n)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:])
    ]


def mlp(params: list[dict], x: jax.Array) -> jax.Array:
    """Applies the MLP of :func:`mlp_params`: tanh hidden layers, a linear output.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> mlp(mlp_params(jax.random.key(0), (5, 8, 3)), jnp.ones((2, 5))).shape
        (2, 3)
    """
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]
