"""The cost tables of the ``alpa`` space's integer program: per operator and strategy (its split
over a stage's ``dp x tp`` logical mesh) the compute, gradient-synchronisation and memory costs,
and per producer -> consumer edge the resharding cost between their strategies.

A strategy gives each mesh axis a dimension of the operator (or None: replicated along that
axis). Under it, a tensor of the operator is, per mesh axis, sharded along the tensor axis that
carries the dimension (``S(i)``), held as partial sums (``P``: an output when the dimension is a
reduction) or replicated (``R``), as materialize lays it out. An edge converts the producer's
layout of a tensor into the consumer's, one collective per mesh axis that differs
(:mod:`planlab.plan.redistribute`): ``P -> R`` all-reduce, ``P -> S`` reduce-scatter, ``S -> R``
all-gather, ``R -> S`` a local slice (free), ``S(i) -> S(j)`` all-to-all; and in the backward the
gradient back (a consumer that splits along a dimension its input lacks leaves partial
gradients). A partial sum over data-parallel replicas (a consumer splits its batch along an axis
along which the producer splits nothing, the tensor has no batch axis) stays one until it reaches
a weight, reduced once a step, as materialize does (:mod:`planlab.plan.partial_grads`). Every
collective is priced by the cost model on the stage's device groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planlab.costmodel import CostModel
from planlab.graph.ir import Graph, Operator
from planlab.plan.program import Precision

Strategy = tuple  # per mesh axis: a dimension name or None

R, P = "R", "P"  # replicated, partial; a sharded placement is the tensor axis index (an int)


@dataclass(frozen=True)
class Mesh2D:
    """A stage's logical mesh: ``sizes`` per axis (dp, tp), devices row-major from 0."""

    sizes: tuple[int, ...]

    def group(self, axis: int) -> tuple[int, ...]:
        """The devices of stage 0 that vary along ``axis`` (the others at 0)."""
        stride = math.prod(self.sizes[axis + 1 :])
        return tuple(i * stride for i in range(self.sizes[axis]))


class CostTables:
    """Strategies and costs of one graph on one mesh with ``microbatches`` micro-batches (seconds
    per iteration, bytes per device)."""

    def __init__(self, graph: Graph, cost: CostModel, precision: Precision, mesh: Mesh2D, microbatches: int) -> None:
        self.g, self.cost, self.prec, self.mesh, self.m = graph, cost, precision, mesh, microbatches
        self.batch = graph.batch_label
        self._strategies: dict[str, tuple[Strategy, ...]] = {}
        self._coll: dict[tuple, float] = {}

    # -- strategies ----------------------------------------------------------------
    def has_batch(self, tensor: str) -> bool:
        spec = self.g.tensors[tensor]
        return any(self.g.labels.get((tensor, i)) == self.batch for i in range(len(spec.shape)))

    def _fits(self, op: Operator, dim: str, pieces: int) -> bool:
        size = op.dim_sizes[dim]
        if self.g.labels and self.g.dim_label(op, dim) == self.batch:
            if size % self.m:
                return False
            size //= self.m
        return size % pieces == 0

    def strategies(self, op: Operator) -> tuple[Strategy, ...]:
        """The op's strategies: on a one-axis mesh (the other of size 1) replication or any
        splittable dimension; on a two-axis mesh the first (data) axis replicates or splits the
        batch, the second any other splittable dimension (Alpa's 2-d meshes, pruned to keep the
        program small). A dimension must split evenly (the batch per micro-batch)."""
        got = self._strategies.get(op.name)
        if got is not None:
            return got
        sizes = self.mesh.sizes
        dims = op.splittable_dims()
        batch = self.g.dim_with_label(op, self.batch) if self.g.labels else None
        per_axis: list[list] = []
        for a, n in enumerate(sizes):
            if n == 1:
                per_axis.append([None])
            elif a == 0 and sizes[1] > 1:
                per_axis.append([None] + ([batch] if batch in dims else []))
            else:
                per_axis.append([None] + list(dims))
        out = []
        for d0 in per_axis[0]:
            for d1 in per_axis[1]:
                if d0 is not None and d0 == d1:
                    continue
                s = (d0, d1)
                if all(d is None or self._fits(op, d, n) for d, n in zip(s, sizes)):
                    out.append(s)
        self._strategies[op.name] = got = tuple(out)
        return got

    # -- layouts -------------------------------------------------------------------
    def placement(self, op: Operator, tensor: str, dim: str | None, output: bool):
        if dim is None:
            return R
        for i, ax in enumerate(op.axes_of(tensor)):
            if ax and ax[0] == dim:
                return i
        if output and dim in op.signature.reduce:
            return P
        return R

    def layout(self, op: Operator, tensor: str, s: Strategy, output: bool) -> tuple:
        return tuple(self.placement(op, tensor, d, output) for d in s)

    def grad_layout(self, op: Operator, tensor: str, s: Strategy) -> tuple:
        """The layout of the gradient ``op``'s backward produces for its input ``tensor``."""
        return tuple(P if (p == R and d is not None) else p for p, d in zip(self.layout(op, tensor, s, False), s))

    # -- prices --------------------------------------------------------------------
    def _collective_s(self, kind: str, nbytes: float, axis: int) -> float:
        key = (kind, round(nbytes), axis)
        t = self._coll.get(key)
        if t is None:
            t = self._coll[key] = self.cost.collective_time_s(kind, nbytes, self.mesh.group(axis))
        return t

    def convert_s(self, src: tuple, dst: tuple, nbytes: float) -> float:
        """Seconds to turn layout ``src`` into ``dst`` (P in ``dst`` means R) of a tensor of ``nbytes``."""
        total = 0.0
        sizes = self.mesh.sizes
        for a, (p, q) in enumerate(zip(src, dst)):
            q = R if q == P else q
            if p == q or sizes[a] == 1:
                continue
            other = math.prod(n for b, n in enumerate(sizes) if b != a and isinstance(dst[b], int))
            full = nbytes / other
            if p == P:
                kind = "all_reduce" if q == R else "reduce_scatter"
            elif p == R:
                continue  # a local slice
            elif q == R:
                kind = "all_gather"
            else:
                kind, full = "all_to_all", full / sizes[a]
            total += self._collective_s(kind, full, a)
        return total

    def tensor_bytes(self, tensor: str) -> float:
        """Bytes of ``tensor`` per micro-batch (activation precision)."""
        spec = self.g.tensors[tensor]
        n = spec.numel / (self.m if self.has_batch(tensor) else 1)
        return n * self.prec.activation_bytes

    def edge_costs(self, prod: Operator, cons: Operator, tensor: str) -> np.ndarray:
        """Per iteration: forward conversion of ``tensor`` and the backward one of its gradient."""
        ps, cs = self.strategies(prod), self.strategies(cons)
        nbytes = self.tensor_bytes(tensor)
        out = np.zeros((len(ps), len(cs)))
        whole = self.has_batch(tensor)
        batch = self.g.dim_with_label(cons, self.batch) if self.g.labels and not whole else None
        for i, sp in enumerate(ps):
            lp = self.layout(prod, tensor, sp, True)
            want_grad = tuple(R if p == P else p for p in lp)
            for j, sc in enumerate(cs):
                fwd = self.convert_s(lp, self.layout(cons, tensor, sc, False), nbytes)
                grad = self.grad_layout(cons, tensor, sc)
                if batch is not None:  # a partial sum over data-parallel replicas stays one (deferred)
                    grad = tuple(w if d == batch and q is None else g for g, w, d, q in zip(grad, want_grad, sc, sp))
                bwd = self.convert_s(grad, want_grad, nbytes)
                out[i, j] = (fwd + bwd) * self.m
        return out

    def node_costs(self, op: Operator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per strategy: seconds per iteration (compute of every micro-batch's forward and
        backward, and the once-a-step gradient all-reduce of weights whose gradient is partial over
        an axis, :mod:`planlab.plan.partial_grads`'s deferred axes among them),
        static bytes (weights, gradients, optimizer states) and the activation bytes one
        micro-batch saves for the backward."""
        ss = self.strategies(op)
        time, static, act = np.zeros(len(ss)), np.zeros(len(ss)), np.zeros(len(ss))
        dt = self.prec.compute_dtype
        per_param = self.prec.param_bytes + self.prec.grad_bytes + self.prec.optimizer_bytes
        batched = any(self.has_batch(t) for t in op.inputs + op.outputs)
        div = self.m if batched else 1
        for k, s in enumerate(ss):
            pieces = math.prod(n for d, n in zip(s, self.mesh.sizes) if d is not None)
            f, b = op.flops / pieces / div, op.bytes_moved / pieces / div
            t = self.cost.compute_time_s(flops=f, bytes_moved=b, dtype=dt)
            t += self.cost.compute_time_s(flops=f * op.bwd_flops_ratio, bytes_moved=b * op.bwd_flops_ratio, dtype=dt)
            t *= self.m
            for tensor in op.inputs:
                spec = self.g.tensors[tensor]
                if spec.role != "param":
                    continue
                lay = self.layout(op, tensor, s, False)
                shard = math.prod(n for p, n in zip(lay, self.mesh.sizes) if isinstance(p, int))
                static[k] += spec.numel / shard * per_param
                for a, (p, d) in enumerate(zip(lay, s)):
                    # partial gradient over axis a: the operator splits along it, or (nothing it
                    # reads or makes has the batch) its consumers split their batch along it and
                    # leave it partial sums over those replicas (edge_costs), reduced once a step
                    deferred = d is None and not batched and bool(self.g.labels)
                    if p == R and (d is not None or deferred) and self.mesh.sizes[a] > 1:
                        other = math.prod(
                            n for b2, n in enumerate(self.mesh.sizes) if b2 != a and isinstance(lay[b2], int)
                        )
                        t += self._collective_s("all_reduce", spec.numel * self.prec.grad_bytes / other, a)
            for tensor in op.saves:
                if self.g.tensors[tensor].role == "param":
                    continue
                out = tensor in op.outputs
                lay = self.layout(op, tensor, s, out)
                shard = math.prod(n for p, n in zip(lay, self.mesh.sizes) if isinstance(p, int))
                act[k] += self.tensor_bytes(tensor) / shard
            time[k] = t
        return time, static, act
