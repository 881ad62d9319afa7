"""A GP fit on RSNA-sized slice features, on the CPU and on a GPU.

The two-stage path fits the GP on features a frozen CNN extracted from every slice. RSNA's
training set holds about 750,000 slices in scans of 24–57 slices; this benchmark fits VGPMIL
(ψ = PG, H = 100, the largest-other-π rule of the shipped configs, M = 200 inducing points) on
that many synthetic 32-D slice features (Gaussian clusters, one of them the positive concept;
:func:`milgp.data.synthetic_mil.synthetic_mil` with bags of 24–57) with Algorithm 1 of
Castro-Macías et al. 2024 (*Hyperparameter-free variational Gaussian processes for multiple
instance learning*): full-batch closed-form sweeps of q(v) and the locals, each followed by 5 Adam
steps on the kernel hyperparameters on a random 20,000-instance subset
(:func:`milgp.variational.fit.fit_closed_form`), to a relative ELBO change of 1e-5 or ``--iters``
iterations.

"fit s" is the wall time of the fit alone, the data already on the device and the inducing
points placed (k-means++ on the CPU, timed separately as "setup s"); on a GPU it ends with a
synchronisation. Peak memory: ``torch.cuda.max_memory_allocated`` on a GPU, the process's peak
RSS on the CPU.

    python -m benchmarks.rsna_size_fit --device cpu cuda          # writes benchmarks/results/rsna_size_fit.json
    python -m benchmarks.rsna_size_fit --instances 50000 --device cpu   # a small run
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.common import batch_from_flat, machine, make_model, markdown_table, model_from, peak_rss_gib
from milgp.data.atomic import atomic_write_text
from milgp.data.synthetic_mil import synthetic_mil
from milgp.likelihoods import MILBernoulliLikelihood
from milgp.variational.fit import fit_closed_form

RESULT_PATH = Path(__file__).resolve().parent / "results" / "rsna_size_fit.json"


def fit_on(device: str, batch, model, iters: int) -> dict:
    """Fit a copy of ``model`` on ``batch`` on ``device``; the row of the results table."""
    dev = torch.device(device)
    model = model.to(dev)
    likelihood = MILBernoulliLikelihood(psi="pg", H=100.0, max_rule="max").to(dev)
    data = batch.to(dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = fit_closed_form(model, likelihood, data, max_iter=iters, tol=1e-5, learn_hyperparameters=True,
                             hyper_steps=5, hyper_max_instances=20000)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    kernel = model.covar_module
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "fit_s": round(seconds, 2), "iterations": result.iterations, "s_per_iteration": round(seconds / max(1, result.iterations), 3),
        "final_elbo": float(result.elbo[-1]),
        "lengthscale": float(kernel.base_kernel.lengthscale.detach().cpu().mean()), "outputscale": float(kernel.outputscale.detach().cpu()),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else peak_rss_gib(), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--instances", type=int, default=750_000, help="slices (default RSNA's ~750,000)")
    p.add_argument("--dim", type=int, default=32, help="feature dimension (the extractors' default 32)")
    p.add_argument("--num-inducing", type=int, default=200)
    p.add_argument("--iters", type=int, default=30, help="largest number of Algorithm 1 iterations")
    p.add_argument("--device", nargs="+", default=["cpu"], help="devices to fit on, in turn (cpu, cuda)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    p.add_argument("--out", default=str(RESULT_PATH))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    x, bag_index, bag_labels, _ = synthetic_mil(args.instances, dim=args.dim, bag_sizes=(24, 57), seed=0)
    batch = batch_from_flat(x, bag_index, bag_labels)
    del x
    _, _, hyper = make_model(batch, args.num_inducing)  # k-means++ inducing points, median lengthscale
    setup_s = time.perf_counter() - t0
    rows = []
    for device in args.device:
        row = fit_on(device, batch, model_from(hyper), args.iters)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(markdown_table(rows, ["device", "fit_s", "iterations", "s_per_iteration", "final_elbo", "peak_mem_gib"]))
    report = {"benchmark": "rsna_size_fit", "machine": machine(), "instances": args.instances, "bags": int(batch.num_bags),
              "dim": args.dim, "num_inducing": args.num_inducing, "setup_s": round(setup_s, 1), "results": rows}
    atomic_write_text(args.out, json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
