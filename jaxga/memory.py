"""Compiled memory and FLOPs of a function, without running it."""

import dataclasses
import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend import core as jex_core

from jaxga.meshes import HOST_KINDS

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}  # lower case
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+\.?\d*|\.\d+)(e[+-]?\d{1,4})?\s*([a-z]*)\s*", re.IGNORECASE)

# the parameter of a shard_map equation naming the axes it makes manual, newest jax first
_MANUAL_AXES = ("newly_manual_axes", "manual_axes", "axis_names")


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """The bytes XLA's compiled program for one call needs on each device, and its matmul FLOPs.

    Attributes:
        argument_bytes: the arguments' bytes on each device.
        output_bytes: the outputs' bytes on each device.
        temp_bytes: scratch memory, mostly the activations kept for the backward pass.
        alias_bytes: the outputs' bytes that reuse a donated argument's buffer.
        peak_bytes: ``argument_bytes + output_bytes + temp_bytes - alias_bytes``.
        host_bytes: the same sum for the arrays in host memory, which the others leave out.
        dot_flops: of matmuls and convolutions, every loop iteration counted, of the whole
            program (all devices together: a ``shard_map``'s body once per device).
        dot_flops_exact: False if a ``while_loop``'s body was counted once.
        backend: the platform compiled for, e.g. ``"cpu"``: that of the devices the compiled
            program's arguments and outputs lie on (``jax.default_backend()`` if it has none).
        moved_bytes: copied between host and device memory a call, every loop counted, of
            the whole program, as ``dot_flops``.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> jaxga.memory_report(lambda a: a @ a, jnp.ones((256, 256))).dot_flops
        33554432
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int  # scratch memory, mostly the activations kept for the backward pass
    alias_bytes: int  # outputs that reuse a donated argument's buffer
    peak_bytes: int  # argument_bytes + output_bytes + temp_bytes - alias_bytes
    host_bytes: int  # the same sum for the arrays in host memory, which the others leave out
    dot_flops: int  # of matmuls and convolutions, every loop iteration counted, all devices
    dot_flops_exact: bool  # False if a while_loop's body was counted once
    backend: str  # the platform compiled for, e.g. "cpu"
    moved_bytes: int = 0  # copied between host and device memory a call, every loop counted


def parse_bytes(value: int | str, *, name: str = "budget") -> int:
    """Returns a byte count given as an int or a string such as ``"512MiB"`` or ``"2GB"``.

    Args:
        value: bytes, or a number and a unit: ``B``, ``KB``...``TB`` or ``KiB``...``TiB``.
        name: the argument's name, for errors.

    Returns:
        The number of bytes, rounded down, an int in ``[0, 2**63)``.

    Examples:
        >>> import jaxga
        >>> jaxga.parse_bytes("512MiB"), jaxga.parse_bytes("1.5GiB"), jaxga.parse_bytes("2GB")
        (536870912, 1610612736, 2000000000)
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer | str):
        raise TypeError(f"`{name}` must be an int number of bytes or a string; got {value!r}.")
    size = value
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        if match is None or match[3].lower() not in _UNITS:
            raise ValueError(f"`{name}`={value!r} is not a size such as '512MiB' or '1.5GB'.")
        size = Fraction(match[1] + (match[2] or "")) * _UNITS[match[3].lower()]
    if not 0 <= size < 2**63:  # XLA counts bytes in int64
        raise ValueError(f"`{name}` must be a number of bytes in [0, 2**63); got {value!r}.")
    return int(size)


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


class DotFlops(NamedTuple):
    """A jaxpr's matmul FLOPs, as `dot_flops` counts them: `Counts` without ``moved_bytes``.

    Attributes:
        flops: of matmuls and convolutions.
        exact: False if a ``while_loop``'s body was counted once.
    """

    flops: int  # of matmuls and convolutions
    exact: bool  # False if a while_loop's body was counted once


class Counts(NamedTuple):
    """What a program does, loops unrolled: its matmul FLOPs and its host-device bytes.

    Of the whole program, all devices together: a ``shard_map``'s body, traced at one
    device's shapes, is counted once per device along the axes it makes manual.

    Attributes:
        flops: of matmuls and convolutions.
        moved_bytes: copied between host and device memory (either way).
        exact: False if a ``while_loop``'s body was counted once.
    """

    flops: int  # of matmuls and convolutions
    moved_bytes: int  # copied between host and device memory (either way), all devices
    exact: bool  # False if a while_loop's body was counted once


def _own_flops(eqn: Any) -> int:  # of a matmul or convolution, 2 a multiply-add, as XLA counts
    p = eqn.params
    lhs, rhs, out = (v.aval.shape for v in (*eqn.invars, *eqn.outvars))
    if eqn.primitive.name == "dot_general":
        (contracting, _), _ = p["dimension_numbers"]
        return 2 * math.prod(out) * math.prod(lhs[d] for d in contracting)
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    taps = 1  # kernel taps on real input elements: neither padding nor inserted by dilation
    for i, (pad, _) in enumerate(p["padding"]):
        o, j = np.ogrid[: out[out_spec[i + 2]], : rhs[rhs_spec[i + 2]]]
        x = o * p["window_strides"][i] + j * p["rhs_dilation"][i] - pad
        last = (lhs[lhs_spec[i + 2]] - 1) * p["lhs_dilation"][i]
        taps *= int(np.sum((x >= 0) & (x <= last) & (x % p["lhs_dilation"][i] == 0)))
    return 2 * out[out_spec[0]] * out[out_spec[1]] * rhs[rhs_spec[1]] * taps


def dot_flops(jaxpr: Any) -> DotFlops:
    """Returns the FLOPs of a (closed) jaxpr's matmuls and convolutions, loops unrolled:
    those of `program_counts`, which counts the moved bytes too."""
    counts = program_counts(jaxpr)
    return DotFlops(counts.flops, counts.exact)


def _moved_bytes(eqn: Any) -> int:
    """The bytes a ``device_put`` copies between host and device memory (0 for any other)."""
    if eqn.primitive.name != "device_put":
        return 0
    pairs = zip(eqn.invars, eqn.outvars)
    moved = [y.aval for x, y in pairs if _space(x.aval) != _space(y.aval)]
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in moved)


def _space(aval: Any) -> Any:
    return getattr(aval, "memory_space", None)


def _times(eqn: Any) -> int:
    """How many times ``eqn``'s inner jaxprs run: a scan's length; a ``shard_map``'s body
    once per device along the axes it makes manual (the product of their sizes); else 1."""
    if eqn.primitive.name == "scan":
        return eqn.params["length"]
    if eqn.primitive.name != "shard_map":
        return 1
    manual = next((eqn.params[name] for name in _MANUAL_AXES if name in eqn.params), ())
    return math.prod(eqn.params["mesh"].shape[axis] for axis in manual)


def program_counts(jaxpr: Any) -> Counts:
    """Returns a (closed) jaxpr's `Counts`: the FLOPs of its matmuls and convolutions and the
    bytes its ``device_put``s copy between host and device memory (not the copies XLA adds
    itself), loops unrolled (a ``cond`` counted by its costliest branch), the dead code XLA
    drops left out; of all devices together: a ``shard_map``'s body, at one device's shapes,
    counted once per device along its manual axes (a batch split over devices counts as the
    whole batch in the program without it).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jaxga.memory import program_counts
        >>> jaxpr = jax.make_jaxpr(lambda a: a @ a)(jnp.ones((2, 2)))
        >>> program_counts(jaxpr)
        Counts(flops=16, moved_bytes=0, exact=True)
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    used = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
    flops = moved = 0
    exact = True
    for eqn in reversed(jaxpr.eqns):  # from the outputs back, skipping the dead code XLA drops
        if not (eqn.effects or any(v in used for v in eqn.outvars)):
            continue
        used.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
        inner = [program_counts(j) for j in jex_core.jaxprs_in_params(eqn.params)]
        exact = exact and eqn.primitive.name != "while" and all(count.exact for count in inner)
        times = _times(eqn)
        if eqn.primitive.name == "cond":  # one of its branches runs: the costliest of each
            most = max(c.flops for c in inner), max(c.moved_bytes for c in inner)
            inner = [Counts(*most, all(c.exact for c in inner))]
        if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
            flops += _own_flops(eqn)
        flops += sum(count.flops for count in inner) * times
        moved += (sum(count.moved_bytes for count in inner)) * times + _moved_bytes(eqn)
    return Counts(flops, moved, exact)


def _host_bytes(pairs: Any) -> int:
    on_host = [(x, s) for x, s in pairs if getattr(s, "memory_kind", None) in HOST_KINDS]
    return sum(math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x, s in on_host)


class _Bytes(NamedTuple):
    """A compiled program's bytes in one memory, the device's or the host's, by XLA's kind."""

    argument: int
    output: int
    temp: int
    alias: int  # of the outputs, reusing a donated argument's buffer

    @property
    def peak(self) -> int:
        return self.argument + self.output + self.temp - self.alias


class _Sizes(NamedTuple):
    """A compiled program's bytes in device memory and in host memory."""

    device: _Bytes
    host: _Bytes


def _sizes(compiled: Any, stats: Any) -> _Sizes:
    device = _Bytes(*(int(getattr(stats, f"{kind}_size_in_bytes")) for kind in _Bytes._fields))
    host = _Bytes(
        *(int(getattr(stats, f"host_{kind}_size_in_bytes", 0)) for kind in _Bytes._fields)
    )
    if any(host):
        return _Sizes(device, host)
    compiled = getattr(compiled, "compiled", compiled)  # nnx.jit's holds jax's
    args = zip(jax.tree.leaves(compiled.args_info), jax.tree.leaves(compiled.input_shardings))
    inputs = list(args)
    output = _host_bytes((x, x.sharding) for x in jax.tree.leaves(compiled.out_info))
    donated = _host_bytes((x, s) for x, s in inputs if x.donated)  # XLA aliases them to outputs
    host = _Bytes(_host_bytes(inputs), output, 0, min(donated, output))  # counted as the device's
    return _Sizes(_Bytes(*(d - h for d, h in zip(device, host))), host)


def _platform(compiled: Any) -> str:
    """The platform ``compiled`` runs on: its arguments' or outputs' devices', e.g. ``"cpu"``;
    ``jax.default_backend()`` if it has neither."""
    compiled = getattr(compiled, "compiled", compiled)  # nnx.jit's holds jax's
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    devices = [device for sharding in shardings for device in sharding.device_set]
    return devices[0].platform if devices else jax.default_backend()


def memory_report(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> MemoryReport:
    """Compiles ``fn`` for its arguments and reports its memory and FLOPs, without running it.

    Args:
        fn: a ``jax.jit`` or ``nnx.jit`` function, or a plain function (then jitted).
        *args: its positional arguments, arrays or ``jax.ShapeDtypeStruct``.
        **kwargs: its keyword arguments, arrays or ``jax.ShapeDtypeStruct``.

    Returns:
        A [`MemoryReport`][jaxga.MemoryReport].

    Examples:
        >>> import jax, jax.numpy as jnp, jaxga
        >>> report = jaxga.memory_report(jnp.tanh, jax.ShapeDtypeStruct((32, 8), jnp.float32))
        >>> report.argument_bytes, report.output_bytes
        (1024, 1024)
    """
    if not callable(fn):  # not _checks.check_callable: a model's forward pass is a function here
        raise TypeError(f"`fn` must be a function; got {fn!r} of type {type(fn).__name__}.")
    jitted = hasattr(fn, "trace") and hasattr(fn, "lower")
    named = {f"args[{i}]": value for i, value in enumerate(args)}
    named |= {f"kwargs[{key!r}]": value for key, value in kwargs.items()}
    mistake = None  # the first argument that is a string or a shape in place of an array
    for arg, value in named.items():
        shape = isinstance(value, tuple | list) and value and all(type(n) is int for n in value)
        if isinstance(value, str) or shape:
            mistake = f"memory_report's {arg} is {value!r}; pass an array or jax.ShapeDtypeStruct."
            break
    if mistake and not jitted:  # jitted here, so no argument is static
        raise TypeError(mistake)
    try:
        traced = (fn if jitted else jax.jit(fn)).trace(*args, **kwargs)
    except Exception:
        if mistake is None:
            raise
        raise TypeError(mistake) from None  # a static argument may be either, if it traces
    compiled = traced.lower().compile()
    stats, backend = compiled.memory_analysis(), _platform(compiled)
    if stats is None:
        raise ValueError(f"The {backend} backend gives no memory analysis of `fn`.")
    counts = program_counts(getattr(traced, "traced", traced).jaxpr)  # nnx.jit: flax's Traced
    device, host = _sizes(compiled, stats)
    named = {f"{kind}_bytes": n for kind, n in device._asdict().items()}  # argument_bytes, ...
    named |= {"dot_flops": counts.flops, "dot_flops_exact": counts.exact}
    named |= {"moved_bytes": counts.moved_bytes, "backend": backend}
    return MemoryReport(**named, peak_bytes=device.peak, host_bytes=host.peak)
