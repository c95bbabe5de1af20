"""jaxga.memory_report against the arrays it sizes and XLA's own FLOP counts."""

import json
import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxga
from jaxga.memory import dot_flops, program_counts

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

import remat_memory


def nbytes(tree):
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def xla_flops(fn, *args):
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


def matmul_and_sum(a, b):
    return jnp.tanh(a @ b) + jnp.sum(a)


A = jax.ShapeDtypeStruct((32, 16), jnp.float32)
B = jax.ShapeDtypeStruct((16, 8), jnp.bfloat16)


def test_sizes_are_those_of_the_arguments_and_outputs():
    report = jaxga.memory_report(matmul_and_sum, A, B)
    assert report.argument_bytes == nbytes((A, B))
    assert report.output_bytes == nbytes(jax.eval_shape(matmul_and_sum, A, B))
    assert report.peak_bytes == (
        report.argument_bytes + report.output_bytes + report.temp_bytes - report.alias_bytes
    )
    assert report.backend == jax.default_backend()


def test_arrays_and_shape_structs_give_the_same_report():
    arrays = (jnp.ones(A.shape, A.dtype), jnp.ones(B.shape, B.dtype))
    assert jaxga.memory_report(matmul_and_sum, *arrays) == jaxga.memory_report(matmul_and_sum, A, B)


def test_compiles_without_running():
    calls = []

    def fn(x):
        jax.debug.callback(lambda: calls.append(1))
        return x * 2

    jaxga.memory_report(fn, jnp.ones(4))
    assert calls == []
    jax.block_until_ready(jax.jit(fn)(jnp.ones(4)))  # the callback does fire when run
    assert calls == [1]


def test_donated_argument_is_aliased():
    x = jax.ShapeDtypeStruct((256,), jnp.float32)
    report = jaxga.memory_report(jax.jit(lambda x: x * 2, donate_argnums=0), x)
    if report.alias_bytes == 0:
        pytest.skip(f"the {report.backend} backend ignores donation")
    assert report.alias_bytes == nbytes(x)
    assert report.peak_bytes == report.argument_bytes + report.temp_bytes


def test_jitted_function_keeps_its_static_arguments():
    fn = jax.jit(lambda x, n: jnp.concatenate([x] * n), static_argnums=1)
    x = jax.ShapeDtypeStruct((8,), jnp.float32)
    assert jaxga.memory_report(fn, x, 3).output_bytes == 3 * nbytes(x)
    assert jaxga.memory_report(lambda x, *, n: x * n, x, n=2.0).output_bytes == nbytes(x)


def matmul_chain(ws, x):
    for w in ws:
        x = x @ w
    return x


def conv_net(k1, k2, x):
    dims = ("NCHW", "OIHW", "NCHW")
    y = jax.lax.conv_general_dilated(x, k1, (2, 1), ((1, 2), (1, 1)), dimension_numbers=dims)
    return jax.lax.conv_general_dilated(
        y, k2, (1, 1), "SAME", rhs_dilation=(2, 1), feature_group_count=2, dimension_numbers=dims
    )


# XLA's cost analysis counts FLOPs on the CPU; on a GPU it reports none (-3.0 on H100).
cpu_cost_analysis = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="XLA's cost analysis reports FLOPs on the CPU only"
)


@cpu_cost_analysis
def test_dot_flops_equal_xla_flops_for_loop_free_programs():
    ws = [jnp.ones((16, 16))] * 3
    x = jnp.ones((5, 16))
    assert jaxga.memory_report(matmul_chain, ws, x).dot_flops == xla_flops(matmul_chain, ws, x)
    k1, k2, x = jnp.ones((6, 3, 3, 3)), jnp.ones((4, 3, 3, 3)), jnp.ones((2, 3, 11, 10))
    report = jaxga.memory_report(conv_net, k1, k2, x)
    assert report.dot_flops == xla_flops(conv_net, k1, k2, x)

    # The gradient adds transposed convolutions (dilated inputs, batch groups).
    def loss(k1, k2, x):
        return jnp.sum(conv_net(k1, k2, x))

    grads = jax.grad(loss, argnums=(0, 1, 2))
    assert jaxga.memory_report(grads, k1, k2, x).dot_flops == xla_flops(grads, k1, k2, x)


@cpu_cost_analysis
def test_dot_flops_count_every_scan_iteration():
    """A scan over L matmuls does the work of the unrolled Python loop; XLA counts one."""
    ws = jnp.ones((7, 16, 16))
    x = jnp.ones((5, 16))

    def scanned(ws, x):
        return jax.lax.scan(lambda x, w: (x @ w, None), x, ws)[0]

    report = jaxga.memory_report(scanned, ws, x)
    unrolled = xla_flops(matmul_chain, list(ws), x)
    assert report.dot_flops == unrolled
    assert report.dot_flops_exact


def test_dot_flops_count_rematerialised_recomputation():
    """Per layer: forward x@w, two backward matmuls, and, rematerialised, x@w again."""
    layers, rows, dim = 6, 5, 16
    ws = jax.ShapeDtypeStruct((layers, dim, dim), jnp.float32)
    x = jax.ShapeDtypeStruct((rows, dim), jnp.float32)
    matmul = 2 * rows * dim * dim

    def grad_flops(policy):
        def apply(ws, x):
            return jaxga.remat_scan(lambda w, x: jnp.tanh(x @ w), ws, x, policy=policy)

        step = jax.grad(lambda ws, x: jnp.sum(apply(ws, x)), argnums=(0, 1))
        return jaxga.memory_report(step, ws, x).dot_flops

    assert grad_flops("none") == layers * 3 * matmul
    assert grad_flops("full") == layers * 4 * matmul


def test_while_loop_is_flagged_and_cond_counts_its_costliest_branch():
    x = jnp.ones((4, 4))

    def body(c):
        return (c[0] @ c[0], c[1] + 1)

    looped = jaxga.memory_report(lambda x: jax.lax.while_loop(lambda c: c[1] < 3, body, (x, 0)), x)
    assert (looped.dot_flops, looped.dot_flops_exact) == (2 * 4**3, False)

    def branches(p, x):
        return jax.lax.cond(p, lambda x: x @ x @ x, lambda x: x, x)

    assert jaxga.memory_report(branches, True, x).dot_flops == xla_flops(lambda x: x @ x @ x, x)


def test_doctest_style_dot_flops_accepts_open_and_closed_jaxprs():
    closed = jax.make_jaxpr(lambda a: a @ a)(jnp.ones((3, 3)))
    assert dot_flops(closed) == dot_flops(closed.jaxpr) == (54, True)


def _offloaded_layers(ws, x):  # matmuls, and the carry's trip to host memory and back
    def body(x, w):
        x = jax.device_put(jnp.tanh(x @ w), jax.memory.Space.Host)
        return jax.device_put(x, jax.memory.Space.Device), None

    return jax.lax.scan(body, x, ws)[0]


@pytest.mark.parametrize("axes", ["a", ("a", "b")])
def test_a_shard_map_over_the_batch_counts_as_the_program_without_it(axes):
    """A shard_map's body is traced at one device's shapes: counted once per device along
    its manual axes, it does what the program over the whole batch does (it read half)."""
    ws, x = jnp.ones((3, 4, 4)), jnp.ones((8, 4))
    whole = program_counts(jax.make_jaxpr(_offloaded_layers)(ws, x))
    mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    names = set(axes) if isinstance(axes, tuple) else {axes}
    split = jax.shard_map(
        _offloaded_layers, mesh=mesh, in_specs=(P(), P(axes)), out_specs=P(axes), axis_names=names
    )
    assert whole == (2 * 3 * 8 * 4 * 4, 3 * 2 * 8 * 4 * 4, True)
    assert program_counts(jax.make_jaxpr(split)(ws, x)) == whole


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_a_step_on_a_mesh_reports_the_flops_of_the_step_on_one_device(axis_type):
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    w, x = jnp.ones((4, 4)), jnp.ones((8, 4))
    one = jaxga.memory_report(jaxga.grad(loss, num_microbatches=2), w, x)
    with jax.set_mesh(jax.make_mesh((2,), ("data",), axis_types=(axis_type,))):
        step = jaxga.grad(loss, num_microbatches=2, axis_name="data")
        two = jaxga.memory_report(step, w, jax.device_put(x, P("data")))
    assert two.dot_flops == one.dot_flops == 2 * (2 * 8 * 4 * 4)  # forward, weight gradient


def test_backend_is_the_compiled_programs_platform():
    placed = jaxga.memory_report(jnp.tanh, jax.device_put(jnp.ones(3), jax.devices()[0]))
    assert placed.backend == jax.devices()[0].platform
    assert jaxga.memory_report(lambda: None).backend == jax.default_backend()  # no devices


def test_a_model_is_a_function_to_report_on():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    assert jaxga.memory_report(model, jnp.ones((4, 3))).dot_flops == 2 * 4 * 3 * 2


@pytest.mark.parametrize("fn, got", [(3, "3 of type int"), ("step", "'step' of type str")])
def test_error_on_fn_not_callable(fn, got):
    """Issue 22: a string passed as the step is named as `fn`, with what was expected."""
    expected = rf"^`fn` must be a function; got {got}\.$"
    with pytest.raises(TypeError, match=expected):
        jaxga.memory_report(fn, A)


@pytest.mark.parametrize("jitted", [False, True])
@pytest.mark.parametrize("wrong", ["x", (32, 8), [32, 8]])
def test_error_on_a_name_or_a_shape_in_place_of_an_argument(jitted, wrong):
    fn = jax.jit(matmul_and_sum) if jitted else matmul_and_sum
    got = re.escape(repr(wrong))
    expected = rf"^memory_report's args\[1\] is {got}; pass an array or jax\.ShapeDtypeStruct\.$"
    with pytest.raises(TypeError, match=expected):
        jaxga.memory_report(fn, A, wrong)
    with pytest.raises(TypeError, match=rf"^memory_report's kwargs\['b'\] is {got}; "):
        jaxga.memory_report(fn, A, b=wrong)


def test_static_arguments_may_be_shapes_and_names():
    def zeros(x, shape, mode):
        return jnp.zeros(shape) + jnp.sum(x) * (mode == "train")

    fn = jax.jit(zeros, static_argnums=(1, 2))
    assert jaxga.memory_report(fn, A, (32, 8), "train").output_bytes == 32 * 8 * 4


def test_nnx_jit_step_is_reported_as_its_jax_jit_twin():
    """Issue 22: memory_report of an nnx.jit step raised "'Traced' object has no attribute
    'jaxpr'". Its report is that of the same step written with jax.jit over nnx.split state."""
    model = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    batch = {"x": jnp.ones((32, 16)), "y": jnp.ones((32, 8))}

    def loss(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    def step(model, optimizer, batch):
        value, grads = nnx.value_and_grad(loss)(model, batch)
        optimizer.update(model, grads)
        return value

    graphdef, state = nnx.split((model, optimizer))

    def functional(state, batch):  # the same step, split and merged by hand
        model, optimizer = nnx.merge(graphdef, state)
        value = step(model, optimizer, batch)
        return value, nnx.state((model, optimizer))

    report = jaxga.memory_report(nnx.jit(step), model, optimizer, batch)
    twin = jaxga.memory_report(jax.jit(functional), state, batch)
    assert report.argument_bytes == twin.argument_bytes == nbytes((state, batch))
    assert report.dot_flops == twin.dot_flops == 2 * (2 * 32 * 16 * 8)  # forward, weight grad
    assert report.dot_flops_exact and report.backend == jax.default_backend()


def test_remat_memory_example_writes_figure_and_table(tmp_path, capsys):
    png, table = tmp_path / "fig.png", tmp_path / "fig.json"
    result = remat_memory.main(
        depths=(4, 16), tokens=32, dim=8, hidden=32, png=png, json_path=table
    )
    assert png.stat().st_size > 0
    assert json.loads(table.read_text())["rows"] == result["rows"]
    temp = {(r["label"], r["depth"]): r["temp_bytes"] for r in result["rows"]}
    assert temp["per layer (policy='full')", 4] < temp["no remat", 4]
    assert "Goal:" in capsys.readouterr().out
