"""End-to-end demo (``make demo`` / ``python -m milgp.demo``): synthetic CT → AttCNN → two GP heads.

Stages, all through the same machinery as real runs (``milgp-cache`` and the ``milgp-train``
Lightning CLI with the YAML files in ``configs/``):

1. write a synthetic head-CT dataset as real DICOM files in the RSNA layout
   (:func:`milgp.data.synthetic.write_rsna_dataset`);
2. index and cache it with a patient-grouped train/val/test split (``milgp-cache rsna --splits``);
3. train the AttCNN baseline (``configs/demo_attcnn.yaml``), test it, and write the frozen CNN's
   slice features of every scan (``predict`` + ``configs/demo_extract.yaml``);
4. fit the two-stage GP head on those features (``configs/demo_gp_two_stage.yaml``) and test it;
5. train CNN + GP end to end, the CNN initialised from the AttCNN (``configs/demo_gp_end_to_end.yaml``),
   and test it;
6. write ``<out>/metrics.json`` (test-set metrics of ``attcnn``, ``gp_two_stage``,
   ``gp_end_to_end``), the plots beside it, and print a summary table.

The configs' ``runs/demo`` paths are rewritten to ``--out``; sizes and epochs can be reduced with
``--quick`` (used by the tests). The Lightning machinery is imported only when :func:`main` runs,
so importing :mod:`milgp` never imports Lightning.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import yaml

__all__ = ["main", "run_demo"]

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
MODELS = ("attcnn", "gp_two_stage", "gp_end_to_end")
_STAGE_DIRS = ("data", "cache", "configs", "attcnn", "gp_two_stage", "gp_end_to_end")


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


def _write_configs(out: Path, settings: dict[str, Any]) -> dict[str, str]:
    """Copy the demo YAML configs into ``out/configs`` with paths under ``out`` and ``settings``
    applied (``{"<config stem>": {"dotted.key": value}}``)."""
    paths = {}
    (out / "configs").mkdir(parents=True, exist_ok=True)
    for stem in ("demo_attcnn", "demo_extract", "demo_gp_two_stage", "demo_gp_end_to_end"):
        cfg = _rewrite(yaml.safe_load((CONFIG_DIR / f"{stem}.yaml").read_text(encoding="utf-8")), str(out))
        for key, value in settings.get(stem, {}).items():
            _set(cfg, key, value)
        path = out / "configs" / f"{stem}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
        paths[stem] = str(path)
    return paths


def _banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def run_demo(
    out: str | Path = "runs/demo",
    scans: int = 200,
    slices: tuple[int, int] = (6, 10),
    size: int = 32,
    seed: int = 0,
    quick: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every stage (module docstring) and return the ``metrics.json`` content."""
    from lightning_modules.cli import run_cli  # Lightning only from here on
    from milgp.data import cache_cli
    from milgp.data.synthetic import write_rsna_dataset
    from milgp.plots import plot_calibration

    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*exists and is not empty.*")
    start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for d in _STAGE_DIRS:
        shutil.rmtree(out / d, ignore_errors=True)
    for f in list(out.glob("*_metrics.json")) + list(out.glob("*.png")) + list(out.glob("*_predictions.json")):
        f.unlink()
    (out / "features.npz").unlink(missing_ok=True)

    settings: dict[str, dict[str, Any]] = {}
    common = {"trainer.enable_progress_bar": progress, "seed_everything": seed}
    if quick:
        scans, slices, size = min(scans, 12), (4, 6), min(size, 32)
        settings = {
            "demo_attcnn": {"trainer.max_epochs": 2, "model.init_args.extractor.init_args.widths": [4, 8]},
            "demo_gp_two_stage": {"trainer.max_epochs": 4, "model.init_args.warmup_epochs": 1, "model.init_args.num_inducing": 8},
            "demo_gp_end_to_end": {"trainer.max_epochs": 1, "model.init_args.extractor.init_args.widths": [4, 8],
                                   "model.init_args.num_inducing": 8, "model.init_args.warmup_epochs": 0},
        }
    for stem in ("demo_attcnn", "demo_gp_two_stage", "demo_gp_end_to_end"):
        settings.setdefault(stem, {}).update(common)
    cfg = _write_configs(out, settings)
    timings: dict[str, float] = {}

    def lap(name: str, t0: float) -> None:
        timings[name] = round(time.perf_counter() - t0, 2)

    _banner(f"1/5 writing {scans} synthetic CT scans ({slices[0]}-{slices[1]} slices, {size}x{size}) as DICOM")
    t0 = time.perf_counter()
    ds = write_rsna_dataset(out / "data", n_scans=scans, slices=slices, size=size, seed=seed, n_patients=max(1, (scans * 4) // 5),
                            lesion_radius=(0.2, 0.35), noise_hu=4.0)
    n_slices = sum(len(s.paths) for s in ds.scans)
    print(f"wrote {len(ds.scans)} scans, {n_slices} slices, {sum(s.bag_label > 0.5 for s in ds.scans)} positive scans")
    rc = cache_cli.main(["rsna", "--images", ds.image_dir, "--labels", ds.labels_csv, "--out", str(out / "cache"),
                         "--size", str(size), "--splits", "0.5,0.2,0.3", "--seed", str(seed)]
                        + ([] if progress else ["--no-progress"]))
    if rc != 0:
        raise RuntimeError(f"milgp-cache failed with status {rc}")
    lap("data_and_cache", t0)

    _banner("2/5 AttCNN: fit, test, extract features")
    t0 = time.perf_counter()
    run_cli(["fit", "--config", cfg["demo_attcnn"]])
    # the last epoch, not the best validation AUC: on a dozen validation scans the AUC saturates at 1
    # after a few epochs, long before the probabilities are any good
    att_ckpt = str(out / "attcnn" / "checkpoints" / "last.ckpt")
    run_cli(["test", "--config", cfg["demo_attcnn"], "--ckpt_path", att_ckpt, "--trainer.logger.init_args.version", "test"])
    run_cli(["predict", "--config", cfg["demo_attcnn"], "--config", cfg["demo_extract"], "--ckpt_path", att_ckpt])
    lap("attcnn", t0)

    _banner("3/5 two-stage GP on the frozen AttCNN features")
    t0 = time.perf_counter()
    run_cli(["fit", "--config", cfg["demo_gp_two_stage"]])
    gp_ckpt = str(out / "gp_two_stage" / "checkpoints" / "last.ckpt")
    run_cli(["test", "--config", cfg["demo_gp_two_stage"], "--ckpt_path", gp_ckpt, "--trainer.logger.init_args.version", "test"])
    lap("gp_two_stage", t0)

    _banner("4/5 end-to-end CNN + GP (CNN initialised from the AttCNN)")
    t0 = time.perf_counter()
    run_cli(["fit", "--config", cfg["demo_gp_end_to_end"], "--model.init_args.extractor_checkpoint", att_ckpt])
    e2e_ckpt = str(out / "gp_end_to_end" / "checkpoints" / "last.ckpt")
    run_cli(["test", "--config", cfg["demo_gp_end_to_end"], "--ckpt_path", e2e_ckpt, "--trainer.logger.init_args.version", "test"])
    lap("gp_end_to_end", t0)

    _banner("5/5 summary")
    result: dict[str, Any] = {}
    curves = {}
    for name in MODELS:
        m = json.loads((out / f"{name}_metrics.json").read_text(encoding="utf-8"))["metrics"]
        m["ece"] = m.get("bag_ece")
        result[name] = m
        preds = json.loads((out / f"{name}_predictions.json").read_text(encoding="utf-8"))
        curves[name] = ([p["bag_prob"] for p in preds], [p["bag_label"] for p in preds])
    plot_calibration(out / "calibration.png", None, None, n_bins=5, title="bag calibration on the test scans", curves=curves)
    wall = time.perf_counter() - start
    result["run"] = {
        "wall_time_s": round(wall, 1), "stage_seconds": timings, "scans": scans, "slices": n_slices, "image_size": size,
        "split_fractions": [0.5, 0.2, 0.3], "test_scans": int(result["attcnn"].get("bag_count", 0)), "quick": quick, "seed": seed,
    }
    from milgp.metrics import json_safe

    (out / "metrics.json").write_text(json.dumps(json_safe(result), indent=2), encoding="utf-8")
    print(format_table(result))
    print(f"\nwrote {out / 'metrics.json'} and plots in {out}/ ({wall:.0f} s)")
    return result


def format_table(result: dict[str, Any]) -> str:
    """The summary table printed at the end of the demo."""
    cols = ("bag_auc", "bag_accuracy", "bag_f1", "bag_ece", "instance_auc")
    lines = [f"{'model':<15}" + "".join(f"{c:>14}" for c in cols)]
    for name in MODELS:
        row = result.get(name, {})
        cells = []
        for c in cols:
            v = row.get(c)
            cells.append(f"{v:>14.3f}" if isinstance(v, (int, float)) and v is not None else f"{'n/a':>14}")
        lines.append(f"{name:<15}" + "".join(cells))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m milgp.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    parser.add_argument("--scans", type=int, default=200, help="synthetic scans (default 200)")
    parser.add_argument("--size", type=int, default=32, help="image size in pixels (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the split and every training stage")
    parser.add_argument("--quick", action="store_true", help="tiny data and 1-2 epochs (a smoke test, not a result)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    run_demo(args.out, scans=args.scans, size=args.size, seed=args.seed, quick=args.quick, progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
