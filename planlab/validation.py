"""Validation against measured training iterations (vTrain's published ground truth).

Each measured run becomes the plan a user would give planlab for it and is simulated as
``planlab explore`` simulates a plan: on a built-in cluster (:data:`CLUSTER`, HGX A100 80GB
nodes with four HDR adapters, the reference's 800 Gb/s per node) with a built-in training
software and precision (:data:`SOFTWARE`, DeepSpeed driving Megatron-LM's layers, fp16), through
:func:`planlab.plan.software_passes.build_program`. The report compares predicted and measured
iteration time.

The measured system is Megatron-DeepSpeed's GPT (reference README): tensor parallelism as
Megatron-LM's (column- and row-parallel linear layers, and a vocabulary-parallel embedding,
output layer and cross entropy), full activation recompute per layer, 1F1B, fp16 mixed precision
with gradients reduced once after the backward, vocabulary padded as Megatron pads it (all of it
the software file's and the ``megatron`` space's). :func:`megatron_gpt` builds that model;
:func:`megatron_plan` builds the plan with the ``megatron`` space's knobs fixed, or, for tensor
parallelism over 16 GPUs (two nodes, which the ``tp`` space refuses), with the same space's parts
issued directly.
"""

from __future__ import annotations

import csv
import math
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

import pandas as pd
import torch

from planlab.errors import ConfigError
from planlab.models.gpt import GPT, GPTConfig
from planlab.models.registry import ModelSpec

GPT2_VOCAB = 50257  # the GPT-2 tokenizer's vocabulary (vTrain's configs)
VOCAB_DIVISOR = 128  # Megatron-LM's --make-vocab-size-divisible-by default, times the tensor-parallel degree
DROPOUT = 0.1  # Megatron-LM's default hidden and attention dropout
CLUSTER = "hgx-a100-80g-4nic"  # 8 A100 SXM 80GB per node over NVSwitch, 800 Gb/s of InfiniBand (reference README)
SOFTWARE = "deepspeed"  # Megatron-DeepSpeed: DeepSpeed's engine and pipeline engine on Megatron-LM's layers
PRECISION = "fp16"  # vTrain's configurations train in fp16 mixed precision


def padded_vocab(tp: int, vocab: int = GPT2_VOCAB) -> int:
    """Megatron-LM pads the vocabulary to a multiple of 128 x the tensor-parallel degree."""
    multiple = VOCAB_DIVISOR * tp
    return math.ceil(vocab / multiple) * multiple


def megatron_gpt(layers: int, hidden: int, heads: int, seq: int, vocab: int, batch: int = 1, dropout: float = DROPOUT):
    """The model of a measured run (``--model planlab.validation:megatron_gpt``): (module, inputs)."""
    cfg = GPTConfig(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, dropout=dropout, vocab_parallel=1)
    here = torch.empty(0).device  # meta when planlab traces, the CPU when the executor runs the model
    return GPT(cfg), GPT.example_inputs(cfg, batch, here, seed=None if here.type == "meta" else 1)


@dataclass(frozen=True)
class MeasuredRun:
    """One row of a vTrain ground-truth file."""

    gpus: int
    global_batch: int
    micro_batch: int
    hidden: int
    heads: int
    layers: int
    seq: int
    tp: int
    dp: int
    pp: int
    measured_s: float

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)


_COLUMNS = (
    "# GPUs",
    "global batch",
    "micro batch",
    "hidden size",
    "attention heads",
    "# layers",
    "sequence length",
    "tensor parallelism",
    "data parallelism",
    "pipeline parallelism",
    "iteration time (ms)",
)


def load_runs(path: str | os.PathLike) -> list[MeasuredRun]:
    """Read ``vtrain_ground_truth_single.csv`` or ``..._multi.csv``; ConfigError naming the file, the
    row and the column when a value is missing or not a number, or the degrees do not multiply."""
    path = Path(path)
    try:
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            missing = [c for c in _COLUMNS if c not in (reader.fieldnames or ())]
            if missing:
                raise ConfigError(
                    f"{str(path)!r}: column {missing[0]!r} is missing; expected the columns {', '.join(_COLUMNS)}"
                )
            rows = list(reader)
    except OSError as e:
        raise ConfigError(f"cannot read {str(path)!r}: {e.strerror}") from None
    out = []
    for i, r in enumerate(rows, start=2):
        vals = []
        for c in _COLUMNS:
            try:
                v = float(r[c]) if c == _COLUMNS[-1] else int(r[c])
            except (TypeError, ValueError):
                raise ConfigError(
                    f"{str(path)!r} line {i}: column {c!r} is {r.get(c)!r}; expected "
                    f"{'a number of milliseconds' if c == _COLUMNS[-1] else 'an integer'}"
                ) from None
            if v <= 0:
                raise ConfigError(f"{str(path)!r} line {i}: column {c!r} is {v!r}; expected a positive value")
            vals.append(v)
        run = MeasuredRun(*vals[:-1], vals[-1] / 1e3)
        if run.tp * run.dp * run.pp != run.gpus or run.global_batch % (run.dp * run.micro_batch):
            raise ConfigError(
                f"{str(path)!r} line {i}: tp x dp x pp = {run.tp * run.dp * run.pp} for {run.gpus} GPUs, "
                f"or dp x micro batch does not divide the global batch {run.global_batch}"
            )
        out.append(run)
    return out


def model_spec(run: MeasuredRun) -> ModelSpec:
    """The model of ``run``: Megatron's GPT of the run's shape, vocabulary padded for its tp."""
    args = dict(layers=run.layers, hidden=run.hidden, heads=run.heads, seq=run.seq, vocab=padded_vocab(run.tp))
    return ModelSpec("planlab.validation:megatron_gpt", tuple(sorted(args.items())))


TRACE_BATCH = 2  # traced at two samples: at one, size-1 axes lose their batch label


@lru_cache(maxsize=4)
def _traced(spec: ModelSpec):
    from planlab.graph.trace import trace
    from planlab.models.registry import build_model

    model, inputs = build_model(spec, batch=TRACE_BATCH)
    return trace(model, inputs)


@lru_cache(maxsize=8)
def _graph(spec: ModelSpec, batch: int):
    return rebatch(_traced(spec), batch)


def rebatch(graph, batch: int):
    """``graph`` at ``batch`` samples: every axis labelled as the batch, and every operator
    dimension so labelled, scales by ``batch`` over the traced batch, as do the flop of
    operators on batched tensors (linear in the batch, as every operator of the GPT family is)
    and the bytes they move: what a trace at that batch gives (checked by the tests), without
    tracing the model again for every batch of the ground truth."""
    from planlab.graph.ir import Graph

    label = graph.batch_label
    base = graph.tensors[graph.inputs[0]].shape[0]
    if batch == base:
        return graph

    def scaled(n: int) -> int:
        if n % base:
            raise ConfigError(f"rebatch: a batch axis of size {n} is not a multiple of the traced batch {base}")
        return n // base * batch

    tensors = {
        name: replace(
            spec,
            shape=tuple(scaled(n) if graph.labels.get((name, a)) == label else n for a, n in enumerate(spec.shape)),
        )
        for name, spec in graph.tensors.items()
    }
    ops = []
    for op in graph.operators:
        names = op.inputs + op.outputs
        batched = any(graph.labels.get((t, a)) == label for t in names for a in range(len(graph.tensors[t].shape)))
        dims = {d: scaled(n) if graph.dim_label(op, d) == label else n for d, n in op.dim_sizes.items()}
        nbytes = float(sum(tensors[t].nbytes for t in names)) if op.bytes_moved else 0.0
        ops.append(
            replace(op, dim_sizes=dims, flops=op.flops * batch / base if batched else op.flops, bytes_moved=nbytes)
        )
    return Graph(tensors, ops, graph.inputs, graph.loss, dict(graph.labels), graph.unknown)


def megatron_plan(run: MeasuredRun, graph, spec: ModelSpec, cluster: str, nodes: int, per_node: int):
    """The plan of ``run``: the ``megatron`` space's plan with the run's knobs fixed (pipeline,
    data and tensor parallelism, full recompute, 1F1B), the vocabulary-parallel embedding, output
    layer and loss split over the tensor-parallel group as Megatron-LM splits them. Where the
    space's knobs do not offer the run's values (tensor parallelism wider than a node, a
    micro-batch that is not a power of two) the same space's parts are issued directly."""
    from planlab.search_spaces.builtin import (
        DataParallel,
        PipelineParallel,
        Recompute,
        get_space,
        tensor_parallel_dims,
    )
    from planlab.search_spaces.space import Context, Draft

    ctx = Context(graph, spec, run.global_batch, cluster, nodes, run.gpus, per_node)
    knobs = dict(
        pp=run.pp,
        dp=run.dp,
        tp=run.tp,
        microbatch=run.micro_batch,
        recompute="full",
        schedule="1f1b",
        virtual_stages=1,
        zero=0,
        sequence_parallel=False,
    )
    if run.layers % run.pp or run.heads % run.tp:
        raise ConfigError(f"pp={run.pp} must divide the {run.layers} layers and tp={run.tp} the {run.heads} heads")
    try:
        return get_space("megatron").build(ctx, knobs)
    except ConfigError:  # a knob value outside the space's ranges: its parts, issued directly
        pass
    draft = Draft(ctx)
    PipelineParallel().apply(draft, knobs)
    DataParallel().apply(draft, knobs)
    draft.add_axis("tp", run.tp, tensor_parallel_dims(graph))  # the vocabulary operators split along it too
    Recompute().apply(draft, knobs)
    return draft.to_plan(space="megatron", knobs=knobs)


def schedules(run: MeasuredRun, microbatches: int) -> dict[int, tuple]:
    """Per pipeline rank, the actions of ``run`` over ``microbatches``: Megatron's 1F1B, or with
    one stage each micro-batch's forward then its backward (gradient accumulation), then the update."""
    from planlab.plan.plan import Action
    from planlab.search_spaces.schedules import one_f_one_b

    out = {}
    for r in range(run.pp):
        if run.pp > 1:
            acts = one_f_one_b(r, run.pp, microbatches)
        else:
            acts = [Action(0, ph, k) for k in range(microbatches) for ph in ("F", "B")]
        out[r] = tuple(acts) + (Action(r, "U", 0),)
    return out


def program_of(run: MeasuredRun, cluster: str = CLUSTER, *, batch: int | None = None):
    """The reduced Program of ``run`` on ``cluster``. With ``batch = dp x micro-batch`` the model
    is traced and materialized for one micro-batch per replica and the schedules are then made
    for the run's micro-batches: every micro-batch runs the same blocks, so runs that differ only
    in their global batch share one materialization (see :func:`validate`)."""
    cost = _cost(cluster, _nodes(run, cluster))
    batch = run.global_batch if batch is None else batch
    program = _template(
        run.hidden, run.heads, run.layers, run.seq, run.tp, run.dp, run.pp, run.micro_batch, batch, cluster
    )
    if batch == run.global_batch:
        return program, cost
    sched = schedules(run, run.microbatches)
    per_rank = run.dp * run.tp
    devices = tuple(replace(d, schedule=sched[d.device // per_rank]) for d in program.devices)
    return replace(program, devices=devices, microbatches=run.microbatches), cost


@lru_cache(maxsize=4)
def _template(hidden, heads, layers, seq, tp, dp, pp, micro_batch, batch, cluster):
    from planlab.plan.software_passes import build_program

    run = MeasuredRun(tp * dp * pp, batch, micro_batch, hidden, heads, layers, seq, tp, dp, pp, 0.0)
    cost = _cost(cluster, _nodes(run, cluster))
    spec = model_spec(run)
    graph = _graph(spec, batch)
    plan = megatron_plan(run, graph, spec, cluster, cost.cluster.nodes, cost.cluster.node.devices_per_node)
    sched = schedules(run, run.microbatches)
    plan = replace(plan, schedule=tuple(sched[d // (dp * tp)] for d in range(plan.num_devices)))
    return build_program(plan, graph, cost)


def predict(run: MeasuredRun, cluster: str = CLUSTER, *, batch: int | None = None) -> dict:
    """Simulate one measured run; returns a row with the prediction and the error. ``batch``:
    see :func:`program_of`."""
    from planlab.simulator.engine import simulate

    program, cost = program_of(run, cluster, batch=batch)
    res = simulate(program, cost)
    row = asdict(run)
    row.update(predicted_s=res.iter_time_s, error=(res.iter_time_s - run.measured_s) / run.measured_s)
    return row


def _nodes(run: MeasuredRun, cluster: str) -> int:
    return max(1, math.ceil(run.gpus / _per_node(cluster)))


@lru_cache(maxsize=8)
def _per_node(cluster: str) -> int:
    from planlab.costmodel import load_cluster

    return load_cluster(cluster).node.devices_per_node


@lru_cache(maxsize=16)
def _cost(cluster: str, nodes: int):
    from planlab.costmodel import CostModel

    return CostModel.load(cluster, nodes, software=SOFTWARE, precision=PRECISION)


def _predict_group(args) -> list[dict]:
    runs, cluster = args
    return [predict(r, cluster, batch=batch) for r, batch in runs]


def validate(runs: list[MeasuredRun], cluster: str = CLUSTER, *, jobs: int = 1) -> pd.DataFrame:
    """Predicted against measured iteration time for each run (``error`` is signed, relative).

    Each model shape is traced once (:func:`rebatch` makes it at each batch); runs that differ
    only in their global batch share one materialized program (for one micro-batch per replica);
    each model's runs go to one worker of ``jobs`` processes."""
    shape = lambda r: (r.hidden, r.heads, r.layers, r.seq, r.tp, r.dp, r.pp, r.micro_batch)  # noqa: E731
    shared: dict[tuple, int] = {}
    for r in runs:
        shared[shape(r)] = shared.get(shape(r), 0) + 1
    groups: dict[tuple, list[MeasuredRun]] = {}
    for r in runs:  # one traced model per group (rebatched for each run), programs shared within
        groups.setdefault((r.hidden, r.heads, r.layers, r.seq, padded_vocab(r.tp)), []).append(r)
    work = [
        ([(r, r.dp * r.micro_batch if shared[shape(r)] > 1 else r.global_batch) for r in sorted(g, key=shape)], cluster)
        for _, g in sorted(groups.items(), key=lambda kv: -len(kv[1]) * kv[0][2] * kv[0][0] ** 2)
    ]
    if jobs > 1 and len(work) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            parts = list(pool.map(_predict_group, work))
    else:
        parts = [_predict_group(w) for w in work]
    return pd.DataFrame([row for part in parts for row in part])


def mape(df: pd.DataFrame) -> float:
    """Mean absolute percentage error."""
    return float(df["error"].abs().mean() * 100)


def kendall_tau(a, b) -> float:
    """Kendall's tau-a between two equally long sequences (1: same order, -1: reversed)."""
    n = len(a)
    if n < 2:
        return float("nan")
    s = 0
    for i in range(n):
        for j in range(i + 1, n):
            x, y = a[i] - a[j], b[i] - b[j]
            s += (x > 0) - (x < 0) if y > 0 else -((x > 0) - (x < 0)) if y < 0 else 0
    return 2.0 * s / (n * (n - 1))


def rank_correlation(df: pd.DataFrame) -> float:
    """Mean Kendall tau of predicted against measured time within each model size
    (hidden, layers), weighted by the number of runs of the size."""
    taus, weights = [], []
    for _, g in df.groupby(["hidden", "layers"]):
        if len(g) >= 2:
            taus.append(kendall_tau(list(g["predicted_s"]), list(g["measured_s"])))
            weights.append(len(g))
    return sum(t * w for t, w in zip(taus, weights)) / sum(weights) if weights else float("nan")
