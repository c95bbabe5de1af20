"""The train steps' policies as arguments (issue 38): `weight=`, `learning_rate=`,
`applied` from `tx.has_updated`, the update through `state.apply_gradients`, `end_group`,
the fields of a Flax TrainState named, checks once per signature, and the errors."""

import re
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jaxga

jax.config.update("jax_default_matmul_precision", "highest")
nnx_train = sys.modules["jaxga.nnx_train"]


def loss(params, batch, model_state, rng):
    return jaxga.Mean.of(
        (batch["x"] @ params["w"] - batch["y"]) ** 2, where=batch["m"]
    ), model_state


def mean_loss(params, batch):
    """The whole batch's loss, for the references."""
    errors = (batch["x"] @ params["w"] - batch["y"]) ** 2
    return jnp.sum(errors * batch["m"]) / jnp.sum(batch["m"])


def make_batch(i, real=4):
    x = jax.random.normal(jax.random.key(i), (4, 3))
    return {"x": x, "y": jnp.sin(x[:, 0]), "m": (jnp.arange(4) < real).astype(jnp.float32)}


PARAMS = {"w": jnp.array([0.5, -0.2, 0.1])}
COUNTS = [4, 1, 3, 2, 4, 1, 2]  # items per call: a mean over calls weighs them


def reference(tx, ends=None, weighted=True):
    """A Python loop of tx.update on each call's whole-batch gradient."""
    params, state, applied = PARAMS, tx.init(PARAMS), []
    for i, real in enumerate(COUNTS):
        batch = make_batch(i, real)
        extra = {"weight": float(real)} if weighted else {}
        if ends is not None:
            extra["end_group"] = ends[i]
        grads = jax.grad(mean_loss)(params, batch)
        updates, state = tx.update(grads, state, params, **extra)
        params = optax.apply_updates(params, updates)
        applied.append(bool(tx.has_updated(state)) if hasattr(tx, "has_updated") else True)
    return params, applied


def run(step, state, ends=None):
    applied = []
    for i, real in enumerate(COUNTS):
        kwargs = {} if ends is None else {"end_group": ends[i]}
        state, metrics = step(state, make_batch(i, real), **kwargs)
        applied.append(bool(metrics["applied"]))
    return state, applied


def no_extra_args(inner):
    """A user's own GradientTransformationExtraArgs whose update takes no `weight`."""

    def update(updates, state, params=None):
        return inner.update(updates, state, params)

    return optax.GradientTransformationExtraArgs(inner.init, update)


# ----------------------------------------------------------------------------- weight=


def test_a_users_extra_args_transformation_is_not_given_weight():
    tx = no_extra_args(optax.adam(0.1))
    state, _ = run(jaxga.make_train_step(loss, 2), jaxga.TrainState.create(params=PARAMS, tx=tx))
    expected, _ = reference(optax.adam(0.1), weighted=False)
    chex.assert_trees_all_close(state.params, expected, rtol=1e-5)

    model = nnx.Linear(3, 1, use_bias=False, rngs=nnx.Rngs(0))
    model.kernel[...] = PARAMS["w"][:, None]
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = jaxga.nnx_train_step(lambda m, b: loss({"w": m.kernel[...][:, 0]}, b, {}, None)[0], 2)
    for i, real in enumerate(COUNTS):
        step(model, optimizer, make_batch(i, real))
    chex.assert_trees_all_close(model.kernel[...][:, 0], expected["w"], rtol=1e-5)


@pytest.mark.parametrize("weight", [None, True, False])
def test_multisteps_gets_the_token_weighted_mean_unless_told_not_to(weight):
    tx = jaxga.MultiSteps(optax.sgd(0.1), every_k=2)
    step = jaxga.make_train_step(loss, 2, weight=weight)
    state, applied = run(step, jaxga.TrainState.create(params=PARAMS, tx=tx))
    expected, expected_applied = reference(tx, weighted=weight is not False)
    chex.assert_trees_all_close(state.params, expected, rtol=1e-5)
    assert applied == expected_applied == [False, True] * 3 + [False]


def test_weight_needs_a_transformation_that_takes_it():
    plain = optax.GradientTransformation(optax.sgd(0.1).init, optax.sgd(0.1).update)
    state = jaxga.TrainState.create(params=PARAMS, tx=plain)
    with pytest.raises(
        TypeError,
        match=r"passes weight to an optax GradientTransformation, which takes no extra args: "
        r"expected one that does \(jaxga.MultiSteps\), or build the step with weight=False",
    ):
        jaxga.make_train_step(loss, 2, weight=True)(state, make_batch(0))
    with pytest.raises(TypeError, match=r"`weight` must be None, True or False; got 'yes'"):
        jaxga.make_train_step(loss, 2, weight="yes")


# ----------------------------------------------------------------- learning_rate=


def test_learning_rate_is_the_injected_one_or_what_the_step_is_told():
    two = optax.chain(
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.2),
    )
    state = jaxga.TrainState.create(params=PARAMS, tx=two)
    with pytest.raises(
        ValueError,
        match=r"holds 2 learning rates \(\[0\].*, \[1\].*\): pass the step's `learning_rate=",
    ):
        jaxga.make_train_step(loss, 2)(state, make_batch(0))

    def second(opt_state):
        return opt_state[1].hyperparams["learning_rate"]

    _, metrics = jaxga.make_train_step(loss, 2, learning_rate=second)(state, make_batch(0))
    np.testing.assert_allclose(metrics["learning_rate"], 0.2)
    plain = jaxga.TrainState.create(params=PARAMS, tx=optax.sgd(0.1))
    assert np.isnan(jaxga.make_train_step(loss, 2)(plain, make_batch(0))[1]["learning_rate"])
    with pytest.raises(TypeError, match=r"`learning_rate` must be a function .*; got 0.1"):
        jaxga.nnx_train_step(lambda m, b: 0.0, 2, learning_rate=0.1)


# ------------------------------------------------------------------------ applied


def test_a_call_counting_nothing_is_skipped_and_not_applied_without_weight():
    """optax.MultiSteps (has_updated, no weight): a call of padding alone leaves the state
    as it was, and `applied` is False although has_updated of that state says True."""
    tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=1)
    step = jaxga.make_train_step(loss, 2, donate=False)
    state, metrics = step(jaxga.TrainState.create(params=PARAMS, tx=tx), make_batch(0))
    assert metrics["applied"] and tx.has_updated(state.opt_state)
    new, metrics = step(state, make_batch(1, real=0))
    assert not metrics["applied"] and int(new.step) == 2
    chex.assert_trees_all_equal((new.params, new.opt_state), (state.params, state.opt_state))


# ------------------------------------------------------------ state.apply_gradients


class Counting(jaxga.TrainState):
    calls: jax.Array = None

    def apply_gradients(self, *, grads, **kwargs):
        return super().apply_gradients(grads=grads, calls=self.calls + 1, **kwargs)


class FlaxCounting(train_state.TrainState):
    calls: jax.Array

    def apply_gradients(self, *, grads, **kwargs):
        return super().apply_gradients(grads=grads, calls=self.calls + 1, **kwargs)


@pytest.mark.parametrize("tx", [optax.adam(0.1), jaxga.MultiSteps(optax.adam(0.1), 2)])
def test_the_step_updates_through_a_subclass_apply_gradients(tx):
    state = Counting.create(params=PARAMS, tx=tx, calls=jnp.int32(0))
    state, _ = run(jaxga.make_train_step(loss, 2), state)
    expected, _ = reference(tx, weighted=isinstance(tx, jaxga.MultiStepsTransformation))
    assert isinstance(state, Counting) and int(state.calls) == len(COUNTS)
    chex.assert_trees_all_close(state.params, expected, rtol=1e-5)

    params = jax.tree.map(jnp.copy, PARAMS)  # Flax's create does not copy what is donated
    flax_state = FlaxCounting.create(apply_fn=None, params=params, tx=tx, calls=jnp.int32(0))
    step = jaxga.make_train_step(loss, 2, model_state_fields=())
    if isinstance(tx, jaxga.MultiStepsTransformation):  # Flax's sends keywords to replace
        with pytest.raises(
            TypeError,
            match=r"passes FlaxCounting.apply_gradients takes no `weight`: expected a "
            r"jaxga.TrainState, or build the step with weight=False",
        ):
            step(flax_state, make_batch(0))
        return
    flax_state, _ = run(step, flax_state)
    assert int(flax_state.calls) == len(COUNTS)
    chex.assert_trees_all_close(flax_state.params, expected, rtol=1e-5)


def test_flax_fp8_overwrite_with_gradient_is_kept():
    """Flax's apply_gradients sets `_overwrite_with_gradient` parameters to their gradient."""

    def fp8_loss(params, batch, model_state, rng):
        value = loss(params["params"], batch, model_state, rng)[0]
        return jaxga.Mean(value.total * params["_overwrite_with_gradient"]["s"], value.count), {}

    params = {"params": PARAMS, "_overwrite_with_gradient": {"s": jnp.float32(2.0)}}
    state = jaxga.TrainState.create(params=params, tx=optax.sgd(0.1))
    new, _ = jaxga.make_train_step(fp8_loss, 2)(state, make_batch(0))
    grads = jax.grad(
        lambda p: mean_loss(p["params"], make_batch(0)) * p["_overwrite_with_gradient"]["s"]
    )(params)
    chex.assert_trees_all_close(
        new.params["_overwrite_with_gradient"], grads["_overwrite_with_gradient"], rtol=1e-5
    )
    expected = optax.apply_updates(PARAMS, jax.tree.map(lambda g: -0.1 * g, grads["params"]))
    chex.assert_trees_all_close(new.params["params"], expected, rtol=1e-5)


# -------------------------------------------------------------------------- end_group

ENDS = [False, True, False, False, False, True, False]  # groups of 2, 3 (k), 1, then 1 open


def test_end_group_through_make_train_step_matches_multisteps_update():
    tx = jaxga.MultiSteps(optax.sgd(0.1), every_k=3)
    step = jaxga.make_train_step(loss, 2)
    state, applied = run(step, jaxga.TrainState.create(params=PARAMS, tx=tx), ENDS)
    expected, expected_applied = reference(tx, ENDS)
    assert applied == expected_applied == [False, True, False, False, True, True, False]
    chex.assert_trees_all_close(state.params, expected, rtol=1e-5)
    plain = optax.GradientTransformation(optax.sgd(0.1).init, optax.sgd(0.1).update)
    with pytest.raises(TypeError, match=r"passes end_group to an optax GradientTransformation"):
        step(jaxga.TrainState.create(params=PARAMS, tx=plain), make_batch(0), end_group=True)
    with pytest.raises(TypeError, match=r"`end_group` must be a bool; got 'yes'"):
        step(state, make_batch(0), end_group="yes")


def test_end_group_through_nnx_train_step_matches_multisteps_update():
    tx = jaxga.MultiSteps(optax.sgd(0.1), every_k=3)
    model = nnx.Linear(3, 1, use_bias=False, rngs=nnx.Rngs(0))
    model.kernel[...] = PARAMS["w"][:, None]
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = jaxga.nnx_train_step(lambda m, b: loss({"w": m.kernel[...][:, 0]}, b, {}, None)[0], 2)
    applied = []
    for i, real in enumerate(COUNTS):
        applied.append(
            bool(step(model, optimizer, make_batch(i, real), end_group=ENDS[i])["applied"])
        )
    expected, expected_applied = reference(tx, ENDS)
    assert applied == expected_applied
    chex.assert_trees_all_close(model.kernel[...][:, 0], expected["w"], rtol=1e-5)


# ------------------------------------------------------------ checks once per signature


def test_checks_run_once_per_signature_and_aliasing_every_call(monkeypatch):
    seen = {"on_device": 0, "wrt": 0}
    check_on_device, check_wrt = jaxga.steps.check_on_device, nnx_train._check_wrt

    def counted_on_device(state):
        seen["on_device"] += 1
        return check_on_device(state)

    def counted_wrt(model, optimizer):
        seen["wrt"] += 1
        return check_wrt(model, optimizer)

    monkeypatch.setattr(jaxga.steps, "check_on_device", counted_on_device)
    monkeypatch.setattr(nnx_train, "_check_wrt", counted_wrt)
    step = jaxga.make_train_step(loss, 2)
    state = jaxga.TrainState.create(params=PARAMS, tx=optax.contrib.prodigy(0.5))
    for i in range(3):
        state, _ = step(state, make_batch(i))
    assert seen["on_device"] == 1
    # the same signature, one buffer twice: unaliased runs on every call, so both donate
    aliased = state.replace(opt_state=state.opt_state._replace(params0=state.params))
    state, metrics = step(aliased, make_batch(3))
    assert seen["on_device"] == 1 and jnp.isfinite(metrics["loss"])
    step(
        jaxga.TrainState.create(params={"w": jnp.ones(3, jnp.bfloat16)}, tx=optax.sgd(0.1)),
        make_batch(0),
    )
    assert seen["on_device"] == 2  # another dtype: another signature

    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    nnx_step = jaxga.nnx_train_step(lambda m, b: jnp.mean(m(b["x"]) ** 2), 2)
    for i in range(3):
        nnx_step(model, optimizer, make_batch(i))
    assert seen["wrt"] == 1


# ---------------------------------------------------------------------------- errors


def test_an_optimiser_given_positionally_is_named():
    with pytest.raises(
        TypeError,
        match=r"make_train_step takes no optimiser \(it runs state.tx\); got "
        r"GradientTransformation\w*, 2: pass tx to TrainState.create and num_microbatches= alone",
    ):
        jaxga.make_train_step(loss, optax.adam(1e-3), 2)
    with pytest.raises(TypeError, match=r"got 2, GradientTransformation\w*: pass tx to"):
        jaxga.make_train_step(loss, 2, optax.adam(1e-3))


class WithStats(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 1, rngs=rngs)
        self.norm = nnx.BatchNorm(1, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.linear(x))


def test_a_two_way_split_is_told_to_split_three_ways():
    graphdef, everything = nnx.split(WithStats(nnx.Rngs(0)))
    fix = (
        r"`params` holds \['BatchStat'\] besides nnx.Param: split it as `graphdef, params, rest "
        r"= nnx.split\(model, nnx.Param, ...\)` and pass `model_state=rest`"
    )
    with pytest.raises(ValueError, match=fix):
        jaxga.TrainState.create(params=everything, tx=optax.sgd(0.1))
    state = train_state.TrainState.create(apply_fn=None, params=everything, tx=optax.sgd(0.1))
    step = jaxga.make_train_step(jaxga.nnx_loss(graphdef, lambda m, b, r: jnp.mean(m(b) ** 2)), 2)
    with pytest.raises(ValueError, match=fix):
        step(state, jnp.ones((4, 3)))


# ------------------------------------------------- issue 46: silent, then vague, no more

OWN_FIELDS = r"\('params', 'opt_state', 'tx', 'step', 'apply_fn'\)"


@pytest.mark.parametrize(
    "fields", ["params", "opt_state", "tx", "step", ("model_state", "params"), ["apply_fn"]]
)
def test_model_state_fields_naming_the_steps_own_fields_is_refused(fields):
    with pytest.raises(
        ValueError,
        match=r"`model_state_fields` must name the model's non-differentiated state \(e.g. "
        rf"\('batch_stats',\)\) or \(\), not a field the step keeps itself {OWN_FIELDS}; "
        rf"got {re.escape(repr(fields))}\.",
    ):
        jaxga.make_train_step(loss, 2, model_state_fields=fields)


def test_state_fields_that_do_not_exist_or_overlap_are_named():
    state = jaxga.TrainState.create(params=PARAMS, tx=optax.sgd(0.1))
    fields = r"\['apply_fn', 'model_state', 'opt_state', 'params', 'rng', 'step', 'tx'\]"
    with pytest.raises(
        ValueError,
        match=rf"`model_state_fields` must name one of `state`'s {fields}; got 'stats': "
        r"`state`, a TrainState, has no field 'stats'\.",
    ):
        jaxga.make_train_step(loss, 2, model_state_fields="stats")(state, make_batch(0))
    with pytest.raises(ValueError, match=r"`rng_field` must name one of `state`'s .*; got 'key'"):
        jaxga.make_train_step(loss, 2, rng_field="key")(state, make_batch(0))
    with pytest.raises(
        ValueError,
        match=r"`model_state_fields` must not name the PRNG key's field; got 'rng', the key's "
        r"\(`rng_field`\)\.",
    ):
        jaxga.make_train_step(loss, 2, model_state_fields="rng")(state, make_batch(0))
    with pytest.raises(
        ValueError, match=r"`rng_field` must name the PRNG key's field, not one .*; got 'step'"
    ):
        jaxga.make_train_step(loss, 2, rng_field="step")


def test_learning_rate_must_return_a_scalar():
    state = jaxga.TrainState.create(params=PARAMS, tx=optax.sgd(0.1))
    step = jaxga.make_train_step(loss, 2, learning_rate=lambda s: jnp.ones(3))
    with pytest.raises(ValueError, match=r"`learning_rate` must return a scalar; got shape \(3,\)"):
        step(state, make_batch(0))
    step = jaxga.make_train_step(loss, 2, learning_rate=lambda s: None)
    with pytest.raises(TypeError, match=r"`learning_rate` must return a number; got None\."):
        step(state, make_batch(0))


def chained_multisteps(clip):
    """A MultiSteps inside optax.chain, behind a clip (binding, or not at all)."""
    return optax.chain(optax.clip_by_global_norm(clip), jaxga.MultiSteps(optax.sgd(0.1), 2))


def calls_of_8_and_4():
    x = jax.random.normal(jax.random.key(7), (12, 3))
    batch = {"x": x, "y": jnp.sin(x[:, 0]) * 4, "m": jnp.ones(12)}
    return batch, [jax.tree.map(lambda a: a[:8], batch), jax.tree.map(lambda a: a[8:], batch)]


def test_a_multisteps_inside_a_chain_is_weighed_and_its_applied_read():
    """Two calls of 8 and 4 items: the update of the 12 items' mean, applied on the second."""
    whole, calls = calls_of_8_and_4()
    expected = optax.apply_updates(
        PARAMS, jax.tree.map(lambda g: -0.1 * g, jax.grad(mean_loss)(PARAMS, whole))
    )
    state = jaxga.TrainState.create(params=PARAMS, tx=chained_multisteps(1e6))
    step, applied = jaxga.make_train_step(loss, 2), []
    for batch in calls:
        state, metrics = step(state, batch)
        applied.append(bool(metrics["applied"]))
    assert applied == [False, True]
    chex.assert_trees_all_close(state.params, expected, rtol=1e-5)

    model = nnx.Linear(3, 1, use_bias=False, rngs=nnx.Rngs(0))
    model.kernel[...] = PARAMS["w"][:, None]
    optimizer = nnx.Optimizer(model, chained_multisteps(1e6), wrt=nnx.Param)
    nnx_step = jaxga.nnx_train_step(
        lambda m, b: loss({"w": m.kernel[...][:, 0]}, b, {}, None)[0], 2
    )
    applied = [bool(nnx_step(model, optimizer, batch)["applied"]) for batch in calls]
    assert applied == [False, True]
    chex.assert_trees_all_close(model.kernel[...][:, 0], expected["w"], rtol=1e-5)


def test_a_binding_clip_before_the_multisteps_matches_the_chain_given_the_counts():
    """The reference: optax's chain.update told each call's item count, in a Python loop."""
    _, calls = calls_of_8_and_4()
    tx = chained_multisteps(0.5)
    params, opt_state = PARAMS, tx.init(PARAMS)
    for batch in calls:
        grads = jax.grad(mean_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params, weight=batch["m"].sum())
        params = optax.apply_updates(params, updates)
    state = jaxga.TrainState.create(params=PARAMS, tx=tx)
    step = jaxga.make_train_step(loss, 2)
    for batch in calls:
        state, _ = step(state, batch)
    chex.assert_trees_all_close(state.params, params, rtol=1e-5)
    assert not np.allclose(params["w"], PARAMS["w"])


def test_a_plain_transformation_holding_a_multisteps_is_refused_not_weighed_one():
    chain = chained_multisteps(1e6)
    plain = optax.GradientTransformation(chain.init, chain.update)
    state = jaxga.TrainState.create(params=PARAMS, tx=plain)
    with pytest.raises(
        TypeError,
        match=r"passes weight to an optax GradientTransformation, which takes no extra args: "
        r"expected one that hands them to the jaxga.MultiSteps it holds \(optax.chain does\), "
        r"or build the step with weight=False \(then each call weighs 1\)\.",
    ):
        jaxga.make_train_step(loss, 2)(state, make_batch(0))
    jaxga.make_train_step(loss, 2, weight=False)(state, make_batch(0))  # told: each call 1


def test_rngs_and_the_losss_arguments_are_named_together():
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    batch = jnp.ones((4, 3))
    handed = r"which it hands the loss as its third argument"
    with pytest.raises(
        TypeError,
        match=rf"`loss` takes \(model, batch, rngs\), but the step got no `rngs=`, {handed}: "
        r"call it with `rngs=` \(an nnx.Rngs or a PRNG key\)\.",
    ):
        jaxga.nnx_train_step(lambda m, b, rng: jnp.mean(m(b) ** 2), 2)(model, optimizer, batch)

    def nloss(m, b):
        return jnp.mean(m(b) ** 2)

    with pytest.raises(
        TypeError,
        match=rf"`loss` takes \(model, batch\), but the step got `rngs=`, {handed}: take it "
        r"\(`loss\(model, batch, rngs\)`\) or call the step without `rngs=`\.",
    ):
        jaxga.nnx_train_step(nloss, 2)(model, optimizer, batch, rngs=nnx.Rngs(1))
    optional = jaxga.nnx_train_step(lambda m, b, rngs=None: jnp.mean(m(b) ** 2), 2)
    optional(model, optimizer, batch)
    optional(model, optimizer, batch, rngs=jax.random.key(0))


@pytest.mark.parametrize("ways", [2, 3])
def test_a_split_handed_to_the_linen_step_without_its_rest_is_told_how(ways):
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))  # parameters only: an empty rest
    graphdef, params, *_ = nnx.split(model) if ways == 2 else nnx.split(model, nnx.Param, ...)
    step = jaxga.make_train_step(jaxga.nnx_loss(graphdef, lambda m, b, r: jnp.mean(m(b) ** 2)), 2)
    state = jaxga.TrainState.create(params=params, tx=optax.sgd(0.1))
    with pytest.raises(
        TypeError,
        match=r"`model_state` must be the split's rest, an nnx.State; got \{\} of type dict: pass "
        r"`model_state=rest`, from `graphdef, params, rest = nnx.split\(model, nnx.Param, "
        r"...\)`, to jaxga.TrainState.create\.",
    ):
        step(state, jnp.ones((4, 3)))
    _, rest = nnx.split(model, nnx.Param, ...)[1:]
    state = jaxga.TrainState.create(params=params, tx=optax.sgd(0.1), model_state=rest)
    assert jnp.isfinite(step(state, jnp.ones((4, 3)))[1]["loss"])
