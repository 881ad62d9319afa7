"""CT cache loading: bags/s and slices/s the training DataLoader serves from a milgp cache.

Does the data path keep up with GPU training? An RSNA-sized epoch is about 750,000 slices; at
256x256 in at most 10 minutes the loader must deliver well over 1,250 slices/s.

1. Writes a synthetic RSNA-style dataset of real DICOM files (512x512 by default, bags of 24-57
   slices like RSNA) into a work folder, indexes it and builds the cache at 256x256, as
   ``milgp-cache rsna`` does (:func:`milgp.ct.synthetic.write_rsna_dataset`,
   :func:`milgp.ct.rsna.index_rsna`, :func:`milgp.ct.cache.build_cache`).
2. For each RSNA config on the cache (``--configs``, default ``configs/rsna_attcnn.yaml``: batches of
   4 bags with the bag augmentation, and ``configs/rsna_gp_end_to_end.yaml``: 8 bags, no
   augmentation; both ``max_slices: 60``) and each worker count (``--workers``), makes the config's
   :class:`lightning_modules.CTCacheDataModule` (only ``cache_dir`` and ``num_workers`` replaced),
   calls ``prepare_data()``, ``setup("fit")`` and ``train_dataloader()`` once -- what a Trainer
   does -- and iterates that loader ``--epochs`` times, calling the sampler's ``set_epoch`` before
   each pass. With ``--device cuda`` every batch (a :class:`milgp.data.bags.BagBatch`) is also
   moved to the GPU with ``non_blocking=True`` and the GPU synchronised at the end of each pass.

Per setting: batches, bags and slices per pass, seconds, bags/s, slices/s, the time to the first
batch and the minutes a 750,000-slice epoch would take. When the loader's workers are persistent
(``num_workers > 0``, as the data module makes them) the first pass is warm-up (worker start-up)
and the rest are timed; otherwise every pass is timed. Figures are medians over the timed passes.

The cache files are in the page cache (just written) unless ``--cold`` asks to evict them before
every pass (``posix_fadvise(DONTNEED)``, best effort: no effect on tmpfs). ``--repeat K`` lists
every training bag K times in a splits file, for longer epochs without a larger dataset (the
repeats of a bag are read from the page cache even with ``--cold``: use ``--repeat 1`` there).

    python -m benchmarks.cache_loading --quick                   # smoke run (tiny images)
    python -m benchmarks.cache_loading                           # 40 scans, workers 0 2 4 8, CPU
    python -m benchmarks.cache_loading --device cuda --workers 4 8 16

Results: ``benchmarks/results/cache_loading.json`` (``--quick``: ``cache_loading_quick.json``;
``--out`` to change).
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import yaml

from benchmarks.common import RESULTS, machine, markdown_table
from lightning_modules.data import CTCacheDataModule
from lightning_modules.module_config import instantiate
from milgp.ct.cache import CacheParams, build_cache
from milgp.ct.rsna import index_rsna
from milgp.ct.synthetic import write_rsna_dataset
from milgp.data.atomic import atomic_write_text

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIGS = ["configs/rsna_attcnn.yaml", "configs/rsna_gp_end_to_end.yaml"]
RSNA_EPOCH_SLICES = 750_000
TARGET_SLICES_PER_S = RSNA_EPOCH_SLICES / 600  # 1,250: an RSNA epoch in 10 minutes


# -- data ---------------------------------------------------------------------------------------
def build(workdir: Path, scans: int, slices: tuple[int, int], source_size: int, cache_size: int, cache_workers: int) -> dict[str, Any]:
    """Write the DICOM dataset into ``workdir/dicom``, index it, cache it into ``workdir/cache``."""
    for sub in ("dicom", "cache"):
        shutil.rmtree(workdir / sub, ignore_errors=True)
    t0 = time.perf_counter()
    ds = write_rsna_dataset(workdir / "dicom", n_scans=scans, slices=slices, size=source_size, seed=0)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = index_rsna(ds.image_dir, ds.labels_csv, workers=cache_workers)
    index_s = time.perf_counter() - t0
    params = CacheParams(size=cache_size)
    t0 = time.perf_counter()
    report = build_cache(index, workdir / "cache", params, workers=cache_workers, progress=False)
    cache_s = time.perf_counter() - t0
    n_slices = sum(b.num_slices for b in index.bags)
    if report.failed or report.slices_written != n_slices:
        raise RuntimeError(f"cache build incomplete: {report.summary()}")
    cache_bytes = sum(p.stat().st_size for p in (workdir / "cache" / "bags").glob("*.npy"))
    return {
        "cache_dir": str(workdir / "cache"),
        "scans": len(index.bags),
        "slices_per_scan": list(slices),
        "total_slices": n_slices,
        "source_size": source_size,
        "cache_size": cache_size,
        "cache_dtype": params.dtype,
        "cache_mb": round(cache_bytes / 1e6, 1),
        "build_workers": cache_workers,
        "write_dicom_s": round(write_s, 2),
        "index_s": round(index_s, 2),
        "build_cache_s": round(cache_s, 2),
    }


def evict_page_cache(folder: Path) -> int:
    """Drop the ``.npy`` files under ``folder`` from the page cache (flush, then ``POSIX_FADV_DONTNEED``;
    best effort). Returns how many files were advised."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    done = 0
    for path in folder.glob("*.npy"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            done += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return done


# -- configs ------------------------------------------------------------------------------------
def data_settings(config: str) -> dict[str, Any]:
    """The ``data.init_args`` of a training config whose data module is :class:`CTCacheDataModule`."""
    path = Path(config) if Path(config).is_file() else REPO / config
    data = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("data") or {}
    class_path = data.get("class_path", "")
    if class_path.rpartition(".")[2] != CTCacheDataModule.__name__:
        raise SystemExit(f"{config}: data module is {class_path or 'not set'}, not {CTCacheDataModule.__name__}")
    return dict(data.get("init_args") or {})


def describe_settings(init_args: dict[str, Any]) -> dict[str, Any]:
    """The config's data settings for the report (its ``cache_dir`` and ``num_workers`` are replaced here)."""
    out = {k: (v if not isinstance(v, dict) else {"class_path": v.get("class_path"), **(v.get("init_args") or {})})
           for k, v in init_args.items() if k not in ("cache_dir", "num_workers")}
    out["num_workers_in_config"] = init_args.get("num_workers", 0)
    return out


def write_repeated_splits(cache_dir: str, init_args: dict[str, Any], repeat: int, out: Path) -> str:
    """A splits file with the data module's own split, the training bags listed ``repeat`` times."""
    dm = CTCacheDataModule(cache_dir=cache_dir, **{k: v for k, v in init_args.items() if k in ("splits_file", "fractions", "split_seed")})
    splits = {name: list(ids) for name, ids in dm.splits.items() if name != "all"}
    train = init_args.get("train_split", "train")
    splits[train] = splits.get(train, []) * repeat
    out.write_text(json.dumps(splits), encoding="utf-8")
    return str(out)


# -- timing -------------------------------------------------------------------------------------
def time_pass(loader, epoch: int, device: torch.device | None, cold_dir: Path | None) -> dict[str, Any]:
    """One pass over ``loader`` (sampler epoch ``epoch``): batches, bags, slices, seconds, first batch."""
    if cold_dir is not None:
        evict_page_cache(cold_dir)
    loader.sampler.set_epoch(epoch)  # what the Trainer does before every training epoch
    batches = bags = slices = 0
    first = None
    t0 = time.perf_counter()
    for batch in loader:
        if first is None:
            first = time.perf_counter() - t0
        if device is not None:
            batch = batch.to(device, non_blocking=True)
        batches += 1
        bags += batch.num_bags
        slices += batch.num_instances
        del batch
    if device is not None:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    return {"epoch": epoch, "batches": batches, "bags": bags, "slices": slices, "seconds": round(seconds, 3),
            "first_batch_s": round(first or 0.0, 3)}


def run_setting(config: str, init_args: dict[str, Any], cache_dir: str, splits_file: str | None, workers: int,
                epochs: int, device: torch.device | None, cold: bool) -> dict[str, Any]:
    kwargs = {k: instantiate(v) if isinstance(v, dict) and "class_path" in v else v for k, v in init_args.items()}
    kwargs.update(cache_dir=cache_dir, num_workers=workers)
    if splits_file:
        kwargs["splits_file"] = splits_file
    dm = CTCacheDataModule(**kwargs)
    dm.prepare_data()
    dm.setup("fit")
    loader = dm.train_dataloader()
    loader_settings = {"pin_memory": loader.pin_memory, "persistent_workers": loader.persistent_workers,
                       "prefetch_factor": loader.prefetch_factor, "sampler": type(loader.sampler).__name__,
                       "collate_fn": getattr(loader.collate_fn, "__qualname__", str(loader.collate_fn))}
    cold_dir = Path(cache_dir) / "bags" if cold else None
    try:
        passes = [time_pass(loader, epoch, device, cold_dir) for epoch in range(epochs)]
    finally:
        iterator = getattr(loader, "_iterator", None)  # persistent workers: stop them now, not at exit
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        del loader, dm
        gc.collect()
    persistent = loader_settings["persistent_workers"]
    timed = passes[1:] if persistent and len(passes) > 1 else passes

    def med(key: str) -> float:
        return statistics.median(p[key] for p in timed)

    seconds = med("seconds")
    slices_per_s = med("slices") / seconds if seconds > 0 else float("nan")
    return {
        "config": Path(config).stem,
        "workers": workers,
        "batch_size": kwargs.get("batch_size", 4),
        "augment": kwargs.get("augment") is not None,
        "timed_passes": len(timed),
        "warm_up_excluded": persistent and len(passes) > 1,
        "batches": int(med("batches")),
        "bags": int(med("bags")),
        "slices": int(med("slices")),
        "seconds": round(seconds, 3),
        "bags_per_s": round(med("bags") / seconds, 1) if seconds > 0 else float("nan"),
        "slices_per_s": round(slices_per_s, 1),
        "first_batch_s": passes[0]["first_batch_s"],
        "first_batch_s_timed": round(med("first_batch_s"), 3),
        "rsna_epoch_min": round(RSNA_EPOCH_SLICES / slices_per_s / 60, 1) if slices_per_s > 0 else float("nan"),
        "loader": loader_settings,
        "passes": passes,
    }


# -- main ---------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="training configs whose data module is CTCacheDataModule")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4, 8], help="DataLoader worker counts to time")
    p.add_argument("--epochs", type=int, default=2, help="passes over the training loader per setting")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: move every batch to the GPU")
    p.add_argument("--scans", type=int, default=40)
    p.add_argument("--slices", type=int, nargs=2, default=(24, 57), metavar=("MIN", "MAX"), help="slices per scan (RSNA: 24 57)")
    p.add_argument("--source-size", type=int, default=512, help="synthetic DICOM image size")
    p.add_argument("--cache-size", type=int, default=256, help="cached slice size")
    p.add_argument("--build-workers", type=int, default=min(os.cpu_count() or 1, 16), help="processes indexing and building the cache")
    p.add_argument("--repeat", type=int, default=4, help="list every training bag this many times (longer epochs)")
    p.add_argument("--cold", action="store_true", help="evict the cache files from the page cache before every pass")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the main process (default: torch's)")
    p.add_argument("--workdir", type=Path, default=None, help="keep the data here (default: a temporary folder, removed)")
    p.add_argument("--out", type=Path, default=None, help="JSON output (default benchmarks/results/cache_loading[_quick].json)")
    p.add_argument("--quick", action="store_true", help="smoke run: 6 scans of 24-30 slices, 64x64 DICOM, 32x32 cache")
    args = p.parse_args(argv)
    if args.quick:
        args.scans, args.slices, args.source_size, args.cache_size = 6, (24, 30), 64, 32
    if args.epochs < 1 or args.repeat < 1:
        p.error("--epochs and --repeat must be at least 1")
    out = args.out or RESULTS / ("cache_loading_quick.json" if args.quick else "cache_loading.json")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = None
    if args.device == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda: no CUDA device")
        device = torch.device("cuda")
        torch.zeros(1, device=device)  # create the context before timing
    settings = {name: data_settings(name) for name in args.configs}

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="milgp_cache_loading_") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        dataset = build(workdir, args.scans, tuple(args.slices), args.source_size, args.cache_size, args.build_workers)
        print(f"{dataset['total_slices']} slices in {dataset['scans']} scans, {args.source_size}x{args.source_size} DICOM -> "
              f"{args.cache_size}x{args.cache_size} {dataset['cache_dtype']} cache ({dataset['cache_mb']} MB): write "
              f"{dataset['write_dicom_s']} s, index {dataset['index_s']} s, cache {dataset['build_cache_s']} s "
              f"({args.build_workers} processes)", flush=True)
        rows = []
        for config, init_args in settings.items():
            splits_file = None
            if args.repeat > 1:
                splits_file = write_repeated_splits(dataset["cache_dir"], init_args, args.repeat, workdir / f"splits_{Path(config).stem}.json")
            for w in args.workers:
                row = run_setting(config, init_args, dataset["cache_dir"], splits_file, w, args.epochs, device, args.cold)
                rows.append(row)
                print(f"  {row['config']}, {w} workers: {row['slices_per_s']} slices/s, {row['bags_per_s']} bags/s "
                      f"({row['batches']} batches in {row['seconds']} s; first batch {row['first_batch_s']} s)", flush=True)
        left = multiprocessing.active_children()
        if left:
            print(f"warning: {len(left)} child processes still running after the loaders were shut down")
    total_s = time.perf_counter() - t_start

    columns = ["config", "workers", "timed_passes", "warm_up_excluded", "batches", "bags", "slices", "seconds", "bags_per_s", "slices_per_s",
               "first_batch_s", "first_batch_s_timed", "rsna_epoch_min"]
    print()
    print(markdown_table(rows, columns))
    print(f"\ntarget: >= {TARGET_SLICES_PER_S:.0f} slices/s (RSNA epoch of {RSNA_EPOCH_SLICES:,} slices in 10 min); "
          f"page cache {'evicted before every pass' if args.cold else 'hot'}; device {args.device}; total {total_s:.1f} s")

    info = machine()  # CPU model and cores
    info["device"] = torch.cuda.get_device_name(device) if device is not None else "cpu"
    result = {
        "benchmark": "cache_loading",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "quick": args.quick,
        "machine": info,
        "settings": {
            "configs": {Path(c).stem: describe_settings(a) for c, a in settings.items()},
            "workers": args.workers,
            "epochs": args.epochs,
            "device": args.device,
            "transfer": "BagBatch tensors .to(cuda, non_blocking=True), synchronise after each pass" if device is not None else None,
            "repeat": args.repeat,
            "page_cache": "evicted before every pass (posix_fadvise DONTNEED, best effort)" if args.cold else "hot",
            "timing": "median over timed passes; with persistent workers (num_workers > 0) the first pass is warm-up when epochs > 1",
            "target_slices_per_s": TARGET_SLICES_PER_S,
        },
        "dataset": {k: v for k, v in dataset.items() if k != "cache_dir"},
        "total_s": round(total_s, 1),
        "results": rows,
    }
    atomic_write_text(out, json.dumps(result, indent=2, default=float) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
