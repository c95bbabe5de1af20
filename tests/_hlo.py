"""Test helper: the collectives of compiled HLO, each marked as inside a loop or not.

The data-parallel tests use :func:`hlo_collectives` to check that jaxga's micro-batch
loop holds no collective and that one all-reduce follows it.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax

__all__ = ["Collective", "hlo_collectives"]


class Collective(NamedTuple):
    """A collective operation in compiled HLO text; see :func:`hlo_collectives`.

    Attributes:
        opcode: ``"all-reduce"``, ``"reduce-scatter"``, ``"all-gather"``,
            ``"collective-permute"``, ``"all-to-all"``, ... (without ``-start``).
        computation: name of the HLO computation that holds it.
        in_loop: whether that computation runs inside a ``while`` loop (is a loop
            body or condition, or is called from one, directly or not).
        line: the HLO instruction.
    """

    opcode: str
    computation: str
    in_loop: bool
    line: str


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_COLLECTIVE = re.compile(
    r"(?<=\s)(all-reduce|reduce-scatter|all-gather|collective-permute|all-to-all|"
    r"ragged-all-to-all|collective-broadcast)(?:-start)?\("
)
_WHILE = re.compile(r"(?<=\s)while\(")
_ATTRIBUTE = re.compile(r"\b\w+=(\{[^{}]*\}|%[\w.\-]+)")
_NAME = re.compile(r"%([\w.\-]+)")


def _hlo_text(compiled: Any) -> str:
    """Returns the HLO text of a ``jax.stages.Compiled``, or ``compiled`` if it is text."""
    if isinstance(compiled, str):
        return compiled
    if isinstance(compiled, jax.stages.Compiled):
        return compiled.as_text()
    if isinstance(compiled, jax.stages.Lowered):
        # Its text is StableHLO before XLA's passes: no fusions, no async collectives.
        raise TypeError(
            "`compiled` is a jax.stages.Lowered, whose text is StableHLO, not compiled HLO; "
            "pass lowered.compile() or lowered.compile().as_text()."
        )
    raise TypeError(
        f"`compiled` must be compiled HLO text or a jax.stages.Compiled "
        f"(jax.jit(f).lower(*args).compile()); got {type(compiled).__name__}."
    )


def parse_computations(hlo_text: str) -> dict[str, list[str]]:
    """Returns each computation's name and its instruction lines."""
    computations: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line.startswith("}"):
            current = None
        elif not line[:1].isspace() and (match := _COMPUTATION.match(line)):
            current = computations.setdefault(match.group(1), [])
        elif current is not None and line.strip():
            current.append(line.strip())
    return computations


def hlo_collectives(compiled: str | jax.stages.Compiled) -> list[Collective]:
    """Lists the collectives of a compiled function, each marked as inside a loop or not.

    ``compiled`` is a ``jax.stages.Compiled`` (``jax.jit(f).lower(*args).compile()``) or
    its ``as_text()``. A computation is *in a loop* if it is the body or condition of a
    ``while`` instruction or is called (as a fusion, call, reducer, branch, ...) from
    such a computation, directly or through others. With ``axis_name`` set, jaxga's
    micro-batch loop has no collective inside it and one all-reduce after it.

    Example:
        >>> hlo = '''
        ... %body (p: f32[]) -> f32[] {
        ...   %p = f32[] parameter(0)
        ...   ROOT %r = f32[] all-reduce(%p), replica_groups={}, to_apply=%add
        ... }
        ... ENTRY %main (x: f32[]) -> f32[] {
        ...   %x = f32[] parameter(0)
        ...   %w = f32[] while(%x), condition=%cond, body=%body
        ...   ROOT %s = f32[] all-reduce-start(%w), replica_groups={}, to_apply=%add
        ... }'''
        >>> [(c.opcode, c.in_loop) for c in hlo_collectives(hlo)]
        [('all-reduce', True), ('all-reduce', False)]
    """
    computations = parse_computations(_hlo_text(compiled))

    def callees(name: str) -> set[str]:
        found = set()
        for line in computations.get(name, ()):
            for value in _ATTRIBUTE.findall(line):
                found.update(n for n in _NAME.findall(value) if n in computations)
        return found

    in_loop: set[str] = set()
    pending = [
        callee
        for lines in computations.values()
        for line in lines
        if _WHILE.search(line)
        for _, callee in re.findall(r"\b(body|condition)=%?([\w.\-]+)", line)
    ]
    while pending:
        name = pending.pop()
        if name not in in_loop:
            in_loop.add(name)
            pending.extend(callees(name))
    return [
        Collective(match.group(1), name, name in in_loop, line)
        for name, lines in computations.items()
        for line in lines
        if (match := _COLLECTIVE.search(line))
    ]


def loop_reductions(compiled: str | jax.stages.Compiled, grads: Any) -> list[str]:
    """The all-reduces and reduce-scatters inside a loop with a result shaped as a gradient.

    ``grads``: arrays laid out as the gradients (their first shard's shape is matched), so
    that a reduction of activations (tensor parallelism) is not taken for one of gradients.
    """
    shapes = {
        "[" + ",".join(map(str, g.addressable_shards[0].data.shape)) + "]"
        for g in jax.tree.leaves(grads)
    }
    found = []
    for c in hlo_collectives(compiled):
        result = c.line.split("=", 1)[1].split(c.opcode)[0]  # "(f32[4,16]{1,0}, f32[4]{0})"
        if (
            c.in_loop
            and c.opcode in _REDUCTIONS
            and set(re.findall(r"\[[\d,]*\]", result)) & shapes
        ):
            found.append(c.line)
    return found


_REDUCTIONS = ("all-reduce", "reduce-scatter")
