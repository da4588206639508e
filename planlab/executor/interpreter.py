"""The interpreter: runs one device's Program on torch.distributed.

It only interprets: every decision (which collective, which slice, which
order) was made by ``materialize``. A task runs by its kind and role alone
(``Interpreter.RUNS`` names the method for each); what it needs beyond them is a field of the task or
of its buffers. Each forward task runs an operator piece
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

from planlab.errors import ExecutionError
from planlab.executor import act_offload, all_to_all, offload, zero3
from planlab.executor.clip import clip_coefficient, local_square_sum, norm_weights
from planlab.executor.failures import Fault, Progress, TaskError, waited_on
from planlab.executor.randomness import PieceRandomness
from planlab.executor.pieces import run_piece
from planlab.executor.ring_attention import zigzag_tokens
from planlab.graph.ir import Graph, Operator
from planlab.models.vocab_parallel import VOCAB_EMBEDDINGS
from planlab.plan import buffer as buf_
from planlab.plan.buffer import GATHERED_KINDS, Buffer, BufferKind
from planlab.plan.layout import Box
from planlab.plan.plan import Action
from planlab.plan.program import DeviceProgram, Program, Recompute, Role, Task, TaskKind


def _slices(region: Box | None):
    return tuple(slice(a, b) for a, b in region) if region is not None else ...


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


try:  # the engine call behind torch.autograd.grad, without its per-call argument checks
    _run_backward = torch.autograd.Variable._execution_engine.run_backward  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover - other torch versions
    _run_backward = None


def _grad(ys: list[torch.Tensor], xs: list[torch.Tensor], gs: list[torch.Tensor], keep: bool = False) -> tuple:
    """``torch.autograd.grad(ys, xs, gs, retain_graph=keep, allow_unused=True)``; gradients of
    mismatched shape are refused here, as ``torch.autograd.grad`` would."""
    for y, g in zip(ys, gs):
        if y.shape != g.shape:
            raise ExecutionError(f"gradient of shape {tuple(g.shape)} for an output of shape {tuple(y.shape)}")
    if _run_backward is None:
        return torch.autograd.grad(ys, xs, gs, retain_graph=keep, allow_unused=True)
    return _run_backward(tuple(ys), tuple(gs), keep, False, tuple(xs), True, False)


@dataclass
class TaskTiming:
    """Measured start and end of one task on ``device`` (seconds since the iteration began)."""

    device: int
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
    progress: Progress | None = None  # where this rank is, for failure reports and the watchdog
    fault: Fault | None = None  # a test-only injected fault (PLANLAB_FAULT)
    shards: dict[str, torch.Tensor] | None = None  # this device's pieces (then ``module``'s may be meta)
    clip_grad_norm: float | None = None  # clip the global gradient norm (every rank's pieces) to this
    seed: int = 0  # the seed random operators draw from (planlab.executor.randomness)
    first_step: int = 0  # the training step of this run's first iteration (a resumed run's are later)

    def __post_init__(self) -> None:
        self.dp: DeviceProgram = self.program.devices[self.device]
        self.static: dict[Buffer, torch.Tensor] = {}
        # the buffers of each parameter's piece and its gradient, the Program's own (they key every step's tables)
        own = {b: b for blk in self.dp.blocks.values() for t in blk.tasks for b in t.reads + t.writes if b}
        self._weights = {p: own.get(buf_.weight(p), buf_.weight(p)) for p, _ in self.dp.params}
        self._grads = {p: own.get(buf_.weight_grad(p), buf_.weight_grad(p)) for p, _ in self.dp.params}
        named = dict(self.module.named_parameters()) if self.shards is None else {}
        self.leaves: list[tuple[str, torch.Tensor]] = []
        for p, box in self.dp.params:
            piece = self.shards[p] if self.shards is not None else named[p].detach()[_slices(box)].clone()
            w = piece.to(self.torch_device).requires_grad_(True)
            self.static[self._weights[p]] = w
            self.leaves.append((p, w))  # its gradient buffer is made at its first contribution
        self.set_inputs(self.inputs)
        for name, b in self.module.named_buffers():
            self.static[buf_.source(name)] = b.to(self.torch_device)
        self.zero = self._zero_buckets()
        zeroed = {p for bucket in self.zero.values() for p in bucket.params}
        # ZeRO-3: the flat shards are all this device keeps of those weights (planlab/executor/zero3.py);
        # a stage that reads another stage's unit (a recycling pass) reads its own gather, a variant
        key_of = {p: z.key for z in self.zero.values() if z.stage3 for p in z.params}
        self.unit_of = {Buffer(kind, p): key for p, key in key_of.items() for kind in GATHERED_KINDS}
        self.unit_of.update({b: key_of[b.tensor] for b in own if b.kind in GATHERED_KINDS and b.tensor in key_of})
        self.gathered: dict[tuple[Buffer, int], torch.Tensor] = {}
        if self.unit_of:
            full = {b.tensor for b in self.unit_of}
            self.leaves = [(p, w) for p, w in self.leaves if p not in full]
            for p in full:
                del self.static[self._weights[p]]
        offloaded = offload.offloaded_weights(self.dp)  # ZeRO-Offload: host masters, stepped on the host
        self.host_masters = offload.host_masters({hw: self._mastered(b) for hw, b in offloaded.items()}, self.lr)
        self.host: dict[Buffer, torch.Tensor] = {}  # the host's gradient copies, until their host step
        self.saved_host = act_offload.SavedOnHost(self.dp, self.torch_device)  # activation offload
        zeroed |= {b.tensor for b in offloaded.values() if b.kind is BufferKind.WEIGHT}
        plain = [w for p, w in self.leaves if p not in zeroed]
        self.optimizer = torch.optim.Adam(plain, lr=self.lr) if plain else None
        self.grad_norm = float("nan")  # the last step's global gradient norm (with clip_grad_norm)
        self._norm_weights = (
            norm_weights(self.program, self.device, self.zero) if self.clip_grad_norm is not None else {}
        )
        self._updating = False  # within this step's update (its first optimizer task has run)
        self.captured_grads: dict[str, torch.Tensor] = {}
        self.timeline: list[TaskTiming] = []
        self.steps_run = 0
        self._compiled: dict[tuple[int, str], tuple] = {}
        self._loss_buffer = own.get(buf_.activation(self.graph.loss), buf_.activation(self.graph.loss))
        self.step, self.action = 0, None
        self._backend = dist.get_backend() if dist.is_initialized() else "gloo"
        self.random = PieceRandomness(self.graph, self.program.microbatches, self.seed)

    def _zero_buckets(self) -> dict[Buffer, "_ZeroBucket"]:
        """ZeRO: per reduce-scattered gradient bucket, this device's shard of the flattened
        weights (fp32 master copy) with its own Adam, keyed by the shard gradient buffer."""
        out = {}
        for block in self.dp.blocks.values():
            for t in block.tasks:
                if t.role in (Role.SHARD_GRADS, Role.UNIT_GRADS):
                    params = tuple(b.tensor for b in t.reads)
                    flat = torch.cat([self.static[self._weights[p]].detach().reshape(-1) for p in params])
                    group = tuple(sorted(t.group))
                    n, me = len(group), group.index(self.device)
                    chunk = -(-flat.numel() // n)
                    flat = torch.nn.functional.pad(flat, (0, chunk * n - flat.numel()))
                    shard = flat[me * chunk : (me + 1) * chunk].clone().requires_grad_(True)
                    out[t.writes[0]] = _ZeroBucket(
                        params,
                        n,
                        me,
                        chunk,
                        shard,
                        torch.optim.Adam([shard], lr=self.lr),
                        t.writes[0],
                        group,
                        t.role is Role.UNIT_GRADS,
                        tuple(tuple(self.static[self._weights[p]].shape) for p in params),
                    )
        return out

    def _mastered(self, b: Buffer) -> torch.Tensor:
        """The device tensor an offloaded master copies: a weight piece, or a ZeRO shard (by its gradient)."""
        return self.static[self._weights[b.tensor]] if b.kind is BufferKind.WEIGHT else self.zero[b].shard

    def set_inputs(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Train on ``inputs`` (the whole global batch, as the model's example inputs) from now on."""
        for t, x in zip(self.graph.inputs, inputs):
            self.static[buf_.source(t)] = x.to(self.torch_device)

    # -- buffers --------------------------------------------------------------
    def _get(self, name: Buffer, mb: int) -> torch.Tensor:
        try:
            return self.static[name] if name.static else self.bufs[(name, mb)]
        except KeyError:
            w = self._weights.get(name.tensor) if name.kind is BufferKind.WEIGHT_GRAD else None
            if w is not None and w in self.static:  # no contribution yet: zero
                z = self.static[name] = torch.zeros_like(self.static[w], requires_grad=False)
                return z
            raise ExecutionError(
                f"device {self.device}: buffer '{name}' (micro-batch {mb}) was read before any task wrote it"
            ) from None

    def _put(
        self, name: Buffer, mb: int, value: torch.Tensor, task: Task | None = None, accumulate: bool = False
    ) -> None:
        store, key = (self.static, name) if name.static else (self.bufs, (name, mb))
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
        self.bufs: dict[tuple[Buffer, int], torch.Tensor] = {}
        self.ctx: dict[tuple[str, int], tuple] = {}
        self.pending: list = []
        self.posted: dict[tuple, tuple] = {}  # receives posted ahead of their action, by (action, task)
        self.overlapped: list = []
        self.capture = capture_grads
        self.timeline = []
        self.step, self.steps_run = self.steps_run, self.steps_run + 1
        self._updating = False
        step, progress, record, bufs = self.step, self.progress, self.record, self.bufs
        stamp, marks = self._stamp, []  # recorded: (action, task, start, end) stamps
        loss = 0.0
        last_mb = self.program.microbatches - 1
        t0 = stamp() if record else None
        for action in self.dp.schedule:
            mb = action.microbatch
            self.action = action
            if progress is not None:
                progress.phase(f"step {step}, action {action}")
            for x in action.posts:
                self._post(x, last_mb)
            for task, fn, label, frees, gathered, is_loss in self._steps(action):
                if task.final and mb != last_mb:
                    continue  # runs with the last micro-batch only
                if progress is not None:
                    progress.task(label)
                if record:
                    s = stamp()
                try:
                    fn(task, mb)
                except Exception as e:
                    raise TaskError(self.device, str(action), task, e, waited_on(task)) from e
                if record:
                    marks.append((action, task, s, stamp()))
                if is_loss:
                    loss += float(bufs[(self._loss_buffer, mb)])
                for b in frees:
                    bufs.pop((b, mb), None)
                for b in gathered:  # a ZeRO-3 layer's gathered weights: give the memory back
                    zero3.release(self, b, mb)
        if progress is not None and self.pending:
            progress.phase(
                f"step {step}, waiting for the sends to {sorted({t.peer for _, t, _ in self.pending})} to complete"
            )
        for work, task, _ in self.pending:
            try:
                work.wait()
            except Exception as e:
                raise TaskError(self.device, "end of step", task, e, waited_on(task)) from e
        self.pending = []
        self._finish_overlapped()
        if record:
            self.timeline = self._timings(t0, marks)
        return loss

    def _stamp(self):
        """Now: a CUDA event recorded on the current stream on a GPU, the monotonic clock on a CPU."""
        if self.torch_device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _timings(self, t0, marks: list) -> list[TaskTiming]:
        """The recorded stamps as seconds since ``t0`` (on a GPU after one synchronisation)."""
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)
            since = lambda e: t0.elapsed_time(e) / 1e3  # noqa: E731 - milliseconds between events
        else:
            since = lambda t: t - t0  # noqa: E731
        return [TaskTiming(self.device, str(a), t.name, t.kind.value, since(s), since(e)) for a, t, s, e in marks]

    def _finish_overlapped(self) -> None:
        """Wait for the overlapped gradient reductions and take their results."""
        for work, task, flat in self.overlapped:
            try:
                work.wait()
            except Exception as e:
                raise TaskError(self.device, "gradient reduction", task, e, waited_on(task)) from e
            if task.role is Role.UNIT_GRADS:
                zero3.take(self, task, flat)
            else:
                self._take_bucket(task, flat)
        self.overlapped = []

    def _steps(self, action) -> tuple:
        """A block's tasks ready to run, made once per block: ``(task, function, progress label,
        buffers freed after it, those of them that are ZeRO-3's gathered weights, whether it yields
        this device's loss)``."""
        key = (action.stage, action.phase)
        steps = self._compiled.get(key)
        if steps is None:
            dispatch = self._dispatch()
            loss_op = self.graph.producer[self.graph.loss].name
            holds_loss = any(d == self.device and p for d, _, p in self.program.loss_holders)
            steps = []
            for task in self.dp.blocks[key].tasks:
                fn = dispatch.get((task.kind, task.role))
                if fn is None:
                    raise ExecutionError(f"task {task} has kind {task.kind} and role {task.role!r}, which no code runs")
                if self.fault is not None and self.fault.task == task.name:
                    fn = self._with_fault(fn)
                steps.append(
                    (
                        task,
                        fn,
                        Progress.encode(str(task)),
                        task.free,
                        tuple(b for b in task.free if b in self.unit_of),
                        holds_loss and task.kind is TaskKind.FORWARD and task.op == loss_op,
                    )
                )
            steps = self._compiled[key] = tuple(steps)
        return steps

    def _with_fault(self, fn):
        """``fn`` preceded by the injected fault's trigger at its step and action."""
        fault = self.fault

        def run(task: Task, mb: int) -> None:
            if fault.step == self.step and fault.action in ("", str(self.action)):
                fault.trigger()
            fn(task, mb)

        return run

    # The method that runs each kind of task with each role, as ``method(task, microbatch)``.
    RUNS = {
        (TaskKind.FORWARD, Role.PLAIN): "_forward",
        (TaskKind.BACKWARD, Role.PLAIN): "_backward",
        (TaskKind.BACKWARD, Role.KEEP_GRAPH): "_backward_input",
        (TaskKind.LOCAL, Role.PLAIN): "_local",
        (TaskKind.LOCAL, Role.LOAD): "_load",
        (TaskKind.COLLECTIVE, Role.PLAIN): "_collective",
        (TaskKind.COLLECTIVE, Role.BUCKET): "_reduce_bucket",
        (TaskKind.COLLECTIVE, Role.SHARD_GRADS): "_zero_reduce_scatter",
        (TaskKind.COLLECTIVE, Role.GATHER_WEIGHTS): "_zero_all_gather",
        (TaskKind.COLLECTIVE, Role.UNIT_GATHER): "_unit_gather",
        (TaskKind.COLLECTIVE, Role.UNIT_GRADS): "_unit_reduce_scatter",
        (TaskKind.SEND, Role.PLAIN): "_send",
        (TaskKind.RECV, Role.PLAIN): "_recv",
        (TaskKind.OPTIMIZER, Role.PLAIN): "_optimizer",
        (TaskKind.OPTIMIZER, Role.SHARD_STEP): "_shard_step",
        (TaskKind.LOCAL, Role.TO_HOST): "_to_host",
        (TaskKind.OPTIMIZER, Role.HOST_STEP): "_host_step",
        (TaskKind.LOCAL, Role.TO_DEVICE): "_to_device",
        (TaskKind.LOCAL, Role.SAVE_TO_HOST): "_save_to_host",
        (TaskKind.LOCAL, Role.SAVE_TO_DEVICE): "_save_to_device",
    }

    def _dispatch(self) -> dict:
        """:data:`RUNS` as bound methods."""
        return {key: getattr(self, name) for key, name in self.RUNS.items()}

    def _unit_gather(self, task: Task, mb: int) -> None:
        zero3.gather(self, task, mb)

    def _unit_reduce_scatter(self, task: Task, mb: int) -> None:
        zero3.reduce_scatter(self, task, mb)

    def _run(self, task: Task, mb: int) -> None:
        """Run one task (``run_iteration`` uses the same dispatch, made once per block)."""
        fn = self._dispatch().get((task.kind, task.role))
        if fn is None:
            raise ExecutionError(f"task {task} has kind {task.kind} and role {task.role!r}, which no code runs")
        fn(task, mb)

    def _process_group(self, task: Task):
        """The process group of a collective's devices."""
        return self.groups[tuple(sorted(task.group))]

    def _send(self, task: Task, mb: int) -> None:
        x = self._get(task.reads[0], mb)[_slices(task.region)].contiguous()
        self.pending.append((dist.isend(x, dst=task.peer, tag=task.tag), task, x))

    def _recv_buffer(self, task: Task) -> torch.Tensor:
        shape = tuple(b - a for a, b in task.region)
        return torch.empty(shape, dtype=_dtype(task.dtype), device=self.torch_device)

    def _post(self, x: Action, last_mb: int) -> None:
        """Post the receives of action ``x`` ahead of it (``Action.posts``): ``irecv`` now, in order,
        waited for where ``x`` reads them (:meth:`_recv`)."""
        for t in self.dp.block(x).tasks:
            if t.kind is TaskKind.RECV and (not t.final or x.microbatch == last_mb):
                buf = self._recv_buffer(t)
                work = dist.irecv(buf, src=t.peer, tag=t.tag)
                self.posted[(x.stage, x.phase, x.microbatch, t.name, t.tag)] = (work, buf)

    def _recv(self, task: Task, mb: int) -> None:
        a = self.action
        got = self.posted.pop((a.stage, a.phase, mb, task.name, task.tag), None)
        if got is None:
            buf = self._recv_buffer(task)
            dist.recv(buf, src=task.peer, tag=task.tag)
        else:
            got[0].wait()
            buf = got[1]
        self._put(task.writes[0], mb, buf, task, task.accumulate)

    def _reads(self, task: Task) -> tuple:
        """``task``'s operator (or None) and ``(buffer, static?, detach?)`` per buffer it reads (a
        dictionary look-up and a tuple: cheap next to the kernels the task runs, so not cached)."""
        return (
            self.graph.op(task.op) if task.op else None,
            tuple(
                (b, b is not None and b.static, task.chunk >= 0 or b is None or b.kind is not BufferKind.WEIGHT)
                for b in task.reads
            ),
        )

    def _forward(self, task: Task, mb: int) -> None:
        op, reads = self._reads(task)
        static, bufs = self.static, self.bufs
        ins = []
        for k, (b, st, detach) in enumerate(reads):
            v = static.get(b) if st else bufs.get((b, mb))
            if v is None:
                v = self._get(b, mb)
            if task.slices and task.slices[k] is not None:  # a co-located chunk's slice
                v = v[_slices(task.slices[k])]
            if detach and v.is_floating_point():  # a leaf of this piece's own autograd graph
                v = v.detach().requires_grad_(True)
            ins.append(v)
        off, group = 0, None
        if op.kind in VOCAB_EMBEDDINGS:
            off = self._vocab_offset(task)
        elif task.ring is not None:
            group = self.groups[tuple(sorted(task.group))]
        elif task.group:  # a piece that agrees with the others on its group (vocab_cross_entropy)
            off = task.group.index(self.device) * ins[0].shape[-1]
            group = self.groups[tuple(sorted(task.group))]
        # a random operator draws what one process draws (planlab.executor.randomness)
        with self.random.piece(op, task.box, mb, self.first_step + self.step):
            self._compute(op, task, mb, ins, reads, off, group)

    def _compute(self, op: Operator, task: Task, mb: int, ins: list, reads: tuple, off: int, group) -> None:
        """Run the piece of a forward task on its inputs ``ins`` and store its outputs."""
        if task.recompute is Recompute.DROP:  # its backward runs after a second forward (REDO): keep no graph
            with torch.no_grad():
                out = run_piece(op, task, ins, self.graph, self.program.microbatches, off, group, mb)
            outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            for k, (b, o) in enumerate(zip(task.writes, outs)):
                if task.places and task.places[k] is not None:
                    self._add_into(b, mb, o, task.places[k])
                else:
                    self.bufs[(b, mb)] = o
            return
        # an offloaded piece's saved tensors go to its slots (planlab.executor.act_offload)
        with torch.enable_grad(), self.saved_host.hooks(task.op, task.chunk, mb):
            out = run_piece(op, task, ins, self.graph, self.program.microbatches, off, group, mb)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if self.unit_of and any(b in self.unit_of for b, _, _ in reads):
            outs = zero3.own_outputs(outs, [v for (b, _, _), v in zip(reads, ins) if b in self.unit_of])
        self.ctx[(task.op, task.chunk, mb)] = (ins, outs)
        for k, (b, o) in enumerate(zip(task.writes, outs)):
            if task.places and task.places[k] is not None:
                self._add_into(b, mb, o.detach(), task.places[k])
            else:
                self.bufs[(b, mb)] = o.detach()

    def _vocab_offset(self, task: Task) -> int:
        """The first vocabulary row of the embedding table piece ``task`` reads (its weight's box
        on this device, plus a co-located chunk's slice)."""
        boxes = self.__dict__.get("_boxes")
        if boxes is None:
            boxes = self._boxes = {p: box for p, box in self.dp.params}
        table = task.reads[1].tensor if len(task.reads) > 1 else ""
        box = boxes.get(table)
        off = box[0][0] if box else 0
        if task.slices and len(task.slices) > 1 and task.slices[1] is not None:
            off += task.slices[1][0][0]
        return off

    def _backward_input(self, task: Task, mb: int) -> None:
        """Zero-bubble's ``I``: the inputs' gradients, keeping the graph for the ``W`` task."""
        self._backward(task, mb, keep=True)

    def _backward(self, task: Task, mb: int, keep: bool = False) -> None:
        op = self._reads(task)[0]
        key = (task.op, task.chunk, mb)
        ins, outs = self.ctx[key] if keep else self.ctx.pop(key)
        ys, gs = [], []
        bufs, loss = self.bufs, self.graph.loss
        for j, (b, o, t) in enumerate(zip(task.reads, outs, op.outputs)):
            if not o.requires_grad:
                continue
            if b:
                g = bufs.get((b, mb))
                if g is None:
                    g = self._get(b, mb)
                if task.slices and task.slices[j] is not None:  # a co-located chunk's slice
                    g = g[_slices(task.slices[j])]
            elif t == loss:
                g = torch.ones_like(o)
            else:
                continue
            ys.append(o)
            gs.append(g)
        writes = task.writes
        wanted = [(k, x) for k, x in enumerate(ins) if writes[k] and x.requires_grad]
        if not ys or not wanted:
            grads = [None] * len(wanted)
        else:
            grads = _grad(ys, [x for _, x in wanted], gs, keep)
        if not keep:
            self.saved_host.release(task.op, task.chunk, mb)
        static = self.static
        for (k, x), g in zip(wanted, grads):
            g = torch.zeros_like(x) if g is None else g
            w = task.writes[k]
            if task.places and task.places[k] is not None:  # a co-located chunk adds its share
                self._add_into(w, mb, g, task.places[k])
            elif w.kind is BufferKind.WEIGHT_GRAD:  # weight gradients add up (out of place: g may alias a buffer)
                static[w] = static[w] + g if w in static else g
            else:
                self.bufs[(w, mb)] = g

    def _add_into(self, name: Buffer, mb: int, value: torch.Tensor, place: tuple) -> None:
        """Add ``value`` into ``region`` of buffer ``name`` (made of zeros of ``shape`` by the first
        chunk that writes it): the co-located chunks of one piece fill or sum it in turn. In place:
        nothing reads the buffer before its last chunk has written it."""
        region, shape = place
        store, key = (self.static, name) if name.static else (self.bufs, (name, mb))
        cur = store.get(key)
        if cur is None:
            cur = store[key] = torch.zeros(shape, dtype=value.dtype, device=value.device)
        cur[_slices(region)] += value

    def _local(self, task: Task, mb: int) -> None:
        src = self._get(task.reads[0], mb)
        # a view (or src itself): no buffer is ever changed in place, so no copy is needed
        x = src if task.src_region is None else src[_slices(task.src_region)]
        self._put(task.writes[0], mb, x, task, task.accumulate)

    def _load(self, task: Task, mb: int) -> None:
        """A micro-batch's slice of a source tensor (along its batch ``axis``), then its piece (of the
        tensor's sequence in zigzag order, where the task's ``order`` says so)."""
        src = self._get(task.reads[0], mb)
        if task.order is not None:
            src = zigzag_tokens(src, task.order)
        if task.axis >= 0:
            size = src.shape[task.axis] // self.program.microbatches
            src = src.narrow(task.axis, mb * size, size)
        x = src if task.src_region is None else src[_slices(task.src_region)]
        self._put(task.writes[0], mb, x, task, task.accumulate)

    def _reduce_bucket(self, task: Task, mb: int) -> None:
        """All-reduce a bucket of weight gradients as one flat buffer; overlapped, the optimizer
        takes its result (:meth:`_finish_overlapped`)."""
        pg = self._process_group(task)
        flat = torch.cat([self._get(b, mb).reshape(-1) for b in task.reads])
        if task.overlap:  # runs while the backward goes on; the optimizer waits for it
            self.overlapped.append((dist.all_reduce(flat, group=pg, async_op=True), task, flat))
            return
        dist.all_reduce(flat, group=pg)
        self._take_bucket(task, flat)

    def _take_bucket(self, task: Task, flat: torch.Tensor) -> None:
        """The reduced gradients of a bucket: views of the flat buffer it was reduced in."""
        off = 0
        for b in task.reads:
            cur = self._get(b, 0)
            self.static[b] = flat[off : off + cur.numel()].view_as(cur)  # views of a fresh buffer
            off += cur.numel()

    def _collective(self, task: Task, mb: int) -> None:
        """A layout conversion's collective on one buffer."""
        group = tuple(task.group)
        pg = self._process_group(task)
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
        elif task.collective == "all_to_all":  # one shard for another: cut and joined as task.exchange says
            y = all_to_all.exchange(x, group, self.device, task.exchange, task.shape, pg)
        else:
            raise ExecutionError(f"collective {task.collective!r} is not supported by the executor")
        self._put(task.writes[0], mb, y, None, task.accumulate)

    def _zero_reduce_scatter(self, task: Task, mb: int) -> None:
        """Sum the bucket's gradients over the group; keep this device's shard of the sum."""
        pg = self._process_group(task)
        z = self.zero[task.writes[0]]
        flat = torch.cat([self._get(b, 0).reshape(-1) for b in task.reads])
        flat = torch.nn.functional.pad(flat, (0, z.chunk * z.n - flat.numel()))
        if self._backend == "nccl":
            out = torch.empty(z.chunk, dtype=flat.dtype, device=flat.device)
            dist.reduce_scatter_tensor(out, flat, group=pg)
        else:  # gloo has no reduce-scatter: all-reduce, keep our shard
            dist.all_reduce(flat, group=pg)
            if self.capture:
                off = 0
                for p in z.params:
                    w = self.static[self._weights[p]]
                    self.captured_grads[p] = flat[off : off + w.numel()].view_as(w).clone()
                    off += w.numel()
            out = flat[z.me * z.chunk : (z.me + 1) * z.chunk]
        self.static[task.writes[0]] = out
        for p in z.params:  # the next step's gradients start from zero
            self.static.pop(self._grads[p], None)

    def _zero_all_gather(self, task: Task, mb: int) -> None:
        """Gather the updated shards and write them into this device's weights."""
        pg = self._process_group(task)
        z = self.zero[task.reads[0].with_kind(BufferKind.SHARD_GRAD)]  # the bucket's shard gradient
        parts = [torch.empty_like(z.shard) for _ in range(z.n)]
        dist.all_gather(parts, z.shard.detach(), group=pg)
        flat = torch.cat(parts)
        off = 0
        with torch.no_grad():
            for p in z.params:
                w = self.static[self._weights[p]]
                w.copy_(flat[off : off + w.numel()].view_as(w))
                off += w.numel()

    def _start_update(self) -> None:
        """Before the step's first optimizer task: wait for the overlapped reductions; capture, clip."""
        self._finish_overlapped()
        if not self._updating:  # every gradient is reduced: capture, clip
            self._updating = True
            self._before_update()

    def _shard_step(self, task: Task, mb: int) -> None:
        """Adam on a ZeRO shard, with the shard gradient the task reads."""
        self._start_update()
        z = self.zero[task.reads[0]]
        if z.stage3:  # the shard gradient was summed over the micro-batches; the next step's starts at zero
            grad = self.static.pop(task.reads[0], None)
            grad = torch.zeros_like(z.shard) if grad is None else grad
        else:
            grad = self.static[task.reads[0]]
        z.shard.grad = grad.detach()
        z.optimizer.step()
        z.optimizer.zero_grad(set_to_none=True)

    def _to_host(self, task: Task, mb: int) -> None:
        """ZeRO-Offload: the reduced (and clipped) gradients copied into host memory; the device's
        next step starts from zero."""
        self._start_update()
        grads = []
        for b in task.reads:
            z = self.zero.get(b) if b.kind is BufferKind.SHARD_GRAD else None
            if z is not None and z.stage3:  # summed over the micro-batches: taken
                g = self.static.pop(b, None)
                grads.append(torch.zeros_like(z.shard) if g is None else g)
            else:
                grads.append(self._get(b, 0))
                if b.kind is BufferKind.WEIGHT_GRAD:
                    self.static.pop(b, None)
        self.host.update(zip(task.writes, offload.copy_to_host(grads)))

    def _host_step(self, task: Task, mb: int) -> None:
        """ZeRO-Offload: Adam on the host's masters."""
        offload.host_step(task, self.host_masters, self.host)

    def _to_device(self, task: Task, mb: int) -> None:
        """ZeRO-Offload: the updated masters copied into the device's weights or shard."""
        offload.copy_to_device(task, self.host_masters)

    def _save_to_host(self, task: Task, mb: int) -> None:
        """Activation offload: the piece's saved activations copied into host memory."""
        self.saved_host.to_host(task, mb)

    def _save_to_device(self, task: Task, mb: int) -> None:
        """Activation offload: the same copied back ahead of the piece's backward."""
        self.saved_host.to_device(task, mb)

    def _optimizer(self, task: Task, mb: int) -> None:
        """Adam on the pieces held whole."""
        self._start_update()
        self._optimizer_step()

    def _before_update(self) -> None:
        """Before the step's first optimizer task: capture the gradients of pieces updated whole
        (for the numeric check; ZeRO shards are captured at their reduction) and clip every
        gradient to the global norm (one all-reduce of a float64 over every rank)."""
        zeroed = {p for bucket in self.zero.values() for p in bucket.params}
        if self.capture:
            for p, _ in self.leaves:
                if p not in zeroed:
                    self.captured_grads[p] = self._get(self._grads[p], 0).detach().clone()
            for z in self.zero.values():  # ZeRO-3 units: gathered from every replica's shard
                if z.stage3:
                    grad = self.static.get(z.key)
                    grad = torch.zeros_like(z.shard) if grad is None else grad
                    self.captured_grads.update(zero3.full_gradients(z, grad, self.groups[z.group]))
        if self.clip_grad_norm is None:
            return
        grads = {b: self.static[b] for b in self._norm_weights if b in self.static}
        total = local_square_sum(grads, self._norm_weights).to(self.torch_device)
        if dist.is_initialized():
            dist.all_reduce(total)
        self.grad_norm = float(total) ** 0.5
        coef = clip_coefficient(self.grad_norm, self.clip_grad_norm)
        for b, g in grads.items():
            self.static[b] = g * coef  # out of place: a gradient may be a view of a reduced buffer

    def _optimizer_step(self) -> None:
        zeroed = {p for bucket in self.zero.values() for p in bucket.params}
        for p, w in self.leaves:
            if p in zeroed:
                continue
            g = self._get(self._grads[p], 0)
            w.grad = g.detach()  # Adam only reads it
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        for p, _ in self.leaves:  # the next step's gradients start from zero (see _get)
            if p not in zeroed:
                self.static.pop(self._grads[p], None)


@dataclass
class _ZeroBucket:
    """One ZeRO bucket on this device: its weights (in flattening order), the group size, this
    device's position, the shard length, the fp32 shard and its optimizer; its shard gradient
    buffer, its group, whether it is a ZeRO-3 unit (weights sharded too) and the weights' shapes."""

    params: tuple[str, ...]
    n: int
    me: int
    chunk: int
    shard: torch.Tensor
    optimizer: torch.optim.Optimizer
    key: Buffer | None = None
    group: tuple[int, ...] = ()
    stage3: bool = False
    shapes: tuple[tuple[int, ...], ...] = ()
