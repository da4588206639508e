"""Structural templates: a model's repeated blocks built once, the other instances mapped from it.

What it maps. A model of many alike layers (AlphaFold2's 48 Evoformer blocks run three times: 144
runs of 150 operators, 99.6% of its 21,687 operators) makes materialize's piece passes do the same
work over and over under other names. :func:`block_runs` finds, per graph, the *runs* of operators
of one numbered module (``blocks.7``: the operators whose module path starts with it, contiguous in
topological order) and gives each run a *structure*: two runs have one structure when operator ``k``
of one matches operator ``k`` of the other in everything but names (:meth:`_Keys.op_key`: kind,
signature, dimension sizes, costs, what it saves and whether it draws random numbers, whether it has
a backward; its tensors' shapes, dtypes, roles, batch axes, whether a detach cuts them off from the
loss, how many operators read each output; which operator of the run makes each input, or the kind
of the one outside the run that does; and what the kernel and saved-tensor choices read from
further away, decided here per operator: output layer, product with a weight, a gated linear unit's
gate, a mixture's combine, a fused GEMM's members, the readers of an attention's output). Per
materialization, :func:`block_map` groups the runs of one structure that are also placed alike (the
same :class:`~planlab.plan.plan.OpPlan` but for its name, the same
:class:`~planlab.plan.passes.layouts.OpForm`, the producers outside the run of the same form and
mesh). ``forward_pieces`` builds each group's first run and ``backward_pieces`` (in reverse
order) its last, and both map the group's other runs from it, operator by operator.

Why a mapped operator is the one building it makes. A piece pass's products for an operator (its
tasks, the bytes of the buffers they make, what its backward keeps) are a function of what the
structure and the placement fix, and of names: the operator's name, the buffers the passes before
gave it (``reads``, ``grads``) and the buffers named after its tensors and itself. The mapped
operator takes its template operator's tasks with those names replaced, each buffer found by its
*place* (:class:`Places`: its index among the buffers the operator reads and writes, or the tag of
one of its internal buffers). The map is taken only where it is one to one (the template's and the
instance's buffers each :func:`distinct`) and where the passes before gave the instance buffers of
the same kinds (``backward_pieces`` compares its gradients'); a buffer found in no place (another
operator's, an FP8 cast) or a ring attention's (its buffers in flight are sized per operator) has
the operator built as without a template. ``tests/test_template.py`` checks templated against
untemplated builds and that a wrong grouping is caught; ``benchmarks/same_programs.py`` compares
every golden case's Program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from planlab.graph.ir import Graph, Operator
from planlab.graph.random_ops import draws_random
from planlab.plan import buffer as buf_
from planlab.plan.buffer import Buffer, BufferKind
from planlab.plan.fused_gemms import fused_groups
from planlab.plan.saved import combined_outputs, glu_gate, output_layer, weight_matmul
from planlab.plan.passes.layouts import Layouts, batch_axes
from planlab.plan.shared_params import forward_only_of, no_grad_of


@dataclass(frozen=True)
class Run:
    """Operators ``start`` to ``start + length - 1`` (topological indices), one numbered module's, of
    structure ``structure`` (runs of one structure match operator by operator, names aside);
    ``outside``: (operator offset, input index) of each input an operator outside the run makes."""

    start: int
    length: int
    structure: int
    outside: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class BlockMap:
    """The repeated runs of one materialization: per operator (topological index) of a run that
    another run of the same structure and placement repeats, its offset in its run and its group
    (the starts of those runs, in order). A pass building operators in topological order builds
    the group's first run and maps the others from it (:meth:`first`); one building them in reverse
    order, the last (:meth:`last`)."""

    groups: tuple[tuple[int, ...], ...]
    of_op: Mapping[int, tuple[int, int]]  # operator -> (group, offset in its run)

    def first(self, i: int) -> int | None:
        """Operator ``i``'s template operator in its group's first run (None outside every group)."""
        got = self.of_op.get(i)
        return None if got is None else self.groups[got[0]][0] + got[1]

    def last(self, i: int) -> int | None:
        """Operator ``i``'s template operator in its group's last run (None outside every group)."""
        got = self.of_op.get(i)
        return None if got is None else self.groups[got[0]][-1] + got[1]


# the graph's memo key of :func:`block_runs` (a function of the graph alone, which the trace cache
# keeps with the graph, :func:`planlab.models.trace_cache.derived`)
BLOCK_RUNS_KEY = ("template: block runs",)


def block_runs(graph: Graph) -> tuple[Run, ...]:
    """The graph's runs of numbered modules with their structures (see the module docstring),
    memoized on the graph."""
    return graph.memo(BLOCK_RUNS_KEY, lambda: _block_runs(graph))


def _module_head(module: str) -> str | None:
    """The module path up to its first numbered part (``blocks.7`` of ``blocks.7.mlp.fc1``), None
    without one."""
    parts = module.split(".")
    for k, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: k + 1])
    return None


def _spans(graph: Graph) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of two or more operators of one numbered module (end exclusive)."""
    heads: dict[str, str | None] = {}
    spans, head, first = [], None, 0
    for i, op in enumerate((*graph.operators, None)):
        h = None
        if op is not None:
            h = heads.get(op.module, "")
            if h == "":
                h = heads[op.module] = _module_head(op.module)
        if h != head or h is None:
            if head is not None and i - first > 1:
                spans.append((first, i))
            head, first = h, i
    return spans


def _block_runs(graph: Graph) -> tuple[Run, ...]:
    ops, producer = graph.operators, graph.producer
    topo = graph.memo(("topological_index",), lambda: {op.name: i for i, op in enumerate(ops)})
    keys = _Keys(graph, topo)
    structures: dict[tuple[int, ...], int] = {}
    runs = []
    for s, e in _spans(graph):
        key = tuple(keys.op_key(ops[i], s, e) for i in range(s, e))
        outside = tuple(
            (i - s, j)
            for i in range(s, e)
            for j, t in enumerate(ops[i].inputs)
            if t in producer and not s <= topo[producer[t].name] < e
        )
        runs.append(Run(s, e - s, structures.setdefault(key, len(structures)), outside))
    return tuple(runs)


class _Keys:
    """Operators' keys in their runs (:meth:`op_key`), each a number: equal numbers for equal keys
    (each tensor's and each operator's key is hashed once; signatures, shared by their operators, by
    identity, which only ever tells equal ones apart)."""

    def __init__(self, graph: Graph, topo: Mapping[str, int]) -> None:
        self.graph, self.topo = graph, topo
        self.nograd, self.forward_only = no_grad_of(graph), forward_only_of(graph)
        self.fused, self.batch = fused_groups(graph), batch_axes(graph)
        self._tensors: dict[str, int] = {}
        self._numbers: dict[tuple, int] = {}
        self._signatures: dict[int, int] = {}

    def _number(self, key: tuple) -> int:
        return self._numbers.setdefault(key, len(self._numbers))

    def tensor(self, t: str) -> int:
        """What a tensor is, names aside: shape, dtype, role, batch axes, cut off from the loss."""
        got = self._tensors.get(t)
        if got is None:
            spec = self.graph.tensors[t]
            key = ("tensor", spec.shape, spec.dtype, spec.role, self.batch.get(t), t in self.nograd)
            got = self._tensors[t] = self._number(key)
        return got

    def op_key(self, op: Operator, s: int, e: int) -> int:
        """Operator ``op`` of the run from ``s`` to ``e`` (exclusive) with its names replaced by
        places: what two runs of one structure have alike operator by operator."""
        g, topo, tensor = self.graph, self.topo, self.tensor
        ins = []
        for t in op.inputs:
            p = g.producer.get(t)
            if p is None:
                ins.append(tensor(t))
            else:
                k = topo[p.name]
                ins.append((tensor(t), k - s if s <= k < e else p.kind, p.outputs.index(t)))
        group = self.fused.get(op.name)
        return self._number(
            (
                op.kind,
                self._signatures.setdefault(id(op.signature), len(self._signatures)),
                tuple(op.dim_sizes.items()),
                op.flops,
                op.bytes_moved,
                tuple(_slot(op, t) for t in op.saves),
                op.bwd_flops_ratio,
                op.add_once,
                draws_random(op),
                op.name in self.forward_only,
                tuple(ins),
                tuple((tensor(t), len(g.consumers.get(t, ()))) for t in op.outputs),
                self._kernel(op),
                None if group is None else (group.fusion, tuple(_place(topo[n], s, e) for n in group.ops)),
            )
        )

    def _kernel(self, op: Operator) -> tuple:
        """What the kernel and saved-tensor choices read beyond the operator's neighbours."""
        g = self.graph
        if op.kind in ("linear", "matmul"):
            return (output_layer(op, g), weight_matmul(op, g))
        if op.kind == "mul":
            gate, combined = glu_gate(op, g), combined_outputs(op, g)
            return (_slot(op, gate) if gate else None, _slot(op, combined) if combined else None)
        if op.kind == "activation":
            readers = g.consumers.get(op.outputs[0], ())
            return tuple(glu_gate(r, g) == op.outputs[0] for r in readers)
        if op.kind == "attention":
            return (_reader_chain(op, g),)
        return ()


def _place(k: int, s: int, e: int) -> int | None:
    """Operator ``k``'s offset in the run from ``s`` to ``e``, None outside it."""
    return k - s if s <= k < e else None


def _slot(op: Operator, t: str) -> tuple[str, int]:
    """Where tensor ``t`` is among ``op``'s inputs or outputs."""
    return ("in", op.inputs.index(t)) if t in op.inputs else ("out", op.outputs.index(t))


def _reader_chain(op: Operator, graph: Graph) -> tuple:
    """The kinds along the single readers of an attention's output (its fused kernel's storage is
    kept by the layer that reads it through views, :func:`~planlab.plan.saved.output_kept_by_reader`)."""
    t, chain = op.outputs[0], []
    while len(chain) < 16:
        readers = graph.consumers.get(t, ())
        if len(readers) != 1:
            break
        r = readers[0]
        chain.append((r.kind, _slot(r, t), r.saves.index(t) if t in r.saves else -1))
        t = r.outputs[0]
    return tuple(chain)


def block_map(graph: Graph, L: Layouts) -> BlockMap:
    """The groups of runs of one structure placed alike by layouts ``L`` (see the module docstring),
    of two runs or more."""
    ops = graph.operators
    found: dict[tuple, list[Run]] = {}
    for run in block_runs(graph):
        placed = tuple(_placement(L, ops[i]) for i in range(run.start, run.start + run.length))
        outside = tuple(_producer_form(L, graph, ops[run.start + k].inputs[j]) for k, j in run.outside)
        found.setdefault((run.structure, placed, outside), []).append(run)
    groups = [runs for runs in found.values() if len(runs) > 1]
    of_op = {run.start + k: (g, k) for g, runs in enumerate(groups) for run in runs for k in range(run.length)}
    return BlockMap(tuple(tuple(run.start for run in runs) for runs in groups), of_op)


def _placement(L: Layouts, op: Operator) -> tuple:
    p = L.op_plan[op.name]  # its dims, sizes and devices by their index (devices: hundreds of ints to hash)
    return (L.placement[op.name], p.stage, p.recompute, p.ring, p.offload, L.form(op).index)


def _producer_form(L: Layouts, graph: Graph, t: str) -> tuple:
    prod = graph.producer[t]
    return (L.form(prod).index, L.mesh[prod.name], prod.outputs.index(t))


@dataclass(frozen=True)
class Places:
    """Where each of some buffers of a template operator is: its place among the buffers the
    operator reads and writes (an index into ``reads + writes``), or the tag of one of its own
    internal buffers. The same places in an instance operator's ``reads + writes`` (which must be as
    many distinct buffers, :func:`distinct`) name its buffers (:meth:`take`): the renaming."""

    where: tuple[int | str, ...]

    @classmethod
    def of(cls, bufs: Iterable[Buffer], among: tuple[Buffer, ...], op: str) -> Places | None:
        """The places of ``bufs`` among ``among`` (distinct) and in operator ``op``'s internals;
        None if one is elsewhere (another operator's buffer, an FP8 cast)."""
        index = {b: k for k, b in enumerate(among)}
        where: list[int | str] = []
        for b in bufs:
            k = index.get(b)
            if k is None:
                name, sep, tag = b.tensor.partition(":")
                if b.kind is not BufferKind.INTERNAL or name != op or not sep or tag == "fp8":
                    return None
                k = tag
            where.append(k)
        return cls(tuple(where))

    def take(self, among: tuple[Buffer, ...], op: str) -> tuple[Buffer, ...]:
        """The buffers at these places among ``among`` and in operator ``op``'s internals."""
        return tuple([among[k] if type(k) is int else buf_.internal(op, k) for k in self.where])


def distinct(bufs: tuple[Buffer, ...]) -> bool:
    """Whether ``bufs`` are all different (a renaming place by place is then one to one)."""
    return len(set(bufs)) == len(bufs)
