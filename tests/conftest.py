"""Test-session set-up: what every test needs to mean the same on every backend.

* float32 matmuls at full precision (``"highest"``): on NVIDIA GPUs JAX's default uses
  TF32, whose 10-bit mantissa breaks comparisons at float32 rounding;
* deterministic GPU reductions, so bit-for-bit tests are bit for bit there too;
* eight host devices on the CPU, so data-parallel tests run in-process;
* a compilation cache shared by the pytest workers;
* no LLVM optimisation of the compiled code (``--xla_backend_optimization_level=0``):
  tests compile far more than they run, and this halves compile times on a CPU. XLA's own
  (HLO) passes and buffer assignment still run, so the compiled HLO and the compiled
  peaks that tests read are the same as by default (checked: identical HLO text and
  ``memory_analysis()`` for the example's steps). Element-wise results may differ from
  optimised code's in the last bits; every comparison here is between programs compiled
  alike, and the whole suite passes with XLA's defaults too (``XLA_FLAGS`` is read, so
  ``--xla_backend_optimization_level=2`` there overrides this). Benchmarks run with XLA's
  defaults.
"""

import os
from pathlib import Path

os.environ["XLA_FLAGS"] = " ".join(
    [  # the environment's last: its flags override these
        "--xla_gpu_deterministic_ops=true",
        "--xla_backend_optimization_level=0",
        os.environ.get("XLA_FLAGS", ""),
    ]
).strip()

import jax

jax.config.update("jax_num_cpu_devices", 8)
# Set for the whole process, not per test: module-scoped fixtures, which build the
# references of many tests, run before any function-scoped fixture would take effect.
jax.config.update("jax_default_matmul_precision", "highest")
# Many tests compile the same small programs (the examples build the same step several
# times); a persistent cache makes every compile after the first a lookup.
jax.config.update(
    "jax_compilation_cache_dir", str(Path(__file__).parents[1] / ".pytest_cache" / "jax")
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
