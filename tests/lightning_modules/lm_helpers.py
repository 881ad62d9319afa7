"""Helpers of the Lightning tests: tiny in-memory image/feature bags and YAML configs for ``milgp-train``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import yaml


def image_bags(num_bags: int = 8, size: int = 16, seed: int = 0, max_slices: int = 5) -> dict[str, Any]:
    """Random 3-channel image bags whose positive instances carry a bright square."""
    rng = np.random.default_rng(seed)
    bags, labels, inst = [], [], []
    for b in range(num_bags):
        n = int(rng.integers(1, max_slices + 1))
        x = rng.uniform(0, 0.3, size=(n, 3, size, size)).astype(np.float32)
        y = np.zeros(n, np.float32)
        if b % 2 == 1:
            k = int(rng.integers(n))
            x[k, :, 4:9, 4:9] += 0.7
            y[k] = 1
        bags.append(x)
        labels.append(float(b % 2))
        inst.append(y)
    return {"bags": bags, "bag_labels": labels, "instance_labels": inst}


def feature_bags(num_bags: int = 24, dim: int = 4, seed: int = 0) -> dict[str, Any]:
    """Feature bags: instances N(0, I); positive bags hold 1–2 instances shifted by +2.5 on every feature."""
    rng = np.random.default_rng(seed)
    bags, labels, inst = [], [], []
    for b in range(num_bags):
        n = int(rng.integers(2, 7))
        x = rng.standard_normal((n, dim)).astype(np.float32)
        y = np.zeros(n, np.float32)
        if b % 2:
            k = rng.choice(n, size=min(n, int(rng.integers(1, 3))), replace=False)
            x[k] += 2.5
            y[k] = 1
        bags.append(x)
        labels.append(float(b % 2))
        inst.append(y)
    return {"bags": bags, "bag_labels": labels, "instance_labels": inst}


def write_config(path: Path, cfg: dict) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return str(path)


def trainer_cfg(root: Path, name: str, max_epochs: int = 1, **extra: Any) -> dict:
    """A small CPU trainer section whose run folder is ``root/name`` (every output goes under it)."""
    cfg = {
        "accelerator": "cpu", "devices": 1, "max_epochs": max_epochs, "default_root_dir": str(root / name),
        "enable_progress_bar": False, "enable_model_summary": False, "log_every_n_steps": 1, "num_sanity_val_steps": 0,
    }
    cfg.update(extra)
    return cfg


def report(run: Path, subcommand: str = "test", version: int = 0) -> dict:
    """The ``metrics.json`` a ``test``/``validate`` wrote into the run folder ``run``."""
    return json.loads((run / subcommand / f"version_{version}" / "metrics.json").read_text())
