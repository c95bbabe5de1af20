"""Test-session set-up: one CPU device, and a compilation cache shared by the workers."""

from pathlib import Path

import jax

# Many tests compile the same small programs (the examples build the same step several
# times); a persistent cache makes every compile after the first a lookup.
jax.config.update(
    "jax_compilation_cache_dir", str(Path(__file__).parents[1] / ".pytest_cache" / "jax")
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
