"""Picks the micro-batch count and remat policy that fit a memory budget, before running."""

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxga import meshes
from jaxga._checks import check_arity, check_bool, leading_size, positive_int
from jaxga.arguments import as_positions
from jaxga.memory import MemoryReport, format_bytes, memory_report, parse_bytes
from jaxga.meshes import HOST_KINDS
from jaxga.microbatch import IndivisibleBatchError
from jaxga.remat import REMAT
from jaxga.sharding import check_strategy

_SEARCHED = ("strategy", "offload", "stream")  # plan's axes given to build as keywords
_TOLERANCE = 0.05  # of the budget: a count predicted further over it is not built


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration that [`plan`][jaxga.plan] considered, and its verdict.

    Attributes:
        num_microbatches: k, the micro-batches per step.
        microbatch_size: the examples per micro-batch.
        remat: the remat value handed to ``build``.
        report: the compiled step's `MemoryReport`; None if build raised IndivisibleBatchError.
        fits: whether ``report.peak_bytes`` is within the budget.
        reason: why it was not chosen; ``""`` if it was.
        strategy: handed to ``build`` if ``plan`` searched strategies; else None.
        offload: handed to ``build`` if ``plan`` searched offload; else None.
        stream: handed to ``build`` if ``plan`` searched stream; else None.

    Examples:
        >>> from jaxga.planner import Candidate
        >>> str(Candidate(4, 8, "full", None, False, "indivisible", offload=True))
        "4 micro-batch(es) of 8, remat 'full', offload True"
    """

    num_microbatches: int  # k, the micro-batches per step
    microbatch_size: int  # the examples per micro-batch
    remat: Any  # the remat value handed to build
    report: MemoryReport | None  # the compiled step's; None if build raised IndivisibleBatchError
    fits: bool  # whether report.peak_bytes is within the budget
    reason: str = ""  # why it was not chosen; "" if it was
    strategy: Any = None  # handed to build if plan searched strategies
    offload: bool | None = None  # handed to build if plan searched offload
    stream: bool | str | None = None  # handed to build if plan searched stream

    def __str__(self) -> str:
        named = [f", {n} {getattr(self, n)!r}" for n in _SEARCHED if getattr(self, n) is not None]
        size = f"{self.num_microbatches} micro-batch(es) of {self.microbatch_size}"
        return f"{size}, remat {self.remat!r}{''.join(named)}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan(Candidate):
    """The `Candidate` that [`plan`][jaxga.plan] chose (its fields), with the search; ``print`` it.

    Attributes:
        budget: each device's budget, in bytes.
        batch_size: the examples per step.
        candidates: the [`Candidate`][jaxga.planner.Candidate]s built, in the order built.
        num_skipped: those not built: the search stopped at the first fit, or skipped them.
        step: what ``build`` returned for the chosen configuration.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> p = jaxga.plan(lambda k, r: jaxga.grad(lambda w, x: jnp.sum(x @ w), num_microbatches=k),
        ...                jnp.ones(3), jnp.ones((8, 3)), budget="1MiB", remat=(None,))
        >>> p.num_microbatches, p.microbatch_size, len(p.candidates), p.num_skipped
        (1, 8, 1, 3)
    """

    budget: int  # in bytes
    batch_size: int  # the examples per step
    candidates: tuple[Candidate, ...]  # those built, in the order built
    num_skipped: int = 0  # those not built: the search stopped at the first fit, or skipped them
    step: Callable[..., Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        axes = [n for n in _SEARCHED if getattr(self, n) is not None]  # searched
        host = any(c.report is not None and c.report.host_bytes for c in self.candidates)
        rows = []
        for c in self.candidates:  # "-": not compiled
            row = {"micro-batches": c.num_microbatches, "size": c.microbatch_size, "remat": c.remat}
            row |= {name: getattr(c, name) for name in axes}
            row["peak"] = "-" if c.report is None else format_bytes(c.report.peak_bytes)
            if host:  # and the bytes a step moves between host and device
                row["host"] = "-" if c.report is None else format_bytes(c.report.host_bytes)
                row["moved"] = "-" if c.report is None else format_bytes(c.report.moved_bytes)
            row["temporaries"] = "-" if c.report is None else format_bytes(c.report.temp_bytes)
            row["matmul FLOPs"] = "-" if c.report is None else f"{c.report.dot_flops:.3e}"
            row["verdict"] = c.reason or "<- chosen"
            rows.append({heading: str(cell) for heading, cell in row.items()})
        table = [list(rows[0]), *(list(row.values()) for row in rows)]
        widths = [max(len(cell) for cell in column) for column in zip(*table)]
        justify = [str.ljust if h in {"remat", *axes, "verdict"} else str.rjust for h in table[0]]
        aligned = [[j(cell, w) for j, cell, w in zip(justify, cells, widths)] for cells in table]
        peak = format_bytes(self.report.peak_bytes)
        lines = [f"jaxga.plan: {Candidate.__str__(self)}: compiled peak {peak} per device"]
        lines[0] += f" within the budget of {format_bytes(self.budget)}"
        lines += ["  ".join(cells).rstrip() for cells in aligned]
        if self.num_skipped:
            lines.append(f"({self.num_skipped} more not built; exhaustive=True builds all)")
        return "\n".join(lines)


class InfeasibleBudgetError(ValueError):
    """No candidate of [`plan`][jaxga.plan] fits the budget; ``candidates`` holds those built."""

    def __init__(self, message: str, candidates: tuple[Candidate, ...]):
        super().__init__(message)
        self.candidates = candidates


def device_budget(budget: int | str | None, *, name: str) -> int:  # None: 90 % of the device's
    if budget is not None:
        return parse_bytes(budget, name=name)
    device = jax.local_devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit is None:
        raise ValueError(f"`{name}`=None, but {device} has no memory limit; pass e.g. '8GiB'.")
    return int(limit * 0.9)


def _abstract(path: Any, x: Any) -> jax.ShapeDtypeStruct:  # an array's shape, dtype, sharding
    if isinstance(x, jax.ShapeDtypeStruct):
        where = x.sharding  # as an array's below: on one device's own memory, any device
        one = isinstance(where, jax.sharding.SingleDeviceSharding)
        if one and where.memory_kind == "device":
            return x.update(sharding=None)
        return x.update(sharding=meshes.traced_as_placed(where)) if where is not None else x
    if isinstance(x, str):  # plan(build, *args, "1GiB"): the budget among the arguments
        where = f"args{jax.tree_util.keystr(path)}"
        raise TypeError(f"plan's {where} is the string {x!r}; pass `budget` and others by keyword.")
    placed = isinstance(x, jax.Array) and (
        len(x.sharding.device_set) > 1 or x.sharding.memory_kind in HOST_KINDS
    )  # on a mesh, or in host memory: kept; on one device: any
    sharding = meshes.traced_as_placed(x.sharding) if placed else None
    weak = getattr(x, "weak_type", type(x) in (int, float, complex))  # Python scalars
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding, weak_type=weak)


def abstract(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` as `jax.ShapeDtypeStruct`s: shapes, dtypes, and where they lie (a mesh, host
    memory; on one device, any)."""
    return jax.tree_util.tree_map_with_path(_abstract, args)


def _batch(args: tuple[Any, ...], argnums: Any, num_microbatches: Any) -> tuple[int, list]:
    positions = as_positions("batch_argnums", len(args) - 1 if argnums is None else argnums)
    if not positions:
        raise TypeError("`batch_argnums` must name at least one argument; got ().")
    if max(positions) >= len(args):
        raise ValueError(f"`batch_argnums`={argnums!r} goes past the {len(args)} arguments.")
    size = leading_size({i: args[i] for i in positions}, "args", "batch")
    if not size:  # None: no arrays
        raise ValueError(f"`batch_argnums`={argnums!r} names no arrays, or no rows.")
    if num_microbatches is None:
        return size, [d for d in range(1, size + 1) if size % d == 0]
    many = isinstance(num_microbatches, Sequence) and not isinstance(num_microbatches, str)
    given = num_microbatches if many and num_microbatches else [num_microbatches]  # () named
    expected = "a positive int or a non-empty sequence of them"
    counts = sorted({positive_int(k, "num_microbatches", expected) for k in given})
    bad = [k for k in counts if size % k]
    if bad:
        raise ValueError(f"`num_microbatches` must divide the batch size {size}; got {bad}.")
    return size, counts


def _values(name: str, value: Any) -> tuple[Any, ...]:  # its items, or itself
    many = isinstance(value, Iterable) and not isinstance(value, str | Mapping | P)
    values = tuple(value) if many else (value,)
    if not values:
        raise ValueError(f"`{name}` must hold at least one value; got {values!r}.")
    return values


class _Config(NamedTuple):
    """One configuration of the search: what `build` is given, and the micro-batch size."""

    num_microbatches: int
    microbatch_size: int
    remat: Any
    keywords: dict[str, Any]  # the searched axes given to build: strategy, offload, stream


class _Built(NamedTuple):
    """One configuration built and compiled: its verdict, and what `build` returned."""

    candidate: Candidate
    step: Any  # None if build raised IndivisibleBatchError


def _build_one(
    build: Callable[..., Any], args: tuple, config: _Config, *, budget: int, strict: bool
) -> _Built:
    """Builds and compiles one configuration."""
    k, size, remat, keywords = config
    try:
        step = build(k, remat, **keywords)
        if not callable(step):
            raise TypeError(f"`build` returned {step!r:.40}; it must return a step to compile.")
        report = memory_report(step, *args)
    except IndivisibleBatchError as e:  # k micro-batches a device do not divide its rows
        if strict:  # the user asked for this k alone: it must compile
            raise
        return _Built(Candidate(k, size, remat, None, False, str(e), **keywords), None)
    except Exception as e:
        e.add_note(f"(jaxga.plan, building num_microbatches={k}, remat={remat!r}, {keywords})")
        raise
    fits = report.peak_bytes <= budget
    reason = "fits; an earlier one is the choice" if fits else "over the budget"
    return _Built(Candidate(k, size, remat, report, fits, reason, **keywords), step)


def over_budget(candidates: Sequence[Candidate], budget: int) -> InfeasibleBudgetError:
    """The error when no candidate fits ``budget``, naming the one of smallest peak."""
    smallest = min((c for c in candidates if c.report), key=lambda c: c.report.peak_bytes)
    peak = smallest.report.peak_bytes
    return InfeasibleBudgetError(
        f"No configuration fits the memory budget of {format_bytes(budget)} ({budget} bytes);"
        f" the smallest peak, {format_bytes(peak)} ({peak} bytes), has {smallest}.",
        tuple(candidates),
    )


def chosen_index(candidates: list[Candidate], budget: int, streams: Sequence[Any] = (None,)) -> int:
    """The index of the fitting candidate first in the search order (``streams``' order,
    then the fewest micro-batches); raises if none fits."""
    if all(c.report is None for c in candidates):
        raise ValueError(f"No num_microbatches splits the batch: {candidates[0].reason}")
    fitting = [i for i, c in enumerate(candidates) if c.fits]  # as built: in order for each k
    if not fitting:
        raise over_budget(candidates, budget)
    place = {stream: i for i, stream in enumerate(streams)}  # then the fewest micro-batches
    return min(fitting, key=lambda i: (place[candidates[i].stream], candidates[i].num_microbatches))


class _Line(NamedTuple):
    """A compiled peak as a fixed part plus a part per row of a micro-batch."""

    fixed: float  # bytes
    per_row: float  # bytes per row of a micro-batch

    @classmethod
    def through(cls, a: Candidate, b: Candidate) -> "_Line":
        rise = a.report.peak_bytes - b.report.peak_bytes
        per_row = rise / (a.microbatch_size - b.microbatch_size)
        return cls(a.report.peak_bytes - per_row * a.microbatch_size, per_row)

    def peak(self, rows: int) -> float:
        return self.fixed + self.per_row * rows


def _next_count(
    configs: list[_Config], built: Mapping[int, Candidate], line: _Line | None, *, limit: float
) -> int | None:
    """The index of the next count to build: of those not built before the fewest that fits,
    the first whose predicted peak is within ``limit``; None if there is none."""
    fewest = min((i for i, c in built.items() if c.fits), default=len(configs))
    unbuilt = (i for i in range(fewest) if i not in built)
    return next(
        (i for i in unbuilt if line is None or line.peak(configs[i].microbatch_size) <= limit), None
    )


def _in_order(
    configs: list[_Config], built: Mapping[int, Candidate], *, every: bool
) -> Iterator[int]:
    """The ordered search: each configuration in turn until one fits (all of them if
    ``every``), but for those of a count the devices do not divide."""
    for i, config in enumerate(configs):
        if not every and any(c.fits for c in built.values()):
            return
        undivided = {c.num_microbatches for c in built.values() if c.report is None}
        if config.num_microbatches not in undivided:  # the devices divide k micro-batches
            yield i


def _predicted(
    configs: list[_Config], built: Mapping[int, Candidate], *, budget: int
) -> Iterator[int]:
    """The ordered search, but for the counts that a line through the peaks of the first and
    the last count puts further over the budget than a tolerance: those are not built."""
    yield 0
    first, last, line = built[0], len(configs) - 1, None
    while line is None and not first.fits and first.report is not None and last > 0:
        yield last
        if built[last].report is not None:  # the last count the devices divide
            line = _Line.through(first, built[last])
        last -= 1
    limit, error = budget + budget * _TOLERANCE, 0.0  # error: the line's largest, since
    while (i := _next_count(configs, built, line, limit=limit)) is not None:
        yield i
        report = built[i].report
        if line is not None and report is not None:
            error = max(error, abs(report.peak_bytes - line.peak(configs[i].microbatch_size)))
        limit = budget + max(budget * _TOLERANCE, 2 * error)


def _search(
    build: Callable[..., Any],
    args: tuple,
    configs: list[_Config],
    order: Callable[..., Iterator[int]],
    *,
    budget: int,
    batch_size: int,
    strict: bool,
    streams: Sequence[Any] = (None,),
) -> Plan:
    """Builds the configurations ``order(configs, built)`` names, each as the ones built so
    far say, and chooses; keeps the step of the first in ``configs`` that fits (the others'
    steps and programs are freed)."""
    built: dict[int, Candidate] = {}  # by index in configs, in the order built
    step, fewest = None, len(configs)
    for i in order(configs, built):
        result = _build_one(build, args, configs[i], budget=budget, strict=strict)
        built[i] = result.candidate
        if result.candidate.fits and i < fewest:
            step, fewest = result.step, i
    candidates = list(built.values())
    chosen = chosen_index(candidates, budget, streams)
    candidates[chosen] = dataclasses.replace(candidates[chosen], reason="")
    undivided = {c.num_microbatches for c in candidates if c.report is None}
    skipped = [
        i for i, c in enumerate(configs) if i not in built and c.num_microbatches not in undivided
    ]  # not built, but for those of a count the devices do not divide
    sizes = {"budget": budget, "batch_size": batch_size, "num_skipped": len(skipped)}
    return Plan(**vars(candidates[chosen]), **sizes, candidates=tuple(candidates), step=step)


def plan(
    build: Callable[[int, Any], Callable[..., Any]],
    *args: Any,
    budget: int | str | None = None,
    num_microbatches: int | Sequence[int] | None = None,
    remat: Sequence[Any] = tuple(REMAT),
    strategy: Sequence[Any] | None = None,
    offload: Sequence[bool] | None = None,
    stream: Sequence[bool | str] | None = None,
    batch_argnums: int | Sequence[int] | None = None,
    exhaustive: bool = False,
    search: str = "ordered",
) -> Plan:
    """Returns the first configuration, least sequential work first, that fits a memory budget.

    Args:
        build: ``build(num_microbatches, remat, **searched) -> step``, a (jitted) train step.
        *args: the step's arguments, arrays or ``jax.ShapeDtypeStruct``.
        budget: each device's bytes, e.g. ``"512MiB"``; default: 90 % of the device's.
        num_microbatches: the candidate counts, divisors of the batch size; default: all.
            Of several, one raising `IndivisibleBatchError` is skipped; one alone raises.
        remat: the candidate remat values, least recomputation first; ``(None,)`` for none.
        strategy: if given, the candidate layouts on a mesh, e.g. ``jaxga.sharding.STRATEGIES``.
        offload: if given, the candidate ``offload`` values, e.g. ``(False, True)``.
        stream: if given, the candidate ``stream`` values in the order tried, e.g.
            ``(False, "layers")``: every candidate of one value before any of the next (the
            model streamed from host memory only when nothing resident fits).
        batch_argnums: the position(s) of the batch in ``args``; default: the last.
        exhaustive: compile every candidate instead of stopping at the first that fits.
        search: ``"ordered"``, candidates in order until one fits, or ``"predict"``: the
            counts a line through the first and last counts' peaks says fit (one remat,
            strategy and offload value only); see docs/planner.md for what it guarantees.

    Returns:
        The chosen [`Plan`][jaxga.Plan]; raises `InfeasibleBudgetError` if none fits.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> def build(k, remat):
        ...     return jax.jit(jaxga.grad(lambda w, x: jnp.tanh(x @ w).sum(), num_microbatches=k))
        >>> w, x = jnp.ones((8, 512)), jnp.ones((64, 8))
        >>> p = jaxga.plan(build, w, x, budget="96KiB", remat=(None,))
        >>> p.num_microbatches > 1, p.report.peak_bytes <= p.budget
        (True, True)
    """
    if not args:
        raise ValueError("plan needs the step's arguments (arrays or jax.ShapeDtypeStruct).")
    args = abstract(args)
    budget = device_budget(budget, name="budget")
    batch_size, counts = _batch(args, batch_argnums, num_microbatches)
    strategies = () if strategy is None else _values("strategy", strategy)
    by_strategy = [{"strategy": check_strategy(v, specs=False)} for v in strategies] or [{}]
    offloads = () if offload is None else _values("offload", offload)
    by_offload = [{"offload": check_bool(value, "offload")} for value in offloads] or [{}]
    streams = (None,) if stream is None else tuple(map(_check_stream, _values("stream", stream)))
    by_stream = [{} if value is None else {"stream": value} for value in streams]
    order = itertools.product(by_stream, counts, by_strategy, _values("remat", remat), by_offload)
    configs = [_Config(k, batch_size // k, r, s | o | m) for m, k, s, r, o in order]
    keywords = list(configs[0].keywords)  # the names of those searched
    signature = "".join(f", {n}=..." for n in keywords)
    check_arity(build, "build", 2, f"build(num_microbatches, remat{signature}) -> step", keywords)
    strict = num_microbatches is not None and len(counts) == 1  # one k asked for: it builds
    every = check_bool(exhaustive, "exhaustive")
    if search not in ("ordered", "predict"):
        raise ValueError(f"`search` must be 'ordered' or 'predict'; got {search!r}.")
    if search == "predict" and len(configs) > len(counts):
        many = len(configs) // len(counts)
        raise ValueError(f"`search`='predict' needs one configuration per count; got {many}.")
    if search == "predict" and not every:
        order = functools.partial(_predicted, budget=budget)
    else:
        order = functools.partial(_in_order, every=every)
    sizes = {"budget": budget, "batch_size": batch_size}
    return _search(build, args, configs, order, strict=strict, streams=streams, **sizes)


def _check_stream(value: Any) -> bool | str:
    """A candidate ``stream`` value: False, True or "layers"."""
    if not (isinstance(value, bool) or value == "layers"):
        raise TypeError(f"`stream` values must be False, True or 'layers'; got {value!r}.")
    return value
