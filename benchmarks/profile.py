"""Where a method's step spends its time: the device's kernels, summed over a few steps.

Runs each named method of ``run.py`` on one workload under ``jax.profiler.trace``, reads
the Perfetto trace and prints, per method, the kernels (or, on a CPU, the host's ops)
that take the most time, with the difference between the first two methods, to find
why one is slower than the other.

    python benchmarks/profile.py --only 2 scan-k4-none optax-k4-none
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
import tempfile
from pathlib import Path

import jax
import optax

sys.path.insert(0, str(Path(__file__).parent))

import _workloads
from run import Method, prepare


def kernel_times(trace_dir: Path) -> tuple[collections.Counter, float]:
    """Seconds per event name on the device's streams (all events where there are none)."""
    path = next(trace_dir.rglob("*.trace.json.gz"))
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    device = {pid for pid, name in names.items() if "/device:" in name and "CPU" not in name}
    times: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and (not device or e["pid"] in device):
            times[e["name"]] += e.get("dur", 0) * 1e-6
    return times, sum(times.values())


def profile(method: Method, args: argparse.Namespace) -> tuple[collections.Counter, float]:
    w = _workloads.workloads(args.quick, args.dtype, only=args.only)[0]
    p = prepare(method, w, optax.adam(1e-3))
    for _ in range(2):
        jax.block_until_ready(p.run())
    trace_dir = Path(tempfile.mkdtemp(prefix="jaxga-profile-"))
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(args.steps):
            jax.block_until_ready(p.run())
    times, total = kernel_times(trace_dir)
    return collections.Counter({k: v / args.steps for k, v in times.items()}), total / args.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="+", help="run.py method keys, e.g. scan-k4-none")
    parser.add_argument("--only", type=int, default=2, help="the workload (0, 1, 2)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    results = {key: profile(Method.from_key(key), args) for key in args.methods}
    for key, (times, total) in results.items():
        print(f"\n{key}: {1e3 * total:.1f} ms of device time per global step")
        for name, t in times.most_common(args.top):
            print(f"  {1e3 * t:8.2f} ms  {name[:110]}")
    if len(results) >= 2:
        (a, (ta, _)), (b, (tb, _)) = list(results.items())[:2]
        diff = collections.Counter({k: ta[k] - tb[k] for k in set(ta) | set(tb)})
        print(f"\n{a} − {b}, largest differences:")
        for name, t in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[: args.top]:
            print(f"  {1e3 * t:+8.2f} ms  {name[:110]}")


if __name__ == "__main__":
    main()
