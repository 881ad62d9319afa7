"""Settings of the AttCNN and the CT cache data module out of range: one line when they are made."""
from __future__ import annotations

from pathlib import Path

import pytest

from lightning_modules.cli import main
from lm_helpers import trainer_cfg, write_config


@pytest.mark.parametrize("setting, message", [
    ({"model": {"lr": -0.1}}, "lr must be a finite number > 0, got -0.1"),
    ({"model": {"weight_decay": -1.0}}, "weight_decay must be a finite number >= 0, got -1.0"),
    ({"model": {"attention_dim": 0}}, "attention_dim must be at least 1, got 0"),
    ({"data": {"batch_size": 0}}, "batch_size must be at least 1, got 0"),
    ({"data": {"batch_size": -2}}, "batch_size must be at least 1, got -2"),
    ({"data": {"eval_batch_size": 0}}, "eval_batch_size must be at least 1, got 0"),
    ({"data": {"max_slices": 0}}, "max_slices must be at least 1 (or None: every slice), got 0"),
    ({"data": {"num_workers": -1}}, "num_workers must be at least 0, got -1"),
])
def test_attcnn_and_ct_cache_settings_out_of_range_are_one_line(tiny_cache: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                setting: dict, message: str) -> None:
    """`milgp-train fit` refuses each with exit status 2, one line naming the setting, and no run
    folder. If this fails, a negative lr or weight decay is torch's 50-line optimiser traceback, a
    batch size, max_slices or num_workers out of range a sampler's traceback after fit/version_0 was
    made, and attention_dim 0 trains a model whose attention is a constant."""
    cfg = {"trainer": trainer_cfg(tmp_path, "run"),
           "model": {"class_path": "lightning_modules.AttentionMILModule", "init_args": setting.get("model", {})},
           "data": {"class_path": "lightning_modules.CTCacheDataModule", "init_args": {"cache_dir": tiny_cache, **setting.get("data", {})}}}
    assert main(["fit", "--config", write_config(tmp_path / "c.yaml", cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()
