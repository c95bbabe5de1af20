"""Interleaved wall-clock timing shared by the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax


def time_interleaved(runners: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Runs each runner once per round, alternating the order; returns seconds per run."""
    names = list(runners)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            jax.block_until_ready(runners[name]())
            times[name].append(time.perf_counter() - start)
    return times
