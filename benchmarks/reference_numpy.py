"""Against a plain reference: the paper's update equations in NumPy, as published code writes them.

    .venv/bin/python -m benchmarks.reference_numpy [--quick]

:class:`ReferenceVGPMIL` is an independent NumPy implementation of Castro-Macías et al. 2024, Eqs. (25)–(28)
(VGPMIL, ψ = φ) in the style of the papers' published code: explicit inverses (``inv(K_zz)``,
``inv(K_zz⁻¹K_zxΘK_xzK_zz⁻¹ + K_zz⁻¹)``), unwhitened ``q(u) = N(m, S)``, the ``N×M`` matrix
``K_xz K_zz⁻¹`` precomputed, and a Python loop over bags (and their instances) for ``π``. It is
run with the same data, inducing points, kernel hyperparameters, jitter, initialisation
(``q(u)`` = prior, ``π`` from one pass at ``μ = 0``), update order and number of sweeps as
``milgp.variational.fit_closed_form`` (hyperparameters fixed), and we check that both reach the
same ELBO and the same predictive moments.
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from benchmarks.common import (
    add_thread_arg, batch_from_bags, batch_from_flat, digits_bags, make_model, markdown_table, model_from,
    set_threads, synthetic_mil, write_json,
)
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.variational.fit import fit_closed_form


def rbf(a: np.ndarray, b: np.ndarray, lengthscale: float, variance: float) -> np.ndarray:
    d2 = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T
    return variance * np.exp(-0.5 * np.maximum(d2, 0) / lengthscale**2)


class ReferenceVGPMIL:
    """VGPMIL coordinate ascent (Castro-Macías et al. 2024, Algorithm 1, steps 4–7), plain NumPy."""

    def __init__(self, X, bag_index, bag_labels, Z, lengthscale, variance, jitter=1e-6, H=100.0):
        self.X, self.Z = X, Z
        self.T = bag_labels
        self.bags = [np.nonzero(bag_index == b)[0] for b in range(len(bag_labels))]
        self.logH = math.log(H)
        self.H = H
        M = len(Z)
        self.Kzz = rbf(Z, Z, lengthscale, variance) + jitter * np.eye(M)
        self.Kzz_inv = np.linalg.inv(self.Kzz)
        self.Kzx = rbf(Z, X, lengthscale, variance)
        self.Kxx_diag = np.full(len(X), variance + jitter)
        self.KxzKzzinv = self.Kzx.T @ self.Kzz_inv  # (N, M)
        self.Ktilde_diag = self.Kxx_diag - np.einsum("nm,mn->n", self.KxzKzzinv, self.Kzx)
        # initial state: q(u) = prior, π from one pass at μ = 0 (as fit_closed_form starts)
        self.m = np.zeros(M)
        self.S = self.Kzz.copy()
        self.pi = np.clip(0.5 * self.T[bag_index], 1e-7, 1 - 1e-7)
        mu, _ = self.moments()
        self.update_pi(mu)

    def moments(self):
        mu = self.KxzKzzinv @ self.m
        var = self.Ktilde_diag + np.einsum("nm,mk,nk->n", self.KxzKzzinv, self.S, self.KxzKzzinv, optimize=True)
        return mu, np.maximum(var, 1e-10)

    @staticmethod
    def theta(c):
        c = np.abs(c)
        out = np.where(c < 1e-3, 0.25 - c * c / 48 + c**4 / 480, np.tanh(np.maximum(c, 1e-3) / 2) / (2 * np.maximum(c, 1e-3)))
        return out

    def update_pi(self, mu):
        pi = self.pi
        for b, idx in enumerate(self.bags):  # Eq. (25), exact E[max y_{b∖n}], coordinate ascent in the bag
            sign = 2 * self.T[b] - 1
            for n in idx:
                others = idx[idx != n]
                p_none = np.prod(1 - pi[others]) if len(others) else 1.0
                pi[n] = min(max(1 / (1 + math.exp(-(mu[n] + self.logH * sign * p_none))), 1e-7), 1 - 1e-7)

    def sweep(self):
        mu, var = self.moments()
        c = np.sqrt(mu**2 + var)
        Theta = self.theta(c)  # Eq. (28)
        A = self.Kzz_inv @ self.Kzx  # K_zz⁻¹ K_zx
        self.S = np.linalg.inv((A * Theta) @ A.T + self.Kzz_inv)  # Eq. (27)
        self.S = 0.5 * (self.S + self.S.T)
        self.m = self.S @ A @ (self.pi - 0.5)  # Eq. (26)
        mu, _ = self.moments()
        self.update_pi(mu)  # Eq. (25)

    def elbo(self):
        mu, var = self.moments()
        c = np.sqrt(mu**2 + var)
        pi = np.clip(self.pi, 1e-7, 1 - 1e-7)
        inst = (pi - 0.5) * mu - (np.abs(c) / 2 + np.log1p(np.exp(-np.abs(c))))  # −log(2cosh(c/2))
        ent = -(pi * np.log(pi) + (1 - pi) * np.log1p(-pi))
        bag = 0.0
        for b, idx in enumerate(self.bags):
            p_any = 1 - np.prod(1 - pi[idx])
            g = self.T[b] * p_any + (1 - self.T[b]) * (1 - p_any)
            bag += self.logH * g - math.log1p(self.H)
        M = len(self.m)
        _, logdet_K = np.linalg.slogdet(self.Kzz)
        _, logdet_S = np.linalg.slogdet(self.S)
        kl = 0.5 * (np.trace(self.Kzz_inv @ self.S) + self.m @ self.Kzz_inv @ self.m - M + logdet_K - logdet_S)
        return float(inst.sum() + ent.sum() + bag - kl)


def compare(name, batch, M, sweeps):
    model, lik, hyper = make_model(batch, M)
    X = batch.x.numpy()
    bi = batch.bag_index.numpy()
    T = batch.bag_labels.numpy()
    Z = hyper["Z"].numpy()
    # ours
    ours = model_from(hyper, natural=True)
    lik = MILBernoulliLikelihood()
    t, c = time.perf_counter(), time.process_time()
    res = fit_closed_form(ours, lik, batch, max_iter=sweeps, tol=0.0, min_iter=sweeps, learn_hyperparameters=False)
    t_ours, c_ours = time.perf_counter() - t, time.process_time() - c
    mu_o, var_o = ours.variational_strategy.predict_marginals(batch.x)
    # reference
    t, c = time.perf_counter(), time.process_time()
    ref = ReferenceVGPMIL(X, bi, T, Z, hyper["lengthscale"], hyper["outputscale"], jitter=ours.variational_strategy.jitter)
    for _ in range(sweeps):
        ref.sweep()
    t_ref, c_ref = time.perf_counter() - t, time.process_time() - c
    elbo_ref = ref.elbo()
    mu_r, var_r = ref.moments()
    return {
        "dataset": name, "N": batch.num_instances, "M": M, "sweeps": sweeps,
        "ours_s": t_ours, "reference_s": t_ref, "speedup": t_ref / t_ours,
        "ours_cpu_s": c_ours, "reference_cpu_s": c_ref, "cpu_speedup": c_ref / c_ours,
        "elbo_ours": res.elbo[-1], "elbo_reference": elbo_ref,
        "elbo_rel_diff": abs(res.elbo[-1] - elbo_ref) / abs(elbo_ref),
        "max_abs_diff_mean": float(np.abs(mu_o.numpy() - mu_r).max()),
        "max_abs_diff_var": float(np.abs(var_o.numpy() - var_r).max()),
        "max_abs_diff_pi": float(np.abs(res.locals.numpy() - ref.pi).max()),
    }


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    add_thread_arg(p)
    args = p.parse_args(argv)
    set_threads(args.threads)
    bags, labels = digits_bags(seed=0)
    plan = [("digits", batch_from_bags(bags, labels), 100, 20)]
    n_syn = 20_000 if args.quick else 100_000
    x, bi, bl, _ = synthetic_mil(n_syn, seed=0)
    plan.append((f"synthetic-{n_syn // 1000}k", batch_from_flat(x, bi, bl), 100 if args.quick else 200, 10))
    rows = []
    with threadpool_limits(args.threads):
        for name, batch, M, sweeps in plan:
            rows.append(compare(name, batch, M, sweeps))
            print(markdown_table(rows[-1:]), flush=True)
    print(markdown_table(rows))
    write_json("reference_numpy", {"quick": args.quick, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
