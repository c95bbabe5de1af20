"""Aux that means the same at every k (issue 46): each leaf combines as its kind is named,
never as its sizes suggest; the default reads no shapes (a `Mean` summed, any other leaf
stacked, `[k, ...]`, k = 1 too).

Every value is checked against plain JAX on the whole batch (or on the rows `i::k` that
micro-batch `i` holds, for a stacked leaf), never against jaxga's own split or merge.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxga

ROWS, FEATURES, CLASSES, BINS = 8, 5, 3, 4
RTOL, ATOL = 1e-5, 1e-6  # float32: a micro-batch's matmul against the whole batch's
NAMED = {"hist": "sum", "scalar": "stack", "logits": "rows", "mean": None}  # None: default


@pytest.fixture(autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def outputs(logits):
    """The aux of a batch's (or a micro-batch's) logits: a histogram, a scalar, the logits
    themselves (a row per example) and a `Mean`."""
    y = logits[:, 0]
    hist = jnp.histogram(y, bins=BINS, range=(-3.0, 3.0))[0].astype(jnp.float32)
    mean = jaxga.Mean(jnp.sum(y), jnp.float32(y.shape[0]))
    return {"hist": hist, "scalar": jnp.max(y), "logits": logits, "mean": mean}


def loss(w, x):
    logits = x @ w
    return jnp.mean(logits**2), outputs(logits)


def data(rows=ROWS):
    w = jax.random.normal(jax.random.key(0), (FEATURES, CLASSES))
    return w, jax.random.normal(jax.random.key(1), (rows, FEATURES))


def aux_of(k, aux=None, rows=ROWS):
    w, x = data(rows)
    (_, got), _ = jaxga.value_and_grad(loss, has_aux=True, num_microbatches=k, aux=aux)(w, x)
    return got


def ranks(tree):
    return jax.tree.structure(tree), jax.tree.map(jnp.ndim, tree)


def assert_whole_batchs(got, w, x):
    """The kinds that claim the whole batch's value have it: plain JAX on the whole batch."""
    whole = outputs(x @ w)
    np.testing.assert_array_equal(got["hist"], whole["hist"])  # counts: exact
    np.testing.assert_allclose(got["logits"], whole["logits"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got["mean"].value, whole["mean"].value, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got["mean"].count, x.shape[0])


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_each_leaf_combines_as_named_at_every_k(k):
    w, x = data()
    got = aux_of(k, NAMED)
    assert_whole_batchs(got, w, x)
    maxima = [jnp.max((x[i::k] @ w)[:, 0]) for i in range(k)]  # micro-batch i: rows i::k
    np.testing.assert_allclose(got["scalar"], jnp.stack(maxima), rtol=RTOL, atol=ATOL)
    assert ranks(got) == ranks(aux_of(1, NAMED))


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_the_default_stacks_every_leaf_but_a_mean_at_every_k(k):
    """`[k, ...]` at k = 1 too: the same structure and rank at every k; no leaf is taken for
    rows because its leading axis happens to equal a micro-batch's rows (at k = 2 the
    histogram's 4 bins do)."""
    w, x = data()
    got = aux_of(k)
    shapes = jax.tree.map(jnp.shape, got)
    assert shapes == {
        "hist": (k, BINS),
        "scalar": (k,),
        "logits": (k, ROWS // k, CLASSES),
        "mean": jaxga.Mean((), ()),
    }
    assert ranks(got) == ranks(aux_of(1))
    for i in range(k):
        part = outputs(x[i::k] @ w)
        np.testing.assert_array_equal(got["hist"][i], part["hist"])
        np.testing.assert_allclose(got["logits"][i], part["logits"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got["mean"].value, outputs(x @ w)["mean"].value, rtol=RTOL)


def test_a_leaf_that_cannot_be_its_kind_is_refused_with_its_path_and_the_kinds():
    with pytest.raises(TypeError, match=r"aux\['hist'\] of shape \(4,\).*'rows'.*Kinds: 'sum'"):
        aux_of(4, {**NAMED, "hist": "rows"})  # 2 rows a micro-batch, 4 bins
    with pytest.raises(TypeError, match=r"aux\['scalar'\] of shape \(\).*'rows' leaf needs"):
        aux_of(2, {**NAMED, "scalar": "rows"})
    with pytest.raises(TypeError, match=r"aux\['mean'\] .*'rows' leaf needs"):
        aux_of(2, {**NAMED, "mean": "rows"})
    with pytest.raises(ValueError, match=r"`aux\['hist'\]` must be None or a tree of kinds"):
        aux_of(2, {**NAMED, "hist": "auto"})  # the shape-reading default is gone
    with pytest.raises(ValueError, match=r"`aux` kinds \['rows'\] must be a prefix of aux"):
        aux_of(2, ["rows"])


def test_an_aux_shaped_as_an_argument_is_aux():
    """`loss(w, x, cfg)` returning a dict shaped as `cfg`: not mistaken for new state."""
    w, x = data()
    cfg = {"scale": jnp.float32(2.0)}

    def scaled(w, x, cfg):
        y = (x @ w)[:, 0] * cfg["scale"]
        return jnp.mean(y**2), {"scale": cfg["scale"] * jnp.mean(y)}

    for aux, k in ((None, 4), ("stack", 1)):
        vg = jaxga.value_and_grad(scaled, has_aux=True, num_microbatches=k, aux=aux)
        (_, got), _ = vg(w, x, cfg)
        want = [scaled(w, x[i::k], cfg)[1]["scale"] for i in range(k)]
        np.testing.assert_allclose(got["scale"], jnp.stack(want), rtol=RTOL, atol=ATOL)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(FEATURES, 1024, rngs=rngs)  # activations a smaller k shrinks
        self.out = nnx.Linear(1024, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


def nnx_loss(model, x):
    logits = model(x)
    return jnp.mean(logits**2), outputs(logits)


def test_auto_gives_the_same_aux_whichever_k_it_plans():
    """Two budgets that plan different k: the same structure and rank, the named kinds the
    whole batch's (the model does not move: a learning rate of 0)."""
    x = data(64)[1]
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    options = {"has_aux": True, "aux": NAMED}
    peaks = {
        k: jaxga.memory_report(jaxga.nnx_train_step(nnx_loss, k, **options), model, optimizer, x)
        for k in (1, 2, 4, 8)
    }
    peaks = {k: report.peak_bytes for k, report in peaks.items()}
    fewer = min(k for k in peaks if peaks[k] < peaks[1])  # the peak falls, at these shapes
    got = {}
    for budget in (peaks[1], peaks[fewer]):
        step = jaxga.nnx_train_step(nnx_loss, "auto", memory_budget=budget, **options)
        aux = step(model, optimizer, x)["aux"]
        got[step.plan.num_microbatches] = aux
    assert sorted(got) == [1, fewer]
    whole = outputs(model(x))
    for k, aux in got.items():
        assert ranks(aux) == ranks(got[1])
        np.testing.assert_array_equal(aux["hist"], whole["hist"])
        np.testing.assert_allclose(aux["logits"], whole["logits"], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(aux["mean"].value, whole["mean"].value, rtol=RTOL, atol=ATOL)
        assert aux["scalar"].shape == (k,)
        np.testing.assert_allclose(jnp.max(aux["scalar"]), jnp.max(whole["logits"][:, 0]))


def on_devices(x):
    mesh = jax.make_mesh((8,), ("data",))
    return mesh, jax.device_put(x, NamedSharding(mesh, P("data")))


@pytest.mark.parametrize("k", [1, 2])
def test_on_devices_rows_and_sums_are_the_whole_batchs_and_stacks_each_devices(k):
    """8 devices of 4 rows, on the route jaxga opens (a shard_map over the batch's axis) and
    inside a user's own shard_map (`axis_name=`): the same aux once the user's out_specs
    concatenate the devices' rows and stacks and the user sums the sums. A stack is one
    entry per call of the loss, device-major: `[devices · k, ...]`."""
    w, x = data(32)
    mesh, placed = on_devices(x)
    vg = jaxga.value_and_grad(loss, has_aux=True, num_microbatches=k, aux=NAMED)
    (_, opened), _ = jax.jit(vg)(w, placed)
    assert_whole_batchs(opened, w, x)
    maxima = [jnp.max((x[4 * d : 4 * d + 4][i::k] @ w)[:, 0]) for d in range(8) for i in range(k)]
    np.testing.assert_allclose(opened["scalar"], jnp.stack(maxima), rtol=RTOL, atol=ATOL)

    def local(w, x):  # the manual route: this device's aux
        (_, aux), _ = jaxga.value_and_grad(
            loss, has_aux=True, num_microbatches=k, aux=NAMED, axis_name="data"
        )(w, x)
        sums = {"hist": aux["hist"][None], "mean": jax.tree.map(lambda y: y[None], aux["mean"])}
        return {**aux, **sums}

    manual = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
    )
    manual = manual(w, placed)
    manual = {
        **manual,
        "hist": manual["hist"].sum(0),
        "mean": jax.tree.map(jnp.sum, manual["mean"]),
    }
    chex.assert_trees_all_close(manual, opened, rtol=RTOL, atol=ATOL)
    (_, default), _ = jax.jit(jaxga.value_and_grad(loss, has_aux=True, num_microbatches=k))(
        w, placed
    )
    assert ranks(default) == ranks(aux_of(1))  # the same rank as on one device
    assert default["logits"].shape == (8 * k, 4 // k, CLASSES)


def test_nnx_train_step_on_a_mesh_gives_the_batchs_rows():
    x = data(32)[1]
    mesh = jax.make_mesh((8,), ("data",))
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    whole = outputs(model(x))
    step = jaxga.nnx_train_step(nnx_loss, 2, has_aux=True, aux=NAMED, mesh=mesh)
    aux = step(model, optimizer, x)["aux"]
    np.testing.assert_array_equal(aux["hist"], whole["hist"])
    np.testing.assert_allclose(aux["logits"], whole["logits"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(aux["mean"].value, whole["mean"].value, rtol=RTOL, atol=ATOL)
    assert aux["scalar"].shape == (8 * 2,)
