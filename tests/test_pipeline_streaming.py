"""A pipeline's stack streamed from host memory: `jaxga.pipeline_loss(..., stream=True)`.

Each stage keeps its layers in its host memory (``pinned_host``, laid out over the stage
axis), fetches one at a time, and its 1F1B (or interleaved 1F1B) backward passes add each
layer's gradient to a sum kept there. The references: the same pipeline with the stack on
the device, and `jax.value_and_grad` of the whole batch through a plain layer scan on one
device. Both to float32 rounding: copies between memories change no bit, but the streamed
layers are compiled in loops of their own, and the tests' XLA
(``--xla_backend_optimization_level=0``, tests/conftest.py) rounds another program's
element-wise code in its own way (a loss 1 ulp apart, seen; equal with XLA's default
optimisation).
"""

import functools

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
from tests.test_pipeline import D, head_fn, layer, stack
from tests.test_pipeline import skewed_batch as batch_of


@pytest.fixture(autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def dropped(p, x, key):  # a layer with a key: each layer and micro-batch its own mask
    keep = jax.random.bernoulli(key, 0.8, x.shape)
    return jnp.where(keep, layer(p, x) / 0.8, 0.0)


HEAD = np.random.default_rng(3).normal(size=(D, 5)).astype(np.float32)


def on_stages(params, mesh, memory_kind="device", repeats=1):
    stages = mesh.shape["stage"]
    ordered = jaxga.pipeline_order(jax.tree.map(jnp.asarray, params), stages, repeats)
    return jax.device_put(ordered, NamedSharding(mesh, P("stage"), memory_kind=memory_kind))


def assert_rounding_close(got, want, atol=1e-7):  # a few float32 ulps
    chex.assert_trees_all_close(jax.device_get(got), jax.device_get(want), rtol=1e-6, atol=atol)


def kinds(tree) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


@pytest.mark.parametrize("stages, m", [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_a_streamed_stack_gives_the_resident_pipelines_loss_and_gradients(stages, m):
    mesh = jax.make_mesh((stages,), ("stage",), devices=jax.devices()[:stages])
    batch = batch_of(4 * m)

    def loss(params, head, stream):
        options = {"num_microbatches": m, "schedule": "1f1b", "stream": stream}
        return jaxga.pipeline_loss(layer, head_fn, (params, head), batch["x"], batch, **options)

    def value_and_grad(params, stream):
        def value(params, head):
            return loss(params, head, stream).value

        return jax.jit(jax.value_and_grad(value, argnums=(0, 1)))(params, HEAD)

    resident = value_and_grad(on_stages(stack(), mesh), False)
    streamed = value_and_grad(on_stages(stack(), mesh, "pinned_host"), True)
    assert_rounding_close(streamed, resident)
    assert kinds(streamed[1][0]) == {"pinned_host"}  # the stack's gradient where it lies

    def reference(params, head):
        return head_fn(head, jaxga.remat_scan(layer, params, batch["x"]), batch).value

    want = jax.value_and_grad(reference, argnums=(0, 1))(stack(), HEAD)
    want = (want[0], (jaxga.pipeline_order(want[1][0], stages, 1), want[1][1]))
    chex.assert_trees_all_close(jax.device_get(streamed), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stages, m, keyed", [(2, 2, False), (2, 4, True), (4, 4, False)])
def test_interleaved_1f1b_streams_each_chunk_of_a_stages_layers(stages, m, keyed):
    """schedule="interleaved_1f1b" with r = 2 chunks a stage and stream=True: each tick
    fetches its chunk's layers at their offset into the stage's stack in host memory, and
    adds their gradients to the stage's sums there. The resident interleaved pipeline's
    loss and gradients (with a key per layer and micro-batch too), to float32 rounding; and
    `jax.value_and_grad` of the whole batch through one layer scan."""
    mesh = jax.make_mesh((stages,), ("stage",), devices=jax.devices()[:stages])
    batch, key = batch_of(4 * m), jax.random.key(5) if keyed else None

    def value(params, head, stream):
        options = {"num_microbatches": m, "schedule": "interleaved_1f1b", "repeats": 2}
        options |= {"stream": stream, "rng": key}
        fn = dropped if keyed else layer
        return jaxga.pipeline_loss(fn, head_fn, (params, head), batch["x"], batch, **options).value

    value_and_grad = jax.jit(jax.value_and_grad(value, argnums=(0, 1)), static_argnums=2)
    resident = value_and_grad(on_stages(stack(), mesh, repeats=2), HEAD, False)
    streamed = value_and_grad(on_stages(stack(), mesh, "pinned_host", 2), HEAD, True)
    assert_rounding_close(streamed, resident)
    assert kinds(streamed[1][0]) == {"pinned_host"}
    assert streamed[1][0]["w"].sharding.spec[0] == "stage"
    if keyed:
        return

    def reference(params, head):
        return head_fn(head, jaxga.remat_scan(layer, params, batch["x"]), batch).value

    want = jax.value_and_grad(reference, argnums=(0, 1))(stack(), HEAD)
    want = (want[0], (jaxga.pipeline_order(want[1][0], stages, 2), want[1][1]))
    chex.assert_trees_all_close(jax.device_get(streamed), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("where", ["device", "mixed"])
def test_stream_takes_a_stack_on_the_device_or_partly_there(where):
    """stream=True with the stack on the device, or ``b`` there and ``w`` in host memory:
    each leaf's sum starts at zeros where it lies (a review found a device leaf's sum
    starting at the parameters)."""
    mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    batch = batch_of(8)
    params = on_stages(stack(), mesh)
    if where == "mixed":
        params["w"] = on_stages(stack(), mesh, "pinned_host")["w"]

    def value(params, stream):
        options = {"num_microbatches": 2, "stream": stream}
        return jaxga.pipeline_loss(
            layer, head_fn, (params, HEAD), batch["x"], batch, **options
        ).value

    grad = jax.jit(jax.grad(value), static_argnums=1)
    streamed, resident = grad(params, True), grad(on_stages(stack(), mesh), False)
    assert_rounding_close(streamed, resident)
    assert kinds(streamed["w"]) == ({"pinned_host"} if where == "mixed" else {"device"})


@pytest.mark.parametrize("k", [1, 2])
def test_jaxga_value_and_grad_takes_a_streamed_pipeline_in_jits_global_view(k):
    """jaxga.value_and_grad of a streamed pipeline's loss, in jit's global view: the
    accumulation's sums of the stack made in host memory split by stage as the stack is
    (a review found them unsplit, and the addition failing deep in JAX); the whole batch's
    loss and gradients."""
    mesh = jax.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    batch = batch_of(32)

    def loss(params, head, batch):
        options = {"num_microbatches": 4, "stream": True}
        return jaxga.pipeline_loss(layer, head_fn, (params, head), batch["x"], batch, **options)

    step = jaxga.value_and_grad(loss, argnums=(0, 1), batch_argnums=2, num_microbatches=k)
    host = on_stages(stack(), mesh, "pinned_host")
    value, grads = jax.jit(step)(host, HEAD, batch)
    assert kinds(grads[0]) == {"pinned_host"}
    assert grads[0]["w"].sharding.spec[0] == "stage"

    def reference(params, head):
        return head_fn(head, jaxga.remat_scan(layer, params, batch["x"]), batch).value

    want_value, want = jax.value_and_grad(reference, argnums=(0, 1))(stack(), HEAD)
    want = (jaxga.pipeline_order(want[0], 4, 1), want[1])
    assert_rounding_close((value, grads), (want_value, want))


def test_keys_an_embedding_and_a_remat_policy_stream_as_the_resident_pipeline():
    """With ``rng`` (each layer and micro-batch its own key), ``embed_fn`` (token ids in,
    its gradient summed on stage 0) and policy "dots": streamed equals resident."""
    mesh = jax.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    batch = batch_of(32)
    ids = np.random.default_rng(5).integers(0, 11, size=32)
    table = np.random.default_rng(6).normal(size=(11, D)).astype(np.float32)

    def embed(table, ids):
        return table[ids]

    def grads(params, stream):
        def value(params, head, table):
            options = {"num_microbatches": 8, "stream": stream, "embed_fn": embed}
            options |= {"rng": jax.random.key(7), "policy": "dots"}
            triple = (params, head, table)
            return jaxga.pipeline_loss(dropped, head_fn, triple, ids, batch, **options).value

        return jax.jit(jax.value_and_grad(value, argnums=(0, 1, 2)))(params, HEAD, table)

    resident = grads(on_stages(stack(), mesh), False)
    streamed = grads(on_stages(stack(), mesh, "pinned_host"), True)
    assert_rounding_close(streamed, resident)
    assert float(jnp.abs(streamed[1][2]).sum()) > 0  # the embedding got its gradient


@pytest.mark.parametrize(
    "k, stream, every, repeats",
    [
        (1, True, 1, 1),
        (2, True, 1, 1),
        (1, "layers", 1, 1),
        (2, "layers", 1, 1),
        (2, "layers", 2, 1),
        (2, "layers", 1, 2),  # interleaved 1F1B, 2 chunks a stage
    ],
)
def test_a_pipelined_train_step_streams_each_stages_layers(k, stream, every, repeats):
    """make_train_step(stream=True | "layers", pipeline_axis="stage", offload=True) on a
    ("data", "stage") mesh, 2 steps of AdamW (or of jaxga.MultiSteps of it, every 2 calls:
    the step then zeroes the sums of a call that counted nothing, a layer at a time): the
    resident pipelined step's loss, gradient norm and parameters, to float32 rounding; the
    stack and its moments stay in host memory, split by stage; and to rounding
    `jax.value_and_grad` of the whole batch with optax on one device. With "layers" each
    device updates its own layers a layer at a time."""
    mesh = jax.make_mesh((2, 4), ("data", "stage"))
    batch = batch_of(32)
    adamw = optax.adamw(0.05, weight_decay=0.1)
    tx = adamw if every == 1 else jaxga.MultiSteps(adamw, every_k=every)

    def loss(params, batch, model_state, rng, stream):
        schedule = "1f1b" if repeats == 1 else "interleaved_1f1b"
        options = {"num_microbatches": 4, "schedule": schedule, "repeats": repeats}
        options |= {"stream": bool(stream)}
        pair = (params["stack"], params["head"])
        return jaxga.pipeline_loss(layer, head_fn, pair, batch["x"], batch, **options), model_state

    specs = {"stack": {"w": P("stage"), "b": P("stage")}, "head": P()}
    runs = {}
    for streamed in (False, stream):
        kind = "pinned_host" if streamed else "device"
        params = {"stack": on_stages(stack(), mesh, kind, repeats), "head": jnp.asarray(HEAD)}
        state = jaxga.TrainState.create(params=params, tx=tx)
        options = {"mesh": mesh, "strategy": specs, "pipeline_axis": "stage", "stream": streamed}
        step = jaxga.make_train_step(
            lambda *a, s=streamed: loss(*a, s), k, offload=bool(streamed), **options
        )
        metrics = []
        for _ in range(2):
            state, got = step(state, batch)
            metrics.append((got["loss"], got["grad_norm"]))
        runs[bool(streamed)] = (jax.device_get(state.params), jax.device_get(metrics), state)
    # AdamW divides by the root of a small second moment: an ulp of a tiny gradient moves an
    # update by up to its learning rate's ulps
    assert_rounding_close(runs[True][:2], runs[False][:2], atol=1e-6)
    state = runs[True][2]
    assert kinds(state.params["stack"]) == {"pinned_host"}
    assert state.params["stack"]["w"].sharding.spec[0] == "stage"
    leaves = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
    moments = [x for path, x in leaves if jnp.ndim(x) == 3 and ".mu" in jax.tree_util.keystr(path)]
    moments += [x for path, x in leaves if jnp.ndim(x) == 3 and ".nu" in jax.tree_util.keystr(path)]
    assert len(moments) == 2 and kinds(moments) == {"pinned_host"}  # the stack's w's

    def reference(params):
        h = jaxga.remat_scan(layer, params["stack"], batch["x"])
        return head_fn(params["head"], h, batch).value

    params = {"stack": jax.tree.map(jnp.asarray, stack()), "head": jnp.asarray(HEAD)}
    opt_state = adamw.init(params)
    for _ in range(2 // every):  # MultiSteps: one update of the two calls' equal gradients
        grads = jax.grad(reference)(params)
        updates, opt_state = adamw.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    want = {"stack": jaxga.pipeline_order(params["stack"], 4, repeats), "head": params["head"]}
    chex.assert_trees_all_close(runs[True][0], want, rtol=2e-5, atol=1e-6)


class _Staged(nnx.Module):
    """A stack laid out by stage in host memory (its variables' sharding metadata), a head."""

    def __init__(self, mesh: jax.sharding.Mesh, kind: str):
        w = jaxga.pipeline_order(jnp.asarray(stack()["w"]), mesh.shape["stage"], 1)
        self.w = nnx.Param(w, out_sharding=("stage", None, None))
        self.head = nnx.Param(jnp.asarray(HEAD))
        where = NamedSharding(mesh, P("stage"), memory_kind=kind)
        self.w.set_value(jax.device_put(self.w.get_value(), where))


@pytest.mark.parametrize("stream", [True, "layers"])
def test_nnx_train_step_streams_a_pipelined_stack(stream):
    """nnx_train_step(stream=True | "layers", pipeline_axis="stage"): two steps of 1F1B and
    Adam with the stack in host memory equal the resident steps, and the stack stays there."""
    mesh = jax.make_mesh((2, 4), ("data", "stage"))
    batch = batch_of(32)

    def loss(model, batch, stream):
        pair = (model.w[...], model.head[...])
        options = {"num_microbatches": 4, "stream": bool(stream)}
        return jaxga.pipeline_loss(
            lambda w, x: jnp.tanh(x @ w), head_fn, pair, batch["x"], batch, **options
        )

    got = {}
    for streamed in (False, stream):
        with jax.set_mesh(mesh):
            model = _Staged(mesh, "pinned_host" if streamed else "device")
            optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
        step = jaxga.nnx_train_step(
            lambda m, b, s=streamed: loss(m, b, s),
            2,
            mesh=mesh,
            pipeline_axis="stage",
            stream=streamed,
            offload=bool(streamed),  # Adam's moments of the stack are made in host memory
        )
        for _ in range(2):
            metrics = step(model, optimizer, batch)
        got[bool(streamed)] = jax.device_get((model.w[...], metrics["loss"], metrics["grad_norm"]))
        if streamed:
            assert model.w.get_value().sharding.memory_kind == "pinned_host"
    assert_rounding_close(got[True], got[False], atol=1e-6)


def test_streaming_a_pipeline_refuses_what_it_does_not_take():
    mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    batch = batch_of(8)
    host = on_stages(stack(), mesh, "pinned_host")

    def loss(params, **options):
        options = {"num_microbatches": 2} | options
        return jaxga.pipeline_loss(layer, head_fn, (params, HEAD), batch["x"], batch, **options)

    with pytest.raises(ValueError, match=r"`stream`=True with schedule='gpipe': not supported; "):
        jax.jit(lambda p: loss(p, schedule="gpipe", stream=True).value)(host)
    match = r"`stream`=True with schedule='circular': not supported; expected schedule='1f1b' or"
    with pytest.raises(ValueError, match=match):  # JAX's autodiff of its ticks: no sums
        jax.jit(lambda p: loss(p, schedule="circular", repeats=2, stream=True).value)(
            jaxga.pipeline_order(host, 2, 2)
        )
    with pytest.raises(TypeError, match=r"`stream` must be"):
        jax.jit(lambda p: loss(p, stream="yes").value)(host)
    match = r"`stacked_params`\['b'\] lives in host memory: call jaxga.pipeline_loss\(.*stream=True"
    with pytest.raises(ValueError, match=match):  # 1F1B
        jax.jit(lambda p: loss(p).value)(host)
    with pytest.raises(ValueError, match=match):  # GPipe, through pipeline_scan
        jax.jit(lambda p: jaxga.pipeline_scan(layer, p, batch["x"], num_microbatches=2))(host)

    def step_loss(params, batch, model_state, rng):
        return loss(params), model_state

    # on Auto axes the stacks' types do not say they are split: the step's division of
    # their sums would be gathered whole (an all-gather of each stack, seen in the HLO)
    auto = jax.make_mesh((1, 1), ("data", "stage"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    match = r"`stream`=True with `pipeline_axis`='stage' on an Auto axis: not supported; expected"
    for stream in (True, "layers"):
        with pytest.raises(ValueError, match=match.replace("True", repr(stream))):
            jaxga.make_train_step(step_loss, 2, mesh=auto, pipeline_axis="stage", stream=stream)
    with pytest.raises(ValueError, match=match):
        jaxga.nnx_train_step(lambda m, b: m(b), 2, mesh=auto, pipeline_axis="stage", stream=True)


def test_layerwise_refuses_stacks_laid_out_apart():
    """_host_stacks.layerwise over a stack split by stage and one that is not: each device
    would read the first layers of the other (a review's silent wrong result), so it raises."""
    from jaxga._host_stacks import layerwise

    mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    split = on_stages(stack(), mesh, "pinned_host")["b"]
    whole = jax.device_put(stack()["b"], NamedSharding(mesh, P(), memory_kind="pinned_host"))
    with pytest.raises(ValueError, match=r"layerwise: stacks laid out apart"):
        jax.jit(lambda a, b: layerwise(jnp.add, a, b))(split, whole)
    added = jax.jit(lambda a, b: layerwise(jnp.add, a, b))(split, split)
    np.testing.assert_array_equal(added, 2 * np.asarray(split))
    assert added.sharding.spec[0] == "stage" and kinds(added) == {"pinned_host"}


def test_the_update_by_layer_groups_stacks_of_one_size_by_their_split():
    """_layerwise.updated_by_layer over two stacks of 8 layers in host memory, one split by
    stage and one not: each updated over its own layers (the split one in a shard_map, each
    device over its 2), equal to optax's whole-tree AdamW on the device; a gradient laid
    out otherwise than its stack is refused (each device would update its layers with
    others' gradients)."""
    from jaxga._layerwise import StreamError, updated_by_layer

    mesh = jax.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    params = {"split": jnp.asarray(stack()["w"]), "whole": jnp.asarray(stack(1)["w"])}
    grads = jax.tree.map(lambda x: jnp.cos(3.0 * x), params)
    layouts = {"split": P("stage"), "whole": P()}

    def placed(tree, kind, specs=layouts):
        return {
            name: jax.device_put(x, NamedSharding(mesh, specs[name], memory_kind=kind))
            for name, x in tree.items()
        }

    tx = optax.adamw(0.05, weight_decay=0.1)
    state = jaxga.TrainState.create(params=placed(params, "device"), tx=tx)
    access = jaxga.train._Flax(None, None, None).optimizer(state)
    streamed = state.replace(params=placed(params, "pinned_host"))
    update = jax.jit(functools.partial(updated_by_layer, access))
    with jax.set_mesh(mesh):
        got = update(streamed, placed(grads, "device"))
    want = jax.jit(access.update)(state, placed(grads, "device"))
    assert kinds(got.params) == {"pinned_host"}
    assert got.params["split"].sharding.spec[0] == "stage"
    assert_rounding_close(got.params, want.params)

    apart = placed(grads, "device", {"split": P(), "whole": P()})
    with jax.set_mesh(mesh), pytest.raises(StreamError, match=r"expected the gradient laid out"):
        update(streamed, apart)


@pytest.mark.parametrize("memory_kind", ["device", "pinned_host"])
def test_a_window_of_a_streamed_stack_runs_those_layers_alone(memory_kind):
    """remat.streamed_window (interleaved 1F1B's chunk of a stage's stack) on layers start to
    start + size - 1 of a stack with an int leaf (the layers' ids), its start traced, its
    gradient added to sums (`_streaming.vjp_summed`, as a pipeline's tick adds it): the
    value, and the sums plus jax.vjp through those layers sliced out and run in a Python
    loop; the other layers' sums left as they were. A window outside the stack, and a
    window's gradient taken outside a loop's sums, are refused by name."""
    from jaxga._streaming import vjp_summed
    from jaxga.remat import streamed_window

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(6, D, D)).astype(np.float32)) / 2
    ids, x = jnp.arange(6), jnp.asarray(rng.normal(size=(2, D)).astype(np.float32))
    totals = (jnp.asarray(rng.normal(size=w.shape).astype(np.float32)), jnp.ones_like(x))
    dy = jnp.asarray(rng.normal(size=x.shape).astype(np.float32))

    def layer(params, x):
        w, i = params
        return jnp.tanh(x @ w) + 0.01 * i

    def windowed(w, x, start, size):
        return streamed_window(layer, (w, ids), x, policy="full", window=(start, size))

    def summed(w, x, total, start, size):
        fun = functools.partial(windowed, start=start, size=size)
        return fun(w, x), vjp_summed(fun, (w, x), dy, (total, totals[1]))

    def reference(w, x, start, size):
        for i in range(start, start + size):
            x = layer((w[i], ids[i]), x)
        return x

    where = NamedSharding(jax.make_mesh((1,), ("one",)), P(), memory_kind)
    stack, total = jax.device_put(w, where), jax.device_put(totals[0], where)
    run = jax.jit(summed, static_argnums=4)
    for start, size in [(1, 3), (4, 2), (0, 6)]:
        y, sums = run(stack, x, total, start, size)
        assert sums[0].sharding.memory_kind == memory_kind
        want, vjp = jax.vjp(functools.partial(reference, start=start, size=size), w, x)
        want_sums = jax.tree.map(jnp.add, totals, vjp(dy))
        assert_rounding_close((y, sums), (want, want_sums), atol=1e-6)
    with pytest.raises(ValueError, match=r"`window`=\(1, 3\): a gradient of some layers"):
        jax.grad(lambda w: jnp.sum(windowed(w, x, 1, 3)))(w)
    for window in [(3, 4), (0, 0), (-1, 2), (0, 2.0), (0, True)]:
        with pytest.raises(ValueError, match=r"`window`=.* for a stack of 6 layers; expected"):
            streamed_window(layer, (w, ids), x, policy="full", window=window)


def test_a_gate_leaves_the_sums_as_they_are_and_skips_the_forward_layers():
    """_streaming.vjp_summed(gate=) as a streamed pipeline's bubble tick calls it, on a layer
    that gives NaN there (the log of a negative input): gate False returns both sums (the
    stack's and the input's) bit for bit, its forward layers skipped in a cond; gate True
    equals no gate, and the sums plus jax.vjp of the layers in a Python loop."""
    from jaxga._streaming import streamed_scan, vjp_summed

    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(size=(3, D, D)).astype(np.float32))
    x, dy = -jnp.ones((2, D)), jnp.asarray(rng.normal(size=(2, D)).astype(np.float32))
    totals = (jnp.asarray(rng.normal(size=w.shape).astype(np.float32)), jnp.ones_like(x))

    def layer(w, x):
        return jnp.log(x) @ w  # NaN for the negative x given

    def scanned(w, x):
        return streamed_scan(layer, w, x)

    def summed(w, x, gate):
        return vjp_summed(scanned, (w, x), dy, totals, gate=gate)

    kept = jax.jit(summed)(w, x, jnp.asarray(False))
    np.testing.assert_array_equal(kept[0], totals[0])
    np.testing.assert_array_equal(kept[1], totals[1])
    assert "cond" in str(jax.make_jaxpr(summed)(w, x, jnp.asarray(False)))

    positive = jnp.abs(x) + 0.5
    added = jax.jit(summed)(w, positive, jnp.asarray(True))
    chex.assert_trees_all_equal(added, jax.jit(summed)(w, positive, None))

    def loop(w, x):
        for layer_w in w:
            x = layer(layer_w, x)
        return x

    want = jax.tree.map(jnp.add, totals, jax.vjp(loop, w, positive)[1](dy))
    assert_rounding_close(added, want, atol=1e-5)
