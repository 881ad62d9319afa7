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
