"""jaxga.MultiSteps against optax.MultiSteps, full-batch optax steps and Python loops."""

import copy
import functools
import pickle
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jex_core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxga

RTOL = 2e-5
ATOL = 1e-6


assert_trees_close = functools.partial(chex.assert_trees_all_close, rtol=RTOL, atol=ATOL)


def max_abs_diff(a, b):
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in pairs)


def as_numpy(tree):
    """Host copies: slicing them and computing references with them compiles nothing."""
    return jax.tree.map(np.asarray, tree)


# ---------------------------------------------------------------- models and data


def init_params(seed=0, sizes=(5, 8, 3)):
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return as_numpy(
        [
            {"w": jax.random.normal(k, (m, n)) / jnp.sqrt(m), "b": jnp.zeros(n)}
            for k, m, n in zip(keys, sizes[:-1], sizes[1:])
        ]
    )


def mlp(params, x):
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def mse(params, batch):
    return jnp.mean((mlp(params, batch["x"]) - batch["y"]) ** 2)


def mlp_batches(calls, seed=1, rows=4):
    kx, ky = jax.random.split(jax.random.key(seed))
    return as_numpy(
        {"x": jax.random.normal(kx, (calls, rows, 5)), "y": jax.random.normal(ky, (calls, rows, 3))}
    )


def embed_params(seed=2, vocab=7, dim=4):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return as_numpy(
        {"embed": jax.random.normal(k1, (vocab, dim)), "out": jax.random.normal(k2, (dim, vocab))}
    )


def token_loss(params, batch):
    logits = params["embed"][batch["tokens"]] @ params["out"]
    return jaxga.token_cross_entropy(logits, batch["labels"], batch["mask"])


def token_batches(calls, seed=3, rows=3, length=6, vocab=7):
    """Batches whose token counts differ a lot from call to call."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    lengths = np.where(np.arange(calls * rows) % 5 == 0, length, 1).reshape(calls, rows)
    return as_numpy(
        {
            "tokens": jax.random.randint(k1, (calls, rows, length), 0, vocab),
            "labels": jax.random.randint(k2, (calls, rows, length), 0, vocab),
            "mask": (np.arange(length) < lengths[..., None]).astype(np.float32),
        }
    )


@jax.jit
def mse_grads(params, data):
    """The gradient of ``mse`` for every call of ``data``, at the same params."""
    return jax.vmap(jax.grad(mse), in_axes=(None, 0))(params, data)


@jax.jit
def token_mean_grad(params, batch):
    """The gradient of the token mean of ``batch`` (leading axes: calls, rows)."""
    flat = jax.tree.map(lambda x: x.reshape(-1, x.shape[-1]), batch)
    return jax.grad(lambda p: token_loss(p, flat).value)(params)


def call_axis(batch):
    """Gives every call of ``batch`` a leading axis of one row group, for vmap."""
    return jax.tree.map(lambda x: np.asarray(x)[:, None], batch)


def unstack(tree, n):
    return [call(i, tree) for i in range(n)]


def call(i, tree):
    """Call ``i`` of per-call data; numpy indexing, so that no op is compiled for it."""
    return jax.tree.map(lambda x: np.asarray(x)[i], tree)


# ---------------------------------------------------------------- training loops


def grads_and_weight(loss, params, batch):
    """Gradient of the loss value and, for a jaxga.Mean loss, its count as the weight."""

    def as_mean(out):  # a float scalar: the mean of one item
        return out if isinstance(out, jaxga.Mean) else jaxga.Mean(out, 1.0)

    grads = jax.grad(lambda p: as_mean(loss(p, batch)).value)(params)
    return grads, as_mean(loss(params, batch)).count


@functools.partial(jax.jit, static_argnames=("tx", "loss", "weighted"))
def train_step(params, state, batch, given, extra, *, tx, loss, weighted):
    """One training call: gradient (or the ``given`` one), ``tx.update``, apply."""
    grads, count = grads_and_weight(loss, params, batch)
    grads = grads if given is None else given
    kwargs = {"weight": count} if weighted else {}
    updates, state = tx.update(grads, state, params, **kwargs, **extra)
    return optax.apply_updates(params, updates), state, updates


def train_calls(tx, params, data, calls, loss=mse, *, weighted=False, extras=None, grads=None):
    """Runs ``calls`` training calls; returns per-call params, states and updates.

    ``grads`` (one per call) replaces the computed gradients when given.
    """
    state = tx.init(params)
    out = {"params": [], "states": [], "updates": []}
    for i in range(calls):
        given = None if grads is None else grads[i]
        extra = extras[i] if extras else {}
        params, state, updates = train_step(
            params, state, call(i, data), given, extra, tx=tx, loss=loss, weighted=weighted
        )
        out["params"].append(params)
        out["states"].append(state)
        out["updates"].append(updates)
    return out


def clip_adamw():
    return optax.chain(optax.clip_by_global_norm(0.3), optax.adamw(3e-2, weight_decay=0.1))


# ---------------------------------------------------------------- equivalence


@pytest.mark.parametrize(
    "inner, every_k",
    [
        (clip_adamw(), 4),
        # a learning-rate schedule and a schedule of k: both advance once per group
        (optax.adam(optax.linear_schedule(0.05, 0.0, 6)), lambda step: jnp.minimum(step + 1, 3)),
    ],
    ids=["clip_adamw_k4", "schedules"],
)
def test_matches_optax_multisteps(inner, every_k):
    calls = 22
    params, data = init_params(), mlp_batches(calls)
    tx = jaxga.MultiSteps(inner, every_k)
    ours = train_calls(tx, params, data, calls)
    reference = optax.MultiSteps(inner, every_k_schedule=every_k, use_grad_mean=True)
    theirs = train_calls(reference, params, data, calls)
    applied = [bool(reference.has_updated(s)) for s in theirs["states"]]
    assert sum(applied) >= 5
    for i in range(calls):
        assert_trees_close(ours["params"][i], theirs["params"][i])
        assert bool(tx.has_updated(ours["states"][i])) == applied[i]
        if not applied[i]:
            assert not any(np.any(u) for u in jax.tree.leaves(ours["updates"][i]))
    final = ours["states"][-1]
    assert int(final.gradient_step) == sum(applied)
    counts = [x for x in jax.tree.leaves(final.inner_opt_state) if x.dtype == jnp.int32]
    assert counts and all(int(c) == sum(applied) for c in counts)


def test_weighted_calls_equal_one_step_on_the_global_token_mean():
    k, groups = 4, 2
    params, data = embed_params(), token_batches(k * groups)
    inner = optax.adam(0.1)
    tx = jaxga.MultiSteps(inner, k)
    ours = train_calls(tx, params, data, k * groups, token_loss, weighted=True)

    @jax.jit
    def adam_step(params, state, grads):
        updates, state = inner.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    reference, state = params, inner.init(params)
    for group in range(groups):
        batch = call(slice(group * k, (group + 1) * k), data)
        if group == 0:  # equal weights, the mean of the per-call means, would be far off
            per_call = jax.vmap(token_mean_grad, in_axes=(None, 0))(params, call_axis(batch))
            mean_of_means = jax.tree.map(lambda g: np.mean(g, 0), as_numpy(per_call))
            wrong, _ = adam_step(params, state, mean_of_means)
        reference, state = adam_step(reference, state, token_mean_grad(reference, batch))
        assert_trees_close(ours["params"][(group + 1) * k - 1], reference, rtol=1e-5)
    assert max_abs_diff(wrong, ours["params"][k - 1]) > 1e-3
    counts = data["mask"][-k:].sum()
    assert float(ours["states"][-1].weight_sum) == pytest.approx(float(counts))


# ---------------------------------------------------------------- the inner optimiser


def counting(inner, counter):
    """``inner``, plus a host-side count of how many times its update executes."""

    def record():
        counter.append(1)

    def update(updates, state, params=None, **extra_args):
        jax.debug.callback(record)
        return optax.with_extra_args_support(inner).update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def test_inner_optimiser_runs_once_per_group():
    k, calls = 4, 12
    params, data = init_params(), mlp_batches(calls)
    ours, theirs = [], []
    train_calls(jaxga.MultiSteps(counting(optax.adam(0.01), ours), k), params, data, calls)
    train_calls(optax.MultiSteps(counting(optax.adam(0.01), theirs), k), params, data, calls)
    jax.effects_barrier()
    assert len(theirs) == calls  # optax runs it on every call and discards k - 1 results
    assert len(ours) == calls // k


def test_extra_args_reach_the_inner_optimiser_on_the_applying_call():
    k, calls = 2, 12
    params, data = init_params(), mlp_batches(calls)
    inner = optax.chain(
        optax.sgd(0.05), optax.contrib.reduce_on_plateau(factor=0.5, patience=1, cooldown=0)
    )
    values = [2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5]
    extras = [{"value": jnp.float32(v)} for v in values]
    ours = train_calls(jaxga.MultiSteps(inner, k), params, data, calls, extras=extras)
    theirs = train_calls(optax.MultiSteps(inner, k), params, data, calls, extras=extras)
    assert_trees_close(ours["params"][-1], theirs["params"][-1])
    assert_trees_close(ours["states"][-1].inner_opt_state, theirs["states"][-1].inner_opt_state)
    scale = ours["states"][-1].inner_opt_state[1].scale
    assert float(scale) < 1.0  # the plateau was seen: the value did reach the inner state


# ---------------------------------------------------------------- skipping


def test_non_finite_calls_are_skipped_as_if_they_never_happened():
    k, calls, bad = 3, 11, (2, 6)
    params, data = init_params(), mlp_batches(calls)
    tx = jaxga.MultiSteps(optax.adam(0.05), k, should_skip_update_fn=jaxga.skip_not_finite)
    grads = unstack(as_numpy(mse_grads(params, data)), calls)
    poison = [jnp.nan, jnp.inf]
    with_bad = [
        jax.tree.map(lambda g: np.where(np.arange(g.shape[-1]) == 0, poison[bad.index(i)], g), g)
        if i in bad
        else g
        for i, g in enumerate(grads)
    ]
    # feed fixed gradients, so that both runs see the same ones whatever the params
    ours = train_calls(tx, params, data, calls, grads=with_bad)
    good = [i for i in range(calls) if i not in bad]
    clean = train_calls(
        tx, params, call(jnp.array(good), data), len(good), grads=[grads[i] for i in good]
    )
    for j, i in enumerate(good):
        mine, ref = ours["states"][i], clean["states"][j]
        assert_trees_close(ours["params"][i], clean["params"][j], rtol=0, atol=0)
        for field in ("mini_step", "gradient_step", "acc_grads", "weight_sum", "inner_opt_state"):
            assert_trees_close(getattr(mine, field), getattr(ref, field), rtol=0, atol=0)
        assert bool(mine.applied) == bool(ref.applied)
    for i in bad:
        before = ours["states"][i - 1]
        state = ours["states"][i]
        assert bool(state.skip_state["should_skip"]) and int(state.skip_state["num_not_finite"]) > 0
        assert not bool(tx.has_updated(state))
        assert int(state.num_skipped) == bad.index(i) + 1
        for field in ("mini_step", "gradient_step", "acc_grads", "weight_sum", "inner_opt_state"):
            assert_trees_close(getattr(state, field), getattr(before, field), rtol=0, atol=0)
        assert_trees_close(ours["params"][i], ours["params"][i - 1], rtol=0, atol=0)
    # the predicate is what protects: without it (the default) the NaN reaches the parameters
    unprotected = jaxga.MultiSteps(optax.adam(0.05), k)
    out = train_calls(unprotected, params, data, calls, grads=with_bad)
    assert not np.isfinite(np.asarray(out["params"][-1][0]["w"])).all()


def test_custom_skip_predicate_from_optax():
    calls = 6
    params, data = init_params(), mlp_batches(calls)
    grads = unstack(as_numpy(mse_grads(params, data)), calls)
    grads[3] = jax.tree.map(lambda g: 1e3 * g, grads[3])

    def skip_large(g, step, p):
        return optax.skip_large_updates(g, step, p, max_squared_norm=100.0)

    tx = jaxga.MultiSteps(optax.sgd(0.1), 2, should_skip_update_fn=skip_large)
    out = train_calls(tx, params, data, calls, grads=grads)
    skipped = [bool(s.skip_state["should_skip"]) for s in out["states"]]
    assert skipped == [False, False, False, True, False, False]
    # the reference: plain SGD on the pairwise means of the calls that were kept
    kept = [grads[i] for i in (0, 1, 2, 4, 5)][:4]
    reference = params
    for a, b in (kept[0:2], kept[2:4]):
        reference = jax.tree.map(lambda p, x, y: p - 0.1 * (x + y) / 2, reference, a, b)
    assert_trees_close(out["params"][4], reference)


def test_a_traced_negative_weight_skips_its_call():
    params, data = embed_params(), token_batches(3)
    tx = jaxga.MultiSteps(optax.sgd(0.1), 2)
    update = jax.jit(lambda g, s, p, w: tx.update(g, s, p, weight=w))
    grads = jax.vmap(token_mean_grad, in_axes=(None, 0))(params, call_axis(data))
    grads = unstack(as_numpy(grads), 3)
    state = tx.init(params)
    _, state = update(grads[0], state, params, 2.0)
    _, skipped = update(grads[1], state, params, -1.0)
    assert int(skipped.num_skipped) == 1
    for field in ("mini_step", "acc_grads", "weight_sum", "inner_opt_state"):
        assert_trees_close(getattr(skipped, field), getattr(state, field), rtol=0, atol=0)
    updates, done = update(grads[2], skipped, params, 1.0)
    expected = jax.tree.map(lambda a, b: -0.1 * (2 * a + b) / 3, grads[0], grads[2])
    assert bool(tx.has_updated(done))
    assert_trees_close(updates, expected)
    # a group without any weight holds no items: it ends without running the inner
    # optimiser (no 0 / 0, no weight decay or schedule step on nothing)
    _, state = update(grads[0], done, params, 0.0)
    updates, state = update(grads[1], state, params, 0.0)
    assert not bool(tx.has_updated(state))
    assert int(state.mini_step) == 0 and int(state.gradient_step) == int(done.gradient_step)
    assert all(not np.any(u) for u in jax.tree.leaves(updates))
    assert_trees_close(state.inner_opt_state, done.inner_opt_state, rtol=0, atol=0)


# ---------------------------------------------------------------- accumulator dtype


def test_bfloat16_accumulator_halves_the_buffer_and_stays_close():
    k, calls = 4, 8
    params, data = init_params(), mlp_batches(calls)
    f32 = train_calls(jaxga.MultiSteps(optax.sgd(0.1), k), params, data, calls)
    bf16 = train_calls(
        jaxga.MultiSteps(optax.sgd(0.1), k, accumulator_dtype=jnp.bfloat16), params, data, calls
    )
    acc32, acc16 = f32["states"][-1].acc_grads, bf16["states"][-1].acc_grads
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(acc16))

    def nbytes(t):
        return sum(x.nbytes for x in jax.tree.leaves(t))

    assert nbytes(acc16) * 2 == nbytes(acc32)
    for u in bf16["updates"]:  # updates keep the gradients' dtype
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(u))
    assert_trees_close(bf16["params"][-1], f32["params"][-1], rtol=2e-2, atol=2e-3)
    assert max_abs_diff(bf16["params"][-1], f32["params"][-1]) > 0  # it is really bfloat16


def sub_jaxprs(params):
    for value in params.values():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, jex_core.ClosedJaxpr):
                yield v
            elif isinstance(v, jex_core.Jaxpr):
                yield jex_core.ClosedJaxpr(v, [])


def zero_arrays(closed, shapes, known=None):
    """The shapes, among ``shapes``, of the constant all-zero arrays a closed jaxpr holds
    or builds: captured constants, and literal zeros broadcast (followed through dtype
    casts and into nested jaxprs)."""
    jaxpr = closed.jaxpr
    consts = [np.asarray(c) for c in closed.consts]
    known = {**(known or {}), **dict(zip(jaxpr.constvars, consts))}

    def value(x):
        return np.asarray(x.val) if isinstance(x, jex_core.Literal) else known.get(x)

    found = [c.shape for c in consts if c.shape in shapes and not c.any()]
    for eqn in jaxpr.eqns:
        if not eqn.outvars:  # a check, for checkify: no arrays built
            continue
        values = [value(x) for x in eqn.invars]
        out = eqn.outvars[0]
        if eqn.primitive.name == "convert_element_type" and values[0] is not None:
            known[out] = values[0]
        elif (
            eqn.primitive.name == "broadcast_in_dim"
            and values[0] is not None
            and not values[0].any()
            and out.aval.shape in shapes
        ):
            found.append(out.aval.shape)
        operands = values[1:] if eqn.primitive.name == "cond" else values
        for sub in sub_jaxprs(eqn.params):
            passed = (
                zip(sub.jaxpr.invars, operands) if len(sub.jaxpr.invars) == len(operands) else ()
            )
            found += zero_arrays(sub, shapes, {v: x for v, x in passed if x is not None})
    return found


def test_update_builds_no_constant_zeros_of_a_parameters_shape():
    # XLA merges equal constants. On a GPU, where the cond around Adam becomes selects,
    # such a zero (the updates of a call that does not apply, a reset accumulator) was
    # merged with the zeros a layer scan's backward pass starts from and kept alive
    # through that pass: one parameter-sized buffer more than optax.MultiSteps at the
    # peak (benchmarks/compiled_for_gpu.py: Transformer M, 12151 vs 11818 MiB; a layer
    # scan's train step is held at optax's peak in tests/h100/checks.py).
    params = {"w": jnp.ones((8, 4)), "b": jnp.ones(4)}
    shapes = {(8, 4), (4,)}
    for tx in (
        jaxga.MultiSteps(optax.adam(1e-3), 4),
        jaxga.MultiSteps(optax.adam(1e-3), 4, should_skip_update_fn=jaxga.skip_not_finite),
    ):
        assert zero_arrays(jax.make_jaxpr(tx.update)(params, tx.init(params), params), shapes) == []

    # the check sees such zeros: built in a branch, and captured as a constant
    def held(g):
        def zeros():
            return jax.tree.map(jnp.zeros_like, g)

        return jax.lax.cond(g["b"][0] > 0, zeros, lambda: g)

    assert sorted(zero_arrays(jax.make_jaxpr(held)(params), shapes)) == [(4,), (8, 4)]

    def captured(g):
        return jnp.where(g["w"] > 0, g["w"], np.zeros((8, 4), np.float32))

    assert zero_arrays(jax.make_jaxpr(captured)(params), shapes) == [(8, 4)]


# ---------------------------------------------------------------- transforms and composition


def test_vmap_over_an_ensemble_matches_separate_runs():
    k, calls, members = 3, 7, 3
    params = [init_params(10 + m) for m in range(members)]
    data = [mlp_batches(calls, 20 + m) for m in range(members)]
    tx = jaxga.MultiSteps(optax.adam(0.05), k)

    def step(params, state, batch):
        updates, state = tx.update(jax.grad(mse)(params, batch), state, params)
        return optax.apply_updates(params, updates), state

    def stack(trees):
        return jax.tree.map(lambda *x: np.stack(x), *trees)

    batched_params = stack(params)
    batched_state = jax.jit(jax.vmap(tx.init))(batched_params)
    vstep = jax.jit(jax.vmap(step))
    stacked_data = stack(data)
    for i in range(calls):
        batched_params, batched_state = vstep(
            batched_params,
            batched_state,
            call(i, jax.tree.map(lambda x: np.swapaxes(x, 0, 1), stacked_data)),
        )
    for m in range(members):
        separate = train_calls(tx, params[m], data[m], calls)
        assert_trees_close(call(m, batched_params), separate["params"][-1])


def test_shard_map_with_replicated_and_with_sharded_gradients():
    k, calls = 2, 5
    mesh = jax.make_mesh((1,), ("data",))
    params, data = init_params(), mlp_batches(calls)
    grads = unstack(as_numpy(mse_grads(params, data)), calls)
    tx = jaxga.MultiSteps(optax.adam(0.05), k)
    reference = train_calls(tx, params, data, calls, grads=grads)["params"][-1]

    def place(tree, specs):
        return jax.tree.map(
            lambda spec, x: jax.device_put(x, NamedSharding(mesh, spec)),
            specs,
            tree,
            is_leaf=lambda x: isinstance(x, P),
        )

    def run(tx, p_spec, s_spec):
        def step(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        specs = (p_spec, s_spec)
        step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(*specs, p_spec), out_specs=specs))
        p, s = place((params, tx.init(params)), specs)
        for g in grads:
            p, s = step(p, s, place(g, p_spec))
        return p, s

    # data parallel: gradients already reduced, the same on every device
    p, _ = run(tx, P(), P())
    assert_trees_close(p, reference)
    # FSDP-like: the arrays of params, gradients and state are sharded; the skip decision
    # (and so the step counters) is summed over the axes the gradients vary over
    fsdp = jaxga.MultiSteps(optax.adam(0.05), k)

    def spec(tree):
        return jax.tree.map(lambda x: P("data") if jnp.ndim(x) else P(), tree)

    p, s = run(fsdp, spec(params), spec(fsdp.init(params)))
    assert_trees_close(p, reference)
    assert int(s.gradient_step) == calls // k


def test_composes_in_optax_chain_and_receives_weight_through_it():
    k, calls = 2, 4
    params, data = embed_params(), token_batches(calls)
    alone = jaxga.MultiSteps(optax.adam(0.1), k)
    a = train_calls(alone, params, data, calls, token_loss, weighted=True)
    unweighted = train_calls(alone, params, data, calls, token_loss)
    assert max_abs_diff(unweighted["params"][-1], a["params"][-1]) > 1e-3  # weight matters
    # optax hands extra arguments such as `weight` only to a GradientTransformationExtraArgs
    assert isinstance(alone, optax.GradientTransformationExtraArgs)
    chained = optax.chain(optax.identity(), jaxga.MultiSteps(optax.adam(0.1), k))
    b = train_calls(chained, params, data, calls, token_loss, weighted=True)
    assert_trees_close(b["params"][-1], a["params"][-1], rtol=0, atol=0)
    # as the first element of a chain, followed by a scaling
    first = optax.chain(jaxga.MultiSteps(optax.scale_by_adam(), k), optax.scale(-0.1))
    c = train_calls(first, params, data, calls, token_loss, weighted=True)
    assert_trees_close(c["params"][-1], a["params"][-1])


GRADS = [np.array([1.0, 2.0, -3.0]), np.array([4.0, 0.0, 1.0]), np.array([0.5, -2.0, 8.0])]
WEIGHTS = [1.0, 2.0, 5.0]


def weighted_mean_reference():
    """Σwᵢgᵢ / Σwᵢ of ``GRADS`` in Python floats."""
    total = sum(WEIGHTS)
    return [sum(w * g[j] for w, g in zip(WEIGHTS, GRADS)) / total for j in range(3)]


def run_weighted(tx, params, wrap):
    """Three calls of ``tx`` with ``GRADS`` (placed by ``wrap``) and ``WEIGHTS``."""
    state = tx.init(params)
    for g, w in zip(GRADS, WEIGHTS):
        updates, state = tx.update(wrap(jnp.asarray(g)), state, params, weight=w)
    return updates


@pytest.mark.parametrize("combinator", ["chain", "partition"])
def test_optax_combinators_give_the_exactly_weighted_mean(combinator):
    """`weight=` reaches a MultiSteps inside optax's combinators: every call does not weigh 1."""
    multisteps = jaxga.MultiSteps(optax.sgd(-1.0), 3)  # updates: the group's mean gradient
    if combinator == "chain":
        tx, params = optax.chain(optax.identity(), multisteps), jnp.zeros(3)
        mean = run_weighted(tx, params, lambda g: g)
    else:
        labels = {"acc": "acc", "frozen": "frozen"}
        tx = optax.partition({"acc": multisteps, "frozen": optax.set_to_zero()}, labels)
        params = {"acc": jnp.zeros(3), "frozen": jnp.zeros(3)}
        updates = run_weighted(tx, params, lambda g: {"acc": g, "frozen": g})
        assert updates["frozen"].tolist() == [0.0, 0.0, 0.0]
        mean = updates["acc"]
    np.testing.assert_allclose(np.asarray(mean), weighted_mean_reference(), rtol=1e-6)
    assert max(abs(x - y) for x, y in zip(weighted_mean_reference(), np.mean(GRADS, 0))) > 0.5


def test_is_an_optax_transformation_with_has_updated():
    inner = optax.adam(0.1)
    tx = jaxga.MultiSteps(
        inner,
        every_k_schedule=3,
        accumulator_dtype=jnp.bfloat16,
        should_skip_update_fn=jaxga.skip_not_finite,
    )
    assert isinstance(tx, jaxga.multistep.MultiStepsTransformation)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    assert type(tx).__slots__ == () and len(tx) == 2  # (init, update), as any transformation
    transformation = tx.gradient_transformation()  # optax.MultiSteps' method
    assert type(transformation) is optax.GradientTransformationExtraArgs
    params = {"w": jnp.arange(3.0)}
    ours, theirs = tx.init(params), transformation.init(params)
    assert ours.acc_grads["w"].dtype == jnp.bfloat16  # the options are in effect
    for i, weight in enumerate((1.0, 2.0, 3.0)):
        grads = {"w": jnp.sin(jnp.arange(3.0) + i)}
        assert not bool(tx.has_updated(ours))
        ours_updates, ours = tx.update(grads, ours, params, weight=weight)
        updates, theirs = transformation.update(grads, theirs, params, weight=weight)
        assert_trees_close(updates, ours_updates, rtol=0, atol=0)
    assert bool(tx.has_updated(theirs)) and int(ours.gradient_step) == 1  # every_k=3
    assert_trees_close(theirs, ours, rtol=0, atol=0)
    _, ours = tx.update({"w": jnp.array([jnp.nan, 0.0, 0.0])}, ours, params, weight=1.0)
    assert int(ours.num_skipped) == 1  # the skipping predicate is in effect


def picklable_init(params):
    return optax.EmptyState()


def picklable_update(updates, state, params=None):
    return jax.tree.map(lambda g: -0.5 * g, updates), state


def test_copies_and_pickles_work_alike():
    """Copies, deep copies and pickles (of an inner optimiser that pickles: optax's own
    are closures, which do not) give a MultiSteps that computes the same."""
    inner = optax.GradientTransformation(picklable_init, picklable_update)
    tx = jaxga.MultiSteps(inner, 2, should_skip_update_fn=jaxga.skip_not_finite)
    params = jnp.zeros(2)
    grads = [jnp.array([1.0, 2.0]), jnp.array([jnp.nan, 0.0]), jnp.array([3.0, -2.0])]

    def run(tx):
        state = tx.init(params)
        for g in grads:
            updates, state = tx.update(g, state, params)
        return updates, state

    expected = run(tx)
    assert expected[0].tolist() == [-1.0, 0.0]  # the mean of calls 1 and 3, halved
    assert int(expected[1].num_skipped) == 1
    for other in [copy.copy(tx), copy.deepcopy(tx), pickle.loads(pickle.dumps(tx))]:
        assert type(other) is jaxga.multistep.MultiStepsTransformation and other is not tx
        assert_trees_close(run(other), expected, rtol=0, atol=0)
    for clone in (copy.copy, copy.deepcopy):  # and with one of optax's optimisers
        tx = jaxga.MultiSteps(optax.sgd(1.0), 3, accumulator_dtype=jnp.bfloat16)
        other = clone(tx)
        assert type(other) is jaxga.multistep.MultiStepsTransformation
        state = other.init(params)
        assert state.acc_grads.dtype == jnp.bfloat16
        for _ in range(3):
            updates, state = other.update(jnp.ones(2), state, params)
        assert bool(other.has_updated(state)) and updates.tolist() == [-1.0, -1.0]
    # optax's closures do not pickle, and the MultiSteps around them fails as they do (the
    # same error type; its wording is CPython's, which changes between versions)
    with pytest.raises(Exception) as inner_error:
        pickle.dumps(optax.sgd(1.0))
    with pytest.raises(type(inner_error.value)):
        pickle.dumps(tx)


def test_flax_train_state_holds_it_as_a_static_field():
    from flax.training import train_state

    k, calls = 2, 4
    params, data = embed_params(), token_batches(calls)
    tx = jaxga.MultiSteps(optax.adam(0.1), k)
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    static = (tx, tx.init, tx.update)  # neither it nor its functions: a static field
    assert not any(leaf is x for leaf in jax.tree.leaves(state) for x in static)

    @jax.jit
    def step(state, batch):
        grads, count = grads_and_weight(token_loss, state.params, batch)
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params, weight=count)
        params = optax.apply_updates(state.params, updates)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state)

    sizes = []
    for i in range(calls - 1):
        state = step(state, call(i, data))
        sizes.append(step._cache_size())
    assert sizes[-1] == sizes[-2]  # the same static optimiser: no new compilation
    copied = copy.deepcopy(state)
    assert isinstance(copied.tx, jaxga.multistep.MultiStepsTransformation)
    last = call(calls - 1, data)
    reference = train_calls(tx, params, data, calls, token_loss, weighted=True)["params"][-1]
    for s in (state, copied):
        assert_trees_close(step(s, last).params, reference, rtol=0, atol=0)
    jaxga_state = jaxga.TrainState.create(params=params, tx=tx)  # jaxga's own, too
    assert_trees_close(step(jaxga_state, call(0, data)).params, params, rtol=0, atol=0)


def test_flax_nnx_optimizer_passes_weight_through():
    from flax import nnx

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jaxga.MultiSteps(optax.sgd(1.0), 2), wrt=nnx.Param)
    x = jnp.arange(12.0).reshape(4, 3) / 10

    @nnx.jit
    def step(model, optimizer, x, weight):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads, weight=weight)
        return grads

    def params():
        return jax.tree.map(jnp.copy, nnx.as_pure(nnx.state(model, nnx.Param)))

    start = params()
    g1 = nnx.as_pure(step(model, optimizer, x[:2], 1.0))
    assert_trees_close(params(), start, rtol=0, atol=0)
    g2 = nnx.as_pure(step(model, optimizer, x[2:], 3.0))
    expected = jax.tree.map(lambda p, a, b: p - (a + 3 * b) / 4, start, g1, g2)
    assert_trees_close(params(), expected)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "every_k, error, match",
    [
        (0, ValueError, "positive int or a schedule; got 0 of type int"),
        (-3, ValueError, "positive int or a schedule; got -3"),
        (2.0, TypeError, "positive int .* got 2.0 of type float"),
        (True, TypeError, "got True of type bool"),
        ("4", TypeError, "got '4' of type str"),
    ],
)
def test_bad_every_k(every_k, error, match):
    with pytest.raises(error, match=f"`every_k` must .*{match}"):
        jaxga.MultiSteps(optax.sgd(0.1), every_k)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"inner": "adam"}, TypeError, "`inner` must be an optax GradientTransformation .* str"),
        ({"accumulator_dtype": jnp.int32}, TypeError, "`accumulator_dtype` .* got int32"),
        ({"accumulator_dtype": "nope"}, TypeError, "`accumulator_dtype` .* got 'nope'"),
        ({"should_skip_update_fn": 3}, TypeError, "`should_skip_update_fn` .* got 3 of type int"),
        (
            {"should_skip_update_fn": lambda grads: (False, ())},
            TypeError,
            r"`should_skip_update_fn` must be callable as `\(grads, gradient_step, params\)",
        ),
        ({"every_k": lambda: 2}, TypeError, r"`every_k` must be callable as `every_k\(step\)`"),
    ],
)
def test_bad_construction_arguments(kwargs, error, match):
    options = {"inner": optax.sgd(0.1), "every_k": 2, **kwargs}
    with pytest.raises(error, match=match):
        jaxga.MultiSteps(**options)


def test_bad_schedule_outputs():
    params = jnp.zeros(3)
    for schedule, error, match in [
        (lambda step: 2.5, TypeError, r"Array\(2\.5, dtype=float32"),
        (lambda step: jnp.array([2, 2]), TypeError, r"Array\(\[2, 2\], dtype=int32\)"),
        (lambda step: 0, ValueError, r"Array\(0, dtype=int32"),
    ]:
        tx = jaxga.MultiSteps(optax.sgd(0.1), schedule)
        with pytest.raises(
            error, match=rf"^The `every_k` schedule must return an int scalar >= 1; got {match}"
        ):
            tx.update(params, tx.init(params), params)
    # under jit a schedule value cannot raise, and one below 1 counts as 1
    tx = jaxga.MultiSteps(optax.sgd(0.1), lambda step: step * 0)
    _, state = jax.jit(tx.update)(params, tx.init(params), params)
    assert bool(tx.has_updated(state))


@pytest.mark.parametrize(
    "weight, error, match",
    [
        (jnp.ones(2), TypeError, r"`weight` must be an int or float scalar; got float32\[2\]\.$"),
        (-1.0, ValueError, "`weight` must be finite and non-negative; got -1.0"),
        (float("nan"), ValueError, "finite and non-negative; got nan"),
        ("ten", TypeError, "`weight` must be an int or float scalar; got 'ten'"),
        (True, TypeError, r"`weight` must be an int or float scalar; got True\.$"),
    ],
)
def test_bad_weight(weight, error, match):
    tx = jaxga.MultiSteps(optax.sgd(0.1), 2)
    params = jnp.zeros(3)
    with pytest.raises(error, match=match):
        tx.update(params, tx.init(params), params, weight=weight)


def test_a_call_without_weight_weighs_one():
    params = jnp.zeros(3)
    tx = jaxga.MultiSteps(optax.sgd(1.0), 3)
    update = jax.jit(lambda g, s, **kw: tx.update(g, s, params, **kw))
    g = [jnp.array([1.0, 2.0, 3.0]), jnp.array([4.0, 0.0, -1.0]), jnp.array([0.5, 0.5, 0.5])]
    state = tx.init(params)
    for weights, expected in (((None,) * 3, 3.0), ((1.0, 3.0, 1.0), 5.0)):
        for gradient, w in zip(g, weights):
            updates, state = update(gradient, state, **({} if w is None else {"weight": w}))
        assert bool(tx.has_updated(state)) and float(state.weight_sum) == expected
        ones = (1.0, 1.0, 1.0) if weights[0] is None else weights
        reference = -sum(w * x for w, x in zip(ones, g)) / expected
        chex.assert_trees_all_close(updates, reference, rtol=1e-6)


def test_a_group_mixing_weighted_and_unweighted_calls():
    params = jnp.zeros(3)
    tx = jaxga.MultiSteps(optax.sgd(1.0), 2)
    g = [jnp.array([1.0, 2.0, 3.0]), jnp.array([4.0, 0.0, -1.0]), jnp.array([0.5, 0.5, 0.5])]
    _, weighted = tx.update(g[0], tx.init(params), params, weight=3.0)
    _, unweighted = tx.update(g[0], tx.init(params), params)
    # eagerly, the state is known: an error naming `weight`
    message = (
        "`weight` must be given to all calls of a group or none; got none after weighted calls."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        tx.update(g[1], weighted, params)
    message = message.replace("none after weighted", "one after unweighted")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        tx.update(g[1], unweighted, params, weight=1.0)
    # under jit the state is not known: as documented, a call without weight weighs 1
    updates, state = jax.jit(lambda g, s: tx.update(g, s, params))(g[1], weighted)
    assert bool(tx.has_updated(state)) and int(state.num_skipped) == 0
    chex.assert_trees_all_close(updates, -(3 * g[0] + g[1]) / 4, rtol=1e-6)
    # a new group may change: its first call decides
    _, state = tx.update(g[1], state, params)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        tx.update(g[2], state, params, weight=1.0)
    updates, state = tx.update(g[2], state, params)
    assert bool(tx.has_updated(state)) and float(state.weight_sum) == 2.0
    chex.assert_trees_all_close(updates, -(g[1] + g[2]) / 2, rtol=1e-6)


def test_weight_passed_by_position():
    """`weight` is keyword-only: passed by position, the error says so and shows the value."""
    params = jnp.zeros(3)
    tx = jaxga.MultiSteps(optax.sgd(1.0), 2)
    message = (
        "`weight` is keyword-only: tx.update(grads, state, params, weight=...); "
        "got (2.0,) after params."
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        tx.update(params, tx.init(params), params, 2.0)


@pytest.mark.parametrize(
    "params, match",
    [
        ("params", r"^`params` must be a pytree of arrays; got 'params' of type str\.$"),
        (
            {"w": jnp.zeros(2), "act": "mlp"},
            r"^`params\['act'\]` must be an array or a number; got 'mlp' of type str\.$",
        ),
        (
            {"w": np.array(["a", "b"])},
            r"^`params\['w'\]` must hold numbers or bools; got dtype <U1\.$",
        ),
        ([None, object()], r"^`params\[1\]` must be an array or a number; got <object object"),
    ],
    ids=["a_string", "a_string_leaf", "a_string_array", "an_object_leaf"],
)
def test_bad_params(params, match):
    with pytest.raises(TypeError, match=match):
        jaxga.MultiSteps(optax.sgd(0.1), 2).init(params)


def test_skip_not_finite_names_a_leaf_that_is_not_an_array():
    message = "`updates[0]` must be an array or a number; got 'a' of type str."
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        jaxga.skip_not_finite(["a", "b"], 0)
    with pytest.raises(TypeError, match=r"^`updates` must be a pytree of arrays; got 'ab'"):
        jaxga.skip_not_finite("ab", 0)
    skip, report = jaxga.skip_not_finite([1.0, np.float32(2.0)], 0)  # numbers are arrays
    assert not bool(skip) and int(report["num_not_finite"]) == 0


def test_bad_grads_and_state():
    params = {"a": jnp.zeros(3), "b": jnp.zeros(2)}
    tx = jaxga.MultiSteps(optax.sgd(0.1), 2)
    state = tx.init(params)
    structure = r"PyTreeDef\(\{'a': \*, 'b': \*\}\); got PyTreeDef\(\{'a': \*\}\)\.$"
    with pytest.raises(
        TypeError, match=r"^`grads` must have the params' tree structure, " + structure
    ):
        tx.update({"a": jnp.zeros(3)}, state, params)
    with pytest.raises(ValueError, match=r"^`grads\['b'\]` must have shape \(2,\); got \(4,\)\.$"):
        tx.update({"a": jnp.zeros(3), "b": jnp.zeros(4)}, state, params)
    with pytest.raises(TypeError, match=r"^`grads\['b'\]` must be an array or a number; got 'x'"):
        tx.update({"a": jnp.zeros(3), "b": "x"}, state, params)
    with pytest.raises(
        TypeError, match=r"^`state` must be a jaxga.MultiStepsState; got a tuple\.$"
    ):
        tx.update(params, tuple(state), params)
    with pytest.raises(TypeError, match=r"^`state` must be a jaxga.MultiStepsState; got a dict\.$"):
        tx.has_updated({})


def test_bad_skip_predicate():
    params = jnp.zeros(3)
    expected = r"^`should_skip_update_fn` must return \(a bool, a report\); got "

    def bare(g, s, p):
        return jnp.array(False)  # the bool alone, without optax's report

    for fn, got in [
        (lambda g, s, p: (0, ()), r"\(ShapeDtypeStruct\(shape=\(\), dtype=int32"),  # an int skip
        (lambda g, s, p: (jnp.ones(2) > 0, ()), r"\(ShapeDtypeStruct\(shape=\(2,\), dtype=bool"),
        (bare, r"ShapeDtypeStruct\(shape=\(\), dtype=bool\)\.$"),
    ]:
        tx = jaxga.MultiSteps(optax.sgd(0.1), 2, should_skip_update_fn=fn)
        with pytest.raises(TypeError, match=expected + got):
            tx.init(params)  # checked once, where the report's structure is taken


def test_optax_spelling_ports_by_changing_the_class():
    inner = optax.adam(1e-2)
    ours = jaxga.MultiSteps(inner, every_k_schedule=3)
    theirs = optax.MultiSteps(inner, every_k_schedule=3, use_grad_mean=True)
    params = theirs_params = jnp.arange(4.0)
    state, theirs_state = ours.init(params), theirs.init(params)
    for i in range(6):
        g = jnp.sin(jnp.arange(4.0) + i)
        updates, state = ours.update(g, state, params)
        params = optax.apply_updates(params, updates)
        updates, theirs_state = theirs.update(g, theirs_state, theirs_params)
        theirs_params = optax.apply_updates(theirs_params, updates)
    chex.assert_trees_all_close(params, theirs_params, rtol=1e-6)


def test_every_k_once():
    message = "Pass one of `every_k` and `every_k_schedule`; got every_k=2, every_k_schedule=2."
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        jaxga.MultiSteps(optax.sgd(0.1), 2, every_k_schedule=2)
    with pytest.raises(TypeError, match=r"every_k=None, every_k_schedule=None\.$"):
        jaxga.MultiSteps(optax.sgd(0.1))


def test_optax_state_says_which_library_it_comes_from():
    params = jnp.zeros(2)
    optax_state = optax.MultiSteps(optax.sgd(0.1), 2).init(params)
    with pytest.raises(TypeError, match=r"MultiStepsState; got optax's MultiStepsState\.$"):
        jaxga.MultiSteps(optax.sgd(0.1), 2).update(jnp.ones(2), optax_state, params)


def test_a_call_of_weight_zero_is_not_looked_at():
    """An all-padding call (count 0, so a 0 / 0 gradient) leaves the group's mean alone."""
    params = jnp.zeros(2)
    tx = jaxga.MultiSteps(optax.sgd(1.0), 2)
    state = tx.init(params)
    _, state = tx.update(jnp.array([1.0, 2.0]), state, params, weight=3.0)
    updates, state = tx.update(jnp.array([jnp.nan, 5.0]), state, params, weight=0.0)
    assert bool(tx.has_updated(state))
    chex.assert_trees_all_close(updates, jnp.array([-1.0, -2.0]))


def test_a_traced_schedule_of_the_wrong_type_is_named_by_its_type():
    params = jnp.zeros(3)
    tx = jaxga.MultiSteps(optax.sgd(0.1), lambda step: step * 2.5)  # a traced float
    said = r"^The `every_k` schedule must return an int scalar >= 1; got a traced float32\[\]\."
    with pytest.raises(TypeError, match=said):
        jax.jit(tx.update)(params, tx.init(params), params)
