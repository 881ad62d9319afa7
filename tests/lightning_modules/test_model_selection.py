"""Model selection by a proper score, with a checkpoint from the first epoch on."""
from __future__ import annotations

import csv
from pathlib import Path

import torch

from lightning_modules.cli import run_cli
from lightning_modules.features import FeatureTable, save_features
from lm_helpers import feature_bags, trainer_cfg, write_config


def test_best_checkpoint_follows_validation_nll_and_exists_during_warm_up(tmp_path: Path) -> None:
    """`--trainer.max_epochs 3` with 10 warm-up epochs leaves a usable best.ckpt, and it is the epoch
    with the lowest validation bag NLL (a proper score; AUC saturates at 1.0 early).

    No checkpoint was written during warm-up epochs (no optimiser step, so Lightning's step counter
    stood still), and best.ckpt followed validation bag AUC."""
    bags = feature_bags(num_bags=30, seed=5)
    save_features(tmp_path / "f.npz", FeatureTable.from_bags(bags["bags"], [f"b{i:02d}" for i in range(30)], bags["bag_labels"],
                                                             bags["instance_labels"]))
    cfg = {"seed_everything": 0, "trainer": trainer_cfg(tmp_path, "run", max_epochs=3),
           "model": {"class_path": "lightning_modules.GPMILModule", "init_args": {"feature_dim": 4, "num_inducing": 6, "warmup_epochs": 10}},
           "data": {"class_path": "lightning_modules.FeatureDataModule", "init_args": {"path": str(tmp_path / "f.npz")}}}
    run_cli(["fit", "--config", write_config(tmp_path / "c.yaml", cfg)])
    best = tmp_path / "run" / "checkpoints" / "best.ckpt"
    assert best.is_file()
    with open(tmp_path / "run" / "fit" / "version_0" / "metrics.csv", newline="") as fh:
        nll = {int(r["epoch"]): float(r["val/bag_nll"]) for r in csv.DictReader(fh) if r.get("val/bag_nll")}
    assert sorted(nll) == [0, 1, 2]
    ckpt = torch.load(best, weights_only=True)
    assert ckpt["epoch"] == min(nll, key=nll.get)
    state = next(v for k, v in ckpt["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert state["monitor"] == "val/bag_nll" and abs(float(state["best_model_score"]) - min(nll.values())) < 1e-6
    run_cli(["test", "--config", str(tmp_path / "c.yaml"), "--ckpt_path", "best"])
