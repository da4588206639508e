"""Published measurements of training throughput, as data: sets of measured runs with their sources.

Each set is two files in ``benchmarks/data/``: ``NAME.json`` (the source: paper or page, table
or figure; the conditions it states: hardware, interconnect, software and version, precision,
sequence, parallel configuration, recomputation, batch sizes; the metric and how it converts to
seconds per iteration) and ``NAME.csv`` (one measured run a row: the model as planlab names it,
the plan as the ``megatron`` space's knobs, the cluster and software it ran on, the quoted number,
and a ``skip_reason`` when planlab cannot express the run yet). :func:`load_sets` reads them;
:class:`PublishedRow` turns a row into the model spec and knobs a user would give
``planlab explore`` (see ``benchmarks/validate_published.py``).

Metrics (``metric`` in the json, ``value`` in each row) and their conversion to the measured
seconds per iteration, ``measured_s``:

``iteration_s``            the value itself;
``tflops_per_gpu``         ``F / (gpus x value x 1e12)``, F by the set's FLOP formula;
``mfu``                    ``F / (gpus x value x peak_tflops x 1e12)``;
``scaling_efficiency``     ``F / (gpus x value x baseline_tflops_per_gpu x 1e12)``;
``tokens_per_s_per_gpu``   ``global batch x sequence / (gpus x value)``;
``gpu_hours_per_trillion_tokens``  ``global batch x sequence x value x 3600 / (1e12 x gpus)``
                           (DeepSeek-V3's "180K H800 GPU hours per trillion tokens").

FLOP formulas (B global batch, s sequence, l layers, h hidden, V the set's ``vocab_for_flops``):
``narayanan-eq3`` = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) (Narayanan et al. 2021, eq. 3: with the
recomputed forward); ``korthikanti-eq7`` = 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) (Korthikanti et
al. 2022, Appendix A eq. 7: model FLOPs); ``torchtitan`` = B s (6 N' + 12 l h s) with N' the parameters
without the token embedding (torchtitan's ``get_num_flop_per_token``: the attention's four matmuls
counted whole, not halved for the causal mask; for sources that state no formula of their own);
``megatron-lm`` = 12 B s l h^2 ((1 + g/a + s/h) q/h + f/h x k x 3/2 + V/(2 l h)) with a heads, g key/value
heads, q = a x head size, f the feed-forward width, k the experts a token is routed to (1 for a dense
model) and 3/2 for SwiGLU's third matrix (Megatron-LM's ``num_floating_point_operations`` in
``megatron/training/training.py``, the teraFLOP/s its training log prints; llama-style and MoE models).
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from planlab.errors import ConfigError, choices
from planlab.models.registry import ModelSpec

COLUMNS = (
    "row",
    "source_ref",
    "model",
    "model_args",
    "params_b",
    "gpus",
    "cluster",
    "software",
    "precision",
    "tp",
    "pp",
    "dp",
    "cp",
    "virtual_stages",
    "schedule",
    "microbatch",
    "global_batch",
    "zero",
    "sequence_parallel",
    "recompute",
    "metric",
    "value",
    "skip_reason",
    "note",
)
# optional columns, after cp and in this order: expert parallelism (ep, and etp, empty: the tensor-parallel
# degree) and uneven pipeline stages (first_stage_layers, last_stage_layers, empty or 0: an even share)
# and the modules recomputed besides recompute's (recompute_modules: Megatron-Core's --recompute-modules
# names separated by spaces, each a recompute_<name> knob of planlab.search_spaces.recompute_modules)
# and the interleaved schedule's micro-batches a chunk runs in a row (pipeline_group: Llama 3's N, the knob of
# planlab.search_spaces.schedules.interleaved_1f1b; empty or 0: pp, Megatron-LM's order)
# and the interleaved schedule's paired forward and backward (expert_overlap: true for Megatron-Core's
# --overlap-moe-expert-parallel-comm, the knob expert_overlap; empty or false: off)
OPTIONAL_COLUMNS = (
    "ep",
    "etp",
    "first_stage_layers",
    "last_stage_layers",
    "cp_kind",
    "recompute_modules",
    "pipeline_group",
    "expert_overlap",
)
RECOMPUTE_MODULES = ("moe_act", "mlp", "mla_up_proj")
CP_KINDS = ("a2a", "ring", "allgather")  # the cp_kind column: planlab.search_spaces.context's cp_kind knob (empty: a2a)
METRICS = (
    "iteration_s",
    "tflops_per_gpu",
    "mfu",
    "scaling_efficiency",
    "tokens_per_s_per_gpu",
    "gpu_hours_per_trillion_tokens",
)
FLOP_FORMULAS = ("narayanan-eq3", "korthikanti-eq7", "torchtitan", "megatron-lm")
SOFTWARE = (
    "megatron",
    "megatron-2019",
    "megatron-2022",
    "megatron-2024",
    "megatron-hybridep",
    "megatron-deepep",
    "hai-llm",
    "deepspeed",
    "deepspeed-2021",
    "torch",
    "torch-2024",
    "torch-float8-fsdp",
)
PRECISIONS = ("fp16", "bf16", "mixed", "fp8")
CONDITIONS = ("hardware", "interconnect", "software", "precision", "sequence", "parallel", "recomputation", "batch")
# integer plan columns a runnable row must fill (a skipped row may leave what its source does not state)
_INTS = ("gpus", "tp", "pp", "dp", "cp", "virtual_stages", "microbatch", "global_batch", "zero")
# strategy families, in the order a report lists them
FAMILIES = ("tp-pp", "zero3-dp", "dp")


@dataclass(frozen=True)
class PublishedRow:
    """One measured run: what ran (model, plan, cluster, software) and what was measured."""

    set: str
    row: str
    source_ref: str
    model: str
    model_args: tuple[tuple[str, int | float], ...]
    params_b: float
    gpus: int
    cluster: str
    software: str
    precision: str
    tp: int
    pp: int
    dp: int
    cp: int
    virtual_stages: int | None
    schedule: str
    microbatch: int | None
    global_batch: int
    zero: int
    sequence_parallel: bool
    recompute: str
    metric: str
    value: float
    skip_reason: str = ""
    note: str = ""
    ep: int = 1
    etp: int | None = None  # None: the tensor-parallel degree (Megatron-Core's default)
    first_stage_layers: int = 0  # 0: an even share (Megatron-Core's --decoder-first-pipeline-num-layers unset)
    last_stage_layers: int = 0
    cp_kind: str = ""  # context parallelism's attention (the cp_kind knob); empty: the default, a2a
    recompute_modules: tuple[str, ...] = ()  # each sets knob recompute_<name> (RECOMPUTE_MODULES)
    pipeline_group: int = 0  # interleaved: micro-batches a chunk runs in a row (Llama 3's N); 0: pp
    expert_overlap: bool = False  # interleaved: each steady-state forward beside the next backward

    def __str__(self) -> str:
        return f"{self.set}/{self.row}"

    @property
    def runnable(self) -> bool:
        """Whether planlab can express the run (no ``skip_reason``)."""
        return not self.skip_reason

    @property
    def family(self) -> str:
        """``tp-pp`` (tensor and/or pipeline parallelism), ``zero3-dp`` (ZeRO-3 / FSDP data
        parallelism without model parallelism) or ``dp`` (plain data parallelism)."""
        if self.tp > 1 or self.pp > 1:
            return "tp-pp"
        return "zero3-dp" if self.zero >= 3 else "dp"

    def spec(self) -> ModelSpec:
        """The model as ``--model NAME --model-arg KEY=VALUE ...``."""
        return ModelSpec(self.model, self.model_args)

    def knobs(self) -> dict:
        """The plan as the ``megatron`` space's knobs (``--set KNOB=VALUE``)."""
        return dict(
            pp=self.pp,
            dp=self.dp,
            tp=self.tp,
            microbatch=self.microbatch,
            schedule=self.schedule,
            virtual_stages=self.virtual_stages,
            zero=self.zero,
            sequence_parallel=self.sequence_parallel,
            recompute=self.recompute,
            ep=self.ep,
            cp=self.cp,
            **({} if self.etp is None else {"etp": self.etp}),
            **{
                k: v
                for k, v in (
                    ("first_stage_layers", self.first_stage_layers),
                    ("last_stage_layers", self.last_stage_layers),
                    ("cp_kind", self.cp_kind),
                    ("pipeline_group", self.pipeline_group),
                    ("expert_overlap", self.expert_overlap),
                )
                if v
            },
            **{f"recompute_{m}": True for m in self.recompute_modules},
        )

    @property
    def precision_arg(self) -> str | None:
        """The row's precision as ``--precision`` takes it; None for "mixed" (the source does not
        say which 16-bit type: the device's default)."""
        return None if self.precision == "mixed" else self.precision

    def nodes(self, devices_per_node: int) -> int:
        """Nodes of ``devices_per_node`` GPUs the run spans."""
        return max(1, math.ceil(self.gpus / devices_per_node))

    def command(self, devices_per_node: int) -> str:
        """The ``planlab explore`` command that evaluates this plan."""
        parts = ["planlab explore", f"--model {self.model}"]
        parts += [f"--model-arg {k}={v}" for k, v in self.model_args]
        parts += [f"--cluster {self.cluster}", f"--nodes {self.nodes(devices_per_node)}", "--space megatron"]
        parts += [f"--set {k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.knobs().items()]
        parts.append(f"--global-batch {self.global_batch}")
        parts.append(f"--software {self.software}")
        if self.precision_arg:
            parts.append(f"--precision {self.precision_arg}")
        return " ".join(parts)


@dataclass(frozen=True)
class PublishedSet:
    """A set of measured runs from one source, with the conditions it states."""

    name: str
    title: str
    software: tuple[str, ...]  # the training software of the rows (``megatron``, ``deepspeed``, ``torch``)
    source: dict = field(compare=False)
    conditions: dict = field(compare=False)
    metric: dict = field(compare=False)
    notes: tuple[str, ...]
    rows: tuple[PublishedRow, ...]

    def __str__(self) -> str:
        return f"{self.name} ({len(self.rows)} rows)"

    def measured_s(self, row: PublishedRow) -> float:
        """Seconds per iteration of ``row`` from its quoted number (module docstring)."""
        kind, m = row.metric, self.metric
        if kind == "iteration_s":
            return row.value
        if kind == "tokens_per_s_per_gpu":
            return row.global_batch * _config(row).seq / (row.gpus * row.value)
        if kind == "gpu_hours_per_trillion_tokens":
            return row.global_batch * _config(row).seq * row.value * 3600 / (1e12 * row.gpus)
        if kind == "mfu":
            per_gpu = row.value * float(m["peak_tflops"])
        elif kind == "tflops_per_gpu":
            per_gpu = row.value
        else:  # scaling_efficiency
            per_gpu = row.value * float(m["baseline_tflops_per_gpu"])
        return flops_per_iteration(row, m) / (row.gpus * per_gpu * 1e12)


def flops_per_iteration(row: PublishedRow, metric: dict) -> float:
    """The FLOPs of one iteration of ``row`` by the set's formula (module docstring)."""
    cfg = _config(row)
    b, s, n_l, h = row.global_batch, cfg.seq, cfg.layers, cfg.hidden
    v = float(metric.get("vocab_for_flops", cfg.vocab))
    if metric["flops"] == "torchtitan":
        non_embedding = cfg.num_params() - cfg.vocab * h
        return float(b * s) * (6.0 * non_embedding + 12.0 * n_l * h * s)
    if metric["flops"] == "narayanan-eq3":
        return 96.0 * b * s * n_l * h * h * (1 + s / (6 * h) + v / (16 * n_l * h))
    if metric["flops"] == "megatron-lm":
        return megatron_lm_flops(b, cfg, v)
    return 72.0 * b * s * n_l * h * h * (1 + s / (6 * h) + v / (12 * n_l * h))


def megatron_lm_flops(batch: int, cfg, vocab: float) -> float:
    """FLOPs of one iteration of ``batch`` sequences by Megatron-LM's ``num_floating_point_operations``
    (module docstring): grouped-query attention, SwiGLU feed-forward, ``top_k`` experts per token;
    ConfigError for a model without key/value heads (not a llama-style or MoE decoder)."""
    if not hasattr(cfg, "kv_heads") or not hasattr(cfg, "ffn_hidden"):
        raise ConfigError(f"the megatron-lm FLOP formula counts llama-style and MoE decoders; got {type(cfg).__name__}")
    s, n_l, h = cfg.seq, cfg.layers, cfg.hidden
    query_ratio = cfg.heads * cfg.head_dim / h
    attention = (1 + cfg.kv_heads / cfg.heads + s / h) * query_ratio
    feed_forward = cfg.ffn_hidden / h * getattr(cfg, "top_k", 1) * 1.5
    return 12.0 * batch * s * n_l * h * h * (attention + feed_forward + vocab / (2 * n_l * h))


def _config(row: PublishedRow):
    if not row.model:
        raise ConfigError(f"{row}: the row names no model, so its FLOPs and tokens cannot be counted")
    return row.spec().config()


# -- reading -----------------------------------------------------------------------------------
def load_sets(directory: str | os.PathLike, names: list[str] | None = None) -> list[PublishedSet]:
    """Every set of ``directory`` (``NAME.json`` + ``NAME.csv``), or those in ``names``;
    ConfigError naming an unknown set."""
    directory = Path(directory)
    found = sorted(p.stem for p in directory.glob("*.json"))
    for n in names or ():
        if n not in found:
            raise ConfigError(f"unknown published set {n!r}; choose {choices(found)}")
    return [load_set(directory / f"{n}.json") for n in (names or found)]


def load_set(path: str | os.PathLike) -> PublishedSet:
    """One set: its json (source, conditions, metric) and the csv beside it; ConfigError naming
    the file, the line and the column of a malformed value."""
    path = Path(path)
    meta = _read_json(path)
    for key in ("name", "title", "source", "conditions", "metric"):
        if key not in meta:
            raise ConfigError(f"{str(path)!r}: key {key!r} is missing")
    missing = [c for c in CONDITIONS if not str(meta["conditions"].get(c, "")).strip()]
    if missing:
        raise ConfigError(f"{str(path)!r}: conditions lack {', '.join(missing)}; expected {', '.join(CONDITIONS)}")
    for key in ("citation", "where", "url"):
        if not str(meta["source"].get(key, "")).strip():
            raise ConfigError(f"{str(path)!r}: source.{key} is missing")
    metric = meta["metric"]
    if metric.get("name") not in METRICS:
        raise ConfigError(f"{str(path)!r}: metric.name is {metric.get('name')!r}; choose {choices(METRICS)}")
    if "flops" in metric and metric["flops"] not in FLOP_FORMULAS:
        raise ConfigError(f"{str(path)!r}: metric.flops is {metric['flops']!r}; choose {choices(FLOP_FORMULAS)}")
    if not str(metric.get("conversion", "")).strip():
        raise ConfigError(f"{str(path)!r}: metric.conversion is missing (how the value becomes seconds)")
    rows = _read_rows(path.with_suffix(".csv"), meta["name"])
    software = tuple(meta.get("software", ()))
    if not software or any(s not in SOFTWARE for s in software) or {r.software for r in rows} - set(software):
        raise ConfigError(
            f"{str(path)!r}: software is {list(software)}; expected the training software of its rows, from {choices(SOFTWARE)}"
        )
    return PublishedSet(
        meta["name"],
        meta["title"],
        software,
        meta["source"],
        meta["conditions"],
        metric,
        tuple(meta.get("notes", ())),
        rows,
    )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {str(path)!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{str(path)!r} is not valid JSON: {e.msg} at line {e.lineno}") from None


def _read_rows(path: Path, name: str) -> tuple[PublishedRow, ...]:
    try:
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            if tuple(reader.fieldnames or ()) != expected_columns(reader.fieldnames or ()):
                raise ConfigError(
                    f"{str(path)!r}: the columns are {reader.fieldnames}; expected {', '.join(COLUMNS)} "
                    f"(optionally {', '.join(OPTIONAL_COLUMNS)} after cp, in that order)"
                )
            raw = list(reader)
    except OSError as e:
        raise ConfigError(f"cannot read {str(path)!r}: {e.strerror}") from None
    rows = tuple(_parse_row(r, name, f"{str(path)!r} line {i}") for i, r in enumerate(raw, start=2))
    dup = [r.row for r in rows if sum(1 for q in rows if q.row == r.row) > 1]
    if dup:
        raise ConfigError(f"{str(path)!r}: row {dup[0]!r} appears twice")
    return rows


def expected_columns(header) -> tuple[str, ...]:
    """The columns a csv with ``header`` must have: :data:`COLUMNS` with the optional columns it
    uses inserted after ``cp`` in :data:`OPTIONAL_COLUMNS`' order."""
    at = COLUMNS.index("cp") + 1
    return COLUMNS[:at] + tuple(c for c in OPTIONAL_COLUMNS if c in header) + COLUMNS[at:]


def _recompute_modules(r: dict, where: str) -> tuple[str, ...]:
    """The ``recompute_modules`` column: Megatron-Core module names (:data:`RECOMPUTE_MODULES`)."""
    names = tuple((r.get("recompute_modules") or "").split())
    bad = [m for m in names if m not in RECOMPUTE_MODULES]
    if bad:
        raise ConfigError(f"{where}: column 'recompute_modules' names {bad[0]!r}; choose {choices(RECOMPUTE_MODULES)}")
    return names


def _parse_row(r: dict, name: str, where: str) -> PublishedRow:
    skip = (r["skip_reason"] or "").strip()

    def num(col: str, kind=int, *, optional: bool = False):
        text = (r[col] or "").strip()
        if not text and (optional or skip):
            return None
        try:
            v = kind(text)
        except ValueError:
            raise ConfigError(f"{where}: column {col!r} is {text!r}; expected {kind.__name__}") from None
        if v < 0 or (v == 0 and col != "zero"):
            raise ConfigError(f"{where}: column {col!r} is {v!r}; expected a positive value")
        return v

    for col, valid in (("software", SOFTWARE), ("precision", PRECISIONS), ("metric", METRICS)):
        if r[col] not in valid:
            raise ConfigError(f"{where}: column {col!r} is {r[col]!r}; choose {choices(valid)}")
    if r["sequence_parallel"] not in ("true", "false"):
        raise ConfigError(f"{where}: column 'sequence_parallel' is {r['sequence_parallel']!r}; expected true or false")
    ints = {c: num(c) for c in _INTS}
    row = PublishedRow(
        set=name,
        row=r["row"],
        source_ref=r["source_ref"],
        model=r["model"],
        model_args=parse_model_args(r["model_args"], where),
        params_b=num("params_b", float),
        cluster=r["cluster"],
        software=r["software"],
        precision=r["precision"],
        schedule=r["schedule"],
        sequence_parallel=r["sequence_parallel"] == "true",
        recompute=r["recompute"],
        metric=r["metric"],
        value=num("value", float),
        skip_reason=skip,
        note=r["note"],
        ep=num("ep", optional=True) or 1 if "ep" in r else 1,
        etp=num("etp", optional=True) if "etp" in r else None,
        first_stage_layers=_count(r, "first_stage_layers", where, "a layer count (empty or 0: an even share)"),
        last_stage_layers=_count(r, "last_stage_layers", where, "a layer count (empty or 0: an even share)"),
        pipeline_group=_count(r, "pipeline_group", where, "a number of micro-batches (empty or 0: pp)"),
        cp_kind=_cp_kind(r, where),
        expert_overlap=_flag(r, "expert_overlap", where),
        recompute_modules=_recompute_modules(r, where),
        **ints,
    )
    if not r["row"] or not r["source_ref"].strip():
        raise ConfigError(f"{where}: columns 'row' and 'source_ref' must name the run and where it is quoted")
    if row.tp * row.pp * row.dp * row.cp != row.gpus:
        raise ConfigError(f"{where}: tp x pp x dp x cp = {row.tp * row.pp * row.dp * row.cp}, not the {row.gpus} GPUs")
    if row.runnable and (not row.model or row.global_batch % (row.dp * row.microbatch)):
        raise ConfigError(f"{where}: a runnable row needs a model, and dp x microbatch must divide the global batch")
    return row


def _cp_kind(r: dict, where: str) -> str:
    text = (r.get("cp_kind") or "").strip()
    if text and text not in CP_KINDS:
        raise ConfigError(f"{where}: column 'cp_kind' is {text!r}; choose {choices(CP_KINDS)} (empty: a2a)")
    return text


def _flag(r: dict, col: str, where: str) -> bool:
    """An optional true/false column (empty: false)."""
    text = (r.get(col) or "").strip()
    if text not in ("", "true", "false"):
        raise ConfigError(f"{where}: column {col!r} is {text!r}; expected true or false (empty: false)")
    return text == "true"


def _count(r: dict, col: str, where: str, expected: str) -> int:
    """An optional count column (empty: 0)."""
    text = (r.get(col) or "").strip()
    if not text:
        return 0
    if not text.isdigit():
        raise ConfigError(f"{where}: column {col!r} is {text!r}; expected {expected}")
    return int(text)


def parse_model_args(text: str, where: str = "") -> tuple[tuple[str, int | float], ...]:
    """``layers=24;hidden=2304;dropout=0.1`` as ``(('layers', 24), ('hidden', 2304), ...)``."""
    out = []
    for part in filter(None, (p.strip() for p in (text or "").split(";"))):
        key, sep, val = part.partition("=")
        bad = ConfigError(f"{where}: model argument {part!r} is not KEY=NUMBER")
        if not sep:
            raise bad
        try:
            out.append((key.strip(), int(val) if val.strip().lstrip("-").isdigit() else float(val)))
        except ValueError:
            raise bad from None
    return tuple(out)
