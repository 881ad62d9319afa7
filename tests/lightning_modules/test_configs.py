"""The shipped configs: valid for milgp-train, naming data paths and the run folder only."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_modules.cli import run_cli

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MODEL_CONFIGS = sorted(p.name for p in CONFIGS.glob("*.yaml") if "model" in (yaml.safe_load(p.read_text()) or {}))
INPUTS = {"default_root_dir", "cache_dir", "path", "extractor_checkpoint", "weights_path", "splits_file"}
OUTPUTS = {"dirpath", "save_dir", "output_dir", "output_path", "logger"}


def _keys(obj: object) -> set[str]:
    if isinstance(obj, dict):
        return set(obj) | {k for v in obj.values() for k in _keys(v)}
    if isinstance(obj, list):
        return {k for v in obj for k in _keys(v)}
    return set()


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_config_names_no_output_path(name: str) -> None:
    """A config names its data and, for a model, its run folder (trainer.default_root_dir); every
    output path (checkpoints, logs, reports, features) derives from the run folder.

    The configs hard-coded five or six output paths each, which --trainer.default_root_dir did not move."""
    keys = _keys(yaml.safe_load((CONFIGS / name).read_text()))
    assert not keys & OUTPUTS, keys & OUTPUTS


@pytest.mark.parametrize("name", MODEL_CONFIGS)
def test_model_config_parses_and_selects_by_validation_nll(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every model config is valid for milgp-train, and best.ckpt follows the validation bag NLL."""
    with pytest.raises(SystemExit) as err:
        run_cli(["fit", "--config", str(CONFIGS / name), "--print_config"])
    assert err.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["checkpoint"]["monitor"] == "val/bag_nll" and printed["checkpoint"]["mode"] == "min"
    assert printed["trainer"]["default_root_dir"].startswith("runs/")
