"""The helpers tests share: tests/_hlo.py (HLO collectives) and tests/_models.py."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tests import _hlo, _models
from tests._hlo import hlo_collectives


@pytest.mark.parametrize("module", [_hlo, _models])
def test_docstring_examples(module):
    assert doctest.testmod(module).failed == 0


def summed_over_devices():
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("data",))  # two devices on any backend
    f = jax.shard_map(
        lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()
    )
    return jax.jit(f).lower(jnp.ones(4))


def test_compiled_or_its_text_give_the_same_collectives():
    compiled = summed_over_devices().compile()
    found = hlo_collectives(compiled)
    assert found == hlo_collectives(compiled.as_text())
    assert [(c.opcode, c.in_loop) for c in found] == [("all-reduce", False)]


@pytest.mark.parametrize(
    "make, message",
    [
        (summed_over_devices, r"`compiled` is a jax.stages.Lowered.*lowered.compile\(\)"),
        (lambda: 3, r"`compiled` must be compiled HLO text or a jax.stages.Compiled.*got int"),
    ],
)
def test_anything_but_compiled_hlo_is_a_type_error(make, message):
    with pytest.raises(TypeError, match=message):
        hlo_collectives(make())
