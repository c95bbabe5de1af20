"""Flax NNX and Equinox modules among a function's arguments, taken apart once and rebuilt."""

import dataclasses
import sys
from typing import Any

import jax
from flax import nnx

from jaxga import meshes


def is_graph_node(x: Any) -> bool:
    """Whether ``x`` is a Flax NNX graph node (a module, optimizer...), not a Variable."""
    return nnx.graphlib.is_graph_node(x) and not isinstance(x, nnx.Variable)


def is_variable(x: Any) -> bool:
    """Whether ``x`` is an NNX Variable (a leaf to stop at: ``is_leaf=is_variable``)."""
    return isinstance(x, nnx.Variable)


def is_module(x: Any) -> bool:
    """Whether ``x`` is an NNX graph node or an ``equinox.Module`` (equinox is not imported)."""
    return is_graph_node(x) or isinstance(x, getattr(sys.modules.get("equinox"), "Module", ()))


def holds_graph_node(tree: Any) -> bool:
    """Whether ``tree`` is or holds a Flax NNX graph node."""
    return any(map(is_graph_node, jax.tree.leaves(tree, is_leaf=is_graph_node)))


def holds_module(tree: Any) -> bool:
    """Whether ``tree`` is or holds a module (`is_module`)."""
    return any(map(is_module, jax.tree.leaves(tree, is_leaf=is_module)))


@dataclasses.dataclass(frozen=True)
class Part:
    """A module taken apart: a pytree leaf (not a node), so trees of parts map part by part."""

    module: Any  # the caller's module, updated in place at the end (NNX)
    graphdef: Any  # an NNX GraphDef, or an Equinox module's non-array part
    diff: Any  # the differentiated state; None when the module is not differentiated
    rest: Any  # the NNX state threaded through the micro-batches; None for Equinox


def _is_nnx(x: Any) -> bool:  # a part with NNX state to thread
    return isinstance(x, Part) and x.rest is not None


def _split_filters(wrt: Any) -> tuple[Any, ...]:  # nnx.split's: (graphdef, [diff,] rest)
    return () if wrt is None else (wrt, ...)


def _take_apart_one(x: Any, where: str, wrt: Any) -> Any:
    if not is_graph_node(x):  # an Equinox module is taken apart only to differentiate it
        if wrt is None or not is_module(x):
            return x
        eqx = sys.modules["equinox"]
        diff, static = eqx.partition(x, eqx.is_inexact_array)
        return Part(module=x, graphdef=static, diff=diff, rest=None)
    graphdef, *diff, rest = nnx.split(x, *_split_filters(wrt))
    if wrt is not None and not jax.tree.leaves(diff):
        raise ValueError(
            f"{where} holds a Flax NNX {type(x).__name__}, but the filter {wrt!r} selects "
            f"none of its state: pass nnx.DiffState(position, filter) selecting parameters."
        )
    return Part(module=x, graphdef=graphdef, diff=diff[0] if diff else None, rest=rest)


def take_apart(arg: Any, where: str, wrt: Any) -> Any:
    """``arg`` with each module in it replaced by a `Part` (``wrt`` None: no gradient)."""
    return jax.tree.map(lambda x: _take_apart_one(x, where, wrt), arg, is_leaf=is_module)


def diff_of(parts: Any) -> Any:
    """``parts`` with each `Part` replaced by its differentiated state."""
    return jax.tree.map(lambda x: x.diff if isinstance(x, Part) else x, parts)


def rest_of(parts: Any) -> Any:
    """``parts`` with each `Part` replaced by its threaded NNX state; other leaves: None."""
    return jax.tree.map(lambda x: x.rest if isinstance(x, Part) else None, parts)


def put_together(parts: Any, diff: Any, rest: Any) -> Any:
    """Fresh modules of the current trace from ``parts``, with ``diff`` and ``rest`` state."""

    def merge(x, r, d):  # d is x itself when diff is None
        if _is_nnx(x):
            return nnx.merge(x.graphdef, *((r,) if d is x else (d, r)), copy=True)
        return sys.modules["equinox"].combine(d, x.graphdef) if isinstance(x, Part) else d

    return jax.tree.map(merge, parts, rest, parts if diff is None else diff)


def new_rest(merged: Any, parts: Any, wrt: Any) -> Any:
    """The threaded state of the rebuilt modules ``merged`` after the loss ran."""

    def rest(x, module):
        return nnx.split(module, *_split_filters(wrt))[-1] if _is_nnx(x) else None

    return jax.tree.map(rest, parts, merged)


def write_back(parts: Any, rest: Any) -> None:
    """Updates each NNX module of ``parts`` in place with its new threaded state in ``rest``."""
    leaves, treedef = jax.tree.flatten(parts)
    for x, r in zip(leaves, treedef.flatten_up_to(rest)):
        if _is_nnx(x):
            nnx.update(x.module, r)


def specs_of(tree: Any) -> Any:
    """Each array's ``PartitionSpec``: on Explicit axes its type's (the layout it has), else
    its NNX Variable's sharding metadata, else ``P()``.

    Examples:
        >>> import jax.numpy as jnp, jaxga
        >>> jaxga.modules.specs_of({"w": jnp.ones(2)})
        {'w': P()}
    """

    def one(spec: Any, x: Any) -> Any:
        explicit = meshes.is_explicit(getattr(jax.typeof(x), "sharding", None))
        return meshes.type_spec(x) if explicit else spec

    return jax.tree.map(one, nnx.get_partition_spec(tree), tree, is_leaf=meshes.is_spec)


def check_unshared(parts: dict[int, Any]) -> None:
    """Raises if two of ``parts`` (``args[i]``'s) share an NNX Variable."""
    owner: dict[int, str] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(parts)[0]:  # parts[i]: args[i]
        where = f"args{jax.tree_util.keystr(path)}"
        for _, v in nnx.iter_graph(x.module) if _is_nnx(x) else ():
            if isinstance(v, nnx.Variable) and owner.setdefault(id(v), where) != where:
                raise ValueError(
                    f"{owner[id(v)]} and {where} share state (one Flax NNX module or "
                    f"Variable): pass it once, or one nnx.Module, List or Dict holding both."
                )
