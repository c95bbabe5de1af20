"""Picks the micro-batch count and remat policy that fit a memory budget, before running."""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp

from jaxga._checks import check_arity, leading_size
from jaxga.memory import MemoryReport, format_bytes, memory_report
from jaxga.microbatch import IndivisibleBatchError
from jaxga.remat import REMAT

__all__ = ["Candidate", "InfeasibleBudgetError", "Plan", "parse_bytes", "plan"]

_UNITS = {"": 1, "b": 1} | {
    f"{u}{i}b": base**n for n, u in enumerate("kmgt", 1) for i, base in (("", 1000), ("i", 1024))
}
_SIZE = re.compile(r"\s*(\d+\.?\d*|\.\d+)(e[+-]?\d{1,4})?\s*([a-z]*)\s*", re.IGNORECASE)
_MAX_BYTES = 2**63 - 1  # XLA counts bytes in int64


def parse_bytes(value: int | str, *, name: str = "budget") -> int:
    """Returns a byte count given as an int or a string such as ``"512MiB"`` or ``"2GB"``.

    Args:
        value: bytes, or a number (fractions round down) with a unit: ``B``, ``KB`` ...
            ``TB`` (powers of 1000) or ``KiB`` ... ``TiB`` (powers of 1024).
        name: the argument's name, for error messages.

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
    size = value
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        if match is None or match[3].lower() not in _UNITS:
            raise ValueError(
                f"`{name}`={value!r} is not a size; expected a number with an optional unit, "
                f"one of B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of "
                f"1024), e.g. '512MiB' or '1.5GiB'."
            )
        size = int(Fraction(match[1] + (match[2] or "")) * _UNITS[match[3].lower()])  # exact
    if not 0 <= size <= _MAX_BYTES:
        raise ValueError(
            f"`{name}` must be a non-negative number of bytes; got {value!r}, which is not "
            f"between 0 and 2**63 - 1 (XLA's int64)."
        )
    return size


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One compiled configuration of a plan.

    Attributes:
        num_microbatches: micro-batches per step (k).
        microbatch_size: examples per micro-batch.
        remat: the remat value handed to ``build``.
        report: the compiled step's :class:`jaxga.MemoryReport`.
        fits: whether ``report.peak_bytes`` is within the budget.
        seconds: median seconds per step, if timed by ``time_top``.
    """

    num_microbatches: int
    microbatch_size: int
    remat: Any
    report: MemoryReport
    fits: bool
    seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """The configuration :func:`plan` chose, and the candidates it compiled; ``print`` it.

    Attributes:
        num_microbatches: the chosen number of micro-batches.
        remat: the chosen remat value.
        report: the chosen step's :class:`jaxga.MemoryReport`.
        budget: the memory budget in bytes.
        batch_size: the global batch size.
        candidates: the compiled candidates, in search order.
        num_skipped: candidates not compiled because the search stopped early.
        step: what ``build`` returned for the chosen configuration.

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> loss = lambda w, x: jnp.mean(x @ w)
        >>> build = lambda k, remat: jax.jit(jaxga.grad(loss, num_microbatches=k))
        >>> p = jaxga.plan(build, jnp.ones(3), jnp.ones((8, 3)), budget="1MiB", remat=(None,))
        >>> p.num_microbatches, p.microbatch_size, len(p.candidates), p.num_skipped
        (1, 8, 1, 3)
    """

    num_microbatches: int
    remat: Any
    report: MemoryReport
    budget: int
    batch_size: int
    candidates: tuple[Candidate, ...]
    num_skipped: int = 0
    step: Callable[..., Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def microbatch_size(self) -> int:
        """Examples per micro-batch."""
        return self.batch_size // self.num_microbatches

    def __str__(self) -> str:
        lines = [
            f"jaxga.plan: {self.num_microbatches} micro-batch(es) of {self.microbatch_size}, "
            f"remat {self.remat!r}: compiled peak {format_bytes(self.report.peak_bytes)} within "
            f"the budget of {format_bytes(self.budget)}",
            format_table(self.candidates, chosen=(self.num_microbatches, self.remat)),
        ]
        if self.num_skipped:
            lines.append(
                f"({self.num_skipped} more candidate(s) not compiled: the search stops at the "
                f"first that fits; exhaustive=True compiles all)"
            )
        return "\n".join(lines)


class InfeasibleBudgetError(ValueError):
    """No candidate of :func:`plan` fits the budget; ``candidates`` holds them all."""

    def __init__(self, message: str, candidates: tuple[Candidate, ...]):
        super().__init__(message)
        self.candidates = candidates


def format_table(candidates: Sequence[Candidate], chosen: tuple[int, Any] | None = None) -> str:
    """Formats candidates as a text table: memory, matmul FLOPs, fit and time."""
    header = ("micro-batches", "size", "remat", "peak", "temporaries", "matmul FLOPs", "fits")
    timed = any(c.seconds is not None for c in candidates)
    rows = [(*header, *("ms/step",) * timed, "")]
    for c in candidates:
        report = c.report
        row = (c.num_microbatches, c.microbatch_size, c.remat, format_bytes(report.peak_bytes))
        row += (
            format_bytes(report.temp_bytes),
            f"{report.dot_flops:.3e}",
            "yes" if c.fits else "no",
        )
        row += ("" if c.seconds is None else f"{1e3 * c.seconds:.1f}",) * timed
        rows.append((*map(str, row), "<- chosen" * ((c.num_microbatches, c.remat) == chosen)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    left = {2, 6, len(widths) - 1}  # remat, fits and the marker; numbers to the right
    return "\n".join(
        "  ".join(
            x.ljust(w) if i in left else x.rjust(w) for i, (x, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in rows
    )


def _abstract(tree: Any) -> Any:
    """Shapes, dtypes and (multi-device) shardings of a tree of arrays, without copying."""

    def leaf(x: Any) -> jax.ShapeDtypeStruct:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        sharded = isinstance(x, jax.Array) and len(x.sharding.device_set) > 1
        weak = getattr(x, "weak_type", type(x) in (int, float, complex))  # Python scalars
        sharding = x.sharding if sharded else None
        return jax.ShapeDtypeStruct(
            jnp.shape(x), jnp.result_type(x), sharding=sharding, weak_type=bool(weak)
        )

    return jax.tree.map(leaf, tree)


def _batch_size(args: tuple[Any, ...], batch_argnums: int | Sequence[int] | None) -> int:
    """The leading size every array of the batch arguments ``args[batch_argnums]`` shares."""
    argnums = (len(args) - 1,) if batch_argnums is None else batch_argnums
    argnums = (argnums,) if isinstance(argnums, int) else argnums
    expected = "`batch_argnums` must be a non-negative int or a non-empty tuple of them"
    expected = f"{expected}; got {batch_argnums!r}."
    try:
        argnums = tuple(argnums)
    except TypeError:
        raise TypeError(expected) from None
    if not argnums or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in argnums
    ):
        raise TypeError(expected)
    if bad := [i for i in argnums if i >= len(args)]:
        raise ValueError(
            f"`batch_argnums`={batch_argnums!r} holds {bad}, which name none of the "
            f"{len(args)} positional argument(s) given to plan."
        )
    sizes = {}
    for i in argnums:
        try:
            size = leading_size(args[i], f"args[{i}]", "batch")
        except ValueError as e:
            raise ValueError(f"{e} (`batch_argnums`={batch_argnums!r} names the batch.)") from None
        if size is not None:
            sizes[f"args[{i}]"] = size
    if len(set(sizes.values())) != 1:
        listed = ", ".join(f"{k}: {v}" for k, v in sizes.items()) or "no arrays"
        raise ValueError(
            f"The batch arguments (`batch_argnums`={batch_argnums!r}) must be arrays with one "
            f"leading batch size; got {listed}."
        )
    return next(iter(sizes.values()))


def _microbatch_counts(num_microbatches: int | Sequence[int] | None, batch_size: int) -> list[int]:
    if num_microbatches is None:
        return [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    many = isinstance(num_microbatches, Sequence) and not isinstance(num_microbatches, str)
    counts = list(num_microbatches) if many else [num_microbatches]
    if not counts or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in counts):
        raise ValueError(
            f"`num_microbatches` must be a positive int or a non-empty sequence of them; got "
            f"{num_microbatches!r}."
        )
    if indivisible := [k for k in counts if batch_size % k]:
        raise ValueError(
            f"`num_microbatches`={num_microbatches!r} holds {indivisible}, which do not divide "
            f"the batch size {batch_size}."
        )
    return sorted(set(counts))


def _budget(budget: int | str | None, margin: Any, device: Any) -> int:
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 <= margin < 1:
        raise ValueError(f"`margin` must be a fraction of device memory in [0, 1); got {margin!r}.")
    if budget is not None:
        return parse_bytes(budget)
    device = device if device is not None else jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        raise ValueError(
            f"`budget` is None, and the {device.platform} device {device} reports no memory "
            f"limit (its memory_stats() has no 'bytes_limit'), so there is no default; pass "
            f"budget=..., e.g. budget='8GiB'."
        )
    return int(stats["bytes_limit"] * (1.0 - margin))


def _seconds(step: Callable[..., Any], args: tuple[Any, ...], repeats: int) -> float:
    """Median seconds of a call on fresh zeros (fresh, as ``step`` may donate them)."""
    compiled = (step if hasattr(step, "lower") else jax.jit(step)).lower(*args).compile()
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        inputs = jax.block_until_ready(
            jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), args)
        )
        start = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _compile(build: Callable[..., Any], k: int, r: Any, args: tuple[Any, ...]) -> tuple:
    try:
        step = build(k, r)
        if not callable(step):
            raise TypeError(
                f"`build` must return the step function; build({k}, {r!r}) returned "
                f"{type(step).__name__}."
            )
        return step, memory_report(step, *args)
    except Exception as e:
        if hasattr(e, "add_note"):  # Python 3.11 on
            e.add_note(f"(while jaxga.plan compiled num_microbatches={k}, remat={r!r})")
        raise


def _search(
    build: Callable[..., Any],
    args: tuple,
    batch_size: int,
    order: list,
    budget: int,
    wanted: int,
    exhaustive: bool,
    strict: bool,
) -> tuple[list[Candidate], dict, int]:
    # Compiles the candidates in order until `wanted` fit (all if exhaustive): the candidates,
    # the steps that fit by index, and how many a mesh could not split (raised if strict).
    found: list[Candidate] = []
    steps: dict[int, Callable[..., Any]] = {}
    passed_over = 0
    for k, r in order:
        if not exhaustive and sum(c.fits for c in found) >= wanted:
            break
        try:
            step, report = _compile(build, k, r, args)
        except IndivisibleBatchError:
            if strict:
                raise
            passed_over += 1  # a step on a mesh: k micro-batches a device do not divide its rows
            continue
        fits = report.peak_bytes <= budget
        if fits:
            steps[len(found)] = step
        found.append(Candidate(k, batch_size // k, r, report, fits))
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

    Candidates ``(num_microbatches, remat)`` are tried fewest micro-batches first, then in
    the order of ``remat``; each is built and compiled for the shapes of ``args`` (nothing
    runs), and the first whose compiled peak fits ``budget`` wins.

    Args:
        build: ``build(num_microbatches, remat) -> step``, a (``jax.jit``-ed) train step.
        *args: the step's arguments, arrays or :class:`jax.ShapeDtypeStruct`.
        budget: bytes, an int or a string such as ``"512MiB"`` (see :func:`parse_bytes`);
            default: the device's ``memory_stats()["bytes_limit"]`` less ``margin``.
        num_microbatches: the candidate counts, an int or a sequence of divisors of the
            batch size; default: every divisor.
        remat: the candidate remat values, least recomputation first; ``(None,)`` for none.
        batch_argnums: the position(s) in ``args`` of the batch, non-negative ints as in
            :func:`jaxga.value_and_grad`; default: the last argument.
        margin: with the default budget, the fraction of device memory left free.
        exhaustive: compile every candidate instead of stopping at the first that fits.
        time_top: if positive, time the first ``time_top`` that fit and choose the fastest.
        repeats: timed runs per candidate with ``time_top`` (the median is kept).
        device: the device whose memory limit is the default budget.

    Returns:
        A :class:`Plan`. Raises :class:`InfeasibleBudgetError` if no candidate fits.

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
    for name, value in (("time_top", time_top), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"`{name}` must be a non-negative int; got {value!r}.")
    if time_top and not repeats:
        raise ValueError(f"`repeats` must be positive with time_top={time_top}; got 0.")
    remat = (remat,) if isinstance(remat, str) else tuple(remat)
    if not remat:
        raise ValueError("`remat` must hold at least one value; use (None,) for no choice.")
    budget = _budget(budget, margin, device)
    args = _abstract(args)
    batch_size = _batch_size(args, batch_argnums)
    counts = _microbatch_counts(num_microbatches, batch_size)
    order = [(k, r) for k in counts for r in remat]
    found, steps, passed_over = _search(
        build,
        args,
        batch_size,
        order,
        budget,
        max(time_top, 1),
        exhaustive,
        num_microbatches is not None,
    )
    return _choose(
        found,
        steps,
        args,
        budget,
        batch_size,
        time_top,
        repeats,
        skipped=len(order) - len(found) - passed_over,
    )


def _choose(found, steps, args, budget, batch_size, time_top, repeats, skipped) -> Plan:
    fitting = [i for i, c in enumerate(found) if c.fits]
    if not fitting:
        smallest = min(found, key=lambda c: c.report.peak_bytes)
        raise InfeasibleBudgetError(
            f"No configuration fits the memory budget of {format_bytes(budget)} ({budget} "
            f"bytes): the smallest compiled peak found is "
            f"{format_bytes(smallest.report.peak_bytes)} ({smallest.report.peak_bytes} bytes), "
            f"with {smallest.num_microbatches} micro-batch(es) of {smallest.microbatch_size} "
            f"and remat {smallest.remat!r}, among {len(found)} candidate(s). Raise `budget`, "
            f"or allow more micro-batches or more rematerialisation.",
            tuple(found),
        )
    for i in fitting[:time_top]:
        found[i] = dataclasses.replace(found[i], seconds=_seconds(steps[i], args, repeats))
    best = min(fitting[: max(time_top, 1)], key=lambda i: (found[i].seconds or 0, i))
    chosen = found[best]
    return Plan(
        chosen.num_microbatches,
        chosen.remat,
        chosen.report,
        budget,
        batch_size,
        tuple(found),
        skipped,
        steps[best],
    )
