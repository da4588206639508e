"""Coshard against the Megatron grid and ZeRO data parallelism, for SwinV2-G at a large image size.

nnScaler (Lin et al., OSDI 2024) reports its largest wins on SwinV2 with large images: its
evaluation scripts train 1536 x 1536 images with 48 x 48 windows (2,304 tokens a window), whose
attention scores hold most of the activations. This script explores, for that shape on
``--nodes`` DGX A100 nodes and one global batch:

1. ``megatron``: data x tensor x pipeline parallelism x recomputation;
2. ``megatron*coshard`` with ``coshard_blocks=attention``: the same grid, each layer's attention
   split ``coshard`` = 1, 2, 4 or 8 times more than tensor parallelism splits it, its pieces run
   one after another on their device, each recomputed;
3. ``dp`` with ZeRO stage 1 and 2: every plan simulated (explore's memory bound does not count
   ZeRO's sharding, so it would refuse them unsimulated);

and prints the best plan of each with its predicted iteration time, peak memory and the ratio to
the Megatron grid's best. The simulator's predictions, not measurements: no GPU is used.
Takes about 20 minutes with two jobs on a quiet 2-core machine.

Run: .venv/bin/python benchmarks/coshard_swin.py [--cluster dgx-a100-40g] [--nodes 4] [--global-batch 32]
"""

from __future__ import annotations

import argparse
import math
import time


def _best(df):
    ok = df[df["feasible"]]
    return None if ok.empty else ok.sort_values("iter_time_s").iloc[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="dgx-a100-40g")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--image", type=int, default=1536)
    ap.add_argument("--window", type=int, default=48)
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()

    import planlab
    from planlab.explore import Setup, make_context
    from planlab.models import ModelSpec
    from planlab.plan import materialize
    from planlab.search_spaces import get_space
    from planlab.simulator import simulate

    spec = ModelSpec("swin-g", (("image", a.image), ("window", a.window)))
    print(f"SwinV2-G {a.image}x{a.image}, window {a.window}, global batch {a.global_batch}, {a.nodes} x {a.cluster}")
    rows = {}
    for label, space, fixed in (
        ("megatron", "megatron", {}),
        ("megatron*coshard", "megatron*coshard", {"coshard_blocks": "attention"}),
    ):
        t0 = time.perf_counter()
        df = planlab.explore(
            spec, cluster=a.cluster, nodes=a.nodes, space=space, fixed=fixed, global_batch=a.global_batch, jobs=a.jobs
        )
        best = _best(df)
        rows[label] = best
        knobs = (
            ""
            if best is None
            else " ".join(
                f"{k}={best[k]}" for k in ("dp", "tp", "pp", "microbatch", "recompute", "coshard") if k in best
            )
        )
        print(
            f"  {label:<18} {len(df)} plans, {int(df['feasible'].sum())} feasible "
            f"({time.perf_counter() - t0:.0f} s); best: {knobs}"
        )

    ctx, cost, graph = make_context(Setup(spec, a.cluster, a.nodes, a.global_batch))
    best_zero = None
    for zero in (1, 2):
        for values in get_space("dp").assignments(ctx, {"zero": zero}):
            prog = materialize(get_space("dp").build(ctx, values), graph, symmetric=True, node_of=cost.cluster.node_of)
            res = simulate(prog, cost, model_flops=3.0 * graph.flops)
            row = dict(
                values, iter_time_s=res.iter_time_s, peak_mem_gib=res.peak_mem_bytes / 2**30, feasible=res.feasible
            )
            if res.feasible and (best_zero is None or row["iter_time_s"] < best_zero["iter_time_s"]):
                best_zero = row
            elif best_zero is None and not res.feasible:
                print(
                    f"  dp zero={zero} dp={values['dp']} microbatch={values['microbatch']}: out of memory, "
                    f"peak {res.peak_mem_bytes / 2**30:.1f} GiB"
                )
    rows["dp + ZeRO"] = best_zero

    ref = rows["megatron"]
    ref_s = ref["iter_time_s"] if ref is not None else math.nan
    print(f"\n  {'space':<18} {'iter_time_s':>11} {'peak_GiB':>9} {'vs megatron':>12}")
    for label, row in rows.items():
        if row is None:
            print(f"  {label:<18} {'no plan fits':>11}")
            continue
        print(
            f"  {label:<18} {row['iter_time_s']:>11.3f} {row['peak_mem_gib']:>9.1f} "
            f"{ref_s / row['iter_time_s']:>11.2f}x"
        )


if __name__ == "__main__":
    main()
