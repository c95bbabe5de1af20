"""Compiled memory and FLOPs of a function, without running it."""

import contextlib
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

    Attributes:
        temp_bytes: scratch memory, mostly the activations kept for the backward pass.
        alias_bytes: outputs that reuse a donated input's buffer.
        peak_bytes: ``argument_bytes + output_bytes + temp_bytes - alias_bytes``.
        flops: XLA's cost-analysis FLOPs (loop bodies once), or ``None``.
        dot_flops, dot_flops_exact: see :func:`dot_flops`.
        measured_peak_bytes: the device's peak in one real run (``measure=True``), or ``None``.

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
    flops: float | None
    dot_flops: int
    dot_flops_exact: bool
    measured_peak_bytes: int | None
    backend: str

    def __str__(self) -> str:
        rows = [
            ("arguments", format_bytes(self.argument_bytes), ""),
            ("outputs", format_bytes(self.output_bytes), ""),
            ("temporaries", format_bytes(self.temp_bytes), "activations and scratch"),
            ("aliased", format_bytes(self.alias_bytes), "outputs in donated inputs"),
            ("peak", format_bytes(self.peak_bytes), "arguments + outputs + temporaries - aliased"),
        ]
        if self.measured_peak_bytes is not None:
            rows.append(("measured peak", format_bytes(self.measured_peak_bytes), "one real run"))
        loops = "every scan iteration" + ("" if self.dot_flops_exact else "; while loops once")
        rows.append(("matmul FLOPs", f"{self.dot_flops:.3e}", f"from the jaxpr: {loops}"))
        if self.flops is not None:
            rows.append(("XLA FLOPs", f"{self.flops:.3e}", "cost analysis: loop bodies once"))
        lines = [f"  {name:<14} {value:>12}  {note}".rstrip() for name, value, note in rows]
        return "\n".join([f"MemoryReport ({self.backend})", *lines])


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
        inner = [f for f, _ in subs]
        inner = max(inner, default=0) if name == "cond" else sum(inner)
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


def memory_report(
    fn: Callable[..., Any], *args: Any, measure: bool = False, **kwargs: Any
) -> MemoryReport:
    """Compiles ``fn`` for ``args`` and reports its memory and FLOPs, without running it.

    Args:
        fn: a ``jax.jit`` or ``nnx.jit`` function, or a plain function (then jitted).
        *args: its arguments (and ``**kwargs``), arrays or ``jax.ShapeDtypeStruct``.
        measure: also run ``fn`` once and record the device's peak (GPU, TPU; needs arrays).

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> x = jax.ShapeDtypeStruct((32, 8), jnp.float32)
        >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
        >>> report = jaxga.memory_report(jax.grad(loss), jnp.ones((8, 8)), x)
        >>> report.argument_bytes, report.output_bytes, report.dot_flops
        (1280, 256, 8192)
    """
    if not callable(fn):
        raise TypeError(
            f"`fn` must be a jitted or plain function; got {fn!r} of type {type(fn).__name__}."
        )
    leaves = jax.tree.leaves((args, kwargs))
    if measure and any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        raise TypeError("`measure=True` runs `fn`: it needs arrays, not jax.ShapeDtypeStruct.")
    jitted = fn if hasattr(fn, "trace") and hasattr(fn, "lower") else jax.jit(fn)
    traced = jitted.trace(*args, **kwargs)
    compiled = traced.lower().compile()
    stats = compiled.memory_analysis()
    if stats is None:
        raise ValueError(f"The {jax.default_backend()} backend gives no memory analysis of `fn`.")
    flops = None
    with contextlib.suppress(Exception):  # backends without a cost model raise
        flops = compiled.cost_analysis().get("flops")
    flops = float(flops) if flops is not None and flops >= 0 else None
    count, exact = dot_flops(getattr(traced, "traced", traced).jaxpr)  # nnx.jit: flax's Traced
    measured = None
    before = (jax.devices()[0].memory_stats() if measure else None) or {}
    if "peak_bytes_in_use" in before:  # a GPU or TPU: run once
        jax.block_until_ready(jitted(*args, **kwargs))
        device_peak = jax.devices()[0].memory_stats()["peak_bytes_in_use"]
        if device_peak > before["peak_bytes_in_use"]:  # else a larger earlier peak hides it
            arrays = sum(x.nbytes for x in leaves if isinstance(x, jax.Array))
            measured = device_peak - before["bytes_in_use"] + arrays
    sizes = [int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes)]
    sizes += [int(stats.temp_size_in_bytes), int(stats.alias_size_in_bytes)]
    peak = sum(sizes[:3]) - sizes[3]
    return MemoryReport(*sizes, peak, flops, count, exact, measured, jax.default_backend())
