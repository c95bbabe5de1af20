"""The examples run, resume exactly and reject bad input (tiny sizes, so they never rot)."""

import shutil
import sys
from pathlib import Path

import chex
import jax
import numpy as np
import pytest
from flax import nnx

import jaxga

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

import digits_cnn
import normalization
import train_lm

TINY = ["--batch-size", "4", "--microbatches", "2", "--seq-len", "16", "--dim", "16"]
TINY += ["--heads", "2", "--layers", "2", "--sample", "0", "--quiet", "--save-every", "2"]


def test_train_lm_resume_is_bit_for_bit(tmp_path, capsys):
    straight = train_lm.train(
        train_lm.parse_args([*TINY, "--steps", "4", "--checkpoint-dir", str(tmp_path / "a")])
    )
    # in the straight run's directory: a run without --resume replaces its checkpoints
    first = train_lm.train(
        train_lm.parse_args([*TINY, "--steps", "2", "--checkpoint-dir", str(tmp_path / "a")])
    )
    resumed = train_lm.train(
        train_lm.parse_args(
            [
                *TINY,
                "--steps",
                "4",
                "--checkpoint-dir",
                str(tmp_path / "a"),
                "--resume",
                "--sample",
                "8",
            ]
        )
    )
    assert first["losses"] + resumed["losses"] == straight["losses"]
    chex.assert_trees_all_equal(straight["params"], resumed["params"])
    out = capsys.readouterr().out
    assert "compiled step: peak" in out and "sample:" in out
    assert "replacing the checkpoints of an earlier run (up to step 4)" in out


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (the CPU has them here)")
def test_train_lm_fsdp_on_eight_devices_resumes_on_four(tmp_path, capsys):
    """--devices 8 --strategy fsdp trains as one device does; its checkpoint restores onto
    4 devices, resharded, and goes on as the 8 devices go on."""
    wide = [*TINY, "--batch-size", "16", "--dropout", "0"]

    def run(*extra):
        return train_lm.train(train_lm.parse_args([*wide, *map(str, extra)]))

    one = run("--steps", "4", "--checkpoint-dir", tmp_path / "one")
    eight = run("--steps", "4", "--checkpoint-dir", tmp_path / "eight", "--devices", 8,
                "--strategy", "fsdp")  # fmt: skip
    np.testing.assert_allclose(eight["losses"], one["losses"], rtol=1e-5)
    assert "per device" in capsys.readouterr().out
    first = run("--steps", "2", "--checkpoint-dir", tmp_path / "b", "--devices", 8,
                "--strategy", "fsdp")  # fmt: skip
    four = run("--steps", "4", "--checkpoint-dir", tmp_path / "b", "--devices", 4,
               "--strategy", "fsdp", "--resume")  # fmt: skip
    np.testing.assert_allclose(first["losses"] + four["losses"], eight["losses"], rtol=1e-5)
    shards = {x.sharding.num_devices for x in jax.tree.leaves(four["params"])}
    assert shards == {4}
    sharded = [x for x in jax.tree.leaves(four["params"]) if not x.sharding.is_fully_replicated]
    assert sharded  # FSDP: parameters are split over the 4 devices


PIPELINE = [*TINY, "--batch-size", "16", "--dropout", "0", "--layers", "8", "--steps", "2"]


@pytest.fixture(scope="module")
def one_device_losses(tmp_path_factory):
    """The losses the pipelined runs must match: the same training on one device."""
    directory = str(tmp_path_factory.mktemp("one") / "c")
    return train_lm.train(train_lm.parse_args([*PIPELINE, "--checkpoint-dir", directory]))["losses"]


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (the CPU has them here)")
@pytest.mark.parametrize("schedule", ["circular", "1f1b"])  # GPipe's: circular's, r = 1
def test_train_lm_pipelined_on_eight_devices_trains_as_one_device(
    tmp_path, capsys, schedule, one_device_losses
):
    """--devices 8 --stages 4: 2 data-parallel copies of a 4-stage pipeline of the 8 blocks
    train with the losses of one device, to float32 rounding; the sample runs unpipelined."""
    pipelined = [*PIPELINE, "--devices", "8", "--stages", "4", "--schedule", schedule]
    args = [*pipelined, "--sample", "4", "--checkpoint-dir", str(tmp_path / "b")]
    piped = train_lm.train(train_lm.parse_args(args))
    np.testing.assert_allclose(piped["losses"], one_device_losses, rtol=1e-5)
    out = capsys.readouterr().out
    assert f"8 devices (2 data × 4 {schedule} pipeline stages)" in out and "sample:" in out


def test_train_lm_on_user_text(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text(f"document {i} " * (3 + i) + "\n\nsecond part" * i)
    args = [*TINY, "--steps", "1", "--data", str(corpus), "--checkpoint-dir", str(tmp_path / "c")]
    result = train_lm.train(train_lm.parse_args(args))
    assert np.isfinite(result["losses"][0])


def test_train_lm_plans_its_micro_batches(tmp_path, capsys):
    """--microbatches auto: the plan is printed, and training runs with the count it chose,
    as the explicit count's run does, bit for bit."""
    common = [*TINY, "--steps", "2", "--batch-size", "8"]
    auto = ["--microbatches", "auto", "--memory-budget", "400KiB"]  # k=4 fits, 2 does not
    planned = train_lm.train(
        train_lm.parse_args([*common, *auto, "--checkpoint-dir", str(tmp_path / "a")])
    )
    out = capsys.readouterr().out
    k = int(out.split("jaxga.plan: ")[1].split(" micro-batch")[0])
    explicit = ["--microbatches", str(k), "--checkpoint-dir", str(tmp_path / "b")]
    fixed = train_lm.train(train_lm.parse_args([*common, *explicit]))
    assert k > 1 and "<- chosen" in out
    chex.assert_trees_all_equal(planned["params"], fixed["params"])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data", "/no/such/path"], "--data /no/such/path: no such file or folder"),
        (["--data", "{empty}"], "holds no UTF-8 text"),
        (["--batch-size", "6", "--microbatches", "4"], "--batch-size 6 is not divisible by"),
        (["--devices", "999"], "--devices 999: this machine has"),
        (["--microbatches", "auto"], "--microbatches auto: the cpu device reports no memory"),
        (["--microbatches", "auto", "--memory-budget", "lots"], "'lots' is not a size"),
        (["--microbatches", "auto", "--memory-budget", "1KiB"], "--memory-budget 1KiB: No"),
        (["--tokens-per-step", "15"], "--tokens-per-step 15 is less than one sequence"),
        (["--tokens-per-step", "65"], "--tokens-per-step 65 is more than --batch-size 4 rows"),
        (
            ["--tokens-per-step", "32", "--microbatches", "auto", "--memory-budget", "1MiB"],
            "--tokens-per-step needs a fixed --microbatches; --microbatches auto chooses it",
        ),
        (["--tokens-per-step", "32", "--plan", "1MiB"], "fixed --microbatches; --plan chooses"),
        (["--stages", "3"], "--stages 3 must divide --devices 1"),
    ],
)
def test_train_lm_bad_input(tmp_path, capsys, extra, message):
    empty = tmp_path / "empty"
    empty.mkdir()
    extra = [str(empty) if e == "{empty}" else e for e in extra]
    checkpoints = tmp_path / "checkpoints"
    code = train_lm.main([*TINY, "--steps", "2", "--checkpoint-dir", str(checkpoints), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert message in err and err.startswith("train_lm.py: error:") and "\n" not in err
    assert not checkpoints.exists()


# ----------------------------------------------------------------- packed rows


LM = train_lm.Config(seq_len=32, dim=16, heads=2, layers=2, dropout=0.0, remat="none")


@pytest.fixture(scope="module")
def lm():
    """A tiny model's parameters, its loss ``f(params, batch, normalize) -> Mean``, and 24
    sequences of 2 to 32 tokens, padded one a row and packed several to a row."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(32, 127, n, np.uint8).tobytes() for n in rng.integers(3, 34, 24)]
    tokens, lengths = train_lm.pack(docs, LM.seq_len)
    graphdef, params, rest = nnx.split(train_lm.Transformer(LM, nnx.Rngs(0)), nnx.Param, ...)

    def loss(params, batch, normalize="token_mean"):
        return train_lm.loss(nnx.merge(graphdef, params, rest), batch, None, normalize)

    padded = train_lm.padded_rows(tokens, lengths)
    packed = train_lm.packed_rows(tokens, lengths)
    assert len(packed["mask"]) <= 16 and packed["segment_ids"].max() > 2  # packed, not padded
    return params, loss, padded, packed


def value_and_grad(loss, params, batch, normalize):
    """The loss's value and gradients on the whole batch at once."""
    return jax.jit(jax.value_and_grad(lambda p: loss(p, batch, normalize).value))(params)


def assert_close(actual, expected, rtol=1e-5):
    """Leaf by leaf, within ``rtol`` of the leaf's largest magnitude: float32 rounding of
    sums taken in another order, whatever the size of each element."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, e, rtol=0, atol=rtol * float(np.abs(e).max()))


@pytest.mark.parametrize("normalize", ["token_mean", "sequence_mean"])
def test_packed_rows_train_as_the_same_sequences_padded(lm, normalize):
    """Several sequences to a row (attention within each, positions from each start) give
    the loss and gradients of the same sequences one a row."""
    params, loss, padded, packed = lm
    assert_close(
        value_and_grad(loss, params, packed, normalize),
        value_and_grad(loss, params, padded, normalize),
    )


def test_packed_micro_batches_equal_the_full_batch(lm):
    """Packed rows in k=4 micro-batches give the full batch's loss and gradients; so does a
    token-budget batch (3 rows in k=4 micro-batches of 2: n=2 real) as its 3 rows alone.
    Per sequence (``sequence_mean``): micro-batches hold different numbers of sequences."""
    params, loss, _, packed = lm
    f = lambda p, batch: loss(p, batch, "sequence_mean")  # noqa: E731
    rows = train_lm.take(packed, np.arange(8))
    k4 = jax.jit(jaxga.value_and_grad(f, num_microbatches=4))(params, rows)
    assert_close(k4, value_and_grad(loss, params, rows, "sequence_mean"))
    index = np.array([5, 0, 3])
    batch, n = train_lm.budget_batch(packed, index, k=4, m=2)
    step = jaxga.value_and_grad(f, num_microbatches=4, num_real_microbatches=n)
    alone = value_and_grad(loss, params, train_lm.take(packed, index), "sequence_mean")
    assert n == 2
    assert_close(jax.jit(step)(params, batch), alone)


def test_train_lm_packed_token_budget_resumes_bit_for_bit(tmp_path):
    """--pack --tokens-per-step: every step counts at most the budget's tokens (in fewer
    micro-batches than k where they fit), and a run resumed from step 2 goes on bit for bit."""
    budget = ["--pack", "--seq-len", "64", "--tokens-per-step", "150", "--steps", "4"]
    run = [*TINY, *budget, "--checkpoint-dir", str(tmp_path)]
    straight = train_lm.train(train_lm.parse_args(run))
    shutil.rmtree(tmp_path / "4")  # the checkpoint of step 2 is left
    resumed = train_lm.train(train_lm.parse_args([*run, "--resume"]))
    assert all(0 < count <= 150 for count in straight["counts"])
    assert resumed["losses"] == straight["losses"][2:]
    chex.assert_trees_all_equal(straight["params"], resumed["params"])


def test_token_budget_schedule():
    """Rows in a permutation per epoch, walked in order, while the budget holds."""
    real = np.array([10, 30, 50, 20, 40])
    schedule = train_lm.token_budget_schedule(real, budget=60, max_rows=2, steps=6, seed=0)
    assert all(1 <= len(rows) <= 2 and real[rows].sum() <= 60 for rows in schedule)
    walked = np.concatenate(schedule)
    epochs = [np.random.default_rng([0, e]).permutation(5) for e in range(3)]
    np.testing.assert_array_equal(walked, np.concatenate(epochs)[: len(walked)])


def test_digits_cnn_runs(capsys):
    assert digits_cnn.main(["--steps", "2", "--batch-size", "16", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    delta = float(out.split("max |Δparam| = ")[1].split()[0])
    assert delta < 1e-5
    assert "test accuracy" in out


def test_digits_cnn_bad_input(capsys):
    assert digits_cnn.main(["--batch-size", "10", "--microbatches", "4"]) == 2
    err = capsys.readouterr().err
    assert "--batch-size 10 must be divisible by --microbatches 4" in err


def test_normalization_figure(tmp_path, capsys):
    out = tmp_path / "norm.png"
    assert normalization.main(["--steps", "3", "--seq-len", "32", "--out", str(out)]) == 0
    assert out.exists() and out.with_suffix(".json").exists()
    text = capsys.readouterr().out
    naive = float(text.split("naive: max |loss(k=1) − loss(k=16)| over 3 steps = ")[1].split()[0])
    exact = float(
        text.split("jaxga.Mean: max |loss(k=1) − loss(k=16)| over 3 steps = ")[1].split()[0]
    )
    assert exact < 1e-4 < naive
