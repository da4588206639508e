"""Ring attention (``cp_kind=ring``): the plan and its Program, the executor's ring on gloo against
``F.scaled_dot_product_attention``, the cost model's price of a ring step, and ring plans on gloo
against one process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from planlab.cli import GRAD_TOL, LOSS_TOL
from planlab.costmodel import CostModel
from planlab.costmodel.ring import gather_time_s, rank_share, ring_time_s, step_shares
from planlab.errors import InfeasiblePlan, InternalError, PlanFileError
from planlab.executor import launch_local
from planlab.plan import materialize
from planlab.plan.plan_file import plan_from_dict, plan_to_dict
from planlab.plan.program import Ring, RingBlock, Task, TaskKind, Zigzag
from planlab.search_spaces import Context, get_space

from conftest import traced


def _ctx(name: str, n: int, args: tuple = ()):
    spec, g = traced(name, 8, args)
    return Context(g, spec, 8, "cpu", n, n, 1)


def _ring_plan(n: int = 2, **knobs):
    ctx = _ctx("llama-tiny", n)
    values = dict(dp=1, tp=1, pp=1, cp=2, cp_kind="ring", microbatch=4)
    values.update(knobs)
    return ctx, get_space("megatron").build(ctx, values)


# ---- the plan and its Program -------------------------------------------------------------


def test_ring_plan_splits_the_attention_sequence_and_round_trips():
    ctx, plan = _ring_plan()
    attention = [p for p in plan.ops if ctx.graph.op(p.op).kind == "attention"]
    assert attention and all(p.ring and p.dims[-1] == "s" and p.sizes[-1] == 2 for p in attention)
    assert all(not p.ring for p in plan.ops if ctx.graph.op(p.op).kind != "attention")
    assert plan.zigzag and plan_to_dict(plan)["zigzag"] is True  # cp_layout=auto: llama-tiny computes the same
    assert plan_from_dict(plan_to_dict(plan)) == plan
    with pytest.raises(PlanFileError, match=r"field 'zigzag' must be true or false, got 'yes'"):
        plan_from_dict(dict(plan_to_dict(plan), zigzag="yes"))


def test_ring_program_has_no_conversion_at_the_attention_and_holds_blocks_in_flight():
    """The queries, keys and values arrive split along the sequence: no collective or message over
    the context-parallel pair but the logits' (vocabulary) gathering; the forward and backward of
    each attention piece carry the ring, and hold 2 and 4 key/value blocks while they run."""
    ctx, plan = _ring_plan()
    program = materialize(plan, ctx.graph)
    tasks = [t for _, t in program.devices[1].tasks_in_order()]
    rings = [t for t in tasks if t.ring is not None]
    layers = 2
    assert len(rings) == 2 * layers * plan.microbatches
    assert {(t.kind, t.ring, t.group) for t in rings} == {
        (TaskKind.FORWARD, Ring(2, True, zigzag=True), (0, 1)),
        (TaskKind.BACKWARD, Ring(2, True, zigzag=True), (0, 1)),
    }
    assert not [t for t in tasks if t.kind is TaskKind.COLLECTIVE and t.collective == "all_to_all"]
    fwd = next(t for t in rings if t.kind is TaskKind.FORWARD)
    k_piece = fwd.shapes[1]  # (B / m, heads, T / cp, head dim)
    assert k_piece[-2] == 16  # sequence 32 over cp 2
    held = {b.tensor: n for t in rings for b, n in t.alloc if str(b).endswith(("ring-F", "ring-B"))}
    block = 4 * 2 * sum(torch.Size(s).numel() for s in fwd.shapes[1:3])  # fp32 keys and values
    assert set(held.values()) == {block, 2 * block}


def test_allgather_plan_gathers_the_ring_and_holds_every_block():
    """cp_kind=allgather (Llama 3): the same split as a ring, its pieces all-gathering the keys and values;
    with cp 4 a forward holds the 4 gathered blocks and a backward those and their gradients (a ring: 2 and 4)."""
    ctx, plan = _ring_plan(4, cp=4, cp_kind="allgather", microbatch=2)
    assert plan.kv_gather and plan.zigzag and plan_to_dict(plan)["kv_gather"] is True
    assert plan_from_dict(plan_to_dict(plan)) == plan
    program = materialize(plan, ctx.graph)
    rings = [t for _, t in program.devices[1].tasks_in_order() if t.ring is not None]
    assert {t.ring for t in rings} == {Ring(4, True, zigzag=True, gather=True)}
    assert str(rings[0].ring) == "allgather/4 causal zigzag"
    block = 4 * sum(torch.Size(s).numel() for s in rings[0].shapes[1:3])
    held = {n for t in rings for b, n in t.alloc if str(b).endswith(("ring-F", "ring-B"))}
    assert held == {4 * block, 8 * block}
    with pytest.raises(InfeasiblePlan, match=r"^kv_gather: the plan runs no attention as a ring"):
        materialize(dataclasses.replace(_ring_plan(cp_kind="a2a")[1], kv_gather=True), ctx.graph)


def test_zigzag_plans_that_do_not_fit_are_refused_in_one_line():
    ctx, plan = _ring_plan(cp_kind="a2a")
    with pytest.raises(InfeasiblePlan, match=r"^zigzag: the plan runs no attention as a ring"):
        materialize(dataclasses.replace(plan, zigzag=True), ctx.graph)
    moe = _ctx("moe-tiny", 2)
    plan = get_space("megatron").build(moe, dict(dp=1, tp=1, pp=1, cp=2, cp_kind="ring", microbatch=1))
    assert not plan.zigzag  # auto: the routing's cumsum counts tokens in sequence order
    with pytest.raises(InfeasiblePlan, match=r"^zigzag: operator 'cumsum' \(cumsum\) keeps the sequence whole"):
        materialize(dataclasses.replace(plan, zigzag=True), moe.graph)


# ---- the executor's ring on gloo -------------------------------------------------------------


def _ring_errors(
    rank: int, world: int, group, causal: bool, rep: int, zigzag: bool = False, gather: bool = False
) -> float:
    """The largest difference between this rank's chunk of the ring's output and gradients and one
    process's whole attention, on random inputs (keys and values with ``4 / rep`` heads); with
    ``zigzag`` each rank holds chunks ``pos`` and ``2 world - 1 - pos`` of ``2 world``; with ``gather``
    the keys and values are all-gathered (``cp_kind=allgather``)."""
    from planlab.executor.ring_attention import ring_attention, zigzag_tokens

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8 * world, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 4 // rep, 8 * world, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 4 // rep, 8 * world, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 4, 8 * world, 6, generator=gen, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=rep > 1)
    ref.backward(dy)
    ranks = tuple(range(world))[::-1]  # the ring's order is its chunks', not the ranks'
    pos = ranks.index(rank)

    def piece(x: torch.Tensor) -> torch.Tensor:  # this rank's chunk of the sequence (in zigzag order)
        x = zigzag_tokens(x, Zigzag(x.dim() - 2, 2 * world)) if zigzag else x
        return x.chunk(world, dim=-2)[pos]

    mine = [piece(x.detach()).clone().requires_grad_(True) for x in (q, k, v)]
    y = ring_attention(*mine, ring=Ring(world, causal, zigzag, gather), ranks=ranks, group=group)
    y.backward(piece(dy))
    errors = [(y - piece(ref)).abs().max().item()]
    errors += [(m.grad - piece(x.grad)).abs().max().item() for m, x in zip(mine, (q, k, v))]
    return max(errors)


def _ring_rank(rank: int, world: int, path: str, cases: tuple, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    out.put((rank, [_ring_errors(rank, world, group, *case) for case in cases]))
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes: about 30 s on this loaded machine
def test_ring_attention_matches_sdpa_on_gloo(tmp_path):
    """Each rank's chunk of the output and of the gradients of q, k and v, as one process computes
    them whole: causal (a diagonal block, then a full or a skipped one), and not causal with
    grouped-query heads (two query heads a key/value head), and causal in zigzag order (each rank two
    chunks: diagonal, full and skipped sub-blocks), with grouped-query heads, passed around or
    all-gathered (Llama 3's context parallelism), and contiguous all-gathered."""
    world, cases = (
        2,
        ((True, 1, False), (False, 2, False), (True, 2, True), (True, 2, True, True), (True, 1, False, True)),
    )
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ring_rank, args=(r, world, str(tmp_path / "store"), cases, out)) for r in range(world)]
    for p in procs:
        p.start()
    errors = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join()
    assert len(errors) == world and max(max(e) for e in errors.values()) < 1e-10, errors


# ---- pricing ------------------------------------------------------------------------------


def test_causal_contiguous_ring_blocks_and_step_pace():
    ring = Ring(4, True)
    grid = [[str(ring.block(r, s))[0] for s in range(4)] for r in range(4)]
    assert grid == [list("dsss"), list("dfss"), list("dffs"), list("dfff")]  # rank r: r full blocks, one diagonal
    assert step_shares(ring) == (0.5, 1.0, 1.0, 1.0)  # the last rank sets the pace
    assert step_shares(Ring(4, False)) == (1.0,) * 4
    assert ring.block(2, 1) is RingBlock.FULL and ring.block(1, 2) is RingBlock.SKIPPED


def test_causal_zigzag_ring_computes_half_a_block_per_step_on_every_rank():
    """Megatron-Core's load balancing: rank r holds chunks r and 7 - r of 8. At step 0 it computes its
    two diagonal sub-blocks and one full one; later, its queries against an earlier rank's first chunk,
    or its second chunk of queries against a later rank's keys: half a block on every rank."""
    ring = Ring(4, True, zigzag=True)
    assert [ring.chunks(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [b for _, _, b in ring.blocks(1, 0)] == ["diagonal", "skipped", "full", "diagonal"]
    assert [(i, j) for i, j, b in ring.blocks(1, 1) if b == "full"] == [(0, 0), (1, 0)]  # rank 0's chunk 0
    assert [(i, j) for i, j, b in ring.blocks(1, 3) if b == "full"] == [(1, 0), (1, 1)]  # rank 2's chunks 2, 5
    assert all(rank_share(ring, r, s) == 0.5 for r in range(4) for s in range(4))
    assert step_shares(ring) == (0.5,) * 4
    assert step_shares(Ring(4, False, zigzag=True)) == (1.0,) * 4
    assert Zigzag(1, 8).order() == (0, 7, 1, 6, 2, 5, 3, 4)
    with pytest.raises(InternalError):
        ring.block(0, 0)


@pytest.mark.parametrize(
    "zigzag, backward, block_s, transfer_s, expected",
    [
        (True, False, 2.0, 0.5, 4 * 1.0),  # compute-bound: half a block at every step
        # backward transfer-bound: the block and its gradients, 2 x 0.75; the last step sends gradients only
        (True, True, 2.0, 0.75, 3 * 1.5 + 1.0),
    ],
)
def test_zigzag_ring_time_by_hand(zigzag, backward, block_s, transfer_s, expected):
    assert ring_time_s(Ring(4, True, zigzag), backward, block_s, transfer_s) == pytest.approx(expected)


@pytest.mark.parametrize(
    "backward, block_s, transfer_s, expected",
    [
        (False, 2.0, 1.0, 1.0 + 2.0 + 2.0 + 2.0),  # compute-bound: 0.5 x 2 at step 0, then full blocks
        (False, 2.0, 3.0, 3.0 + 3.0 + 3.0 + 2.0),  # transfer-bound: 3 transfers, the last step computes only
        (True, 2.0, 1.5, 3.0 + 3.0 + 3.0 + 2.0),  # backward: keys/values ahead and their gradients behind
    ],
)
def test_ring_time_by_hand(backward, block_s, transfer_s, expected):
    assert ring_time_s(Ring(4, True), backward, block_s, transfer_s) == pytest.approx(expected)


def test_cost_model_prices_a_ring_step_on_the_cp_link():
    """A ring of 2 on one node (NVLink) and across two nodes (the network): the forward of a piece is
    the diagonal block, then the full one, with one key/value transfer overlapped with the first."""
    cost = CostModel.load("dgx-h100", nodes=2, software="torch")
    q = (1, 8, 4096, 128)
    shapes = (q, q, q, q)
    flops = 4.0 * 8 * 4096 * 8192 * 128  # the piece's: its 4,096 queries against the 8,192 keys
    kv_bytes = 2 * 2 * 8 * 4096 * 128  # bf16 keys and values of one chunk
    for group in ((0, 1), (0, 8)):
        task = Task(
            "attn", TaskKind.FORWARD, flops=flops, op_kind="attention", shapes=shapes, group=group, ring=Ring(2, True)
        )
        block = task.but(ring=None, group=(), flops=flops / 2)
        block_s = cost.device_and_host_s(block, "bf16")[0]
        x = cost.p2p_time_s(kv_bytes, *group)
        assert cost.ring_attention_s(task, "bf16")[0] == pytest.approx(max(0.5 * block_s, x) + block_s)
    assert cost.p2p_time_s(kv_bytes, 0, 8) > cost.p2p_time_s(kv_bytes, 0, 1)


@pytest.mark.parametrize(
    "zigzag, backward, expected", [(True, False, 3 + 2), (False, False, 3 + 3.5), (True, True, 3 + 2 + 1)]
)
def test_allgather_time_by_hand(zigzag, backward, expected):
    """An all-gather ring of 4, a full block 1 s, the all-gather 3 s and the reduce-scatter 1 s: balanced,
    every rank computes 2 blocks (16 blocks' causal half over 4); contiguous, the last rank computes its 3
    earlier chunks and its diagonal, 3.5 blocks; nothing overlaps."""
    assert gather_time_s(Ring(4, True, zigzag, gather=True), backward, 1.0, 3.0, 1.0) == pytest.approx(expected)


def test_cost_model_prices_an_allgather_ring_as_exposed_collectives():
    """Llama 3's all-gather: the keys and values of the ring all-gathered, the piece's blocks, and in the
    backward the gradients reduce-scattered, each a collective of the ring's whole key/value bytes."""
    cost = CostModel.load("dgx-h100", nodes=2, software="torch")
    q, kv = (1, 8, 4096, 128), (1, 1, 4096, 128)
    kv_bytes = 2 * 2 * 1 * 4096 * 128  # bf16 keys and values of one chunk, one key/value head
    group, ring = (0, 8), Ring(2, True, zigzag=True, gather=True)
    for kind in (TaskKind.FORWARD, TaskKind.BACKWARD):
        task = Task("attn", kind, flops=1e12, op_kind="attention", shapes=(q, kv, kv, q), group=group, ring=ring)
        block_s = cost.device_and_host_s(task.but(ring=None, group=(), flops=0.5e12), "bf16")[0]
        ag = cost.collective_time_s("all_gather", 2 * kv_bytes, group)
        rs = cost.collective_time_s("reduce_scatter", 2 * kv_bytes, group) if kind is TaskKind.BACKWARD else 0.0
        assert cost.ring_attention_s(task, "bf16")[0] == pytest.approx(ag + block_s + rs)


def test_spaces_lists_ring(capsys):
    from planlab.cli import main

    main(["spaces"])
    out = capsys.readouterr().out
    assert "cp_kind" in out and "a2a, ring, allgather" in out
    assert "cp_layout" in out and "auto, zigzag, contiguous  default auto" in out


# ---- ring plans on gloo match one process ----------------------------------------------------


@pytest.mark.parametrize("layout", ["zigzag", pytest.param("contiguous", marks=pytest.mark.slow)])
def test_ring_plan_on_2_ranks_matches_one_process(layout):
    """The zigzag plan loads its tokens, targets and rotary tables permuted (rank 0 holds chunks 0 and 3
    of 4) and masks its attention per pair of chunks; the loss and gradients are one process's."""
    ctx, plan = _ring_plan(cp_layout=layout)
    program = materialize(plan, ctx.graph)
    loads = {t.reads[0].tensor: t.order for _, t in program.devices[0].tasks_in_order() if t.role == "load"}
    want = {"idx": Zigzag(1, 4), "targets": Zigzag(1, 4), "rope_cos": Zigzag(0, 4), "rope_sin": Zigzag(0, 4)}
    assert loads == (want if layout == "zigzag" else dict.fromkeys(want))
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.passed(loss_tol=LOSS_TOL, grad_tol=GRAD_TOL), (res.losses, res.ref_losses, res.max_grad_error)


def test_allgather_plan_on_2_ranks_matches_one_process():
    """Llama 3's context parallelism: zigzag tokens, keys and values all-gathered, their gradients
    reduce-scattered; the loss and gradients are one process's."""
    _, plan = _ring_plan(cp_kind="allgather")
    res = launch_local(plan, 2, steps=1, lr=1e-2)
    assert res.passed(loss_tol=LOSS_TOL, grad_tol=GRAD_TOL), (res.losses, res.ref_losses, res.max_grad_error)


@pytest.mark.slow
def test_ring_plan_cp2_tp2_on_4_ranks_matches_one_process():
    _, plan = _ring_plan(4, tp=2, microbatch=2)
    res = launch_local(plan, 4, steps=2, lr=1e-2)
    assert res.passed(loss_tol=LOSS_TOL, grad_tol=GRAD_TOL), (res.losses, res.ref_losses, res.max_grad_error)


@pytest.mark.slow
def test_ring_plan_cp4_on_4_ranks_matches_one_process():
    _, plan = _ring_plan(4, cp=4, microbatch=2)
    res = launch_local(plan, 4, steps=1, lr=1e-2)
    assert res.passed(loss_tol=LOSS_TOL, grad_tol=GRAD_TOL), (res.losses, res.ref_losses, res.max_grad_error)
