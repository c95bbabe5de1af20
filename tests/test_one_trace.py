"""The loss traced once per compile; each aux leaf combined as said; the hints a port meets.

Every number is checked against the same loss run without jaxga: `jax.value_and_grad` on
the whole batch, or a Python loop over `split_microbatches`' micro-batches.
"""

import functools

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.experimental import checkify
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxga

K = 4


@pytest.fixture(autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def data(rows: int = 16):
    x = jax.random.normal(jax.random.key(0), (rows, 3))
    y = jax.random.normal(jax.random.key(1), (rows,))
    return jnp.array([0.5, -1.0, 2.0]), x, y


def counted(fun):
    calls = []

    @functools.wraps(fun)
    def wrapper(*args):
        calls.append(1)
        return fun(*args)

    return wrapper, calls


def loss_and_aux(w, x, y):
    err = x @ w - y
    return jaxga.Mean.of(err**2), {"err": err, "max": jnp.max(err), "mse": jaxga.Mean.of(err**2)}


def explicit_device_batch(x, y):
    mesh = jax.make_mesh((8,), ("data",))
    where = NamedSharding(mesh, P("data"))
    return jax.device_put(x, where), jax.device_put(y, where)


@pytest.mark.parametrize("has_aux", [False, True])
@pytest.mark.parametrize("num_real", [None, 3])
@pytest.mark.parametrize("route", ["local", "opened"])
def test_the_loss_is_traced_once_per_compile(has_aux, num_real, route):
    w, x, y = data(32)
    xs, ys = explicit_device_batch(x, y) if route == "opened" else (x, y)  # opened: Explicit
    fun = loss_and_aux if has_aux else (lambda w, x, y: loss_and_aux(w, x, y)[0])
    fun, calls = counted(fun)
    options = {"num_microbatches": K, "num_real_microbatches": num_real, "batch_argnums": (1, 2)}
    out = jax.jit(jaxga.value_and_grad(fun, has_aux=has_aux, **options))(w, xs, ys)
    assert len(calls) == 1
    value = out[0][0] if has_aux else out[0]
    if num_real is None:  # and exact
        want = jax.value_and_grad(lambda w: loss_and_aux(w, x, y)[0].value)(w)
        chex.assert_trees_all_close((value, out[1]), want, rtol=1e-5)


def test_the_train_steps_trace_the_loss_once():
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def loss(model, batch):
        pred = model(batch["x"])[:, 0]
        return jaxga.Mean.of((pred - batch["y"]) ** 2), {"pred": pred}

    fun, calls = counted(loss)
    step = jaxga.nnx_train_step(fun, K, has_aux=True, aux="rows")
    _, x, y = data()
    metrics = step(model, optimizer, {"x": x, "y": y}, 2)
    assert len(calls) == 1 and metrics["aux"]["pred"].shape == (16,)


def per_micro_of(fun, k, *batches):
    """The Python loop: `fun` on each of the `k` micro-batches of `batches`."""
    parts = [jaxga.split_microbatches(b, k) for b in batches]
    return [fun(*(p[i] for p in parts)) for i in range(k)]


def test_each_aux_leaf_combines_as_its_kind_says():
    w, x, y = data()

    def fun(w, x, y):
        err = x @ w - y
        return jnp.mean(err**2), {"err": err, "cum": jnp.cumsum(err), "sq": jnp.sum(err**2)}

    kinds = {"err": "rows", "cum": "stack", "sq": "sum"}
    options = {"has_aux": True, "num_microbatches": K, "batch_argnums": (1, 2)}
    vg = jax.jit(jaxga.value_and_grad(fun, aux=kinds, **options))
    (_, aux), _ = vg(w, x, y)
    micro = per_micro_of(lambda x, y: fun(w, x, y)[1], K, x, y)
    chex.assert_trees_all_close(aux["err"], fun(w, x, y)[1]["err"], rtol=1e-6)  # the batch's rows
    chex.assert_trees_all_close(aux["cum"], jnp.stack([m["cum"] for m in micro]), rtol=1e-6)
    chex.assert_trees_all_close(aux["sq"], sum(m["sq"] for m in micro), rtol=1e-6)
    # unnamed, every leaf is stacked: no leaf is taken for rows by its size
    (_, default), _ = jaxga.value_and_grad(fun, **options)(w, x, y)
    assert default["cum"].shape == default["err"].shape == (K, 4) and default["sq"].shape == (K,)


def test_a_loss_valid_only_at_micro_batch_size_runs():
    """No whole-batch trace: a reshape to the micro-batch's own size is fine."""
    w, x, y = data()

    def fun(w, x, y):
        err = (x @ w - y).reshape(K, 1)  # 4 rows: a micro-batch's, not the batch's 16
        return jnp.mean(err**2), err[:, 0]

    options = {"num_microbatches": K, "batch_argnums": (1, 2), "aux": "rows"}
    (value, aux), grads = jaxga.value_and_grad(fun, has_aux=True, **options)(w, x, y)
    want = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    chex.assert_trees_all_close((value, grads), want, rtol=1e-5)
    chex.assert_trees_all_close(aux, x @ w - y, rtol=1e-6)


def test_aux_kinds_are_checked_and_named():
    w, x, y = data()
    with pytest.raises(ValueError, match=r"`aux\['err'\]` must be None or a tree of kinds"):
        jaxga.value_and_grad(loss_and_aux, has_aux=True, num_microbatches=K, aux={"err": "cat"})
    bad_prefix = jaxga.value_and_grad(
        loss_and_aux, has_aux=True, num_microbatches=K, batch_argnums=(1, 2), aux=["rows"]
    )
    with pytest.raises(ValueError, match=r"`aux` kinds \['rows'\] must be a prefix of aux"):
        bad_prefix(w, x, y)
    not_rows = jaxga.value_and_grad(
        loss_and_aux,
        has_aux=True,
        num_microbatches=K,
        batch_argnums=(1, 2),
        aux={"err": None, "max": "rows", "mse": None},
    )
    with pytest.raises(TypeError, match=r"aux\['max'\] of shape \(\) .*: a 'rows' leaf needs"):
        not_rows(w, x, y)


def test_aux_kinds_on_an_opened_route_are_the_whole_batchs():
    """8 devices of 4 rows, 2 micro-batches each: rows in the batch's order, sums over all."""
    w, x, y = data(32)

    def fun(w, x, y):
        err = x @ w - y
        return jaxga.Mean.of(err**2), {"err": err, "max": jnp.max(err), "sq": jnp.sum(err**2)}

    kinds = {"err": "rows", "max": "stack", "sq": "sum"}
    options = {"has_aux": True, "num_microbatches": 2, "batch_argnums": (1, 2), "aux": kinds}
    (value, aux), grads = jax.jit(jaxga.value_and_grad(fun, **options))(
        w, *explicit_device_batch(x, y)
    )
    # the Python loop: device d holds rows 4d..4d+3; its micro-batch i, rows i and i + 2
    devices = [
        per_micro_of(lambda x, y: fun(w, x, y)[1], 2, x[4 * d : 4 * d + 4], y[4 * d : 4 * d + 4])
        for d in range(8)
    ]
    want = jax.value_and_grad(lambda w: fun(w, x, y)[0].value)(w)
    chex.assert_trees_all_close((value, grads), want, rtol=1e-5)
    chex.assert_trees_all_close(aux["err"], x @ w - y, rtol=1e-6)
    maxima = jnp.array([micro[i]["max"] for micro in devices for i in range(2)])
    chex.assert_trees_all_close(aux["max"], maxima, rtol=1e-6)  # [devices · k], device-major
    chex.assert_trees_all_close(aux["sq"], jnp.sum((x @ w - y) ** 2), rtol=1e-5)


class EqxModel(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, key):
        self.linear = eqx.nn.Linear(3, 4, key=key)
        self.norm = eqx.nn.BatchNorm(4, axis_name="batch", mode="batch")

    def __call__(self, x, state):
        return self.norm(self.linear(x), state)


def split_xy(x, y):
    return jaxga.split_microbatches(x, K), jaxga.split_microbatches(y, K)


def eqx_loss(model, state, x, y):  # Equinox's stateful.ipynb: (loss, new state)
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    pred, state = batched(x, state)
    return jnp.mean((pred[:, 0] - y) ** 2), state


def test_equinox_state_goes_through_state_argnums():
    """State threaded through `state_argnums`; returned as aux, it is aux: no shape tells."""
    model, state = eqx.nn.make_with_state(EqxModel)(jax.random.key(0))
    _, x, y = data()
    options = {"num_microbatches": K, "batch_argnums": (2, 3)}
    as_aux = eqx.filter_jit(jaxga.value_and_grad(eqx_loss, has_aux=True, **options))
    (_, stacked), _ = as_aux(model, state, x, y)  # each micro-batch's, from the first state
    firsts = [eqx_loss(model, state, xi, yi)[1] for xi, yi in zip(*split_xy(x, y))]
    chex.assert_trees_all_close(stacked, jax.tree.map(lambda *s: jnp.stack(s), *firsts), rtol=1e-5)
    both = jaxga.value_and_grad(eqx_loss, has_aux=True, state_argnums=1, **options)
    with pytest.raises(
        TypeError, match=r"must return \(\(value, aux\), new_state\).*has_aux=False"
    ):
        eqx.filter_jit(both)(model, state, x, y)
    vg = eqx.filter_jit(jaxga.value_and_grad(eqx_loss, state_argnums=1, **options))
    (value, grads), new_state = vg(model, state, x, y)
    # the Python loop: each micro-batch starts from the state the one before returned
    total, summed, threaded = 0.0, None, state
    for xi, yi in zip(*split_xy(x, y)):
        (v, threaded), g = eqx.filter_value_and_grad(eqx_loss, has_aux=True)(
            model, threaded, xi, yi
        )
        total, summed = total + v, g if summed is None else jax.tree.map(jnp.add, summed, g)
    chex.assert_trees_all_close(value, total / K, rtol=1e-5)
    want = jax.tree.map(lambda g: g / K, summed)
    chex.assert_trees_all_close(grads, want, rtol=1e-5, atol=1e-6)  # the bias's: BatchNorm's 0
    chex.assert_trees_all_close(new_state, threaded, rtol=1e-6)


def test_arrays_of_the_batch_read_from_outside_the_arguments_are_named():
    """Gemma's step builds its attention mask from the batch outside the loss."""
    w, x, y = data()
    mask = (jnp.arange(16) % 3 > 0).astype(jnp.float32)  # the batch's 16 rows, not split

    def fun(w, x, y):
        return jnp.mean(mask * (x @ w - y) ** 2)

    with pytest.raises(TypeError) as info:
        jaxga.value_and_grad(fun, num_microbatches=K, batch_argnums=(1, 2))(w, x, y)
    assert "reads arrays of the batch's 16 rows whole, from outside its arguments: mask" in str(
        info.value.__notes__
    )
    with pytest.raises(TypeError) as info:  # a partial's argument too
        partial = functools.partial(lambda mask, w, x, y: jnp.mean(mask * (x @ w - y)), mask)
        jaxga.value_and_grad(partial, num_microbatches=K, batch_argnums=(1, 2))(w, x, y)
    assert "partial args[0]" in str(info.value.__notes__)


def test_jaxgas_own_keywords_given_to_the_call_are_sent_back():
    w, x, y = data()
    options = {"num_microbatches": K, "batch_argnums": (1, 2)}
    vg = jaxga.value_and_grad(lambda w, x, y: jnp.mean(x @ w - y), **options)
    with pytest.raises(TypeError, match=r"\['num_real_microbatches'\].*jaxga.value_and_grad"):
        vg(w, x, y, num_real_microbatches=2)
    takes_it = jaxga.value_and_grad(  # a loss that takes the keyword itself gets it
        lambda w, x, y, aux=1.0: jnp.mean(x @ w - y) * aux, **options
    )
    chex.assert_trees_all_close(takes_it(w, x, y, aux=2.0)[0], 2 * jnp.mean(x @ w - y), rtol=1e-6)


def test_a_batch_given_by_keyword_is_asked_for_by_position():
    w, x, _ = data()
    grad_fn = jaxga.grad(lambda w, batch: jnp.mean(batch @ w), num_microbatches=K)
    with pytest.raises(ValueError, match=r"got 1 arguments\. Pass the batch.*not by keyword"):
        grad_fn(w, batch=x)


@pytest.mark.parametrize("reduction", ["mean", "max"])
def test_state_reduction_over_devices_is_an_argument(reduction):
    """Threaded state, replicated again after the loop: averaged (the default) or as given."""
    mesh = jax.make_mesh((8,), ("data",))
    w, x, y = data(64)

    def fun(w, x, y, seen):  # the state: the largest error seen, per device
        err = x @ w - y
        return jnp.mean(err**2), jnp.maximum(seen, jnp.max(err))

    given = "mean" if reduction == "mean" else (lambda s, axes: jax.lax.pmax(s, axes))
    options = {"num_microbatches": 2, "batch_argnums": (1, 2), "state_argnums": 3}
    vg = jaxga.value_and_grad(fun, axis_name="data", state_reduction=given, **options)
    specs = (P(), P("data"), P("data"), P())
    run = jax.jit(jax.shard_map(vg, mesh=mesh, in_specs=specs, out_specs=P()))
    (_, _), seen = run(w, *explicit_device_batch(x, y), jnp.float32(-10.0))
    per_device = jnp.stack(
        [jnp.max(xd @ w - yd) for xd, yd in zip(x.reshape(8, 8, 3), y.reshape(8, 8))]
    )
    want = jnp.mean(per_device) if reduction == "mean" else jnp.max(per_device)
    chex.assert_trees_all_close(seen, want, rtol=1e-5)
    with pytest.raises(TypeError, match=r"`state_reduction` must be callable as"):
        jaxga.value_and_grad(fun, state_reduction="sum", **options)


def test_bad_counts_raise_where_read_and_are_nan_and_checkified_where_traced():
    """The rule (docs/architecture.md): read, it raises; traced, NaN, and checkify says why."""
    state = jaxga.TrainState.create(params=jnp.ones(3), tx=optax.sgd(0.1))
    step = jaxga.make_train_step(lambda p, b, s, r: (jnp.mean(b @ p), s), 2)
    with pytest.raises(ValueError, match=r"`num_real_microbatches` must be in 1..2.*got 0"):
        step(state, jnp.ones((4, 3)), jnp.int32(0))  # an array, not traced: read

    def run(n):  # n traced
        def mean(w, x):
            return jnp.mean(w * x)

        vg = jaxga.value_and_grad(mean, num_microbatches=2, num_real_microbatches=n)
        return vg(1.0, jnp.ones(4))

    assert jnp.isnan(jax.jit(run)(0)[0])
    with jaxga.checkify_values():  # a new function: `run`'s trace above has no checks
        error, _ = checkify.checkify(jax.jit(lambda n: run(n)))(0)
    assert "`num_real_microbatches` must be in 1..2 (num_microbatches); got 0" in error.get()

    def negative(w, x):
        return jaxga.Mean(jnp.sum(w * x), -jnp.sum(x))

    vg = jaxga.value_and_grad(negative, num_microbatches=2)
    with pytest.raises(ValueError, match=r"counts summed to -4.0 items"):
        vg(1.0, jnp.ones(4))
    assert all(jnp.isnan(v) for v in jax.jit(vg)(1.0, jnp.ones(4)))  # never a plausible number
    with jaxga.checkify_values():
        error, _ = checkify.checkify(jax.jit(lambda w, x: vg(w, x)))(1.0, jnp.ones(4))
    assert "Mean counts summed to -4.0 items" in error.get()
