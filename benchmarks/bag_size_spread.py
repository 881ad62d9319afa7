"""Bags whose lengths differ by two orders of magnitude, with few witnesses (scikit-learn's digits).

Real MIL collections mix short and long bags (a molecule with two conformations beside one with a
thousand; a 5 mm CT series beside a 0.6 mm one), and a long bag holds as few witnesses as a short
one. The development sets of ``benchmarks/real_mil.py`` do not test that, so this script builds
such sets from the digits that ship with scikit-learn and judges them exactly as ``real_mil``
does (same rows, same columns, stratified 5-fold CV over bags × shuffles).

Per data draw: 50 bags, half positive; bag lengths ``⌊exp(U)⌋`` with ``U`` stratified uniform on
``[ln 2, ln 100]`` (log-uniform, 2 to 99 instances, one length in each fiftieth of the range, in
random order); a positive bag holds 1–3 nines (at most its length), every other instance is
another digit; no digit is in two bags.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bag_size_spread           # 3 draws × 3 shuffles
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bag_size_spread --quick   # 1 draw × 1 shuffle

Prints a markdown table per draw and writes ``benchmarks/results/bag_size_spread.json``.
"""
from __future__ import annotations

import argparse
import warnings
from typing import Any

import numpy as np
from sklearn.datasets import load_digits

from benchmarks.common import add_thread_arg, markdown_table, set_threads, write_json
from benchmarks.real_mil import COLUMNS, DEFAULT_SEEDS, MODELS, evaluate

NUM_BAGS = 50
MAX_LENGTH = 100


def spread_bags(seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """One draw: ``NUM_BAGS`` bags ``(n_b, 64)`` of digits and their labels ``(B,)`` (see the module
    docstring)."""
    rng = np.random.default_rng(seed)
    x, digit = load_digits(return_X_y=True)
    nines = list(rng.permutation(np.nonzero(digit == 9)[0]))
    others = list(rng.permutation(np.nonzero(digit != 9)[0]))
    # stratified log-uniform lengths: every draw spans the whole range with about the same total
    u = (rng.permutation(NUM_BAGS) + rng.uniform(size=NUM_BAGS)) / NUM_BAGS
    bags, labels = [], []
    for b, length in enumerate(np.exp(np.log(2) + u * np.log(MAX_LENGTH / 2)).astype(int)):
        label = b % 2
        witnesses = min(length, int(rng.integers(1, 4))) if label else 0
        rows = [nines.pop() for _ in range(witnesses)] + [others.pop() for _ in range(length - witnesses)]
        bags.append(x[rows])
        labels.append(label)
    return bags, np.array(labels)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--draws", type=int, default=3, help="data draws (seeds 0..n-1)")
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="CV shuffles per draw")
    p.add_argument("--quick", action="store_true", help="one draw, one shuffle")
    add_thread_arg(p)
    args = p.parse_args(argv)
    set_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    draws, shuffles = (1, 1) if args.quick else (args.draws, args.seeds)
    results = {}
    for draw in range(draws):
        bags, y = spread_bags(draw)
        lengths = [len(b) for b in bags]
        print(f"\n### draw {draw} — {len(bags)} bags, {sum(lengths)} instances, lengths {min(lengths)}–{max(lengths)} "
              f"(median {int(np.median(lengths))}); 5-fold CV × {shuffles} shuffle(s)\n", flush=True)
        rows = evaluate(bags, y, list(range(shuffles)), list(MODELS))
        print(markdown_table(rows, COLUMNS), flush=True)
        results[f"draw_{draw}"] = rows
    write_json("bag_size_spread" + ("_quick" if args.quick else ""), {"draws": draws, "shuffles": shuffles, "results": results})
    return results


if __name__ == "__main__":
    main()
