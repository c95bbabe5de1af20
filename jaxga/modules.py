"""Flax NNX and Equinox modules among a function's arguments, taken apart once and rebuilt."""

from __future__ import annotations

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
    eqx = sys.modules.get("equinox")
    return eqx is not None and isinstance(x, eqx.Module)


def holds_graph_node(tree: Any) -> bool:
    """Whether any leaf of ``tree`` is a Flax NNX graph node."""
    return any(map(is_graph_node, jax.tree.leaves(tree, is_leaf=is_graph_node)))


def holds_module(tree: Any) -> bool:
    """Whether any leaf of ``tree`` is a Flax NNX graph node or an Equinox module."""
    is_module = lambda x: is_graph_node(x) or is_equinox(x)
    return any(map(is_module, jax.tree.leaves(tree, is_leaf=is_module)))


@dataclasses.dataclass(frozen=True)
class Part:
    """A module taken apart: a leaf, not a pytree node, on purpose."""

    module: Any
    graphdef: Any  # NNX GraphDef, or an Equinox module's non-array part
    diff: Any  # the differentiated state; None when not differentiated
    rest: Any  # NNX state threaded through the micro-batches; None for Equinox


def is_part(x: Any) -> bool:
    return isinstance(x, Part)


def take_apart(arg: Any, where: str, wrt: Any) -> Any:
    """``arg`` with each module in it replaced by a :class:`Part` (``wrt`` None: no gradient)."""

    def part(x):
        if is_equinox(x):
            if wrt is None:
                return x
            eqx = sys.modules["equinox"]
            diff, static = eqx.partition(x, eqx.is_inexact_array)
            return Part(x, static, diff, None)
        if not is_graph_node(x):
            return x
        if wrt is None:
            graphdef, rest = nnx.split(x)
            return Part(x, graphdef, None, rest)
        graphdef, diff, rest = nnx.split(x, wrt, ...)
        if not jax.tree.leaves(diff):
            raise ValueError(
                f"{where} holds a Flax NNX {type(x).__name__}, but the filter {wrt!r} of "
                f"`argnums` selects none of its state: there is nothing to differentiate. Pass "
                f"nnx.DiffState(position, filter) with a filter that selects parameters."
            )
        return Part(x, graphdef, diff, rest)

    return jax.tree.map(part, arg, is_leaf=lambda x: is_graph_node(x) or is_equinox(x))


def diff_of(parts: Any) -> Any:
    """The differentiated state of ``parts``: modules' ``diff``, other leaves as they are."""
    return jax.tree.map(lambda x: x.diff if is_part(x) else x, parts, is_leaf=is_part)


def rest_of(parts: Any) -> Any:
    """The threaded (non-differentiated) NNX state of ``parts``."""
    return jax.tree.map(lambda x: x.rest if is_part(x) else None, parts, is_leaf=is_part)


def put_together(parts: Any, diff: Any, rest: Any) -> Any:
    """Fresh modules of the current trace from ``parts``, with ``diff`` and ``rest`` state."""

    def merge(x, d, r):
        if not is_part(x):
            return x if diff is None else d
        if is_equinox(x.module):
            return sys.modules["equinox"].combine(d, x.graphdef)
        # copy=True: fresh Variables, which the loss may update (BatchNorm, Rngs counters)
        return nnx.merge(x.graphdef, *((r,) if d is None else (d, r)), copy=True)

    none = jax.tree.map(lambda x: None, parts, is_leaf=is_part)
    return jax.tree.map(
        merge,
        parts,
        none if diff is None else diff,
        rest,
        is_leaf=lambda x: is_part(x) or x is None,
    )


def new_rest(merged: Any, parts: Any, wrt: Any) -> Any:
    """The threaded state of the rebuilt modules ``merged`` after the loss ran."""

    def rest(x, module):
        if not is_part(x) or x.rest is None:
            return None
        return nnx.split(module)[1] if wrt is None else nnx.split(module, wrt, ...)[2]

    is_leaf = lambda x: is_part(x) or is_graph_node(x) or is_equinox(x)
    return jax.tree.map(rest, parts, merged, is_leaf=is_leaf)


def write_back(parts: Any, rest: Any) -> None:
    """Updates the caller's NNX modules in place with their threaded state ``rest``."""

    def update(x, r):
        if is_part(x) and r is not None:
            nnx.update(x.module, r)

    jax.tree.map(update, parts, rest, is_leaf=lambda x: is_part(x) or x is None)


def check_unshared(parts: dict[int, Any]) -> None:
    """Raises if two modules among the arguments share a Variable (or are one module)."""
    owner: dict[int, str] = {}
    for i, tree in parts.items():
        for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_part)[0]:
            if not is_part(x) or x.rest is None:
                continue
            where = f"args[{i}]{jax.tree_util.keystr(path)}"
            for _, v in nnx.iter_graph(x.module):
                if isinstance(v, nnx.Variable) and owner.setdefault(id(v), where) != where:
                    raise ValueError(
                        f"{owner[id(v)]} and {where} share state (they are, or hold, the same "
                        f"Flax NNX module or Variable): its gradient and updates would be split "
                        f"between them. Pass it once, or pass one module that holds both (an "
                        f"nnx.Module, nnx.List or nnx.Dict), which is taken apart as a whole."
                    )
