"""On the meshes JAX builds: Explicit axes (jax.make_mesh's default), Auto axes and Manual
axes (inside a shard_map), each on 8 host devices against the same step without jaxga.

Exact to float32 rounding, and the compiled HLO has no gradient-sized reduction inside the
micro-batch loop: the gradient is reduced once, after it.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxga
from tests._hlo import loop_reductions

K = 4


def mesh_of(kind: str) -> jax.sharding.Mesh:
    axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)


def host_data(seed: int = 0):
    rng = np.random.default_rng(seed)
    batch = {
        "x": rng.normal(size=(64, 32)).astype(np.float32),
        "y": rng.integers(0, 8, size=64),
        # skewed weights: a mean of micro-batch means would be wrong
        "w": np.where(np.arange(64) % 5 == 0, 4.0, 0.5) * (rng.uniform(size=64) > 0.3),
    }
    params = {
        "a": rng.normal(size=(32, 16)).astype(np.float32) / 6,
        "bias": rng.normal(size=16).astype(np.float32),
        "b": rng.normal(size=(16, 8)).astype(np.float32) / 4,
    }
    return params, jax.tree.map(np.asarray, batch)


LAYOUT = {"a": P(None, "model"), "bias": P("model"), "b": P("model", None)}
FSDP = {**LAYOUT, "a": P("data", "model")}  # split over the batch's axis too


def contract(h, w):  # over the 'model' axis: Explicit axes want the result's layout said
    explicit = AxisType.Explicit in jax.sharding.get_abstract_mesh().axis_types
    return jnp.dot(h, w, out_sharding=P() if explicit else None)


def loss(params, batch):  # a bias add: what JAX's reduced types cannot yet carry
    h = jnp.tanh(batch["x"] @ params["a"] + params["bias"])
    return jaxga.token_cross_entropy(contract(h, params["b"]), batch["y"], batch["w"])


def reference(params, batch):
    return jax.value_and_grad(lambda p: loss(p, batch).value)(params)


def place(mesh, params, batch, layout=LAYOUT):
    params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, layout)
    return params, jax.device_put(batch, NamedSharding(mesh, P("data")))


def assert_close(got, want):
    value, grads = got
    np.testing.assert_allclose(value, want[0], rtol=2e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-7)


@pytest.mark.parametrize("layout", [LAYOUT, FSDP], ids=["model-axis", "fsdp"])
@pytest.mark.parametrize("kind", ["explicit", "auto", "manual"])
def test_value_and_grad_in_jit_reduces_once_on_every_kind_of_axis(kind, layout):
    if kind == "manual" and layout is FSDP:
        pytest.skip("inside a shard_map, a parameter split over its axis is the user's to gather")
    mesh = mesh_of("explicit" if kind == "explicit" else "auto")
    host_params, host_batch = host_data()
    with jax.set_mesh(mesh):
        params, batch = place(mesh, host_params, host_batch, layout)
        if kind == "explicit":  # the batch's type says which axis: nothing to name
            fn = jaxga.value_and_grad(loss, num_microbatches=K)
        elif kind == "auto":  # Auto axes are not in the types: name the batch's axis
            fn = jaxga.value_and_grad(loss, num_microbatches=K, axis_name="data")
        else:  # inside the user's own shard_map: read from the batch (varying over "data")
            vg = jaxga.value_and_grad(loss, num_microbatches=K)
            specs = {"in_specs": (P(), P("data")), "out_specs": P(), "axis_names": {"data"}}
            fn = jax.shard_map(vg, **specs)
        step = jax.jit(fn)
        got = step(params, batch)
        compiled = step.lower(params, batch).compile()
    assert_close(got, reference(host_params, host_batch))
    assert not loop_reductions(compiled, jax.tree.leaves(got[1]))
    if kind == "auto" and layout is FSDP:
        return  # Auto axes: types do not say where a parameter is; the compiler lays it out
    for g, spec in zip(jax.tree.leaves(got[1]), jax.tree.leaves(layout)):  # where they were
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, spec), g.ndim)


def test_global_view_is_exact_and_reduces_in_the_loop():
    """axis_name=(): the loop in jit's global view (for a loss naming the batch's axis in its
    own annotations). Exact too, but JAX reduces every micro-batch: the check above can fail."""
    mesh = mesh_of("explicit")
    host_params, host_batch = host_data()
    with jax.set_mesh(mesh):
        params, batch = place(mesh, host_params, host_batch)
        step = jax.jit(jaxga.value_and_grad(loss, num_microbatches=K, axis_name=()))
        got = step(params, batch)
        compiled = step.lower(params, batch).compile()
    assert_close(got, reference(host_params, host_batch))
    assert loop_reductions(compiled, jax.tree.leaves(got[1]))


def test_a_loss_naming_the_batch_axis_is_told_what_to_do():
    mesh = mesh_of("explicit")
    host_params, host_batch = host_data()

    def annotated(params, batch):
        h = jnp.tanh(batch["x"] @ params["a"] + params["bias"])
        logits = jnp.dot(h, params["b"], out_sharding=P("data", None))  # names "data"
        return jaxga.token_cross_entropy(logits, batch["y"], batch["w"])

    with jax.set_mesh(mesh):
        params, batch = place(mesh, host_params, host_batch)
        with pytest.raises(ValueError) as error:
            jax.jit(jaxga.value_and_grad(annotated, num_microbatches=K))(params, batch)
        notes = " ".join(getattr(error.value, "__notes__", ()))
        assert "pass axis_name=() to run the loop in jit's global view" in notes
        got = jax.jit(jaxga.value_and_grad(annotated, num_microbatches=K, axis_name=()))(
            params, batch
        )
    assert_close(got, reference(host_params, host_batch))


@pytest.mark.parametrize("normalize", ["token_mean", "sequence_mean", "sequence_sum"])
def test_token_cross_entropy_on_logits_split_over_the_vocabulary(normalize):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(8, 6, 64)).astype(np.float32)
    labels = rng.integers(0, 64, size=(8, 6))
    mask = (rng.uniform(size=(8, 6)) > 0.3).astype(np.float32)
    want = jaxga.token_cross_entropy(logits, labels, mask, normalize=normalize)
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"))  # Explicit axes
    with jax.set_mesh(mesh):
        sharded = jax.device_put(logits, P("fsdp", None, "tensor"))
        rows = jax.device_put((labels, mask), P("fsdp"))
        fn = jax.jit(lambda *a: jaxga.token_cross_entropy(*a, normalize=normalize))
        got = fn(sharded, *rows)
        grad = jax.jit(jax.grad(lambda x: fn(x, *rows).value))(sharded)
    np.testing.assert_allclose(got.total, want.total, rtol=1e-6)
    np.testing.assert_allclose(got.count, want.count)
    assert grad.sharding.spec == P("fsdp", None, "tensor")
    plain = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # the bits of optax's
    np.testing.assert_array_equal(
        jaxga.token_cross_entropy(logits, labels).total, jnp.sum(plain, dtype=jnp.float32)
    )


def test_split_microbatches_keeps_each_devices_rows():
    mesh = jax.make_mesh((8,), ("data",))
    x = jax.device_put(np.arange(64.0).reshape(32, 2), NamedSharding(mesh, P("data")))
    split = jaxga.split_microbatches(x, 4)
    assert split.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "data")), 3)
    np.testing.assert_array_equal(split, np.arange(64.0).reshape(8, 4, 2).swapaxes(0, 1))
    np.testing.assert_array_equal(jaxga.merge_microbatches(split), x)
    assert jaxga.merge_microbatches(split).sharding.is_equivalent_to(x.sharding, 2)


class TinyModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(6)(jnp.tanh(nn.Dense(12)(x)))  # no gradient shaped as an activation


def linen_setup():
    model = TinyModel()
    _, batch = host_data(2)
    params = model.init(jax.random.key(0), batch["x"][:2])["params"]

    def step_loss(params, batch, model_state, rng):
        logits = model.apply({"params": params}, batch["x"])
        return jaxga.token_cross_entropy(logits, batch["y"] % 6, batch["w"]), model_state

    return params, batch, step_loss


def model_axis_specs(params):
    def spec(path, x):  # Dense_0 is the outer layer: its outputs (the logits) over "model"
        if "Dense_0" in jax.tree_util.keystr(path):
            return P(None, "model") if x.ndim == 2 else P("model")
        return P()

    return jax.tree_util.tree_map_with_path(spec, params)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("strategy", ["data_parallel", "zero1", "fsdp", "zero3", "model axis"])
def test_make_train_step_on_a_mesh_matches_one_device(kind, strategy):
    if strategy == "zero3" and kind == "explicit":  # beside the Explicit "model" axis
        with pytest.raises(ValueError, match="'zero3' gathers in every micro-batch in a shard_map"):
            jaxga.make_train_step(linen_setup()[2], K, mesh=mesh_of(kind), strategy=strategy)(
                jaxga.TrainState.create(params=linen_setup()[0], tx=optax.adam(0.05)),
                linen_setup()[1],
            )
        return
    params, batch, step_loss = linen_setup()
    tx = optax.adam(0.05)
    plain = jaxga.make_train_step(step_loss, 1)
    want, _ = plain(jaxga.TrainState.create(params=params, tx=tx), batch)
    mesh = mesh_of(kind)
    layout = model_axis_specs(params) if strategy == "model axis" else strategy
    step = jaxga.make_train_step(step_loss, K, mesh=mesh, strategy=layout)
    state = jaxga.TrainState.create(params=params, tx=tx)
    got, metrics = step(state, batch)
    for g, w in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
    if strategy == "model axis":  # the parameters stay where the layout put them
        for x, spec in zip(jax.tree.leaves(got.params), jax.tree.leaves(layout)):
            assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)
    if strategy != "zero3":  # ZeRO-3 reduce-scatters in every micro-batch, by design
        compiled = step.lower(got, batch).compile()
        assert not loop_reductions(compiled, jax.tree.leaves(got.params)), strategy
    assert jnp.isfinite(metrics["loss"])


class FSDPToy(nnx.Module):
    """Flax's examples/nnx_toy_examples/10_fsdp_and_optimizer.py, its MLP: 'model' layout."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(init(rngs.params(), (1, 32)), out_sharding=(None, "model"))
        self.b1 = nnx.Param(jnp.zeros((32,)), out_sharding=("model",))
        self.w2 = nnx.Param(init(rngs.params(), (32, 1)), out_sharding=("model", None))

    def __call__(self, x):
        return nnx.relu(x @ self.w1 + self.b1) @ self.w2


def test_flax_fsdp_toy_example_ported_to_the_drop_in():
    """As the example runs it: an Auto mesh, parameters laid out by their metadata."""
    kind = "auto"
    mesh = mesh_of(kind)
    rng = np.random.default_rng(3)
    x = rng.uniform(-2, 2, size=(32, 1)).astype(np.float32)
    y = (0.8 * x**2 + 0.1).astype(np.float32)

    def loss_fn(model, x, y):
        return jnp.mean((y - model(x)) ** 2)

    axis = {} if kind == "explicit" else {"axis_name": "data"}
    ported = jaxga.value_and_grad(loss_fn, num_microbatches=K, batch_argnums=(1, 2), **axis)

    def step(model, x, y, fn):
        return nnx.jit(fn)(model, x, y)

    with jax.set_mesh(mesh):
        model = nnx.jit(lambda: FSDPToy(nnx.Rngs(0)))()
        xs, ys = jax.device_put((x, y), NamedSharding(mesh, P("data")))
        want_loss, want = step(model, xs, ys, nnx.value_and_grad(loss_fn))
        got_loss, got = step(model, xs, ys, ported)
        graphdef, state = nnx.split(model)
        compiled = (
            jax.jit(lambda s, x, y: ported(nnx.merge(graphdef, s), x, y)).lower(state, xs, ys)
        ).compile()
    np.testing.assert_allclose(got_loss, want_loss, rtol=2e-6)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-7)
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim)  # the 'model' layout kept
    assert not loop_reductions(compiled, jax.tree.leaves(got))


class NNXTensorParallel(nnx.Module):
    """Its outer layer's outputs (the logits) over "model", by its variables' metadata."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(32, 12, rngs=rngs)
        init = nnx.initializers.lecun_normal()
        self.w = nnx.Param(init(rngs.params(), (12, 6)), out_sharding=(None, "model"))
        self.b = nnx.Param(jnp.zeros((6,)), out_sharding=("model",))

    def __call__(self, x):
        return jnp.tanh(self.hidden(x)) @ self.w + self.b


def nnx_loss(model, batch):
    return jaxga.token_cross_entropy(model(batch["x"]), batch["y"] % 6, batch["w"])


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_nnx_train_step_on_a_mesh_keeps_the_models_layout(kind):
    _, batch = host_data(4)
    mesh = mesh_of(kind)
    with jax.set_mesh(mesh):  # the reference: the whole batch in one micro-batch, no split
        want_model = nnx.jit(lambda: NNXTensorParallel(nnx.Rngs(0)))()
        want_opt = nnx.Optimizer(want_model, optax.adam(0.05), wrt=nnx.Param)
        jaxga.nnx_train_step(nnx_loss, 1)(want_model, want_opt, batch)
        model = nnx.jit(lambda: NNXTensorParallel(nnx.Rngs(0)))()
        optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
    step = jaxga.nnx_train_step(nnx_loss, K, mesh=mesh)
    metrics = step(model, optimizer, batch)
    for got, want in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(want_model))):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert model.w[...].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
    assert model.b[...].sharding.is_equivalent_to(NamedSharding(mesh, P("model")), 1)
    compiled = step.lower(model, optimizer, batch).compile()
    assert not loop_reductions(compiled, jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert jnp.isfinite(metrics["loss"])


class Dropped(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(32, 6, rngs=rngs)
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x, rngs=None):
        return self.linear(self.drop(x, rngs=rngs))


def test_nnx_train_step_gives_aux_and_takes_rngs():
    """Gemma's step: the logits for its metrics from the same forward pass, and its own
    nnx.Rngs handed to the model: a stream per micro-batch, advanced k times."""
    _, batch = host_data(5)
    batch["x"] = np.ones_like(batch["x"])  # every row alike: only the masks tell them apart

    def loss(model, batch, rngs):
        logits = model(batch["x"], rngs=rngs)
        return jaxga.token_cross_entropy(logits, batch["y"] % 6, batch["w"]), {"logits": logits}

    model = Dropped(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)  # nothing moves
    rngs = nnx.Rngs(dropout=7)
    step = jaxga.nnx_train_step(loss, K, has_aux=True, aux="rows")
    metrics = step(model, optimizer, batch, rngs=rngs)
    assert int(rngs.dropout.count[...]) == K  # one draw per micro-batch
    logits = metrics["aux"]["logits"]
    assert logits.shape == (64, 6)
    # the same rows in every micro-batch: one key for all would give them the same masks
    per_microbatch = jaxga.split_microbatches(logits, K)
    for i in range(1, K):
        assert not np.allclose(per_microbatch[0], per_microbatch[i])
    with pytest.raises(TypeError, match="has_aux=True"):
        jaxga.nnx_train_step(loss, K)(model, optimizer, batch, rngs=rngs)
    for key in (jax.random.key(3), jax.random.PRNGKey(3)):  # a typed or raw key: folded
        key_metrics = step(model, optimizer, batch, rngs=key)
        per_microbatch = jaxga.split_microbatches(key_metrics["aux"]["logits"], K)
        assert not np.allclose(per_microbatch[0], per_microbatch[1])
    with pytest.raises(
        TypeError, match=r"With has_aux=True, .* must return \(loss, aux\); got Mean"
    ):
        jaxga.nnx_train_step(lambda m, b, r: loss(m, b, r)[0], K, has_aux=True)(
            model, optimizer, batch, rngs=rngs
        )
    with pytest.raises(ValueError, match='`rngs` needs a fixed num_microbatches; "auto"'):
        auto = jaxga.nnx_train_step(loss, "auto", has_aux=True, memory_budget="1GiB")
        auto(model, optimizer, batch, rngs=rngs)


class GemmaLike(nnx.Module):
    """As Flax's Gemma example lays itself out: FSDP × tensor parameters, and activations
    annotated with the batch's own axis ("fsdp"), which no shard_map over it can keep."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Param(init(rngs.params(), (8, 16)), out_sharding=("fsdp", "tensor"))
        self.down = nnx.Param(init(rngs.params(), (16, 6)), out_sharding=("tensor", None))

    def __call__(self, x):
        h = jnp.einsum("btd,df->btf", x, self.up, out_sharding=P("fsdp", None, "tensor"))
        return jnp.einsum("btf,fv->btv", jnp.tanh(h), self.down, out_sharding=P("fsdp"))


def test_a_model_naming_the_batch_axis_trains_in_the_global_view():
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"))  # Explicit axes, as Gemma's example
    rng = np.random.default_rng(6)
    batch = {
        "x": rng.normal(size=(32, 5, 8)).astype(np.float32),
        "y": rng.integers(0, 6, size=(32, 5)),
        "mask": (rng.uniform(size=(32, 5)) > 0.4).astype(np.float32),
    }

    def loss(model, batch):
        logits = model(batch["x"])
        mean = jaxga.token_cross_entropy(logits, batch["y"], batch["mask"])
        return mean, {"per_sample": jnp.sum(logits, axis=(1, 2))}  # a row per example

    def build():
        model = GemmaLike(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(0.02), wrt=nnx.Param)

    with jax.set_mesh(mesh):
        want_model, want_opt = nnx.jit(build)()
        want = jaxga.nnx_train_step(loss, 1, has_aux=True, aux="rows")(want_model, want_opt, batch)
        model, optimizer = nnx.jit(build)()
    kwargs = {"mesh": mesh, "axis_name": "fsdp", "has_aux": True, "aux": "rows"}
    with pytest.raises(Exception) as error:  # in a shard_map over "fsdp": JAX refuses
        jaxga.nnx_train_step(loss, K, **kwargs)(model, optimizer, batch)
    assert "reduce_once=False" in " ".join(getattr(error.value, "__notes__", ()))
    got = jaxga.nnx_train_step(loss, K, reduce_once=False, **kwargs)(model, optimizer, batch)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=2e-6)
    np.testing.assert_allclose(got["aux"]["per_sample"], want["aux"]["per_sample"], rtol=2e-5)
    for g, w in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(want_model))):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
    assert model.up[...].sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp", "tensor")), 2)


def test_reduce_once_is_checked():
    _, _, step_loss = linen_setup()
    mesh = mesh_of("explicit")
    with pytest.raises(TypeError, match="`reduce_once` must be a bool; got 'no'"):
        jaxga.make_train_step(step_loss, K, mesh=mesh, reduce_once="no")
    params, batch, _ = linen_setup()
    state = jaxga.TrainState.create(params=params, tx=optax.sgd(0.1))
    step = jaxga.make_train_step(step_loss, K, mesh=mesh, strategy="zero3", reduce_once=False)
    with pytest.raises(ValueError, match=r"'zero3' gathers in every micro-batch .* reduce_once"):
        step(state, batch)
    with pytest.raises(TypeError, match="`reduce_once` must be a bool"):
        jaxga.nnx_train_step(nnx_loss, K, reduce_once=1)


@pytest.mark.parametrize("aux", [{"rows": "rows", "mean": None}, None])
def test_aux_and_keywords_come_back_alike_on_every_route(aux):
    """Named rows and a Mean: the same shapes and values in jaxga's shard_map and in jit's
    global view; a string keyword stays a string. Stacked (the default), each call of the
    loss's: `[devices · k, ...]` in the shard_map, device-major, `[k, ...]` in the global
    view, the same rows once each is merged back."""
    mesh = mesh_of("explicit")
    host_params, host_batch = host_data()

    def with_aux(params, batch, *, mode):
        assert mode == "train"  # a Python value, not traced
        mean = loss(params, batch)
        h = jnp.tanh(batch["x"] @ params["a"] + params["bias"])
        return mean, {"rows": jnp.sum(h, axis=1), "mean": mean}

    with jax.set_mesh(mesh):
        params, batch = place(mesh, host_params, host_batch)
        outs = [
            jax.jit(
                jaxga.value_and_grad(with_aux, has_aux=True, num_microbatches=K, aux=aux, **route),
                static_argnames="mode",
            )(params, batch, mode="train")
            for route in ({}, {"axis_name": ()})
        ]
    (_, opened), _ = outs[0]
    (_, global_view), _ = outs[1]
    if aux is None:  # device d's micro-batch i at d * k + i: its rows, merged, are d's
        devices = mesh.shape["data"]
        assert opened["rows"].shape == (devices * K, 64 // (devices * K))
        per_device = opened["rows"].reshape(devices, K, -1)
        opened["rows"] = jnp.concatenate([jaxga.merge_microbatches(d) for d in per_device])
        global_view["rows"] = jaxga.merge_microbatches(global_view["rows"])
    for a, b in zip(jax.tree.leaves(opened), jax.tree.leaves(global_view)):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
