"""One process of a two-process (multi-host) data-parallel training run on localhost.

``tests/test_data_parallel.py`` starts this script twice; by hand::

    python tests/multidevice/two_process.py 0 2 PORT 2 out0.json &
    python tests/multidevice/two_process.py 1 2 PORT 2 out1.json

Arguments: process id, number of processes, coordinator port (on 127.0.0.1), CPU
devices per process, path of the JSON result. Each process joins the run with
``jax.distributed.initialize`` (CPU collectives over gloo, loopback only), loads only
its own rows of a global batch, trains a tiny token model for a few Adam steps with
``jaxga.value_and_grad(axis_name="data")`` under ``shard_map`` over the global mesh,
and checks every step against a single-process reference computed in the same
script without jaxga: ``jax.value_and_grad`` of the global batch on one device (with
micro-batch ``i`` of device ``d`` given ``fold_in(key, d * K + i)``). It then trains
the same steps with ``jaxga.make_train_step(..., mesh=mesh)``, giving it each process's
rows placed with ``shard_batch`` and a replicated ``TrainState``, and checks the losses,
the token counts, the parameters and the model state (averaged over the devices of both
processes) against the same reference. It exits 1 on a mismatch and writes both runs'
losses and final parameters to the JSON file.
"""

import functools
import json
import sys
import time

import jax

T0 = time.perf_counter()
K = 2  # micro-batches per device
ROWS = 2  # rows per micro-batch
SEQ, VOCAB, DIM = 6, 7, 4
STEPS = 3
RTOL, ATOL = 2e-5, 1e-6


def log(message: str) -> None:
    print(f"[{time.perf_counter() - T0:5.1f}s] {message}", flush=True)


def initialize(process_id: int, num_processes: int, port: int, local_devices: int) -> None:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Keep gloo's own sockets on loopback too (jax does not expose this option; test only).
    from jax._src import xla_bridge

    make = getattr(xla_bridge._jax, "make_gloo_tcp_collectives", None)
    if make is not None:
        xla_bridge._jax.make_gloo_tcp_collectives = functools.partial(make, hostname="127.0.0.1")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        coordinator_bind_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        cluster_detection_method="deactivate",  # ignore SLURM etc. variables of the host
        initialization_timeout=3000,  # the other process may start late on a busy machine
    )


def main(argv: list[str]) -> int:
    process_id, num_processes, port, local_devices = map(int, argv[:4])
    out_path = argv[4]
    initialize(process_id, num_processes, port, local_devices)
    log(f"process {process_id}: joined {num_processes} processes")

    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import PartitionSpec as P

    import jaxga
    from jaxga.sharding import replicate, shard_batch

    assert jax.process_count() == num_processes
    devices = jax.device_count()
    assert devices == num_processes * local_devices, jax.devices()
    mesh = jax.make_mesh((devices,), ("data",))
    local_rows = K * ROWS

    # The global batch (every process can build it, so that it can check the result),
    # with token lengths that grow with the device that holds them.
    rng = np.random.default_rng(0)
    total_rows = devices * local_rows
    tokens = rng.integers(0, VOCAB, (total_rows, SEQ + 1)).astype(np.int32)
    lengths = 1 + (np.arange(total_rows) // local_rows) * SEQ // devices
    mask = (np.arange(SEQ)[None] < lengths[:, None]).astype(np.float32)
    full = {"inputs": tokens[:, :-1], "labels": tokens[:, 1:], "mask": mask}

    # This process's rows: those of its devices in the mesh (contiguous for make_mesh).
    mine = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == process_id]
    assert mine == list(range(mine[0], mine[0] + len(mine))), mesh.devices
    rows = slice(mine[0] * local_rows, (mine[-1] + 1) * local_rows)
    batch = shard_batch(jax.tree.map(lambda x: x[rows], full), mesh)
    for shard in batch["inputs"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full["inputs"][shard.index])

    params0 = {
        "embed": rng.normal(size=(VOCAB, DIM)).astype(np.float32),
        "out": (rng.normal(size=(DIM, VOCAB)) / np.sqrt(DIM)).astype(np.float32),
        "bias": np.zeros(VOCAB, np.float32),
    }

    def loss(params, batch, key):
        scale = 0.5 + (jax.random.key_data(key)[-1] % 16).astype(jnp.float32) / 16
        hidden = jnp.tanh(params["embed"][batch["inputs"]]) * scale
        logits = hidden @ params["out"] + params["bias"]
        return jaxga.token_cross_entropy(logits, batch["labels"], batch["mask"])

    optimizer = optax.adam(0.05)
    base_key = jax.random.key(1)

    # --- data parallel across processes with jaxga
    grad_fn = jax.shard_map(
        jaxga.value_and_grad(loss, num_microbatches=K, axis_name="data", rng_argnums=2),
        mesh=mesh,
        in_specs=(P(), P("data"), P()),
        out_specs=P(),
    )

    @jax.jit
    def step(params, opt_state, batch, key):
        value, grads = grad_fn(params, batch, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params = replicate(params0, mesh)
    opt_state = replicate(optimizer.init(params0), mesh)
    losses = []
    for s in range(STEPS):
        params, opt_state, value = step(params, opt_state, batch, jax.random.fold_in(base_key, s))
        losses.append(float(value))
    log(f"process {process_id}: trained {STEPS} steps, losses {losses}")

    # --- single-process reference, without jaxga, on this process's first device
    def reference_loss(params, key):  # loops over micro-batches, vmapped over devices
        per_device = jax.tree.map(lambda x: x.reshape(devices, local_rows, *x.shape[1:]), full)
        total, count = 0.0, 0.0
        for i in range(K):
            micro = jax.tree.map(lambda x: x[:, i::K], per_device)
            keys = jax.vmap(lambda d: jax.random.fold_in(key, d * K + i))(jnp.arange(devices))
            mean = jax.vmap(loss, (None, 0, 0))(params, micro, keys)
            total, count = total + mean.total.sum(), count + mean.count.sum()
        return total / count

    @jax.jit
    def reference_step(params, opt_state, key):
        value, grads = jax.value_and_grad(reference_loss)(params, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    with jax.default_device(jax.local_devices()[0]):
        ref_params, ref_opt_state = params0, optimizer.init(params0)
        ref_losses, ref_history = [], [params0]
        for s in range(STEPS):
            ref_params, ref_opt_state, value = reference_step(
                ref_params, ref_opt_state, jax.random.fold_in(base_key, s)
            )
            ref_losses.append(float(value))
            ref_history.append(ref_params)

    log(f"process {process_id}: reference losses {ref_losses}")

    # --- the same run with jaxga.make_train_step(mesh=...): each process's host rows
    # placed with shard_batch, the state created by every process and replicated. Its
    # model state, a running mean of the hidden activations threaded through each
    # device's micro-batches, comes back averaged over the devices of both processes.
    def train_step_loss(params, batch, model_state, key):
        hidden = jnp.tanh(params["embed"][batch["inputs"]])
        ema = 0.5 * model_state["ema"] + 0.5 * jnp.mean(hidden, axis=(0, 1))
        return loss(params, batch, key), {"ema": jax.lax.stop_gradient(ema)}

    train_step = jaxga.make_train_step(train_step_loss, K, mesh=mesh)
    ema0 = np.zeros(DIM, np.float32)
    state = jaxga.TrainState.create(
        params=params0, tx=optimizer, model_state={"ema": ema0}, rng=base_key
    )
    state = jaxga.sharding.replicate(state, mesh)
    step_losses, counts = [], []
    for _ in range(STEPS):
        host_rows = jax.tree.map(lambda x: x[rows], full)
        state, metrics = train_step(state, jaxga.sharding.shard_batch(host_rows, mesh))
        step_losses.append(float(metrics["loss"]))
        counts.append(float(metrics["count"]))
    log(f"process {process_id}: make_train_step losses {step_losses}")

    # --- and with FSDP: parameters and Adam's moments split over the devices of both
    # processes; the fresh state is placed by the step itself.
    fsdp_step = jaxga.make_train_step(train_step_loss, K, mesh=mesh, strategy="fsdp")
    fsdp_state = jaxga.TrainState.create(
        params=params0, tx=optimizer, model_state={"ema": ema0}, rng=base_key
    )
    fsdp_losses = []
    for _ in range(STEPS):
        host_rows = jax.tree.map(lambda x: x[rows], full)
        fsdp_state, metrics = fsdp_step(fsdp_state, jaxga.sharding.shard_batch(host_rows, mesh))
        fsdp_losses.append(float(metrics["loss"]))
    assert not fsdp_state.params["out"].is_fully_addressable  # split across the processes
    fsdp_params = multihost_utils.process_allgather(fsdp_state.params, tiled=True)
    log(f"process {process_id}: FSDP losses {fsdp_losses}")

    def reference_ema(params, ema):  # each device's micro-batches in turn, then the mean
        per_device = jax.tree.map(lambda x: x.reshape(devices, local_rows, *x.shape[1:]), full)
        emas = np.stack([ema] * devices)
        for i in range(K):
            hidden = np.tanh(np.asarray(params["embed"])[per_device["inputs"][:, i::K]])
            emas = 0.5 * emas + 0.5 * hidden.mean(axis=(1, 2))
        return emas.mean(0)

    ref_ema = ema0
    for before in ref_history[:-1]:  # each step's state comes from the parameters before it
        ref_ema = reference_ema(before, ref_ema)
    np.testing.assert_allclose(counts, [full["mask"].sum()] * STEPS)

    final = {k: np.asarray(v).tolist() for k, v in params.items()}
    step_final = {k: np.asarray(v).tolist() for k, v in state.params.items()}
    with open(out_path, "w") as f:
        json.dump(
            {
                "process_id": process_id,
                "losses": losses,
                "params": final,
                "train_step_losses": step_losses,
                "train_step_params": step_final,
            },
            f,
        )
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(step_losses, ref_losses, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(fsdp_losses, ref_losses, rtol=RTOL, atol=ATOL)
    for name in params0:
        for trained in (params, state.params, fsdp_params):
            np.testing.assert_allclose(
                np.asarray(trained[name]), np.asarray(ref_params[name]), rtol=1e-4, atol=1e-5
            )
    np.testing.assert_allclose(np.asarray(state.model_state["ema"]), ref_ema, rtol=1e-5, atol=1e-6)
    log(f"process {process_id}: both runs match the single-process reference")
    jax.distributed.shutdown()
    log(f"process {process_id}: shut down")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
