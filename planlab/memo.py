"""Simulated rows kept across explorations, so that a plan simulated once is not simulated again.

A caller exploring several spaces of one workload (a baseline, the grid, the grid's products with
other spaces) finds the same plans in many of them: the ``megatron`` baseline's plans are the
grid's, and a product space holds its factors' best. Passing one :class:`SimulationMemo` to each
:func:`planlab.explore` call (``memo=``) makes each of those plans simulated once: a candidate
whose plan the memo holds, for the same model, cluster, batch and software, takes the row the
simulation gave it then.

A plan is known by its priced identity (:func:`planlab.plan.software_passes.priced_identity`: the
whole Plan value but its space's name and the knobs no pass reads, which only label it) through a
SHA-256 digest of that value's ``repr``, every field typed as the dataclass holds it, so that two
plans share a row exactly when they are the same plan. The setup (:class:`planlab.explore.Setup`:
model, cluster, nodes, global batch, calibration profile, software, precision) keys the rows too:
a plan priced with DeepSpeed's software is another row than with Megatron-LM's. Files named in the
setup (a cluster spec, a software file, a profile) are taken as unchanged while the memo lives.

The memo also keeps each model's traced graph (:meth:`SimulationMemo.graph`, by model specification
and batch): the explorations of one workload then share one Graph object, read from the trace cache
(or traced) once, and with it the graph's memo (what the spaces, the screen's tables and materialize
derive from the graph alone), which the first exploration fills and the later ones find. A model's
code is taken as unchanged while the memo lives, as the setup's files are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from dataclasses import dataclass, field

from planlab.candidates import ROW_KEYS
from planlab.graph.ir import Graph
from planlab.models.spec import ModelSpec
from planlab.models.trace_cache import trace_model
from planlab.plan.plan import Plan
from planlab.plan.software_passes import priced_identity

DIGEST_KEY = "plan_digest"  # a worker's row carries its plan's digest with a memo (the parent takes it off)


def plan_digest(plan: Plan) -> str:
    """The SHA-256 hex digest of ``plan``'s priced identity (its ``repr``: every field, typed)."""
    return hashlib.sha256(repr(priced_identity(plan)).encode()).hexdigest()


@dataclass
class SimulationMemo:
    """The simulated rows (``planlab.candidates.ROW_KEYS``) of the plans explored so far, per setup
    and plan digest, owned by the caller that passes it to each exploration; ``reused`` counts the
    candidates that took a row from it instead of being simulated; ``graphs`` holds the traced graphs
    by model specification and batch (:meth:`graph`)."""

    rows: dict[Hashable, dict[str, dict]] = field(default_factory=dict)
    reused: int = 0
    graphs: dict[tuple[ModelSpec, int], Graph] = field(default_factory=dict)

    def graph(self, spec: ModelSpec, batch: int) -> Graph:
        """The graph of ``spec`` at ``batch`` samples: traced (or read from the trace cache,
        :func:`planlab.models.trace_cache.trace_model`) the first time it is asked for, the same object
        after (with the memo its earlier explorations filled)."""
        if (spec, batch) not in self.graphs:
            self.graphs[spec, batch] = trace_model(spec, batch)
        return self.graphs[spec, batch]

    def known(self, setup: Hashable) -> dict[str, dict]:
        """The rows of ``setup``'s plans by digest (the memo's own dict: rows recorded later show in it)."""
        return self.rows.setdefault(setup, {})

    def record(self, setup: Hashable, digest: str, row: dict) -> bool:
        """Keep ``row`` for the plan of ``digest``; False (and counted as reused) if the memo held it."""
        known = self.known(setup)
        if digest in known:
            self.reused += 1
            return False
        known[digest] = dict(row)
        return True

    def recorder(self, setup: Hashable) -> Recorder:
        """What one exploration of ``setup`` calls with each row a worker returns."""
        return Recorder(self, setup)


@dataclass
class Recorder:
    """Records the rows of one exploration of ``setup`` in ``memo``, each under the digest the
    worker put on it (``DIGEST_KEY``, taken off the row; none: a row resumed from the journal, or
    from a worker without the memo), and counts the rows the memo held already (``reused``)."""

    memo: SimulationMemo
    setup: Hashable
    reused: int = 0

    def __call__(self, result: dict) -> None:
        digest = result.pop(DIGEST_KEY, None)
        if digest is not None and not self.memo.record(self.setup, digest, {k: result[k] for k in ROW_KEYS}):
            self.reused += 1
