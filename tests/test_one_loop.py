"""One loop onto a mesh: the drop-in and both train steps run the engine's one ``shard_map``.

On 8 host devices, read from the compiled HLO: a parameter split over the batch's axis
stays split through the step — gathered for the loop once (ZeRO-3: in every micro-batch)
and its gradient reduce-scattered once, after the loop, never all-reduced whole — exact
against the whole batch on one device (plain ``jax.value_and_grad``, ``nnx.Optimizer``).
And the optimiser is traced once per compile, plain and under ``jaxga.MultiSteps``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxga
from tests._hlo import hlo_collectives, loop_reductions


def mesh_of(kind: str) -> jax.sharding.Mesh:
    axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    return jax.make_mesh((8,), ("data",), axis_types=(axis_type,))


def data(rows: int = 32, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(rows, 16)).astype(np.float32),
        "y": rng.integers(0, 8, size=rows),
        # skewed weights: a mean of micro-batch means would be wrong
        "w": np.where(np.arange(rows) % 5 == 0, 4.0, 0.5) * (rng.uniform(size=rows) > 0.3),
    }


def shapes_of(collectives, opcode: str, *, in_loop: bool) -> list[str]:
    return [c.line for c in collectives if c.opcode == opcode and c.in_loop == in_loop]


def whole(lines: list[str], shapes: tuple[str, ...]) -> list[str]:
    """The lines among ``lines`` whose result is one of ``shapes`` (a whole gradient)."""
    return [line for line in lines if any(f"{s}{{" in line.split("=", 1)[1][:60] for s in shapes)]


def test_drop_in_reduce_scatters_a_parameter_split_over_the_batch_axis():
    mesh = mesh_of("explicit")
    rng = np.random.default_rng(1)
    w = rng.normal(size=(64, 64)).astype(np.float32) / 8
    batch = data(32)
    batch["x"] = rng.normal(size=(32, 64)).astype(np.float32)

    def loss(w, batch):
        logits = jnp.tanh(batch["x"] @ w)[:, :8]
        return jaxga.token_cross_entropy(logits, batch["y"], batch["w"])

    want_loss, want = jax.value_and_grad(lambda w: loss(w, batch).value)(w)
    ported = jax.jit(jaxga.value_and_grad(loss, num_microbatches=2))
    with jax.set_mesh(mesh):
        ws = jax.device_put(w, NamedSharding(mesh, P("data", None)))
        bs = jax.device_put(batch, NamedSharding(mesh, P("data")))
        got_loss, got = ported(ws, bs)
        found = hlo_collectives(ported.lower(ws, bs).compile())
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert got.sharding.is_equivalent_to(ws.sharding, 2)  # split as it came
    assert shapes_of(found, "reduce-scatter", in_loop=False)
    assert not whole(shapes_of(found, "all-reduce", in_loop=False), ("f32[64,64]",))
    assert not [c for c in found if c.in_loop and c.opcode in ("all-reduce", "reduce-scatter")]


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, split: tuple | None = None):
        init = nnx.initializers.lecun_normal()
        if split is not None:  # its own sharding metadata: over the batch's axis
            init = nnx.with_partitioning(init, split)
        self.hidden = nnx.Linear(16, 64, kernel_init=init, rngs=rngs)
        self.out = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


def nnx_loss(model, batch):
    return jaxga.token_cross_entropy(model(batch["x"]), batch["y"], batch["w"])


def reference_model(steps: int, batches: list[dict]) -> MLP:
    """``nnx.Optimizer`` on the whole batch, one device: the plain step."""
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
    for batch in batches[:steps]:
        grads = nnx.grad(lambda m: nnx_loss(m, batch).value)(model)
        optimizer.update(model, grads)
    return model


# what each strategy compiles, outside the loop (o) and inside it (i)
EXPECTED = {
    "data_parallel": {"reduce-scatter o": False, "all-gather i": False},
    "zero1": {"reduce-scatter o": True, "all-gather i": False},
    "fsdp": {"reduce-scatter o": True, "all-gather i": False},
    "zero3": {"reduce-scatter o": False, "all-gather i": True},
}


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("strategy", list(EXPECTED))
def test_nnx_train_step_strategies_match_nnx_optimizer_and_reduce_as_laid_out(kind, strategy):
    batches = [data(32, seed) for seed in range(2)]
    want = reference_model(2, batches)
    mesh = mesh_of(kind)
    with jax.set_mesh(mesh):
        model = MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
        step = jaxga.nnx_train_step(nnx_loss, 2, mesh=mesh, strategy=strategy)
        for batch in batches:
            metrics = step(model, optimizer, batch)
        compiled = step.lower(model, optimizer, batches[0]).compile()
    for g, w in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(want))):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
    assert np.isfinite(metrics["loss"])
    kernel, mu = model.hidden.kernel, optimizer.opt_state[0].mu["hidden"]["kernel"]
    split = sharding_of(kernel), sharding_of(mu)
    params_split = strategy in ("fsdp", "zero3")
    assert split == (params_split, strategy != "data_parallel"), split
    found = hlo_collectives(compiled)
    expected = EXPECTED[strategy]
    assert bool(shapes_of(found, "reduce-scatter", in_loop=False)) == expected["reduce-scatter o"]
    assert bool(shapes_of(found, "all-gather", in_loop=True)) == expected["all-gather i"]
    grads = ("f32[16,64]", "f32[64,8]")
    if strategy != "data_parallel":  # never the whole gradient all-reduced
        assert not whole(shapes_of(found, "all-reduce", in_loop=False), grads)
    if strategy != "zero3":  # ZeRO-3 reduce-scatters in every micro-batch, by design
        assert not loop_reductions(compiled, [kernel.get_value()])


def sharding_of(variable: nnx.Variable) -> bool:
    """Whether ``variable`` is split over the devices."""
    x = variable.get_value()
    return x.addressable_shards[0].data.shape != x.shape


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_nnx_metadata_split_over_the_batch_axis_reduce_scatters(kind):
    """A parameter whose metadata splits it over "data" (Flax's FSDP example's habit)."""
    batches = [data(32, 3)]
    mesh = mesh_of(kind)
    with jax.set_mesh(mesh):
        model = nnx.jit(lambda: MLP(nnx.Rngs(0), split=(None, "data")))()
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        graphdef, state = nnx.split((model, optimizer))
        want_model, want_optimizer = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
        grads = nnx.grad(lambda m: nnx_loss(m, batches[0]).value)(want_model)
        want_optimizer.update(want_model, grads)
        step = jaxga.nnx_train_step(nnx_loss, 2, mesh=mesh)
        step(model, optimizer, batches[0])
        compiled = step.lower(model, optimizer, batches[0]).compile()
    for g, w in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(want_model))):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
    assert model.hidden.kernel.get_value().sharding.spec == P(None, "data")
    found = hlo_collectives(compiled)
    assert shapes_of(found, "reduce-scatter", in_loop=False)
    assert not whole(shapes_of(found, "all-reduce", in_loop=False), ("f32[16,64]",))


def counting(tx: optax.GradientTransformation, calls: list) -> optax.GradientTransformation:
    """``tx``, its ``update`` counted (each trace of it under jit)."""

    def update(updates, state, params=None, **extra):
        calls.append(1)
        return tx.update(updates, state, params)

    return optax.GradientTransformationExtraArgs(tx.init, update)


@pytest.mark.parametrize("multisteps", [False, True])
def test_the_optimizer_is_traced_once_per_compile(multisteps):
    calls = []
    tx = counting(optax.adam(0.1), calls)
    tx = jaxga.MultiSteps(tx, every_k=2) if multisteps else tx

    def loss(params, batch, model_state, rng):
        return jaxga.Mean.of((batch @ params) ** 2), model_state

    state = jaxga.TrainState.create(params=jnp.ones(3), tx=tx)
    jaxga.make_train_step(loss, 2).lower(state, jnp.ones((4, 3)))
    assert len(calls) == 1
    calls.clear()
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    jaxga.nnx_train_step(lambda m, x: jaxga.Mean.of(m(x) ** 2), 2).lower(
        model, optimizer, jnp.ones((4, 3))
    )
    assert len(calls) == 1


def test_nnx_strategy_is_checked():
    with pytest.raises(ValueError, match=r"`strategy`='fsdp' shards the state over a mesh"):
        jaxga.nnx_train_step(nnx_loss, 2, strategy="fsdp")
    with pytest.raises(ValueError, match=r"`strategy` must be one of 'data_parallel'"):
        jaxga.nnx_train_step(nnx_loss, 2, mesh=mesh_of("auto"), strategy="ddp")
    with pytest.raises(TypeError, match=r"`strategy` for an NNX model must be one of"):
        model = MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        step = jaxga.nnx_train_step(nnx_loss, 2, mesh=mesh_of("auto"), strategy={"w": P()})
        step(model, optimizer, data(32))


class Noisy(nnx.Module):
    """Dropout and BatchNorm: a key per micro-batch, statistics threaded through them."""

    def __init__(self, rngs: nnx.Rngs):
        # no bias before the norm: its gradient is zero but for rounding, which Adam would
        # scale up to a step of the learning rate, differently for each summation order
        self.hidden = nnx.Linear(16, 64, use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(64, rngs=rngs)
        self.drop = nnx.Dropout(0.3)
        self.out = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x, rngs):
        return self.out(self.drop(jnp.tanh(self.norm(self.hidden(x))), rngs=rngs))


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("strategy", ["zero1", "fsdp", "zero3"])
def test_nnx_strategies_thread_dropout_keys_and_batchnorm_as_the_models_own_layout(kind, strategy):
    """A strategy changes where the state lives, not the step: the same parameters,
    BatchNorm statistics and key counts as the step with the model's own layout."""

    def loss(model, batch, rngs):
        return jaxga.token_cross_entropy(model(batch["x"], rngs), batch["y"], batch["w"])

    mesh, got = mesh_of(kind), {}
    for name in (None, strategy):
        with jax.set_mesh(mesh):
            model = Noisy(nnx.Rngs(0))  # SGD: Adam's first steps scale rounding up to lr
            optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        rngs = nnx.Rngs(dropout=1)
        step = jaxga.nnx_train_step(loss, 2, mesh=mesh, strategy=name)
        for seed in range(2):
            step(model, optimizer, data(32, seed), rngs=rngs)
        got[name] = (nnx.state(model), int(rngs.dropout.count[...]))
    (want, want_count), (state, count) = got[None], got[strategy]
    assert count == want_count
    for g, w in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
