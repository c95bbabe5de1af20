"""Tokens, not rows: Mean.of's normalisations, num_real_microbatches and MultiSteps' end_group.

Every number is checked against an independent reference: plain ``jax.value_and_grad`` (or
``nnx.value_and_grad``) of a loss written sequence by sequence on the whole (real) batch,
optax itself, or a Python loop; never against jaxga.
"""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxga
from tests._hlo import parse_computations

RTOL, ATOL = 2e-5, 1e-6  # float32 rounding: matmuls at "highest" precision (conftest.py)
ROWS, LENGTH, VOCAB, DIM = 16, 8, 7, 4
K = 4  # micro-batches of the num_real_microbatches tests
LR = 0.5
NORMALIZATIONS = ("token_mean", "sequence_mean", "sequence_sum")

assert_trees_close = functools.partial(chex.assert_trees_all_close, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------- model, data, references


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.normal(size=(VOCAB, DIM)).astype(np.float32),
        "out": (rng.normal(size=(DIM, VOCAB)) / np.sqrt(DIM)).astype(np.float32),
    }


PARAMS = make_params()


def logits_of(params, tokens):
    return params["embed"][tokens] @ params["out"]


def padded_batch(seed=1, rows=ROWS):
    """One sequence a row, of very different lengths (0 to LENGTH), padded at the end.

    Returns the batch and its sequences, ``[(row, positions)]``, read off the lengths.
    """
    rng = np.random.default_rng(seed)
    lengths = np.where(rng.random(rows) < 0.3, LENGTH, rng.integers(0, 3, rows))
    lengths[:2] = LENGTH, 0  # micro-batch 0 always counts; a row of padding alone
    batch = {
        "tokens": rng.integers(0, VOCAB, (rows, LENGTH)),
        "labels": rng.integers(0, VOCAB, (rows, LENGTH)),
        "mask": (np.arange(LENGTH) < lengths[:, None]).astype(np.float32),
    }
    return batch, [(r, np.arange(n)) for r, n in enumerate(lengths)]


def packed_batch(seed=6, rows=ROWS):
    """Rows packing 0 to 8 sequences of 1 to 4 tokens, then padding (id 0, label -100).

    A row's ids are distinct non-zero ids in any order, the same ids again in other rows
    (other sequences). Each sequence's first token is masked out, as its label would be
    the previous sequence's: a one-token sequence counts nothing. Returns the batch and
    ``[(row, positions)]``, the counted positions of each (row, id).
    """
    rng = np.random.default_rng(seed)
    ids = np.zeros((rows, LENGTH), np.int32)
    mask = np.ones((rows, LENGTH), np.float32)
    sequences = []
    for r in range(rows):
        fill = LENGTH if r == 0 else 0 if r == 1 else int(rng.integers(0, LENGTH + 1))
        names, start = rng.permutation(np.arange(1, LENGTH + 1)), 0
        for name in names:
            if start >= fill:
                break
            size = min(int(rng.integers(1, 5)), fill - start)
            ids[r, start : start + size] = name
            mask[r, start] = 0.0
            sequences.append((r, np.arange(start + 1, start + size)))
            start += size
    labels = np.where(ids != 0, rng.integers(0, VOCAB, (rows, LENGTH)), -100)
    batch = {"tokens": rng.integers(0, VOCAB, (rows, LENGTH)), "labels": labels}
    return {**batch, "mask": mask, "ids": ids}, sequences


BATCHES = {"rows": padded_batch(), "packed": packed_batch()}


def token_losses(params, batch):
    """Each token's cross-entropy, written out: log-sum-exp minus the label's logit."""
    logits = logits_of(params, batch["tokens"])
    labels = jnp.maximum(batch["labels"], 0)  # padding's -100: looked up, never used
    picked = jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
    return jax.nn.logsumexp(logits, -1) - picked


def reference_loss(params, batch, sequences, normalize):
    """The loss as its definition reads, one sequence at a time; empty ones do not count."""
    losses = token_losses(params, batch)
    per_sequence = [losses[r, positions] for r, positions in sequences if len(positions)]
    if normalize == "token_mean":
        return sum(jnp.sum(x) for x in per_sequence) / sum(len(x) for x in per_sequence)
    if normalize == "sequence_mean":
        return sum(jnp.mean(x) for x in per_sequence) / len(per_sequence)
    assert normalize == "sequence_sum"
    return sum(jnp.sum(x) for x in per_sequence) / len(per_sequence)


def reference_count(sequences, normalize):
    """Tokens for the token mean, else sequences with a counted token."""
    sizes = [len(positions) for _, positions in sequences]
    return sum(sizes) if normalize == "token_mean" else sum(n > 0 for n in sizes)


@functools.cache
def reference(kind, normalize, rows=None):
    """Value and gradient of the reference on ``BATCHES[kind]``, or on its ``rows`` alone."""
    batch, sequences = subset(*BATCHES[kind], rows)
    loss = functools.partial(reference_loss, batch=batch, sequences=sequences, normalize=normalize)
    value, grads = jax.value_and_grad(loss)(PARAMS)  # eagerly: no compilation per shape
    return value, grads, reference_count(sequences, normalize)


def subset(batch, sequences, rows):
    """``batch``'s ``rows`` (a tuple, in that order; ``None``: all) and their sequences."""
    if rows is None:
        return batch, sequences
    new = {r: i for i, r in enumerate(rows)}
    picked = [(new[r], positions) for r, positions in sequences if r in new]
    return jax.tree.map(lambda x: x[np.asarray(rows)], batch), picked


def real_rows(n, k=K, rows=ROWS):
    """The rows of micro-batches 0..n-1: micro-batch i holds rows i, i + k, ... (strided)."""
    return tuple(int(r) for r in np.flatnonzero(np.arange(rows) % k < n))


def token_loss(normalize):
    def loss(params, batch):
        logits = logits_of(params, batch["tokens"])
        ids = batch.get("ids")
        return jaxga.token_cross_entropy(
            logits, batch["labels"], batch["mask"], normalize=normalize, segment_ids=ids
        )

    return loss


def state_loss(normalize):
    """``token_loss`` as make_train_step takes it."""

    def loss(params, batch, model_state, rng):
        return token_loss(normalize)(params, batch), model_state

    return loss


def sgd_step(params, grads):
    return jax.tree.map(lambda p, g: p - LR * g, params, grads)


def numpy_loss(losses, sequences, normalize):
    """``reference_loss``'s value from the tokens' losses, in numpy."""
    per_sequence = [losses[r, positions] for r, positions in sequences if len(positions)]
    total = sum(x.sum() for x in per_sequence)
    if normalize == "token_mean":
        return total / sum(len(x) for x in per_sequence)
    if normalize == "sequence_mean":
        return sum(x.mean() for x in per_sequence) / len(per_sequence)
    return total / len(per_sequence)


def test_the_batches_tell_the_normalisations_and_a_mean_of_means_apart():
    """Otherwise a wrong normalisation, a mean of means or a wrong weight could pass."""
    for kind, (batch, sequences) in BATCHES.items():
        assert any(len(p) == 0 for _, p in sequences) and len({len(p) for _, p in sequences}) > 3
        losses = np.asarray(token_losses(PARAMS, batch), np.float64)
        values = [numpy_loss(losses, sequences, normalize) for normalize in NORMALIZATIONS]
        assert min(abs(a - b) for a, b in zip(values, values[1:] + values[:1])) > 1e-3
        assert (
            reference_count(sequences, "token_mean")
            > reference_count(sequences, "sequence_mean") + 10
        )
        for normalize, value in zip(NORMALIZATIONS, values):
            for parts in ((range(0, ROWS, 2), range(1, ROWS, 2)), (range(8), range(8, ROWS))):
                picked = [subset(batch, sequences, tuple(rows)) for rows in parts]
                means = [
                    numpy_loss(losses[list(rows)], s, normalize)
                    for rows, (_, s) in zip(parts, picked)
                ]
                assert abs(np.mean(means) - value) > 2e-4, (kind, normalize, parts)
    # the halves' tokens per sequence differ: weighing them by tokens would be wrong
    halves = [subset(*BATCHES["packed"], tuple(range(h, h + 8)))[1] for h in (0, 8)]
    (t0, s0), (t1, s1) = ([reference_count(x, n) for n in NORMALIZATIONS[:2]] for x in halves)
    assert abs(t0 / s0 - t1 / s1) > 0.2


# ---------------------------------------------------------------- each normalisation


KS = (2, 4, 8)


@functools.cache
def accumulated_whole_batch(kind):
    """jaxga.value_and_grad of every normalisation and k: one program (one compilation)."""

    def run(params, batch):
        return {
            (normalize, k): jaxga.value_and_grad(token_loss(normalize), num_microbatches=k)(
                params, batch
            )
            for normalize in NORMALIZATIONS
            for k in KS
        }

    return jax.jit(run)(PARAMS, BATCHES[kind][0])


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("normalize", NORMALIZATIONS)
@pytest.mark.parametrize("kind", ["rows", "packed"])
def test_each_normalisation_matches_the_whole_batch(kind, normalize, k):
    value, grads, _ = reference(kind, normalize)
    assert_trees_close(accumulated_whole_batch(kind)[normalize, k], (value, grads))


def test_mean_of_weights_a_sequence_mean_by_each_sequences_own_weights():
    """Float weights and packed rows, by hand: each (row, id) its own weighted mean."""
    values = np.array([[1.0, 3.0, 4.0, 8.0, 9.0], [2.0, 6.0, 5.0, 7.0, np.nan]], np.float32)
    weights = np.array([[1.0, 3.0, 2.0, 0.0, 1.0], [0.5, 0.5, 0.0, 1.0, 0.0]], np.float32)
    ids = np.array([[2, 2, 1, 1, 0], [1, 1, 2, 3, 3]], np.int32)
    # row 0: id 2 -> (1 + 9) / 4, id 1 -> 4 (its 8 weighs 0), 0 -> padding (9 not counted)
    # row 1: id 1 -> 4, id 2 -> no weight: not a sequence, id 3 -> 7 (its NaN weighs 0)
    sums = {"token_mean": (10.0 + 8.0 + 4.0 + 7.0, 8.0)}
    sums["sequence_mean"] = (2.5 + 4.0 + 4.0 + 7.0, 4.0)
    sums["sequence_sum"] = (sums["token_mean"][0], 4.0)
    for normalize, (total, count) in sums.items():
        m = jaxga.Mean.of(values, where=weights, normalize=normalize, segment_ids=ids)
        np.testing.assert_allclose([m.total, m.count], [total, count], rtol=1e-6)
    rows = jaxga.Mean.of(values[:, :4], where=weights[:, :4], normalize="sequence_mean")
    np.testing.assert_allclose(
        [rows.total, rows.count], [(1 + 9 + 8) / 6 + (1 + 3 + 7) / 2, 2], rtol=1e-6
    )


def test_padding_by_segment_ids_alone_leaves_its_labels_out_eagerly():
    """Padding marked only by id 0 (its mask 1) may hold labels outside the vocabulary."""
    batch, _ = BATCHES["packed"]
    logits = logits_of(PARAMS, batch["tokens"])
    for normalize in NORMALIZATIONS:
        m = jaxga.token_cross_entropy(
            logits, batch["labels"], batch["mask"], normalize=normalize, segment_ids=batch["ids"]
        )
        expected = reference("packed", normalize)
        np.testing.assert_allclose([m.value, m.count], [expected[0], expected[2]], rtol=RTOL)


def numpy_mean_of(values, weights, ids, normalize):
    """Mean.of's definition in loops: sequences are the (row, non-zero id) pairs."""
    sequences = []
    for r in range(values.shape[0]):
        for name in sorted(set(ids[r]) - {0}):
            w = weights[r][ids[r] == name]
            if w.sum() > 0:
                sequences.append((values[r][ids[r] == name], w))
    total = sum(float(np.sum(v * w)) for v, w in sequences)
    if normalize == "token_mean":
        return total, sum(float(w.sum()) for _, w in sequences)
    if normalize == "sequence_mean":
        total = sum(float(np.sum(v * w) / w.sum()) for v, w in sequences)
    return total, float(len(sequences))


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    normalize=st.sampled_from(NORMALIZATIONS),
    zeros=st.floats(0.0, 0.9),
)
def test_property_mean_of_matches_loops_over_sequences(seed, normalize, zeros):
    """Any ids (a sequence's tokens need not be contiguous) and weights (many zeros)."""
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(3, 6)).astype(np.float32)
    weights = rng.uniform(0, 2, (3, 6)) * (rng.uniform(size=(3, 6)) > zeros)
    ids = rng.integers(0, 7, (3, 6)).astype(np.int32)
    m = jaxga.Mean.of(
        values, where=weights.astype(np.float32), normalize=normalize, segment_ids=ids
    )
    expected = numpy_mean_of(values, weights.astype(np.float32), ids, normalize)
    np.testing.assert_allclose([m.total, m.count], expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- two devices


@pytest.mark.skipif(jax.device_count() < 2, reason="needs two (host) devices")
@pytest.mark.parametrize("normalize", NORMALIZATIONS)
def test_two_devices_take_the_whole_batchs_sgd_step(normalize, kind="packed"):
    """Each device's rows have their own sequence counts: it is their sum that divides."""
    value, grads, count = reference(kind, normalize)
    mesh = jax.make_mesh((2,), ("data",))
    step = jaxga.make_train_step(state_loss(normalize), 2, mesh=mesh)
    state = jaxga.TrainState.create(params=PARAMS, tx=optax.sgd(LR))
    state, metrics = step(state, BATCHES[kind][0])
    assert_trees_close(state.params, sgd_step(PARAMS, grads))
    np.testing.assert_allclose(metrics["loss"], value, rtol=RTOL)
    assert float(metrics["count"]) == count


# ---------------------------------------------------------------- MultiSteps over calls


@pytest.mark.parametrize("normalize", NORMALIZATIONS)
def test_two_multisteps_calls_on_half_batches_take_the_whole_batchs_step(normalize):
    """The weight a call gives MultiSteps, its Mean's count, is its sequence count."""
    _, grads, _ = reference("packed", normalize)
    accumulated = jax.jit(jaxga.accumulate(token_loss(normalize), num_microbatches=2))
    tx = jaxga.MultiSteps(optax.sgd(LR), every_k=2)
    params, state = PARAMS, tx.init(PARAMS)
    for half in (tuple(range(8)), tuple(range(8, 16))):
        batch, sequences = subset(*BATCHES["packed"], half)
        acc = accumulated(params, batch)
        assert float(acc.mean.count) == reference_count(sequences, normalize)
        updates, state = tx.update(acc.grads, state, params, weight=acc.mean.count)
        params = optax.apply_updates(params, updates)
    assert bool(state.applied)
    assert_trees_close(params, sgd_step(PARAMS, grads))


# ---------------------------------------------------------------- num_real_microbatches


def test_real_microbatches_alone_count_in_one_compiled_function():
    traces = []

    @jax.jit
    def run(params, batch, n):
        traces.append(n)  # a Python side effect: runs once per trace
        means_and_grads = {}
        for normalize in NORMALIZATIONS:
            options = {"num_microbatches": K, "num_real_microbatches": n}
            acc = jaxga.accumulate(token_loss(normalize), **options)(params, batch)
            means_and_grads[normalize] = acc.mean, acc.grads
        return means_and_grads

    for n in range(1, K + 1):
        out = run(PARAMS, BATCHES["packed"][0], n)
        for normalize, (mean, grads) in out.items():
            value, expected, count = reference("packed", normalize, rows=real_rows(n))
            assert_trees_close((mean.value, grads), (value, expected))
            assert float(mean.count) == count
    assert len(traces) == 1 and run._cache_size() == 1


def regression_batch(rows=ROWS, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3)).astype(np.float32)
    return {"x": x, "y": (x @ [1.0, -2.0, 0.5] + rng.normal(size=rows)).astype(np.float32)}


def scalar_loss(w, batch):
    """A float, its micro-batch's mean over rows, not a Mean: each row counts once."""
    return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


@pytest.mark.parametrize("unroll", [1, True])
def test_a_scalar_loss_counts_the_real_rows(unroll):
    w, batch = jnp.array([0.3, -0.1, 0.2]), regression_batch()

    @jax.jit
    def run(w, batch, n):
        options = {"num_microbatches": K, "num_real_microbatches": n, "unroll": unroll}
        acc = jaxga.accumulate(scalar_loss, **options)(w, batch)
        return acc.mean, acc.grads

    for n in range(1, K + 1):
        rows = np.asarray(real_rows(n))
        expected = jax.value_and_grad(scalar_loss)(w, jax.tree.map(lambda x: x[rows], batch))
        mean, grads = run(w, batch, n)
        assert_trees_close((mean.value, grads), expected)
        assert float(mean.count) == len(rows) == n * ROWS // K
    assert run._cache_size() == 1
    # an int given eagerly, to jaxga.grad and value_and_grad run without jit
    rows = np.asarray(real_rows(2))
    expected = jax.value_and_grad(scalar_loss)(w, jax.tree.map(lambda x: x[rows], batch))
    options = {"num_microbatches": K, "num_real_microbatches": 2, "unroll": unroll}
    assert_trees_close(jaxga.value_and_grad(scalar_loss, **options)(w, batch), expected)
    assert_trees_close(jaxga.grad(scalar_loss, **options)(w, batch), expected[1])


def test_padding_microbatches_are_not_run_and_give_zero_aux_rows():
    """Micro-batches n.. full of NaN (built as merge_microbatches of stacked micro-batches):
    their loss never runs (a host callback counts the runs), nothing of them reaches the
    value or the gradient, and their aux rows are zeros."""
    whole = BATCHES["rows"][0]
    stacked = jaxga.split_microbatches(whole, K)
    poison = {**stacked, "mask": np.full(stacked["mask"].shape, np.nan, np.float32)}
    runs = []

    def loss(params, batch):
        jax.debug.callback(lambda: runs.append(1))
        rows = jnp.sum(batch["mask"] * token_losses(params, batch), -1)  # aux: a row each
        return token_loss("sequence_mean")(params, batch), rows

    def run(params, batch, n):
        options = {"num_microbatches": K, "num_real_microbatches": n, "aux": "rows"}
        return jaxga.value_and_grad(loss, has_aux=True, **options)(params, batch)

    run = jax.jit(run)
    for n in range(1, K + 1):
        batch = jax.tree.map(
            lambda real, bad: jaxga.merge_microbatches(np.concatenate([real[:n], bad[n:]])),
            stacked,
            poison,
        )
        runs.clear()
        (value, aux), grads = run(PARAMS, batch, n)
        jax.effects_barrier()
        assert len(runs) == n
        expected_value, expected_grads, _ = reference("rows", "sequence_mean", rows=real_rows(n))
        assert_trees_close((value, grads), (expected_value, expected_grads))
        rows = np.asarray(real_rows(n))
        per_row = np.sum(whole["mask"] * token_losses(PARAMS, whole), -1)
        np.testing.assert_allclose(np.asarray(aux)[rows], per_row[rows], rtol=RTOL, atol=ATOL)
        assert not np.any(np.asarray(aux)[np.setdiff1d(np.arange(ROWS), rows)])
    assert run._cache_size() == 1
    # the same NaN in a micro-batch that runs poisons everything: the checks above can fail
    poisoned = {**whole, "mask": np.where(np.arange(ROWS)[:, None] % K == 1, np.nan, 1.0)}
    (value, _), grads = run(PARAMS, poisoned, K - 1)
    assert np.isnan(value) and np.isnan(np.asarray(grads["out"])).all()


def reachable(computations, roots):
    """The HLO computations ``roots`` name and all those they call, directly or not."""
    pending, found = list(roots), {}
    while pending:
        name = pending.pop()
        if name in computations and name not in found:
            found[name] = computations[name]
            pending.extend(n for line in found[name] for n in re.findall(r"%([\w.\-]+)", line))
    return found


def opcodes(computations):
    return {
        m.group(1)
        for lines in computations.values()
        for line in lines
        if (m := re.search(r"=\s*\S+\s+([\w\-]+)\(", line))
    }


def test_the_compiled_loop_holds_a_conditional_whose_skip_branch_does_no_work():
    """A traced count compiles to a conditional inside the micro-batch loop: a skipped
    micro-batch takes a branch without the forward and backward pass (no dot, no gather)."""

    def run(params, batch, n):
        loss = token_loss("token_mean")
        return jaxga.value_and_grad(loss, num_microbatches=K, num_real_microbatches=n)(
            params, batch
        )

    compiled = jax.jit(run).lower(PARAMS, BATCHES["rows"][0], 2).compile()
    computations = parse_computations(compiled.as_text())
    bodies = [
        name
        for lines in computations.values()
        for line in lines
        if re.search(r"\swhile\(", line)
        for name in re.findall(r"\bbody=%?([\w.\-]+)", line)
    ]
    loop = reachable(computations, bodies)
    conditionals = [line for lines in loop.values() for line in lines if " conditional(" in line]
    assert len(conditionals) == 1, conditionals
    branches = re.search(r"branch_computations=\{([^}]*)\}", conditionals[0]).group(1)
    ops = [opcodes(reachable(computations, [b])) for b in re.findall(r"%?([\w.\-]+)", branches)]
    work = {"dot", "gather", "scatter", "exponential"}
    assert sorted(bool(o & work) for o in ops) == [False, True], ops


@pytest.mark.parametrize("devices", [1, 2])
def test_make_train_step_takes_the_real_rows_step_with_one_compilation(devices):
    if jax.device_count() < devices:
        pytest.skip("needs two (host) devices")
    mesh = jax.make_mesh((2,), ("data",)) if devices == 2 else None
    step = jaxga.make_train_step(state_loss("sequence_mean"), K, mesh=mesh)
    # micro-batch i of each device's rows: on two devices too, global rows i, i + K, ...
    tx = optax.sgd(LR)  # one optimiser: a new one is a new static field, a new compilation
    for n in (1, np.int64(2), jnp.int32(3), 4):  # all int32 in the step: one compilation
        state = jaxga.TrainState.create(params=PARAMS, tx=tx)
        state, metrics = step(state, BATCHES["packed"][0], num_real_microbatches=n)
        value, grads, count = reference("packed", "sequence_mean", rows=real_rows(int(n)))
        assert_trees_close(state.params, sgd_step(PARAMS, grads))
        np.testing.assert_allclose(metrics["loss"], value, rtol=RTOL)
        assert float(metrics["count"]) == count
    assert step._jitted._cache_size() == 1


def test_make_train_step_lowers_for_an_abstract_count_as_for_a_concrete_one():
    """step.lower(state, batch, ShapeDtypeStruct((), int32)): the program a call with any
    count runs (its HLO the concrete count's); an abstract count of another shape or dtype
    is refused, named, and so is an abstract count given to a call."""
    step = jaxga.make_train_step(state_loss("sequence_mean"), K)
    state = jaxga.TrainState.create(params=PARAMS, tx=optax.sgd(LR))
    batch = BATCHES["packed"][0]
    for count in (jax.ShapeDtypeStruct((), jnp.int16), jax.ShapeDtypeStruct((), jnp.int32)):
        abstract = step.lower(state, batch, count).as_text()
        assert abstract == step.lower(state, batch, 2).as_text()
    for bad, got in (
        (jax.ShapeDtypeStruct((2,), jnp.int32), r"int32\[2\]"),
        (jax.ShapeDtypeStruct((), jnp.float32), r"float32\[\]"),
    ):
        with pytest.raises(TypeError, match=rf"abstract `num_real_microbatches` .* got {got}"):
            step.lower(state, batch, bad)
    with pytest.raises(TypeError, match=r"`num_real_microbatches` is a jax.ShapeDtypeStruct"):
        step(state, batch, jax.ShapeDtypeStruct((), jnp.int32))


class TokenModel(nnx.Module):
    def __init__(self, params):
        self.embed = nnx.Param(jnp.asarray(params["embed"]))
        self.out = nnx.Param(jnp.asarray(params["out"]))

    def __call__(self, tokens):
        return self.embed[...][tokens] @ self.out[...]


def nnx_token_loss(model, batch):
    logits = model(batch["tokens"])
    return jaxga.token_cross_entropy(
        logits, batch["labels"], batch["mask"], normalize="sequence_sum", segment_ids=batch["ids"]
    )


def test_nnx_train_step_takes_the_real_rows_step_with_one_compilation():
    step = jaxga.nnx_train_step(nnx_token_loss, K)
    tx = optax.sgd(LR)  # one optimiser: the step's static graph is the same for every model
    for n in range(1, K + 1):
        model = TokenModel(PARAMS)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        metrics = step(model, optimizer, BATCHES["packed"][0], num_real_microbatches=n)
        _, grads, count = reference("packed", "sequence_sum", rows=real_rows(n))
        trained = {"embed": model.embed[...], "out": model.out[...]}
        assert_trees_close(trained, sgd_step(PARAMS, grads))
        assert float(metrics["count"]) == count
    assert step._jitted._cache_size() == 1


def regression_state():
    return jaxga.TrainState.create(params=jnp.zeros(3), tx=optax.sgd(LR))


def regression_step_loss(w, batch, model_state, rng):
    return scalar_loss(w, batch), model_state


def nnx_regression():
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)


ENTRIES = {
    "accumulate": lambda n: jaxga.accumulate(
        scalar_loss, num_microbatches=K, num_real_microbatches=n
    ),
    "value_and_grad": lambda n: jaxga.value_and_grad(
        scalar_loss, num_microbatches=K, num_real_microbatches=n
    ),
    "grad": lambda n: jaxga.grad(scalar_loss, num_microbatches=K, num_real_microbatches=n),
    "make_train_step": lambda n: jaxga.make_train_step(regression_step_loss, K)(
        regression_state(), regression_batch(), num_real_microbatches=n
    ),
    "nnx_train_step": lambda n: jaxga.nnx_train_step(lambda m, b: scalar_loss(m, b), K)(
        *nnx_regression(), regression_batch(), num_real_microbatches=n
    ),
}


@pytest.mark.parametrize(
    "n, error",
    [
        (0, ValueError),
        (K + 1, ValueError),
        (-1, ValueError),
        (2.5, TypeError),
        ("2", TypeError),
        (True, TypeError),
        (np.array([2]), TypeError),
    ],
)
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_bad_num_real_microbatches_is_named(entry, n, error):
    with pytest.raises(error, match=r"`num_real_microbatches`") as raised:
        ENTRIES[entry](n)
    if error is ValueError:
        assert f"got {n}" in str(raised.value) and f"{K}" in str(raised.value)


def test_a_traced_float_num_real_microbatches_is_named():
    def run(w, batch, n):
        return jaxga.grad(scalar_loss, num_microbatches=K, num_real_microbatches=n)(w, batch)

    with pytest.raises(TypeError, match=r"`num_real_microbatches`"):
        jax.jit(run)(jnp.zeros(3), regression_batch(), 2.0)


@pytest.mark.parametrize("n", [0, K + 1])
def test_an_int_count_out_of_range_is_refused_inside_jit_too(n):
    """A Python int is checked on the host, also when the function is built inside a jit
    (where a traced count cannot be, and would silently run all, or none)."""

    def run(w, batch):
        return jaxga.grad(scalar_loss, num_microbatches=K, num_real_microbatches=n)(w, batch)

    with pytest.raises(ValueError, match=rf"`num_real_microbatches` must be in 1..{K}"):
        jax.jit(run)(jnp.zeros(3), regression_batch())


def test_an_auto_step_refuses_a_real_count():
    step = jaxga.make_train_step(state_loss("token_mean"), "auto", memory_budget="1GiB")
    state = jaxga.TrainState.create(params=PARAMS, tx=optax.sgd(LR))
    with pytest.raises(ValueError, match=r"`num_real_microbatches` needs a fixed k"):
        step(state, BATCHES["packed"][0], num_real_microbatches=1)


def test_segment_ids_out_of_range_under_jit_make_the_count_nan():
    """Eagerly they raise; traced they cannot, and a sequence count built on them would be
    silently wrong: it is NaN instead."""
    values, ids = jnp.array([[1.0, 3.0, 4.0, 8.0]]), jnp.array([[1, 1, 7, 7]])
    for normalize in ("sequence_mean", "sequence_sum"):
        mean = jax.jit(lambda i: jaxga.Mean.of(values, segment_ids=i, normalize=normalize))(ids)
        assert np.isnan(mean.count) and np.isnan(mean.value)


@pytest.mark.parametrize("normalize", NORMALIZATIONS)
def test_negative_segment_ids_are_padding(normalize):
    """-1 for padding (a common convention) counts nothing, as 0 does, traced or not."""
    values = jnp.array([[1.0, 3.0, 4.0, 8.0], [2.0, 5.0, 7.0, 9.0]])
    padded, zeros = (
        jnp.array([[1, 1, 2, -1], [1, -1, -1, -1]]),
        jnp.array([[1, 1, 2, 0], [1, 0, 0, 0]]),
    )
    for of in (jaxga.Mean.of, jax.jit(jaxga.Mean.of, static_argnames="normalize")):
        expected = of(values, segment_ids=zeros, normalize=normalize)
        assert_trees_close(of(values, segment_ids=padded, normalize=normalize), expected)


class NormDropout(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.norm(self.linear(x)))


def test_nnx_batchnorm_and_dropout_skip_with_the_padding_micro_batches():
    """n = 2 of k = 4: the loss, BatchNorm statistics and dropout streams are those of a
    step compiled for the two real micro-batches alone; padding updates no state."""
    rows = 2
    stacked = np.random.default_rng(3).normal(size=(K, rows, 3)).astype(np.float32)

    def loss(model, x):
        return jaxga.Mean.of(model(x) ** 2)

    def run(k, batch, **call):
        model = NormDropout(nnx.Rngs(params=0, dropout=1))
        optimizer = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)
        metrics = jaxga.nnx_train_step(loss, k)(model, optimizer, batch, **call)
        return metrics, nnx.state(model, nnx.Not(nnx.RngKey))  # counts, stats, params

    skipping = run(K, jaxga.merge_microbatches(stacked), num_real_microbatches=2)
    exact = run(2, jaxga.merge_microbatches(stacked[:2]))
    chex.assert_trees_all_close(skipping[0], exact[0], rtol=RTOL, atol=ATOL)
    chex.assert_trees_all_close(skipping[1], exact[1], rtol=RTOL, atol=ATOL)
    everything = run(K, jaxga.merge_microbatches(stacked))  # the padding, had it run
    assert not np.allclose(everything[1]["norm"]["mean"][...], exact[1]["norm"]["mean"][...])


# ---------------------------------------------------------------- MultiSteps end_group

EVERY_K, BUDGET = 4, 10
TOKENS = [7, 2, 9, 0, 3, 4, 12, 1, 1, 2, 1, 12, 5, 6]  # groups: 3, 4, 4 (every_k), 1, 2 calls


def end_group_flags(tokens, budget):
    """A data loader's choice: end the group once it holds ``budget`` tokens."""
    flags, held = [], 0
    for n in tokens:
        held += n
        flags.append(held >= budget)
        held = 0 if held >= budget else held
    return flags


def call_grads(calls, seed=4):
    rng = np.random.default_rng(seed)
    return [
        {"w": rng.normal(size=3).astype(np.float32), "b": np.float32(rng.normal())}
        for _ in range(calls)
    ]


def inner_optimizer():
    return optax.sgd(LR, momentum=0.9)  # its state: it must run once per group, in order


def grouped_reference(params, grads, tokens, flags, every_k):
    """A Python loop: optax on the token-weighted mean of each group's gradients."""
    inner = inner_optimizer()
    state, group, out = inner.init(params), [], []
    for g, n, end in zip(grads, tokens, flags):
        group.append((g, n))
        applied = False
        if end or len(group) == every_k:
            total = sum(w for _, w in group)
            if total > 0:
                mean = jax.tree.map(
                    lambda *gs: sum(w * x for (_, w), x in zip(group, gs)) / total,
                    *[x for x, _ in group],
                )
                updates, state = inner.update(mean, state, params)
                params, applied = optax.apply_updates(params, updates), True
            group = []
        out.append((params, applied))
    return out


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "traced"])
def test_end_group_ends_groups_by_a_token_budget(jit):
    flags = end_group_flags(TOKENS, BUDGET)
    assert flags != [False] * len(TOKENS) and sum(flags) < 5  # every_k ends a group too
    grads = call_grads(len(TOKENS))
    params = {"w": jnp.zeros(3), "b": jnp.float32(0)}  # device arrays: as the updated ones
    expected = grouped_reference(params, grads, TOKENS, flags, EVERY_K)
    tx = jaxga.MultiSteps(inner_optimizer(), EVERY_K)

    def update(g, state, params, n, end):
        return tx.update(g, state, params, weight=n, end_group=end)

    update = jax.jit(update) if jit else update
    state = tx.init(params)
    for i, (g, n, end) in enumerate(zip(grads, TOKENS, flags)):
        end = jnp.asarray(end) if jit else end
        updates, state = update(g, state, params, n, end)
        params = optax.apply_updates(params, updates)
        expected_params, applied = expected[i]
        assert bool(state.applied) == applied, i
        assert_trees_close(params, expected_params)
        if applied:
            assert int(state.mini_step) == 0
    assert int(state.gradient_step) == sum(applied for _, applied in expected) == 5
    if jit:
        assert update._cache_size() == 1


def test_end_group_on_a_groups_first_call_applies_that_call_alone():
    grads = call_grads(5, seed=5)
    params = {"w": np.ones(3, np.float32), "b": np.float32(1)}
    flags = [np.bool_(True), False, False, True, jnp.bool_(True)]
    expected = grouped_reference(params, grads, [3, 1, 2, 5, 4], flags, every_k=3)
    tx = jaxga.MultiSteps(inner_optimizer(), every_k=3)
    state = tx.init(params)
    applied = []
    for g, n, end, (expected_params, _) in zip(grads, [3, 1, 2, 5, 4], flags, expected):
        updates, state = tx.update(g, state, params, weight=n, end_group=end)
        params = optax.apply_updates(params, updates)
        applied.append(bool(state.applied))
        assert_trees_close(params, expected_params)
    assert applied == [True, False, False, True, True] == [a for _, a in expected]


@pytest.mark.parametrize("end_group", [1, 0, 1.0, "yes", None, np.array([True]), jnp.int32(1)])
def test_a_bad_end_group_is_named(end_group):
    """None fails at the time of writing: jnp.asarray(None) raises a ValueError, not caught."""
    tx = jaxga.MultiSteps(optax.sgd(LR), every_k=2)
    params = jnp.zeros(2)
    with pytest.raises(TypeError, match=r"`end_group`"):
        tx.update(jnp.ones(2), tx.init(params), params, weight=1, end_group=end_group)


# ---------------------------------------------------------------- bad inputs


def mean_of(**kwargs):
    return jaxga.Mean.of(np.ones((2, 5), np.float32), **kwargs)


def cross_entropy(**kwargs):
    logits, labels = np.zeros((2, 5, 3), np.float32), np.zeros((2, 5), np.int32)
    return jaxga.token_cross_entropy(logits, labels, **kwargs)


@pytest.mark.parametrize("fn", [mean_of, cross_entropy], ids=["Mean.of", "token_cross_entropy"])
@pytest.mark.parametrize(
    "kwargs, error, parts",
    [
        ({"segment_ids": np.ones((2, 4), np.int32)}, ValueError, ["(2, 5)", "(2, 4)"]),
        ({"segment_ids": np.ones(5, np.int32)}, ValueError, ["(2, 5)", "(5,)"]),
        ({"segment_ids": np.ones((2, 5), np.float32)}, TypeError, ["float32"]),
        ({"segment_ids": np.full((2, 5), 6)}, ValueError, ["6"]),
    ],
)
@pytest.mark.parametrize("normalize", NORMALIZATIONS)
def test_bad_segment_ids_are_named(fn, kwargs, error, parts, normalize):
    with pytest.raises(error, match=r"`segment_ids`") as raised:
        fn(normalize=normalize, **kwargs)
    assert all(part in str(raised.value) for part in parts), raised.value


@pytest.mark.parametrize("fn", [mean_of, cross_entropy], ids=["Mean.of", "token_cross_entropy"])
@pytest.mark.parametrize("normalize", ["mean", "sequence", None, "TOKEN_MEAN"])
def test_an_unknown_normalisation_lists_the_choices(fn, normalize):
    with pytest.raises(ValueError, match=r"`normalize`") as raised:
        fn(normalize=normalize)
    assert all(repr(choice) in str(raised.value) for choice in (*NORMALIZATIONS, normalize))


def test_ids_up_to_the_token_count_are_accepted():
    m = mean_of(normalize="sequence_mean", segment_ids=np.array([[5, 4, 3, 2, 1], [0] * 5]))
    assert float(m.count) == 5.0 and float(m.value) == 1.0


@pytest.mark.parametrize("normalize", NORMALIZATIONS[1:])
def test_a_sequence_normalisation_of_a_scalar_is_refused(normalize):
    with pytest.raises(ValueError, match=r"scalar"):
        jaxga.Mean.of(2.0, normalize=normalize)
    with pytest.raises(ValueError, match=r"scalar"):
        jaxga.token_cross_entropy(np.zeros(3, np.float32), np.int32(1), normalize=normalize)
    assert float(jaxga.Mean.of(2.0).value) == 2.0  # the token mean of one item


@pytest.mark.parametrize("normalize", NORMALIZATIONS)
def test_an_empty_tokens_axis_counts_nothing(normalize):
    """Rows of no tokens hold no sequence: a Mean of nothing, as the token mean gives.

    Fails at the time of writing: `_sequences` reshapes to (-1, 0), a ZeroDivisionError."""
    for ids in (None, np.zeros((2, 0), np.int32)):
        m = jaxga.Mean.of(np.ones((2, 0), np.float32), normalize=normalize, segment_ids=ids)
        assert (float(m.total), float(m.count)) == (0.0, 0.0)
