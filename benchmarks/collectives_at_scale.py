"""planlab's collective times beside nccl-tests measurements on 1 to 32 nodes.

Reads ``benchmarks/microbench/nccl-tests-multinode.csv`` (sources in ``benchmarks/microbench/README.md``)
and prints, per row, the measured bus bandwidth (or time), planlab's, the signed error and the
algorithm planlab prices; then, per set, the mean absolute and signed error. ``--gathers`` adds
planlab's all_gather over 48 to 192 DGX A100 nodes at the sizes of ZeRO-3's gathers (no
measurement: what the model predicts there). ``--fit`` fits ``dgx-a100-40g``'s ``inter_efficiency``
(max, half_MiB, exponent <= 1, so that a bigger message never takes less time; fit_ranks 16) to the
two-node rows of ``echo-a100`` by least squares on log bus bandwidth, with every other field of the
spec as it is, and prints it. ``--fit-intra`` fits the A100 nodes' ``intra_efficiency_by_ranks``
(a curve per number of ranks, 2 to 7, inside one node) the same way to the rows of ``vtrain-a100``
(vTrain's all-reduce tables of one A100 NVSwitch node); 8 ranks keep ``intra_efficiency``.

    .venv/bin/python benchmarks/collectives_at_scale.py [--gathers] [--fit] [--fit-intra]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
from pathlib import Path

from planlab.costmodel.comm import algorithms, collective_time_s
from planlab.costmodel.hardware import ClusterSpec, Efficiency, load_cluster

DATA = Path(__file__).parent / "microbench" / "nccl-tests-multinode.csv"
MiB = 2**20


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' bus bandwidth over algorithm bandwidth for ``kind`` on ``n`` ranks."""
    return 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


def predict(cluster: str | ClusterSpec, nodes: int, ranks: int, kind: str, nbytes: int) -> tuple[float, str]:
    """planlab's time (s) of ``kind`` on ``nbytes`` over the first ``ranks`` ranks, and the fastest algorithm."""
    c = load_cluster(cluster, nodes) if isinstance(cluster, str) else cluster
    group = tuple(range(ranks))
    t = collective_time_s(c, kind, nbytes, group)  # the algorithm planlab picks
    for a in algorithms(kind):
        if a == "nvls" and (nodes > 1 or c.node.nvls_bytes_per_s <= 0):
            continue
        if collective_time_s(c, kind, nbytes, group, algorithm=a) == t:
            return t, a
    return t, "?"


def _fit_curve(rows: list[dict[str, str]], cluster: str, with_curve, start: Efficiency) -> tuple[float, float, float]:
    """The (max, half_MiB, exponent <= 1) of an efficiency curve that best fits ``rows`` (least squares
    on log bus bandwidth), rounded to 2 decimals; ``with_curve(spec, curve)`` puts the curve into
    ``cluster``'s spec, every other field as it is."""
    from scipy.optimize import minimize

    def error(x: tuple[float, float, float]) -> float:
        top, half_mib, exponent = x
        # exponent <= 1: a message's time (nbytes / efficiency) must grow with its size
        if not (0 < top <= 1 and half_mib > 0 and 0 < exponent <= 1):
            return math.inf
        total = 0.0
        for row in rows:
            c = load_cluster(cluster, int(row["nodes"]))
            c = with_curve(c, Efficiency(top, half_mib * MiB, exponent, start.ranks))
            n, nbytes = int(row["ranks"]), int(row["bytes"])
            t, _ = predict(c, int(row["nodes"]), n, row["collective"], nbytes)
            total += math.log(nbytes / t * bus_factor(row["collective"], n) / 1e9 / float(row["busbw_GBps"])) ** 2
        return total

    x0 = [start.max, start.half / MiB, min(start.exponent, 0.99)]
    bounds = [(0.01, 1.0), (0.01, 1000.0), (0.05, 1.0)]
    best = minimize(error, x0, method="Nelder-Mead", bounds=bounds, options={"xatol": 1e-4})
    return tuple(round(float(v), 2) for v in best.x)  # type: ignore[return-value]


def fit_inter_efficiency(rows: list[dict[str, str]]) -> tuple[float, float, float]:
    """``dgx-a100-40g``'s inter_efficiency (max, half_MiB, exponent) that best fits ``rows`` (least
    squares on log bus bandwidth), rounded to 2 decimals."""

    def with_curve(c: ClusterSpec, curve: Efficiency) -> ClusterSpec:
        return dataclasses.replace(c, node=dataclasses.replace(c.node, inter_efficiency=curve))

    return _fit_curve(rows, "dgx-a100-40g", with_curve, load_cluster("dgx-a100-40g").node.inter_efficiency)


def fit_intra_efficiency(rows: list[dict[str, str]], ranks: int) -> tuple[float, float, float]:
    """``hgx-a100-80g-4nic``'s ``intra_efficiency_by_ranks`` curve for rings of ``ranks`` ranks inside
    one node (max, half_MiB, exponent) that best fits ``rows`` (least squares on log bus bandwidth),
    starting from the 8-rank curve ``intra_efficiency``, rounded to 2 decimals."""

    def with_curve(c: ClusterSpec, curve: Efficiency) -> ClusterSpec:
        return dataclasses.replace(c, node=dataclasses.replace(c.node, intra_by_ranks=((ranks, curve),)))

    start = load_cluster("hgx-a100-80g-4nic").node.intra_efficiency
    return _fit_curve(rows, "hgx-a100-80g-4nic", with_curve, start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gathers", action="store_true", help="also print all_gather over 48 to 192 DGX A100 nodes")
    ap.add_argument("--fit", action="store_true", help="fit dgx-a100-40g's inter_efficiency to the two-node rows")
    ap.add_argument(
        "--fit-intra", action="store_true", help="fit the A100 node's intra_efficiency_by_ranks to vtrain-a100's rows"
    )
    args = ap.parse_args()
    if args.fit_intra:
        with DATA.open() as fh:
            lut = [r for r in csv.DictReader(fh) if r["set"] == "vtrain-a100"]
        for n in sorted({int(r["ranks"]) for r in lut} - {8}):
            top, half_mib, exponent = fit_intra_efficiency([r for r in lut if int(r["ranks"]) == n], n)
            print(f'intra_efficiency_by_ranks "{n}": max {top}, half_MiB {half_mib}, exponent {exponent}')
        print()
    if args.fit:
        with DATA.open() as fh:
            rows = [r for r in csv.DictReader(fh) if r["set"] == "echo-a100" and r["nodes"] == "2"]
        top, half_mib, exponent = fit_inter_efficiency(rows)
        print(
            f"inter_efficiency fitted to {len(rows)} two-node rows: max {top}, half_MiB {half_mib}, exponent {exponent}\n"
        )
    errors: dict[str, list[float]] = {}
    print(
        f"{'set':<14} {'cluster':<18} {'nodes':>5} {'ranks':>5} {'collective':<11} {'bytes':>11}"
        f" {'measured':>10} {'planlab':>10} {'error':>7}  algorithm"
    )
    with DATA.open() as fh:
        for row in csv.DictReader(fh):
            nodes, ranks, nbytes = int(row["nodes"]), int(row["ranks"]), int(row["bytes"])
            kind = row["collective"]
            t, algo = predict(row["cluster"], nodes, ranks, kind, nbytes)
            if row["busbw_GBps"]:
                measured = float(row["busbw_GBps"])
                model = nbytes / t * bus_factor(kind, ranks) / 1e9
                unit = "GB/s"
                err = model / measured - 1  # > 0: planlab too fast
            else:
                measured = float(row["time_us"])
                model = t * 1e6
                unit = "us"
                err = measured / model - 1  # > 0: planlab too fast, as for bandwidth
            errors.setdefault(row["set"], []).append(err)
            print(
                f"{row['set']:<14} {row['cluster']:<18} {nodes:>5} {ranks:>5} {kind:<11} {nbytes:>11}"
                f" {measured:>7.1f}{unit:>3} {model:>7.1f}{unit:>3} {err:>+7.1%}  {algo}"
            )
    print("\nerror > 0: planlab faster than measured (bandwidth higher, or time shorter)")
    for name, errs in errors.items():
        mape = sum(abs(e) for e in errs) / len(errs)
        signed = sum(errs) / len(errs)
        print(f"{name:<14} {len(errs):>2} rows: mean absolute {mape:6.1%}, mean signed {signed:+6.1%}")
    if args.gathers:
        print("\nall_gather over DGX A100 80GB nodes (planlab only; algorithm bandwidth, GB/s)")
        sizes = (25 * MiB, 200 * MiB, 864 * MiB)
        print(f"{'nodes':>5} {'ranks':>5} " + " ".join(f"{s // MiB:>8} MiB" for s in sizes))
        for nodes in (48, 96, 192):
            ranks = 8 * nodes
            cells = []
            for s in sizes:
                t, algo = predict("dgx-a100-80g", nodes, ranks, "all_gather", s)
                cells.append(f"{s / t / 1e9:>7.1f} {algo[:4]}")
            print(f"{nodes:>5} {ranks:>5} " + " ".join(cells))


if __name__ == "__main__":
    main()
