"""``milgp-cache``: index a CT dataset and preprocess it into a bag cache (or write a synthetic one).

Examples::

    milgp-cache rsna --images stage_2_train --labels stage_2_train.csv --out cache/rsna --size 256 --workers 8
    milgp-cache cq500 --root CQ500 --reads reads.csv --out cache/cq500
    milgp-cache generic --root my_scans --labels labels.csv --slice-labels slice_labels.csv --out cache/mine
    milgp-cache index --index cache/rsna/index.json --out cache/rsna_128 --size 128
    milgp-cache verify cache/rsna --repair
    milgp-cache synthetic --layout rsna --out data/synthetic --scans 20

Resuming and reporting are described in ``docs/ct_data.md``, "Quick start". Also runs as
``python -m milgp.ct.cache_cli``.

The modules that index, read and cache (and pull in torch) are imported by the command that needs
them, so ``--help`` and argument errors answer at once.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from milgp.ct.cache_lock import CacheLockedError
from milgp.ct.label_rule import LABEL_TARGETS, parse_label_map
from milgp.ct.report_entry import printable
from milgp.ct.windows import HEAD_CT_WINDOWS

if TYPE_CHECKING:
    from milgp.ct.cache import CacheReport
    from milgp.ct.index import BagIndex

__all__ = ["build_parser", "main"]


def _window(text: str) -> tuple[float, float]:
    try:
        center, width = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"window {text!r} is not CENTER,WIDTH (e.g. 40,80)") from None
    if not (math.isfinite(center) and math.isfinite(width)):
        raise argparse.ArgumentTypeError(f"window {text!r}: centre and width must be finite numbers of HU")
    if width <= 0:
        raise argparse.ArgumentTypeError(f"window {text!r} has a non-positive width")
    return center, width


def _fractions(text: str) -> tuple[float, float, float]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not TRAIN,VAL,TEST fractions (e.g. 0.8,0.1,0.1)") from None
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"{text!r}: give three fractions TRAIN,VAL,TEST")
    if any(not 0 <= v for v in values) or values[0] == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: fractions must be >= 0 with a non-empty training share")
    total = sum(values)
    if abs(total - 100) < 1e-6:  # percentages
        return tuple(v / 100 for v in values)  # type: ignore[return-value]
    if abs(total - 1) > 1e-6:
        raise argparse.ArgumentTypeError(f"{text!r}: fractions sum to {total:g}; they must sum to 1 (or to 100 as percentages)")
    return values  # type: ignore[return-value]


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the seed must be an integer >= 0")
    return value


def _label_map(text: str) -> dict[str, float]:
    try:
        return parse_label_map(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_run_options(p: argparse.ArgumentParser, workers_help: str) -> None:
    """The options of every command that writes into a cache."""
    p.add_argument("--workers", type=int, default=1, help=f"worker processes for {workers_help} (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--wait", action="store_true",
                   help="when another milgp-cache process writes into the cache, wait for it instead of refusing")


def _add_index_options(p: argparse.ArgumentParser, aggregate: bool = False) -> None:
    """The options of a command that indexes a layout, then those of every caching command."""
    p.add_argument("--label-map", type=_label_map, default={}, metavar="TEXT=VALUE,...",
                   help="how other label encodings map to numbers, e.g. yes=1,no=0 (MIL labels must end up 0 or 1)")
    if aggregate:
        p.add_argument("--target", choices=LABEL_TARGETS, default="binary",
                       help="binary: MIL labels 0/1 (default); aggregate: finite non-negative bag targets")
    p.add_argument("--allow-non-ct", action="store_true",
                   help="accept non-CT images (MR, ...); their values are recorded in their own units, never as HU")
    p.add_argument("--allow-non-axial", action="store_true", help="accept sagittal, coronal and strongly tilted series")
    _add_cache_options(p)


def _add_cache_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path, help="cache folder (created; an existing one is resumed)")
    p.add_argument("--size", type=int, default=256, help="resize slices to SIZE x SIZE pixels; 0 keeps the native size (default 256)")
    p.add_argument("--dtype", choices=("uint8", "float16"), default="uint8", help="storage dtype (default uint8)")
    p.add_argument(
        "--windows", type=_window, nargs="+", default=list(HEAD_CT_WINDOWS), metavar="CENTER,WIDTH",
        help="display windows in HU, one channel each (default: brain 40,80 subdural 80,200 soft tissue 40,380)",
    )
    p.add_argument("--splits", type=_fractions, default=None, metavar="TRAIN,VAL,TEST",
                   help="also write OUT/splits.json: patient-grouped stratified split of the cached bags with these fractions")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the split, an integer >= 0 (default 0)")
    _add_run_options(p, "header reading and caching")


def build_parser() -> argparse.ArgumentParser:
    """The ``milgp-cache`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="milgp-cache",
        description="Index a CT dataset (RSNA, CQ500 or folder-per-bag layout) and cache windowed, resized slices per bag.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("rsna", help="RSNA layout: a folder of ID_*.dcm and stage_2_train.csv")
    p.add_argument("--images", required=True, type=Path, help="folder of ID_*.dcm slices")
    p.add_argument("--labels", required=True, type=Path, help="stage_2_train.csv")
    _add_index_options(p)
    p = sub.add_parser("cq500", help="CQ500 layout: study folders and reads.csv")
    p.add_argument("--root", required=True, type=Path, help="folder holding the CQ500CT<n> study folders")
    p.add_argument("--reads", required=True, type=Path, help="reads.csv")
    _add_index_options(p)
    p = sub.add_parser("generic", help="one folder per bag plus a bag_id,label CSV")
    p.add_argument("--root", required=True, type=Path, help="folder holding one sub-folder per bag")
    p.add_argument("--labels", required=True, type=Path, help="CSV with columns bag_id,label[,patient_id]")
    p.add_argument("--slice-labels", type=Path, default=None, help="optional CSV with columns bag_id,file,label")
    _add_index_options(p, aggregate=True)
    p = sub.add_parser("index", help="cache from a saved bag index (.json or .csv)")
    p.add_argument("--index", required=True, type=Path, help="bag index written by a previous run (OUT/index.json)")
    _add_cache_options(p)
    p = sub.add_parser("verify", help="check a cache (headers, sizes, checksums, sources, manifest, splits); --repair rebuilds")
    p.add_argument("cache", type=Path, help="the cache folder")
    p.add_argument("--repair", action="store_true",
                   help="rebuild corrupt or stale bags from the recorded sources, drop what cannot be rebuilt from the manifest and splits")
    _add_run_options(p, "rebuilding")
    p = sub.add_parser("synthetic", help="write a synthetic head-CT dataset as real DICOM files")
    p.add_argument("--out", required=True, type=Path, help="output folder (new or empty: an existing dataset is never written into)")
    p.add_argument("--layout", choices=("rsna", "cq500", "generic"), default="rsna")
    p.add_argument("--scans", type=int, default=20, help="number of scans/studies/bags (default 20)")
    p.add_argument("--slices", type=int, nargs=2, default=(10, 14), metavar=("MIN", "MAX"), help="slices per scan (default 10 14)")
    p.add_argument("--size", type=int, default=64, help="image size in pixels (default 64)")
    p.add_argument("--prevalence", type=float, default=0.5, help="fraction of positive scans (default 0.5)")
    p.add_argument("--seed", type=_seed, default=0, help="an integer >= 0 (default 0)")
    return parser


def _synthetic(args: argparse.Namespace) -> int:
    from milgp.ct.synthetic import write_cq500_dataset, write_generic_dataset, write_rsna_dataset

    kw = dict(slices=tuple(args.slices), size=args.size, prevalence=args.prevalence, seed=args.seed)
    if args.layout == "rsna":
        ds = write_rsna_dataset(args.out, n_scans=args.scans, **kw)
        hint = f"milgp-cache rsna --images {ds.image_dir} --labels {ds.labels_csv} --out CACHE"
    elif args.layout == "cq500":
        ds = write_cq500_dataset(args.out, n_studies=args.scans, **kw)
        hint = f"milgp-cache cq500 --root {ds.image_dir} --reads {ds.labels_csv} --out CACHE"
    else:
        ds = write_generic_dataset(args.out, n_bags=args.scans, **kw)
        hint = f"milgp-cache generic --root {ds.image_dir} --labels {ds.labels_csv} --slice-labels {ds.slice_labels_csv} --out CACHE"
    positives = sum(s.bag_label > 0.5 for s in ds.scans)
    print(f"wrote {len(ds.scans)} synthetic {args.layout} scans ({positives} positive) to {args.out}")
    print(f"cache it with: {hint}")
    return 0


def _index(args: argparse.Namespace) -> BagIndex:
    from milgp.ct.cq500 import index_cq500
    from milgp.ct.index import BagIndex
    from milgp.ct.generic_layout import index_generic
    from milgp.ct.label_rule import LabelRule
    from milgp.ct.rsna import index_rsna
    from milgp.ct.series_policy import SeriesPolicy

    if args.command == "index":
        return BagIndex.load(args.index)
    policy = SeriesPolicy(allow_non_ct=args.allow_non_ct, allow_non_axial=args.allow_non_axial)
    rule = LabelRule(getattr(args, "target", "binary"), args.label_map)
    common = dict(workers=args.workers, progress=not args.no_progress, rule=rule, policy=policy)
    if args.command == "rsna":
        return index_rsna(args.images, args.labels, **common)
    if args.command == "cq500":
        return index_cq500(args.root, args.reads, **common)
    return index_generic(args.root, args.labels, args.slice_labels, **common)


def _extend_splits(previous: dict[str, list[str]], cached: BagIndex, fresh: dict[str, BagIndex]) -> dict[str, list[str]]:
    """The splits of ``cached`` that keep every bag of ``previous`` (an earlier ``splits.json``) in
    its split, so that a rerun never moves a bag between splits (a test bag trained on): a bag new
    to the splits goes to its patient's split when the patient is already placed, else to the
    split ``fresh`` (a fresh split of all of ``cached``) gives it. Bags no longer cached leave."""
    by_id = {b.bag_id: b for b in cached.bags}
    out = {name: [b for b in previous.get(name, []) if b in by_id] for name in [*fresh, *(n for n in previous if n not in fresh)]}
    split_of_patient: dict[str, str] = {}
    for name, ids in out.items():
        for b in ids:
            split_of_patient.setdefault(by_id[b].patient_id, name)
    placed = {b for ids in out.values() for b in ids}
    fresh_of = {b: name for name, s in fresh.items() for b in s.bag_ids}
    for b in cached.bags:
        if b.bag_id not in placed:
            out[split_of_patient.setdefault(b.patient_id, fresh_of[b.bag_id])].append(b.bag_id)
    return out


def _write_splits(index: BagIndex, report: CacheReport, out: Path, fractions: tuple[float, float, float], seed: int) -> None:
    """Write ``out/splits.json`` over the bags this run cached (computed or reused) and say which
    bags of ``index`` it leaves out (failed ones; ``skipped.json`` has the reasons). Bags the
    indexer refused never reach ``index``, so no bag is in the splits without being cached. An
    existing ``splits.json`` is extended, never reshuffled (:func:`_extend_splits`).

    Raises:
        ValueError: when the training split would be empty (nothing is written).
    """
    from milgp.data.atomic import atomic_write_json
    from milgp.ct.index import read_splits, split_by_patient

    path = out / "splits.json"
    cached = index.subset(report.done + report.reused)
    fresh = split_by_patient(cached, fractions, seed=seed)
    splits = {name: s.bag_ids for name, s in fresh.items()}
    if path.is_file():
        try:
            splits = _extend_splits(read_splits(path), cached, fresh)
        except (OSError, ValueError) as err:
            print(f"milgp-cache: warning: {printable(str(err))}; splitting the cached bags afresh", file=sys.stderr)
    shares = ",".join(f"{f:g}" for f in fractions)
    if not splits["train"]:
        raise ValueError(f"--splits {shares} leaves the training split empty for the {len(cached)} cached bags "
                         f"({len({b.patient_id for b in cached.bags})} patients); {printable(path)} not written "
                         "(the cache is built: rerun with a larger training share)")
    for name in ("val", "test"):
        if not splits[name]:
            print(f"milgp-cache: warning: --splits {shares} leaves the {name} split empty for the {len(cached)} cached bags",
                  file=sys.stderr)
    atomic_write_json(path, splits)
    sizes = ", ".join(f"{name} {len(ids)}" for name, ids in splits.items())
    print(f"splits.json: {len(cached)} cached bags ({sizes})")
    kept = set(cached.bag_ids)
    dropped = [b for b in index.bag_ids if b not in kept]
    if dropped:
        shown = ", ".join(dropped[:10]) + (f" and {len(dropped) - 10} more" if len(dropped) > 10 else "")
        print(f"  left out of splits.json: {len(dropped)} bags that were not cached ({printable(shown)}); see {printable(out / 'skipped.json')}")


def _warn_stale_splits(path: Path, cached: set[str]) -> None:
    """Warn on stderr when an existing ``splits.json`` (from an earlier run) names bags this cache lacks."""
    from milgp.ct.index import read_splits

    try:
        listed = {b for ids in read_splits(path).values() for b in ids}
    except ValueError as err:
        print(f"milgp-cache: warning: {err}", file=sys.stderr)
        return
    missing = sorted(listed - cached)
    if missing:
        print(f"milgp-cache: warning: {printable(path)} (from an earlier run) lists {len(missing)} bags not in this cache "
              f"(e.g. {printable(missing[0])!r}); rerun with --splits to rewrite it", file=sys.stderr)


def _verify(args: argparse.Namespace) -> int:
    from milgp.ct.cache_verify import verify_cache

    report = verify_cache(args.cache, repair=args.repair, wait_s=math.inf if args.wait else 0.0, workers=args.workers,
                          progress=not args.no_progress)
    print(report.summary())
    state = "clean" if not report.problems else ("repaired" if report.ok else "problems remain")
    print(f"milgp-cache: verify {printable(args.cache)}: {report.checked} bags checked, {len(report.problems)} problems, "
          f"{state}", file=sys.stderr)
    return 0 if report.ok else 1


def _build(args: argparse.Namespace) -> int:
    from milgp.ct.cache import CacheParams, build_cache, check_cache_params
    from milgp.ct.cache_lock import CacheLock

    params = CacheParams(windows=tuple(args.windows), size=None if args.size == 0 else args.size, dtype=args.dtype)
    check_cache_params(args.out, params)  # before writing anything: a refused run leaves the cache as it was
    created = not args.out.exists()
    try:
        with CacheLock(args.out, wait_s=math.inf if args.wait else 0.0):  # before indexing: a second writer is refused at once
            index = _index(args)
            report = build_cache(index, args.out, params, workers=args.workers, progress=not args.no_progress)
            cached = len(report.done) + len(report.reused)
            if args.splits is not None and cached > 0:
                _write_splits(index, report, args.out, args.splits, args.seed)
            elif (args.out / "splits.json").is_file():
                _warn_stale_splits(args.out / "splits.json", set(report.done + report.reused))
    except BaseException:
        if created and args.out.is_dir() and not any(args.out.iterdir()):
            args.out.rmdir()  # a run that wrote nothing leaves no empty cache folder behind
        raise
    print(report.summary())
    print(report.summary_line(), file=sys.stderr)
    return 0 if cached > 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``milgp-cache``; returns the exit status (0 ok, 1 error, nothing cached or a cache with
    problems left, 130 interrupted)."""
    for stream in (sys.stdout, sys.stderr):  # a file name the terminal's encoding lacks must not fail the run
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "synthetic":
            return _synthetic(args)
        if args.command == "verify":
            return _verify(args)
        return _build(args)
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume (finished bags are kept)", file=sys.stderr)
        return 130
    except (ValueError, KeyError, OSError, CacheLockedError) as err:
        print(f"milgp-cache: error: {printable(str(err))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
