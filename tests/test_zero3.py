"""ZeRO-3 (FSDP full sharding): the collectives each layer issues, the static memory a device
keeps, the simulator's overlap of prefetched gathers (exact times), and numerics on 2 gloo ranks."""

import json
from collections import Counter

import pytest

from planlab.cli import GRAD_TOL, LOSS_TOL
from planlab.costmodel import CostModel
from planlab.errors import InfeasiblePlan, PlanFileError
from planlab.executor import launch_local
from planlab.explore import memory_lower_bound_bytes
from planlab.plan import FP32, Block, DeviceProgram, Program, Task, TaskKind, materialize, plan_from_json, plan_to_json
from planlab.plan.buffer import Buffer, BufferKind, activation, shard_grad, shard_weight, weight
from planlab.plan.plan_file import plan_to_dict
from planlab.plan.program import Role
from planlab.plan.zero import unit_key
from planlab.search_spaces import Context, get_space
from planlab.simulator import find_deadlock, simulate

from conftest import traced
from test_simulator import IdealCost

# gpt-tiny's layers, in forward order; the position embedding's gradient is a partial sum over dp
# like every weight's (planlab.plan.partial_grads), so it is sharded too
UNITS = ["wte", "wpe", "blocks.0", "blocks.1", "ln_f", "lm_head"]


def _program(n, knobs, zero, model="gpt-tiny"):
    spec, g = traced(model, 8)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", n, n, 1), dict(knobs, zero=zero))
    return plan, g, materialize(plan, g)


@pytest.mark.parametrize(
    "param, unit",
    [
        ("blocks.3.attn.q.weight", "blocks.3"),
        ("wte.weight", "wte"),
        ("model.layers.12.mlp.up_proj.weight", "model.layers.12"),
        ("model.norm.weight", "model"),
        ("scale", "scale"),
    ],
)
def test_unit_of_a_parameter(param, unit):
    assert unit_key(param) == unit


@pytest.mark.parametrize("micro", [1, 2])
def test_each_layer_gathers_twice_and_reduce_scatters_once_per_microbatch(micro):
    plan, g, prog = _program(2, dict(dp=2, tp=1, pp=1, microbatch=4 // micro), 3)
    assert prog.microbatches == micro
    find_deadlock(prog)
    dev = prog.devices[0]
    count = Counter(
        (t.collective, t.name.split("#")[1])
        for _, t in dev.tasks_in_order()
        if "#" in t.name and t.kind is TaskKind.COLLECTIVE
    )
    assert count == Counter({(c, u): n * micro for u in UNITS for c, n in (("all_gather", 2), ("reduce_scatter", 1))})
    # the update steps each unit's shard; no weight all-gather follows it
    update = dev.blocks[(0, "U")].tasks
    assert [t.name.split("#")[1] for t in update if t.kind is TaskKind.OPTIMIZER and "#" in t.name] == UNITS
    assert not any(t.kind is TaskKind.COLLECTIVE for t in update)
    # forward prefetch: each layer's gather is issued before the previous layer's first forward task
    fwd = list(dev.blocks[(0, "F")].tasks)
    at = {t.name.split("#")[1]: i for i, t in enumerate(fwd) if t.name.startswith("zero3-gather-f")}
    first = {u: min(i for i, t in enumerate(fwd) if any(_gathered(r, u) for r in t.reads)) for u in UNITS}
    assert [at[u] < first[u] for u in UNITS] == [True] * len(UNITS)
    assert [at[UNITS[k + 1]] < first[UNITS[k]] for k in range(len(UNITS) - 1)] == [True] * (len(UNITS) - 1)
    # reshard after forward: a layer's gathered weights are freed together, after its last forward task
    for u in UNITS:
        frees = [i for i, t in enumerate(fwd) if any(_gathered(b, u) for b in t.free)]
        assert frees == [max(i for i, t in enumerate(fwd) if any(_gathered(r, u) for r in t.reads))]


def _gathered(b, unit: str) -> bool:
    """``b`` is a weight of ``unit`` gathered for the forward."""
    return b is not None and b.kind is BufferKind.GATHERED_FORWARD and unit_key(b.tensor) == unit


@pytest.mark.parametrize(
    "n, knobs",
    [
        (2, dict(dp=2, tp=1, pp=1, microbatch=2)),
        (4, dict(dp=2, tp=2, pp=1, microbatch=2)),
        (4, dict(dp=2, tp=1, pp=2, microbatch=1)),
    ],
)
def test_static_bytes_are_a_data_parallel_share(n, knobs):
    """Weights, gradients and Adam states of each weight: a 1/k share of ZeRO-0's, where k devices
    sum its gradient (the dp replicas; with tp, the row-parallel biases' partial sums are summed over
    tp too). gpt-tiny's position embedding is not data-parallel (its input has no batch) and stays whole."""
    per_param = FP32.param_bytes + FP32.grad_bytes + FP32.optimizer_bytes
    _, _, base = _program(n, knobs, 0)
    plan, g, z3 = _program(n, knobs, 3)
    for b, z in zip(base.devices, z3.devices):
        tasks = [t for blk in z.blocks.values() for t in blk.tasks]
        share = {r.tensor: len(t.group) for t in tasks if t.collective == "reduce_scatter" for r in t.reads}
        whole = sum(per_param * _numel(box) for p, box in z.params if p not in share)
        assert {weight(p) for p, _ in z.params if p not in share} == {
            r for t in tasks for r in t.reads if r and r.kind is BufferKind.WEIGHT
        }
        assert b.static_bytes == whole + sum(per_param * _numel(box) for p, box in z.params if p in share)
        if set(share.values()) == {knobs["dp"]}:
            assert z.static_bytes == (b.static_bytes - whole) // knobs["dp"] + whole
        kept = whole + sum(per_param * _numel(box) / share[p] for p, box in z.params if p in share)
        assert kept <= z.static_bytes < kept + per_param * len(UNITS) * n  # shards pad to equal length
        assert (z.param_bytes, z.grad_bytes) == (z.optimizer_bytes // 2,) * 2
    # the explorer's lower bound knows it, for every stage
    for zero in range(4):
        plan, g, prog = _program(n, knobs, zero)
        assert memory_lower_bound_bytes(plan, g)[0] == max(d.static_bytes for d in prog.devices)


def _numel(box):
    out = 1
    for lo, hi in box:
        out *= hi - lo
    return out


def test_simulated_peak_holds_the_gathered_layers():
    cost = IdealCost(CostModel.load("cpu", 2))
    knobs = dict(dp=2, tp=1, pp=1, microbatch=2)
    res = {z: (simulate(_program(2, knobs, z)[2], cost), _program(2, knobs, z)[2]) for z in (2, 3)}
    transient = {z: r.peak_mem_bytes - p.devices[0].static_bytes for z, (r, p) in res.items()}
    gathered = sum(
        n
        for blk in res[3][1].devices[0].blocks.values()
        for t in blk.tasks
        if t.name.startswith("zero3-gather-f")
        for _, n in t.alloc
    )
    assert transient[3] > transient[2]
    assert transient[3] - transient[2] < gathered  # two layers at most are gathered at once, not all
    assert res[3][0].iter_time_s > res[2][0].iter_time_s  # gathers cost more than they overlap here


def _gather_program(prefetch: bool) -> Program:
    """Two devices of one data-parallel group, two layers: gathers of 1 s each on the
    communication stream, a forward of 1 s per layer, one backward of 1 s whose gradient is
    reduce-scattered (1 s) on the side, then a 1 s optimizer step."""

    zf = {u: Buffer(BufferKind.GATHERED_FORWARD, u) for u in "ab"}
    zd, y, z = Buffer(BufferKind.FULL_GRAD, "a"), activation("y"), activation("z")
    zg, zp = shard_grad((0, 1), "a"), shard_weight((0, 1), "a")

    def gather(u):
        return Task(
            f"zero3-gather-f[0, 1]#{u}",
            TaskKind.COLLECTIVE,
            (shard_weight((0, 1), u),),
            (zf[u],),
            collective="all_gather",
            group=(0, 1),
            nbytes=int(1e9),
            overlap=True,
            alloc=((zf[u], 100),),
            role=Role.UNIT_GATHER,
            ident=ord(u),
        )

    f0 = Task("f0", TaskKind.FORWARD, (zf["a"],), (y,), flops=1e9, free=(zf["a"],))
    f1 = Task("f1", TaskKind.FORWARD, (y, zf["b"]), (z,), flops=1e9, free=(zf["b"], y, z))
    fwd = (gather("a"), gather("b"), f0, f1) if prefetch else (gather("a"), f0, gather("b"), f1)
    bwd = (
        Task("b0", TaskKind.BACKWARD, (), (zd,), flops=1e9, alloc=((zd, 50),)),
        Task(
            "zero3-reduce-scatter[0, 1]#a",
            TaskKind.COLLECTIVE,
            (zd,),
            (zg,),
            collective="reduce_scatter",
            group=(0, 1),
            nbytes=int(1e9),
            overlap=True,
            accumulate=True,
            free=(zd,),
            role=Role.UNIT_GRADS,
            ident=0,
        ),
    )
    upd = (Task("optimizer-shard[0, 1]#a", TaskKind.OPTIMIZER, (zg,), (zp,), flops=1e9, role=Role.SHARD_STEP),)
    blocks = {(0, "F"): Block(0, "F", fwd), (0, "B"): Block(0, "B", bwd), (0, "U"): Block(0, "U", upd)}
    from planlab.plan import Action

    sched = (Action(0, "F", 0), Action(0, "B", 0), Action(0, "U", 0))
    return Program(tuple(DeviceProgram(d, blocks, sched) for d in (0, 1)), 1, FP32)


@pytest.mark.parametrize(
    "prefetch, update_at, peak, log",
    [
        (
            True,
            5.0,
            200,
            [
                ("comm", "zero3-gather-f[0, 1]#a", 0, 1),
                ("comm", "zero3-gather-f[0, 1]#b", 0, 2),
                ("compute", "f0", 1, 2),
                ("compute", "f1", 2, 3),
                ("compute", "b0", 3, 4),
                ("comm", "zero3-reduce-scatter[0, 1]#a", 4, 5),
                ("compute", "optimizer-shard[0, 1]#a", 5, 6),
            ],
        ),
        (
            False,
            6.0,
            100,
            [
                ("comm", "zero3-gather-f[0, 1]#a", 0, 1),
                ("compute", "f0", 1, 2),
                ("comm", "zero3-gather-f[0, 1]#b", 2, 3),
                ("compute", "f1", 3, 4),
                ("compute", "b0", 4, 5),
                ("comm", "zero3-reduce-scatter[0, 1]#a", 5, 6),
                ("compute", "optimizer-shard[0, 1]#a", 6, 7),
            ],
        ),
    ],
)
def test_prefetched_gathers_overlap_compute_exactly(prefetch, update_at, peak, log):
    cost = IdealCost(CostModel.load("dgx-a100-80g", 1))
    prog = _gather_program(prefetch)
    find_deadlock(prog)
    res = simulate(prog, cost, timeline=True)
    assert [(e.stream, e.name, e.start_s, e.end_s) for e in res.events if e.device == 0] == log
    assert res.iter_time_s == update_at + 1.0  # the optimizer waits for the reduce-scatter
    # both gathered layers are held at once with prefetch; the gradient lives until its reduce-scatter ends
    assert res.devices[0].peak_mem_bytes == peak
    mem = [(t, b) for d, t, b in res.memory if d == 0]
    assert (update_at, 0) in mem and (update_at - 1, 50) in mem
    assert res.devices[0].exposed_comm_s == (1.0 if prefetch else 2.0) + 1.0


def test_zero_stage_3_in_plan_files_and_errors(tiny):
    plan, _, _ = _program(2, dict(dp=2, tp=1, pp=1, microbatch=2), 3)
    assert plan.zero == 3 and plan_from_json(plan_to_json(plan)) == plan
    d = plan_to_dict(plan)
    d["zero"] = 4
    with pytest.raises(PlanFileError, match="'zero' must be 0, 1, 2 or 3, got 4"):
        plan_from_json(json.dumps(d))
    spec, g = tiny
    from planlab.plan import PlanBuilder

    with pytest.raises(InfeasiblePlan, match="zero stage 5: choose 0, 1, 2 or 3"):
        PlanBuilder(g, model=spec, global_batch=8, cluster="cpu", nodes=2, num_devices=2).zero(5)
    assert 3 in dict((k.name, k) for k in get_space("dp").knobs)["zero"].values(Context(g, spec, 8, "cpu", 2, 2, 1))


def test_zero3_matches_one_process_and_runs_each_layers_collectives():
    """dp=2, 2 micro-batches (gradients summed into the shards over both), recorded: every rank
    ran each layer's two gathers and its reduce-scatter per micro-batch, and no other ZeRO collective."""
    plan, _, _ = _program(2, dict(dp=2, tp=1, pp=1, microbatch=2), 3)
    res = launch_local(plan, 2, steps=2, lr=1e-2, record=True)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert res.losses[1] < res.losses[0]
    for rank in (0, 1):
        ran = Counter(
            t["task"].split("[")[0]
            for t in res.timeline
            if t["device"] == rank and t["kind"] == "C" and t["task"].startswith(("zero3", "param", "grad"))
        )
        assert ran == {"zero3-gather-f": 12, "zero3-gather-b": 12, "zero3-reduce-scatter": 12}


def test_a_weight_gradient_block_waits_for_a_gather_issued_in_the_input_gradient_block():
    """With ZB-H1, the embedding's backward has no input-gradient part: its layer's backward gather
    is issued in the I block and read (as the weight its W keeps) in the W block, which waits for it."""
    from planlab.simulator.units import Await, lower_block, overlap_writers

    _, _, prog = _program(4, dict(dp=2, tp=1, pp=2, microbatch=1, schedule="zb-h1"), 3)
    dev = prog.devices[0]
    assert any(t.name.endswith("gather-b[0, 1]#wte") for t in dev.blocks[(0, "I")].tasks)
    lowered = lower_block(
        dev.blocks[(0, "W")],
        device=0,
        cls=[0, 1, 2, 3],
        cost=CostModel.load("cpu", 4),
        dtype="fp32",
        sizes={},
        writers=overlap_writers(dev.blocks.values()),
    )
    waits = [u.tasks for u in lowered if isinstance(u, Await)]
    assert ("zero3-gather-b[0, 1]#wte",) in waits  # the others are long complete: no wait in the simulation
    assert {w for ws in waits for w in ws} == {t.name for t in dev.blocks[(0, "I")].tasks if "gather-b" in t.name}


@pytest.mark.parametrize("limit, prefetched", [(0, True), (10**9, True), (1, False)])
def test_no_prefetch_beside_a_unit_at_the_max_live_parameters(limit, prefetched):
    """DeepSpeed prefetches the next module only while the gathered parameters are fewer than
    ``stage3_max_live_parameters`` (software field ``zero3.max_live_elements``): above it, each
    unit's gather is issued as the unit starts, not as the unit before it starts."""
    from dataclasses import replace

    from planlab.costmodel.software import load_software

    spec, g = traced("gpt-tiny", 8)
    plan = get_space("megatron").build(
        Context(g, spec, 8, "cpu", 2, 2, 1), dict(dp=2, tp=1, pp=1, microbatch=4, zero=3)
    )
    software = replace(load_software("deepspeed"), zero3_max_live_elements=limit)
    assert load_software("deepspeed").zero3_max_live_elements == 10**9
    dev = materialize(plan, g, software=software).devices[0]
    fwd = list(dev.blocks[(0, "F")].tasks)
    gathers = [i for i, t in enumerate(fwd) if t.name.startswith("zero3-gather-f")]
    computes = [i for i, t in enumerate(fwd) if t.kind is not TaskKind.COLLECTIVE and not t.name.startswith("zero3")]
    # prefetched: the second gather comes before the first computation that reads the first unit
    assert (gathers[1] < computes[0]) is prefetched
    # never prefetched: a computation runs between any two gathers (one unit gathered at a time)
    between = [any(gathers[k] < i < gathers[k + 1] for i in computes) for k in range(len(gathers) - 1)]
    assert all(between) is not prefetched


def _deepspeed_backward(**fields):
    """The backward block of device 0 of a dp 2 ZeRO-3 gpt-tiny plan with full recomputation, under
    ``deepspeed-2021`` with ``fields`` replaced."""
    from dataclasses import replace

    from planlab.costmodel.software import load_software

    spec, g = traced("gpt-tiny", 8)
    plan = get_space("megatron").build(
        Context(g, spec, 8, "cpu", 2, 2, 1), dict(dp=2, tp=1, pp=1, microbatch=4, zero=3, recompute="full")
    )
    software = replace(load_software("deepspeed-2021"), **{"zero3_persistence_elements": 0, **fields})
    return list(materialize(plan, g, software=software).devices[0].blocks[(0, "B")].tasks)


def test_a_recomputed_forward_gathers_one_module_ahead():
    """DeepSpeed fetches a recomputed forward's modules as it runs them, prefetching along its
    recorded trace: each recomputation gather comes after the recomputed task of the module two
    before it, never all at once ahead of the recomputation (which held a layer's weights at once)."""
    tasks = _deepspeed_backward(zero3_max_reuse_elements=0)
    redo = [i for i, t in enumerate(tasks) if t.name.startswith("re:blocks_0")]
    gathers = [i for i, t in enumerate(tasks) if t.name.startswith("zero3-gather-r") and "#blocks.0." in t.name]
    assert len(gathers) >= 4 and redo
    # the first two are issued before the recomputation starts, the others as it goes
    assert gathers[1] < redo[0] < gathers[2]
    assert all(any(gathers[k] < i < gathers[k + 1] for i in redo) for k in range(1, len(gathers) - 1))


@pytest.mark.parametrize("limit", [0, 1, 10**9])
def test_the_recomputed_last_module_keeps_its_weights_for_its_backward(limit):
    """DeepSpeed releases a module's gathered weights after its recomputed forward unless its next
    use comes within ``stage3_max_reuse_distance`` elements of other modules' (software field
    ``zero3.max_reuse_elements``): at 1 element only the layer's last module (whose backward comes
    next) keeps them, at 1e9 every module of gpt-tiny, at 0 none."""
    tasks = _deepspeed_backward(zero3_max_reuse_elements=limit)
    units = lambda kind: {t.name.split("#")[1] for t in tasks if t.name.startswith(kind)}  # noqa: E731
    redone, regathered = units("zero3-gather-r"), units("zero3-gather-b")
    last = {"blocks.0.mlp.proj", "blocks.1.mlp.proj"}  # each recomputed layer's last module
    assert last <= redone
    if limit == 0:
        assert redone <= regathered
    elif limit == 1:
        assert regathered & redone == redone - last
    else:
        assert not regathered & redone
    # a kept module's backward reads the recomputation's gather
    proj = next(t for t in tasks if t.kind is TaskKind.BACKWARD and t.name == "blocks_1_mlp_proj")
    kinds = {b.kind for b in proj.reads + proj.saved if b and b.tensor.startswith("blocks.1.mlp.proj.")}
    assert kinds == {BufferKind.GATHERED_BACKWARD if limit == 0 else BufferKind.GATHERED_RECOMPUTE}


def test_small_weights_persist_whole_and_are_never_gathered():
    """DeepSpeed keeps parameters of fewer than ``stage3_param_persistence_threshold`` elements
    whole (software field ``zero3.persistence_elements``): gpt-tiny's layer norms and biases are
    not gathered, their gradients are reduce-scattered and the updated shards all-gathered once in
    the update block, and the linear layers' weights are still gathered module by module."""
    spec, g = traced("gpt-tiny", 8)
    ln, fc = g.tensors["blocks.0.ln1.weight"].numel, g.tensors["blocks.0.mlp.fc.weight"].numel
    assert ln < 1000 <= fc
    tasks = _deepspeed_backward(zero3_persistence_elements=1000)
    gathered = {t.name.split("#")[1] for t in tasks if t.name.startswith("zero3-gather")}
    assert "blocks.0.mlp.fc" in gathered and not any("ln" in u for u in gathered)
    # the recomputed forward reads the whole bias, the backward writes its gradient whole (not a ZeRO-3 full gradient)
    bias = [b for t in tasks if t.name == "re:blocks_0_mlp_fc" for b in t.reads if b and b.tensor.endswith("fc.bias")]
    grad = [b for t in tasks if t.name == "blocks_0_mlp_fc" for b in t.writes if b and b.tensor.endswith("fc.bias")]
    assert [b.kind for b in bias] == [BufferKind.WEIGHT] and grad and BufferKind.FULL_GRAD not in {b.kind for b in grad}


@pytest.mark.parametrize("fused", [True, False])
def test_fused_query_key_value_weights_are_gathered_as_one_module(fused):
    """Megatron-LM's attention holds its query, key and value projections as one
    ``query_key_value`` linear layer, so DeepSpeed's hooks fetch them with one gather per use: under
    a software with ``fused_qkv`` the three projections of gpt-tiny share one unit, ``attn.qkv``,
    gathered as much as the attention's output projection; without it each is a unit of its own."""
    tasks = _deepspeed_backward(fused_qkv=fused)
    count = Counter(t.name.split("#")[1] for t in tasks if t.name.startswith("zero3-gather"))
    projections = {f"blocks.0.attn.{p}" for p in ("q", "k", "v")}
    if fused:
        assert count["blocks.0.attn.qkv"] == count["blocks.0.attn.proj"] > 0
        assert not projections & set(count)
    else:
        assert "blocks.0.attn.qkv" not in count
        assert {count[p] for p in projections} == {count["blocks.0.attn.proj"]}


@pytest.mark.parametrize("later", [True, False])
def test_a_reduce_scatter_is_issued_by_the_next_gradient(later):
    """DeepSpeed reduces a weight's gradient from the hook of the next parameter whose gradient
    arrives, as that module's backward runs (software field ``zero3.reduce_at_next_gradient``):
    the MLP's output projection's reduce-scatter comes just before the input projection's backward
    (the next to write a gradient; the activation's has none); without it, right after the output
    projection's own backward."""
    tasks = _deepspeed_backward(zero3_max_reuse_elements=0, zero3_reduce_at_next_gradient=later)
    names = [t.name for t in tasks]
    proj, fc = names.index("blocks_1_mlp_proj"), names.index("blocks_1_mlp_fc")
    reduce = next(
        i for i, n in enumerate(names) if n.startswith("zero3-reduce-scatter") and n.endswith("#blocks.1.mlp.proj")
    )
    if later:
        assert proj < names.index("blocks_1_mlp_act") < reduce < fc
        assert not any(t.kind is TaskKind.BACKWARD for t in tasks[reduce + 1 : fc])
    else:
        assert reduce == proj + 1


def test_beside_a_unit_at_the_max_live_parameters_the_next_gather_waits_for_its_release():
    """DeepSpeed checks for a prefetch at every module's hook: once a unit too large to prefetch
    beside is released, the next module's hook issues the next unit's gather. The attention's
    output projection is gathered right after the value projection (the fused QKV unit's last use),
    so its gather runs beside the attention; the QKV gather itself waits for the first layer norm."""
    from dataclasses import replace

    from planlab.costmodel.software import load_software

    spec, g = traced("gpt-tiny", 8)
    plan = get_space("megatron").build(
        Context(g, spec, 8, "cpu", 2, 2, 1), dict(dp=2, tp=1, pp=1, microbatch=4, zero=3)
    )
    software = replace(load_software("deepspeed-2021"), zero3_persistence_elements=0, zero3_max_live_elements=1)
    names = [t.name for t in materialize(plan, g, software=software).devices[0].blocks[(0, "F")].tasks]
    gather = {
        u: next(i for i, n in enumerate(names) if n.startswith("zero3-gather-f") and n.endswith(f"#blocks.0.{u}"))
        for u in ("attn.qkv", "attn.proj")
    }
    assert names.index("blocks_0_attn_v") < gather["attn.proj"] < names.index("scaled_dot_product_attention")
    assert names.index("blocks_0_ln1") < gather["attn.qkv"] < names.index("blocks_0_attn_q")


# gpt-tiny's weights that tensor parallelism with sequence parallelism leaves whole and whose
# gradients come as partial sums over the tensor-parallel pair: the layer norms (split along the
# sequence) and the row-parallel linears' biases
TP_SUMMED = {f"blocks.{i}.{w}" for i in (0, 1) for w in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias")} | {
    f"blocks.{i}.{m}.proj.bias" for i in (0, 1) for m in ("attn", "mlp")
}


def test_a_weight_tensor_parallelism_replicates_is_sharded_over_the_data_parallel_ranks_only():
    """tp 2 x dp 2 with sequence parallelism, ZeRO-3: FSDP2 shards over its data-parallel mesh and
    keeps every weight Replicate on the tensor-parallel one, so each layer is one unit (its norms
    with its linears) gathered and reduce-scattered over the device's dp pair, never over all four;
    the norms' and row-parallel biases' gradients are all-reduced over the tp pair one by one, on the
    compute stream, after the layer's last backward task and before its reduce-scatter (FSDP2's
    post-backward redistribute of a Partial gradient)."""
    plan, g, prog = _program(4, dict(dp=2, tp=2, pp=1, microbatch=2, sequence_parallel=True), 3)
    for d in prog.devices:
        dp_pair, tp_pair = tuple(sorted((d.device, d.device ^ 2))), tuple(sorted((d.device, d.device ^ 1)))
        tasks = [t for blk in d.blocks.values() for t in blk.tasks]
        zero = [t for t in tasks if t.role in (Role.UNIT_GATHER, Role.UNIT_GRADS)]
        assert {tuple(sorted(t.group)) for t in zero} == {dp_pair}
        assert {t.name.split("#")[1] for t in zero} == set(UNITS)
        back = d.blocks[(0, "B")].tasks
        summed = {t.name.split("#")[1]: i for i, t in enumerate(back) if t.name.startswith("zero3-tp-reduce")}
        assert set(summed) == TP_SUMMED
        for p, i in summed.items():
            t, full = back[i], Buffer(BufferKind.FULL_GRAD, p)
            assert (t.collective, tuple(sorted(t.group)), t.overlap, t.reads, t.writes) == (
                "all_reduce",
                tp_pair,
                False,
                (full,),
                (full,),
            )
            unit = unit_key(p)
            last = max(
                k
                for k, b in enumerate(back)
                if b.kind is TaskKind.BACKWARD
                and any(
                    w is not None and w.kind is BufferKind.FULL_GRAD and unit_key(w.tensor) == unit for w in b.writes
                )
            )
            scatter = next(k for k, b in enumerate(back) if b.role is Role.UNIT_GRADS and b.name.endswith("#" + unit))
            assert last < i < scatter


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_and_2_shard_over_the_data_parallel_ranks_after_the_tensor_parallel_sum(zero):
    """tp 2 x dp 2 with sequence parallelism, ZeRO-1/2: Megatron-Core's distributed optimizer shards
    over the data-parallel group; the sequence-parallel weights' gradients are summed over the tp
    pair by one coalesced all-reduce (``finalize_model_grads``), here before the reduce-scatter."""
    _, _, prog = _program(4, dict(dp=2, tp=2, pp=1, microbatch=2, sequence_parallel=True), zero)
    for d in prog.devices:
        update = [t for t in d.blocks[(0, "U")].tasks if t.kind is TaskKind.COLLECTIVE]
        assert [(t.name.split("[")[0], tuple(sorted(t.group))) for t in update] == [
            ("grad-tp-reduce", tuple(sorted((d.device, d.device ^ 1)))),
            ("grad-reduce-scatter", tuple(sorted((d.device, d.device ^ 2)))),
            ("param-all-gather", tuple(sorted((d.device, d.device ^ 2)))),
        ]
        assert {b.tensor for b in update[0].reads} == TP_SUMMED


def test_context_parallel_ranks_stay_in_the_shard_group():
    """Context parallelism splits the sequence but shards no weight: FSDP2 shards over dp x cp
    (torchtitan's ``fsdp`` mesh is dp_shard x cp), so every ZeRO-3 collective of llama-tiny on
    dp 2 x cp 2 spans all four ranks and nothing is summed over tensor-parallel ranks first."""
    spec, g = traced("llama-tiny", 8)
    knobs = dict(dp=2, cp=2, tp=1, pp=1, microbatch=2, zero=3, cp_kind="ring")
    prog = materialize(get_space("megatron").build(Context(g, spec, 8, "cpu", 4, 4, 1), knobs), g)
    tasks = [t for d in prog.devices for blk in d.blocks.values() for t in blk.tasks]
    zero = [t for t in tasks if t.role in (Role.UNIT_GATHER, Role.UNIT_GRADS)]
    assert zero and {tuple(sorted(t.group)) for t in zero} == {(0, 1, 2, 3)}
    assert not any("tp-reduce" in t.name for t in tasks)


@pytest.mark.parametrize("slowdown", [1.0, 1.3])
def test_gathers_within_a_class_taken_at_once_simulate_as_at_their_barriers(slowdown, monkeypatch):
    """One class of four devices takes each ZeRO-3 collective on the stream as it is issued
    (``DeviceRun.overlapped_now``); device by device (``symmetry=False``) each is a process that
    waits at its barrier. Same iteration, peaks, statistics and timeline, with and without the
    computation slowed beside the stream."""
    from planlab.simulator.engine import DeviceRun

    taken = Counter()
    at_once = DeviceRun.overlapped_now

    def counted(self, *args):
        taken[self.sim.timeline] += 1
        return at_once(self, *args)

    monkeypatch.setattr(DeviceRun, "overlapped_now", counted)
    cost = CostModel.load("cpu", 4)
    prog = _program(4, dict(dp=4, tp=1, pp=1, microbatch=1), 3)[2]
    classes = simulate(prog, cost, timeline=True, overlap_slowdown=slowdown)
    assert taken[True] > 0 and len(classes.devices) == 1
    taken.clear()
    apart = simulate(prog, cost, timeline=True, overlap_slowdown=slowdown, symmetry=False)
    assert not taken and len(apart.devices) == 4
    assert apart.iter_time_s == classes.iter_time_s
    one = classes.devices[0]
    for d in apart.devices:
        assert (d.finish_s, d.compute_s, d.comm_s, d.exposed_comm_s, d.peak_mem_bytes, d.peak_at_s) == (
            one.finish_s,
            one.compute_s,
            one.comm_s,
            one.exposed_comm_s,
            one.peak_mem_bytes,
            one.peak_at_s,
        )
    assert [e for e in apart.events if e.device == 0] == [e for e in classes.events if e.device == 0]
