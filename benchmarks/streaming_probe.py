"""Does a layer scan stream its parameters from pinned host memory? A probe on a real GPU.

L = 16 layers ``x = tanh(x @ w[l])`` of 4096 × 4096 float32 weights (64 MiB a layer, 1 GiB
the stack), a batch of 512, each layer under ``jax.checkpoint``. The stack is placed in
pinned host memory and each layer's slice moved to the device inside the scan body
(``jax.device_put(w_l, jax.memory.Space.Device)``), for the forward pass alone and for
its gradient, by JAX's transpose of the scan and by a backward scan written out
(``jax.custom_vjp``: the forward keeps each layer's input, the backward fetches each
layer again and moves its gradient to host memory as the loop's output); the resident
program (the stack on the device) is the reference. Printed:
XLA's ``memory_analysis()`` of each program in MiB (device temporaries, device and host
arguments and outputs), the memory kind of the result, and whether the streamed gradient
equals the resident one bit for bit. It needs a GPU (a described one has no memory
spaces: its host placements are counted on the device):

    python benchmarks/streaming_probe.py
"""

import functools
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

LAYERS, WIDTH, BATCH = 16, 4096, 512


def layer(w: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ w)


def loss(stacked: jax.Array, x: jax.Array, stream: bool) -> jax.Array:
    """The layers in a ``lax.scan``; with ``stream``, each slice moved to the device first."""

    def body(carry: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
        if stream:
            w = jax.device_put(w, jax.memory.Space.Device)
        return jax.checkpoint(layer)(w, carry), None

    return jnp.sum(jax.lax.scan(body, x, stacked)[0] ** 2)


@jax.custom_vjp
def streamed(stacked: jax.Array, x: jax.Array) -> jax.Array:
    """The layers on ``x``, each layer's parameters moved to the device in the loop."""
    return streamed_forward(stacked, x)[0]


def streamed_forward(stacked: jax.Array, x: jax.Array) -> tuple[jax.Array, Any]:
    def body(carry: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        return layer(jax.device_put(w, jax.memory.Space.Device), carry), carry

    y, inputs = jax.lax.scan(body, x, stacked)
    return y, (stacked, inputs)  # each layer's input, for the backward


def streamed_backward(saved: Any, grad_y: jax.Array) -> tuple[jax.Array, jax.Array]:
    def body(grad: jax.Array, layer_and_input: Any) -> tuple[jax.Array, jax.Array]:
        w, x = layer_and_input
        _, vjp = jax.vjp(layer, jax.device_put(w, jax.memory.Space.Device), x)
        grad_w, grad_x = vjp(grad)
        return grad_x, jax.device_put(grad_w, jax.memory.Space.Host)

    grad_x, grad_stacked = jax.lax.scan(body, grad_y, saved, reverse=True)
    return grad_stacked, grad_x


streamed.defvjp(streamed_forward, streamed_backward)


def written_out(stacked: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.sum(streamed(stacked, x) ** 2)


def mib(fn, *args) -> dict[str, int]:
    """The compiled program's memory analysis, in MiB."""
    stats = fn.lower(*args).compile().memory_analysis()
    kinds = ("temp", "argument", "output", "host_argument", "host_output", "host_temp")
    return {kind: getattr(stats, f"{kind}_size_in_bytes") >> 20 for kind in kinds}


def main() -> None:
    device = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    stacked = jax.random.normal(jax.random.key(0), (LAYERS, WIDTH, WIDTH)) * 0.02
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    on_host = jax.device_put(stacked, host)
    resident = jax.jit(jax.grad(functools.partial(loss, stream=False)))
    reference = np.asarray(resident(stacked, x))
    out = {"device": device.device_kind, "jax": jax.__version__,
           "stack_mib": LAYERS * WIDTH * WIDTH * 4 >> 20,
           "grad resident": mib(resident, stacked, x)}  # fmt: skip
    programs = {
        "forward streamed": jax.jit(functools.partial(loss, stream=True)),
        "grad streamed": jax.jit(jax.grad(functools.partial(loss, stream=True))),
        "grad streamed, backward written out": jax.jit(jax.grad(written_out)),
    }
    for name, fn in programs.items():
        result = fn(on_host, x)
        out[name] = mib(fn, on_host, x) | {"result_kind": result.sharding.memory_kind}
        if name.startswith("grad"):
            out[name]["equal_bit_for_bit"] = bool(np.array_equal(np.asarray(result), reference))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
