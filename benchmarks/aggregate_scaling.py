"""Scaling of VBAgg (aggregate outputs) training with minibatches of whole bags.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 .venv/bin/python -m benchmarks.aggregate_scaling [--quick] [--threads 1]

Backs the claim of the VBAgg issue / docs/aggregate.md: "bags of thousands of instances and a
total of 10⁶ instances fit in memory with minibatches of bags". Each configuration runs in a fresh
subprocess (``python -m benchmarks.aggregate_scaling --child MODEL N M``) so that its peak resident
memory (``ru_maxrss``: the high-water mark of the whole process, data generation and torch
included) is its own.

**Data** (synthetic, known truth). Bag ``a`` has a centre ``c_a ~ N(0, I₅)``; its instances are
``x_i = c_a + s·ε_i`` (5-D covariates; ``s`` = ``--spread``, default 0.8, so rates vary inside a
bag as well as between bags); bag sizes are uniform in ``--bag-sizes`` (default 1,000–3,000).
Individual rate ``λ(x) = exp(g(x))`` with the smooth log-rate
``g(x) = 0.8 + 0.6 sin(x₁) + 0.5 cos(x₂) + 0.4 tanh(x₃ + x₄)`` (``x₅`` is irrelevant), populations
``p_i ~ U(0.5, 1.5)``. Poisson models observe ``y_a ~ Poisson(Σ_i p_i λ_i)``; the Normal model
observes ``y_a ~ N(Σ_i p_i λ_i, τ Σ_i p_i²)`` with ``τ = 1``.

**Models** (:func:`milgp.variational.aggregate_fit.fit_aggregate` on a
:class:`milgp.models.SparseGP`, set up as :class:`milgp.estimators.VBAggRegressor` does: M
inducing points by k-means++, median-heuristic lengthscale, constant mean at the link value of
the pooled rate): Poisson with the exp link (Lemma-1 bound, marginals only), Poisson with the
square link (Taylor approximation, per-bag covariance blocks ``S^a``, chunked by
``block_budget``), and Normal (exact, conjugate, ``wᵀS^a w`` blocks for the objective).

**Training.** ``--epochs`` (default 2) epochs over random minibatches of ``--bags-per-batch`` whole
bags (default: a tenth of the bags): each minibatch takes one stochastic natural step on q(v)
(Robbins–Monro ρ_t) and ``--hyper-steps`` Adam steps on the kernel/mean/τ; each epoch ends with
the full-data objective (part of the timed epoch). "s/epoch" is wall time, "CPU s/epoch" process
CPU time (user + system); on a shared machine the two differ when the process waits for a core.

**Correctness check.** The true rate is known, so each row reports the MSE of the posterior mean
rate ``E[Ψ(f(x_i))]`` on (a fixed subsample of up to 200,000) training individuals against
``λ_i``, beside the constant-in-bag baseline ``λ̂_i = y_a / Σ_{j∈a} p_j``
(:class:`milgp.baselines.ConstantRateRegressor`'s in-bag prediction). A model that learned
nothing beyond bag totals cannot beat that baseline.

Results: ``benchmarks/results/aggregate_scaling.json`` (``--quick``: ``aggregate_scaling_quick.json``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import torch

from benchmarks.common import Clock, add_thread_arg, markdown_table, peak_rss_gib, set_threads, write_json

MODELS = {  # name -> (likelihood, link)
    "poisson-exp": ("poisson", "exp"),
    "poisson-square": ("poisson", "square"),
    "normal": ("normal", "identity"),
}
TAU = 1.0  # Normal observation noise per unit squared population


def log_rate(x: np.ndarray) -> np.ndarray:
    """The true smooth log-rate ``g(x)`` ``(N,)`` of 5-D covariates."""
    return 0.8 + 0.6 * np.sin(x[:, 0]) + 0.5 * np.cos(x[:, 1]) + 0.4 * np.tanh(x[:, 2] + x[:, 3])


def make_data(N: int, model: str, bag_sizes=(1000, 3000), spread: float = 0.8, dim: int = 5, seed: int = 0) -> dict:
    """Synthetic aggregate data with exactly ``N`` instances (module docstring).

    Returns ``x (N, dim)``, ``bag_index (N,)`` (bags contiguous), ``sizes (B,)``, ``pop (N,)``,
    ``lam (N,)`` (true individual rates) and ``y (B,)`` (observed aggregates).
    """
    rng = np.random.default_rng(seed)
    lo, hi = bag_sizes
    sizes = []
    while sum(sizes) < N:
        sizes.append(int(rng.integers(lo, hi + 1)))
    sizes[-1] -= sum(sizes) - N
    if sizes[-1] < lo // 2 and len(sizes) > 1:  # fold a small remainder into the previous bag
        last = sizes.pop()
        sizes[-1] += last
    sizes_a = np.asarray(sizes)
    B = len(sizes_a)
    bag_index = np.repeat(np.arange(B), sizes_a)
    centres = rng.standard_normal((B, dim))
    x = centres[bag_index]
    x += spread * rng.standard_normal((N, dim))
    lam = np.exp(log_rate(x))
    pop = rng.uniform(0.5, 1.5, N)
    mean_a = np.bincount(bag_index, weights=pop * lam, minlength=B)
    if MODELS[model][0] == "poisson":
        y = rng.poisson(mean_a).astype(np.float64)
    else:
        w2 = np.bincount(bag_index, weights=pop * pop, minlength=B)
        y = mean_a + np.sqrt(TAU * w2) * rng.standard_normal(B)
    return {"x": x, "bag_index": bag_index, "sizes": sizes_a, "pop": pop, "lam": lam, "y": y}


def child(model_name: str, N: int, M: int, epochs: int, bags_per_batch: int | None, hyper_steps: int, lr: float,
          bag_sizes: tuple[int, int], spread: float, block_budget: int, threads: int, rho_max: float = 1.0,
          seed: int = 0) -> dict:
    set_threads(threads)
    from milgp.data.bags import BagBatch
    from milgp.inducing import kmeans_pp_inducing, median_lengthscale
    from milgp.likelihoods.aggregate_normal import NormalAggregateLikelihood
    from milgp.likelihoods.aggregate_poisson import PoissonAggregateLikelihood
    from milgp.models.sparse_gp import SparseGP
    from milgp.variational.aggregate_fit import fit_aggregate

    rss_import = peak_rss_gib()  # torch + gpytorch + milgp alone (about 0.8 GiB here)
    likelihood_name, link = MODELS[model_name]
    setup = Clock()
    with setup:
        d = make_data(N, model_name, bag_sizes, spread, seed=seed)
        B = len(d["sizes"])
        x = torch.as_tensor(d["x"])
        bag_index = torch.as_tensor(d["bag_index"])
        pop = torch.as_tensor(d["pop"])
        y = torch.as_tensor(d["y"])
        lik = PoissonAggregateLikelihood(link) if likelihood_name == "poisson" else NormalAggregateLikelihood(noise=1.0)
        lik = lik.to(torch.float64)
        x_np = d["x"]
        Z = kmeans_pp_inducing(x_np, np.zeros(len(x_np)), M, seed=seed)
        gp = SparseGP(torch.as_tensor(Z), constant_mean=True, lengthscale=median_lengthscale(x_np, seed=seed), outputscale=1.0)
        rate = float(d["y"].sum() / d["pop"].sum())
        c = math.log(rate) if link == "exp" else math.sqrt(rate) if link == "square" else rate
        gp.mean_module.constant.data.fill_(c)
        batch = BagBatch(x, bag_index, y, instance_weights=pop)
    rss_data = peak_rss_gib()
    bpb = bags_per_batch or max(1, B // 10)

    wall, cpu = [], []
    clock = {"w": 0.0, "c": 0.0}

    def cb(it, elbo):
        now_w, now_c = time.perf_counter(), time.process_time()
        wall.append(now_w - clock["w"])
        cpu.append(now_c - clock["c"])
        clock["w"], clock["c"] = now_w, now_c

    clock["w"], clock["c"] = time.perf_counter(), time.process_time()
    res = fit_aggregate(
        gp, lik, batch, max_iter=epochs, tol=0.0, min_iter=epochs, learn_hyperparameters=hyper_steps > 0,
        hyper_steps=max(1, hyper_steps), lr=lr, bags_per_batch=bpb, block_budget=block_budget, rho_max=rho_max, seed=seed,
        callback=cb,
    )
    # correctness: posterior mean rate vs the truth, against the constant-in-bag baseline
    rng = np.random.default_rng(seed + 1)
    sub = np.sort(rng.choice(N, min(N, 200_000), replace=False))
    mean, var = gp.variational_strategy.predict_marginals(x[sub])
    with torch.no_grad():
        pred = lik.rate_mean(mean, var).numpy()
    lam = d["lam"][sub]
    pop_a = np.bincount(d["bag_index"], weights=d["pop"], minlength=B)
    const = (d["y"] / pop_a)[d["bag_index"][sub]]
    return {
        "model": model_name, "N": N, "M": M, "bags": B, "bag_size_min": int(d["sizes"].min()),
        "bag_size_max": int(d["sizes"].max()), "bags_per_batch": bpb, "minibatches_per_epoch": math.ceil(B / bpb),
        "epochs": res.iterations, "hyper_steps": hyper_steps, "rho_max": rho_max, "final_rho": res.rho,
        "s_per_epoch": float(np.mean(wall)), "cpu_s_per_epoch": float(np.mean(cpu)),
        "s_epochs": [float(v) for v in wall], "cpu_s_epochs": [float(v) for v in cpu],
        "setup_s": setup.wall, "peak_rss_gib": peak_rss_gib(), "rss_after_import_gib": rss_import, "rss_after_setup_gib": rss_data,
        "objective": res.elbo[-1], "objective_per_epoch": [float(v) for v in res.elbo],
        "objective_per_bag": res.elbo[-1] / B,
        "rate_mse": float(np.mean((pred - lam) ** 2)), "const_mse": float(np.mean((const - lam) ** 2)),
        "rate_var": float(np.var(lam)), "mse_points": int(len(sub)),
        "lengthscale": float(gp.covar_module.base_kernel.lengthscale.detach().reshape(-1)[0]),
        "outputscale": float(gp.covar_module.outputscale.detach()),
        "threads": torch.get_num_threads(),
    }


def run_child(model: str, N: int, M: int, args, timeout: float = 3600) -> dict:
    cmd = [sys.executable, "-W", "ignore", "-m", "benchmarks.aggregate_scaling", "--child", model, str(N), str(M),
           "--epochs", str(args.epochs), "--hyper-steps", str(args.hyper_steps), "--lr", str(args.lr),
           "--bag-sizes", str(args.bag_sizes[0]), str(args.bag_sizes[1]), "--spread", str(args.spread),
           "--block-budget", str(args.block_budget), "--rho-max", str(args.rho_max), "--threads", str(args.threads)]
    if args.bags_per_batch:
        cmd += ["--bags-per-batch", str(args.bags_per_batch)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    except subprocess.TimeoutExpired:
        return {"model": model, "N": N, "M": M, "error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"model": model, "N": N, "M": M, "error": proc.stderr[-2000:]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["child_wall_s"] = time.perf_counter() - t
    return out


def parse_configs(specs: list[str]) -> list[tuple[str, int, int]]:
    """``MODEL:N:M`` strings, e.g. ``poisson-square:300000:100``."""
    out = []
    for s in specs:
        model, n, m = s.split(":")
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; choose from {sorted(MODELS)}")
        out.append((model, int(float(n)), int(m)))
    return out


# The block likelihoods (square link, Normal) cost O(Σ_a n_a²·M) per pass, ~1 ms per instance per
# epoch for bags of ~2,000 on one core: 10⁶ instances would take ~20 min per epoch, beyond this
# benchmark's ~12-minute budget; run them with e.g. ``--configs normal:1000000:100`` on a faster machine.
FULL_CONFIGS = [("poisson-exp", 100_000, 100), ("poisson-square", 100_000, 100), ("normal", 100_000, 100),
                ("poisson-exp", 1_000_000, 100)]
QUICK_CONFIGS = [("poisson-exp", 100_000, 50), ("poisson-square", 10_000, 50), ("normal", 10_000, 50)]
COLUMNS = ["model", "N", "M", "bags", "bags_per_batch", "epochs", "s_per_epoch", "cpu_s_per_epoch", "peak_rss_gib",
           "objective", "rate_mse", "const_mse"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="N = 10⁴ (block models) and 10⁵ (exp link), < 1 min: aggregate_scaling_quick.json")
    p.add_argument("--child", nargs=3, metavar=("MODEL", "N", "M"))
    p.add_argument("--configs", nargs="*", help="MODEL:N:M to run instead of the default set")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--bags-per-batch", type=int, default=None, help="default: a tenth of the bags")
    p.add_argument("--hyper-steps", type=int, default=1, help="Adam steps per minibatch (0: fixed hyperparameters)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--bag-sizes", nargs=2, type=int, default=[1000, 3000])
    p.add_argument("--spread", type=float, default=0.8)
    p.add_argument("--block-budget", type=int, default=2_000_000)
    p.add_argument("--rho-max", type=float, default=1.0, help="cap of the Robbins–Monro natural step")
    add_thread_arg(p)
    args = p.parse_args(argv)
    if args.child:
        model, n, m = args.child
        print(json.dumps(child(model, int(float(n)), int(m), args.epochs, args.bags_per_batch, args.hyper_steps, args.lr,
                               tuple(args.bag_sizes), args.spread, args.block_budget, args.threads, args.rho_max)))
        return None
    set_threads(args.threads)  # the children use the same count; recorded in the JSON
    if args.configs:
        configs = parse_configs(args.configs)
    elif args.quick:
        configs = QUICK_CONFIGS
    else:
        configs = FULL_CONFIGS
    rows = []
    t0 = time.perf_counter()
    for model, N, M in configs:
        r = run_child(model, N, M, args)
        rows.append(r)
        print(json.dumps(r), flush=True)
    ok = [r for r in rows if "error" not in r]
    print("\n" + markdown_table(ok, COLUMNS))
    for r in rows:
        if "error" in r:
            print(f"\nFAILED {r['model']} N={r['N']} M={r['M']}: {r['error']}")
    settings = {"epochs": args.epochs, "bags_per_batch": args.bags_per_batch or "B/10", "hyper_steps": args.hyper_steps,
                "lr": args.lr, "rho_max": args.rho_max, "bag_sizes": list(args.bag_sizes), "spread": args.spread, "block_budget": args.block_budget,
                "dim": 5, "total_wall_s": time.perf_counter() - t0}
    write_json("aggregate_scaling", {"quick": args.quick, "settings": settings, "rows": rows})
    failed = [r for r in rows if "error" in r]
    if failed:
        raise RuntimeError(f"{len(failed)} configuration(s) failed: " + ", ".join(f"{r['model']}@{r['N']}" for r in failed))
    return rows


if __name__ == "__main__":
    main()
