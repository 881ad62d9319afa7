"""Scaling of the closed-form fit: time per sweep and peak memory against N and M.

    .venv/bin/python -m benchmarks.scaling [--quick] [--threads 1]

Each configuration runs in a fresh subprocess (``python -m benchmarks.scaling --child N M``) so
that its peak resident memory (``resource.getrusage(RUSAGE_SELF).ru_maxrss``, the high-water mark
of the whole process, torch's allocations included) is its own. A child generates the synthetic
MIL set (10-D Gaussian clusters, bags of 10–50), places M inducing points (k-means++), and runs
full-batch CAVI sweeps at fixed hyperparameters; "s/sweep" excludes the first sweep (which also
computes and caches ``A = L⁻¹K_zx``, timed separately as "A setup"). The largest configuration is
also fitted end to end with Algorithm 1 (CAVI sweeps alternating with Adam steps on the kernel
hyperparameters, ``hyper_max_instances=20000``; 3 warm-up sweeps + at most 10 iterations). Log-log exponents are least-squares slopes of
log(s/sweep) on log N and log M.
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

from benchmarks.common import add_thread_arg, markdown_table, peak_rss_gib, set_threads, write_json



def child(N: int, M: int, sweeps: int, learn_iters: int, threads: int) -> dict:
    set_threads(threads)
    from benchmarks.common import batch_from_flat, make_model, synthetic_mil
    from milgp.variational.fit import fit_closed_form

    t0 = time.perf_counter()
    x, bi, bl, _ = synthetic_mil(N, seed=0)
    batch = batch_from_flat(x, bi, bl)
    del x, bi, bl
    model, lik, _ = make_model(batch, M)
    setup_s = time.perf_counter() - t0
    rss_data = peak_rss_gib()
    times, cpu = [], []
    last = [time.perf_counter(), time.process_time()]

    def cb(it, elbo):
        now, now_c = time.perf_counter(), time.process_time()
        times.append(now - last[0])
        cpu.append(now_c - last[1])
        last[0], last[1] = now, now_c

    last[0], last[1] = time.perf_counter(), time.process_time()
    res = fit_closed_form(model, lik, batch, max_iter=sweeps + 1, tol=0.0, min_iter=sweeps + 1, learn_hyperparameters=False, callback=cb)
    first = times[0]
    per_sweep = float(np.mean(times[1:])) if len(times) > 1 else first
    out = {
        "N": N, "M": M, "s_per_sweep": per_sweep,
        "cpu_s_per_sweep": float(np.mean(cpu[1:])) if len(cpu) > 1 else cpu[0], "first_sweep_s": first, "A_setup_s": first - per_sweep,
        "data_and_init_s": setup_s, "peak_rss_gib": peak_rss_gib(), "rss_after_data_gib": rss_data,
        "elbo": res.elbo[-1], "threads": torch.get_num_threads(),
    }
    if learn_iters:
        model2, lik2, _ = make_model(batch, M)
        t2 = time.perf_counter()
        warm = fit_closed_form(model2, lik2, batch, max_iter=3, tol=0.0, min_iter=3, learn_hyperparameters=False)
        res2 = fit_closed_form(model2, lik2, batch, max_iter=learn_iters, tol=1e-5, learn_hyperparameters=True, hyper_steps=5, hyper_max_instances=20000)
        out.update({
            "full_fit_s": time.perf_counter() - t2, "full_fit_iterations": warm.iterations + res2.iterations,
            "full_fit_elbo": res2.elbo[-1], "full_fit_peak_rss_gib": peak_rss_gib(),
        })
    return out


def run_child(N: int, M: int, sweeps: int, learn_iters: int, threads: int, timeout: float = 3600) -> dict:
    cmd = [sys.executable, "-W", "ignore", "-m", "benchmarks.scaling", "--child", str(N), str(M), "--sweeps", str(sweeps),
           "--learn-iters", str(learn_iters), "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if proc.returncode != 0:
        return {"N": N, "M": M, "error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def slope(xs, ys) -> float:
    lx, ly = np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float))
    return float(np.polyfit(lx, ly, 1)[0])


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--child", nargs=2, type=int, metavar=("N", "M"))
    p.add_argument("--sweeps", type=int, default=3)
    p.add_argument("--learn-iters", type=int, default=0)
    add_thread_arg(p)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.sweeps, args.learn_iters, args.threads)))
        return None
    set_threads(args.threads)  # the children use the same count; recorded in the JSON
    if args.quick:
        Ns, M0 = [10_000, 30_000, 100_000], 200
        Ms, N0 = [50, 100, 200, 400], 10_000
        big = None
    else:
        Ns, M0 = [10_000, 30_000, 100_000, 300_000, 1_000_000], 200
        Ms, N0 = [50, 100, 200, 500, 1000], 20_000
        big = (1_000_000, 200, 10)
    rows_n, rows_m = [], []
    for N in Ns:
        learn = big[2] if big and (N, M0) == big[:2] else 0
        r = run_child(N, M0, 3 if N < 1_000_000 else 2, learn, args.threads)
        rows_n.append(r)
        print(json.dumps(r), flush=True)
    for M in Ms:
        cached = next((r for r in rows_n if r.get("N") == N0 and r.get("M") == M), None)
        r = cached or run_child(N0, M, 3, 0, args.threads)
        rows_m.append(r)
        print(json.dumps(r), flush=True)
    ok_n = [r for r in rows_n if "error" not in r]
    ok_m = [r for r in rows_m if "error" not in r]
    key = "cpu_s_per_sweep" if all("cpu_s_per_sweep" in r for r in ok_n + ok_m) else "s_per_sweep"
    exp_n = slope([r["N"] for r in ok_n], [r[key] for r in ok_n]) if len(ok_n) > 1 else float("nan")
    exp_m = slope([r["M"] for r in ok_m], [r[key] for r in ok_m]) if len(ok_m) > 1 else float("nan")
    top = ok_m[len(ok_m) // 2 :]
    exp_m_top = slope([r["M"] for r in top], [r[key] for r in top]) if len(top) > 1 else float("nan")
    wall_exp_n = slope([r["N"] for r in ok_n], [r["s_per_sweep"] for r in ok_n]) if len(ok_n) > 1 else float("nan")
    wall_exp_m = slope([r["M"] for r in ok_m], [r["s_per_sweep"] for r in ok_m]) if len(ok_m) > 1 else float("nan")
    exp_mem_n = slope([r["N"] for r in ok_n[1:]], [r["peak_rss_gib"] - ok_n[0]["peak_rss_gib"] + 1e-3 for r in ok_n[1:]]) if len(ok_n) > 2 else float("nan")
    cols = ["N", "M", "cpu_s_per_sweep", "s_per_sweep", "A_setup_s", "peak_rss_gib", "threads"]
    print("### time per sweep vs N (M = %d)\n" % M0 + markdown_table(ok_n, cols))
    print("\n### time per sweep vs M (N = %d)\n" % N0 + markdown_table(ok_m, cols))
    summary = {"timing": key, "exponent_N": exp_n, "exponent_M": exp_m, "exponent_M_upper_half": exp_m_top,
               "wall_exponent_N": wall_exp_n, "wall_exponent_M": wall_exp_m, "expected": "N^1 M^2"}
    big_row = next((r for r in ok_n if "full_fit_s" in r), None)
    if big_row:
        summary.update({
            "million_fit_s": big_row["full_fit_s"], "million_fit_iterations": big_row["full_fit_iterations"],
            "million_fit_peak_rss_gib": big_row["full_fit_peak_rss_gib"],
            "million_target_met": big_row["full_fit_peak_rss_gib"] <= 8.0 and big_row["full_fit_s"] <= 30 * 60,
        })
        print(f"\n1e6 instances, M=200, Algorithm 1 with hyperparameters: {big_row['full_fit_s']:.0f} s, "
              f"{big_row['full_fit_iterations']} iterations, peak RSS {big_row['full_fit_peak_rss_gib']:.2f} GiB")
    print("\n" + markdown_table([summary]))
    write_json("scaling", {"quick": args.quick, "vs_N": rows_n, "vs_M": rows_m, "summary": summary})
    return summary


if __name__ == "__main__":
    main()
