"""Programs, simulated times and peaks unchanged by a change to materialize or the simulator.

``--save DIR`` records, for every golden case (``tests/golden_predictions.py``; its reduced and its full
Program) and the four plans of ``benchmarks/sim_scale.py`` on 1,024 A100 (175B, interlaced, alpa, 3f1b;
their reduced Programs), the Program (pickled), the simulated iteration time and every class's peak memory;
``--check DIR`` builds them again and compares: Programs equal (``==``), times and peaks exactly equal.
Run the first on the commit before a change, the second after it:

    .venv/bin/python benchmarks/same_programs.py --save /tmp/before
    .venv/bin/python benchmarks/same_programs.py --check /tmp/before
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCALE = ("gpt3-175b on 1024", "interlaced gpt-43b", "alpa pp 2", "3f1b alphafold2")


def _golden():
    """(name, reduced, full, graph, cost) of every golden case."""
    sys.path[:0] = [str(ROOT / "tests")]
    from golden_predictions import CASES, programs_of

    for case in CASES:
        reduced, full, graph, cost = programs_of(case)
        yield case.name, reduced, full, graph, cost


def _scale():
    """(name, reduced, None, graph, cost) of sim_scale's four 1,024-device plans."""
    sys.path[:0] = [str(ROOT / "benchmarks")]
    from sim_scale import CASES

    from planlab.explore import Setup, make_context
    from planlab.models import ModelSpec
    from planlab.plan.software_passes import build_program
    from planlab.search_spaces import get_space

    for name, c in CASES.items():
        if not any(name.startswith(s) for s in SCALE):
            continue
        model, args = c["model"]
        setup = Setup(
            ModelSpec(model, tuple(sorted(args.items()))), c.get("cluster", "dgx-a100-80g"), c["nodes"], c["batch"]
        )
        ctx, cost, graph = make_context(setup)
        plan = get_space(c.get("space", "megatron")).build(ctx, c["knobs"])
        t0 = time.process_time()
        program = build_program(plan, graph, cost, symmetric=True)
        print(f"  {name}: build_program {time.process_time() - t0:.2f} s CPU", flush=True)
        yield name, program, None, graph, cost


def _record(reduced, full, graph, cost) -> dict:
    from planlab.plan.shared_params import training_flops
    from planlab.simulator import simulate

    res = simulate(reduced, cost, model_flops=training_flops(graph))
    return dict(
        reduced=reduced,
        full=full,
        iter_time_s=res.iter_time_s,
        peaks={d.device: (d.peak_mem_bytes, d.peak_at_s, d.finish_s) for d in res.devices},
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--save", type=Path, metavar="DIR", help="record the Programs and predictions in DIR")
    group.add_argument("--check", type=Path, metavar="DIR", help="compare with those recorded in DIR")
    ap.add_argument("--skip-scale", action="store_true", help="the golden cases only")
    args = ap.parse_args()
    folder = args.save or args.check
    folder.mkdir(parents=True, exist_ok=True)
    cases = list(_golden()) if args.skip_scale else [*_golden(), *_scale()]
    bad = 0
    for i, (name, reduced, full, graph, cost) in enumerate(cases):
        got = _record(reduced, full, graph, cost)
        path = folder / f"{i:03d}.pickle"
        if args.save:
            path.write_bytes(pickle.dumps((name, got)))
            continue
        want_name, want = pickle.loads(path.read_bytes())
        diffs = [k for k in got if got[k] != want[k]] if want_name == name else ["name"]
        bad += bool(diffs)
        print(f"{'DIFFERS' if diffs else 'same'}: {name} {', '.join(diffs)}", flush=True)
    print(f"{len(cases)} cases {'recorded in ' + str(folder) if args.save else f'compared, {bad} differ'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
