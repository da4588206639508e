"""Exploring a space: build, bound, simulate and rank every plan; Pareto front and plot."""

from __future__ import annotations

import math
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from planlab.costmodel import CostModel
from planlab.errors import ConfigError, InfeasiblePlan, PlanlabError
from planlab.graph.ir import Graph
from planlab.graph.trace import trace
from planlab.models.registry import ModelSpec, build_model
from planlab.plan.materialize import materialize, precision_for
from planlab.plan.plan import Plan
from planlab.plan.plan_file import save_plan
from planlab.search_spaces.builtin import get_space
from planlab.search_spaces.space import Context, Space
from planlab.simulator.engine import simulate

RESULT_COLUMNS = ["iter_time_s", "peak_mem_gib", "tflops_per_gpu", "mfu", "feasible", "reason"]


@dataclass(frozen=True)
class Setup:
    """The three inputs of an exploration: model, cluster and batch (the space comes apart)."""

    model: ModelSpec
    cluster: str
    nodes: int
    global_batch: int
    profile: str | None = None  # a calibration profile (planlab calibrate) pricing the cluster


def make_context(setup: Setup, graph: Graph | None = None) -> tuple[Context, CostModel, Graph]:
    cost = CostModel.load(setup.cluster, setup.nodes, profile=setup.profile)
    if graph is None:
        model, inputs = build_model(setup.model, batch=setup.global_batch)
        graph = trace(model, inputs)
    ctx = Context(graph, setup.model, setup.global_batch, setup.cluster, setup.nodes,
                  cost.cluster.num_devices, cost.cluster.node.devices_per_node)
    return ctx, cost, graph


def memory_lower_bound_bytes(plan: Plan, graph: Graph) -> tuple[int, int]:
    """``(static, activations)`` bytes on the fullest device, without simulating: weights,
    gradients and optimizer states (ZeRO keeps a 1/n share of the optimizer states, of the
    gradients from stage 2, of the weights at stage 3, where n devices sum a weight's gradient),
    plus the activations saved for backward by one micro-batch times the most micro-batches the
    device's schedule keeps in flight (until their backward, or its input-gradient part ``I``)."""
    prec = precision_for(plan.cluster)
    per_param = (prec.param_bytes, prec.grad_bytes, prec.optimizer_bytes)
    sharded = (plan.zero >= 3, plan.zero >= 2, plan.zero >= 1)  # which of them ZeRO shards
    by_devices: dict[tuple[int, ...], list[int]] = {}  # device set -> [static, saved] bytes on each
    m = plan.microbatches
    for p in plan.ops:
        acc = by_devices.setdefault(p.devices, [0, 0])
        op = graph.op(p.op)
        for t in dict.fromkeys(op.inputs + op.saves):
            spec = graph.tensors[t]
            if spec.role != "param" and (t not in op.saves or p.recompute):
                continue  # a recomputed operator keeps nothing for its backward
            axes = op.axes_of(t)
            cut = math.prod(n for d, n in zip(p.dims, p.sizes) if d is not None and any(ax and ax[0] == d for ax in axes))
            if spec.role == "param":
                reduced = math.prod(n for d, n in zip(p.dims, p.sizes)  # devices summing its gradient
                                    if d is not None and not any(ax and ax[0] == d for ax in axes))
                acc[0] += sum(spec.numel // cut // (reduced if z else 1) * b for b, z in zip(per_param, sharded))
            else:
                batch = any(graph.labels.get((t, a)) == graph.batch_label for a in range(len(spec.shape)))
                acc[1] += spec.numel // cut // (m if batch else 1) * (prec.activation_bytes if spec.is_float else 8)
    static = [0] * plan.num_devices
    saved = [0] * plan.num_devices
    for devs, (st, sv) in by_devices.items():
        for dev in devs:
            static[dev] += st
            saved[dev] += sv
    worst = (0, 0)
    for dev in range(plan.num_devices):
        sched = plan.schedule[dev] if plan.schedule and plan.schedule[dev] else None
        if sched is None:
            flight = m
        else:
            flight = cur = 0
            for a in sched:
                cur += 1 if a.phase == "F" else -1 if a.phase in ("B", "I") else 0
                flight = max(flight, cur)
        total = (static[dev], saved[dev] * flight)
        if sum(total) > sum(worst):
            worst = total
    return worst


def evaluate(plan: Plan, graph: Graph, cost: CostModel, *, timeline: bool = False):
    """Simulate one plan; returns ``(row dict, SimResult or None)``. Infeasible plans are rows too."""
    row = dict(plan.knobs)
    mem_cap = cost.device_memory_bytes
    static, acts = memory_lower_bound_bytes(plan, graph)
    if static + acts > mem_cap:
        what = "weights, gradients and optimizer states alone need" if static > mem_cap else \
            "weights, optimizer states and the activations saved in flight need at least"
        row.update(iter_time_s=math.nan, peak_mem_gib=(static + acts) / 2**30, tflops_per_gpu=math.nan,
                   mfu=math.nan, feasible=False,
                   reason=f"{what} {(static if static > mem_cap else static + acts) / 2**30:.1f} GiB per device "
                          f"(device memory {mem_cap / 2**30:.1f} GiB)")
        return row, None
    try:
        program = materialize(plan, graph, symmetric=True, node_of=cost.cluster.node_of)
        res = simulate(program, cost, model_flops=3.0 * graph.flops, timeline=timeline)
    except InfeasiblePlan as e:
        row.update(iter_time_s=math.nan, peak_mem_gib=math.nan, tflops_per_gpu=math.nan, mfu=math.nan,
                   feasible=False, reason=str(e).splitlines()[0])
        return row, None
    row.update(iter_time_s=res.iter_time_s, peak_mem_gib=res.peak_mem_bytes / 2**30,
               tflops_per_gpu=res.tflops_per_gpu, mfu=res.mfu, feasible=res.feasible, reason=res.reason)
    return row, res


_WORKER: dict = {}


def _init_worker(setup: Setup, space: str) -> None:
    ctx, cost, graph = make_context(setup)
    _WORKER.update(ctx=ctx, cost=cost, graph=graph, space=get_space(space))


def _eval_assignment(values: dict) -> dict:
    w = _WORKER
    row, _ = evaluate(w["space"].build(w["ctx"], values), w["graph"], w["cost"])
    return row


def explore(model: str | ModelSpec, *, cluster: str, nodes: int = 1, space: str = "megatron",
            fixed: dict | None = None, global_batch: int | None = None, jobs: int = 1,
            out: str | os.PathLike | None = None, progress: bool = False,
            profile: str | os.PathLike | None = None) -> pd.DataFrame:
    """Evaluate every plan of ``space``; return the ranked DataFrame (fastest feasible first).

    Columns: the knobs, ``iter_time_s``, ``peak_mem_gib``, ``tflops_per_gpu``, ``mfu``,
    ``feasible``, ``reason``, ``pareto``. ``df.attrs["best_plan"]`` is the best Plan (or None).
    With ``out``, writes ``results.csv``, ``pareto.png`` and ``best_plan.json`` there.
    ``profile`` (a file from ``planlab calibrate``) prices the cluster with its measurements.
    """
    spec = model if isinstance(model, ModelSpec) else ModelSpec(model)
    spec.config()  # unknown model -> ConfigError before any work
    profile = None if profile is None else os.fspath(profile)
    cost = CostModel.load(cluster, nodes, profile=profile)
    batch = global_batch if global_batch is not None else max(8, cost.cluster.num_devices)
    if not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"--global-batch must be a positive integer, got {batch!r}")
    sp = get_space(space) if isinstance(space, str) else space
    setup = Setup(spec, cluster, nodes, batch, profile)
    ctx, cost, graph = make_context(setup)
    assignments = list(sp.assignments(ctx, fixed))
    if not assignments:
        why = sp.explain(ctx, dict(fixed or {}))
        raise ConfigError(why or f"no plan of space {sp.name!r} fits {cost.cluster.num_devices} devices, "
                          f"{spec.config().layers} layers and global batch {batch} with {fixed or {}}")
    rows = []
    bar = _progress(len(assignments), progress)
    if jobs > 1 and isinstance(space, str):
        with ProcessPoolExecutor(max_workers=jobs, initializer=_init_worker, initargs=(setup, space)) as pool:
            for row in pool.map(_eval_assignment, assignments):
                rows.append(row)
                bar.update(1)
    else:
        for values in assignments:
            rows.append(evaluate(sp.build(ctx, values), graph, cost)[0])
            bar.update(1)
    bar.close()
    df = pd.DataFrame(rows)
    for c in RESULT_COLUMNS:
        if c not in df:
            df[c] = math.nan
    df["pareto"] = pareto_mask(df)
    df["_index"] = range(len(df))
    df = df.sort_values(["feasible", "iter_time_s"], ascending=[False, True], na_position="last")
    df = df.reset_index(drop=True)
    best = None
    if len(df) and bool(df.loc[0, "feasible"]):
        best = sp.build(ctx, assignments[int(df.loc[0, "_index"])])  # plans are rebuilt, not shipped
    df = df.drop(columns=["_index"])
    df.attrs["best_plan"] = best
    df.attrs["space"] = sp.name
    df.attrs["device_memory_gib"] = cost.device_memory_bytes / 2**30
    if out is not None:
        write_outputs(df, Path(out))
    return df


def pareto_mask(df: pd.DataFrame) -> list[bool]:
    """True for feasible plans that no other feasible plan beats in both time and memory."""
    pts = [(r.iter_time_s, r.peak_mem_gib) if r.feasible else None for r in df.itertuples()]
    mask = []
    for i, p in enumerate(pts):
        if p is None:
            mask.append(False)
            continue
        dominated = any(q is not None and q[0] <= p[0] and q[1] <= p[1] and q != p for q in pts)
        mask.append(not dominated)
    return mask


def write_outputs(df: pd.DataFrame, out: Path) -> None:
    """results.csv, pareto.png and best_plan.json, each written whole or not at all."""
    from planlab.plotting import pareto_plot

    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.csv.tmp"
    df.to_csv(tmp, index=False)
    os.replace(tmp, out / "results.csv")
    pareto_plot(df, out / "pareto.png")
    best = df.attrs.get("best_plan")
    if best is not None:
        save_plan(best, out / "best_plan.json")
    elif (out / "best_plan.json").exists():
        (out / "best_plan.json").unlink()


def _progress(total: int, show: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="plan", desc="exploring", disable=not show)
