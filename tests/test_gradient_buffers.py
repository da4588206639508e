"""What a backward writes and a forward allocates, as PyTorch and the training software run them:
a constant (a ``*_like`` factory's zeros and their views) takes no gradient; the projections of one
of the software's fused GEMMs write one gradient of their shared input; a broadcast view
(``Tensor.expand``) allocates no storage of its own."""

from planlab.costmodel.software import load_software
from planlab.graph.ir import constant_tensors
from planlab.plan import materialize
from planlab.plan.buffer import BufferKind
from planlab.plan.fused_gemms import fused_groups
from planlab.search_spaces import Context, get_space

from conftest import traced

MEGATRON = load_software("megatron")  # fused_qkv and fused_gate_up


def _program(name: str, software=None):
    spec, g = traced(name, 8)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", 1, 1, 1), dict(dp=1, tp=1, pp=1, microbatch=1))
    return g, materialize(plan, g, software=software)


def _tasks(program, kind: str):
    dp = program.device(0)
    return [t for b in dp.blocks.values() for t in b.tasks if str(t).startswith(kind)]


def test_the_dispatch_zeros_take_no_gradient():
    """``scatter_add(zeros_like(x[:, :1]).expand(...), 1, slot, tokens)``: PyTorch's ``zeros_like``
    returns a tensor without ``requires_grad``, so the dispatch's backward computes the tokens'
    gradient only, and the zeros, their expand and the slice they were made like have no backward."""
    g, program = _program("deepseek-tiny")
    constants = constant_tensors(g)
    fills = [op for op in g.operators if op.kind == "fill_like"]
    assert fills and all(op.outputs[0] in constants for op in fills)
    scatters = [op for op in g.operators if op.kind == "scatter"]
    assert scatters and all(op.inputs[0] in constants and op.inputs[2] not in constants for op in scatters)
    backward = {t.op: t for t in _tasks(program, "B:")}
    for op in scatters:
        writes = backward[op.name].writes
        assert writes[0] is None and writes[2] is not None
        assert g.producer[op.inputs[0]].name not in backward  # the expand of the zeros
    assert not any(op.name in backward for op in fills)


def test_a_fused_gemm_writes_one_gradient_of_its_input():
    """Megatron-Core's ``linear_fc1`` (gate and up) and ``linear_qkv`` are one GEMM each way: the
    input-gradient product writes one gradient of the shared input, so the projections of a group
    write one contribution buffer and no local sum follows; without the fusion (``torch``'s
    separate ``nn.Linear`` layers) each writes its own and they are summed."""
    g, fused = _program("llama-tiny", MEGATRON)
    _, apart = _program("llama-tiny", load_software("torch"))
    groups = {grp for grp in fused_groups(g).values()}
    assert groups
    for name, program in (("fused", fused), ("apart", apart)):
        backward = {t.op: t for t in _tasks(program, "B:")}
        for grp in groups:
            bufs = {backward[n].writes[0] for n in grp.ops}
            assert len(bufs) == (1 if name == "fused" else len(grp.ops)), (name, grp)
    sums = lambda p: sum(1 for t in _tasks(p, "L:") if ":copy" in str(t))  # noqa: E731
    assert sums(fused) < sums(apart)
    assert _peak(fused) < _peak(apart)


def _peak(program) -> int:
    """Device 0's most bytes alive at once, its tasks replayed in order."""
    sizes: dict = {}
    peak = 0
    for action, task in program.device(0).tasks_in_order():
        sizes.update(((b, action.microbatch), n) for b, n in task.alloc)
        peak = max(peak, sum(sizes.values()))
        for b in task.free:
            sizes.pop((b, action.microbatch), None)
    return peak


def test_a_broadcast_view_allocates_its_input_not_its_size():
    """``Tensor.expand`` is a view with stride 0 along the new axes: the routing's slot index expanded
    over the hidden size (``tokens x top-k`` int64 numbers seen ``hidden`` times) allocates nothing
    but holds its input's storage, which its forward task is charged instead of the view's size."""
    g, program = _program("deepseek-tiny")
    made = {b.tensor: n for t in _tasks(program, "F:") for b, n in t.alloc if b.kind is BufferKind.ACTIVATION}
    expands = [op for op in g.operators if op.kind == "expand" and op.inputs[0] in made and op.outputs[0] in made]
    assert len(expands) >= 2  # the slot index and the zeros, per layer
    for op in expands:
        view, base = g.tensors[op.outputs[0]], g.tensors[op.inputs[0]]
        assert made[op.outputs[0]] == made[op.inputs[0]] < made[op.inputs[0]] * view.numel / base.numel, op.name
