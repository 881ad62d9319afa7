"""The quick set of every benchmark, in one go (``make bench``).

    .venv/bin/python -m benchmarks.run_quick [--threads 1]

Runs each benchmark's ``--quick`` variant (smaller N, shorter budgets) and prints its tables;
results go to ``benchmarks/results/*_quick.json``. The deep path (``benchmarks/deep_path.py``) runs
its smallest setting (small CNN, bags of 24 slices, one timed step) into ``deep_path_quick.json``.
The full runs are each script without ``--quick`` (see docs/performance.md).
"""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUICK = ["convergence", "scaling", "reference_numpy", "prediction", "profile_fit", "aggregate_scaling"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=int(os.environ.get("MILGP_BENCH_THREADS", "1")))
    p.add_argument("--only", nargs="*", help="run only these benchmarks")
    args = p.parse_args(argv)
    names = [n for n in args.only if n != "deep_path"] if args.only else QUICK  # deep_path runs below, in its own process
    failures = []
    for name in names:
        print(f"\n## {name} (quick)\n", flush=True)
        t = time.perf_counter()
        extra = ["--tag", "quick"] if name == "profile_fit" else []
        try:
            mod = importlib.import_module(f"benchmarks.{name}")
            mod.main(["--quick", "--threads", str(args.threads), *extra])
        except Exception as err:  # keep going: report every benchmark
            failures.append(name)
            print(f"FAILED: {type(err).__name__}: {err}", flush=True)
        print(f"\n({name}: {time.perf_counter() - t:.0f} s)", flush=True)
    if args.only is None or "deep_path" in args.only:
        print("\n## deep_path (quick)\n", flush=True)
        flags = ["--slices", "24", "--steps", "1", "--arch", "small", "--out", str(HERE / "results" / "deep_path_quick.json")]
        if subprocess.run([sys.executable, "-m", "benchmarks.deep_path", *flags], cwd=HERE.parent).returncode != 0:
            failures.append("deep_path")
    if failures:
        print(f"\nfailed: {', '.join(failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
