"""Random plans on 2 to 4 gloo ranks against one process: finds whole classes of errors.

Each plan is drawn from its own seed (``SEED:INDEX``), so any plan can be drawn again alone with
``--first INDEX --plans 1``: a small model (planlab's GPT with dropout, LLaMA, T5 with dropout, MoE,
Swin, the Evoformer, and Hugging Face GPT-2, Swin, T5, ViT and LLaMA in their default
configurations, dropout and stochastic depth on; the Evoformer also with 3 recycling passes), a device count (2 or 4), and either a random
assignment of a random built-in space (dp, tp, pp, recompute, megatron, coshard, interlaced, alpa,
3f1b, megatron*coshard) or random primitives (each operator kept whole on one device, replicated,
or split along a random splittable dimension, its pieces on a random order of the devices; 1 or 2
micro-batches). The plan runs 2 steps with ``planlab.executor.launch_local`` (what ``planlab run``
calls) and the numeric check; each line prints the result: ``ok``, ``MISMATCH`` (loss or gradient
error above planlab run's tolerances) or ``ERROR`` (the run failed). A draw whose space does not
apply to its model, or that planlab refuses before running it (a split the model cannot take),
is drawn again (up to 30 times); the refusals are counted and kept with their reasons.

Run: .venv/bin/python benchmarks/fuzz_plans.py --plans 500 --seed 0
(about 10 to 30 s a plan on two cores; ``--out FILE.jsonl`` keeps a line per plan.)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
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
        sp = get_space(space)
        assignments = sp.enumerate(ctx)
        knobs = rng.choice(assignments)
        return f"{what} {knobs}", sp.build(ctx, knobs), n
    except PlanlabError as e:
        return what, None, f"{type(e).__name__}: {str(e).splitlines()[0]}"


def run_one(seed: int, index: int) -> dict:
    """Draw plan ``index`` and run it; the result as a dict (one line of --out)."""
    from planlab.executor import launch_local

    t0 = time.perf_counter()
    what, plan, n, refused = draw_plan(seed, index)
    row = dict(index=index, plan=what, refused=refused)
    if plan is None:
        return dict(row, result="ERROR", reason=f"no draw of {ATTEMPTS} applies", seconds=time.perf_counter() - t0)
    row["describe"] = plan.describe()
    try:
        res = launch_local(plan, n, steps=2, lr=1e-2, timeout_s=120)
    except Exception as e:  # the run failed: a finding (unless it was stopped: Ctrl-C ends the fuzzer)
        if type(e).__name__ == "SignalException" or "got signal" in str(e):
            raise KeyboardInterrupt from e
        tb = traceback.format_exception_only(type(e), e)[-1].strip()
        return dict(row, result="ERROR", reason=tb[:400], seconds=time.perf_counter() - t0)
    ok = res.max_loss_error <= LOSS_TOL and res.max_grad_error <= GRAD_TOL
    return dict(
        row,
        result="ok" if ok else "MISMATCH",
        loss_error=res.max_loss_error,
        grad_error=res.max_grad_error,
        seconds=time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", type=int, default=20, help="plans to draw and run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first", type=int, default=0, help="index of the first plan (to run a range in chunks)")
    ap.add_argument("--out", default=None, metavar="FILE.jsonl", help="append one JSON line per plan")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    counts: dict[str, int] = {}
    refusals = 0
    t0 = time.perf_counter()
    findings = []
    for i in range(args.first, args.first + args.plans):
        row = run_one(args.seed, i)
        counts[row["result"]] = counts.get(row["result"], 0) + 1
        refusals += len(row["refused"])
        extra = (
            f"loss {row['loss_error']:.1e} grad {row['grad_error']:.1e}"
            if "loss_error" in row
            else row.get("reason", "")
        )
        print(f"{i:4d} {row['result']:8s} {row['plan']}: {extra}", flush=True)
        if row["result"] in ("MISMATCH", "ERROR"):
            findings.append(row)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(dict(row, seed=args.seed)) + "\n")
    load = os.getloadavg()
    print(
        f"\n{args.plans} plans (seed {args.seed}, from {args.first}): "
        + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        + f" ({refusals} draws refused and drawn again); {time.perf_counter() - t0:.0f} s, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
    for row in findings:
        print(f"  {row['result']} #{row['index']} {row['plan']} ({row.get('describe', '')}): {row.get('reason', '')}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
