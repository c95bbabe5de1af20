"""Picks the micro-batch count and remat policy that fit a memory budget, before running."""

import dataclasses
import re
import statistics
import time
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp

from jaxga._checks import check_arity, leading_size, positive_int
from jaxga.arguments import as_positions
from jaxga.memory import MemoryReport, format_bytes, memory_report
from jaxga.microbatch import IndivisibleBatchError
from jaxga.remat import REMAT

_UNITS = {"": 1, "b": 1} | {
    f"{u}{i}b": base**n for n, u in enumerate("kmgt", 1) for i, base in (("", 1000), ("i", 1024))
}
_SIZE = re.compile(r"\s*(\d+\.?\d*|\.\d+)(e[+-]?\d{1,4})?\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(value: int | str, *, name: str = "budget") -> int:
    """Returns a byte count given as an int or a string such as ``"512MiB"`` or ``"2GB"``.

    Units: ``B``, ``KB`` ... ``TB`` (powers of 1000), ``KiB`` ... ``TiB`` (powers of 1024);
    fractions of a byte round down. ``name`` names the argument in errors.

    Example:
        >>> import jaxga
        >>> jaxga.parse_bytes("512MiB"), jaxga.parse_bytes("1.5GiB"), jaxga.parse_bytes("2GB")
        (536870912, 1610612736, 2000000000)
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(
            f"`{name}` must be an int number of bytes or a string like '512MiB'; got "
            f"{value!r} of type {type(value).__name__}."
        )
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if isinstance(value, str) and (match is None or match[3].lower() not in _UNITS):
        raise ValueError(f"`{name}`={value!r} is not a size such as '512MiB', '1.5GiB' or '2GB'.")
    size = int(Fraction(match[1] + (match[2] or "")) * _UNITS[match[3].lower()]) if match else value
    if not 0 <= size < 2**63:  # XLA counts bytes in int64
        raise ValueError(f"`{name}` must be a number of bytes in [0, 2**63); got {value!r}.")
    return size


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One compiled configuration of a plan: what ``build`` was given, and its report."""

    num_microbatches: int  # k, micro-batches per step
    microbatch_size: int  # examples per micro-batch
    remat: Any  # the remat value handed to build
    report: MemoryReport  # the compiled step's
    fits: bool  # report.peak_bytes <= budget
    seconds: float | None = None  # median seconds per step, if timed by time_top


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan(Candidate):
    """The :class:`Candidate` that :func:`plan` chose, with the search; ``print`` it.

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> loss = lambda w, x: jnp.mean(x @ w)
        >>> build = lambda k, remat: jax.jit(jaxga.grad(loss, num_microbatches=k))
        >>> p = jaxga.plan(build, jnp.ones(3), jnp.ones((8, 3)), budget="1MiB", remat=(None,))
        >>> p.num_microbatches, p.microbatch_size, len(p.candidates), p.num_skipped
        (1, 8, 1, 3)
    """

    budget: int  # bytes
    batch_size: int
    candidates: tuple[Candidate, ...]  # the compiled ones, in search order
    num_skipped: int = 0  # not compiled, as the search stopped at the first that fits
    step: Callable[..., Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        timed = any(c.seconds is not None for c in self.candidates)
        rows = [["micro-batches", "size", "remat", "peak", "temporaries", "matmul FLOPs", "fits"]]
        rows[0] += ["ms/step"] * timed + [""]
        for c in self.candidates:
            r = c.report
            cells = [c.num_microbatches, c.microbatch_size, c.remat, format_bytes(r.peak_bytes)]
            cells += [format_bytes(r.temp_bytes), f"{r.dot_flops:.3e}", "yes" if c.fits else "no"]
            cells += ["" if c.seconds is None else f"{1e3 * c.seconds:.1f}"] * timed
            chosen = (c.num_microbatches, c.remat) == (self.num_microbatches, self.remat)
            rows.append([*map(str, cells), "<- chosen" * chosen])
        widths = [max(map(len, column)) for column in zip(*rows)]
        align = ["<" if i in (2, 6, len(widths) - 1) else ">" for i in range(len(widths))]  # text
        peak, budget = format_bytes(self.report.peak_bytes), format_bytes(self.budget)
        lines = [
            f"jaxga.plan: {self.num_microbatches} micro-batch(es) of {self.microbatch_size}, remat "
            f"{self.remat!r}: compiled peak {peak} within the budget of {budget}",
            *("  ".join(f"{x:{a}{w}}" for x, a, w in zip(r, align, widths)).rstrip() for r in rows),
        ]
        if self.num_skipped:
            lines.append(f"({self.num_skipped} more not compiled; exhaustive=True compiles all)")
        return "\n".join(lines)


class InfeasibleBudgetError(ValueError):
    """No candidate of :func:`plan` fits the budget; ``candidates`` holds them all."""

    def __init__(self, message: str, candidates: tuple[Candidate, ...]):
        super().__init__(message)
        self.candidates = candidates


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    """The shape, dtype and (multi-device) sharding of an array, without copying it."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    sharding = x.sharding if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1 else None
    weak = getattr(x, "weak_type", type(x) in (int, float, complex))  # Python scalars
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding, weak_type=weak)


def _batch(args, batch_argnums, num_microbatches) -> tuple[int, list[int]]:
    """The leading size all arrays of ``args[batch_argnums]`` share, and the counts dividing it."""
    if batch_argnums is None:
        argnums = (len(args) - 1,)
    elif not (argnums := as_positions("batch_argnums", batch_argnums)):
        raise TypeError("`batch_argnums` must name at least one argument; got ().")
    if max(argnums) >= len(args):
        raise ValueError(f"`batch_argnums`={batch_argnums!r} goes past the {len(args)} arguments.")
    try:
        size = leading_size({i: args[i] for i in argnums}, "args", "batch")
    except ValueError as e:
        raise ValueError(f"{e} (`batch_argnums`={batch_argnums!r} names the batch.)") from None
    if size is None:
        raise ValueError(f"`batch_argnums`={batch_argnums!r} names arguments with no arrays.")
    if num_microbatches is None:
        return size, [d for d in range(1, size + 1) if size % d == 0]
    expected = "a positive int or a non-empty sequence of them"
    many = isinstance(num_microbatches, Sequence) and not isinstance(num_microbatches, str)
    counts = num_microbatches if many and num_microbatches else [num_microbatches]  # () named
    counts = sorted({positive_int(k, "num_microbatches", expected) for k in counts})
    if bad := [k for k in counts if size % k]:
        raise ValueError(f"`num_microbatches` must divide the batch size {size}; got {bad}.")
    return size, counts


def _seconds(step: Callable[..., Any], args: tuple[Any, ...], repeats: int) -> float:
    """Median seconds of a call on fresh zeros (fresh, as ``step`` may donate them)."""
    compiled = (step if hasattr(step, "lower") else jax.jit(step)).lower(*args).compile()
    zeros, times = lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), []
    for _ in range(repeats + 1):  # the first call warms up
        inputs = jax.block_until_ready(jax.tree.map(zeros, args))
        start = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _search(build, args, batch_size, order, budget, wanted, strict) -> tuple[list, list, int]:
    """Compiles the candidates in order until ``wanted`` fit, or raises if none does."""
    found, steps, passed_over = [], [], 0  # passed_over: what a mesh could not split
    for k, r in order:
        if sum(c.fits for c in found) >= wanted:
            break
        try:
            step = build(k, r)
            if not callable(step):
                got = type(step).__name__
                raise TypeError(f"`build` must return a step; build({k}, {r!r}) returned {got}.")
            report = memory_report(step, *args)
        except Exception as e:
            if isinstance(e, IndivisibleBatchError) and not strict:
                passed_over += 1  # k micro-batches a device do not divide its rows
                continue
            if hasattr(e, "add_note"):  # Python 3.11 on
                e.add_note(f"(while jaxga.plan compiled num_microbatches={k}, remat={r!r})")
            raise
        found.append(Candidate(k, batch_size // k, r, report, report.peak_bytes <= budget))
        steps.append(step)
    if not found:
        raise ValueError(
            f"`build` raised IndivisibleBatchError for every candidate: no micro-batch count "
            f"divides the batch of {batch_size} over the step's devices; pass a batch they divide."
        )
    if not any(c.fits for c in found):
        s = min(found, key=lambda c: c.report.peak_bytes)
        peak = s.report.peak_bytes
        raise InfeasibleBudgetError(
            f"No configuration fits the memory budget of {format_bytes(budget)} ({budget} bytes); "
            f"the smallest peak, {format_bytes(peak)} ({peak} bytes), has {s.num_microbatches} "
            f"micro-batch(es) of {s.microbatch_size} and remat {s.remat!r}. Raise `budget`, or "
            f"allow more micro-batches or more rematerialisation.",
            tuple(found),
        )
    return found, steps, passed_over


def plan(
    build: Callable[[int, Any], Callable[..., Any]],
    *args: Any,
    budget: int | str | None = None,
    num_microbatches: int | Sequence[int] | None = None,
    remat: Sequence[Any] = tuple(REMAT),
    batch_argnums: int | Sequence[int] | None = None,
    margin: float = 0.1,
    exhaustive: bool = False,
    time_top: int = 0,
    repeats: int = 3,
    device: Any = None,
) -> Plan:
    """Returns the first configuration, least sequential work first, that fits a memory budget.

    Each candidate ``(num_microbatches, remat)``, fewest micro-batches first, then in the
    order of ``remat``, is built and compiled for the shapes of ``args`` (nothing runs).

    Args:
        build: ``build(num_microbatches, remat) -> step``, a (``jax.jit``-ed) train step.
        *args: the step's arguments, arrays or :class:`jax.ShapeDtypeStruct`.
        budget: bytes, e.g. ``"512MiB"`` (see :func:`parse_bytes`); default: ``device``'s
            (the first local one's) ``memory_stats()["bytes_limit"]`` less the fraction ``margin``.
        num_microbatches: the candidate counts, divisors of the batch size; default: all.
        remat: the candidate remat values, least recomputation first; ``(None,)`` for none.
        batch_argnums: the position(s) of the batch in ``args``; default: the last.
        exhaustive: compile every candidate instead of stopping at the first that fits.
        time_top: if positive, choose the fastest of the first ``time_top`` that fit, each
            timed by the median of ``repeats`` runs.

    Raises :class:`InfeasibleBudgetError` if no candidate fits.

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> loss = lambda w, x: jnp.mean(jnp.tanh(x @ w["a"]) @ w["b"])
        >>> build = lambda k, remat: jax.jit(jaxga.grad(loss, num_microbatches=k))
        >>> w = {"a": jnp.ones((16, 1024)), "b": jnp.ones(1024)}
        >>> p = jaxga.plan(build, w, jnp.ones((256, 16)), budget="512KiB", remat=(None,))
        >>> p.num_microbatches > 1, p.report.peak_bytes <= p.budget
        (True, True)
    """
    check_arity(build, "build", 2, "build(num_microbatches, remat) -> step")
    if not args:
        raise ValueError("plan needs the step's arguments (arrays or jax.ShapeDtypeStruct).")
    if isinstance(time_top, bool) or not isinstance(time_top, int) or time_top < 0:
        raise ValueError(f"`time_top` must be a non-negative int; got {time_top!r}.")
    positive_int(repeats, "repeats")
    remat = (remat,) if isinstance(remat, str) else tuple(remat)
    if not remat:
        raise ValueError("`remat` must hold at least one value; use (None,) for no choice.")
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 <= margin < 1:
        raise ValueError(f"`margin` must be a fraction of device memory in [0, 1); got {margin!r}.")
    if budget is None:
        device = device if device is not None else jax.local_devices()[0]
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            raise ValueError(f"`budget`=None, but {device} has no memory limit; pass e.g. '8GiB'.")
        budget = int(stats["bytes_limit"] * (1.0 - margin))
    budget = parse_bytes(budget)
    args = jax.tree.map(_abstract, args)
    batch_size, counts = _batch(args, batch_argnums, num_microbatches)
    order = [(k, r) for k in counts for r in remat]
    wanted = len(order) if exhaustive else max(time_top, 1)
    strict = num_microbatches is not None  # a count the user asked for must compile
    found, steps, passed_over = _search(build, args, batch_size, order, budget, wanted, strict)
    fitting = [i for i, c in enumerate(found) if c.fits]
    for i in fitting[:time_top]:
        found[i] = dataclasses.replace(found[i], seconds=_seconds(steps[i], args, repeats))
    best = min(fitting[: max(time_top, 1)], key=lambda i: (found[i].seconds or 0, i))
    chosen = vars(found[best]) | {"budget": budget, "batch_size": batch_size, "step": steps[best]}
    skipped = len(order) - len(found) - passed_over
    return Plan(**chosen, candidates=tuple(found), num_skipped=skipped)
