"""The ``interlaced`` space (nnScaler's interlaced pipeline): the plan's structure (the vocabulary
operators on every device, their stages), the schedule against golden text, a dry run without
deadlock, exploration on a small GPT, and 4 gloo ranks against one process."""

import pytest

from planlab.cli import GRAD_TOL, LOSS_TOL
from planlab.errors import ConfigError
from planlab.executor import launch_local
from planlab.plan import materialize
from planlab.search_spaces import Context, get_space
from planlab.search_spaces.schedules import format_schedule, interlaced_1f1b
from planlab.simulator import find_deadlock

from conftest import traced

ARGS = (("layers", 2), ("hidden", 32), ("heads", 4), ("seq", 16), ("vocab", 512))


def _matches_one_process(plan):
    """4 gloo ranks against one process: loss and gradients, and the optimizer step took effect."""
    res = launch_local(plan, 4, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert res.losses[1] < res.losses[0]


def _ctx(devices=4, batch=8):
    spec, g = traced("gpt", batch, ARGS)
    return Context(g, spec, batch, "cpu", devices, devices, 1)


def test_schedule_golden():
    got = [format_schedule(interlaced_1f1b(r, 2, 4)) for r in range(2)]
    assert got == [
        "0F0 1F0 0F1 1F1 3F0 3B0 0F2 1F2 3F1 3B1 0F3 1B0 1F3 3F2 3B2 0B0 1B1 3F3 3B3 0B1 1B2 0B2 1B3 0B3",
        "0F0 0F1 2F0 3F0 3B0 0F2 2F1 2B0 3F1 3B1 0F3 2F2 2B1 3F2 3B2 0B0 2F3 2B2 3F3 3B3 0B1 2B3 0B2 0B3",
    ]
    for ranks, m in ((2, 1), (3, 5), (4, 8), (8, 16), (4, 3)):  # every action once, shared ones in one order
        lists = [interlaced_1f1b(r, ranks, m) for r in range(ranks)]
        shared = [[a for a in lst if a.stage in (0, ranks + 1)] for lst in lists]
        assert all(s == shared[0] for s in shared) and len(shared[0]) == 4 * m
        for r, lst in enumerate(lists):
            assert sorted((a.phase, a.microbatch) for a in lst if a.stage == r + 1) == sorted(
                (p, k) for p in "FB" for k in range(m)
            )
        assert _channels_in_order(lists, ranks)


def _channels_in_order(lists, ranks) -> bool:
    """Every pair of ranks receives its messages in the order they were sent: layer activations and
    gradients between neighbours, the last rank's outputs to every device's output stage and its
    gradients back, every device's embedding pieces to rank 0 and rank 0's gradients back."""
    last, sent, got = ranks - 1, {}, {}
    for rank, lst in enumerate(lists):
        for a in lst:
            k, r = a.microbatch, a.stage - 1
            if a.stage == 0:
                takes, sends = ([], [(rank, 0, "E", k)]) if a.phase == "F" else ([(0, rank, "e", k)], [])
            elif a.stage == ranks + 1:
                takes, sends = ([(last, rank, "H", k)], []) if a.phase == "F" else ([], [(rank, last, "h", k)])
            elif a.phase == "F":
                takes = [(x, 0, "E", k) for x in range(ranks)] if r == 0 else [(r - 1, r, "F", k)]
                sends = [(last, x, "H", k) for x in range(ranks)] if r == last else [(r, r + 1, "F", k)]
            else:
                takes = [(x, last, "h", k) for x in range(ranks)] if r == last else [(r + 1, r, "B", k)]
                sends = [(0, x, "e", k) for x in range(ranks)] if r == 0 else [(r, r - 1, "B", k)]
            for src, dst, *msg in sends:
                sent.setdefault((src, dst), []).append(msg)
            for src, dst, *msg in takes:
                got.setdefault((src, dst), []).append(msg)
    return sent == got


def test_interlaced_cycles_balance_the_ranks():
    """Between two meetings of every device at the output stage, each rank runs one forward and one
    backward of its layers (the steady state); rank r holds 2 (ranks - r) - 1 micro-batches in flight
    (the last rank, which runs its forward first, 2)."""
    ranks, m = 4, 12
    for r in range(ranks):
        lst = interlaced_1f1b(r, ranks, m)
        heads = [i for i, a in enumerate(lst) if a.stage == ranks + 1 and a.phase == "F"]
        between = [[a.phase for a in lst[i:j] if 1 <= a.stage <= ranks] for i, j in zip(heads, heads[1:])]
        steady = between[ranks : m - ranks]
        assert steady and all(sorted(p) == ["B", "F"] for p in steady)
        held = peak = 0
        for a in lst:
            if 1 <= a.stage <= ranks:
                held += 1 if a.phase == "F" else -1
                peak = max(peak, held)
        assert peak == max(2, 2 * (ranks - r) - 1)


def test_plan_structure_and_dry_run():
    ctx = _ctx()
    plan = get_space("interlaced").build(ctx, dict(pp=2, dp=1, tp=2, microbatch=4))
    ops = {p.op: p for p in plan.ops}
    assert str(ops["wte"]) == "wte: v/4 on [0, 1, 2, 3] stage 0"  # the vocabulary over every device
    assert ops["lm_head"].devices == (0, 1, 2, 3) and ops["lm_head"].stage == 3
    assert ops["cross_entropy"].devices == (0, 1, 2, 3) and ops["cross_entropy"].stage == 3
    assert ops["blocks_0_attn_q"].devices == (0, 1) and ops["blocks_0_attn_q"].stage == 1
    assert ops["ln_f"].devices == (2, 3) and ops["ln_f"].stage == 2
    assert [format_schedule(s) for s in plan.schedule] == [
        "0F0 1F0 0F1 1F1 3F0 3B0 3F1 3B1 1B0 0B0 1B1 0B1 0U0"
    ] * 2 + ["0F0 0F1 2F0 3F0 3B0 2F1 2B0 3F1 3B1 2B1 0B0 0B1 0U0"] * 2
    program = materialize(plan, ctx.graph)
    assert find_deadlock(program, raise_error=False) is None
    colls = {
        (t.collective, tuple(t.group))
        for d in program.devices
        for b in d.blocks.values()
        for t in b.tasks
        if t.collective
    }
    assert ("all_reduce", (0, 1, 2, 3)) in colls  # the output layer's weight gradients over every device
    assert ("all_reduce", (0, 1)) in colls and ("all_reduce", (2, 3)) in colls  # tensor parallelism


def test_embed_layout_vocab_batch():
    ctx = _ctx()
    plan = get_space("interlaced").build(ctx, dict(pp=2, dp=2, tp=1, microbatch=2, embed_layout="vocab+batch"))
    ops = {p.op: p for p in plan.ops}
    assert str(ops["wte"]) == "wte: v/4 on [0, 1, 2, 3] stage 0"
    assert str(ops["add"]) == "add: a0/4 on [0, 1, 2, 3] stage 0"  # the lookup's pieces meet in a reduce-scatter
    assert str(ops["wpe"]) == "wpe: R/4 on [0, 1, 2, 3] stage 0"
    program = materialize(plan, ctx.graph)
    assert find_deadlock(program, raise_error=False) is None
    colls = {
        (t.collective, tuple(t.group))
        for d in program.devices
        for b in d.blocks.values()
        for t in b.tasks
        if t.collective
    }
    assert ("reduce_scatter", (0, 1, 2, 3)) in colls


def test_constraints_name_the_knob():
    ctx = _ctx()
    sp = get_space("interlaced")
    with pytest.raises(ConfigError, match="pp"):
        sp.build(ctx, dict(pp=1, dp=4, tp=1, microbatch=2))
    spec, g = traced("gpt", 8, (("layers", 2), ("hidden", 32), ("heads", 4), ("seq", 16), ("vocab", 510)))
    with pytest.raises(ConfigError, match="vocabulary of 510"):
        sp.build(Context(g, spec, 8, "cpu", 4, 4, 1), dict(pp=2, dp=2, tp=1, microbatch=2))


def test_explore_small_gpt():
    import planlab
    from planlab.models import ModelSpec

    df = planlab.explore(ModelSpec("gpt", ARGS), cluster="cpu", nodes=4, space="interlaced", global_batch=8)
    sim = df[df["simulated"]]
    assert len(sim) > 0 and sim["feasible"].any()
    assert set(df["pp"]) == {2} and (df["dp"] * df["tp"] * df["pp"] == 4).all()
    best = df.attrs["best_plan"]
    assert best.space == "interlaced" and sorted(best.op_plan("wte").devices) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "knobs", [dict(pp=2, dp=1, tp=2, microbatch=4), dict(pp=2, dp=2, tp=1, microbatch=2, embed_layout="vocab+batch")]
)
def test_matches_one_process(knobs):
    ctx = _ctx()
    plan = get_space("interlaced").build(ctx, knobs)
    _matches_one_process(plan)


# With Megatron's vocabulary-parallel loss (gpt vocab_parallel=1) the output layer, the logits and the
# loss split along the vocabulary over every device, so a micro-batch need not hold a sequence per device.
VP_ARGS = ARGS + (("vocab_parallel", 1),)


def _vp_ctx(devices=4, batch=8):
    spec, g = traced("gpt", batch, VP_ARGS)
    return Context(g, spec, batch, "cpu", devices, devices, 1)


def test_vocabulary_parallel_head_structure():
    ctx = _vp_ctx()
    plan = get_space("interlaced").build(ctx, dict(pp=2, dp=2, tp=1, microbatch=1))  # 2 sequences, 4 devices
    ops = {p.op: p for p in plan.ops}
    assert str(ops["lm_head"]) == "lm_head: n/4 on [0, 1, 2, 3] stage 3"
    assert str(ops["vocab_cross_entropy"]) == "vocab_cross_entropy: v/4 on [0, 1, 2, 3] stage 3"
    assert str(ops["vocab_embedding"]) == "vocab_embedding: v/4 on [0, 1, 2, 3] stage 0"
    program = materialize(plan, ctx.graph)
    assert find_deadlock(program, raise_error=False) is None
    loss = [
        t
        for d in program.devices
        for b in d.blocks.values()
        for t in b.tasks
        if t.op_kind == "vocab_cross_entropy" and t.kind.value == "F"
    ]
    assert loss and all(t.group == (0, 1, 2, 3) for t in loss)  # the pieces agree over every device


def test_vocabulary_parallel_head_frees_the_micro_batch_but_not_the_batch_split_embedding():
    ctx, sp = _vp_ctx(), get_space("interlaced")
    sp.build(ctx, dict(pp=2, dp=2, tp=1, microbatch=1))  # 2 sequences per micro-batch on 4 devices
    with pytest.raises(ConfigError, match="embed_layout=vocab\\+batch"):
        sp.build(ctx, dict(pp=2, dp=2, tp=1, microbatch=1, embed_layout="vocab+batch"))
    with pytest.raises(ConfigError, match="do not split over the 4 devices"):  # a batch-split head still needs them
        sp.build(_ctx(), dict(pp=2, dp=2, tp=1, microbatch=1))


@pytest.mark.parametrize("knobs", [dict(pp=2, dp=1, tp=2, microbatch=2), dict(pp=2, dp=2, tp=1, microbatch=1)])
def test_vocabulary_parallel_head_matches_one_process(knobs):
    ctx = _vp_ctx()
    plan = get_space("interlaced").build(ctx, knobs)
    _matches_one_process(plan)


def test_batch_vocab_head_layout():
    """head_layout=batch+vocab: each data-parallel replica's sequences on its own pp x tp devices,
    split along the vocabulary over them; the loss's pieces agree within those devices."""
    ctx = _vp_ctx()
    plan = get_space("interlaced").build(ctx, dict(pp=2, dp=2, tp=1, microbatch=1, head_layout="batch+vocab"))
    ops = {p.op: p for p in plan.ops}
    assert str(ops["lm_head"]) == "lm_head: a0/2 x n/2 on [0, 2, 1, 3] stage 3"
    program = materialize(plan, ctx.graph)
    assert find_deadlock(program, raise_error=False) is None
    groups = {
        t.group
        for d in program.devices
        for b in d.blocks.values()
        for t in b.tasks
        if t.op_kind == "vocab_cross_entropy" and t.kind.value == "F"
    }
    assert groups == {(0, 2), (1, 3)}  # replica 0 on devices 0 and 2 (stages 1 and 2), replica 1 on 1 and 3
    with pytest.raises(ConfigError, match="head_layout=batch\\+vocab"):
        get_space("interlaced").build(_ctx(), dict(pp=2, dp=4, tp=1, microbatch=1, head_layout="batch+vocab"))
    _matches_one_process(plan)


@pytest.mark.parametrize("args", [ARGS, VP_ARGS], ids=["cross_entropy", "vocab_parallel"])
def test_batch_vocab_embed_layout(args):
    """embed_layout=batch+vocab: each data-parallel replica's sequences looked up by its own pp x tp
    devices, split along the vocabulary over them; the pieces are summed on the replica's first stage."""
    ctx = _vp_ctx() if args is VP_ARGS else _ctx()
    plan = get_space("interlaced").build(
        ctx,
        dict(
            pp=2,
            dp=2,
            tp=1,
            microbatch=2,
            embed_layout="batch+vocab",
            head_layout="batch+vocab" if args is VP_ARGS else "vocab",
        ),
    )
    ops = {p.op: p for p in plan.ops}
    lookup, batch = ("vocab_embedding", "a") if args is VP_ARGS else ("wte", "a0")
    assert str(ops[lookup]) == f"{lookup}: {batch}/2 x v/2 on [0, 2, 1, 3] stage 0"
    program = materialize(plan, ctx.graph)
    assert find_deadlock(program, raise_error=False) is None
    _matches_one_process(plan)


def test_operators_made_from_the_inputs_run_before_their_users():
    """T5 concatenates its encoder and decoder token ids (``cat``, from the inputs alone) before the
    shared embedding: on the embedding's stage 0, not the first layer stage after it (where its
    output was read before it was made)."""
    spec, g = traced("t5-tiny", 8)
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    plan = get_space("interlaced").build(ctx, dict(pp=2, dp=1, tp=1, microbatch=8, recompute="none"))
    stage = {p.op: p.stage for p in plan.ops}
    for op in g.operators:
        for t in op.outputs:
            for user in g.consumers.get(t, []):
                if not any(x in g.producer for x in op.inputs):
                    assert stage[op.name] <= stage[user.name], (op.name, user.name)
    assert stage["cat"] == stage["shared"] == 0


def test_a_recomputed_first_stage_redoes_its_forward_on_the_whole_received_input():
    """embed_layout=vocab+batch sends each device's batch piece of the embedding's output to the first
    layer stage, whose input is a receive's piece and a local copy's; with recompute=full the redone
    forward read a renamed buffer holding the local piece only (the receive is not redone), and the
    gradients were wrong (0.26 on this model). Now it reads the received input as the forward left it."""
    ctx = _vp_ctx(devices=2)
    knobs = dict(pp=2, dp=1, tp=1, microbatch=8, embed_layout="vocab+batch", head_layout="vocab", recompute="full")
    plan = get_space("interlaced").build(ctx, knobs)
    program = materialize(plan, ctx.graph)
    received = {
        w for d in program.devices for b in d.blocks.values() for t in b.tasks if t.kind.value == "R" for w in t.writes
    }
    redo_reads = {
        r
        for d in program.devices
        for b in d.blocks.values()
        for t in b.tasks
        if t.name.startswith("re:")
        for r in t.reads
    }
    assert received & redo_reads  # the redo reads the received buffer itself
    res = launch_local(plan, 2, steps=1, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL and res.max_grad_error <= GRAD_TOL, (res.max_loss_error, res.max_grad_error)
