"""The training software as an input: --software and --precision on the command line, the plan
file's fields (and files without them), results.csv's columns, and what a software file changes
in the Program: ZeRO-3's gathers (per layer or per module, again for a recomputed forward) and
the gradient reduction (overlapped buckets or after the backward)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter

import pytest
from conftest import traced

from planlab.cli import main
from planlab.costmodel import CostModel
from planlab.costmodel.kernels import op_kernels
from planlab.costmodel.software import load_software
from planlab.errors import ConfigError
from planlab.plan.plan_file import load_plan, plan_from_dict, plan_to_dict
from planlab.plan.program import TaskKind
from planlab.plan.software_passes import build_program
from planlab.search_spaces import Context, get_space

TINY = ["--model", "gpt-tiny", "--cluster", "cpu", "--nodes", "2", "--global-batch", "8"]


def test_explore_records_the_software(tmp_path, capsys) -> None:
    """The default software is printed, written into results.csv and the best plan; simulate
    takes the plan's, or the one given."""
    out = tmp_path / "out"
    assert main(["explore", *TINY, "--set", "tp=2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "software planlab (fp32)" in printed
    head = (out / "results.csv").read_text().splitlines()[0].split(",")
    assert "software" in head and "precision" in head
    plan = load_plan(out / "best_plan.json")
    assert (plan.software, plan.precision) == ("planlab", "fp32")
    assert main(["simulate", str(out / "best_plan.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["software"] == "planlab"
    assert main(["simulate", str(out / "best_plan.json"), "--software", "torch", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["software"], got["precision"]) == ("torch", "fp32")


def test_plan_files_without_the_software_take_the_default(tmp_path) -> None:
    spec, g = traced("gpt-tiny", 8)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", 2, 2, 1), dict(dp=2, tp=1, pp=1, microbatch=4))
    d = plan_to_dict(plan)
    assert "software" not in d and "precision" not in d  # written only when set
    assert plan_from_dict(d).software == ""
    both = plan_from_dict(dict(d, software="deepspeed", precision="fp16"))
    assert (both.software, both.precision) == ("deepspeed", "fp16")
    assert plan_from_dict(plan_to_dict(both)) == both
    with pytest.raises(Exception, match="field 'software' must be a string"):
        plan_from_dict(dict(d, software=3))


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--software", "jax"], "unknown software 'jax'"),
        (["--software", "missing.json"], "software file 'missing.json' not found"),
        (["--precision", "fp8"], "has no precision 'fp8'"),
    ],
)
def test_bad_software_is_one_line(args, fragment, capsys) -> None:
    assert main(["explore", *TINY, *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1


def zero3_gathers(software: str, recompute: str) -> Counter:
    spec, g = traced("gpt-tiny", 8)
    cost = CostModel.load("dgx-a100-80g", 1, software=software, precision="bf16")
    ctx = Context(g, spec, 8, "dgx-a100-80g", 1, 8, 8)
    plan = get_space("megatron").build(ctx, dict(dp=8, tp=1, pp=1, microbatch=1, zero=3, recompute=recompute))
    program = build_program(plan, g, cost)
    tasks = [t for b in program.devices[0].blocks.values() for t in b.tasks if t.kind is TaskKind.COLLECTIVE]
    return Counter(t.name.split("[")[0] for t in tasks if t.collective == "all_gather")


def test_zero3_gathers_as_the_software_does() -> None:
    """FSDP (torch) gathers a layer at a time, forward and backward; DeepSpeed gathers each
    module, and once more for a recomputed forward."""
    fsdp, ds = zero3_gathers("torch", "full"), zero3_gathers("deepspeed", "full")
    assert set(fsdp) == {"zero3-gather-f", "zero3-gather-b"} and fsdp["zero3-gather-f"] == fsdp["zero3-gather-b"]
    assert set(ds) == {"zero3-gather-f", "zero3-gather-b", "zero3-gather-r"}
    assert ds["zero3-gather-f"] > 2 * fsdp["zero3-gather-f"]  # modules, not layers
    assert "zero3-gather-r" not in zero3_gathers("deepspeed", "none")


def test_gradient_reduction_follows_the_software() -> None:
    """torch (DDP) overlaps bucketed all-reduces with the backward; megatron reduces after it."""
    spec, g = traced("gpt-tiny", 8)
    ctx = Context(g, spec, 8, "dgx-a100-80g", 1, 8, 8)
    plan = get_space("megatron").build(ctx, dict(dp=8, tp=1, pp=1, microbatch=1))
    for software, overlapped in (("torch", True), ("megatron", False)):
        program = build_program(plan, g, CostModel.load("dgx-a100-80g", 1, software=software))
        reduces = [
            t for b in program.devices[0].blocks.values() for t in b.tasks if t.collective == "all_reduce" and t.final
        ] + [t for (s, ph), b in program.devices[0].blocks.items() for t in b.tasks if ph == "U" and t.collective]
        assert reduces and all(t.overlap == overlapped for t in reduces), software


def test_default_precision_by_device() -> None:
    assert CostModel.load("dgx-1-v100").precision.name == "fp16"  # no bf16 tensor cores
    assert CostModel.load("dgx-h100").precision.name == "bf16"
    assert CostModel.load("cpu").software.name == "planlab"
    with pytest.raises(ConfigError, match="'v100-32g' has no fp8 peak"):
        CostModel.load("dgx-1-v100", precision="fp8")


def test_per_rank_collective_buffers_cost_a_copy_per_rank() -> None:
    """DeepSpeed of 2021 passes its all-gathers and its gradients' reduce-scatters a list of one
    tensor per rank, which PyTorch copies out of (into) a flat buffer one rank at a time: the same
    all-gather costs n copies more than deepspeed's flat one, the extra grows with the ranks, a
    reduce-scatter pays the same copies, and an all-reduce (one tensor) costs the same."""
    new, old = (
        CostModel.load("dgx-a100-80g", 96, software=s, precision="fp16") for s in ("deepspeed", "deepspeed-2021")
    )
    assert (new.software.collective_buffers, old.software.collective_buffers) == ("flat", "per_rank")
    extra = {}
    for n in (8, 768):
        group = tuple(range(n))
        t_new, t_old = (c.collective_time_s("all_gather", 1.2e9, group) for c in (new, old))
        extra[n] = t_old - t_new
        assert extra[n] == pytest.approx(old.buffer_copies_s("all_gather", 1.2e9, n)) and extra[n] > 0
        assert old.collective_time_s("all_reduce", 1.2e9, group) == new.collective_time_s("all_reduce", 1.2e9, group)
    assert extra[768] > extra[8]
    assert old.buffer_copies("reduce_scatter", 768) == 768 and new.buffer_copies("reduce_scatter", 768) == 0
    assert old.buffer_copies("all_reduce", 768) == 0 and old.buffer_copies("all_gather", 1) == 0
    assert old.buffer_copies("all_gather", 768) == 768 and new.buffer_copies("all_gather", 768) == 0


def test_megatron_2019_attention_masks_and_normalizes_in_separate_kernels() -> None:
    """Megatron-LM 2019 scales query and key, multiplies by the mask, subtracts and normalizes in
    separate half-precision kernels: more passes over the scores than the fused kernel, each way."""

    assert not load_software("megatron-2019").fused_softmax and load_software("megatron").fused_softmax
    shapes = ((8, 16, 1024, 96), (8, 16, 1024, 96), (8, 16, 1024, 96), (8, 16, 1024, 96))
    for phase in ("F", "B"):
        fused, unfused = (op_kernels("attention", phase, shapes, 2, "megatron", False, f) for f in (True, False))
        moved = [sum(k.bytes for k in ks.kernels if not k.gemm) for ks in (fused, unfused)]
        assert moved[1] > moved[0] and unfused.calls > fused.calls
        assert [k.gemm for k in unfused.kernels if k.gemm] == [k.gemm for k in fused.kernels if k.gemm]


def test_megatron_runs_attention_fused_and_megatron_2022_unfused() -> None:
    """Megatron-Core with Transformer Engine (``megatron``) computes the attention core in one fused
    kernel each way, its backward computing the scores again (2.5 times the forward's flop, as
    FlashAttention-2 counts it); Megatron-LM before it (``megatron-2022``) in its unfused kernels."""
    core, old = load_software("megatron"), load_software("megatron-2022")
    assert core.fused_attention and core.attention_fused and not old.fused_attention and not old.attention_fused
    shapes = ((8, 16, 1024, 96), (8, 16, 1024, 96), (8, 16, 1024, 96), (8, 16, 1024, 96))
    fwd, bwd = (op_kernels("attention", ph, shapes, 2, "megatron", False, True, True) for ph in ("F", "B"))
    assert len(fwd.kernels) == len(bwd.kernels) == 1
    flop = [math.prod(ks.kernels[0].gemm) for ks in (fwd, bwd)]
    assert flop[1] == pytest.approx(2.5 * flop[0])
    unfused = op_kernels("attention", "F", shapes, 2, "megatron", False, True, False)
    assert len(unfused.kernels) > 1 and any(k.name == "baddbmm-scores" for k in unfused.kernels)


def test_a_software_file_with_a_base_gives_only_what_differs(tmp_path) -> None:
    """``base``: the base's fields, the file's own over them, objects merged field by field;
    ``megatron-2024`` is ``megatron`` with the routing weights applied at the combine."""
    core, older = load_software("megatron"), load_software("megatron-2024")
    assert core.routing_weights_in_experts and not older.routing_weights_in_experts
    assert dataclasses.replace(older, name=core.name, path=core.path, routing_weights_in_experts=True) == core
    assert older.precisions == core.precisions and older.memory == core.memory
    mine = tmp_path / "mine.json"
    mine.write_text(
        json.dumps(
            {
                "name": "mine",
                "base": "megatron-2024",
                "precisions": {"fp8": {"optimizer_bytes": 8}, "source": {"fp8": "BF16 moments"}},
            }
        )
    )
    sw = load_software(mine)
    assert sw.precision("fp8").optimizer_bytes == 8 and sw.precision("fp8").linear_input_bytes == 1
    assert sw.precision("bf16") == core.precision("bf16") and not sw.routing_weights_in_experts


def test_torch_2024_runs_torchtitans_eager_rms_norm() -> None:
    """``torch-2024`` is ``torch`` with torchtitan's 2024 eager RMSNorm: eight kernels forward, the
    fp32 round trip moving several times the bytes of one fused pass each way; other kinds unchanged."""
    now, then = load_software("torch"), load_software("torch-2024")
    assert now.fused_rms_norm and not then.fused_rms_norm
    assert dataclasses.replace(then, name=now.name, path=now.path, fused_rms_norm=True) == now
    shapes = ((1, 4096, 4096), (4096,), (1, 4096, 4096))
    n = 4096 * 4096
    for phase, kernels, at_least in (("F", 8, 8), ("B", 13, 7)):
        fused = op_kernels("rms_norm", phase, shapes, 2, "torch")
        eager = op_kernels("rms_norm", phase, shapes, 2, "torch", fused_rms_norm=False)
        assert len(eager.kernels) == kernels and len(fused.kernels) < kernels
        assert sum(k.bytes for k in eager.kernels) > at_least * sum(k.bytes for k in fused.kernels) > at_least * 2 * n
    assert op_kernels("linear", "F", ((1, 8, 16), (32, 16), (1, 8, 32)), 2, "torch", fused_rms_norm=False) == (
        op_kernels("linear", "F", ((1, 8, 16), (32, 16), (1, 8, 32)), 2, "torch")
    )


@pytest.mark.parametrize(
    "base, message",
    [
        ("nope", "unknown software 'nope'"),
        (3, "field 'base' is 3; expected a built-in software name or a file"),
        ("SELF", "leads back to itself"),
    ],
)
def test_a_bad_base_is_named_in_one_line(tmp_path, base, message) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "base": str(path) if base == "SELF" else base}))
    with pytest.raises(ConfigError, match=message) as e:
        load_software(path)
    assert "\n" not in str(e.value)


def test_deepspeed_2021_issues_each_gather_with_the_device_idle(tmp_path) -> None:
    """DeepSpeed of 2021 zero-fills each gathered buffer, synchronizes the device and walks the
    group's ranks in Python before issuing the all-gather (its fetch had synchronized it too): in the
    forward block each gather starts after an entry on the compute stream holding the fill and that
    host time (``zero3.gather_rank_us`` per rank and the framework call), and the computation after
    it waits for the per-rank copy launches too; the later deepspeed issues its gathers while the
    device goes on."""
    from planlab.simulator.units import AsyncCollective, Segment, lower_block, overlap_writers

    spec, g = traced("gpt-tiny", 8)
    ctx = Context(g, spec, 8, "dgx-a100-80g", 1, 8, 8)
    plan = get_space("megatron").build(ctx, dict(dp=8, tp=1, pp=1, microbatch=1, zero=3))
    # gpt-tiny's weights are all below DeepSpeed's persistence threshold: gathered here all the same
    gathering = tmp_path / "ds2021.json"
    gathering.write_text(json.dumps({"name": "ds2021", "base": "deepspeed-2021", "zero3": {"persistence_elements": 1}}))
    entries: dict[str, dict[str, list[float]]] = {}
    for software in ("deepspeed", str(gathering)):
        cost = CostModel.load("dgx-a100-80g", 1, software=software, precision="fp16")
        block = build_program(plan, g, cost).devices[0].blocks[(0, "F")]
        units = lower_block(
            block, device=0, cls=[0] * 8, cost=cost, dtype="fp16", sizes={}, writers=overlap_writers([block])
        )
        found: dict[str, list[float]] = {"prepare": [], "issue": []}
        for k, u in enumerate(units):
            if not isinstance(u, Segment):
                continue
            for name, d in zip(u.tasks, u.durations):
                kind = name.rpartition(":")[2]
                if kind in found:
                    found[kind].append(d)
            if u.tasks[-1].endswith(":prepare"):  # the gather starts right after its preparation
                gather = units[k + 1]
                assert isinstance(gather, AsyncCollective) and u.tasks[-1] == f"{gather.task}:prepare"
        entries[software] = found
    gathers = sum(1 for t in block.tasks if t.role.value == "unit-gather")
    assert entries["deepspeed"] == {"prepare": [], "issue": []}
    mine = entries[str(gathering)]
    assert len(mine["prepare"]) == len(mine["issue"]) == gathers > 0
    sw = load_software("deepspeed-2021")
    assert sw.zero3_gather_rank_s > 0
    # before: at least the framework call and the loop over the 8 ranks; after: the 8 copy launches
    assert min(mine["prepare"]) >= sw.host_collective_s + 8 * sw.zero3_gather_rank_s
    assert min(mine["issue"]) >= 8 * sw.host_launch_s


@pytest.mark.parametrize(
    "kernels, message",
    [
        ({"pascal": "flash2"}, "names architecture 'pascal'; choose"),
        ({"hopper": "fa9"}, "'attention_kernels.hopper' is 'fa9'; choose"),
    ],
)
def test_a_bad_attention_kernel_is_named_in_one_line(tmp_path, kernels, message) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "base": "megatron", "attention_kernels": kernels}))
    with pytest.raises(ConfigError, match=message) as e:
        load_software(path)
    assert "\n" not in str(e.value)


def test_attention_kernels_by_architecture() -> None:
    """Transformer Engine prefers cuDNN's fused attention on Hopper and FlashAttention-2 on Ampere;
    torch's SDPA runs its FlashAttention-2 on both; a software's base passes the choice on."""
    core, torch_sw = load_software("megatron"), load_software("torch")
    assert (core.attention_kernel("hopper"), core.attention_kernel("ampere")) == ("cudnn", "flash2")
    assert (torch_sw.attention_kernel("hopper"), torch_sw.attention_kernel("ampere")) == ("flash2", "flash2")
    assert load_software("megatron-2024").attention_kernel("hopper") == "cudnn"
    assert core.attention_kernel("volta") == ""


def test_deepspeed_2021s_fetch_waits_for_the_reduce_scatters_issued_before_it(tmp_path) -> None:
    """DeepSpeed 2021's fetch ends with ``torch.cuda.synchronize()``: a backward task waiting for
    its gathered weights waits for every reduce-scatter issued before the task before it (the
    attention's output projection for the MLP's input projection's, issued by the second layer
    norm's gradient hook), not for one its own module's gradient hook issues after the fetch (the
    MLP's input projection for its output projection's)."""
    from planlab.simulator.units import Await, lower_block, overlap_writers

    spec, g = traced("gpt-tiny", 8)
    ctx = Context(g, spec, 8, "dgx-a100-80g", 1, 8, 8)
    plan = get_space("megatron").build(ctx, dict(dp=8, tp=1, pp=1, microbatch=1, zero=3))
    mine = tmp_path / "ds2021.json"
    mine.write_text(json.dumps({"name": "ds2021", "base": "deepspeed-2021", "zero3": {"persistence_elements": 1}}))
    cost = CostModel.load("dgx-a100-80g", 1, software=str(mine), precision="fp16")
    block = build_program(plan, g, cost).devices[0].blocks[(0, "B")]
    units = lower_block(
        block, device=0, cls=[0] * 8, cost=cost, dtype="fp16", sizes={}, writers=overlap_writers([block])
    )
    waits = [set(u.tasks) for u in units if isinstance(u, Await)]

    def reduce(unit: str) -> str:
        return next(
            t.name for t in block.tasks if t.name.startswith("zero3-reduce-scatter") and t.name.endswith(f"#{unit}")
        )

    def gather(unit: str) -> str:
        return next(t.name for t in block.tasks if t.name.startswith("zero3-gather-b") and t.name.endswith(f"#{unit}"))

    fc = next(w for w in waits if gather("blocks.1.mlp.fc") in w)
    proj = next(w for w in waits if gather("blocks.1.attn.proj") in w)
    assert reduce("blocks.1.mlp.proj") not in fc
    assert reduce("blocks.1.mlp.fc") in proj
