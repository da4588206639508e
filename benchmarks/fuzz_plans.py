"""Random plans on 2 to 4 gloo ranks against one process: finds whole classes of errors.

Each plan is drawn from its own seed (``SEED:INDEX``), so any plan can be drawn again alone with
``--first INDEX --plans 1``: a small model (planlab's GPT with dropout, LLaMA, T5 with dropout, MoE,
Swin, the Evoformer, and Hugging Face GPT-2, Swin, T5, ViT and LLaMA in their default
configurations, dropout and stochastic depth on; the Evoformer also with 3 recycling passes), a device count (2 or 4), and either a random
assignment of a random built-in space (dp, tp, pp, recompute, megatron, coshard, interlaced, alpa,
3f1b, megatron*coshard) or random primitives (each operator kept whole on one device, replicated,
or split along a random splittable dimension, its pieces on a random order of the devices; 1 or 2
micro-batches). The plan runs 2 steps with the numeric check on a pool of ranks started once per
device count (``planlab.executor.pool.RankPool``: each rank traces the model and runs the worker
``planlab run``'s processes run, in a fresh process group per plan), or with ``--launch`` on ranks
started for it by ``planlab.executor.launch_local`` (what ``planlab run`` calls); each line prints the result: ``ok``, ``MISMATCH`` (loss or gradient
error above planlab run's tolerances) or ``ERROR`` (the run failed). A draw whose space does not
apply to its model, or that planlab refuses before running it (a split the model cannot take),
is drawn again (up to 30 times); the refusals are counted and kept with their reasons.

Run: .venv/bin/python benchmarks/fuzz_plans.py --plans 500 --seed 0
(``--out FILE.jsonl`` keeps a line per plan.) Each line ends with the plan's time: wall seconds,
drawing, the run (``launch``) and its steps, and CPU seconds (this process and its ranks); the
summary adds them up. With ``--launch``, plan 157 took 16 s of CPU, about half of it its 2 ranks
starting (importing torch and planlab: 2.5 s of CPU each, 3.8 s with transformers) and 0.4 s its
steps; the pool starts them once per device count (and again after a failed plan).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import resource
import statistics
import sys
import time
import traceback

GLOBAL_BATCH = 8
LOSS_TOL = GRAD_TOL = 1e-4  # planlab run's tolerances (planlab.cli)
HF = "planlab.models.hf:"
MODELS = (  # (model, --model-arg pairs)
    ("gpt-tiny", (("dropout", 0.1),)),
    ("gpt-tiny", (("dropout", 0.1), ("vocab_parallel", 1))),
    ("llama-tiny", ()),
    ("t5-tiny", (("dropout", 0.1),)),
    ("moe-tiny", ()),
    ("swin-tiny", ()),
    ("evoformer-tiny", ()),
    ("evoformer-tiny", (("recycles", 3),)),  # AlphaFold2's recycling: what the 3f1b space pipelines
    (HF + "gpt2", ()),
    (HF + "swin", ()),
    (HF + "t5", ()),
    (HF + "vit", ()),
    (HF + "llama", ()),
)
SPACES = (  # every built-in space, those that use one device per stage composed with dp
    "dp",
    "tp",
    "pp",
    "dp*recompute",
    "megatron",
    "dp*coshard",
    "megatron*coshard",
    "interlaced",
    "alpa",
    "3f1b",
    "primitives",
    "primitives",
)
ATTEMPTS = 30  # draws until a plan applies to its model and planlab takes it


def random_primitives(rng: random.Random, graph, spec, n: int):
    """A plan of random op-trans and op-assign calls (see the module docstring)."""
    from planlab.plan import PlanBuilder

    b = PlanBuilder(graph, model=spec, global_batch=GLOBAL_BATCH, cluster="cpu", nodes=n, num_devices=n)
    b.microbatch(rng.choice([1, 2]))
    for op in graph.operators:
        choice = rng.choice(["whole", "replicate"] + op.splittable_dims())
        if choice == "whole":
            b.op_assign(op.name, [rng.randrange(n)])
            continue
        k = rng.choice([2, n])
        try:
            b.op_trans(op.name, None if choice == "replicate" else choice, k)
        except Exception:
            b.op_trans(op.name, None, k)  # the dimension does not split in k at this size
        b.op_assign(op.name, rng.sample(range(n), k))
    return b.build()


def draw_plan(seed: int, index: int) -> tuple[str, object, int, list[str]]:
    """``(description, plan, devices, refusals)`` of plan ``index``: the first of its draws
    (seeded ``SEED:INDEX:ATTEMPT``) that applies to its model and that planlab takes; a draw that
    does not is a refusal (its reason is kept). The plan is None when every draw is refused."""
    from planlab.errors import PlanlabError
    from planlab.plan import materialize

    refused = []
    for attempt in range(ATTEMPTS):
        what, plan, n = _draw(random.Random(f"{seed}:{index}:{attempt}"))
        if plan is None:
            refused.append(f"{what}: {n}")
            continue
        try:
            materialize(plan, _context(plan.model, n)[1])  # a split the model cannot take: refused before running
        except PlanlabError as e:
            refused.append(f"{what}: {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        return what, plan, n, refused
    return "", None, 0, refused


@functools.lru_cache(maxsize=None)
def _context(spec, n: int):
    """The explore context (and traced graph) of a model on ``n`` CPU devices, traced once."""
    from planlab.explore import Setup, make_context

    ctx, _, graph = make_context(Setup(spec, "cpu", n, GLOBAL_BATCH))
    return ctx, graph


@functools.lru_cache(maxsize=None)
def _assignments(space: str, spec, n: int) -> list:
    """Every assignment of ``space`` for a model on ``n`` CPU devices, enumerated once (up to 2 s of
    CPU for megatron*coshard on T5)."""
    from planlab.search_spaces import get_space

    return get_space(space).enumerate(_context(spec, n)[0])


def _draw(rng: random.Random):
    """One draw: ``(description, plan, devices)``, or ``(description, None, reason)``."""
    from planlab.errors import PlanlabError
    from planlab.models import ModelSpec
    from planlab.search_spaces import get_space

    name, args = rng.choice(MODELS)
    space = rng.choice(SPACES)
    n = rng.choice([2, 2, 4])
    spec = ModelSpec(name, args)
    what = f"{spec} on {n}, {space}"
    try:
        ctx, graph = _context(spec, n)
        if space == "primitives":
            return what, random_primitives(rng, graph, spec, n), n
        knobs = rng.choice(_assignments(space, spec, n))
        return f"{what} {knobs}", get_space(space).build(ctx, knobs), n
    except PlanlabError as e:
        return what, None, f"{type(e).__name__}: {str(e).splitlines()[0]}"


def _cpu_s(pools: dict) -> float:
    """CPU seconds of this process, its ended children (the ranks and their launcher's processes) and
    the pools' running ranks."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + sum(p.cpu_s() for p in pools.values())


def run_plan(plan, n: int, pools: dict | None):
    """Run ``plan`` on ``n`` ranks for 2 steps with the numeric check: on ``pools[n]`` (a
    :class:`~planlab.executor.pool.RankPool`, started at its first plan), or with ``pools`` None on
    ranks started for it by ``launch_local``."""
    from planlab.executor import RunConfig, launch_local
    from planlab.executor.pool import RankPool

    if pools is None:
        return launch_local(plan, n, steps=2, lr=1e-2, timeout_s=120)
    pool = pools.setdefault(n, RankPool(n))
    return pool.run(plan, RunConfig(steps=2, lr=1e-2, timeout_s=120))


def run_one(seed: int, index: int, pools: dict | None = None) -> dict:
    """Draw plan ``index`` and run it; the result as a dict (one line of --out), with where its time
    went: ``draw_s`` (tracing its model, the first time, the space's plans, materialize's checks),
    ``launch_s`` (launch_local: the ranks' processes, imports, tracing and materializing, the steps,
    rank 0's single-process reference), ``steps_s`` (the ranks' 2 steps, the slowest rank's),
    ``seconds`` (wall, all of it) and ``cpu_s`` (CPU seconds of this process and the ranks).
    ``pools``: see :func:`run_plan`."""
    t0, c0 = time.perf_counter(), _cpu_s(pools or {})
    what, plan, n, refused = draw_plan(seed, index)
    t1 = time.perf_counter()
    row = dict(index=index, plan=what, refused=refused, draw_s=t1 - t0)

    def timed(**fields) -> dict:
        t2 = time.perf_counter()
        return dict(
            row,
            **fields,
            launch_s=t2 - t1 if plan is not None else 0.0,
            seconds=t2 - t0,
            cpu_s=_cpu_s(pools or {}) - c0,
        )

    if plan is None:
        return timed(result="ERROR", reason=f"no draw of {ATTEMPTS} applies")
    row["describe"] = plan.describe()
    try:
        res = run_plan(plan, n, pools)
    except Exception as e:  # the run failed: a finding (unless it was stopped: Ctrl-C ends the fuzzer)
        if type(e).__name__ == "SignalException" or "got signal" in str(e):
            raise KeyboardInterrupt from e
        tb = traceback.format_exception_only(type(e), e)[-1].strip()
        return timed(result="ERROR", reason=tb[:400])
    ok = res.max_loss_error <= LOSS_TOL and res.max_grad_error <= GRAD_TOL
    return timed(
        result="ok" if ok else "MISMATCH",
        loss_error=res.max_loss_error,
        grad_error=res.max_grad_error,
        steps_s=sum(res.iter_times_s),
    )


def summary(rows: list[dict]) -> str:
    """Where the plans' time went: wall seconds (total, median and largest a plan) split into
    drawing, the launch and its steps, and CPU seconds."""
    if not rows:
        return "no plan ran"
    total = {k: sum(r.get(k, 0.0) for r in rows) for k in ("seconds", "draw_s", "launch_s", "steps_s", "cpu_s")}
    wall = total["seconds"] or 1.0
    return (
        f"time: {total['seconds']:.0f} s wall (median {statistics.median(r['seconds'] for r in rows):.0f} s a plan, "
        f"largest {max(r['seconds'] for r in rows):.0f} s): drawing {total['draw_s']:.0f} s "
        f"({100 * total['draw_s'] / wall:.0f}%), launches {total['launch_s']:.0f} s "
        f"({100 * total['launch_s'] / wall:.0f}%) of which the ranks' steps {total['steps_s']:.0f} s "
        f"({100 * total['steps_s'] / wall:.0f}%); {total['cpu_s']:.0f} s CPU ({total['cpu_s'] / len(rows):.1f} s a plan)"
    )


def report(row: dict, seed: int, out: str | None) -> None:
    """Print plan ``row``'s line (and append it to ``out``, a JSON-lines file)."""
    extra = (
        f"loss {row['loss_error']:.1e} grad {row['grad_error']:.1e}" if "loss_error" in row else row.get("reason", "")
    )
    took = f"{row['seconds']:.0f} s: draw {row['draw_s']:.1f}, launch {row['launch_s']:.1f}"
    took += f" (steps {row['steps_s']:.1f})" if "steps_s" in row else ""
    print(f"{row['index']:4d} {row['result']:8s} {row['plan']}: {extra} [{took}; {row['cpu_s']:.1f} s CPU]", flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(dict(row, seed=seed)) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", type=int, default=20, help="plans to draw and run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first", type=int, default=0, help="index of the first plan (to run a range in chunks)")
    ap.add_argument("--out", default=None, metavar="FILE.jsonl", help="append one JSON line per plan")
    ap.add_argument("--launch", action="store_true", help="start each plan's ranks for it (launch_local), not a pool")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    t0 = time.perf_counter()
    rows: list[dict] = []
    pools: dict | None = None if args.launch else {}
    try:
        for i in range(args.first, args.first + args.plans):
            rows.append(run_one(args.seed, i, pools))
            report(rows[-1], args.seed, args.out)
    finally:
        for pool in (pools or {}).values():
            pool.close()
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["result"]] = counts.get(row["result"], 0) + 1
    findings = [row for row in rows if row["result"] in ("MISMATCH", "ERROR")]
    load = os.getloadavg()
    print(
        f"\n{args.plans} plans (seed {args.seed}, from {args.first}): "
        + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        + f" ({sum(len(r['refused']) for r in rows)} draws refused and drawn again); "
        + f"{time.perf_counter() - t0:.0f} s, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
        + ("" if pools is None else f"; ranks started {sum(p.starts for p in pools.values())} times")
    )
    print(summary(rows))
    for row in findings:
        print(f"  {row['result']} #{row['index']} {row['plan']} ({row.get('describe', '')}): {row.get('reason', '')}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
