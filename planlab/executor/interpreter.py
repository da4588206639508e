"""The interpreter: runs one device's Program on torch.distributed.

It only interprets: every decision (which collective, which slice, which
order) was made by ``materialize``. Each forward task runs an operator piece
under autograd on detached inputs; the matching backward task calls
``torch.autograd.grad`` on that piece alone, so the backward order is the
Program's, not autograd's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from planlab.errors import ExecutionError
from planlab.graph.ir import Graph, Operator, TensorArg
from planlab.plan.layout import Box
from planlab.plan.program import DeviceProgram, Program, Task, TaskKind, is_static


def _slices(region: Box | None):
    return tuple(slice(a, b) for a, b in region) if region is not None else ...


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def run_piece(op: Operator, task: Task, tensors: list[torch.Tensor], graph: Graph, microbatches: int):
    """Run one piece of ``op`` on local tensors; returns the output tensor(s)."""
    if op.kind == "reshape":
        return tensors[0].reshape(task.shape)
    if not task.lead and op.add_once:
        tensors = [None if k in op.add_once else x for k, x in enumerate(tensors)]
    if op.kind == "cross_entropy" and op.call.kwargs.get("reduction", "mean") == "mean":
        # A piece of a mean: sum its share and divide by the full count, so pieces add up.
        full = 1
        for name in op.signature.reduce:
            full *= op.dim_sizes[name]
        kwargs = dict(op.call.kwargs, reduction="sum")
        args = [tensors[a.index] if isinstance(a, TensorArg) else a for a in op.call.args]
        return F.cross_entropy(*args, **kwargs) / full
    sub = lambda a: tensors[a.index] if isinstance(a, TensorArg) else a  # noqa: E731
    args = [torch.fx.node.map_aggregate(a, sub) for a in op.call.args]
    kwargs = {k: torch.fx.node.map_aggregate(v, sub) for k, v in op.call.kwargs.items()}
    target = op.call.target
    if isinstance(target, str):
        return getattr(args[0], target)(*args[1:], **kwargs)
    return target(*args, **kwargs)


@dataclass
class TaskTiming:
    """Measured start and end of one task (seconds since the iteration began)."""

    action: str
    task: str
    kind: str
    start_s: float
    end_s: float


@dataclass
class Interpreter:
    """Runs ``program``'s tasks for ``device`` (= this rank)."""

    program: Program
    graph: Graph
    device: int
    module: nn.Module
    inputs: tuple[torch.Tensor, ...]
    groups: dict[tuple[int, ...], object]
    lr: float = 1e-3
    torch_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    record: bool = False

    def __post_init__(self) -> None:
        self.dp: DeviceProgram = self.program.devices[self.device]
        self.static: dict[str, torch.Tensor] = {}
        named = dict(self.module.named_parameters())
        self.leaves: list[tuple[str, torch.Tensor]] = []
        for p, box in self.dp.params:
            w = named[p].detach()[_slices(box)].clone().to(self.torch_device).requires_grad_(True)
            self.static[f"w:{p}"] = w
            self.static[f"wg:{p}"] = torch.zeros_like(w, requires_grad=False)
            self.leaves.append((p, w))
        for t, x in zip(self.graph.inputs, self.inputs):
            self.static[f"src:{t}"] = x.to(self.torch_device)
        for name, b in self.module.named_buffers():
            self.static[f"src:{name}"] = b.to(self.torch_device)
        self.optimizer = torch.optim.Adam([w for _, w in self.leaves], lr=self.lr) if self.leaves else None
        self.captured_grads: dict[str, torch.Tensor] = {}
        self.timeline: list[TaskTiming] = []
        self._backend = dist.get_backend() if dist.is_initialized() else "gloo"

    # -- buffers --------------------------------------------------------------
    def _get(self, name: str, mb: int) -> torch.Tensor:
        try:
            return self.static[name] if is_static(name) else self.bufs[(name, mb)]
        except KeyError:
            raise ExecutionError(f"device {self.device}: buffer {name!r} (micro-batch {mb}) was read before "
                                 "any task wrote it") from None

    def _put(self, name: str, mb: int, value: torch.Tensor, task: Task | None = None,
             accumulate: bool = False) -> None:
        store, key = (self.static, name) if is_static(name) else (self.bufs, (name, mb))
        region = task.region if task is not None and task.kind in (TaskKind.RECV, TaskKind.LOCAL) else None
        if region is None:
            store[key] = store[key] + value if accumulate and key in store else value
            return
        cur = store.get(key)
        new = torch.zeros(task.shape, dtype=value.dtype, device=value.device) if cur is None else cur.clone()
        if accumulate:
            new[_slices(region)] += value
        else:
            new[_slices(region)] = value
        store[key] = new

    # -- one iteration --------------------------------------------------------
    def run_iteration(self, *, capture_grads: bool = False) -> float:
        """Run every action of the schedule once; returns this device's share of the loss."""
        self.bufs: dict[tuple[str, int], torch.Tensor] = {}
        self.ctx: dict[tuple[str, int], tuple] = {}
        self.pending: list = []
        self.capture = capture_grads
        self.timeline = []
        loss = 0.0
        t0 = time.perf_counter()
        for action in self.dp.schedule:
            block = self.dp.block(action)
            for task in block.tasks:
                s = time.perf_counter()
                try:
                    self._run(task, action.microbatch)
                except ExecutionError:
                    raise
                except Exception as e:
                    raise ExecutionError(f"device {self.device}, action {action}, task {task}: "
                                         f"{type(e).__name__}: {e}") from e
                if self.record:
                    self.timeline.append(TaskTiming(str(action), task.name, task.kind.value,
                                                    s - t0, time.perf_counter() - t0))
                if task.kind is TaskKind.FORWARD and task.op == self.graph.producer[self.graph.loss].name:
                    if any(d == self.device and p for d, _, p in self.program.loss_holders):
                        loss += float(self.bufs[(f"a:{self.graph.loss}", action.microbatch)])
                for b in task.free:
                    self.bufs.pop((b, action.microbatch), None)
        for work, _ in self.pending:
            work.wait()
        self.pending = []
        return loss

    def _run(self, task: Task, mb: int) -> None:
        kind = task.kind
        if kind is TaskKind.FORWARD:
            self._forward(task, mb)
        elif kind is TaskKind.BACKWARD:
            self._backward(task, mb)
        elif kind is TaskKind.LOCAL:
            self._local(task, mb)
        elif kind is TaskKind.COLLECTIVE:
            self._collective(task, mb)
        elif kind is TaskKind.SEND:
            x = self._get(task.reads[0], mb)[_slices(task.region)].contiguous()
            self.pending.append((dist.isend(x, dst=task.peer, tag=task.axis), x))
        elif kind is TaskKind.RECV:
            shape = tuple(b - a for a, b in task.region)
            buf = torch.empty(shape, dtype=_dtype(task.dtype), device=self.torch_device)
            dist.recv(buf, src=task.peer, tag=task.axis)
            self._put(task.writes[0], mb, buf, task, task.accumulate)
        elif kind is TaskKind.OPTIMIZER:
            self._optimizer_step()
        else:  # pragma: no cover - TaskKind is closed
            raise ExecutionError(f"unknown task kind {kind}")

    def _forward(self, task: Task, mb: int) -> None:
        op = self.graph.op(task.op)
        ins = []
        for b in task.reads:
            v = self._get(b, mb)
            if not b.startswith("w:") and v.is_floating_point():
                v = v.detach().requires_grad_(True)
            ins.append(v)
        with torch.enable_grad():
            out = run_piece(op, task, ins, self.graph, self.program.microbatches)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        self.ctx[(task.op, mb)] = (ins, outs)
        for b, o in zip(task.writes, outs):
            self.bufs[(b, mb)] = o.detach()

    def _backward(self, task: Task, mb: int) -> None:
        op = self.graph.op(task.op)
        ins, outs = self.ctx.pop((task.op, mb))
        ys, gs = [], []
        for b, o, t in zip(task.reads, outs, op.outputs):
            if not o.requires_grad:
                continue
            if b:
                g = self._get(b, mb)
            elif t == self.graph.loss:
                g = torch.ones_like(o)
            else:
                continue
            ys.append(o)
            gs.append(g)
        wanted = [(k, x) for k, x in enumerate(ins) if task.writes[k] and x.requires_grad]
        if not ys or not wanted:
            grads = [None] * len(wanted)
        else:
            grads = torch.autograd.grad(ys, [x for _, x in wanted], gs, allow_unused=True)
        for (k, x), g in zip(wanted, grads):
            g = torch.zeros_like(x) if g is None else g
            w = task.writes[k]
            if w.startswith("wg:"):
                self.static[w] = self.static[w] + g
            else:
                self.bufs[(w, mb)] = g

    def _local(self, task: Task, mb: int) -> None:
        src = self._get(task.reads[0], mb)
        if task.name.startswith("load:") and task.axis >= 0:
            size = src.shape[task.axis] // self.program.microbatches
            src = src.narrow(task.axis, mb * size, size)
        x = src[_slices(task.src_region)]
        if task.region is None and not task.accumulate:
            x = x.clone()
        self._put(task.writes[0], mb, x, task, task.accumulate)

    def _collective(self, task: Task, mb: int) -> None:
        group = tuple(task.group)
        pg = self.groups[tuple(sorted(group))]
        if task.collective == "all_reduce" and (len(task.reads) > 1 or task.reads[0].startswith("wg:")):
            flat = torch.cat([self._get(b, mb).reshape(-1) for b in task.reads])
            dist.all_reduce(flat, group=pg)
            off = 0
            for b in task.reads:
                cur = self._get(b, mb)
                self.static[b] = flat[off:off + cur.numel()].view_as(cur).clone()
                off += cur.numel()
            return
        x = self._get(task.reads[0], mb).contiguous()
        n, me = len(group), group.index(self.device)
        order = sorted(group)
        if task.collective == "all_reduce":
            y = x.clone()
            dist.all_reduce(y, group=pg)
        elif task.collective == "all_gather":
            parts = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(parts, x, group=pg)
            y = torch.cat([parts[order.index(d)] for d in group], dim=task.axis)
        elif task.collective == "reduce_scatter":
            if self._backend == "nccl":
                chunks = [c.contiguous() for c in x.chunk(n, dim=task.axis)]
                y = torch.empty_like(chunks[me])
                dist.reduce_scatter(y, [chunks[group.index(d)] for d in order], group=pg)
            else:  # gloo has no reduce-scatter: all-reduce, keep our chunk
                z = x.clone()
                dist.all_reduce(z, group=pg)
                y = z.chunk(n, dim=task.axis)[me].contiguous()
        else:
            raise ExecutionError(f"collective {task.collective!r} is not supported by the executor")
        self._put(task.writes[0], mb, y, None, task.accumulate)

    def _optimizer_step(self) -> None:
        for p, w in self.leaves:
            g = self.static[f"wg:{p}"]
            if self.capture:
                self.captured_grads[p] = g.detach().clone()
            w.grad = g.detach().clone()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        for p, w in self.leaves:
            self.static[f"wg:{p}"] = torch.zeros_like(w, requires_grad=False)
