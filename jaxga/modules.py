"""Flax NNX and Equinox modules among a function's arguments, taken apart once and rebuilt."""

import dataclasses
import sys
from typing import Any

import jax
from flax import nnx


def is_graph_node(x: Any) -> bool:
    """Whether ``x`` is a Flax NNX graph node (a module, optimizer...), not a Variable."""
    return nnx.graphlib.is_graph_node(x) and not isinstance(x, nnx.Variable)


def is_equinox(x: Any) -> bool:
    """Whether ``x`` is an ``equinox.Module`` (equinox is optional: never imported here)."""
    return isinstance(x, getattr(sys.modules.get("equinox"), "Module", ()))


@dataclasses.dataclass(frozen=True)
class Part:
    """A module taken apart: a pytree leaf (not a node), so trees of parts map part by part."""

    module: Any
    graphdef: Any  # NNX GraphDef, or an Equinox module's non-array part
    diff: Any  # the differentiated state; None when not differentiated
    rest: Any  # NNX state threaded through the micro-batches; None for Equinox


is_part = lambda x: isinstance(x, Part)
_is_module = lambda x: is_graph_node(x) or is_equinox(x)
_holds_nnx = lambda x: is_part(x) and x.rest is not None  # Equinox parts thread no state
_filters = lambda wrt: () if wrt is None else (wrt, ...)  # nnx.split: (graphdef, [diff,] rest)
holds_graph_node = lambda x: any(map(is_graph_node, jax.tree.leaves(x, is_leaf=is_graph_node)))
holds_module = lambda x: any(map(_is_module, jax.tree.leaves(x, is_leaf=_is_module)))
diff_of = lambda parts: jax.tree.map(lambda x: x.diff if is_part(x) else x, parts)
rest_of = lambda parts: jax.tree.map(lambda x: x.rest if is_part(x) else None, parts)


def take_apart(arg: Any, where: str, wrt: Any) -> Any:
    """``arg`` with each module in it replaced by a :class:`Part` (``wrt`` None: no gradient)."""

    def part(x):
        if is_equinox(x) and wrt is not None:
            eqx = sys.modules["equinox"]
            return Part(x, *eqx.partition(x, eqx.is_inexact_array)[::-1], None)  # static, diff
        if not is_graph_node(x):
            return x
        graphdef, *diff, rest = nnx.split(x, *_filters(wrt))
        if wrt is not None and not jax.tree.leaves(diff):
            raise ValueError(
                f"{where} holds a Flax NNX {type(x).__name__}, but the filter {wrt!r} selects "
                f"none of its state: pass nnx.DiffState(position, filter) selecting parameters."
            )
        return Part(x, graphdef, diff[0] if diff else None, rest)

    return jax.tree.map(part, arg, is_leaf=_is_module)


def put_together(parts: Any, diff: Any, rest: Any) -> Any:
    """Fresh modules of the current trace from ``parts``, with ``diff`` and ``rest`` state."""

    def merge(x, r, d):  # d is x itself when diff is None
        if _holds_nnx(x):
            return nnx.merge(x.graphdef, *((r,) if d is x else (d, r)), copy=True)
        return sys.modules["equinox"].combine(d, x.graphdef) if is_part(x) else d

    return jax.tree.map(merge, parts, rest, parts if diff is None else diff)


def new_rest(merged: Any, parts: Any, wrt: Any) -> Any:
    """The threaded state of the rebuilt modules ``merged`` after the loss ran."""
    new = lambda x, m: nnx.split(m, *_filters(wrt))[-1] if _holds_nnx(x) else None
    return jax.tree.map(new, parts, merged)


def write_back(parts: Any, rest: Any) -> None:
    """Updates the caller's NNX modules in place with their threaded state ``rest``."""
    jax.tree.map(lambda x, r: nnx.update(x.module, r) if _holds_nnx(x) else None, parts, rest)


def check_unshared(parts: dict[int, Any]) -> None:
    """Raises if two modules among the arguments share a Variable (or are one module)."""
    owner: dict[int, str] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(parts)[0]:  # parts[i]: args[i]
        where = f"args{jax.tree_util.keystr(path)}"
        for _, v in nnx.iter_graph(x.module) if _holds_nnx(x) else ():
            if isinstance(v, nnx.Variable) and owner.setdefault(id(v), where) != where:
                raise ValueError(
                    f"{owner[id(v)]} and {where} share state (one Flax NNX module or "
                    f"Variable): pass it once, or one nnx.Module, List or Dict holding both."
                )
