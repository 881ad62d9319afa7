"""CT cache throughput: slices per second and cache size for 1 and 2 worker processes.

Writes a synthetic RSNA-style dataset (real DICOM files, 512x512 by default, like RSNA/CQ500
slices), indexes it, then builds the cache from scratch once per worker count and reports

* slices per second of :func:`milgp.ct.cache.build_cache` (read DICOM -> HU -> 3 windows ->
  antialiased resize -> uint8 -> atomic .npy write),
* cache size in MB per 1,000 slices (and the DICOM source size for comparison).

Run: ``python -m benchmarks.cache_throughput`` (or ``python benchmarks/cache_throughput.py``);
results go to ``benchmarks/results/cache_throughput.json``. Use ``--quick`` for a smoke run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

from milgp.ct.cache import CacheParams, build_cache
from milgp.ct.rsna import index_rsna
from milgp.ct.synthetic import write_rsna_dataset
from milgp.data.atomic import atomic_write_text

RESULT_PATH = Path(__file__).resolve().parent / "results" / "cache_throughput.json"


def _folder_bytes(folder: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in folder.glob(pattern))


def run(scans: int, slices: tuple[int, int], source_size: int, cache_size: int, workers: Sequence[int], workdir: Path) -> dict:
    """Write the dataset into ``workdir``, cache it once per worker count, and return the results dict."""
    shutil.rmtree(workdir / "dicom", ignore_errors=True)  # the writer refuses a non-empty folder
    t0 = time.perf_counter()
    ds = write_rsna_dataset(workdir / "dicom", n_scans=scans, slices=slices, size=source_size, seed=0)
    synth_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = index_rsna(ds.image_dir, ds.labels_csv)
    index_s = time.perf_counter() - t0
    n_slices = sum(b.num_slices for b in index.bags)
    dicom_mb = _folder_bytes(Path(ds.image_dir), "*.dcm") / 1e6
    params = CacheParams(size=cache_size)
    rows = []
    for w in workers:
        cache_dir = workdir / f"cache_w{w}"
        shutil.rmtree(cache_dir, ignore_errors=True)
        t0 = time.perf_counter()
        report = build_cache(index, cache_dir, params, workers=w, progress=False)
        seconds = time.perf_counter() - t0
        assert report.slices_written == n_slices and not report.failed, report.summary()
        cache_mb = _folder_bytes(cache_dir / "bags", "*.npy") / 1e6
        rows.append(
            {
                "workers": w,
                "seconds": round(seconds, 2),
                "slices_per_second": round(n_slices / seconds, 1),
                "cache_mb_per_1000_slices": round(cache_mb / n_slices * 1000, 1),
            }
        )
    return {
        "benchmark": "cache_throughput",
        "machine": {
            "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads_in_process": torch.get_num_threads(),
            "load_average_1_5_15_min_at_end": [round(v, 2) for v in os.getloadavg()],
        },
        "dataset": {
            "scans": scans,
            "slices_per_scan": list(slices),
            "total_slices": n_slices,
            "source_size": source_size,
            "dicom_mb_per_1000_slices": round(dicom_mb / n_slices * 1000, 1),
            "write_seconds": round(synth_s, 2),
            "index_seconds": round(index_s, 2),
        },
        "cache": {"size": cache_size, "dtype": params.dtype, "windows": [list(w) for w in params.windows]},
        "results": rows,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scans", type=int, default=30)
    parser.add_argument("--slices", type=int, nargs=2, default=(24, 40), metavar=("MIN", "MAX"))
    parser.add_argument("--source-size", type=int, default=512, help="synthetic DICOM image size (default 512)")
    parser.add_argument("--cache-size", type=int, default=256, help="cached slice size (default 256)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--workdir", type=Path, default=None, help="where to write data (default: a temporary folder, removed)")
    parser.add_argument("--out", type=Path, default=RESULT_PATH)
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (4 scans of 64x64); does not overwrite --out")
    args = parser.parse_args(argv)
    if args.quick:
        args.scans, args.slices, args.source_size, args.cache_size = 4, (6, 8), 64, 32
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="milgp_cache_bench_"))
    try:
        result = run(args.scans, tuple(args.slices), args.source_size, args.cache_size, args.workers, workdir)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    d = result["dataset"]
    print(f"{d['total_slices']} slices of {d['source_size']}x{d['source_size']} ({d['scans']} scans) -> "
          f"{result['cache']['size']}x{result['cache']['size']} {result['cache']['dtype']}, {result['machine']['cpu_count']} CPUs")
    print(f"{'workers':>7} | {'seconds':>7} | {'slices/s':>8} | {'cache MB / 1000 slices':>22}")
    for r in result["results"]:
        print(f"{r['workers']:>7} | {r['seconds']:>7.2f} | {r['slices_per_second']:>8.1f} | {r['cache_mb_per_1000_slices']:>22.1f}")
    print(f"DICOM source: {d['dicom_mb_per_1000_slices']:.1f} MB / 1000 slices; header indexing {d['index_seconds']:.2f} s")
    if not args.quick:
        atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
