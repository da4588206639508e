"""Validation against measured training iterations (vTrain's published ground truth).

Each measured run becomes a plan of the Megatron space (its tensor, data and pipeline degrees,
micro-batch size and full recomputation, as in vTrain's runs), simulated on a cluster spec
describing the measured machines; the report compares predicted and measured iteration time.
"""

from __future__ import annotations

import csv
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import pandas as pd

from planlab.errors import ConfigError
from planlab.models.registry import ModelSpec

VOCAB = 51200  # Megatron-LM's padded GPT-2 vocabulary (vTrain's configs use the GPT-2 tokenizer)


@dataclass(frozen=True)
class MeasuredRun:
    """One row of a vTrain ground-truth file."""

    gpus: int
    global_batch: int
    micro_batch: int
    hidden: int
    heads: int
    layers: int
    seq: int
    tp: int
    dp: int
    pp: int
    measured_s: float


def load_runs(path: str | os.PathLike) -> list[MeasuredRun]:
    """Read ``vtrain_ground_truth_single.csv`` or ``..._multi.csv``."""
    path = Path(path)
    try:
        rows = list(csv.DictReader(path.open()))
    except OSError as e:
        raise ConfigError(f"cannot read {str(path)!r}: {e.strerror}") from None
    out = []
    for r in rows:
        out.append(MeasuredRun(int(r["# GPUs"]), int(r["global batch"]), int(r["micro batch"]), int(r["hidden size"]),
                               int(r["attention heads"]), int(r["# layers"]), int(r["sequence length"]),
                               int(r["tensor parallelism"]), int(r["data parallelism"]),
                               int(r["pipeline parallelism"]), float(r["iteration time (ms)"]) / 1e3))
    return out


@lru_cache(maxsize=4)
def _graph(hidden: int, heads: int, layers: int, seq: int, batch: int):
    from planlab.graph.trace import trace
    from planlab.models.registry import build_model

    spec = ModelSpec("gpt", tuple(sorted(dict(layers=layers, hidden=hidden, heads=heads, seq=seq,
                                                vocab=VOCAB).items())))
    model, inputs = build_model(spec, batch=batch)
    return spec, trace(model, inputs)


def predict(run: MeasuredRun, cluster: str) -> dict:
    """Simulate one measured run; returns a row with the prediction and the error."""
    from planlab.costmodel import CostModel
    from planlab.plan.materialize import materialize
    from planlab.search_spaces.builtin import get_space
    from planlab.search_spaces.space import Context
    from planlab.simulator.engine import simulate

    cost = CostModel.load(cluster, max(1, run.gpus // 8))
    spec, graph = _graph(run.hidden, run.heads, run.layers, run.seq, run.global_batch)
    ctx = Context(graph, spec, run.global_batch, cluster, cost.cluster.nodes, run.gpus,
                  cost.cluster.node.devices_per_node)
    plan = get_space("megatron").build(ctx, dict(tp=run.tp, dp=run.dp, pp=run.pp, microbatch=run.micro_batch,
                                                 recompute="full"))
    res = simulate(materialize(plan, graph, symmetric=True, node_of=cost.cluster.node_of), cost)
    row = asdict(run)
    row.update(predicted_s=res.iter_time_s, error=(res.iter_time_s - run.measured_s) / run.measured_s)
    return row


def _predict_star(args):
    return predict(*args)


def validate(runs: list[MeasuredRun], cluster: str, *, jobs: int = 1) -> pd.DataFrame:
    """Predicted against measured iteration time for each run (``error`` is signed, relative)."""
    order = sorted(range(len(runs)), key=lambda i: (runs[i].hidden, runs[i].layers, runs[i].global_batch))
    args = [(runs[i], cluster) for i in order]  # grouped so each worker reuses its traced graphs
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            rows = list(pool.map(_predict_star, args, chunksize=max(1, len(args) // (4 * jobs))))
    else:
        rows = [predict(*a) for a in args]
    return pd.DataFrame(rows)


def mape(df: pd.DataFrame) -> float:
    """Mean absolute percentage error."""
    return float(df["error"].abs().mean() * 100)


def kendall_tau(a, b) -> float:
    """Kendall's tau-a between two equally long sequences (1: same order, -1: reversed)."""
    n = len(a)
    if n < 2:
        return float("nan")
    s = 0
    for i in range(n):
        for j in range(i + 1, n):
            x, y = a[i] - a[j], b[i] - b[j]
            s += (x > 0) - (x < 0) if y > 0 else -((x > 0) - (x < 0)) if y < 0 else 0
    return 2.0 * s / (n * (n - 1))


def rank_correlation(df: pd.DataFrame) -> float:
    """Mean Kendall tau of predicted against measured time within each model size
    (hidden, layers), weighted by the number of runs of the size."""
    taus, weights = [], []
    for _, g in df.groupby(["hidden", "layers"]):
        if len(g) >= 2:
            taus.append(kendall_tau(list(g["predicted_s"]), list(g["measured_s"])))
            weights.append(len(g))
    return sum(t * w for t, w in zip(taus, weights)) / sum(weights) if weights else float("nan")
