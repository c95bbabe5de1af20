"""Picks the micro-batch count and remat policy that fit a memory budget, before running."""

import dataclasses
import numbers
import re
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxga._checks import check_arity, check_bool, leading_size, positive_int
from jaxga.arguments import as_positions
from jaxga.memory import MemoryReport, format_bytes, memory_report
from jaxga.microbatch import IndivisibleBatchError
from jaxga.remat import REMAT
from jaxga.sharding import check_strategy

_UNITS = {"": 1, "b": 1} | {
    f"{u}{i}b": base**n for n, u in enumerate("kmgt", 1) for i, base in (("", 1000), ("i", 1024))
}
_SEARCHED = ("strategy", "offload")  # plan's axes given to build as keywords
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
    if isinstance(value, bool) or not isinstance(value, numbers.Integral | str):
        raise TypeError(
            f"`{name}` must be an int number of bytes or a string like '512MiB'; got "
            f"{value!r} of type {type(value).__name__}."
        )
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if isinstance(value, str) and (match is None or match[3].lower() not in _UNITS):
        raise ValueError(f"`{name}`={value!r} is not a size such as '512MiB', '1.5GiB' or '2GB'.")
    size = int(Fraction(match[1] + (match[2] or "")) * _UNITS[match[3].lower()] if match else value)
    if not 0 <= size < 2**63:  # XLA counts bytes in int64
        raise ValueError(f"`{name}` must be a number of bytes in [0, 2**63); got {value!r}.")
    return size


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration :func:`plan` considered: what ``build`` was given, and the verdict."""

    num_microbatches: int  # k, micro-batches per step
    microbatch_size: int  # examples per micro-batch
    remat: Any  # the remat value handed to build
    report: MemoryReport | None  # the compiled step's; None if build raised IndivisibleBatchError
    fits: bool  # report.peak_bytes <= budget
    reason: str = ""  # why it was not chosen; "" if chosen
    strategy: Any = None  # handed to build if plan searched strategies
    offload: bool | None = None  # handed to build if plan searched offload
    seconds: float | None = None  # median seconds per step, if timed by time_top

    def __str__(self) -> str:
        named = [f", {n} {getattr(self, n)!r}" for n in _SEARCHED if getattr(self, n) is not None]
        k, size, remat = self.num_microbatches, self.microbatch_size, self.remat
        return f"{k} micro-batch(es) of {size}, remat {remat!r}{''.join(named)}"


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
    candidates: tuple[Candidate, ...]  # those built, in search order
    num_skipped: int = 0  # not built, as the search stopped at the first that fits
    step: Callable[..., Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        named = [n for n in _SEARCHED if getattr(self, n) is not None]
        host = any(c.report and c.report.host_bytes for c in self.candidates)
        timed = self.seconds is not None
        rows = [["micro-batches", "size", "remat", *named, "peak", *["host"] * host]]
        rows[0] += ["temporaries", "matmul FLOPs", *["ms/step"] * timed, "verdict"]
        for c, r in ((c, c.report) for c in self.candidates):
            cells = [c.num_microbatches, c.microbatch_size, c.remat, *(vars(c)[n] for n in named)]
            sizes = [] if r is None else [r.peak_bytes, *[r.host_bytes] * host, r.temp_bytes]
            cells += [*map(format_bytes, sizes), f"{r.dot_flops:.3e}"] if r else ["-"] * (3 + host)
            cells += ["" if c.seconds is None else f"{1e3 * c.seconds:.1f}"] * timed
            rows.append([*map(str, cells), c.reason or "<- chosen"])
        widths = [max(map(len, column)) for column in zip(*rows)]
        text = {2, *range(3, 3 + len(named)), len(widths) - 1}  # left-aligned columns
        align = ["<" if i in text else ">" for i in range(len(widths))]
        peak, budget = format_bytes(self.report.peak_bytes), format_bytes(self.budget)
        lines = [
            f"jaxga.plan: {Candidate.__str__(self)}: compiled peak {peak} per device within the "
            f"budget of {budget}",
            *("  ".join(f"{x:{a}{w}}" for x, a, w in zip(r, align, widths)).rstrip() for r in rows),
        ]
        skipped = f"({self.num_skipped} more not built; exhaustive=True builds all)"
        return "\n".join(lines + [skipped] * bool(self.num_skipped))


class InfeasibleBudgetError(ValueError):
    """No candidate of :func:`plan` fits the budget; ``candidates`` holds them all."""

    def __init__(self, message: str, candidates: tuple[Candidate, ...]):
        super().__init__(message)
        self.candidates = candidates


def _abstract(path: Any, x: Any) -> jax.ShapeDtypeStruct:
    """The shape, dtype and (multi-device) sharding of an array, without copying it."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, str):  # plan(build, *args, "1GiB"): the budget among the arguments
        where = f"args{jax.tree_util.keystr(path)}"
        raise TypeError(f"plan's {where} is the string {x!r}; pass `budget` and others by keyword.")
    sharding = x.sharding if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1 else None
    weak = getattr(x, "weak_type", type(x) in (int, float, complex))  # Python scalars
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding, weak_type=weak)


def _budget(budget: Any) -> int:
    """``budget`` in bytes; ``None``: 90 % of the first local device's memory limit."""
    if budget is None:
        device = jax.local_devices()[0]
        if "bytes_limit" not in (stats := device.memory_stats() or {}):
            raise ValueError(f"`budget`=None, but {device} has no memory limit; pass e.g. '8GiB'.")
        budget = int(stats["bytes_limit"] * 0.9)
    return parse_bytes(budget)


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
    if not size:  # None: no arrays
        raise ValueError(f"`batch_argnums`={batch_argnums!r} names no arrays, or no rows.")
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
    """Median seconds of a call on fresh zeros laid out as ``step`` takes them (it may donate)."""
    compiled = (step if hasattr(step, "lower") else jax.jit(step)).lower(*args).compile()
    zeros, times = lambda s, where: jnp.zeros(s.shape, s.dtype, device=where), []
    for _ in range(repeats + 1):  # the first call warms up
        inputs = jax.tree.map(zeros, args, compiled.input_shardings[0])
        start = time.perf_counter()
        jax.block_until_ready(compiled(*jax.block_until_ready(inputs)))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _search(build, args, batch_size, order, budget, wanted, strict) -> tuple[list, list, int]:
    """Compiles the candidates in order until ``wanted`` fit (and says how many were left)."""
    found, steps = [], []
    for i, (k, r, choice) in enumerate(order):
        if sum(c.fits for c in found) >= wanted:
            return found, steps, len(order) - i
        if any(c.num_microbatches == k and c.report is None for c in found):
            continue
        step, report, reason = None, None, ""
        try:
            step = build(k, r, **choice)
            if not callable(step):
                got = type(step).__name__
                raise TypeError(f"`build` must return a step; build({k}, {r!r}) returned {got}.")
            report = memory_report(step, *args)
        except IndivisibleBatchError as e:
            if strict:  # a count the user asked for
                raise
            reason = str(e)  # k micro-batches a device do not divide its rows
        except Exception as e:
            e.add_note(f"(while jaxga.plan built num_microbatches={k}, remat={r!r}, {choice})")
            raise
        fits = report is not None and report.peak_bytes <= budget
        reason = reason or ("" if fits else "over the budget")
        found.append(Candidate(k, batch_size // k, r, report, fits, reason, **choice))
        steps.append(step if fits else None)  # its compiled programs freed
    if not (compiled := [c for c in found if c.report is not None]):
        raise ValueError(
            f"`build` raised IndivisibleBatchError for every candidate: no micro-batch count "
            f"divides the batch of {batch_size} over the step's devices; pass a batch they divide."
        )
    if not any(c.fits for c in found):
        smallest = min(compiled, key=lambda c: c.report.peak_bytes)
        peak = smallest.report.peak_bytes
        raise InfeasibleBudgetError(
            f"No configuration fits the memory budget of {format_bytes(budget)} ({budget} bytes); "
            f"the smallest peak, {format_bytes(peak)} ({peak} bytes), has {smallest}. Raise "
            f"`budget`, or allow more micro-batches, rematerialisation, sharding or offload.",
            tuple(found),
        )
    return found, steps, 0


def _choices(remat: Any, strategy: Any, offload: Any) -> list[Any]:
    """The remat values, and ``build``'s keywords for each strategy and offload (or ``[{}]``)."""
    given = {"remat": remat, "strategy": strategy, "offload": offload}
    many = lambda v: isinstance(v, Iterable) and not isinstance(v, str | Mapping | P)
    axes = {n: tuple(v) if many(v) else (v,) for n, v in given.items() if v is not None}
    for name, values in axes.items():
        if not values:
            raise ValueError(f"`{name}` must hold at least one value; got {values!r}.")
        for value in values if name != "remat" else ():
            check_bool(value, "offload") if name == "offload" else check_strategy(value)
    keywords = [[{n: v} for v in axes[n]] if n in axes else [{}] for n in _SEARCHED]
    return [axes.get("remat", (None,)), *keywords]


def plan(
    build: Callable[[int, Any], Callable[..., Any]],
    *args: Any,
    budget: int | str | None = None,
    num_microbatches: int | Sequence[int] | None = None,
    remat: Sequence[Any] = tuple(REMAT),
    strategy: Sequence[Any] | None = None,
    offload: Sequence[bool] | None = None,
    batch_argnums: int | Sequence[int] | None = None,
    exhaustive: bool = False,
    time_top: int = 0,
    repeats: int = 3,
) -> Plan:
    """Returns the first configuration, least sequential work first, that fits a memory budget.

    Candidates, fewest micro-batches first, then in the order of ``strategy``, ``remat`` and
    ``offload``, are built and compiled for the shapes of ``args`` (nothing runs); the
    budget bounds each device's compiled peak (:attr:`MemoryReport.peak_bytes`).

    Args:
        build: ``build(num_microbatches, remat) -> step``, a (``jax.jit``-ed) train step;
            also given ``strategy=`` and ``offload=`` when those are searched.
        *args: the step's arguments, arrays or :class:`jax.ShapeDtypeStruct`.
        budget: bytes, e.g. ``"512MiB"`` (see :func:`parse_bytes`); default: 90 % of the
            first local device's ``memory_stats()["bytes_limit"]``.
        num_microbatches: the candidate counts, divisors of the batch size; default: all.
        remat: the candidate remat values, least recomputation first; ``(None,)`` for none.
        strategy: if given, the candidate layouts on a mesh, e.g. ``jaxga.sharding.STRATEGIES``.
        offload: if given, the candidate ``offload`` values, e.g. ``(False, True)``.
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
    remat, layouts, offloads = _choices(remat, strategy, offload)
    keywords = [*layouts[0], *offloads[0]]
    signature = "".join(f", {n}=..." for n in keywords)
    check_arity(build, "build", 2, f"build(num_microbatches, remat{signature}) -> step", keywords)
    if not args:
        raise ValueError("plan needs the step's arguments (arrays or jax.ShapeDtypeStruct).")
    positive_int(time_top, "time_top", "a non-negative int", low=0)
    positive_int(repeats, "repeats")
    check_bool(exhaustive, "exhaustive")
    args = jax.tree_util.tree_map_with_path(_abstract, args)
    budget = _budget(budget)
    batch_size, counts = _batch(args, batch_argnums, num_microbatches)
    order = [(k, r, s | o) for k in counts for s in layouts for r in remat for o in offloads]
    wanted = len(order) if exhaustive else max(time_top, 1)
    strict = num_microbatches is not None  # a count the user asked for must compile
    found, steps, skipped = _search(build, args, batch_size, order, budget, wanted, strict)
    fitting = [i for i, c in enumerate(found) if c.fits]
    for i in fitting[:time_top]:
        found[i] = dataclasses.replace(found[i], seconds=_seconds(steps[i], args, repeats))
    best = min(fitting[: max(time_top, 1)], key=lambda i: (found[i].seconds or 0, i))
    why = lambda c: "fits; " + ("slower than" if c.seconds else "an earlier one is") + " the choice"
    found = [dataclasses.replace(c, reason=why(c)) if c.fits else c for c in found]
    found[best] = dataclasses.replace(found[best], reason="")
    chosen = vars(found[best]) | {"budget": budget, "batch_size": batch_size}
    return Plan(**chosen, step=steps[best], candidates=tuple(found), num_skipped=skipped)
