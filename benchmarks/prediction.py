"""Prediction throughput of a fitted VGPMIL head.

    .venv/bin/python -m benchmarks.prediction [--quick]

* instances/s for ``q(f*)`` (``ClosedFormStrategy.predict_marginals``) plus the instance probability and its
  standard deviation (``LogisticLink.moments``, 40-node quadrature);
* bags/s for the noisy-OR bag probability with std (Eqs. 34–36, quadrature, factorised q(f*));
* bags/s for the bag probability under the joint within-bag ``q(f*_b)``
  (``BagPosterior.from_model`` + ``JointNoisyOrRule``, 512 samples per bag).

Timings are the best of 3 repeats (wall, and process CPU time).
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import add_thread_arg, batch_from_flat, make_model, markdown_table, set_threads, synthetic_mil, write_json
from milgp.data.bags import Bags
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.prediction import BagPosterior, JointNoisyOrRule, NoisyOrRule
from milgp.variational.fit import fit_closed_form


def best_of(fn, repeats=3):
    best_w, best_c = float("inf"), float("inf")
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        best_w, best_c = min(best_w, time.perf_counter() - w), min(best_c, time.process_time() - c)
    return best_w, best_c


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    add_thread_arg(p)
    args = p.parse_args(argv)
    set_threads(args.threads)
    N_train, N_test = (20_000, 50_000) if args.quick else (100_000, 200_000)
    M = 100 if args.quick else 200
    x, bi, bl, _ = synthetic_mil(N_train + N_test, seed=3)
    full = batch_from_flat(x, bi, bl)
    B = full.num_bags
    sizes = torch.bincount(full.bag_index, minlength=B)
    # train on the bags whose instances come first in bag order, test on the rest
    order = torch.arange(B)
    n_train_bags = int((torch.cumsum(sizes, 0) <= N_train).sum())
    train = full.select_bags(order[:n_train_bags])
    test = full.select_bags(order[n_train_bags:])
    model, lik, _ = make_model(train, M)
    fit_closed_form(model, lik, train, max_iter=10, tol=1e-6, learn_hyperparameters=False)
    lik = MILBernoulliLikelihood()
    xt, bit, Bt = test.x, test.bag_index, test.num_bags
    rows = []
    with torch.no_grad():
        w, c = best_of(lambda: model.variational_strategy.predict_marginals(xt))
        rows.append({"what": "q(f*) mean+var (predict_marginals)", "unit": "instances", "count": test.num_instances, "per_s": test.num_instances / w, "per_cpu_s": test.num_instances / c, "wall_s": w})

        def inst():
            mu, var = model.variational_strategy.predict_marginals(xt)
            return lik.instance_link.moments(mu, var)

        w, c = best_of(inst)
        rows.append({"what": "instance probability + std", "unit": "instances", "count": test.num_instances, "per_s": test.num_instances / w, "per_cpu_s": test.num_instances / c, "wall_s": w})

        def noisy_or():
            mu, var = model.variational_strategy.predict_marginals(xt)
            return NoisyOrRule()(BagPosterior(mu, var, Bags(bit, Bt)), lik.instance_link)

        w, c = best_of(noisy_or)
        rows.append({"what": "bag noisy-OR probability + std", "unit": "bags", "count": Bt, "per_s": Bt / w, "per_cpu_s": Bt / c, "wall_s": w})
        nb = min(Bt, 500 if args.quick else 2000)
        sub = test.select_bags(torch.arange(nb))
        gen = torch.Generator().manual_seed(0)

        def joint():
            return JointNoisyOrRule(num_samples=512)(BagPosterior.from_model(model, sub.x, Bags(sub.bag_index, nb)), lik.instance_link, gen)

        w, c = best_of(joint)
        rows.append({"what": "bag joint-sampling probability + std (512 samples)", "unit": "bags", "count": nb, "per_s": nb / w, "per_cpu_s": nb / c, "wall_s": w})
    for r in rows:
        r.update({"M": M, "threads": torch.get_num_threads()})
    print(markdown_table(rows, ["what", "unit", "count", "M", "per_s", "per_cpu_s", "wall_s", "threads"]))
    write_json("prediction", {"quick": args.quick, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
