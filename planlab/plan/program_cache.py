"""A cache of materialized Programs on disk, beside the trace cache (:mod:`planlab.models.trace_cache`),
so that a second ``planlab simulate`` of a plan file does not materialize it again.

An entry is keyed by everything :func:`~planlab.plan.software_passes.build_program` reads
(:class:`ProgramKey`): the trace key of the plan's model (which holds planlab's version and the
digest of its source, so an edited materialize misses), the digest of the plan as planlab writes
it, and the cost model's cluster, software and precision as values (a changed spec file misses
too; a calibration profile does not enter the Program). Entries live in the trace cache's folder,
one file per plan and cost model, written whole (a temporary file renamed into place); an entry that
does not load or holds another key is built again and written over. Only reduced Programs (one
representative per device class) are cached: a full one (stragglers) is built each time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from planlab.costmodel import CostModel
from planlab.costmodel.hardware import ClusterSpec
from planlab.costmodel.precision import Precision
from planlab.costmodel.software import SoftwareSpec
from planlab.graph.ir import Graph
from planlab.models.trace_cache import TraceKey, cache_dir, cacheable, read_entry, write_entry
from planlab.plan.plan import Plan
from planlab.plan.plan_file import plan_to_json
from planlab.plan.program import Program
from planlab.plan.software_passes import build_program

PROGRAM_FORMAT = 1  # the layout of an entry: (PROGRAM_FORMAT, ProgramKey, Program)


@dataclass(frozen=True)
class ProgramKey:
    """Everything a reduced Program of a plan file depends on."""

    trace: TraceKey
    plan_sha256: str
    cluster: ClusterSpec
    software: SoftwareSpec
    precision: Precision

    def file_name(self) -> str:
        """One file per plan and cost model (a stale entry is written over)."""
        what = repr(
            (self.plan_sha256, self.cluster.node.name, self.cluster.nodes, self.software.name, self.precision.name)
        )
        return f"program-{hashlib.sha256(what.encode()).hexdigest()[:32]}.pkl"


def cached_program(plan: Plan, graph: Graph, cost: CostModel, *, plan_text: str | None = None) -> Program:
    """The reduced Program of ``plan`` under ``cost`` (``build_program``'s), from the cache when
    an entry of the same :class:`ProgramKey` loads, else built and stored. ``plan_text``: the plan
    file ``plan`` was read from, whose digest then keys the entry (the same text is the same plan;
    writing a 1,024-device plan as JSON again to digest it takes about as long as simulating it);
    None: the plan as planlab writes it."""
    folder = cache_dir()
    if folder is None or not cacheable(plan.model):
        return build_program(plan, graph, cost)
    key = ProgramKey(
        TraceKey.of(plan.model, plan.global_batch),
        hashlib.sha256((plan_to_json(plan) if plan_text is None else plan_text).encode()).hexdigest(),
        cost.cluster,
        cost.software,
        cost.precision,
    )
    path = Path(folder) / key.file_name()
    program = read_entry(path, PROGRAM_FORMAT, key, Program)
    if program is None:
        program = build_program(plan, graph, cost)
        write_entry(folder, path, (PROGRAM_FORMAT, key, program))
    return program
