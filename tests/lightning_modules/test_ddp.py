"""Two CPU processes (DDP, gloo) hold the same q(u) and match one process on the same data."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _run(out: Path, devices: int, shuffle: bool) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONWARNINGS="ignore")
    args = [sys.executable, str(HERE / "ddp_run.py"), str(out), str(devices)] + (["shuffle"] if shuffle else [])
    proc = subprocess.run(args, cwd=str(out), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
def test_ddp_two_processes_same_q_and_same_as_one_process(tmp_path: Path, shuffle: bool) -> None:
    """End-to-end GP, 2 epochs × 2 steps: with `strategy="ddp"`, `devices=2` on CPU the natural
    step's statistics are all-reduced, so both ranks end with bit-identical q(u), kernel and CNN
    weights, and the result equals a single process given each step's union of the two ranks'
    bags (up to float summation order).

    If the ranks differ, the NaturalStatistics are not summed across ranks (each rank would fit
    q(u) to its own shard); if DDP differs from one process, the scaling of the statistics or of
    the ELBO gradient by the global batch is wrong; if it differs only when shuffled, a bag that
    moved to the other rank in epoch 2 lost its π (the locals are not shared across ranks)."""
    _run(tmp_path, 2, shuffle)
    _run(tmp_path, 1, shuffle)
    tag = "_shuffle" if shuffle else ""
    r0 = torch.load(tmp_path / f"devices2{tag}_rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / f"devices2{tag}_rank1.pt", weights_only=True)
    one = torch.load(tmp_path / f"devices1{tag}_rank0.pt", weights_only=True)
    assert r0["steps"] == r1["steps"] == one["steps"] == 4
    assert torch.equal(r0["m"], r1["m"]) and torch.equal(r0["S"], r1["S"])
    for k in r0["state"]:
        assert torch.equal(r0["state"][k], r1["state"][k]), k
    torch.testing.assert_close(r0["m"], one["m"], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(r0["S"], one["S"], rtol=1e-4, atol=1e-6)
    for k in one["state"]:
        if one["state"][k].is_floating_point():
            torch.testing.assert_close(r0["state"][k].double(), one["state"][k].double(), rtol=1e-4, atol=1e-5, msg=k)
    assert set(r0["locals"]) == set(r1["locals"]) == set(one["locals"]) and len(one["locals"]) == 8
    for k in one["locals"]:
        assert torch.equal(r0["locals"][k], r1["locals"][k]), k
        torch.testing.assert_close(r0["locals"][k], one["locals"][k], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_milgp_train_runs_ddp_from_the_command_line(tmp_path: Path) -> None:
    """`milgp-train fit ... --trainer.strategy ddp --trainer.devices 2` as a user types it: Lightning
    starts rank 1 by running the same command again, so the CLI must leave ``sys.argv`` whole.
    Before, rank 1 got no arguments, printed the usage and exited, and rank 0 waited for it forever.
    Then `predict` on two ranks writes every scan once, each with its slice positions."""
    from lightning_modules.features import FeatureTable, save_features
    from lm_helpers import feature_bags, trainer_cfg, write_config

    bags = feature_bags(num_bags=16, dim=4)
    ids = [f"b{i}" for i in range(16)]
    save_features(tmp_path / "f.npz", FeatureTable.from_bags(bags["bags"], ids, bags["bag_labels"]))
    cfg = {"seed_everything": 0, "trainer": trainer_cfg(tmp_path, "run", max_epochs=1),
           "model": {"class_path": "lightning_modules.GPMILModule", "init_args": {"feature_dim": 4, "num_inducing": 4}},
           "data": {"class_path": "lightning_modules.FeatureDataModule", "init_args": {"path": str(tmp_path / "f.npz"), "batch_size": 4}}}
    config = write_config(tmp_path / "gp.yaml", cfg)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
    for sub, extra in (("fit", []), ("predict", ["--ckpt_path", "last", "--data.init_args.predict_split", "all"])):
        proc = subprocess.run([sys.executable, "-m", "lightning_modules.cli", sub, "--config", config, *ddp, *extra],
                              cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
    import csv

    with open(tmp_path / "run" / "predict" / "version_0" / "slices.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert sorted({r["bag_id"] for r in rows}) == sorted(ids) and len(rows) == sum(len(b) for b in bags["bags"])


def test_the_cli_ends_the_process_group_it_ran_in(tmp_path: Path) -> None:
    """After a subcommand under DDP the CLI waits for the ranks and destroys the process group
    (checked in a child process: Lightning's launcher writes the DDP variables into os.environ).

    If this fails, a Gloo group is left alive at exit, where its worker threads can abort the rank
    that finished first ("terminate called without an active exception", exit code -6: `predict`
    on two CPU ranks, while rank 0 still wrote its plots); Lightning destroys only NCCL groups."""
    from lightning_modules.features import FeatureTable, save_features
    from lm_helpers import feature_bags, trainer_cfg, write_config

    bags = feature_bags(num_bags=8, dim=3)
    save_features(tmp_path / "f.npz", FeatureTable.from_bags(bags["bags"], [f"b{i}" for i in range(8)], bags["bag_labels"]))
    cfg = {"seed_everything": 0, "trainer": trainer_cfg(tmp_path, "run", max_epochs=1),
           "model": {"class_path": "lightning_modules.GPMILModule", "init_args": {"feature_dim": 3, "num_inducing": 4}},
           "data": {"class_path": "lightning_modules.FeatureDataModule", "init_args": {"path": str(tmp_path / "f.npz"), "batch_size": 4}}}
    config = write_config(tmp_path / "gp.yaml", cfg)
    child = (
        "import torch.distributed as dist\n"
        "from lightning_modules.cli import run_cli\n"
        f"run_cli(['fit', '--config', {config!r}, '--trainer.strategy', 'ddp', '--trainer.devices', '1', '--trainer.accelerator', 'cpu'])\n"
        "print('process group alive:', dist.is_initialized())\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", child], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "process group alive: False" in proc.stdout, proc.stdout[-3000:]
