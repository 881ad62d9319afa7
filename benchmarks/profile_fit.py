"""Profile of the closed-form fit's hot paths (cProfile) and per-sweep timings.

    .venv/bin/python -m benchmarks.profile_fit [--quick] [--tag after] [--cprofile]

"Before" numbers come from the same script run against the committed tree:

    git archive HEAD milgp | tar -x -C /tmp/orig
    cd /tmp && PYTHONPATH=/tmp/orig:/work/main /work/main/.venv/bin/python -m benchmarks.profile_fit --tag before

Runs :func:`milgp.variational.fit.fit_closed_form` on the synthetic MIL set (Gaussian clusters,
bags of 10–50) with fixed hyperparameters (CAVI sweeps only) and with hyperparameter learning
(Algorithm 1), and times the prediction path. Writes ``results/profile_fit_<tag>.json``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import milgp
from benchmarks.common import add_thread_arg, batch_from_flat, make_model, markdown_table, set_threads, synthetic_mil, write_json
from milgp.variational.fit import fit_closed_form


def _timed_fit(batch, M, iters, learn):
    model, lik, _ = make_model(batch, M)
    t, c = time.perf_counter(), time.process_time()
    res = fit_closed_form(model, lik, batch, max_iter=iters, tol=0.0, min_iter=iters, learn_hyperparameters=learn, hyper_steps=5)
    dt, dc = time.perf_counter() - t, time.process_time() - c
    return dt / res.iterations, dc / res.iterations, res.elbo[-1]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tag", default="after")
    p.add_argument("--cprofile", action="store_true")
    add_thread_arg(p)
    args = p.parse_args(argv)
    set_threads(args.threads)
    print("milgp from", milgp.__file__)
    N = 20_000 if args.quick else 100_000
    M = 100 if args.quick else 200
    iters = 3 if args.quick else 4
    x, bi, bl, _ = synthetic_mil(N, seed=0)
    batch = batch_from_flat(x, bi, bl)
    rows = []
    for learn in (False, True):
        per, per_cpu, elbo = _timed_fit(batch, M, iters, learn)
        rows.append({"code": args.tag, "N": N, "M": M, "hyperparameters": "learned" if learn else "fixed",
                     "cpu_s_per_iter": per_cpu, "s_per_iter": per, "final_elbo": elbo, "threads": torch.get_num_threads()})
    print(markdown_table(rows))
    prof_text = ""
    if args.cprofile:
        for learn in (False, True):
            model, lik, _ = make_model(batch, M)
            pr = cProfile.Profile()
            pr.enable()
            fit_closed_form(model, lik, batch, max_iter=iters, tol=0.0, min_iter=iters, learn_hyperparameters=learn)
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
            text = f"## hyperparameters {'learned' if learn else 'fixed'}\n" + s.getvalue()
            print(text)
            prof_text += text
    write_json(f"profile_fit_{args.tag}", {"rows": rows, "cprofile": prof_text, "quick": args.quick})
    return rows


if __name__ == "__main__":
    main()
