"""End-to-end demo (``make demo`` / ``python -m lightning_modules.demo``): synthetic CT scans →
AttCNN → two GP heads, tested on scans like the training ones and on an external thin-slice set.

Every stage goes through the machinery of real runs (``milgp-cache``, ``milgp-train`` with the
YAML files ``configs/demo_*.yaml``, ``milgp-predict``); the README ("The demo") has the stages in
detail and the measured results.

Every model's run folder (checkpoints, logs, reports) is ``<out>/<model>``. ``--quick`` shrinks
everything for the tests (a smoke test, not a result).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import yaml

__all__ = ["DemoSize", "MODELS", "format_table", "main", "run_demo"]

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
MODELS = ("attcnn", "gp_two_stage", "gp_end_to_end")
TEST_SETS = ("internal", "external_thin")
GP_MODELS = ("gp_two_stage", "gp_end_to_end")
_CONFIGS = ("demo_attcnn", "demo_extract", "demo_external", "demo_gp_two_stage", "demo_gp_end_to_end")


@dataclass(frozen=True)
class DemoSize:
    """How big the demo is.

    Attributes:
        scans: training-distribution scans (split 50/20/30 train/val/test by patient).
        slices: ``(min, max)`` slices per scan (5 mm).
        size: slice size in pixels.
        external_scans: scans of the external thin-slice test set.
        slice_factor: how many times more finely the external scans are sliced.
        new_scans: scans given to ``milgp-predict`` as DICOM.
        attcnn_epochs, two_stage_epochs, end_to_end_epochs: training epochs.
        widths: the SmallCNN's channels per block.
        num_inducing: M of the GP heads.
    """

    scans: int = 120
    slices: tuple[int, int] = (30, 40)
    size: int = 32
    external_scans: int = 20
    slice_factor: int = 6
    new_scans: int = 2
    attcnn_epochs: int = 15
    two_stage_epochs: int = 15
    end_to_end_epochs: int = 3
    widths: tuple[int, ...] = (8, 16, 32)
    num_inducing: int = 32


QUICK = DemoSize(scans=16, slices=(6, 8), size=16, external_scans=6, slice_factor=3, new_scans=2, attcnn_epochs=2,
                 two_stage_epochs=3, end_to_end_epochs=1, widths=(4, 8), num_inducing=8)
PHANTOMS = {"lesion_radius": (0.2, 0.35), "noise_hu": 8.0, "lesion_hu": (55.0, 85.0)}
"""The phantom heads of every demo set: small, faint lesions in noisy slices (not trivially separable)."""


def _rewrite(obj: Any, out: str) -> Any:
    if isinstance(obj, dict):
        return {k: _rewrite(v, out) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rewrite(v, out) for v in obj]
    if isinstance(obj, str) and obj.startswith("runs/demo"):
        return out + obj[len("runs/demo"):]
    return obj


def _set(cfg: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        cfg = cfg.setdefault(k, {})
    cfg[keys[-1]] = value


def _write_configs(out: Path, settings: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Copies of the demo configs in ``out/configs`` with ``runs/demo`` replaced by ``out`` and
    ``settings`` (``{"<config stem>": {"dotted.key": value}}``) applied."""
    paths = {}
    (out / "configs").mkdir(parents=True, exist_ok=True)
    for stem in _CONFIGS:
        cfg = _rewrite(yaml.safe_load((CONFIG_DIR / f"{stem}.yaml").read_text(encoding="utf-8")), str(out))
        for key, value in settings.get(stem, {}).items():
            _set(cfg, key, value)
        path = out / "configs" / f"{stem}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
        paths[stem] = str(path)
    return paths


def _fresh_folder(out: str | Path | None) -> Path:
    """``out`` if it is new or empty (a demo never overwrites one); by default the first of
    ``runs/demo``, ``runs/demo_1``, ... that does not exist."""
    from lightning_modules.input_error import InputError

    if out is not None:
        path = Path(out)
        if path.exists() and any(path.iterdir()):
            raise InputError(f"{path} is not empty: the demo writes a new folder (remove it or give another --out)")
        return path
    candidates = (Path("runs/demo" if k == 0 else f"runs/demo_{k}") for k in itertools.count())
    return next(path for path in candidates if not path.exists())


def _banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def _settings(size: DemoSize, seed: int, progress: bool, quick: bool) -> dict[str, dict[str, Any]]:
    common = {"seed_everything": seed, "trainer.enable_progress_bar": progress, **({"trainer.log_every_n_steps": 1} if quick else {})}
    cnn = {"model.init_args.extractor.init_args.widths": list(size.widths)}
    return {
        "demo_attcnn": {**common, **cnn, "trainer.max_epochs": size.attcnn_epochs},
        "demo_gp_two_stage": {**common, "trainer.max_epochs": size.two_stage_epochs, "model.init_args.num_inducing": size.num_inducing},
        "demo_gp_end_to_end": {**common, "trainer.max_epochs": size.end_to_end_epochs, "model.init_args.num_inducing": size.num_inducing},
    }


def rule_comparison(records: list[dict], link: Any, threshold: float = 0.5) -> dict[str, dict[str, Any]]:
    """The paper's noisy-OR (uncalibrated, Castro-Macías et al. 2024, Eq. 34) against the model's own
    calibrated decision on the same instance posterior: AUC, NLL and how many negative and positive
    scans each rule calls positive at ``threshold``.

    ``records`` are a GP model's test records (``gp_mean``/``gp_var`` per slice, ``bag_prob`` of its
    decision, labelled)."""
    import numpy as np
    import torch

    from milgp.data.bags import Bags, bag_index_from_sizes
    from milgp.metrics import auroc, log_loss
    from milgp.prediction import BagPosterior, NoisyOrRule

    mean = torch.as_tensor(np.concatenate([r["gp_mean"] for r in records]), dtype=torch.float64)
    var = torch.as_tensor(np.concatenate([r["gp_var"] for r in records]), dtype=torch.float64)
    index = bag_index_from_sizes([len(r["gp_mean"]) for r in records])
    noisy_or = NoisyOrRule()(BagPosterior(mean, var, Bags(index, len(records))), link)[0].numpy()
    y = np.array([r["bag_label"] for r in records])
    rules = {"noisy_or (paper)": noisy_or, "calibrated default": np.array([r["bag_prob"] for r in records])}
    return {name: {"bag_auc": auroc(p, y), "bag_nll": log_loss(p, y), "negatives_called_positive": int(((p > threshold) & (y == 0)).sum()),
                   "positives_called_positive": int(((p > threshold) & (y == 1)).sum()), "negatives": int((y == 0).sum()),
                   "positives": int((y == 1).sum()), "probabilities": p.tolist(), "labels": y.tolist()}
            for name, p in rules.items()}


def run_demo(out: str | Path | None = None, seed: int = 0, quick: bool = False, progress: bool = False, threads: int = 1) -> dict[str, Any]:
    """Run every stage (README, "The demo") and return the ``metrics.json`` content.

    ``threads``: torch's intra-op threads (default 1: the GP head's tensors are small); the results
    are reproducible for a given seed and thread count."""
    from lightning_modules.callbacks import FeatureWriter
    from lightning_modules.cli import run_cli
    from lightning_modules.input_error import InputError
    from lightning_modules.predict import predict
    from milgp.ct import cache_cli
    from milgp.ct.synthetic import write_rsna_dataset
    from milgp.metrics import json_safe
    from milgp.plots import plot_calibration, plot_rule_comparison

    import torch

    torch.set_num_threads(threads)
    start = time.perf_counter()
    size = QUICK if quick else DemoSize()
    out = _fresh_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _write_configs(out, _settings(size, seed, progress, quick))
    timings: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(banner: str, name: str) -> Iterator[None]:
        """Print the stage's banner and record its wall time as ``timings[name]``."""
        _banner(banner)
        t0 = time.perf_counter()
        yield
        timings[name] = round(time.perf_counter() - t0, 1)

    def cache(name: str, dataset: Any, splits: bool) -> None:
        args = ["rsna", "--images", dataset.image_dir, "--labels", dataset.labels_csv, "--out", str(out / name), "--size", str(size.size),
                "--seed", str(seed), "--no-progress"] + (["--splits", "0.5,0.2,0.3"] if splits else [])
        if cache_cli.main(args) != 0:
            raise InputError(f"milgp-cache could not build {out / name}")

    with stage(f"1/6 synthetic CT: {size.scans} scans of {size.slices[0]}-{size.slices[1]} slices, {size.external_scans} external "
               f"scans re-sliced {size.slice_factor}x thinner, {size.size}x{size.size} pixels, as DICOM", "data_and_cache"):
        internal = write_rsna_dataset(out / "data", n_scans=size.scans, slices=size.slices, size=size.size, seed=seed,
                                      n_patients=max(1, (size.scans * 4) // 5), **PHANTOMS)
        cache("cache", internal, splits=True)
        external = write_rsna_dataset(out / "external_data", n_scans=size.external_scans, slices=size.slices, size=size.size,
                                      seed=seed + 1000, slice_factor=size.slice_factor, **PHANTOMS)
        cache("external_cache", external, splits=False)
        new_scans = write_rsna_dataset(out / "new_scans", n_scans=size.new_scans, slices=size.slices, size=size.size, seed=seed + 2000,
                                       slice_factor=size.slice_factor, prevalence=0.5, **PHANTOMS)
    data_summary = {name: {"scans": len(ds.scans), "slices": sum(len(s.paths) for s in ds.scans),
                           "positive_scans": int(sum(s.bag_label > 0.5 for s in ds.scans))}
                    for name, ds in (("internal", internal), ("external_thin", external), ("new_dicom", new_scans))}
    print(json.dumps(data_summary))

    results: dict[str, dict[str, Any]] = {t: {} for t in TEST_SETS}
    test_records: dict[str, dict[str, list[dict]]] = {t: {} for t in TEST_SETS}
    links: dict[str, Any] = {}

    def test(name: str, config: str, internal_data: Sequence[str] = ()) -> None:
        for test_set, more in (("internal", list(internal_data)), ("external_thin", ["--config", cfg["demo_external"]])):
            cli = run_cli(["test", "--config", config, *more, "--ckpt_path", "best", "--verbose", str(progress).lower()])
            report = json.loads((Path(cli.trainer.log_dir) / "metrics.json").read_text(encoding="utf-8"))
            results[test_set][name] = {**report["metrics"], "report": str(Path(cli.trainer.log_dir)),
                                       "bag_rule": report["model"].get("bag_decision", {}).get("bag_rule")}
            test_records[test_set][name] = cli.model.test_records
            if name in GP_MODELS:
                links[name] = cli.model.gp.likelihood.instance_link

    with stage("2/6 AttCNN: fit, test (internal, external thin-slice), extract features", "attcnn"):
        run_cli(["fit", "--config", cfg["demo_attcnn"]])
        test("attcnn", cfg["demo_attcnn"])
        extract = run_cli(["predict", "--config", cfg["demo_attcnn"], "--config", cfg["demo_extract"], "--ckpt_path", "best"])
        features = next(c.written for c in extract.trainer.callbacks if isinstance(c, FeatureWriter))
        att_best = str(out / "attcnn" / "checkpoints" / "best.ckpt")

    with stage("3/6 two-stage GP on the frozen AttCNN features", "gp_two_stage"):
        inputs = ["--data.init_args.path", features, "--model.init_args.extractor_checkpoint", att_best]
        run_cli(["fit", "--config", cfg["demo_gp_two_stage"], *inputs])
        test("gp_two_stage", cfg["demo_gp_two_stage"], ["--data.init_args.path", features])

    with stage("4/6 end-to-end CNN + GP (CNN initialised from the AttCNN)", "gp_end_to_end"):
        run_cli(["fit", "--config", cfg["demo_gp_end_to_end"], "--model.init_args.extractor_checkpoint", att_best])
        test("gp_end_to_end", cfg["demo_gp_end_to_end"])

    with stage(f"5/6 milgp-predict on {size.new_scans} new DICOM scans", "predict_dicom"):
        predicted = predict(out / "gp_two_stage" / "checkpoints" / "best.ckpt", [new_scans.image_dir], progress=progress)

    _banner("6/6 summary")
    comparison = {name: {t: rule_comparison(test_records[t][name], links[name]) for t in TEST_SETS} for name in GP_MODELS}
    for test_set in TEST_SETS:
        curves = {name: ([r["bag_prob"] for r in test_records[test_set][name]], [r["bag_label"] for r in test_records[test_set][name]])
                  for name in MODELS}
        plot_calibration(out / f"calibration_{test_set}.png", None, None, n_bins=5, curves=curves,
                         title=f"bag calibration, {test_set.replace('_', ' ')} test set")
    plot_rule_comparison(out / "bag_rules_external_thin.png",
                         {f"{name}\n{rule}": (c["external_thin"][rule]["probabilities"], c["external_thin"][rule]["labels"])
                          for name, c in comparison.items() for rule in c["external_thin"]},
                         title=f"external thin-slice scans ({size.slice_factor}x more slices than in training)")
    wall = time.perf_counter() - start
    result = {
        **results,
        "bag_rule_comparison": {name: {t: {rule: {k: v for k, v in stats.items() if k not in ("probabilities", "labels")}
                                           for rule, stats in c[t].items()} for t in TEST_SETS} for name, c in comparison.items()},
        "predictions_new_dicom": str(predicted),
        "run": {"wall_time_s": round(wall, 1), "stage_seconds": timings, "data": data_summary, "size": asdict(size), "quick": quick,
                "seed": seed, "threads": threads, "split_fractions": [0.5, 0.2, 0.3], "out": str(out)},
    }
    (out / "metrics.json").write_text(json.dumps(json_safe(result), indent=2), encoding="utf-8")
    print(format_table(result))
    print(f"\nwrote {out / 'metrics.json'} and plots in {out}/ ({wall:.0f} s)")
    return result


def format_table(result: dict[str, Any]) -> str:
    """The summary printed at the end of the demo: both test sets' metrics, then the rule comparison."""
    cols = ("bag_auc", "bag_accuracy", "bag_ece", "bag_nll", "instance_auc")
    lines = []
    for test_set in TEST_SETS:
        lines.append(f"\n{test_set} test set")
        lines.append(f"{'model':<15}" + "".join(f"{c:>14}" for c in cols))
        for name in MODELS:
            row = result.get(test_set, {}).get(name, {})
            lines.append(f"{name:<15}" + "".join(f"{row[c]:>14.3f}" if isinstance(row.get(c), (int, float)) else f"{'n/a':>14}" for c in cols))
    lines.append("\nbag rules on the same instance posterior, external thin-slice set (negatives called positive at 0.5)")
    for name, per_set in result.get("bag_rule_comparison", {}).items():
        for rule, stats in per_set["external_thin"].items():
            lines.append(f"{name:<15}{rule:<20} AUC {stats['bag_auc']:.3f}   NLL {stats['bag_nll']:.3f}   "
                         f"negatives > 0.5: {stats['negatives_called_positive']}/{stats['negatives']}   "
                         f"positives > 0.5: {stats['positives_called_positive']}/{stats['positives']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_modules.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="a new or empty output folder (default: runs/demo, or runs/demo_<k> when that exists)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the split and every training stage")
    parser.add_argument("--quick", action="store_true", help="tiny data and 1-3 epochs (a smoke test, not a result)")
    parser.add_argument("--progress", action="store_true", help="progress bars")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    from lightning_modules.input_error import run_reporting_input_errors

    return run_reporting_input_errors("demo", lambda: run_demo(args.out, seed=args.seed, quick=args.quick, progress=args.progress,
                                                                     threads=args.threads))


if __name__ == "__main__":
    sys.exit(main())
