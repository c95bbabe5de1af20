"""Compiled memory and FLOPs of a function, without running it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jex_core

__all__ = ["MemoryReport", "dot_flops", "memory_report"]


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """What XLA's compiled program for one call needs, in bytes, and how much it computes.

    Attributes:
        argument_bytes: the inputs (parameters, batch, ...).
        output_bytes: the outputs (e.g. gradients).
        temp_bytes: scratch memory the program allocates while it runs; for a training
            step, mostly the activations kept for the backward pass. This is the
            *activation memory* that rematerialisation reduces.
        alias_bytes: outputs that reuse an input's buffer (donated arguments).
        peak_bytes: ``argument_bytes + output_bytes + temp_bytes - alias_bytes``: an
            upper bound on the device memory of one call.
        flops: XLA's cost-analysis FLOPs, or ``None`` where the backend reports none.
            XLA counts the body of a loop once, whatever its trip count: for a program
            with a ``lax.scan`` over layers or micro-batches it is far below the work
            done. Use ``dot_flops`` to compare programs.
        dot_flops: FLOPs of every matrix multiplication and convolution (2 per
            multiply-add) in the program JAX hands to XLA, counted from its jaxpr: a scan
            body counts once per iteration, and a rematerialised recomputation counts
            again where it runs in the backward pass; dead code is skipped, as XLA
            drops it. A ``while_loop`` with a trip count unknown at compile time counts
            once (see ``dot_flops_exact``). See :func:`dot_flops`.
        dot_flops_exact: ``False`` when the jaxpr has a ``while_loop``, whose body is
            counted once.
        measured_peak_bytes: with ``measure=True`` on a backend with memory statistics
            (GPU, TPU): the device's peak bytes in use during one real run, including its
            arguments; otherwise ``None``.
        backend: the platform compiled for, e.g. ``"cpu"`` or ``"gpu"``.

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
        >>> report = jaxga.memory_report(lambda a: a @ a, x)
        >>> report.argument_bytes, report.output_bytes, report.dot_flops
        (262144, 262144, 33554432)
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
        loops = "every scan iteration and recomputation" + (
            "" if self.dot_flops_exact else "; while-loop bodies once"
        )
        rows.append(("matmul FLOPs", f"{self.dot_flops:.3e}", f"from the jaxpr: {loops}"))
        if self.flops is not None:
            rows.append(("XLA FLOPs", f"{self.flops:.3e}", "cost analysis: loop bodies once"))
        lines = [f"MemoryReport ({self.backend})"]
        lines += [f"  {name:<14} {value:>12}  {note}".rstrip() for name, value, note in rows]
        return "\n".join(lines)


def format_bytes(n: int) -> str:
    """Formats a byte count with a binary unit.

    Example:
        >>> from jaxga.memory import format_bytes
        >>> format_bytes(3 * 2**20 // 2)
        '1.50 MiB'
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _eqn_dot_flops(eqn: Any) -> int:
    name = eqn.primitive.name
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs_shape = eqn.invars[0].aval.shape
        contracted = math.prod(lhs_shape[d] for d in lhs_contract)
        return 2 * math.prod(eqn.outvars[0].aval.shape) * contracted
    if name == "conv_general_dilated":
        return _conv_flops(eqn)
    return 0


def _valid_taps(
    size: int, out: int, window: int, stride: int, pad: tuple, lhs_dil: int, rhs_dil: int
) -> int:
    """Kernel taps on a real input (not padding, not a dilation hole), over all outputs."""
    last = (size - 1) * lhs_dil
    return sum(
        1
        for o in range(out)
        for j in range(window)
        if 0 <= (p := o * stride + j * rhs_dil - pad[0]) <= last and p % lhs_dil == 0
    )


def _conv_flops(eqn: Any) -> int:
    # Padding taps multiply zeros; like XLA's cost analysis, count only the real ones.
    params = eqn.params
    lhs, rhs, out = (v.aval.shape for v in (*eqn.invars[:2], eqn.outvars[0]))
    lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
    taps = 1
    for i in range(len(lhs_spec) - 2):
        taps *= _valid_taps(
            lhs[lhs_spec[i + 2]],
            out[out_spec[i + 2]],
            rhs[rhs_spec[i + 2]],
            params["window_strides"][i],
            params["padding"][i],
            (params["lhs_dilation"] or (1,) * len(lhs))[i],
            (params["rhs_dilation"] or (1,) * len(lhs))[i],
        )
    outputs = out[out_spec[0]] * out[out_spec[1]]
    return 2 * outputs * rhs[rhs_spec[1]] * taps


def _live_eqns(jaxpr: Any) -> list[Any]:
    """The equations that feed an output or have effects: what XLA keeps after DCE."""
    used = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
    live = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in used for v in eqn.outvars):
            live.append(eqn)
            used.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
    return live[::-1]


def _jaxpr_dot_flops(jaxpr: Any) -> tuple[int, bool]:
    total, exact = 0, True
    for eqn in _live_eqns(jaxpr):
        name = eqn.primitive.name
        subs = [_jaxpr_dot_flops(j) for j in jex_core.jaxprs_in_params(eqn.params)]
        exact = exact and all(e for _, e in subs) and name != "while"
        if name == "scan":
            total += eqn.params["length"] * sum(f for f, _ in subs)
        elif name == "cond":
            total += max((f for f, _ in subs), default=0)
        else:
            total += _eqn_dot_flops(eqn) + sum(f for f, _ in subs)
    return total, exact


def dot_flops(jaxpr: Any) -> tuple[int, bool]:
    """Counts the matmul and convolution FLOPs of a (closed) jaxpr, loops unrolled.

    Returns ``(flops, exact)``: a scan body counts ``length`` times, a ``cond`` counts
    its most expensive branch, a rematerialised (``jax.checkpoint``) body counts each
    time it appears, and ``exact`` is ``False`` if a ``while_loop`` (unknown trip count)
    was counted once. Equations whose results are never used (and that have no
    effects) are skipped, as XLA's dead-code elimination drops them. Convolutions count
    only the kernel taps on real inputs, not on padding, as XLA does.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxga.memory import dot_flops
        >>> f = lambda a, b: a @ b
        >>> dot_flops(jax.make_jaxpr(f)(jnp.ones((4, 3)), jnp.ones((3, 5))))
        (120, True)
    """
    return _jaxpr_dot_flops(getattr(jaxpr, "jaxpr", jaxpr))


def _xla_flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # backends without a cost model raise rather than return nothing
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = cost.get("flops") if cost else None
    return float(flops) if flops is not None and flops >= 0 else None


def _measure(jitted: Callable[..., Any], args: tuple, kwargs: dict) -> int | None:
    leaves = jax.tree.leaves((args, kwargs))
    device = jax.devices()[0]
    before = device.memory_stats()
    if not before or "peak_bytes_in_use" not in before:
        return None
    arrays = [x for x in leaves if isinstance(x, jax.Array)]
    args_on_device = sum(x.nbytes for x in arrays)
    jax.block_until_ready(jitted(*args, **kwargs))
    after = device.memory_stats()
    if after["peak_bytes_in_use"] <= before["peak_bytes_in_use"]:
        return None  # an earlier, larger allocation hides this run's peak
    return after["peak_bytes_in_use"] - before["bytes_in_use"] + args_on_device


def memory_report(
    fn: Callable[..., Any], *args: Any, measure: bool = False, **kwargs: Any
) -> MemoryReport:
    """Compiles ``fn`` for ``args`` and reports its memory and FLOPs, without running it.

    ``fn`` is a ``jax.jit``-ed function (its static arguments and donations are kept)
    or a plain function, which is jitted. ``args`` and ``kwargs`` may be arrays or
    :class:`jax.ShapeDtypeStruct`: nothing is allocated for them. Report the memory of a
    training step by passing the step itself (e.g. ``jax.jit(jax.grad(loss))``).

    Args:
        fn: the function to compile.
        *args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``).
        measure: also run ``fn`` once and record the device's peak memory
            (``MemoryReport.measured_peak_bytes``); needs arrays, and a backend with
            memory statistics (GPU, TPU; on CPU the field stays ``None``). The peak is
            the device's high-water mark, so measure in a fresh process or the largest
            run first: a run below an earlier peak also gives ``None``. (This keyword is
            memory_report's own: wrap ``fn`` if it takes a ``measure`` argument.)
        **kwargs: its keyword arguments.

    Returns:
        A :class:`MemoryReport`; ``print`` it for a table.

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
        >>> report = jaxga.memory_report(jax.grad(loss), jnp.ones((8, 8)),
        ...                              jax.ShapeDtypeStruct((32, 8), jnp.float32))
        >>> report.argument_bytes, report.output_bytes, report.dot_flops
        (1280, 256, 8192)
    """
    if not callable(fn):
        raise TypeError(f"`fn` must be callable; got {type(fn).__name__}.")
    if measure and any(
        isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((args, kwargs))
    ):
        raise TypeError(
            "`measure=True` runs the function, so it needs arrays; got a "
            "jax.ShapeDtypeStruct among the arguments."
        )
    jitted = fn if hasattr(fn, "trace") and hasattr(fn, "lower") else jax.jit(fn)
    traced = jitted.trace(*args, **kwargs)
    compiled = traced.lower().compile()
    stats = compiled.memory_analysis()
    if stats is None:
        raise ValueError(
            f"The {jax.default_backend()!r} backend reports no memory analysis for compiled "
            f"programs, so memory_report cannot size `fn`."
        )
    flops, exact = dot_flops(traced.jaxpr)
    sizes = {
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
    }
    peak = (
        sizes["argument_bytes"] + sizes["output_bytes"] + sizes["temp_bytes"] - sizes["alias_bytes"]
    )
    return MemoryReport(
        **sizes,
        peak_bytes=peak,
        flops=_xla_flops(compiled),
        dot_flops=int(flops),
        dot_flops_exact=exact,
        measured_peak_bytes=_measure(jitted, args, kwargs) if measure else None,
        backend=jax.default_backend(),
    )
