"""Predicting published runs as a user would, and the figures of a validation report.

:func:`predict_row` evaluates one measured run the way ``planlab explore --space megatron
--set ...`` evaluates a plan whose knobs are all fixed: the built-in cluster, the model traced at
the run's global batch, the ``megatron`` space's plan of the run's knobs (its constraints
checked), :func:`planlab.explore.evaluate` (memory bound, materialize, simulate), with the row's
training software and precision (``--software``, ``--precision``; a row that says only "mixed"
precision takes the device's default). A plan that does not fit in predicted memory is reported as
such; its time is then simulated anyway (``unfit_time_s``) so that the time error can be seen
apart from the memory error.

:func:`summarize` gives a set's figures: mean absolute and mean signed error, the worst row,
Kendall's tau of per-GPU throughput within model sizes (samples per second per GPU, so that
runs of different batch compare) and across all rows (FLOP/s per GPU by the set's formula), and the order of the strategy families
wherever one model on one GPU count was measured with more than one family.
"""

from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import ProcessPoolExecutor

import pandas as pd

from planlab.errors import InfeasiblePlan, PlanlabError
from planlab.published import FAMILIES, PublishedRow, PublishedSet, flops_per_iteration
from planlab.validation import kendall_tau


def software_input() -> bool:
    """Whether this planlab takes the training software as an input (``Setup.software``)."""
    from planlab.explore import Setup

    return "software" in {f.name for f in dataclasses.fields(Setup)}


def predict_row(row: PublishedRow) -> dict:
    """The prediction of one runnable row: a dict with ``predicted_s``, ``peak_mem_gib``,
    ``fits``, ``reason``, ``unfit_time_s`` (the simulated time of a plan that does not fit) and
    ``seconds`` (wall time of the prediction)."""
    from planlab.costmodel import load_cluster
    from planlab.explore import Setup, evaluate, make_context, training_flops
    from planlab.plan.software_passes import build_program
    from planlab.search_spaces.builtin import get_space
    from planlab.simulator.engine import simulate

    t0 = time.perf_counter()
    per_node = load_cluster(row.cluster).node.devices_per_node
    extra = {"software": row.software, "precision": row.precision_arg} if software_input() else {}
    setup = Setup(row.spec(), row.cluster, row.nodes(per_node), row.global_batch, **extra)
    out = dict(predicted_s=math.nan, peak_mem_gib=math.nan, fits=False, reason="", unfit_time_s=math.nan, failed=False)
    try:
        if row.gpus % per_node:
            raise InfeasiblePlan(
                f"the run uses {row.gpus} GPUs, not whole nodes of {per_node}: a planlab cluster is whole nodes"
            )
        ctx, cost, graph = make_context(setup)
        plan = get_space("megatron").build(ctx, row.knobs())
        res_row, _ = evaluate(plan, graph, cost)
        out.update(
            peak_mem_gib=res_row["peak_mem_gib"],
            fits=bool(res_row["feasible"]),
            reason=res_row["reason"] or "",
            device_gib=cost.device_memory_bytes / 2**30,
        )
        if out["fits"]:
            out["predicted_s"] = res_row["iter_time_s"]
        elif not math.isnan(res_row["iter_time_s"]):
            out["unfit_time_s"] = res_row["iter_time_s"]
        else:  # pruned by the memory bound: simulate anyway, for the time error alone
            program = build_program(plan, graph, cost)
            out["unfit_time_s"] = simulate(program, cost, model_flops=training_flops(graph)).iter_time_s
    except PlanlabError as e:  # planlab refuses the plan: reported as such, not as a memory verdict
        out.update(reason=str(e).splitlines()[0], failed=True)
    out["seconds"] = time.perf_counter() - t0
    return out


def _predict_indexed(item: tuple[int, PublishedRow]) -> tuple[int, dict]:
    return item[0], predict_row(item[1])


def predict_sets(sets: list[PublishedSet], *, jobs: int = 1) -> pd.DataFrame:
    """One frame row per published row: the row's columns, ``measured_s``, ``family`` and, for
    runnable rows, the prediction (:func:`predict_row`) and the signed relative ``error``
    (predicted / measured - 1; ``unfit_error`` for plans that do not fit)."""
    records, work = [], []
    for s in sets:
        for r in s.rows:
            rec = dict(dataclasses.asdict(r), model_args=";".join(f"{k}={v}" for k, v in r.model_args))
            rec.update(family=r.family, measured_s=_measured(s, r), work=_work(s, r), command=_command(r))
            records.append(rec)
            if r.runnable:
                work.append((len(records) - 1, r))
    work.sort(key=lambda w: -w[1].params_b * max(1, w[1].gpus) ** 0.5)  # the longest first
    if jobs > 1 and len(work) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(_predict_indexed, work))
    else:
        results = [_predict_indexed(w) for w in work]
    for i, res in results:
        records[i].update(res)
    df = pd.DataFrame(records)
    for col, empty in (
        ("predicted_s", math.nan),
        ("unfit_time_s", math.nan),
        ("peak_mem_gib", math.nan),
        ("failed", False),
    ):
        if col not in df:
            df[col] = empty
    df["error"] = df["predicted_s"] / df["measured_s"] - 1
    df["unfit_error"] = df["unfit_time_s"] / df["measured_s"] - 1
    return df


def _command(r: PublishedRow) -> str:
    """The ``planlab explore`` command of a runnable row ('' for a skipped one)."""
    from planlab.costmodel import load_cluster

    return r.command(load_cluster(r.cluster).node.devices_per_node) if r.runnable else ""


def _work(s: PublishedSet, r: PublishedRow) -> float:
    """The FLOPs of one iteration by the set's formula, or 6 x parameters x tokens without one
    (a common scale for ranking runs of different models)."""
    try:
        if "flops" in s.metric:
            return flops_per_iteration(r, s.metric)
        return 6e9 * r.params_b * r.global_batch * r.spec().config().seq
    except PlanlabError:
        return math.nan


def _measured(s: PublishedSet, r: PublishedRow) -> float:
    try:
        return s.measured_s(r)
    except PlanlabError:
        return math.nan


def per_gpu_throughput(df: pd.DataFrame, col: str) -> pd.Series:
    """Samples per second per GPU of the iteration times in ``col``."""
    return df["global_batch"] / (df[col] * df["gpus"])


def per_gpu_flops(df: pd.DataFrame, col: str) -> pd.Series:
    """FLOP/s per GPU (``work`` per iteration) of the iteration times in ``col``: a scale on which
    runs of different models compare."""
    return df["work"] / (df[col] * df["gpus"])


def tau_within_models(df: pd.DataFrame) -> tuple[float, int]:
    """Kendall's tau of predicted against measured per-GPU throughput within each model size,
    weighted by rows; and the number of model sizes with at least two rows (0: tau is nan)."""
    taus, weights = [], []
    for _, g in df.groupby(["model", "model_args"]):
        if len(g) >= 2:
            taus.append(
                kendall_tau(list(per_gpu_throughput(g, "predicted_s")), list(per_gpu_throughput(g, "measured_s")))
            )
            weights.append(len(g))
    if not weights:
        return math.nan, 0
    return sum(t * w for t, w in zip(taus, weights)) / sum(weights), len(weights)


def family_orders(df: pd.DataFrame) -> list[dict]:
    """Where one model on one GPU count was measured with more than one strategy family: the
    families fastest first (best per-GPU throughput of each), measured and predicted."""
    out = []
    for (model, args, gpus), g in df.groupby(["model", "model_args", "gpus"]):
        if g["family"].nunique() < 2:
            continue
        order = {}
        for col in ("measured_s", "predicted_s"):
            best = {f: per_gpu_throughput(h, col).max() for f, h in g.groupby("family")}
            order[col] = sorted(best, key=lambda f: (-best[f], FAMILIES.index(f)))
            order[col + "_ratio"] = max(best.values()) / min(best.values())
        out.append(
            dict(
                model=f"{g['params_b'].iloc[0]:g}B",
                gpus=int(gpus),
                measured=order["measured_s"],
                predicted=order["predicted_s"],
                measured_ratio=order["measured_s_ratio"],
                predicted_ratio=order["predicted_s_ratio"],
                preserved=order["measured_s"] == order["predicted_s"],
            )
        )
    return out


def summarize(df: pd.DataFrame) -> dict:
    """The figures of one set (``df``: :func:`predict_sets` rows of the set)."""
    run = df[df["skip_reason"] == ""]
    ok = run[run["fits"] == True]  # noqa: E712 (a column of objects: NaN for rows not predicted)
    out = dict(rows=len(df), skipped=len(df) - len(run), runnable=len(run), fit=len(ok))
    if len(ok):
        worst = ok.loc[ok["error"].abs().idxmax()]
        out.update(
            mape=float(ok["error"].abs().mean() * 100),
            signed=float(ok["error"].mean() * 100),
            worst=(worst["row"], float(worst["error"] * 100)),
        )
    both = run[run["error"].notna() | run["unfit_error"].notna()]
    if len(both):
        err = both["error"].fillna(both["unfit_error"])
        out.update(mape_all=float(err.abs().mean() * 100), signed_all=float(err.mean() * 100), n_all=len(both))
    out["tau"], out["tau_groups"] = tau_within_models(ok)
    out["tau_all"] = (
        kendall_tau(list(per_gpu_flops(ok, "predicted_s")), list(per_gpu_flops(ok, "measured_s")))
        if len(ok) >= 2
        else math.nan
    )
    out["families"] = family_orders(ok)
    failed = run["failed"] == True  # noqa: E712
    out["failed"] = [(r["row"], r["reason"]) for _, r in run[failed].iterrows()]
    out["unfit"] = [
        (r["row"], r["peak_mem_gib"], r.get("device_gib", math.nan), r["reason"])
        for _, r in run[(run["fits"] != True) & ~failed].iterrows()  # noqa: E712
    ]
    return out
