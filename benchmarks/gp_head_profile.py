"""The GP head's end-to-end training step alone: time, kernel launches and host synchronisations.

On a GPU the float64 GP head works on a few hundred values per step, so its cost is the host's:
one launch per operation and a stall at every read of a device value back to the host. This
profiles the head's part of :meth:`lightning_modules.GPMILModule.training_step`
(:func:`benchmarks.deep_path.gp_head_update`: the closed-form natural step on the detached
features, the locals, the hyperparameter objective and its backward, the Adam step) on ``--bags`` bags of
``S`` instances of 32 random features (``S`` in ``--slices``), with the module's default
likelihood, M = 200:

* ``step_ms_median``: wall time per step, median of 20 after 5 warm-up steps;
* CUDA: ``gpu_kernels`` (kernels the profiler saw in one step), ``gpu_busy_ms`` (their summed
  duration) and ``host_syncs`` with ``sync_sites`` (``torch.cuda.set_sync_debug_mode("warn")``:
  each operation that made the host wait for the GPU, by the library lines that called it);
* CPU: ``dispatched_ops`` (ATen operations dispatched in one step, the launches a GPU would get).

    python -m benchmarks.gp_head_profile --device cuda --out benchmarks/results/gp_head_profile_cuda.json
    python -m benchmarks.gp_head_profile                       # CPU: dispatched operations
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
import traceback
import warnings
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.deep_path import gp_head_update
from lightning_modules import GPMILModule, SmallCNN
from milgp.data.atomic import atomic_write_text
from milgp.data.bags import bag_index_from_sizes

_LIBRARY = ("/milgp/", "/lightning_modules/")


def head_step(device: str, slices: int, bags: int) -> Callable[[], None]:
    """The head's training step on fixed random features (``bags × slices``, 32-D) on ``device``."""
    torch.manual_seed(0)
    model = GPMILModule(mode="end_to_end", extractor=SmallCNN(feature_dim=32, widths=(8, 8, 8)), num_inducing=200).to(device)
    model.gp.initialize(torch.randn(64, 32, device=device), torch.arange(64, device=device) % 2)
    opt = torch.optim.Adam([{"params": model.gp.hyperparameters(), "lr": 1e-2}])
    bag_index = bag_index_from_sizes([slices] * bags, device=device)
    labels = (torch.arange(bags, device=device) % 2).float()
    h = torch.randn(bags * slices, 32, device=device, requires_grad=True)

    return lambda: gp_head_update(model, opt, h, bag_index, labels)


def _library_lines() -> str:
    frames = [f"{f.filename.split('/main/')[-1]}:{f.lineno}" for f in traceback.extract_stack() if any(s in f.filename for s in _LIBRARY)]
    return " <- ".join(reversed(frames[-3:]))


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def profile(device: str, slices: int, bags: int) -> dict:
    step = head_step(device, slices, bags)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(5):
        step()
    sync()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    row = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "slices_per_bag": slices, "bags": bags,
           "step_ms_median": round(statistics.median(times) * 1e3, 2)}
    if device != "cuda":
        with _CountOps() as ops:
            step()
        return {**row, "dispatched_ops": ops.count}
    sites: collections.Counter = collections.Counter()
    shown = warnings.showwarning
    warnings.showwarning = lambda message, *a, **k: sites.update([_library_lines()]) if "synchroniz" in str(message).lower() else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            step()
            torch.cuda.set_sync_debug_mode(0)
    finally:
        warnings.showwarning = shown
    sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {**row, "gpu_kernels": len(kernels), "gpu_busy_ms": round(sum(e.device_time for e in kernels) / 1e3, 2),
            "host_syncs": sum(sites.values()), "sync_sites": dict(sites)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--slices", type=int, nargs="+", default=[24, 57])
    p.add_argument("--bags", type=int, default=4)
    p.add_argument("--out", default=None, help="JSON file (default: print only)")
    args = p.parse_args()
    rows = [profile(args.device, s, args.bags) for s in args.slices]
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.out:
        atomic_write_text(args.out, json.dumps({"torch": torch.__version__, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
