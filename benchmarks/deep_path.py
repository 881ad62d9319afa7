"""Deep-path throughput: slices/s and peak memory of AttCNN and end-to-end GP training steps.

Each measured step is one optimisation step on ``--bags`` bags of ``S`` slices (S in
``--slices``, default the RSNA range 24/40/57) at ``--size``×``--size`` pixels:

* ``attcnn``: CNN forward on all slices → gated attention → bag BCE → backward → AdamW step
  (:class:`lightning_modules.AttentionMILModule`);
* ``gp_end_to_end``: CNN forward → float64 GP head: closed-form natural step of q(u) on the detached
  features + locals update, then the ELBO's data term → backward → Adam on CNN + kernel (the
  computations of :meth:`lightning_modules.GPMILModule.training_step`, without a Trainer).

Peak memory: CUDA ``max_memory_allocated`` over the step (above the pre-step allocation, and in
total); CPU the peak resident set size during the step above the resident size before it, and the
process's peak RSS (sampled every 2 ms from ``/proc/self/status``).

    python -m benchmarks.deep_path                      # CPU, reduced size (64 px), writes benchmarks/results/deep_path.json
    python -m benchmarks.deep_path --device cuda --size 512 --amp --out benchmarks/results/deep_path_cuda.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from contextlib import nullcontext
from typing import Callable

import torch
import torch.nn.functional as F

from lightning_modules import AttentionMILModule, GPMILModule, ResNetExtractor, SmallCNN
from milgp.data.atomic import atomic_write_text
from milgp.data.bags import Bags, bag_index_from_sizes


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


class _PeakRSS:
    def __init__(self) -> None:
        self.peak = 0.0
        self._stop = threading.Event()

    def __enter__(self) -> "_PeakRSS":
        self.base = _rss_mb()
        self.peak = self.base
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_mb())
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())


def _extractor(arch: str, dim: int) -> torch.nn.Module:
    if arch == "small":
        return SmallCNN(feature_dim=dim, widths=(16, 32, 64))
    return ResNetExtractor(arch=arch, feature_dim=dim, norm="group")


def _attcnn_step(model: AttentionMILModule, opt: torch.optim.Optimizer, amp: bool, device: str) -> Callable:
    def step(x: torch.Tensor, bag_index: torch.Tensor, labels: torch.Tensor) -> None:
        ctx = torch.autocast(device_type=device, dtype=torch.float16) if amp else nullcontext()
        with ctx:
            out = model(x, Bags(bag_index, len(labels)))
        loss = F.binary_cross_entropy_with_logits(out["logits"].float(), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def gp_head_update(model: GPMILModule, opt: torch.optim.Optimizer, h: torch.Tensor, bag_index: torch.Tensor, labels: torch.Tensor) -> None:
    """The GP head's part of :meth:`GPMILModule.training_step` on features ``h`` ``(N, D)`` of bags
    ``bag_index`` with ``labels`` ``(B,)``: the closed-form natural step (a minibatch step of size
    ½ scaled ×10) and the locals, then the hyperparameter objective, its backward (into ``h``) and
    an optimiser step."""
    z = model.gp.standardize(h.float())
    steps = model.gp.fit_steps(z, Bags(bag_index, len(labels)), labels)
    steps.minibatch_step(None, 0.5, 10.0)
    loss = -steps.hyper_objective(z) / len(z)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    model.gp.strategy.clear_caches()


def _gp_step(model: GPMILModule, opt: torch.optim.Optimizer, amp: bool, device: str) -> Callable:
    def step(x: torch.Tensor, bag_index: torch.Tensor, labels: torch.Tensor) -> None:
        ctx = torch.autocast(device_type=device, dtype=torch.float16) if amp else nullcontext()
        with ctx:
            h = model.extractor(x)
        with torch.autocast(device_type=device, enabled=False):  # the head in float64
            gp_head_update(model, opt, h, bag_index, labels)
    return step


def run(args: argparse.Namespace) -> dict:
    device = args.device
    torch.manual_seed(0)
    results = []
    for name in ("attcnn", "gp_end_to_end"):
        for S in args.slices:
            cnn = _extractor(args.arch, args.feature_dim)
            if name == "attcnn":
                model = AttentionMILModule(cnn, attention_dim=64).to(device)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                step = _attcnn_step(model, opt, args.amp, device)
            else:
                model = GPMILModule(mode="end_to_end", extractor=cnn, num_inducing=args.num_inducing).to(device)
                with torch.no_grad():
                    x0 = torch.rand(64, 3, args.size, args.size, device=device)
                    model.gp.initialize(model.extractor(x0), torch.arange(64, device=device) % 2)
                opt = torch.optim.Adam([{"params": model.gp.hyperparameters(), "lr": 1e-2},
                                        {"params": model.extractor.parameters(), "lr": 1e-4}])
                step = _gp_step(model, opt, args.amp, device)
            model.train()
            sizes = [S] * args.bags
            x = torch.rand(sum(sizes), 3, args.size, args.size, device=device)
            bag_index = bag_index_from_sizes(sizes, device=device)
            labels = (torch.arange(args.bags, device=device) % 2).float()
            step(x, bag_index, labels)  # warm-up
            times, peaks, absolute = [], [], []
            for _ in range(args.steps):
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                with _PeakRSS() as rss:
                    t0 = time.perf_counter()
                    step(x, bag_index, labels)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                peaks.append((torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else rss.peak - rss.base)
                absolute.append(torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else rss.peak)
            med = statistics.median(times)
            row = {"model": name, "slices_per_bag": S, "bags_per_step": args.bags, "image_size": args.size,
                   "step_s_median": round(med, 4), "slices_per_s": round(S * args.bags / med, 2),
                   "peak_mem_mb": round(max(peaks), 1), "peak_total_mb": round(max(absolute), 1)}
            print(json.dumps(row), flush=True)
            results.append(row)
            del model, opt, x
    return {
        "device": device, "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "arch": args.arch, "feature_dim": args.feature_dim,
        "num_inducing": args.num_inducing, "amp": args.amp, "memory": "peak_mem_mb: CUDA max_memory_allocated above the pre-step allocation; peak_total_mb: max_memory_allocated" if device == "cuda"
        else "peak_mem_mb: peak RSS during the step above the RSS before it (after a warm-up step, so the allocator's cache is already held); peak_total_mb: peak RSS of the process", "results": results,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--size", type=int, default=None, help="image size (default 64 on CPU, 512 on CUDA)")
    p.add_argument("--slices", type=int, nargs="+", default=[24, 40, 57])
    p.add_argument("--bags", type=int, default=2, help="bags per step")
    p.add_argument("--steps", type=int, default=3, help="timed steps per setting (after one warm-up step)")
    p.add_argument("--arch", default="resnet18", choices=("small", "resnet18", "resnet34", "resnet50"))
    p.add_argument("--feature-dim", type=int, default=32)
    p.add_argument("--num-inducing", type=int, default=200)
    p.add_argument("--amp", action="store_true", help="float16 autocast for the CNN (CUDA)")
    p.add_argument("--out", default="benchmarks/results/deep_path.json")
    args = p.parse_args()
    args.size = args.size or (64 if args.device == "cpu" else 512)
    report = run(args)
    atomic_write_text(args.out, json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
