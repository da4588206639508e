"""``planlab calibrate``: microbenchmarks on this machine, fitted into a :class:`Profile`.

What is measured, in this order (each step's fit feeds the next):

1. kernels, in this process with one thread per process as the executor runs (gloo): linear
   layers (matmuls) over shapes, causal attention, layer norm, GELU, add, embedding and cross
   entropy, forward and backward, in each dtype asked for. Their flop and byte counts come
   from tracing each operator with planlab's own tracer, so the table is keyed as the
   Program's tasks are. Each case cycles through copies of its data filling a core's L2 cache
   and cases are sampled round-robin. A roofline with efficiency curves is fitted per dtype;
   the per-kernel launch cost is the time of a one-element add.
2. the optimizer step (torch's Adam, as the executor steps it) over tensor counts and sizes:
   a fixed cost, a cost per tensor and one per parameter.
3. the executor's own cost per task: planlab's interpreter runs a small GPT on one device;
   its view tasks (no kernel) give the cost of a task beyond its kernel, and of a task with
   none; its optimizer step, the executor's own work per weight.
4. on ``nproc`` processes: how much slower a rank computes while the others compute too (they
   share this machine's caches, memory and, on a virtual machine, perhaps physical cores);
   then collectives (all-reduce, all-gather, reduce-scatter, broadcast, all-to-all) and
   point-to-point transfers over message sizes and group sizes 2..nproc, through
   torch.distributed on processes started by torch's elastic launcher (as ``planlab run``
   starts ranks), issued the way the executor issues them; ``alpha`` and bandwidth fitted per
   kind and group size.

Repeated measurements of kernels are summarised by their lower quartile (:func:`typical_s`): on
a machine shared with other work, some repetitions are slowed by preemption, and it ignores them.
Collectives and transfers, whose time between processes has a heavy tail of its own, by their
mean without the slowest 2% (:func:`expected_s`), with a little compute between repetitions. The
processes allocate as the executor's ranks do (``keep_freed_memory``: freed buffers stay in the
process, so recycled buffers cost no page faults).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import platform
import shutil
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from planlab.costmodel.fit import fit_alpha_beta, fit_linear, fit_roofline, robust_overhead
from planlab.costmodel.profile import CollectiveFit, KernelTime, OptimizerFit, Profile
from planlab.errors import ConfigError, ExecutionError
from planlab.executor.run import keep_freed_memory

MiB = 2**20
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------------------------- timing


QUANTILE = 0.25  # the statistic of repeated measurements: their lower quartile


def typical_s(times: list[float]) -> float:
    """The lower quartile of repeated measurements of one thing: on a machine shared with other
    work, slower repetitions were preempted; the lower quartile is the uninterrupted time
    without being the single luckiest run. Validation reports measured times the same way."""
    if not times:
        raise ConfigError("no measurements to summarise")
    xs = sorted(times)
    pos = QUANTILE * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


TRIM = 0.02  # the share of the slowest repetitions :func:`expected_s` leaves out


def expected_s(times: list[float]) -> float:
    """The mean of repeated measurements without their slowest 2%: what a collective or transfer
    costs an iteration on average. Unlike a kernel's, a collective's time has a heavy tail of its
    own: between processes on a few cores, a rank blocked in a collective is often woken a
    scheduler tick late (on this 2-core machine a gloo all-reduce of 256 KiB takes 0.4 ms at its
    lower quartile but 1.4 to 1.9 ms on average, one in four or five taking about 4 ms, with
    nothing else running), and an iteration pays every collective's mean, not its lower
    quartile. The trim drops only rare preemptions by other work."""
    if not times:
        raise ConfigError("no measurements to summarise")
    xs = sorted(times)
    keep = xs[: max(1, len(xs) - int(TRIM * len(xs)))]
    return statistics.fmean(keep)


def time_s(fn: Callable[[], object], *, min_time_s: float, min_reps: int = 5, max_reps: int = 200) -> float:
    """The typical seconds (see :func:`typical_s`) of ``fn()`` after one warm-up call, repeated
    until ``min_time_s`` has passed (at least ``min_reps``, at most ``max_reps`` times)."""
    fn()
    clock = time.perf_counter
    times: list[float] = []
    start = clock()
    while len(times) < max_reps and (len(times) < min_reps or clock() - start < min_time_s):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return typical_s(times)


# ---------------------------------------------------------------------------------- kernels


class _One(nn.Module):
    """One operator and a sum: the smallest module planlab's tracer takes (it wants a scalar)."""

    def __init__(self, fn: Callable, module: nn.Module | None = None) -> None:
        super().__init__()
        self.fn, self.m = fn, module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.m, x).sum()


class _Two(_One):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.fn(self.m, x, y).sum()


class _Three(_One):
    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.fn(self.m, x, y, z).sum()


# The kernel cases of a full calibration: linear layers' (in, out) widths, attention's
# (batch, heads, sequence, head width)
_LINEAR_KN = (
    (32, 64),
    (64, 32),
    (64, 64),
    (64, 128),
    (128, 64),
    (64, 256),
    (256, 64),
    (128, 128),
    (128, 256),
    (256, 128),
    (128, 512),
    (512, 128),
    (256, 256),
    (64, 512),
    (256, 512),
)
_ATTENTION_BHSD = (
    (4, 2, 16, 16),
    (8, 2, 32, 16),
    (8, 4, 32, 16),
    (4, 2, 64, 32),
    (8, 2, 64, 32),
    (8, 4, 64, 32),
    (8, 8, 64, 16),
    (4, 4, 128, 32),
    (8, 4, 128, 32),
    (2, 8, 256, 64),
)


def _cases(quick: bool) -> list[tuple[str, tuple[int, ...], Callable, Callable]]:
    """(kind, shape, make module, make inputs(dtype)) per kernel case. Sizes step by factors of 2
    (the profile's table interpolates within a factor of 2) over the small models this machine
    runs: 64 to 4,096 tokens per micro-batch, widths 32 to 512."""
    cases = []
    lin_m = (128, 512) if quick else (64, 128, 256, 512, 1024, 2048, 4096)
    lin_kn = ((64, 64), (64, 256), (256, 64), (128, 512)) if quick else _LINEAR_KN
    for m in lin_m:
        for k, n in lin_kn:
            cases.append(
                (
                    "linear",
                    (m, k, n),
                    lambda k=k, n=n: nn.Linear(k, n),
                    lambda dt, m=m, k=k: (torch.randn(m, k, dtype=dt),),
                )
            )
    attn = ((8, 4, 32, 16), (8, 4, 64, 32), (4, 4, 128, 32)) if quick else _ATTENTION_BHSD
    for b, h, s, d in attn:
        cases.append(
            (
                "attention",
                (b, h, s, d),
                lambda: None,
                lambda dt, b=b, h=h, s=s, d=d: tuple(torch.randn(b, h, s, d, dtype=dt) for _ in range(3)),
            )
        )
    rows = ((256, 64), (2048, 256)) if quick else tuple((m, h) for m in (128, 512, 2048) for h in (32, 64, 128, 256))
    for m, h in rows:
        cases.append(
            ("layer_norm", (m, h), lambda h=h: nn.LayerNorm(h), lambda dt, m=m, h=h: (torch.randn(m, h, dtype=dt),))
        )
        cases.append(
            ("activation", (m, 4 * h), lambda: nn.GELU(), lambda dt, m=m, h=h: (torch.randn(m, 4 * h, dtype=dt),))
        )
        cases.append(
            (
                "add",
                (m, h),
                lambda: None,
                lambda dt, m=m, h=h: (torch.randn(m, h, dtype=dt), torch.randn(m, h, dtype=dt)),
            )
        )
    emb = (
        ((256, 128, 64), (2048, 512, 128))
        if quick
        else tuple((m, v, h) for m in (128, 512, 2048) for v, h in ((128, 64), (512, 128), (1024, 256)))
    )
    for m, v, h in emb:
        cases.append(
            (
                "embedding",
                (m, v, h),
                lambda v=v, h=h: nn.Embedding(v, h),
                lambda dt, m=m, v=v: (torch.randint(0, v, (m,)),),
            )
        )
        cases.append(
            (
                "cross_entropy",
                (m, v),
                lambda: None,
                lambda dt, m=m, v=v: (torch.randn(m, v, dtype=dt), torch.randint(0, v, (m,))),
            )
        )
    return cases


_CALL = {
    "linear": lambda mod, x: mod(x),
    "attention": lambda mod, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    "layer_norm": lambda mod, x: mod(x),
    "activation": lambda mod, x: mod(x),
    "add": lambda mod, x, y: x + y,
    "embedding": lambda mod, i: mod(i),
    "cross_entropy": lambda mod, x, t: F.cross_entropy(x, t),
}


def _traced_cost(kind: str, module: nn.Module | None, inputs: tuple) -> tuple[float, float, float]:
    """(forward flop, bytes moved, backward/forward flop ratio) of the case's operator, as
    planlab's tracer and signature registry count them."""
    from planlab.graph.trace import trace

    g = trace((_One, _Two, _Three)[len(inputs) - 1](_CALL[kind], module), inputs)
    ops = [op for op in g.operators if op.kind == kind]
    if not ops:  # pragma: no cover - the registry names these kinds
        raise ConfigError(f"calibrate: tracing a {kind} case gave operators {[o.kind for o in g.operators]}")
    op = ops[0]
    return op.flops, op.bytes_moved, op.bwd_flops_ratio


CHUNK = 16  # cases measured round-robin together


def l2_bytes() -> int:
    """The size of a core's level-2 cache (Linux sysfs), or 2 MiB if it cannot be read."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for idx in sorted(base.glob("index*")):
            if (idx / "level").read_text().strip() == "2":
                text = (idx / "size").read_text().strip().upper()
                unit = {"K": 2**10, "M": 2**20}.get(text[-1], 1)
                return int(text.rstrip("KM")) * unit
    except (OSError, ValueError):
        pass
    return 2 * MiB


# Each case cycles through copies of its data adding up to a core's L2 cache: a call finds its
# inputs in L2 but not in L1, as an operator of a training step finds the activations a recent
# operator wrote (hot data would flatter small kernels, data from memory burden them).
CYCLE_BYTES = l2_bytes()


class _Case:
    """One kernel case ready to time: sets of module and inputs (cycled, see ``CYCLE_BYTES``) with
    their forward graphs, for the backward."""

    def __init__(self, kind: str, make: Callable, inputs_of: Callable, dt: torch.dtype) -> None:
        torch.manual_seed(0)
        self.kind, self.call = kind, _CALL[kind]
        proto = make()
        proto = proto.to(dt) if proto is not None else None
        xs = inputs_of(dt)
        self.flops, self.nbytes, self.ratio = _traced_cost(kind, proto, xs)
        per_set = sum(x.numel() * x.element_size() for x in xs) + sum(
            p.numel() * p.element_size() for p in (proto.parameters() if proto is not None else ())
        )
        copies = max(1, min(8, CYCLE_BYTES // max(per_set, 1)))
        self.sets = []
        for i in range(copies):
            mod = copy.deepcopy(proto) if (proto is not None and i) else proto
            ins = tuple((x.clone().requires_grad_(True) if x.is_floating_point() else x.clone()) for x in xs)
            leaves = [x for x in ins if x.requires_grad] + (list(mod.parameters()) if mod is not None else [])
            y = self.call(mod, *ins)
            self.sets.append((mod, ins, leaves, y, torch.ones_like(y)))
        self.fwd: list[float] = []
        self.bwd: list[float] = []
        self.next = 0

    def sample(self) -> None:
        """Time one forward and one backward, each on the next set of inputs."""
        clock = time.perf_counter
        mod, ins, _, _, _ = self.sets[self.next % len(self.sets)]
        t0 = clock()
        self.call(mod, *ins)
        self.fwd.append(clock() - t0)
        self.next += 1
        _, _, leaves, y, gy = self.sets[self.next % len(self.sets)]
        t0 = clock()
        torch.autograd.grad(y, leaves, gy, retain_graph=True, allow_unused=True)
        self.bwd.append(clock() - t0)
        self.next += 1


def measure_kernels(
    dtypes: tuple[str, ...] = ("fp32",), *, quick: bool = False, log: Callable[[str], None] = lambda s: None
) -> list[KernelTime]:
    """Forward and backward time of every kernel case in every dtype (one thread).

    Cases are measured round-robin in chunks, a sample of each per round, so that a passing
    disturbance of a shared machine touches a few samples of many cases rather than all samples
    of one; each case's time is the lower quartile of its samples (``typical_s``)."""
    out: list[KernelTime] = []
    rounds = 6 if quick else 16
    for dtname in dtypes:
        dt = _DTYPES[dtname]
        cases = _cases(quick)
        for at in range(0, len(cases), CHUNK):
            chunk = [
                (kind, shape, _Case(kind, make, inputs_of, dt))
                for kind, shape, make, inputs_of in cases[at : at + CHUNK]
            ]
            for c in chunk:  # warm up every set once
                for _ in range(len(c[2].sets)):
                    c[2].sample()
                c[2].fwd.clear()
                c[2].bwd.clear()
            for _ in range(rounds):
                for _, _, c in chunk:
                    c.sample()
            for kind, shape, c in chunk:
                out.append(KernelTime("F", kind, dtname, shape, c.flops, c.nbytes, typical_s(c.fwd)))
                out.append(KernelTime("B", kind, dtname, shape, c.flops * c.ratio, c.nbytes, typical_s(c.bwd)))
        log(f"  kernels {dtname}: {len(cases)} cases, forward and backward, {rounds} rounds")
    return out


def measure_launch_s() -> float:
    """The cost of the smallest kernel: a one-element add (framework dispatch, no work)."""
    a, b = torch.ones(1), torch.ones(1)
    return time_s(lambda: torch.add(a, b), min_time_s=0.01, min_reps=50, max_reps=2000)


# ---------------------------------------------------------------------------------- optimizer


def measure_optimizer(*, quick: bool = False) -> list[tuple[int, int, float]]:
    """``(tensors, parameters, seconds)`` of one Adam step as the executor takes it (gradients set
    on each weight, ``step()``, ``zero_grad(set_to_none=True)``), cycling through copies of the
    weights and states as the kernels do (``CYCLE_BYTES``)."""
    grid = (
        ((1, 1000), (1, 200_000), (8, 1000), (32, 1000), (8, 50_000))
        if quick
        else (
            (1, 1000),
            (1, 100_000),
            (1, 1_000_000),
            (8, 1000),
            (8, 100_000),
            (32, 1000),
            (32, 10_000),
            (64, 4000),
            (64, 1_000_000),
        )
    )
    out = []
    for k, n in grid:
        steps = []
        for _ in range(max(1, min(4, CYCLE_BYTES // (16 * n)))):  # weights, gradients, m and v: 16 B each
            ws = [torch.zeros(n // k, requires_grad=True) for _ in range(k)]
            gs = [torch.randn(n // k) for _ in range(k)]
            steps.append((ws, gs, torch.optim.Adam(ws, lr=1e-3)))
        turn = [0]

        def step() -> None:
            ws, gs, opt = steps[turn[0] % len(steps)]
            turn[0] += 1
            for w, g in zip(ws, gs):
                w.grad = g
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in steps:
            step()  # the first step of each copy creates its states
        out.append((k, (n // k) * k, time_s(step, min_time_s=0.02 if quick else 0.08)))
    return out


def fit_optimizer(points: list[tuple[int, int, float]]) -> OptimizerFit:
    """Fixed, per-tensor and per-parameter costs of the optimizer step (non-negative least squares)."""
    a, b, c = fit_linear([[1.0, k, n] for k, n, _ in points], [t for _, _, t in points])
    return OptimizerFit(a, b, c)


# ---------------------------------------------------------------------------------- executor


OVERHEAD_MODEL = (("layers", 2), ("hidden", 32), ("heads", 2), ("seq", 16), ("vocab", 64))


def measure_bare_view_s() -> tuple[float, float]:
    """(forward, backward) seconds of a view operator run bare: a reshape, and the autograd
    engine carrying a gradient back through it (what a view task costs without the executor)."""
    x = torch.randn(4, 16, 32, requires_grad=True)
    y = x.reshape(4, 16, 2, 16)
    gy = torch.ones_like(y)
    fwd = time_s(lambda: x.reshape(4, 16, 2, 16), min_time_s=0.01, min_reps=50, max_reps=2000)
    bwd = time_s(
        lambda: torch.autograd.grad(y, [x], gy, retain_graph=True), min_time_s=0.01, min_reps=50, max_reps=2000
    )
    return fwd, bwd


def measure_task_overheads(
    profile: Profile, *, quick: bool = False, cluster: str = "cpu"
) -> tuple[dict[str, float], dict[str, float]]:
    """The executor's cost per task kind, beyond the kernels: planlab's interpreter runs one
    device's program of a small GPT (``OVERHEAD_MODEL``). Forward and backward: the median over
    its view tasks (reshapes and transposes, no kernel) of their typical time less the same view
    run bare (``measure_bare_view_s``); local copies (views too): the median of their typical
    time less the profile's kernel time; the optimizer step: its time less the fitted Adam step,
    per weight (setting and releasing each gradient), under "O". Returns (those costs, the median
    whole time of forward and backward view tasks)."""
    from planlab.costmodel.model import CostModel
    from planlab.executor.interpreter import Interpreter
    from planlab.graph.trace import trace
    from planlab.models.registry import ModelSpec, build_model
    from planlab.plan.materialize import materialize
    from planlab.search_spaces.builtin import get_space
    from planlab.search_spaces.space import Context

    spec = ModelSpec("gpt", OVERHEAD_MODEL)
    batch = 4
    graph = trace(*build_model(spec, batch=batch))
    plan = get_space("megatron").build(
        Context(graph, spec, batch, cluster, 1, 1, 1), dict(dp=1, tp=1, pp=1, microbatch=2)
    )
    program = materialize(plan, graph)
    module, inputs = build_model(spec, batch=batch, device="cpu", seed=0)
    interp = Interpreter(program, graph, 0, module, inputs, {}, lr=1e-3)
    interp.record = True
    samples: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(6 if quick else 20):
        interp.run_iteration()
        for t in interp.timeline:
            samples.setdefault((t.action, t.task, t.kind), []).append(t.end_s - t.start_s)
    tasks = {(str(a), t.name): t for a, t in program.devices[0].tasks_in_order()}
    costs = CostModel.load(
        cluster, 1, profile=Profile(profile.device, profile.rooflines, (), None, (), profile.kernels)
    )
    dtype = program.precision.compute_dtype
    bare = dict(zip("FB", measure_bare_view_s()))
    residuals: dict[str, list[float]] = {}
    views: dict[str, list[float]] = {}
    for (action, name, kind), ts in samples.items():
        task = tasks[(action, name)]
        if kind in ("F", "B") and task.flops == 0 and task.bytes_moved == 0:
            views.setdefault(kind, []).append(typical_s(ts))
            residuals.setdefault(kind, []).append(typical_s(ts) - bare[kind])
        elif kind == "L":
            residuals.setdefault(kind, []).append(typical_s(ts) - costs.task_time_s(task, dtype))
        elif kind == "O" and profile.optimizer is not None:  # the executor's own work per weight
            tensors = max(1, len(task.writes))
            model = profile.optimizer.time_s(tensors, task.params)
            residuals.setdefault("O", []).append((typical_s(ts) - model) / tensors)
    return ({k: robust_overhead(v) for k, v in residuals.items()}, {k: robust_overhead(v) for k, v in views.items()})


# ---------------------------------------------------------------------------------- collectives


def _sizes(quick: bool) -> tuple[int, ...]:
    return (4096, 65536, MiB, 4 * MiB) if quick else (4096, 16384, 65536, 262144, MiB, 4 * MiB, 16 * MiB)


def _reps(nbytes: int, quick: bool) -> int:
    """Repetitions per collective and size: enough for the mean of a heavy-tailed time
    (:func:`expected_s`), fewer where the bytes dominate."""
    reps = 100 if nbytes <= 262144 else 40 if nbytes <= MiB else 12
    return max(5, reps // 4) if quick else reps


def _probes() -> list[Callable[[], object]]:
    """Small and mid-size operators, forward and backward, and an optimizer step: what every
    rank of a training step runs, for :func:`concurrency_slowdowns`."""
    torch.manual_seed(0)
    probes: list[Callable[[], object]] = []
    for m, k, n in ((512, 128, 512), (128, 64, 64)):
        lin = nn.Linear(k, n)
        x = torch.randn(m, k, requires_grad=True)
        y = lin(x)
        gy = torch.ones_like(y)
        probes += [
            lambda lin=lin, x=x: lin(x),
            lambda y=y, x=x, lin=lin, gy=gy: torch.autograd.grad(y, [x, *lin.parameters()], gy, retain_graph=True),
        ]
    q = torch.randn(8, 4, 64, 32, requires_grad=True)
    a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    ga = torch.ones_like(a)
    probes += [
        lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
        lambda: torch.autograd.grad(a, [q], ga, retain_graph=True),
    ]
    ln, z = nn.LayerNorm(128), torch.randn(512, 128)
    probes += [lambda: ln(z), lambda: F.gelu(z), lambda: z + z]
    ws = [torch.zeros(4000, requires_grad=True) for _ in range(16)]
    gs = [torch.randn(4000) for _ in range(16)]
    opt = torch.optim.Adam(ws, lr=1e-3)

    def adam() -> None:
        for w, g in zip(ws, gs):
            w.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)

    probes.append(adam)
    return probes


def concurrency_slowdowns(rank: int, world: int, quick: bool) -> dict[int, float]:
    """How much slower rank 0 computes while ``n`` ranks (this machine's processes) compute at
    once than alone, for n = 2..world: rounds alternate rank 0 alone and ``n`` ranks together
    (so that a drift of the shared machine's speed touches both), and the factor is the median
    over rounds and :func:`_probes` of the ratio of their times. Processes on one machine share
    its caches, memory bandwidth and, on virtual machines, perhaps the physical cores; devices of
    a cluster do not."""
    import torch.distributed as dist

    probes = _probes()
    min_time = 0.005 if quick else 0.01
    for p in probes:
        p()  # warm up

    def timed() -> list[float]:
        return [time_s(p, min_time_s=min_time, min_reps=3) for p in probes]

    ratios: dict[int, list[float]] = {n: [] for n in range(2, world + 1)}
    for _ in range(3 if quick else 6):
        for n in ratios:
            dist.barrier()
            alone = timed() if rank == 0 else None
            dist.barrier()
            together = timed() if rank < n else None
            dist.barrier()
            if rank == 0:
                ratios[n] += [b / a for a, b in zip(alone, together)]
    return {n: float(statistics.median(r)) for n, r in ratios.items()} if rank == 0 else {}


def collective_worker(quick: bool) -> dict:
    """One rank of the distributed benchmark (started by torch's elastic launcher): first the
    concurrency slowdowns (:func:`concurrency_slowdowns`), then for each group size 2..world,
    collective kind and size, the typical seconds per operation issued back to back, the way the
    executor issues it. Rank 0 returns ``{"collectives": {"kind/ranks": [[nbytes, seconds], ...]},
    "slowdown": {ranks: factor}}``."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # as the executor's gloo ranks
    keep_freed_memory()
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, list[list[float]]] = {}
    groups = {n: dist.new_group(list(range(n))) for n in range(2, world + 1)}
    slowdowns = concurrency_slowdowns(rank, world, quick)

    between = torch.randn(128, 128)

    def bench(key: str, fn: Callable[[], None], nbytes: int, member: bool) -> None:
        reps = _reps(nbytes, quick)
        times = []
        if member:
            fn()  # warm up
            for _ in range(reps):
                for _ in range(4):  # a little compute between operations, as in a training step
                    between @ between
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        dist.barrier()
        if rank == 0:
            results.setdefault(key, []).append([nbytes, expected_s(times)])

    for n, pg in groups.items():
        member = rank < n
        for nbytes in _sizes(quick):
            numel = nbytes // 4
            x = torch.randn(numel)
            part = torch.randn(numel // n)

            def all_reduce() -> None:
                y = x.clone()
                dist.all_reduce(y, group=pg)

            def all_gather() -> None:
                parts = [torch.empty_like(part) for _ in range(n)]
                dist.all_gather(parts, part, group=pg)
                torch.cat(parts)

            def reduce_scatter() -> None:  # gloo has no reduce-scatter: the executor all-reduces
                z = x.clone()
                dist.all_reduce(z, group=pg)
                z.chunk(n)[rank % n].contiguous()

            def broadcast() -> None:
                dist.broadcast(x, src=0, group=pg)

            def all_to_all() -> None:
                out = torch.empty_like(x[: numel // n * n])
                dist.all_to_all_single(out, x[: numel // n * n], group=pg)

            for kind, fn in (
                ("all_reduce", all_reduce),
                ("all_gather", all_gather),
                ("reduce_scatter", reduce_scatter),
                ("broadcast", broadcast),
                ("all_to_all", all_to_all),
            ):
                bench(f"{kind}/{n}", fn, nbytes, member)
    for nbytes in _sizes(quick):  # one transfer between ranks 0 and 1: half a round trip
        x = torch.randn(nbytes // 4)

        def ping() -> None:
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            elif rank == 1:
                dist.recv(x, 0)
                dist.send(x, 0)

        bench("p2p/2", ping, nbytes, rank < 2)
        if rank == 0:
            results["p2p/2"][-1][1] /= 2
    dist.barrier()
    dist.destroy_process_group()
    return {"collectives": results, "slowdown": slowdowns}


def measure_collectives(nproc: int, *, quick: bool = False) -> dict:
    """Run :func:`collective_worker` on ``nproc`` local processes with torch's elastic launcher."""
    from torch.distributed.launcher.api import elastic_launch

    from planlab.executor.run import local_launch, quiet_launcher

    run_dir = tempfile.mkdtemp(prefix="planlab-calibrate-")
    cfg = local_launch(nproc, f"planlab-calibrate-{os.getpid()}-{time.time_ns()}", run_dir)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        with quiet_launcher():
            out = elastic_launch(cfg, collective_worker)(quick)
    except ChildFailedError as e:
        ranks = ", ".join(f"rank {r} (exit code {f.exitcode})" for r, f in sorted(e.failures.items()))
        raise ExecutionError(
            f"calibrate: the distributed benchmark on {nproc} gloo processes failed: {ranks}"
        ) from None
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return out[0]


def fit_collectives(measured: dict) -> tuple[CollectiveFit, ...]:
    """Alpha and bandwidth per ``kind/ranks`` from :func:`collective_worker`'s points."""
    fits = []
    for key in sorted(measured):
        kind, ranks = key.split("/")
        pts = tuple((float(n), float(t)) for n, t in measured[key])
        fits.append(CollectiveFit(kind, int(ranks), fit_alpha_beta(pts), pts))
    return tuple(fits)


# ---------------------------------------------------------------------------------- the command


def calibrate(
    *,
    out: str | os.PathLike | None = None,
    nproc: int = 2,
    quick: bool = False,
    cluster: str = "cpu",
    dtypes: tuple[str, ...] = ("fp32",),
    log: Callable[[str], None] = lambda s: None,
) -> Profile:
    """Measure this machine and return (and with ``out``, write) its profile.

    ``nproc`` processes (>= 2) run the collective benchmark. ``cluster`` names the cluster
    whose device the profile calibrates (``cpu``: one process = one device). ``quick`` runs
    fewer sizes and repetitions (under a minute; for tests).
    """
    from planlab.costmodel.hardware import load_cluster

    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 2:
        raise ConfigError(f"--nproc must be an integer >= 2 (the collectives need two processes), got {nproc!r}")
    bad = [d for d in dtypes if d not in _DTYPES]
    if bad:
        raise ConfigError(f"calibrate: unknown dtype {bad[0]!r}; choose {', '.join(map(repr, _DTYPES))}")
    device = load_cluster(cluster).device.name
    t0 = time.perf_counter()
    keep_freed_memory()  # malloc as the executor's ranks run it (no page faults for recycled buffers)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        log("measuring kernels (one thread, as each executor rank)")
        kernels = measure_kernels(dtypes, quick=quick, log=log)
        launch = measure_launch_s()
        rooflines = []
        for dt in dtypes:
            mine = [(k.flops, k.bytes_moved, k.time_s) for k in kernels if k.dtype == dt]
            rooflines.append((dt, fit_roofline(mine, launch_s=launch)))
            log(f"  {dt}: {rooflines[-1][1]}")
        log("measuring the optimizer step")
        optimizer = fit_optimizer(measure_optimizer(quick=quick))
        log(
            f"  Adam: {optimizer.fixed_s * 1e6:.0f} us + {optimizer.per_tensor_s * 1e6:.1f} us per tensor + "
            f"{optimizer.per_param_s * 1e9:.2f} ns per parameter"
        )
        base = Profile(device, tuple(rooflines), (), optimizer, (), tuple(kernels))
        log("measuring the executor's cost per task")
        overheads, views = measure_task_overheads(base, quick=quick, cluster=cluster)
        per_weight = overheads.pop("O", 0.0)  # the executor's work per weight joins the optimizer's per-tensor cost
        optimizer = OptimizerFit(optimizer.fixed_s, optimizer.per_tensor_s + per_weight, optimizer.per_param_s)
        log(
            "  "
            + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in sorted(overheads.items()))
            + "; a view task "
            + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in sorted(views.items()))
            + f"; the optimizer {per_weight * 1e6:.1f} us more per weight"
        )
    finally:
        torch.set_num_threads(threads)
    log(f"measuring collectives on {nproc} gloo processes")
    measured = measure_collectives(nproc, quick=quick)
    collectives = fit_collectives(measured["collectives"])
    slowdown = tuple(sorted((int(n), float(f)) for n, f in measured["slowdown"].items()))
    for c in collectives:
        log(f"  {c}")
    log("  computing beside other ranks: " + ", ".join(f"{n} ranks x{f:.2f}" for n, f in slowdown))
    meta = (
        ("created", datetime.now(timezone.utc).isoformat(timespec="seconds")),
        ("host", platform.node()),
        ("torch", torch.__version__),
        ("threads", 1),
        ("quick", quick),
        ("seconds", round(time.perf_counter() - t0, 1)),
    )
    prof = Profile(
        device,
        tuple(rooflines),
        tuple(sorted(overheads.items())),
        optimizer,
        collectives,
        tuple(kernels),
        meta,
        view_task_s=tuple(sorted(views.items())),
        slowdown=slowdown,
    )
    if out is not None:
        prof = dataclasses.replace(prof, path=str(Path(out)))
        prof.save(out)
    return prof
