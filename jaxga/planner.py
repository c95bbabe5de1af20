"""Picks the micro-batch count and remat policy that fit a memory budget, before running."""

from __future__ import annotations

import dataclasses
import decimal
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxga._checks import check_arity, leading_size
from jaxga.memory import MemoryReport, format_bytes, memory_report
from jaxga.remat import REMAT
from jaxga.sharding import IndivisibleBatchError

__all__ = ["Candidate", "InfeasibleBudgetError", "Plan", "parse_bytes", "plan"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_MAX_BYTES = 2**63 - 1
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, *, name: str = "budget") -> int:
    """Returns a byte count given as an int or a string such as ``"512MiB"`` or ``"2GB"``.

    Units: ``B``, decimal ``KB MB GB TB`` (powers of 1000) and binary ``KiB MiB GiB TiB``
    (powers of 1024), case-insensitive; no unit means bytes. Fractions are rounded down;
    more than 2**63 - 1 bytes (XLA counts bytes in int64) is a ``ValueError``.

    Args:
        value: the size.
        name: the argument's name, for error messages.

    Example:
        >>> import jaxga
        >>> jaxga.parse_bytes("512MiB"), jaxga.parse_bytes("1.5GiB"), jaxga.parse_bytes("2GB")
        (536870912, 1610612736, 2000000000)
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"`{name}` must be a non-negative number of bytes; got {value}.")
        if value > _MAX_BYTES:
            raise ValueError(
                f"`{name}`={value} is more bytes than a byte count holds (2**63 - 1, XLA's int64)."
            )
        return value
    if not isinstance(value, str):  # bool too: True is not a size
        raise TypeError(
            f"`{name}` must be an int number of bytes or a string like '512MiB'; got "
            f"{value!r} of type {type(value).__name__}."
        )
    match = _BYTES_RE.match(value)
    unit = match.group(3).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"`{name}`={value!r} is not a size; expected a number with an optional unit, one "
            f"of B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), "
            f"e.g. '512MiB' or '1.5GiB'."
        )
    try:
        number = decimal.Decimal(f"{match.group(1)}e{match.group(2) or 0}")  # exact
    except decimal.InvalidOperation:  # an exponent beyond what decimal represents
        number = decimal.Decimal(0 if match.group(2).startswith("-") else "Infinity")
    if number > _MAX_BYTES:  # before multiplying: a huge exponent would overflow the context
        raise ValueError(
            f"`{name}`={value!r} is more bytes than a byte count holds (2**63 - 1, XLA's int64); "
            f"expected a size such as '512MiB' or '80GB'."
        )
    with decimal.localcontext() as context:
        context.prec = 64
        size = int(number * _UNITS[unit])  # rounds down
    if size > _MAX_BYTES:
        raise ValueError(
            f"`{name}`={value!r} is {size} bytes, more than a byte count holds (2**63 - 1, "
            f"XLA's int64); expected a size such as '512MiB' or '80GB'."
        )
    return size


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One compiled configuration of a plan.

    Attributes:
        num_microbatches: micro-batches per step (k).
        microbatch_size: examples per micro-batch (the batch size over k).
        remat: the remat value handed to ``build``.
        report: the compiled step's :class:`jaxga.MemoryReport`.
        fits: whether ``report.peak_bytes`` is within the budget.
        seconds: median seconds per step, for candidates timed by ``time_top``; else
            ``None``.
    """

    num_microbatches: int
    microbatch_size: int
    remat: Any
    report: MemoryReport
    fits: bool
    seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """The configuration :func:`plan` chose, and every candidate it compiled on the way.

    Attributes:
        num_microbatches: the chosen number of micro-batches.
        remat: the chosen remat value.
        report: the chosen step's :class:`jaxga.MemoryReport`.
        budget: the memory budget in bytes.
        batch_size: the global batch size.
        candidates: the compiled candidates in search order (all of them with
            ``exhaustive=True``; else up to the first that fits, or the first
            ``time_top`` that fit).
        num_skipped: candidates never compiled because the search stopped early.
        step: what ``build`` returned for the chosen configuration.

    ``print(plan)`` shows the choice and the table of candidates.

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> loss = lambda w, x: jnp.mean(x @ w)
        >>> build = lambda k, remat: jax.jit(jaxga.grad(loss, num_microbatches=k))
        >>> p = jaxga.plan(build, jnp.ones(3), jnp.ones((8, 3)), budget="1MiB", remat=(None,))
        >>> p.num_microbatches, p.microbatch_size, len(p.candidates), p.num_skipped
        (1, 8, 1, 3)
        >>> str(p).splitlines()[1].split()
        ['micro-batches', 'size', 'remat', 'peak', 'temporaries', 'matmul', 'FLOPs', 'fits']
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
        head = (
            f"jaxga.plan: {self.num_microbatches} micro-batch(es) of {self.microbatch_size}, "
            f"remat {self.remat!r}: compiled peak {format_bytes(self.report.peak_bytes)} within "
            f"the budget of {format_bytes(self.budget)}"
        )
        table = format_table(self.candidates, chosen=(self.num_microbatches, self.remat))
        lines = [head, table]
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
    """Formats candidates as a text table: memory, matmul FLOPs, fit and time.

    Example:
        >>> from jaxga.planner import format_table
        >>> format_table([]).split()[:3]
        ['micro-batches', 'size', 'remat']
    """
    header = ("micro-batches", "size", "remat", "peak", "temporaries", "matmul FLOPs", "fits")
    timed = any(c.seconds is not None for c in candidates)
    header += ("ms/step",) * timed + ("",)
    rows = [header]
    for c in candidates:
        row = (
            str(c.num_microbatches),
            str(c.microbatch_size),
            str(c.remat),
            format_bytes(c.report.peak_bytes),
            format_bytes(c.report.temp_bytes),
            f"{c.report.dot_flops:.3e}",
            "yes" if c.fits else "no",
        )
        if timed:
            row += ("" if c.seconds is None else f"{1e3 * c.seconds:.1f}",)
        is_chosen = chosen is not None and (c.num_microbatches, c.remat) == chosen
        rows.append((*row, "<- chosen" if is_chosen else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    right = {0, 1, 3, 4, 5, 7} if timed else {0, 1, 3, 4, 5}
    return "\n".join(
        "  ".join(
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(r, widths))
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
        return jax.ShapeDtypeStruct(
            jnp.shape(x),
            jnp.result_type(x),
            sharding=x.sharding if sharded else None,
            weak_type=bool(weak),
        )

    return jax.tree.map(leaf, tree)


def _batch_size(args: tuple[Any, ...], batch_argnums: int | Sequence[int]) -> int:
    """The leading size every array of the batch arguments ``args[batch_argnums]`` shares."""
    argnums = (batch_argnums,) if isinstance(batch_argnums, int) else batch_argnums
    if (
        isinstance(batch_argnums, bool)
        or not isinstance(argnums, Sequence)
        or not argnums
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in argnums)
    ):
        raise TypeError(
            f"`batch_argnums` must be an int or a non-empty sequence of ints (positions in "
            f"args); got {batch_argnums!r}."
        )
    if bad := [i for i in argnums if not -len(args) <= i < len(args)]:
        raise ValueError(
            f"`batch_argnums`={batch_argnums!r} holds {bad}, which name none of the "
            f"{len(args)} positional argument(s) given to plan."
        )
    sizes = {}
    for i in argnums:
        name = f"args[{i % len(args)}]"
        try:
            size = leading_size(args[i], name, "batch")
        except ValueError as e:
            raise ValueError(f"{e} (`batch_argnums`={batch_argnums!r} names the batch.)") from None
        if size is not None:
            sizes[name] = size
    if not sizes:
        raise ValueError(
            f"`batch_argnums`={batch_argnums!r} names arguments that hold no arrays; they must "
            f"be the batch, pytrees of arrays with a leading batch axis."
        )
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"The batch arguments (`batch_argnums`={batch_argnums!r}) have different leading "
            f"sizes ({', '.join(f'{k}: {v}' for k, v in sizes.items())}); they must share one "
            f"batch size."
        )
    return next(iter(sizes.values()))


def _microbatch_counts(num_microbatches: int | Sequence[int] | None, batch_size: int) -> list[int]:
    if num_microbatches is None:
        return [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    if isinstance(num_microbatches, Sequence) and not isinstance(num_microbatches, str):
        counts = list(num_microbatches)
    else:
        counts = [num_microbatches]
    bad = [k for k in counts if isinstance(k, bool) or not isinstance(k, int) or k < 1]
    if not counts or bad:
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


def _default_budget(margin: float, device: Any) -> int:
    device = device if device is not None else jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        raise ValueError(
            f"`budget` is None, and the {device.platform} device {device} reports no memory "
            f"limit (its memory_stats() has no 'bytes_limit'), so there is no default; pass "
            f"budget=..., e.g. budget='8GiB'."
        )
    return int(stats["bytes_limit"] * (1.0 - margin))


def _check_margin(margin: Any) -> float:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"`margin` must be a fraction of device memory in [0, 1); got {margin!r}.")
    return float(margin)


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative int; got {value!r}.")
    return value


def _zeros(tree: Any) -> Any:
    def leaf(s: jax.ShapeDtypeStruct) -> jax.Array:
        x = jnp.zeros(s.shape, s.dtype)
        return jax.device_put(x, s.sharding) if s.sharding is not None else x

    return jax.tree.map(leaf, tree)


def _seconds(step: Callable[..., Any], args: tuple[Any, ...], repeats: int) -> float:
    """Median seconds of a call on fresh zeros (fresh, as ``step`` may donate them)."""
    jitted = step if hasattr(step, "lower") else jax.jit(step)
    compiled = jitted.lower(*args).compile()
    times = []
    for i in range(repeats + 1):
        inputs = jax.block_until_ready(_zeros(args))
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(*inputs))
        if i:  # the first call warms up
            times.append(time.perf_counter() - start)
        del inputs, out
    return statistics.median(times)


def _candidates(counts: list[int], remat: Sequence[Any]) -> Iterator[tuple[int, Any]]:
    for k in counts:
        for r in remat:
            yield k, r


def _compile(build: Callable[..., Any], k: int, r: Any, args: tuple[Any, ...]):
    try:
        step = build(k, r)
        if not callable(step):
            raise TypeError(
                f"`build` must return the step function; build({k}, {r!r}) returned "
                f"{type(step).__name__}."
            )
        return step, memory_report(step, *args)
    except Exception as e:
        if hasattr(e, "add_note"):
            e.add_note(f"(while jaxga.plan compiled num_microbatches={k}, remat={r!r})")
        raise


def plan(
    build: Callable[[int, Any], Callable[..., Any]],
    *args: Any,
    budget: int | str | None = None,
    num_microbatches: int | Sequence[int] | None = None,
    remat: Sequence[Any] = tuple(REMAT),
    batch_argnums: int | Sequence[int] = -1,
    margin: float = 0.1,
    exhaustive: bool = False,
    time_top: int = 0,
    repeats: int = 3,
    device: Any = None,
) -> Plan:
    """Returns the first configuration, least sequential work first, that fits a memory budget.

    Candidates are pairs ``(num_microbatches, remat)``, tried in order: fewest
    micro-batches first (each extra micro-batch is a sequential scan iteration), then
    least recomputation, in the order of ``remat`` (by default every name of
    :data:`jaxga.remat.REMAT`: ``none < dots < dots_no_batch < offload_dots < full <
    sqrt``). Each is built
    with ``build`` and compiled ahead of time for the shapes of ``args``, with
    :func:`jaxga.memory_report`: nothing is allocated and nothing runs, so a candidate
    that does not fit cannot run out of memory. The first that fits wins, so a
    tighter budget never picks a candidate earlier in this order: never fewer
    micro-batches, nor, for as many, less recomputation (``time_top`` trades this
    guarantee for measured speed among the first few that fit).

    The budget bounds XLA's compiled peak (``MemoryReport.peak_bytes``): the step's
    arguments (parameters, optimiser state, the batch), outputs and temporaries,
    less donated buffers.

    Args:
        build: ``build(num_microbatches, remat) -> step``, a (preferably ``jax.jit``-ed)
            train step for that configuration, e.g. ``lambda k, r:
            jaxga.make_train_step(loss_for(r), k)``. ``remat`` values are handed over
            as they are (:func:`jaxga.remat.remat_options` turns a name of
            :data:`jaxga.remat.REMAT` into :func:`jaxga.remat_scan` arguments).
        *args: the step's arguments, arrays or :class:`jax.ShapeDtypeStruct` (e.g. from
            :func:`jax.eval_shape`); only their shapes, dtypes and shardings are used.
        budget: bytes (an int or a string such as ``"512MiB"``, see :func:`parse_bytes`).
            Default: the device's memory limit (``memory_stats()["bytes_limit"]``) less
            ``margin``. CPUs report no limit: pass a budget there.
        num_microbatches: the candidate micro-batch counts, an int or a sequence of
            ints, each a divisor of the batch size. Default: every divisor of the batch
            size (for a step on a mesh, those whose micro-batches the devices divide; a
            step on a mesh is sized per device, as its compiled program is).
        remat: the candidate remat values for each count, from least to most
            recomputation. Use ``(None,)`` if ``build`` has no remat choice.
        batch_argnums: the position(s) in ``args`` of the batch, an int or a sequence of
            ints as in :func:`jaxga.value_and_grad` (default: the last argument); the
            batch size is the leading size every array there shares.
        margin: with the default budget, the fraction of device memory left free (for
            the runtime, fragmentation and arrays outside the step).
        exhaustive: compile every candidate for the table instead of stopping early.
        time_top: if positive, time the first ``time_top`` candidates that fit (on zeros,
            ``repeats`` runs each, median) and choose the fastest of them.
        repeats: timed runs per candidate with ``time_top``.
        device: the device whose memory limit is the default budget (default: the first).

    Returns:
        A :class:`Plan`; ``print`` it for the table of candidates.

    Raises:
        InfeasibleBudgetError: (a ``ValueError``) if no candidate fits; the message states
            the budget and the smallest peak found, and which candidate had it.

    Example:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> def build(k, remat):   # a 16 -> 1024 -> 1 MLP: activations dominate
        ...     loss = lambda w, x: jnp.mean(jnp.tanh(x @ w["a"]) @ w["b"])
        ...     return jax.jit(jaxga.grad(loss, num_microbatches=k))
        >>> w = {"a": jax.ShapeDtypeStruct((16, 1024), jnp.float32),
        ...      "b": jax.ShapeDtypeStruct((1024,), jnp.float32)}
        >>> x = jax.ShapeDtypeStruct((256, 16), jnp.float32)
        >>> p = jaxga.plan(build, w, x, budget="512KiB", remat=(None,))
        >>> p.num_microbatches > 1, p.report.peak_bytes <= p.budget
        (True, True)
    """
    check_arity(build, "build", 2, "build(num_microbatches, remat) -> step")
    if not args:
        raise ValueError("plan needs the step's arguments (arrays or jax.ShapeDtypeStruct).")
    margin = _check_margin(margin)
    time_top = _check_count("time_top", time_top)
    repeats = _check_count("repeats", repeats)
    if time_top and not repeats:
        raise ValueError(f"`repeats` must be positive with time_top={time_top}; got 0.")
    remat = tuple(remat) if not isinstance(remat, str) else (remat,)
    if not remat:
        raise ValueError("`remat` must hold at least one value; use (None,) for no choice.")
    budget = _default_budget(margin, device) if budget is None else parse_bytes(budget)
    args = _abstract(args)
    batch_size = _batch_size(args, batch_argnums)
    order = list(_candidates(_microbatch_counts(num_microbatches, batch_size), remat))

    found: list[Candidate] = []
    steps: dict[int, Callable[..., Any]] = {}
    passed_over = 0
    wanted = max(time_top, 1)
    for i, (k, r) in enumerate(order):
        if not exhaustive and sum(c.fits for c in found) >= wanted:
            break
        try:
            step, report = _compile(build, k, r, args)
        except IndivisibleBatchError:
            if num_microbatches is not None:
                raise
            passed_over += 1  # a step on a mesh: k micro-batches a device do not divide its rows
            continue
        fits = report.peak_bytes <= budget
        if fits:
            steps[i] = step
        found.append(Candidate(k, batch_size // k, r, report, fits))

    fitting = [(i, c) for i, c in enumerate(found) if c.fits]
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
    best = fitting[0][0]
    if time_top:
        for i, c in fitting[:time_top]:
            found[i] = dataclasses.replace(c, seconds=_seconds(steps[i], args, repeats))
        best = min((i for i, _ in fitting[:time_top]), key=lambda i: (found[i].seconds, i))
    chosen = found[best]
    return Plan(
        num_microbatches=chosen.num_microbatches,
        remat=chosen.remat,
        report=chosen.report,
        budget=budget,
        batch_size=batch_size,
        candidates=tuple(found),
        num_skipped=len(order) - len(found) - passed_over,
        step=steps[best],
    )
