"""Predicted against measured iteration time on vTrain's 1,549 measured runs.

Every run of ``vtrain_ground_truth_single.csv`` (1,440) and ``..._multi.csv`` (109) is built as
the measured system's plan (``planlab.validation``: Megatron-DeepSpeed's GPT, tensor x data x
pipeline parallelism with 1F1B, full recompute) and simulated as a user's plan is, on the built-in
cluster ``hgx-a100-80g-4nic`` (HGX A100 80GB, 800 Gb/s of InfiniBand per node, as the reference
states) with the built-in software ``deepspeed`` in fp16 (Megatron-DeepSpeed); every number of
those files names its source, none comes from vTrain's rows. Prints where the parameters come
from, then per set: planlab's mean absolute percentage error (MAPE) next to
vTrain's own (8.37% and 14.73%), the mean signed error, the error by group (hidden size,
micro-batch, tp, pp, dp, nodes), the worst runs and Kendall's tau of predicted against measured
time within each model size, and how much of the signed error by micro-batch is the cost an
iteration pays once (:func:`fixed_share`: per configuration measured at several global batches, the
least-squares split of its times into a fixed cost and a cost per pipeline step, vTrain's against
predicted; on the single-node set vTrain's "fixed cost" is its composed constant plus its own all-reduce
table, not a measured optimizer step: ``benchmarks/vtrain_composition.py``), and the rows that do the
same work per GPU under the same pipeline schedule at several tensor-parallel degrees, with the pairs
whose measured order is the opposite of the predicted one (:func:`matched_work`). ``--breakdown K`` then simulates the K worst runs of each set again
with a timeline and prints where the predicted step goes on its slowest device (:func:`breakdown`).

    .venv/bin/python benchmarks/validate_vtrain.py [--every N] [--multi-every M] [--jobs 2] [--csv out.csv]
        [--breakdown K]
"""

import argparse
import json
import re
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pandas as pd

from planlab.costmodel.hardware import DEVICES_FILE, SPEC_DIR
from planlab.costmodel.software import SOFTWARE_DIR
from planlab.validation import (
    CLUSTER,
    PRECISION,
    SOFTWARE,
    MeasuredRun,
    load_runs,
    mape,
    program_of,
    rank_correlation,
    validate,
)

HERE = Path(__file__).resolve().parent


def _reference() -> Path:
    """The shared reference directory: beside the repository or its worktree, or /work/shared."""
    for base in (HERE.parents[1], HERE.parents[2] if len(HERE.parents) > 2 else HERE, Path("/work")):
        if (base / "shared" / "reference").is_dir():
            return base / "shared" / "reference"
    return Path("/work/shared/reference")


VTRAIN_MAPE = {"single": 8.37, "multi": 14.73}  # vTrain (MICRO 2024), reference README
GROUPS = ("hidden", "micro_batch", "tp", "pp", "dp", "nodes")
CROSS = (("tp", "pp"), ("tp", "micro_batch"), ("hidden", "tp"))  # two factors at once: where the misses sit


def _numbers(where: str, obj: dict, sources: dict) -> None:
    for key, val in obj.items():
        if key in ("source", "description", "name", "device") or isinstance(val, str):
            continue
        src = sources.get(key, "?")
        print(f"  {where}.{key} = {json.dumps(val)}: {src if isinstance(src, str) else json.dumps(src)}")


def print_sources(cluster: str, software: str, precision: str) -> None:
    """Every number of the cluster, its device and the software with where it comes from."""
    node = json.loads((SPEC_DIR / f"{cluster}.json").read_text())
    device = json.loads((SPEC_DIR / DEVICES_FILE).read_text())[node["device"]]
    sw = json.loads((SOFTWARE_DIR / f"{software}.json").read_text())
    print(f"parameters: cluster {cluster}, device {node['device']}, software {software} ({precision}):")
    _numbers("device", device, device.get("source", {}))
    _numbers("node", node, node.get("source", {}))
    _numbers("software", sw, sw.get("source", {}))
    prec_src = sw["precisions"]["source"][precision]
    _numbers(
        f"software.precisions.{precision}",
        sw["precisions"][precision],
        dict.fromkeys(sw["precisions"][precision], prec_src),
    )
    _numbers("software.memory", sw["memory"], sw["memory"]["source"])


def report(df: pd.DataFrame, kind: str) -> None:
    print(
        f"{kind}-node: {len(df)} runs; planlab MAPE {mape(df):.2f}% (vTrain's own: {VTRAIN_MAPE[kind]}%); "
        f"mean signed error {df['error'].mean() * 100:+.1f}%; within 10%: {(df['error'].abs() <= 0.1).mean() * 100:.0f}%;"
        f" Kendall tau within model sizes {rank_correlation(df):.3f}"
    )
    df = df.assign(nodes=(df["gpus"] + 7) // 8)
    for g in GROUPS:
        parts = []
        for v, s in df.groupby(g):
            parts.append(f"{v}: {s['error'].abs().mean() * 100:.1f}% ({s['error'].mean() * 100:+.1f}, n={len(s)})")
        print(f"  by {g}: " + "; ".join(parts))
    for rows, cols in CROSS:
        print(cross_table(df, rows, cols))
    print(fixed_share(df))
    print(matched_work(df))
    worst = df.reindex(df["error"].abs().sort_values(ascending=False).index).head(8)
    print(
        worst[
            [
                "gpus",
                "hidden",
                "layers",
                "global_batch",
                "micro_batch",
                "tp",
                "dp",
                "pp",
                "measured_s",
                "predicted_s",
                "error",
            ]
        ].to_string(index=False)
    )


def cross_table(df: pd.DataFrame, rows: str, cols: str) -> str:
    """Mean signed error (%) and the number of runs for every pair of ``rows`` x ``cols`` values
    that has runs, as a printable table."""
    cell = df.groupby([rows, cols])["error"].agg(["mean", "size"])
    text = cell.apply(lambda r: f"{r['mean'] * 100:+.1f} ({int(r['size'])})", axis=1).unstack(cols).fillna("")
    return f"  signed error %, {rows} (rows) x {cols} (columns), runs in brackets:\n" + text.to_string()


SHAPE = ("hidden", "layers", "tp", "dp", "pp")  # one configuration, measured at several global batches


def step_costs(df: pd.DataFrame) -> pd.DataFrame:
    """Per configuration measured at two or more numbers of micro-batches ``m`` (the same shape, degrees
    and micro-batch, another global batch), the least-squares ``time = fixed + (m + pp - 1) x per``
    of the measured and of the predicted times: ``fixed`` is what an iteration pays once (the optimizer
    step, the gradient all-reduce), ``per`` a pipeline step's. Columns ``fixed_measured_s``,
    ``fixed_predicted_s``, ``per_measured_s``, ``per_predicted_s`` beside the configuration's."""
    df = df.assign(m=df["global_batch"] // (df["dp"] * df["micro_batch"]))
    rows = []
    for key, g in df.groupby(list(SHAPE) + ["micro_batch"]):
        steps = g["m"] + g["pp"] - 1
        if steps.nunique() < 2:
            continue
        (per_m, fixed_m), (per_p, fixed_p) = (np.polyfit(steps, g[c], 1) for c in ("measured_s", "predicted_s"))
        rows.append(
            dict(zip(list(SHAPE) + ["micro_batch"], key))
            | dict(fixed_measured_s=fixed_m, fixed_predicted_s=fixed_p, per_measured_s=per_m, per_predicted_s=per_p)
        )
    return pd.DataFrame(rows)


def fixed_share(df: pd.DataFrame) -> str:
    """How much of each micro-batch size's mean signed error is the once-an-iteration cost
    (:func:`step_costs`; a configuration's fixed cost, the median over its micro-batch sizes, also
    stands for its rows measured at one global batch): the predicted less the measured fixed cost over
    each row's measured time, and the rest of the error, as a printable table."""
    costs = step_costs(df)
    if costs.empty:
        return "  once an iteration: no configuration measured at two numbers of micro-batches"
    fixed = costs.groupby(list(SHAPE))[["fixed_measured_s", "fixed_predicted_s"]].median().reset_index()
    rows = df.merge(fixed, on=list(SHAPE))
    rows["fixed"] = (rows["fixed_predicted_s"] - rows["fixed_measured_s"]) / rows["measured_s"]
    rows["rest"] = rows["error"] - rows["fixed"]
    table = rows.groupby("micro_batch")[["error", "fixed", "rest"]].mean() * 100
    ms = costs.groupby(["hidden", "tp", "pp"])[["fixed_measured_s", "fixed_predicted_s"]].median() * 1e3
    cells = ms.apply(lambda r: f"{r['fixed_measured_s']:.1f} / {r['fixed_predicted_s']:.1f}", axis=1).unstack("pp")
    return (
        f"  once an iteration ({len(costs)} configurations at two or more global batches, {len(rows)} rows): "
        f"signed error % by micro-batch, the fixed cost's share and the rest:\n"
        + table.round(1).to_string()
        + "\n  fixed cost, vTrain's (single-node: composed, vtrain_composition.py) / predicted ms (median),"
        " hidden and tp (rows) x pp (columns):\n" + cells.fillna("").to_string()
    )


MATCH = ("hidden", "layers", "pp", "m", "work")  # same model, schedule and work per GPU: only tp differs


def matched_groups(df: pd.DataFrame) -> pd.DataFrame:
    """The rows that do the same work per GPU under the same pipeline schedule with different tensor-
    parallel degrees: same model (hidden, layers), same pp and number of micro-batches ``m`` (so the same
    1F1B bubble), and the same micro-batch per tp rank (``micro_batch / tp``: the same FLOPs per GPU and
    micro-batch, and with DeepSpeed's tp-partitioned pipeline messages the same bytes between stages).
    What differs is only what grows with tp (the tp all-reduces, the element-wise work every tp rank repeats,
    narrower GEMMs) and what shrinks with it (parameters per GPU: the optimizer step, the gradient
    all-reduce, whose bytes per node are the same at every tp). Columns: the row's with ``m`` and ``work``
    (the micro-batch per tp rank) added, sorted by group and tp; only groups with two or more tp."""
    df = df.assign(
        m=df["global_batch"] // (df["dp"] * df["micro_batch"]),
        work=[Fraction(int(mb), int(tp)) for mb, tp in zip(df["micro_batch"], df["tp"])],
    )
    keep = df.groupby(list(MATCH))["tp"].transform("nunique") > 1
    return df[keep].sort_values(list(MATCH) + ["tp"]).reset_index(drop=True)


def order_contradictions(df: pd.DataFrame) -> pd.DataFrame:
    """Within each group of :func:`matched_groups`, every pair of rows (lower tp ``a``, higher tp ``b``)
    whose measured order is the opposite of the predicted one, with the measured and predicted time of
    each: columns ``hidden``, ``pp``, ``m``, ``tp_a``, ``tp_b``, ``measured_a``, ``measured_b``,
    ``predicted_a``, ``predicted_b``."""
    rows = []
    for key, g in matched_groups(df).groupby(list(MATCH)):
        recs = g.to_dict("records")
        for i, a in enumerate(recs):
            for b in recs[i + 1 :]:
                if a["tp"] == b["tp"]:
                    continue
                measured, predicted = a["measured_s"] - b["measured_s"], a["predicted_s"] - b["predicted_s"]
                if measured * predicted < 0:
                    rows.append(
                        dict(hidden=key[0], pp=key[2], m=key[3], tp_a=a["tp"], tp_b=b["tp"])
                        | dict(measured_a=a["measured_s"], measured_b=b["measured_s"])
                        | dict(predicted_a=a["predicted_s"], predicted_b=b["predicted_s"])
                    )
    return pd.DataFrame(rows)


def matched_work(df: pd.DataFrame) -> str:
    """:func:`matched_groups` as a printable table (measured / predicted s and the signed error per tp),
    then the pairs whose measured order contradicts the predicted one (:func:`order_contradictions`)."""
    groups = matched_groups(df)
    if groups.empty:
        return "  same work per GPU at several tp: no such rows"
    lines = [
        f"  same work per GPU and schedule at several tp ({groups.groupby(list(MATCH)).ngroups} groups, "
        f"{len(groups)} rows): measured / predicted s (signed error), by tp:"
    ]
    for key, g in groups.groupby(list(MATCH)):
        cells = " | ".join(
            f"tp {r.tp} mb {r.micro_batch}: {r.measured_s:.2f} / {r.predicted_s:.2f} ({r.error * 100:+.0f}%)"
            for r in g.itertuples()
        )
        lines.append(f"    h {key[0]} pp {key[2]} m {key[3]}: {cells}")
    bad = order_contradictions(df)
    lines.append(f"  pairs whose measured order contradicts the predicted one: {len(bad)}")
    for r in bad.itertuples():
        lines.append(
            f"    h {r.hidden} pp {r.pp} m {r.m}: tp {r.tp_a} / tp {r.tp_b} measured {r.measured_a / r.measured_b:.2f}, "
            f"predicted {r.predicted_a / r.predicted_b:.2f}"
        )
    return "\n".join(lines)


# What a task of the timeline is, by its name (planlab's Program names tasks after the model's
# modules): the order matters, the first pattern that matches decides.
COMM_KINDS = (
    ("dp gradient reduce", re.compile(r"grad-reduce")),
    ("pp send/recv", re.compile(r":(send|recv)")),
    ("tp collectives", re.compile(r"all_reduce|all_gather|reduce_scatter")),
)
COMPUTE_KINDS = (
    ("optimizer step", re.compile(r"^optimizer")),
    ("linear layers", re.compile(r"_attn_[qkv]$|_attn_proj$|_mlp_fc$|_mlp_proj$|lm_head$")),
    ("attention (bmm, softmax, dropout)", re.compile(r"scaled_dot_product_attention|_attn_drop$")),
)


def _kind(name: str, kinds) -> str:
    bare = name.removeprefix("re:").removeprefix("d")
    return next((k for k, pat in kinds if pat.search(name) or pat.search(bare)), "other")


def breakdown(run: MeasuredRun, cluster: str = CLUSTER) -> dict:
    """Where ``run``'s predicted step goes on its slowest device: busy seconds of compute by kind
    (and how much of it is recomputation) and of communication by kind, then the device's
    exposed communication, pipeline bubble and the rest of its time."""
    from planlab.simulator.engine import simulate

    program, cost = program_of(run, cluster)
    res = simulate(program, cost, timeline=True)
    slow = max(res.devices, key=lambda d: d.finish_s)
    busy: dict[str, float] = {}
    for e in res.events:
        if e.device != slow.device or e.stream not in ("compute", "comm"):
            continue
        kind = _kind(e.name, COMPUTE_KINDS if e.stream == "compute" else COMM_KINDS)
        key = f"{e.stream}: {kind}"
        busy[key] = busy.get(key, 0.0) + e.end_s - e.start_s
        if e.stream == "compute" and e.name.startswith("re:"):
            busy["compute: of it recomputation"] = busy.get("compute: of it recomputation", 0.0) + e.end_s - e.start_s
    return dict(
        predicted_s=res.iter_time_s,
        device=slow.device,
        busy_s=dict(sorted(busy.items())),
        exposed_comm_s=slow.exposed_comm_s,
        bubble_s=slow.bubble_s,
        idle_s=slow.idle_s,
    )


def print_breakdowns(df: pd.DataFrame, runs: list[MeasuredRun], k: int, cluster: str = CLUSTER) -> None:
    """:func:`breakdown` of the ``k`` runs of ``df`` with the largest absolute error."""
    by_key = {(r.gpus, r.hidden, r.layers, r.global_batch, r.micro_batch, r.tp, r.dp, r.pp): r for r in runs}
    worst = df.reindex(df["error"].abs().sort_values(ascending=False).index).head(k)
    for _, row in worst.iterrows():
        run = by_key[
            tuple(int(row[c]) for c in ("gpus", "hidden", "layers", "global_batch", "micro_batch", "tp", "dp", "pp"))
        ]
        b = breakdown(run, cluster)
        print(
            f"  breakdown: h {run.hidden} x {run.layers} layers, tp {run.tp} dp {run.dp} pp {run.pp}, micro-batch "
            f"{run.micro_batch} x {run.microbatches}: measured {run.measured_s:.3f} s, predicted {b['predicted_s']:.3f} s "
            f"({row['error'] * 100:+.1f}%); device {b['device']}:"
        )
        print("    " + "; ".join(f"{key} {v:.3f} s" for key, v in b["busy_s"].items()))
        print(
            f"    exposed communication {b['exposed_comm_s']:.3f} s, pipeline bubble {b['bubble_s']:.3f} s, "
            f"rest {b['idle_s']:.3f} s"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--every", type=int, default=1, help="every N-th single-node run (default: all)")
    ap.add_argument("--multi-every", type=int, default=1, help="every M-th multi-node run (0: none)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--ref", default=str(_reference()))
    ap.add_argument("--breakdown", type=int, default=0, help="break down the K worst runs of each set (default: 0)")
    args = ap.parse_args()
    print_sources(CLUSTER, SOFTWARE, PRECISION)
    frames = []
    for kind in ("single", "multi"):
        step = args.every if kind == "single" else args.multi_every
        if step <= 0:
            continue
        runs = load_runs(Path(args.ref) / f"vtrain_ground_truth_{kind}.csv")[::step]
        t = time.perf_counter()
        df = validate(runs, CLUSTER, jobs=args.jobs)
        df["set"] = kind
        frames.append(df)
        print(f"({kind}: {len(df)} runs simulated in {time.perf_counter() - t:.0f} s)")
        report(df, kind)
        if args.breakdown > 0:
            print_breakdowns(df, runs, args.breakdown)
        if args.csv:  # after each set, so a long run keeps what it has
            pd.concat(frames).to_csv(args.csv, index=False)


if __name__ == "__main__":
    main()
