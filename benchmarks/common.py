"""Shared helpers of the benchmark suite: data sets, model set-up, timing, JSON/markdown output."""
from __future__ import annotations

import json
import os
import platform
import re
import resource
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from milgp.data.atomic import atomic_write_text
from milgp.data.bags import BagBatch, bag_index_from_sizes
from milgp.data.synthetic_mil import synthetic_mil  # noqa: F401  (re-exported for the benchmarks)
from milgp.inducing import kmeans_pp_inducing, median_lengthscale
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.models.sparse_gp import SparseGP

RESULTS = Path(__file__).resolve().parent / "results"


# -- data -------------------------------------------------------------------------------------
def digits_bags(seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    """The bags of ``benchmarks/digits_mil.py`` (sklearn ``load_digits``, bags of 10, positive when
    they hold a 2 or a 9, balanced classes): ``(bags, labels)`` with float64 labels."""
    from benchmarks.digits_mil import make_bags

    bags, labels, _ = make_bags(seed=seed)
    return [np.asarray(b, dtype=np.float64) for b in bags], np.asarray(labels, dtype=np.float64)


def witness_bags(
    X: np.ndarray, is_pos: np.ndarray, seed: int, bag_size: int = 10, max_pos: int = 4
) -> tuple[list[np.ndarray], np.ndarray, list[np.ndarray]]:
    """Balanced MIL bags of ``bag_size`` rows of ``X`` ``(N, D)``, no row in two bags: each positive
    bag holds 1–``max_pos`` (uniform) rows with ``is_pos`` ``(N,)`` true among negatives, each
    negative bag only negatives; as many bag pairs as the rows allow.

    Returns ``bags`` (list of ``(bag_size, D)``), ``bag_labels`` ``(B,)``, ``instance_labels``
    (list of ``(bag_size,)``), in random order (``numpy.random.default_rng(seed)``).
    """
    rng = np.random.default_rng(seed)
    pos = rng.permutation(np.nonzero(is_pos)[0])
    neg = rng.permutation(np.nonzero(~is_pos)[0])
    # number of positive instances in each positive bag, uniform on 1..max_pos
    n_pos_bags = len(neg) // (2 * bag_size - (1 + max_pos) / 2)  # negatives are the scarce resource
    n_pos_bags = int(min(n_pos_bags, len(pos) // ((1 + max_pos) / 2)))
    counts = rng.integers(1, max_pos + 1, size=n_pos_bags)
    while counts.sum() > len(pos) or n_pos_bags * bag_size * 2 - counts.sum() > len(neg):
        n_pos_bags -= 1
        counts = counts[:n_pos_bags]
    bags, labels, inst = [], [], []
    ip = ineg = 0
    for k in counts:  # positive bags
        idx = np.concatenate([pos[ip : ip + k], neg[ineg : ineg + bag_size - k]])
        ip += k
        ineg += bag_size - k
        idx = rng.permutation(idx)
        bags.append(X[idx])
        inst.append(is_pos[idx].astype(int))
        labels.append(1)
    for _ in range(n_pos_bags):  # negative bags
        idx = neg[ineg : ineg + bag_size]
        ineg += bag_size
        bags.append(X[idx])
        inst.append(np.zeros(bag_size, dtype=int))
        labels.append(0)
    order = rng.permutation(len(bags))
    return [bags[i] for i in order], np.asarray(labels)[order], [inst[i] for i in order]


def proportion_bags(
    X: np.ndarray, is_pos: np.ndarray, seed: int, bag_size: int = 10,
    pos_share: tuple[float, float] = (0.4, 0.6), neg_share: tuple[float, float] = (0.1, 0.3),
) -> tuple[list[np.ndarray], np.ndarray, list[np.ndarray]]:
    """MIL bags whose label is the *share* of positive rows, not their presence (the collective
    assumption): ``bag_size`` rows of ``X`` ``(N, D)`` each, no row in two bags, a positive bag a
    share of rows with ``is_pos`` ``(N,)`` true drawn uniformly from ``pos_share``, a negative bag
    one from ``neg_share`` (negative bags hold positive rows too); positive and negative bags
    alternate until the rows run out. Returns what :func:`witness_bags` returns.
    """
    rng = np.random.default_rng(seed)
    pos = list(rng.permutation(np.nonzero(is_pos)[0]))
    neg = list(rng.permutation(np.nonzero(~is_pos)[0]))
    bags, labels, inst = [], [], []
    label = 1
    while True:
        k = int(round(rng.uniform(*(pos_share if label else neg_share)) * bag_size))
        if len(pos) < k or len(neg) < bag_size - k:
            break
        idx = rng.permutation([pos.pop() for _ in range(k)] + [neg.pop() for _ in range(bag_size - k)])
        bags.append(X[idx])
        inst.append(is_pos[idx].astype(int))
        labels.append(label)
        label = 1 - label
    return bags, np.asarray(labels), inst


def standardise(x: np.ndarray) -> np.ndarray:
    s = x.std(0)
    return (x - x.mean(0)) / np.where(s > 1e-12, s, 1.0)


def batch_from_bags(bags: list[np.ndarray], labels: np.ndarray, dtype=torch.float64) -> BagBatch:
    x = standardise(np.concatenate(bags, 0))
    idx = bag_index_from_sizes([len(b) for b in bags])
    return BagBatch(torch.as_tensor(x, dtype=dtype), idx, torch.as_tensor(labels, dtype=dtype))


def batch_from_flat(x: np.ndarray, bag_index: np.ndarray, bag_labels: np.ndarray, dtype=torch.float64) -> BagBatch:
    return BagBatch(torch.as_tensor(standardise(x), dtype=dtype), torch.as_tensor(bag_index, dtype=torch.long), torch.as_tensor(bag_labels, dtype=dtype))


def make_model(batch: BagBatch, num_inducing: int, natural: bool = True, seed: int = 0) -> tuple[SparseGP, MILBernoulliLikelihood, dict]:
    """A VGPMIL model with k-means++ inducing points and the median-heuristic lengthscale."""
    x_np = batch.x.numpy()
    inst = batch.bag_labels.numpy()[batch.bag_index.numpy()]
    Z = kmeans_pp_inducing(x_np, inst, num_inducing, seed=seed)
    ls = median_lengthscale(x_np, seed=seed)
    hyper = dict(Z=torch.as_tensor(Z, dtype=batch.x.dtype), lengthscale=ls, outputscale=1.0)
    return model_from(hyper, natural=natural), MILBernoulliLikelihood(), hyper


def model_from(hyper: dict, natural: bool = True) -> SparseGP:
    return SparseGP(hyper["Z"].clone(), natural=natural, lengthscale=hyper["lengthscale"], outputscale=hyper["outputscale"])


def add_thread_arg(parser) -> None:
    parser.add_argument(
        "--threads", type=int, default=int(os.environ.get("MILGP_BENCH_THREADS", "1")),
        help="torch intra-op threads (default 1: on a shared 2-core machine two OpenMP threads spin-wait "
        "for each other and inflate both wall and CPU time; use 2 on an idle machine)",
    )


def set_threads(n: int) -> None:
    torch.set_num_threads(max(1, int(n)))


class Clock:
    """Wall and process-CPU time, accumulated while running (``with clock: ...``)."""

    def __init__(self):
        self.wall = 0.0
        self.cpu = 0.0

    def __enter__(self):
        self._w, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall += time.perf_counter() - self._w
        self.cpu += time.process_time() - self._c
        return False


# -- machine / output -------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    model = platform.processor() or ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                model = line.split(":", 1)[1].strip()
    except Exception:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1_5_15": list(os.getloadavg()),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` to ``benchmarks/results/<name>.json`` atomically (an interrupted or failed
    write leaves the previous file as it was); quick runs get a ``_quick`` suffix, so they never
    overwrite the full results."""
    if payload.get("quick") and not name.endswith("_quick"):
        name += "_quick"
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "machine": machine(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), **payload}
    atomic_write_text(path, json.dumps(payload, indent=2, default=float))
    return path


def name_for_folder(name: str, data_dir: str | Path) -> str:
    """``name``, or ``name_<folder>`` when ``benchmarks/results/<name>.json`` records another
    ``data_dir`` than this run's: a run on one's own data never overwrites the committed results
    (a file without the record is taken to be of the same folder)."""
    path = RESULTS / f"{name}.json"
    try:
        recorded = json.loads(path.read_text(encoding="utf-8")).get("data_dir") if path.exists() else None
    except (OSError, ValueError):
        recorded = None
    if recorded is None or Path(recorded).resolve() == Path(data_dir).resolve():
        return name
    return name + "_" + re.sub(r"[^A-Za-z0-9_-]+", "_", Path(data_dir).resolve().name)


def markdown_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0].keys())

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if v != v:
                return "–"
            if abs(v) >= 1e4 or (abs(v) < 1e-3 and v != 0):
                return f"{v:.3g}"
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def peak_rss_gib() -> float:
    """This process's peak resident set size (``ru_maxrss``) in GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1024**3  # ru_maxrss is KiB on Linux
