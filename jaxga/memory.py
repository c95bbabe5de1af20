"""Compiled memory and FLOPs of a function, without running it."""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """What XLA's compiled program for one call needs, in bytes, and how much it computes.

    Bytes are a device's (each device's, on a mesh); arrays in host memory count apart.

    Attributes:
        temp_bytes: scratch memory, mostly the activations kept for the backward pass.
        alias_bytes: outputs that reuse a donated input's buffer.
        peak_bytes: ``argument_bytes + output_bytes + temp_bytes - alias_bytes``.
        host_bytes: the same sum for the arguments, outputs and scratch in host memory.
        dot_flops, dot_flops_exact: see :func:`dot_flops`.

    Example:
        >>> import jax.numpy as jnp, jaxga
        >>> jaxga.memory_report(lambda a: a @ a, jnp.ones((256, 256))).dot_flops
        33554432
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    peak_bytes: int
    host_bytes: int
    dot_flops: int
    dot_flops_exact: bool
    backend: str


def format_bytes(n: int) -> str:
    """Formats a byte count with a binary unit: ``format_bytes(1536) == '1.50 KiB'``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def dot_flops(jaxpr: Any) -> tuple[int, bool]:
    """Returns ``(flops, exact)``: the matmul and convolution FLOPs of a jaxpr, loops unrolled.

    A scan counts ``length`` times, a ``cond`` its costliest branch, dead code not at all, a
    ``while_loop`` body once (then ``exact`` is ``False``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxga.memory import dot_flops
        >>> dot_flops(jax.make_jaxpr(jnp.dot)(jnp.ones((4, 3)), jnp.ones((3, 5))))
        (120, True)
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    used = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
    total, exact = 0, True
    for eqn in reversed(jaxpr.eqns):  # from the outputs back, skipping the dead code XLA drops
        if not (eqn.effects or any(v in used for v in eqn.outvars)):
            continue
        used.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
        name, p = eqn.primitive.name, eqn.params
        subs = [dot_flops(j) for j in jex_core.jaxprs_in_params(p)]
        exact = exact and name != "while" and all(e for _, e in subs)
        inner = (max if name == "cond" else sum)(f for f, _ in subs)  # a cond has branches
        total += inner * (p["length"] if name == "scan" else 1)
        if name == "dot_general":  # 2 FLOPs per multiply-add
            (contract, _), _ = p["dimension_numbers"]
            size = math.prod(eqn.invars[0].aval.shape[d] for d in contract)
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * size
        elif name == "conv_general_dilated":  # as XLA's cost analysis: taps on real inputs only
            lhs, rhs, out = (v.aval.shape for v in (*eqn.invars[:2], eqn.outvars[0]))
            lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
            taps = 1
            for i, (pad, _) in enumerate(p["padding"]):
                o, j = np.ogrid[: out[out_spec[i + 2]], : rhs[rhs_spec[i + 2]]]
                x = o * p["window_strides"][i] + j * p["rhs_dilation"][i] - pad
                real = (x >= 0) & (x <= (lhs[lhs_spec[i + 2]] - 1) * p["lhs_dilation"][i])
                taps *= int(np.sum(real & (x % p["lhs_dilation"][i] == 0)))
            total += 2 * out[out_spec[0]] * out[out_spec[1]] * rhs[rhs_spec[1]] * taps
    return total, exact


def _sizes(compiled: Any, stats: Any) -> tuple[list[int], list[int]]:
    """Device and host bytes of arguments, outputs, scratch and aliases (host: by memory kind)."""
    kinds = ("argument", "output", "temp", "alias")
    device = [int(getattr(stats, f"{kind}_size_in_bytes")) for kind in kinds]
    host = [int(getattr(stats, f"host_{kind}_size_in_bytes", 0)) for kind in kinds]
    if any(host):
        return device, host
    compiled = getattr(compiled, "compiled", compiled)  # nnx.jit's holds jax's
    on_host = lambda s: getattr(s, "memory_kind", None) in ("pinned_host", "unpinned_host")
    size = lambda x, s: math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
    args = zip(jax.tree.leaves(compiled.args_info), jax.tree.leaves(compiled.input_shardings))
    inputs = [(x, s) for x, s in args if on_host(s)]
    outputs = [(x, x.sharding) for x in jax.tree.leaves(compiled.out_info) if on_host(x.sharding)]
    donated = sum(size(x, s) for x, s in inputs if x.donated)  # XLA aliases them to outputs
    host = [sum(size(x, s) for x, s in inputs), sum(size(x, s) for x, s in outputs), 0]
    host.append(min(donated, host[1]))
    return [d - h for d, h in zip(device, host, strict=True)], host


def memory_report(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> MemoryReport:
    """Compiles ``fn`` for ``args`` and reports its memory and FLOPs, without running it.

    Args:
        fn: a ``jax.jit`` or ``nnx.jit`` function, or a plain function (then jitted).
        *args: its arguments (and ``**kwargs``), arrays or ``jax.ShapeDtypeStruct``.

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> x = jax.ShapeDtypeStruct((32, 8), jnp.float32)
        >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
        >>> report = jaxga.memory_report(jax.grad(loss), jnp.ones((8, 8)), x)
        >>> report.argument_bytes, report.output_bytes, report.dot_flops
        (1280, 256, 8192)
    """
    if not callable(fn):  # not _checks.check_callable: a model's forward pass is a function here
        raise TypeError(f"`fn` must be a function; got {fn!r} of type {type(fn).__name__}.")
    jitted = fn if hasattr(fn, "trace") and hasattr(fn, "lower") else jax.jit(fn)
    traced = jitted.trace(*args, **kwargs)
    compiled = traced.lower().compile()
    stats = compiled.memory_analysis()
    if stats is None:
        raise ValueError(f"The {jax.default_backend()} backend gives no memory analysis of `fn`.")
    count, exact = dot_flops(getattr(traced, "traced", traced).jaxpr)  # nnx.jit: flax's Traced
    sizes, host = _sizes(compiled, stats)
    peak, host_peak = (sum(x[:3]) - x[3] for x in (sizes, host))
    return MemoryReport(*sizes, peak, host_peak, count, exact, jax.default_backend())
