"""The fine-grained space against the full Megatron grid on standard language-model workloads.

Issue 18, item 3. For each workload this script explores ``megatron`` (Megatron-LM's whole grid:
tp x pp x dp x micro-batch x schedule x recompute x sequence parallelism x ZeRO, uneven end
stages) and ``megatron*fine`` (each grid point's per-stage layers, recomputed layers and
offloading chosen by an integer program, planlab/search_spaces/fine.py), and prints per workload
the best simulated plan of each: iteration time, peak memory, knobs, the fine plan's per-stage
layout, and the speedup of the fine plan over the grid's; then the geometric mean.

Workloads (shapes from planlab/models/registry.py):
- GPT-3 175B, sequence 2048, global batch 1536: Narayanan et al., SC'21 ("Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM"), Table 1's 175B row; on 512 and
  1,024 A100 80 GB (DGX A100) and 1,024 H100 (DGX H100).
- LLaMA-3 70B and 405B, sequence 8192, global batch 512 sequences (4M tokens, the Llama 3 paper's
  first batch size, Dubey et al. 2024, section 3.4.1): 70B on 64 A100 and 256 H100, 405B on 1,024 H100.

With ``--timelines DIR`` the best plans' simulated timelines (timeline.png, memory.png) are written
per workload and space, and the per-stage times per micro-batch of both plans (the screen's) printed.

With ``--bound`` (planlab/search_spaces/fine_bound.py) it bounds, over every point of the grid
(or of the ``--set`` slice), the least iteration time any fine layout reaches in the integer
program's model, prices the grid best (this run's, or ``--grid-best`` KNOB=VALUE,... simulated
here) in the same model, and prints their ratio, the largest speedup the fine space could find
as its program sees it, with how far the model is from the simulator at the grid best.

Run: nice -n 10 .venv/bin/python benchmarks/fine_grained.py [--jobs 1] [--only gpt3-a100-512,...] [--timelines DIR]
     [--spaces grid|fine|none] [--bound [--grid-best tp=4,pp=4,...] [--target 1.10] [--simulate-best]]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import math
import os
import resource
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    key: str
    model: str
    cluster: str
    nodes: int
    global_batch: int


WORKLOADS = (
    Workload("gpt3-175b-a100-512", "gpt3-175b", "dgx-a100-80g", 64, 1536),
    Workload("gpt3-175b-a100-1024", "gpt3-175b", "dgx-a100-80g", 128, 1536),
    Workload("gpt3-175b-h100-1024", "gpt3-175b", "dgx-h100", 128, 1536),
    Workload("llama3-70b-a100-64", "llama3-70b", "dgx-a100-80g", 8, 512),
    Workload("llama3-70b-h100-256", "llama3-70b", "dgx-h100", 32, 512),
    Workload("llama3-405b-h100-1024", "llama3-405b", "dgx-h100", 128, 512),
)
SPACES = (("grid", "megatron"), ("fine", "megatron*fine"))
KNOBS = ("tp", "pp", "dp", "microbatch", "schedule", "virtual_stages", "recompute", "zero", "sequence_parallel")


def _knobs(row) -> str:
    return " ".join(
        f"{k}={row[k]}"
        for k in KNOBS + ("fine_layout", "fine_offload")
        if k in row and str(row[k]) not in ("nan", "None")
    )


def _row_knobs(sp, row) -> dict:
    """The knobs of ``sp`` in a results row (numpy scalars and pandas' floats as Python values)."""
    knobs = {k.name: row[k.name] for k in sp.all_knobs() if k.name in row and str(row[k.name]) not in ("nan", "None")}
    knobs = {k: (v.item() if hasattr(v, "item") else v) for k, v in knobs.items()}
    return {k: (int(v) if isinstance(v, float) and v == int(v) else v) for k, v in knobs.items()}


def _context(w: Workload):
    from planlab.explore import Setup, make_context
    from planlab.models import ModelSpec

    return make_context(Setup(ModelSpec(w.model), w.cluster, w.nodes, w.global_batch))


def _draft(w: Workload, row, space: str):
    """The draft of the plan of ``row`` in ``space``, with the workload's cost model and graph."""
    from planlab.search_spaces import get_space

    ctx, cost, graph = _context(w)
    sp = get_space(space)
    return sp.draft(ctx, sp.with_defaults(_row_knobs(sp, row))), cost, graph


def _bound(
    w: Workload, grid_knobs: dict, grid_s: float | None, fixed: dict, simulate_best: bool, target: float | None
) -> float | None:
    """Print the least time any fine layout of any grid point (of the slice ``fixed``) reaches in
    the integer program's model (the pipeline walked, planlab/search_spaces/fine_paths.py), against
    the grid best's time in that model, in fine.py's closed form and simulated; with
    ``simulate_best``, simulate the fine plan of the bound's best point; with ``target`` (a speedup),
    prove only that no layout reaches it (grid_bound's ``enough_s``: the grid best, the slower of
    walked and simulated, over the target);
    return the largest speedup the fine space could find, against the slower of the grid best walked
    and simulated (None: no point fits)."""
    from planlab.explore import evaluate
    from planlab.search_spaces import get_space
    from planlab.search_spaces.fine_bound import grid_bound, grid_plan_cost

    s0, c0 = time.perf_counter(), _cpu_s()
    ctx, cost, graph = _context(w)
    grid = get_space("megatron")
    knobs = grid.with_defaults(grid.check_values(ctx, grid_knobs))
    if grid_s is None:  # the grid best given by its knobs: simulated here
        grid_s = evaluate(grid.build(ctx, knobs), graph, cost)[0]["iter_time_s"]
    model_s, fits, layout = grid_plan_cost(ctx, grid, knobs)
    closed_s = grid_plan_cost(ctx, grid, knobs, walked=False)[0]
    # the target against the slower of the grid best walked and simulated: proven, no layout walks under
    # either over the target, so the speedup is under it in the model and, wherever the walk is not above
    # the simulator (as at every fine plan measured), simulated
    enough_s = max(model_s, grid_s) / target if target and fits else math.inf
    b = grid_bound(
        ctx, grid, fixed, model_s if fits else math.inf, enough_s
    )  # the grid best's own layout: the first incumbent
    where = " ".join(f"{k}={v}" for k, v in b.knobs.items() if k in KNOBS + ("first_stage_layers", "last_stage_layers"))
    print(
        f"  bound over {b.points} grid points ({b.chains} bounded by their chains, {b.chain_lps} of them then by "
        f"their chains programs' LPs, {b.chain_programs} by their chains' integer programs, {b.lps} by their "
        f"walked LP relaxations, {b.programs} walked integer programs, "
        f"{b.node_limited} of them stopped short of their optimum; the other points' balanced bounds were higher): "
        f"no fine layout is under {b.least_s:.3f} s in the program's walked model; the best found is {b.best_s:.3f} s "
        f"at {where or 'the grid best, its own layout'}; the least LP relaxation solved is {b.least_lp_s:.3f} s"
    )
    print(
        f"  grid best in the program's model: {model_s:.3f} s walked, {closed_s:.3f} s in the closed form (layers "
        f"{'/'.join(map(str, layout.layers))}, recomputed {sum(layout.recompute)}; {'fits' if fits else 'over the memory rows'}), "
        f"simulated {grid_s:.3f} s: the model is {model_s / grid_s - 1:+.1%} off the simulator there "
        f"(the closed form {closed_s / grid_s - 1:+.1%})"
    )
    ratio = max(model_s, grid_s) / b.least_s if math.isfinite(b.least_s) else None  # in the model and simulated
    if math.isfinite(enough_s):
        print(
            f"  asked to prove only that no layout is under {enough_s:.3f} s (the grid best, the slower of walked and "
            f"simulated, over {target:.2f}x): " + ("proven" if b.least_s >= enough_s * (1 - 1e-9) else "not proven")
        )
    if ratio is not None:
        print(
            f"  largest speedup the fine space could find in its model: {model_s / b.least_s:.3f}x (target 1.10x; "
            f"by the least LP relaxation solved alone {model_s / b.least_lp_s:.3f}x); against the grid best simulated, "
            f"{grid_s / b.least_s:.3f}x (a bound for the simulator wherever the walk is not above it)"
        )
    if simulate_best and b.knobs:
        fine = get_space("megatron*fine")
        host = cost.cluster.node.host is not None
        fk = fine.with_defaults(fine.check_values(ctx, {**b.knobs, "fine_layout": "program", "fine_offload": host}))
        row, _ = evaluate(fine.build(ctx, fk), graph, cost)
        got = row.get("iter_time_s", math.nan)
        d = fine.draft(ctx, fk)
        print(
            f"  the fine plan at that point ({d.layout.describe()}) simulates {got:.3f} s, {row.get('peak_mem_gib', math.nan):.1f} GiB: "
            f"the model is {b.best_s / got - 1:+.1%} off there; {grid_s / got:.3f}x over the grid best"
        )
    print(
        f"  bound: {time.perf_counter() - s0:.0f} s wall, {_cpu_s() - c0:.0f} s CPU, load {os.getloadavg()[0]:.1f}",
        file=sys.stderr,
    )
    return ratio


def _stage_times(w: Workload, row, space: str) -> str:
    """Per pipeline group, the screen's time per micro-batch (ms) of the plan of ``row``."""
    from planlab.search_spaces.screen import Screen, group_costs

    d, cost, graph = _draft(w, row, space)
    chunks = d.chunks
    if chunks > 1:  # per model chunk: each chunk a group of its own
        d = dataclasses.replace(d, chunks=1, schedule="1f1b")
    times = " ".join(f"{g.time_s * 1e3:.0f}" for g in group_costs(Screen(graph, cost, cost.precision), d))
    return times + (f" (per model chunk, {chunks} a device; chunk s on device s % pp)" if chunks > 1 else "")


def _device_times(w: Workload, plan) -> str:
    """The simulated timeline of ``plan`` per device class (its representative device): busy
    computing, communication it waited for, pipeline bubble, finish and peak memory."""
    from planlab.explore import Setup, evaluate, make_context
    from planlab.models import ModelSpec

    _, cost, graph = make_context(Setup(ModelSpec(w.model), w.cluster, w.nodes, w.global_batch))
    _, res = evaluate(plan, graph, cost)
    if res is None:
        return "(not simulated)"
    return "; ".join(
        f"device {d.device} (x{d.members}): compute {d.compute_s:.1f}, exposed comm {d.exposed_comm_s:.1f}, "
        f"bubble {d.bubble_s:.1f}, finish {d.finish_s:.1f} s, peak {d.peak_mem_bytes / 2**30:.1f} GiB"
        for d in res.devices
    )


class _Outcomes(logging.Handler):
    """Counts the fine space's programs by how they ended (planlab.search_spaces.fine's debug records)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: collections.Counter = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[str(record.args[0]) if record.args else record.getMessage()] += 1


def _explore(w: Workload, label: str, space: str, args, fixed: dict):
    """The best feasible row of ``space`` on ``w`` (None: none fits) and its plan; a line of counts and times."""
    import planlab
    from planlab.explore import DEFAULT_CANDIDATES

    s0, c0 = time.perf_counter(), _cpu_s()
    fine_log, outcomes = logging.getLogger("planlab.search_spaces.fine"), _Outcomes()
    fine_log.addHandler(outcomes)
    fine_log.setLevel(logging.DEBUG)
    out = os.path.join(args.timelines, f"{w.key}-{label}") if args.timelines else None
    df = planlab.explore(
        w.model,
        cluster=w.cluster,
        nodes=w.nodes,
        global_batch=w.global_batch,
        space=space,
        jobs=args.jobs,
        out=out,
        fixed=fixed,
        candidates=args.candidates or DEFAULT_CANDIDATES,
    )
    fine_log.removeHandler(outcomes)
    ok = df[df["feasible"] == True]  # noqa: E712
    c = df.attrs["counts"]
    programs = ", ".join(f"{n} {status}" for status, n in sorted(outcomes.counts.items()))
    print(
        f"{w.key} {label:4s} ({space}): {c['plans']} plans, {c['simulated']} simulated, "
        f"{time.perf_counter() - s0:.0f} s wall, {_cpu_s() - c0:.0f} s CPU (with workers); "
        f"load {os.getloadavg()[0]:.1f}" + (f"; fine programs (this process): {programs}" if programs else ""),
        file=sys.stderr,
    )
    return (ok.iloc[0] if len(ok) else None), df.attrs.get("best_plan")


def _print_best(w: Workload, label: str, r, plan, timelines: str | None) -> None:
    """One space's best plan: time, memory, knobs, the fine layout, the simulated time per device class."""
    if r is None:
        print(f"  {label}: no simulated plan fits")
        return
    print(f"  {label}: {r['iter_time_s']:.3f} s, {r['peak_mem_gib']:.1f} GiB, MFU {r['mfu']:.1%}: {_knobs(r)}")
    if isinstance(r.get("stage_layers"), tuple):
        print(
            f"    layout: layers {r['stage_layers']}, recomputed {r['stage_recompute']}, "
            f"optimizer offloaded per device group {r['stage_offload']}"
        )
    if timelines and plan is not None:
        print(f"    simulated, per device class: {_device_times(w, plan)}")


def _cpu_s() -> float:
    """CPU seconds of this process and its finished workers."""
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ch.ru_utime + ch.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated workload keys")
    ap.add_argument("--timelines", default=None, help="write both best plans' timelines there")
    ap.add_argument("--set", action="append", default=[], help="KNOB=VALUE pinned in both spaces (a slice of the grid)")
    ap.add_argument("--candidates", type=int, default=None, help="plans simulated per space (default: explore's)")
    ap.add_argument("--spaces", default="grid,fine", help="which of grid, fine to explore (the speedup needs both)")
    ap.add_argument(
        "--bound",
        action="store_true",
        help="bound what any fine layout of any grid point can reach in the program's model, against the grid best",
    )
    ap.add_argument(
        "--grid-best",
        default="",
        help="with --bound and no grid run: the grid best's knobs, KNOB=VALUE,... (simulated here)",
    )
    ap.add_argument(
        "--target",
        type=float,
        default=None,
        help="with --bound: prove only that no fine layout is that speedup over the grid best (e.g. 1.10), or find one",
    )
    ap.add_argument(
        "--simulate-best",
        action="store_true",
        help="with --bound: simulate the fine plan at the point where the program's best layout is",
    )
    args = ap.parse_args()
    bad = [kv for kv in args.set + [kv for kv in args.grid_best.split(",") if kv] if "=" not in kv]
    if bad:
        ap.error(f"{bad[0]!r}: expected KNOB=VALUE")
    chosen = [w for w in WORKLOADS if not args.only or w.key in args.only.split(",")]
    fixed = {k: int(v) if v.isdigit() else v for k, v in (kv.split("=", 1) for kv in args.set)}
    if fixed:
        print(f"pinned in both spaces: {fixed} (a slice of the grid, not the full grid)")
    t0, cpu0 = time.perf_counter(), time.process_time()
    ratios, bounds = [], []
    for w in chosen:
        best, plans = {}, {}
        for label, space in SPACES:
            if label in args.spaces.split(","):
                best[label], plans[label] = _explore(w, label, space, args, fixed)
        g, f = best.get("grid"), best.get("fine")
        print(f"\n{w.key}: {w.model} on {w.nodes} x {w.cluster}, global batch {w.global_batch}")
        for label in best:
            _print_best(w, label, best[label], plans[label], args.timelines)
        if args.bound:
            from planlab.search_spaces import get_space

            given = dict(kv.split("=", 1) for kv in args.grid_best.split(",") if kv)
            if g is not None:
                bounds.append(
                    _bound(
                        w,
                        _row_knobs(get_space("megatron"), g),
                        float(g["iter_time_s"]),
                        fixed,
                        args.simulate_best,
                        args.target,
                    )
                )
            elif given:
                bounds.append(_bound(w, given, None, fixed, args.simulate_best, args.target))
            else:
                print("  --bound needs the grid best: explore the grid (--spaces grid) or give --grid-best")
        if g is None or f is None:
            continue
        ratio = g["iter_time_s"] / f["iter_time_s"]
        ratios.append(ratio)
        print(f"  speedup fine / grid: {ratio:.3f}x")
        if args.timelines:
            print(f"  per-stage ms per micro-batch (screen): grid {_stage_times(w, g, 'megatron')}")
            print(f"                                         fine {_stage_times(w, f, 'megatron*fine')}")
    if ratios:
        gm = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        print(
            f"\ngeometric mean speedup over {len(ratios)} workloads: {gm:.3f}x (target 1.10x); min {min(ratios):.3f}x, max {max(ratios):.3f}x"
        )
    bounds = [b for b in bounds if b is not None]
    if bounds:
        gm = math.exp(sum(math.log(b) for b in bounds) / len(bounds))
        print(
            f"\nlargest speedups the fine space could find (in its model, and against the grid bests simulated): "
            f"geometric mean {gm:.3f}x over {len(bounds)}"
        )
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        f"wall {time.perf_counter() - t0:.0f} s, CPU {time.process_time() - cpu0:.0f} s (+ workers "
        f"{ch.ru_utime + ch.ru_stime:.0f} s), load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    from planlab.errors import PlanlabError

    try:
        main()
    except PlanlabError as e:  # a knob or value the space refuses: its one line
        sys.exit(f"fine_grained: {e}")
