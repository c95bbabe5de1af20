"""benchmarks/biggest_model.py's size grid and bisection, without compiling for a GPU."""

import argparse
import math
import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import biggest_model as bm

GiB = 2**30


@pytest.mark.parametrize(
    ("size", "published"),
    [(64, 6_738_415_616), (80, 13_015_864_320)],  # Llama 2 7B and 13B, as Meta counts them
    ids=["llama-2-7b", "llama-2-13b"],
)
def test_the_grid_holds_llama_2(size, published):
    model = bm.Llama.of(size)
    leaves = jax.tree.leaves(bm.abstract_params(model))
    assert model.num_params() == published
    assert sum(math.prod(x.shape) for x in leaves) == published


def fake_compile(bytes_per_param, card):
    """A step whose peak is bytes_per_param a parameter plus 1 GiB, as a compile would say."""

    def compile_step(setting, model, card_, batch):
        assert card_ == card
        return bm.fit_for(bytes_per_param * model.num_params() + GiB, 0, card)

    return compile_step


@pytest.mark.parametrize("bytes_per_param", [16, 20, 28])
@pytest.mark.parametrize("card", list(bm.CARDS.values()), ids=list(bm.CARDS))
def test_bisection_finds_the_largest_fitting_size(monkeypatch, bytes_per_param, card):
    monkeypatch.setattr(bm, "compile_step", fake_compile(bytes_per_param, card))
    args = argparse.Namespace(min_size=8, max_size=256, probe_size=32, seq_len=2048, batch=128)
    setting = bm.Setting("jaxga resident", "full", 1)
    first = bm.compile_step(setting, bm.Llama.of(args.probe_size), card, args.batch)
    found = bm.largest(setting, card, args, lambda *a: None, first)
    fitting = [  # every size tried, the reference
        size
        for size in range(args.min_size, args.max_size + 1)
        if bytes_per_param * bm.Llama.of(size).num_params() + GiB <= card.device_bytes
    ]
    assert found.size == max(fitting)
    assert found.fit.fits and not found.next_fit.fits
    assert found.probes <= 6  # a line through the probes lands next to the answer
