"""jaxga.remat_scan driving a stack of Flax blocks, in NNX and in Linen.

Both models scan one pre-norm MLP block over stacked parameters (leading axis = depth),
rematerialised in √depth segments, and check their gradients against the same blocks
run in a plain Python loop without rematerialisation.

    .venv/bin/python examples/flax_remat.py --depth 8 --policy full --segments sqrt
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxga


class Block(nnx.Module):
    """A pre-norm residual MLP block: x + W₂ gelu(W₁ norm(x))."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(nnx.gelu(self.up(self.norm(x))))


class Stack(nnx.Module):
    """``depth`` Blocks with stacked parameters, run by ``jaxga.remat_scan``."""

    def __init__(self, dim: int, depth: int, *, policy="full", segments="sqrt", rngs: nnx.Rngs):
        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(dim, rngs=rngs)

        self.blocks = make_blocks(rngs)  # every parameter has a leading axis of size depth
        self.policy, self.segments = policy, segments

    def __call__(self, x: jax.Array) -> jax.Array:
        graphdef, params = nnx.split(self.blocks)

        def layer(p, x):
            return nnx.merge(graphdef, p)(x)

        return jaxga.remat_scan(layer, params, x, policy=self.policy, segments=self.segments)

    def loop(self, x: jax.Array) -> jax.Array:
        """The reference: the same blocks in a Python loop, nothing rematerialised."""
        graphdef, params = nnx.split(self.blocks)
        for i in range(jaxga.remat.stack_length(params)):
            x = nnx.merge(graphdef, jax.tree.map(lambda p, i=i: p[i], params))(x)
        return x


class LinenBlock(nn.Module):
    """The same block in Linen."""

    dim: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(4 * self.dim)(nn.LayerNorm()(x))
        return x + nn.Dense(self.dim)(nn.gelu(h))


class LinenStack(nn.Module):
    """``depth`` LinenBlocks as one stacked parameter tree, run by ``jaxga.remat_scan``."""

    dim: int
    depth: int
    policy: str = "full"
    segments: int | str = "sqrt"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        block = LinenBlock(self.dim, parent=None)  # unbound: used through init/apply

        def init(key):
            return jax.vmap(block.init, in_axes=(0, None))(jax.random.split(key, self.depth), x)

        stacked = self.param("blocks", init)
        return jaxga.remat_scan(block.apply, stacked, x, policy=self.policy, segments=self.segments)


def linen_loop(dim: int, variables, x: jax.Array) -> jax.Array:
    """The reference for LinenStack: its blocks in a Python loop."""
    stacked = variables["params"]["blocks"]
    for i in range(jaxga.remat.stack_length(stacked)):
        x = LinenBlock(dim).apply(jax.tree.map(lambda p, i=i: p[i], stacked), x)
    return x


def max_abs_diff(a, b) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in pairs)


def main(depth: int = 8, dim: int = 32, batch: int = 8, policy="full", segments="sqrt") -> dict:
    x = jax.random.normal(jax.random.key(1), (batch, dim))

    def loss(y):
        return jnp.mean(y**2)

    model = nnx.jit(lambda: Stack(dim, depth, policy=policy, segments=segments, rngs=nnx.Rngs(0)))()
    grads = nnx.jit(nnx.grad(lambda m: loss(m(x))))(model)
    graphdef, state = nnx.split(model)
    reference = jax.jit(jax.grad(lambda s: loss(nnx.merge(graphdef, s).loop(x))))(state)
    nnx_diff = max_abs_diff(grads, reference)

    linen = LinenStack(dim, depth, policy=policy, segments=segments)
    variables = jax.jit(linen.init)(jax.random.key(0), x)
    grads = jax.jit(jax.grad(lambda v: loss(linen.apply(v, x))))(variables)
    reference = jax.jit(jax.grad(lambda v: loss(linen_loop(dim, v, x))))(variables)
    linen_diff = max_abs_diff(grads, reference)

    s = jaxga.remat.resolve_segments(segments, depth)
    print(f"{depth} blocks, policy={policy!r}, segments={segments!r} ({s} segment(s))")
    for name, diff in (("NNX", nnx_diff), ("Linen", linen_diff)):
        verdict = "match" if diff < 1e-4 else "DIFFER"
        print(f"  {name:<5} gradients vs. the plain loop: max |diff| = {diff:.1e} ({verdict})")
    return {"nnx": nnx_diff, "linen": linen_diff}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--policy", default="full", help="none, full, dots, dots_no_batch")
    parser.add_argument("--segments", default="sqrt", help="an int dividing depth, or sqrt")
    args = parser.parse_args()
    segments = args.segments if args.segments == "sqrt" else int(args.segments)
    main(args.depth, args.dim, args.batch, args.policy, segments)
