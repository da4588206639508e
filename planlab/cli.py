"""The ``planlab`` command."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from pathlib import Path

from planlab.errors import DeadlockError, PlanlabError
from planlab.inputs import MAX_GLOBAL_BATCH, count, writable_file, writable_folder

DEFAULT_CANDIDATES = 16  # planlab.explore.DEFAULT_CANDIDATES, without importing it for --help
LOSS_TOL = 1e-4  # absolute, on losses of order 1 (fp32)
GRAD_TOL = 1e-4  # absolute, largest element of any gradient shard


def _kv(text: str) -> tuple[str, int | float | str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    k, v = text.split("=", 1)
    for conv in (int, float):
        try:
            return k.strip(), conv(v)
        except ValueError:
            pass
    return k.strip(), v


def _model(args):
    from planlab.models import ModelSpec

    return ModelSpec(args.model, tuple(sorted(dict(args.model_arg or []).items())))


def cmd_explore(args) -> int:
    from planlab.explore import RESULT_COLUMNS, SCREEN_COLUMNS, explore

    count(args.top, "--top")

    df = explore(
        _model(args),
        cluster=args.cluster,
        nodes=args.nodes,
        space=args.space,
        fixed=dict(args.set or []),
        global_batch=args.global_batch,
        jobs=args.jobs,
        out=args.out,
        progress=True,  # bars on a terminal, a line every few seconds otherwise (planlab.progress)
        profile=args.profile,
        budget=args.budget,
        candidates=None if args.all else args.candidates,
        ray=False if args.ray is None else args.ray,
        resume=args.resume,
        software=args.software,
        precision=args.precision,
    )
    knobs = [c for c in df.columns if c not in RESULT_COLUMNS + ["pareto"]]
    fixed = [k for k in knobs if df[k].nunique(dropna=False) == 1]
    cols = [c for c in df.columns if c not in fixed and c not in ("reason", "simulated", "screen_rank")] + ["reason"]
    show = df[cols].head(args.top).copy()
    for c, f in (
        ("screen_time_s", "{:.4g}"),
        ("screen_mem_gib", "{:.2f}"),
        ("iter_time_s", "{:.4g}"),
        ("peak_mem_gib", "{:.2f}"),
        ("tflops_per_gpu", "{:.3g}"),
    ):
        show[c] = show[c].map(lambda v, f=f: f.format(v) if v == v else "-")
    show["mfu"] = show["mfu"].map(lambda v: f"{v:.1%}" if v == v else "-")
    show["reason"] = show["reason"].fillna("").map(lambda s: (s[:60] + "...") if len(s) > 63 else s)
    show = show.rename(columns={c: c.replace("screen_", "~") for c in SCREEN_COLUMNS})
    import pandas as pd

    with pd.option_context("display.width", 220, "display.max_columns", 24):
        print(show.to_string(index=False))
    print(df.attrs["software"])
    _print_best_layout(df)
    c, ph = df.attrs["counts"], df.attrs["phases"]
    same = ", ".join(f"{k}={df[k].iloc[0]}" for k in fixed)
    print(
        f"\n{c['plans']} plans: {c['screened']} screened, {c['pruned']} pruned by the memory bound, "
        f"{c['simulated']} of {c['candidates']} candidates simulated, {c['feasible']} feasible."
        + (f" Every plan has {same}." if same else "")
    )
    rho = df.attrs.get("screen_rank_corr")
    print(
        f"time: trace {ph['trace_s']:.1f} s, enumerate {ph['enumerate_s']:.1f} s, screen {ph['screen_s']:.1f} s, "
        f"simulate {ph['simulate_s']:.1f} s, total {ph['total_s']:.1f} s"
        + (f"; screen vs simulation rank correlation {rho:.2f}" if rho == rho else "")
    )
    if c["simulated"] == 0:
        print("No plan was simulated (see --budget); the screen's estimates are in the ~ columns.")
    elif df.attrs.get("best_plan") is None:
        print("No simulated plan fits in device memory; see the reason column.")
    if args.out:
        out = Path(args.out)
        files = ["results.csv", "simulations.jsonl", "pareto.png"] + (
            ["best_plan.json", "timeline.png", "memory.png"] if df.attrs.get("best_plan") is not None else []
        )
        print("wrote " + ", ".join(str(out / f) for f in files))
    return 0


def _print_best_layout(df) -> None:
    """The best plan's per-stage layout (the fine space's), when it has one."""
    if len(df) and "stage_layers" in df and df.loc[0, "feasible"] and isinstance(df.loc[0, "stage_layers"], tuple):
        r = df.loc[0]
        print(
            f"best plan's stages: layers {r['stage_layers']}, fully recomputed {r['stage_recompute']}, "
            f"optimizer offloaded per device group {r['stage_offload']}"
        )


def _check_outputs(*, save=None, trace=None, predicted_trace=None, plot=None) -> None:
    """Before any work: every file and folder a command will write can be written."""
    if save is not None:
        writable_folder(save, "--save")
    if plot is not None:
        writable_folder(plot, "--plot")
    for value, what in ((trace, "--trace"), (predicted_trace, "--predicted-trace")):
        if value is not None:
            writable_file(value, what)


def plan_cost(plan, *, profile: str | None = None, software: str | None = None, precision: str | None = None):
    """The cost model of a plan file: its cluster, with the software and precision given, else the
    plan's own (files written before they were recorded take the cluster's defaults)."""
    from planlab.costmodel import CostModel

    return CostModel.load(
        plan.cluster,
        plan.nodes,
        profile=profile,
        software=software or plan.software or None,
        precision=precision or plan.precision or None,
    )


def _simulate_plan(plan, cost, *, timeline: bool = False, stragglers: dict | None = None, plan_text=None):
    """Simulate ``plan`` (read from a file of ``plan_text``): its Program comes from the program
    cache after the first time (:mod:`planlab.plan.program_cache`), unless stragglers need every
    device's tasks."""
    from planlab.models.trace_cache import trace_model
    from planlab.plan.program_cache import cached_program
    from planlab.plan.shared_params import training_flops
    from planlab.plan.software_passes import build_program
    from planlab.simulator import find_deadlock, simulate

    graph = trace_model(plan.model, plan.global_batch)  # from the trace cache after the first time
    # one representative per device class, unless a straggler needs every device's tasks
    if stragglers:
        program = build_program(plan, graph, cost, symmetric=False)
    else:
        program = cached_program(plan, graph, cost, plan_text=plan_text)
    try:
        return simulate(program, cost, model_flops=training_flops(graph), timeline=timeline, stragglers=stragglers)
    except DeadlockError:
        full = build_program(plan, graph, cost, symmetric=False) if program.reduced else program
        if full.num_tasks() < 200_000:
            find_deadlock(full)  # the report names the device, its task and the peer it waits for
        raise


def cmd_simulate(args) -> int:
    from planlab.plan import load_plan

    _check_outputs(trace=args.trace, plot=args.plot)
    plan = load_plan(args.plan)
    stragglers = {}
    for k, v in args.straggler or []:
        if not k.isdigit() or int(k) >= plan.num_devices or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            from planlab.errors import ConfigError

            raise ConfigError(
                f"--straggler {k}={v}: expected DEVICE=FACTOR with a device 0..{plan.num_devices - 1} of the plan "
                "and a factor above 0, e.g. 1=1.5"
            )
        stragglers[int(k)] = float(v)
    cost = plan_cost(plan, profile=args.profile, software=args.software, precision=args.precision)
    text = Path(args.plan).read_text(encoding="utf-8")  # read whole by load_plan already: it keys the program cache
    res = _simulate_plan(plan, cost, timeline=bool(args.trace or args.plot), stragglers=stragglers, plan_text=text)
    if args.trace:
        res.write_trace(args.trace)
    if args.plot:
        from planlab.drawing import drawing_of
        from planlab.plotting import memory_plot, timeline_plot

        out = Path(args.plot)
        out.mkdir(parents=True, exist_ok=True)
        drawing = drawing_of(res)  # the timeline's events reduced to pixels once, for both plots
        timeline_plot(drawing, out / "timeline.png", title=plan.describe())
        memory_plot(drawing, out / "memory.png", title=plan.describe())
    if args.json:
        print(
            json.dumps(
                {
                    "iter_time_s": res.iter_time_s,
                    "peak_mem_gib": res.peak_mem_bytes / 2**30,
                    "tflops_per_gpu": res.tflops_per_gpu,
                    "mfu": res.mfu,
                    "hfu": res.hfu,
                    "feasible": res.feasible,
                    "reason": res.reason,
                    "software": cost.software.name,
                    "precision": cost.precision.name,
                }
            )
        )
    else:
        print(cost.describe_software())
        print(f"{plan.describe()}: {res.summary()}")
        print(_device_table_text(res))
    return 0


def _device_table_text(res) -> str:
    """``SimResult.device_table()`` as aligned text, without importing pandas for it."""
    rows = [dict(d.__dict__, idle_s=d.idle_s) for d in res.devices]
    cols = list(rows[0]) if rows else []
    cells = [cols] + [[f"{r[c]:.6g}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(row[k]) for row in cells) for k in range(len(cols))]
    return "\n".join(" ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


def _run_config(args):
    from planlab.errors import ConfigError
    from planlab.executor.run import RunConfig

    if args.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {args.steps}")
    warmup = args.warmup if args.warmup is not None else min(1, args.steps - 1)
    if not 0 <= warmup < args.steps:
        raise ConfigError(f"--warmup must be at least 0 and less than --steps {args.steps}, got {warmup}")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if args.clip_grad_norm is not None and not 0 < args.clip_grad_norm < float("inf"):
        raise ConfigError(f"--clip-grad-norm must be a positive number, got {args.clip_grad_norm:g}")
    return RunConfig(
        steps=args.steps,
        warmup=warmup,
        lr=args.lr,
        check=not args.no_check and not args.load,
        seed=args.seed,
        record=True,
        timeout_s=args.timeout,
        save_dir=args.save,
        load_dir=args.load,
        data=args.data,
        clip_grad_norm=args.clip_grad_norm,
        log=True,
    )


def cmd_run(args) -> int:
    from planlab.errors import ConfigError
    from planlab.executor.launch_env import detect
    from planlab.plan import load_plan

    _check_outputs(save=args.save, trace=args.trace, predicted_trace=args.predicted_trace)
    if args.nproc is not None:
        count(args.nproc, "--nproc")

    env = None if args.nproc is not None else detect()
    try:  # started by torchrun or srun: this process is one rank
        plan = load_plan(args.plan)
        cfg = _run_config(args)
        if env is not None:
            from planlab.executor.as_rank import run_as_rank

            return run_as_rank(
                plan,
                cfg,
                env,
                loss_tol=LOSS_TOL,
                grad_tol=GRAD_TOL,
                allow_device_mismatch=args.allow_device_mismatch,
                profile=args.profile,
                trace=args.trace,
                predicted_trace=args.predicted_trace,
            )
    except PlanlabError:
        if env is not None and env.local_rank != 0:
            return 2  # a refusal is printed once per node, by its first rank
        raise
    if args.nproc is None:
        raise ConfigError(
            "give --nproc N to run the plan on N local processes, or start `planlab run` under "
            "torchrun or srun (then every process is one rank)"
        )
    if args.nproc != plan.num_devices:
        raise ConfigError(f"--nproc {args.nproc} differs from the plan's device count {plan.num_devices}")
    cfg.validate()
    from planlab.executor import launch_local
    from planlab.executor.report import run_report
    from planlab.executor.timeline import measured_events, predict, write_trace

    cost = plan_cost(plan, profile=args.profile, software=args.software, precision=args.precision)
    pred = predict(plan, cost=cost)  # every device simulated, with a timeline to compare against
    options = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "device"}  # launch_local picks the device
    res = launch_local(plan, args.nproc, **options, allow_device_mismatch=args.allow_device_mismatch)
    text, ok = run_report(plan, res, pred, cfg, loss_tol=LOSS_TOL, grad_tol=GRAD_TOL)
    print(f"predicted with {cost.describe_software()}")
    print(text)
    if args.trace:
        write_trace(args.trace, measured_events(res.timeline))
        print(f"wrote the measured trace of the last step to {args.trace}")
    if args.predicted_trace:
        pred.sim.write_trace(args.predicted_trace)
        print(f"wrote the simulated trace (every device) to {args.predicted_trace}")
    return 0 if ok else 1


def _preset_sizes(fam, cfg) -> str:
    """A preset's sizes as KEY=VALUE (the --model-arg form): the family's required fields, then
    any other field that differs from its default."""
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(cfg)}
    names = [n for n in fam.required if n in fields] + [
        n
        for n, f in fields.items()
        if n not in fam.required and f.default is not dataclasses.MISSING and getattr(cfg, n) != f.default
    ]

    def fmt(v) -> str:
        return ",".join(map(str, v)) if isinstance(v, (tuple, list)) else f"{v:g}" if isinstance(v, float) else str(v)

    return " ".join(f"{n}={fmt(getattr(cfg, n))}" for n in names)


def cmd_calibrate(args) -> int:
    from planlab.costmodel.calibrate import calibrate

    count(args.nproc, "--nproc", minimum=2)
    writable_file(args.out, "--out")

    prof = calibrate(
        out=args.out, nproc=args.nproc, quick=args.quick, cluster=args.cluster, log=lambda line: print(line, flush=True)
    )
    print(f"wrote {args.out}: {prof}; use it with --profile {args.out} on explore, simulate and run")
    return 0


def cmd_models(args) -> int:
    from planlab.models import FAMILIES

    width = max(len(name) for fam in FAMILIES.values() for name in fam.presets)
    for fam in FAMILIES.values():
        for name, cfg in fam.presets.items():
            print(f"{name:{width}s} {cfg.num_params() / 1e6:12,.1f}M params  {_preset_sizes(fam, cfg)}")
    for fam in FAMILIES.values():
        print(
            f"family: {fam.name} (use --model {fam.name} --model-arg " + " ".join(f"{k}=.." for k in fam.required) + ")"
        )
    print(
        "your own: --model package.module:function (returns the module and example inputs; "
        "--model-arg KEY=VALUE become keyword arguments)"
    )
    return 0


def cmd_clusters(args) -> int:
    from planlab.costmodel import CostModel, list_clusters, list_software

    for name in list_clusters():
        cost = CostModel.load(name)
        print(f"{name:18s} {cost.cluster}; default software {cost.software.name} ({cost.precision.name})")
    print(f"software (--software): {', '.join(list_software())}, or a software file")
    return 0


def cmd_spaces(args) -> int:
    from planlab.search_spaces import list_spaces

    ctx = None
    if args.model:
        from planlab.errors import ConfigError
        from planlab.explore import Setup, make_context

        if not args.cluster:
            raise ConfigError("planlab spaces --model needs --cluster too (the values of the knobs depend on both)")
        batch = args.global_batch or 8
        ctx = make_context(Setup(_model(args), args.cluster, args.nodes, batch))[0]
    spaces = list_spaces() if not args.space else [_space(args.space)]
    for sp in spaces:
        doc = " ".join((sp.__doc__ or "").replace("``", "").split()).split(". ")[0].rstrip(".")
        print(f"{sp.name}: {doc}" if doc else sp.name)
        for k in sp.all_knobs():
            default = "" if k.default is None else f"  default {k.default}" + (" (pinned)" if k.pinned else "")
            explored = f"  explores {k.describe_explore(ctx)}" if k.explore is not None else ""
            print(f"    {k.name:18s} {k.kind_of():6s} {k.describe_range(ctx)}{default}{explored}  -- {k.doc}")
        rules = sp.all_rules()
        if rules:
            print("    rules: " + "; ".join(map(str, rules)))
    return 0


def _space(spec: str):
    from planlab.search_spaces import get_space

    return get_space(spec)


def cmd_graph(args) -> int:
    from planlab.graph import trace
    from planlab.models import build_model

    count(args.global_batch, "--global-batch", maximum=MAX_GLOBAL_BATCH)
    model, inputs = build_model(_model(args), batch=args.global_batch)
    g = trace(model, inputs)
    print(g.summary())
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are one line (the option and the bad value) and status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def software_args(sp, default: str) -> None:
    """``--software`` and ``--precision`` on a subcommand."""
    sp.add_argument(
        "--software",
        default=None,
        metavar="NAME|FILE.json",
        help=f"the training software: megatron, deepspeed, torch, planlab or a software file (default: {default})",
    )
    sp.add_argument(
        "--precision",
        default=None,
        choices=("bf16", "fp16", "fp8", "fp32"),
        help="the software's precision (default: the plan's, else the device's: fp16 on V100, bf16 on other GPUs)",
    )


def build_parser() -> argparse.ArgumentParser:
    """planlab's argument parser: one subcommand each (explore, run, simulate, calibrate, models,
    clusters, spaces, graph)."""
    p = _Parser(prog="planlab", description="Find and run parallelization plans for training.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    _add_explore(sub)
    _add_run(sub)
    s = sub.add_parser("simulate", help="simulate one plan")
    s.add_argument("plan")
    s.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace")
    s.add_argument("--json", action="store_true")
    s.add_argument("--plot", default=None, metavar="DIR", help="write timeline.png and memory.png there")
    s.add_argument(
        "--straggler",
        action="append",
        type=_kv,
        metavar="DEVICE=FACTOR",
        help="slow one device's computation by FACTOR (what-if)",
    )
    s.add_argument("--profile", default=None, metavar="PROFILE.json", help="price with a calibration profile")
    software_args(s, "the plan's")
    s.set_defaults(fn=cmd_simulate)

    c = sub.add_parser("calibrate", help="measure this machine's kernels, executor and collectives into a profile")
    c.add_argument("--out", default="profile.json", metavar="PROFILE.json", help="where to write the profile")
    c.add_argument("--nproc", type=int, default=2, help="processes for the collective benchmark (>= 2)")
    c.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (under a minute)")
    c.add_argument("--cluster", default="cpu", help="the cluster whose device this machine is (default cpu)")
    c.set_defaults(fn=cmd_calibrate)

    sub.add_parser("models", help="list built-in models").set_defaults(fn=cmd_models)
    sub.add_parser("clusters", help="list built-in clusters").set_defaults(fn=cmd_clusters)
    sp = sub.add_parser("spaces", help="list the spaces, their knobs with types and ranges, and their rules")
    sp.add_argument("space", nargs="?", default=None, help="one space (any --space form) instead of all")
    _model_args(sp, required=False)
    sp.add_argument("--cluster", default=None, help="with --model: print the knobs' values for this cluster")
    sp.add_argument("--nodes", type=int, default=1)
    sp.add_argument("--global-batch", type=int, default=None)
    sp.set_defaults(fn=cmd_spaces)
    g = sub.add_parser("graph", help="trace a model and summarise its graph")
    _model_args(g)
    g.add_argument("--global-batch", type=int, default=1)
    g.set_defaults(fn=cmd_graph)
    return p


def _model_args(sp, required=True) -> None:
    sp.add_argument("--model", required=required, help="a preset (planlab models) or a family")
    sp.add_argument("--model-arg", action="append", type=_kv, metavar="KEY=VALUE", help="override a size")


def _add_explore(sub) -> None:
    e = sub.add_parser("explore", help="evaluate every plan of a space and rank them")
    _model_args(e)
    e.add_argument("--cluster", required=True, help="a built-in cluster (planlab clusters) or a spec file")
    e.add_argument("--nodes", type=int, default=1)
    e.add_argument(
        "--space",
        default="megatron",
        help="a registered space (planlab spaces), a product a*b, a union a|b, or package.module:space",
    )
    e.add_argument("--set", action="append", type=_kv, metavar="KNOB=VALUE", help="fix a knob")
    e.add_argument("--global-batch", type=int, default=None)
    e.add_argument("--out", default=None, help="folder for results.csv, pareto.png and best_plan.json")
    e.add_argument("--jobs", type=int, default=1, help="plans evaluated in parallel")
    e.add_argument("--top", type=int, default=10, help="rows printed")
    e.add_argument("--profile", default=None, metavar="PROFILE.json", help="price with a calibration profile")
    e.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop simulating after SECONDS from the start and return the best found so far",
    )
    e.add_argument(
        "--candidates",
        type=int,
        default=DEFAULT_CANDIDATES,
        metavar="K",
        help=f"simulate the K fastest plans by the screen and up to K along its Pareto front "
        f"(default {DEFAULT_CANDIDATES})",
    )
    e.add_argument("--all", action="store_true", help="simulate every plan the memory bound leaves")
    e.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="simulate the candidates as Ray tasks on the cluster at ADDRESS (alone: a local Ray instance); "
        "needs pip install 'planlab[ray]'",
    )
    e.add_argument(
        "--resume",
        action="store_true",
        help="continue the exploration interrupted in --out: rows in its simulations.jsonl are not simulated again",
    )
    software_args(e, "the cluster's: planlab on cpu, megatron on GPUs")
    e.set_defaults(fn=cmd_explore)


def _add_run(sub) -> None:
    r = sub.add_parser(
        "run", help="run a plan (local processes, or one rank under torchrun or srun) and check it against one process"
    )
    r.add_argument("plan")
    r.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="start this many local processes; without it, under torchrun or srun, this process is one rank",
    )
    r.add_argument("--steps", type=int, default=3)
    r.add_argument(
        "--warmup",
        type=int,
        default=None,
        metavar="N",
        help="first steps left out of the timing (default 1, 0 with one step)",
    )
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--seed", type=int, default=0, help="the seed the weights are drawn from")
    r.add_argument(
        "--data",
        default=None,
        metavar="FILE.pt|package.module:function",
        help="batches to train on (default: the model's synthetic example inputs); see README",
    )
    r.add_argument(
        "--clip-grad-norm",
        type=float,
        default=None,
        metavar="MAX",
        help="clip the global gradient norm (across every rank's shards) to MAX",
    )
    r.add_argument(
        "--allow-device-mismatch",
        action="store_true",
        help="run a GPU cluster's plan on CPU processes (numerics only; times do not compare)",
    )
    r.add_argument("--no-check", action="store_true")
    r.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="write the measured Chrome/Perfetto trace of the last step (every rank)",
    )
    r.add_argument(
        "--predicted-trace",
        default=None,
        metavar="FILE",
        help="write the simulated trace of every device, to open beside --trace",
    )
    r.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="a collective or receive waiting longer fails the run (default 300)",
    )
    r.add_argument("--save", default=None, metavar="DIR", help="write a sharded checkpoint after the last step")
    r.add_argument(
        "--load",
        default=None,
        metavar="DIR",
        help="start from a checkpoint of the same model, written under any plan (no numeric check)",
    )
    r.add_argument("--profile", default=None, metavar="PROFILE.json", help="predict with a calibration profile")
    software_args(r, "the plan's")
    r.set_defaults(fn=cmd_run)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=".*TypedStorage.*")
    try:
        return args.fn(args)
    except PlanlabError as e:
        print(f"planlab: error: {str(e).splitlines()[0]}", file=sys.stderr)
        rest = str(e).splitlines()[1:]
        if rest and getattr(args, "cmd", "") in ("simulate", "run"):
            print("\n".join(rest), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("planlab: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # torch's launcher turns a signal into its SignalException after stopping the workers
        if type(e).__name__ != "SignalException":
            raise
        sig = getattr(e, "sigval", None)
        print(
            f"planlab: stopped by {getattr(sig, 'name', 'a signal')}; every worker process was stopped", file=sys.stderr
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
