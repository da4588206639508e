"""Golden predictions: a table of plans and what planlab predicts for each (``tests/test_golden.py``).

Each case builds one plan with a space's ``build`` (as ``planlab explore`` does), builds its Program
the way ``explore`` and ``planlab simulate`` do (``build_program`` with the cost model's software and
precision, reduced to device classes) and simulates it; a second, full Program gives every device's
task count. Recorded per case: the iteration
time, the hardware FLOPs, per device class its finish, compute, communication, wait, exposed
communication and bubble times and its peak memory (with the time of the peak), and per device the
class it belongs to and the number of tasks it runs in one iteration.

The table covers every built-in space (dp, tp, pp, recompute, megatron, coshard, interlaced, 3f1b,
alpa), ZeRO 0 to 3, every pipeline schedule (1f1b, gpipe, interleaved, zb-h1, zb-v, dualpipe, the
interlaced pipeline, 3f1b and the plain recycling schedule, and a single stage accumulating
gradients), context and expert parallelism, ZeRO-Offload's optimizer on the host,
co-located pieces inside recomputed layers, vocabulary-parallel heads and the model families'
small presets, on the ``cpu`` cluster, on two DGX A100 nodes (planlab's software) and on two
HGX A100 nodes with Megatron-LM's and DeepSpeed's software (gradients reduced after the backward;
DeepSpeed's pipeline sends blocking).

A change that moves a prediction on purpose (the cost model, say) regenerates the file with one
command from the repository root, and the diff of ``tests/data/golden_predictions.json`` shows
what moved::

    .venv/bin/python tests/golden_predictions.py
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data" / "golden_predictions.json"

# Models beyond the presets (as the tests of the spaces use them)
WIDE_VOCAB = (("layers", 2), ("hidden", 32), ("heads", 4), ("seq", 16), ("vocab", 512))  # interlaced
VOCAB_PARALLEL = WIDE_VOCAB + (("vocab_parallel", 1),)
RECYCLED = (("recycles", 3),)  # evoformer: three passes, two behind a detach
ALPA_GPT = (("hidden", 256), ("seq", 64))
FOUR_LAYERS = (("layers", 4),)  # zb-v: two stages a device over pp=2


@dataclass(frozen=True)
class Case:
    """One plan: the model (preset or family with ``args``), global batch, cluster (name or spec
    path), nodes, space and knobs; ``software`` is the training software (None: the cluster's default)."""

    name: str
    model: str
    batch: int
    cluster: str
    nodes: int
    space: str
    knobs: dict = field(hash=False)
    args: tuple = ()
    software: str | None = None


def _cases() -> tuple[Case, ...]:
    cpu2 = dict(cluster="cpu", nodes=2)
    cpu4 = dict(cluster="cpu", nodes=4)
    gpu = dict(cluster="dgx-a100-80g", nodes=2)
    sw = dict(cluster="hgx-a100-80g-4nic", nodes=2, software="megatron")
    dp2 = dict(dp=2, tp=1, pp=1)
    pp2 = dict(dp=1, tp=1, pp=2, microbatch=2)
    return (
        # data parallelism, ZeRO 0 to 3, gradient accumulation on one stage
        Case("dp2", "gpt-tiny", 8, space="dp", knobs=dict(dp=2, microbatch=4), **cpu2),
        Case("dp2-accumulate", "gpt-tiny", 8, space="megatron", knobs=dict(dp2, microbatch=1), **cpu2),
        Case(
            "dp2-no-buckets",
            "gpt-tiny",
            8,
            space="megatron",
            knobs=dict(dp2, microbatch=2),
            software="deepspeed",
            **cpu2,
        ),
        *(
            Case(f"zero{z}", "gpt-tiny", 8, space="megatron", knobs=dict(dp2, microbatch=2, zero=z), **cpu2)
            for z in (1, 2, 3)
        ),
        # tensor parallelism, sequence parallelism, recomputation
        Case("tp2", "gpt-tiny", 8, space="tp", knobs=dict(tp=2), **cpu2),
        Case(
            "tp2-sp",
            "gpt-tiny",
            8,
            space="megatron",
            knobs=dict(tp=2, dp=1, pp=1, microbatch=4, sequence_parallel=True),
            **cpu2,
        ),
        Case(
            "tp2-full-recompute",
            "gpt-tiny",
            8,
            space="megatron",
            knobs=dict(tp=2, dp=1, pp=1, microbatch=4, recompute="full"),
            **cpu2,
        ),
        Case(
            "dp2-selective-recompute",
            "gpt-tiny",
            8,
            space="dp*recompute",
            knobs=dict(dp=2, microbatch=2, recompute="selective"),
            **cpu2,
        ),
        # pipelines: every schedule
        Case("pp2-1f1b", "gpt-tiny", 8, space="pp", knobs=dict(pp=2, schedule="1f1b"), **cpu2),
        Case("pp2-gpipe", "gpt-tiny", 8, space="megatron", knobs=dict(pp2, schedule="gpipe"), **cpu2),
        Case("pp2-zb-h1", "gpt-tiny", 8, space="megatron", knobs=dict(pp2, schedule="zb-h1"), **cpu2),
        Case(
            "pp2-zb-h1-recompute",
            "gpt-tiny",
            8,
            space="megatron",
            knobs=dict(pp2, schedule="zb-h1", recompute="full"),
            **cpu2,
        ),
        Case(
            "pp2-interleaved",
            "gpt-small",
            8,
            space="megatron",
            knobs=dict(pp2, schedule="interleaved", virtual_stages=2),
            **cpu2,
        ),
        Case(
            "pp2-zb-v",
            "gpt-tiny",
            8,
            space="megatron",
            knobs=dict(dp=1, tp=1, pp=2, microbatch=1, schedule="zb-v"),
            args=FOUR_LAYERS,
            **cpu2,
        ),
        Case("pp2-dualpipe", "gpt-tiny", 8, space="megatron", knobs=dict(pp2, schedule="dualpipe"), **cpu2),
        Case(
            "dp2-pp2-zero3-zb-h1",
            "gpt-tiny",
            8,
            space="megatron",
            knobs=dict(dp=2, tp=1, pp=2, microbatch=1, zero=3, schedule="zb-h1"),
            **cpu4,
        ),
        Case(
            "dp2-pp2-zero1", "gpt-tiny", 8, space="megatron", knobs=dict(dp=2, tp=1, pp=2, microbatch=1, zero=1), **cpu4
        ),
        Case("tp2-pp2-llama", "llama-tiny", 8, space="megatron", knobs=dict(dp=1, tp=2, pp=2, microbatch=2), **cpu4),
        # context parallelism (all-to-all over the sequence and heads), expert parallelism
        Case("cp2-llama", "llama-tiny", 8, space="megatron", knobs=dict(dp=1, cp=2, tp=1, pp=1, microbatch=4), **cpu2),
        Case(
            "dp2-ep2-deepseek",
            "deepseek-tiny",
            8,
            space="megatron",
            knobs=dict(dp=2, tp=1, pp=1, microbatch=2, ep=2),
            **cpu2,
        ),
        # Megatron-Bridge's DeepSeek-V3 layout: tp x ep, expert TP 1, sequence parallelism; one
        # all-to-all over the ep x tp ranks each way, each rank sending its own share of the tokens
        Case(
            "dp2-tp2-ep4-etp1-deepseek",
            "deepseek-tiny",
            8,
            space="megatron",
            knobs=dict(dp=2, tp=2, pp=1, microbatch=2, ep=4, etp=1, sequence_parallel=True),
            **cpu4,
        ),
        # co-located pieces (coshard), alone and inside recomputed layers
        Case(
            "coshard-attention",
            "gpt-tiny",
            8,
            space="megatron*coshard",
            knobs=dict(dp=1, tp=2, pp=1, microbatch=4, coshard=2),
            **cpu2,
        ),
        Case(
            "coshard-both-full",
            "gpt-tiny",
            8,
            space="megatron*coshard",
            knobs=dict(dp=1, tp=2, pp=1, microbatch=4, coshard=2, coshard_blocks="both", recompute="full"),
            **cpu2,
        ),
        Case(
            "coshard-remade",
            "gpt-tiny",
            8,
            space="megatron*coshard",
            knobs=dict(
                dp=1,
                tp=2,
                pp=1,
                microbatch=4,
                coshard=2,
                coshard_blocks="both",
                recompute="full",
                coshard_outputs="recompute",
            ),
            **cpu2,
        ),
        Case(
            "coshard-dp-mlp",
            "gpt-tiny",
            8,
            space="dp*coshard",
            knobs=dict(dp=2, microbatch=2, coshard=2, coshard_blocks="mlp"),
            **cpu2,
        ),
        Case(
            "coshard-swin",
            "swin-tiny",
            8,
            space="megatron*coshard",
            knobs=dict(dp=2, tp=1, pp=1, microbatch=2, coshard=2, recompute="full"),
            **cpu2,
        ),
        # nnScaler's interlaced pipeline, with and without a vocabulary-parallel loss
        Case(
            "interlaced",
            "gpt",
            8,
            space="interlaced",
            knobs=dict(pp=2, dp=1, tp=2, microbatch=4),
            args=WIDE_VOCAB,
            **cpu4,
        ),
        Case(
            "interlaced-vocab-batch",
            "gpt",
            8,
            space="interlaced",
            knobs=dict(pp=2, dp=2, tp=1, microbatch=2, embed_layout="vocab+batch"),
            args=WIDE_VOCAB,
            **cpu4,
        ),
        Case(
            "interlaced-vocab-parallel",
            "gpt",
            8,
            space="interlaced",
            knobs=dict(pp=2, dp=2, tp=1, microbatch=1, head_layout="batch+vocab"),
            args=VOCAB_PARALLEL,
            **cpu4,
        ),
        # recycling (AlphaFold2's Evoformer): the plain recycled pipeline, 3F1B, 3F1B with coshard
        Case(
            "recycling-pp2",
            "evoformer-tiny",
            4,
            space="megatron",
            knobs=dict(dp=1, tp=1, pp=2, microbatch=1),
            args=RECYCLED,
            **cpu2,
        ),
        Case(
            "recycling-dp2",
            "evoformer-tiny",
            4,
            space="megatron",
            knobs=dict(dp=2, tp=1, pp=1, microbatch=1),
            args=RECYCLED,
            **cpu2,
        ),
        Case(
            "3f1b", "evoformer-tiny", 4, space="3f1b", knobs=dict(pp=2, dp=1, tp=1, microbatch=1), args=RECYCLED, **cpu2
        ),
        Case(
            "3f1b-coshard",
            "evoformer-tiny",
            4,
            space="3f1b*coshard",
            knobs=dict(dp=1, tp=1, pp=2, microbatch=1, coshard=2),
            args=RECYCLED,
            **cpu2,
        ),
        # Alpa's automatic search (its integer program picks the splits)
        Case("alpa-pp1", "gpt-tiny", 8, space="alpa", knobs=dict(pp=1, tp=1, microbatch=2), args=ALPA_GPT, **cpu2),
        Case("alpa-pp2", "gpt-tiny", 8, space="alpa", knobs=dict(pp=2, tp=1, microbatch=1), args=ALPA_GPT, **cpu4),
        # the other model families
        Case("t5-tp2", "t5-tiny", 8, space="megatron", knobs=dict(dp=1, tp=2, pp=1, microbatch=4), **cpu2),
        Case("moe-dp2-tp2", "moe-tiny", 8, space="megatron", knobs=dict(dp=2, tp=2, pp=1, microbatch=2), **cpu4),
        Case(
            "evoformer-tp2", "evoformer-tiny", 4, space="megatron", knobs=dict(dp=1, tp=2, pp=1, microbatch=2), **cpu2
        ),
        Case(
            "swin-dp2-zero2",
            "swin-tiny",
            8,
            space="megatron",
            knobs=dict(dp=2, tp=1, pp=1, microbatch=2, zero=2),
            **cpu2,
        ),
        # two DGX A100 nodes (16 GPUs, bf16 mixed precision)
        Case(
            "gpu-dp2-tp4-pp2-sp",
            "gpt-small",
            16,
            space="megatron",
            knobs=dict(dp=2, tp=4, pp=2, microbatch=1, sequence_parallel=True),
            **gpu,
        ),
        Case(
            "gpu-dp4-tp2-pp2-interleaved-zero1",
            "gpt-small",
            16,
            space="megatron",
            knobs=dict(dp=4, tp=2, pp=2, microbatch=2, zero=1, schedule="interleaved", virtual_stages=2),
            **gpu,
        ),
        Case(
            "gpu-dp4-tp2-pp2-zero2-offload",
            "gpt-small",
            16,
            space="megatron*offload",
            knobs=dict(dp=4, tp=2, pp=2, microbatch=2, zero=2, offload_optimizer=True),
            **gpu,
        ),
        Case(
            "gpu-dp16-zero3",
            "gpt-tiny",
            16,
            space="megatron",
            knobs=dict(dp=16, tp=1, pp=1, microbatch=1, zero=3),
            **gpu,
        ),
        # activation offload: half of each stage's layers keep their saved activations in host memory
        # (copies to the host after the forward and back before the backward, over PCIe)
        Case(
            "gpu-dp8-pp2-act-offload",
            "gpt-tiny",
            16,
            space="megatron*act_offload",
            knobs=dict(dp=8, tp=1, pp=2, microbatch=1, zero=0, recompute="none", offload_activations=50),
            **gpu,
        ),
        Case(
            "gpu-dp2-tp2-pp4-zb-h1",
            "gpt-small",
            16,
            space="megatron",
            knobs=dict(dp=2, tp=2, pp=4, microbatch=1, schedule="zb-h1"),
            **gpu,
        ),
        Case(
            "gpu-llama-dp8-tp2-zero2",
            "llama-tiny",
            16,
            space="megatron",
            knobs=dict(dp=8, tp=2, pp=1, microbatch=1, zero=2),
            **gpu,
        ),
        Case(
            "gpu-coshard",
            "gpt-tiny",
            16,
            space="megatron*coshard",
            knobs=dict(dp=8, tp=2, pp=1, microbatch=1, coshard=2, coshard_blocks="both", recompute="full"),
            **gpu,
        ),
        Case(
            "gpu-interlaced",
            "gpt",
            16,
            space="interlaced",
            knobs=dict(pp=2, dp=4, tp=2, microbatch=1),
            args=VOCAB_PARALLEL,
            **gpu,
        ),
        # the kernel-level spec (Megatron-LM's kernels and host costs)
        Case(
            "kernels-dp2-tp2-pp4-zb-h1",
            "gpt-small",
            16,
            space="megatron",
            knobs=dict(dp=2, tp=2, pp=4, microbatch=1, schedule="zb-h1", recompute="selective"),
            **sw,
        ),
        Case(
            "kernels-coshard",
            "gpt-tiny",
            16,
            space="megatron*coshard",
            knobs=dict(dp=8, tp=2, pp=1, microbatch=1, coshard=2, recompute="full"),
            **sw,
        ),
        Case(
            "kernels-dp16-zero3",
            "llama-tiny",
            16,
            space="megatron",
            knobs=dict(dp=16, tp=1, pp=1, microbatch=1, zero=3),
            **sw,
        ),
        # DeepSpeed's pipeline engine: blocking sends and receives in its TrainSchedule's order
        Case(
            "kernels-deepspeed-dp4-tp2-pp2",
            "gpt-small",
            16,
            space="megatron",
            knobs=dict(dp=4, tp=2, pp=2, microbatch=1, recompute="full"),
            **dict(sw, software="deepspeed"),
        ),
    )


CASES = _cases()


def plan_of(case: Case) -> tuple:
    """``(plan, graph, cost model)`` of ``case``: its space builds the plan, as explore does."""
    from conftest import traced

    from planlab.costmodel import CostModel
    from planlab.search_spaces import Context, get_space

    cluster = str(ROOT / case.cluster) if case.cluster.endswith(".json") else case.cluster
    spec, graph = traced(case.model, case.batch, case.args)
    cost = CostModel.load(cluster, case.nodes, software=case.software)
    ctx = Context(
        graph, spec, case.batch, cluster, case.nodes, cost.cluster.num_devices, cost.cluster.node.devices_per_node
    )
    return get_space(case.space).build(ctx, case.knobs), graph, cost


def programs_of(case: Case) -> tuple:
    """``(reduced, full, graph, cost)``: ``case``'s Program reduced to device classes and in full,
    built as a user's path builds them (``build_program``)."""
    from planlab.plan.software_passes import build_program

    plan, graph, cost = plan_of(case)
    return build_program(plan, graph, cost), build_program(plan, graph, cost, symmetric=False), graph, cost


def measure(case: Case) -> dict:
    """What planlab predicts for ``case`` (see the module docstring)."""
    from planlab.plan.shared_params import training_flops
    from planlab.simulator import simulate
    from planlab.simulator.classes import device_classes

    reduced, full, graph, cost = programs_of(case)
    res = simulate(reduced, cost, model_flops=training_flops(graph))
    cls = reduced.classes if reduced.reduced else device_classes(reduced, cost.cluster)
    peak = {d.device: d.peak_mem_bytes for d in res.devices}
    return dict(
        iter_time_s=res.iter_time_s,
        hardware_flops=res.hardware_flops,
        classes={
            str(d.device): dict(
                members=d.members,
                finish_s=d.finish_s,
                compute_s=d.compute_s,
                comm_s=d.comm_s,
                wait_s=d.wait_s,
                exposed_comm_s=d.exposed_comm_s,
                bubble_s=d.bubble_s,
                peak_mem_bytes=d.peak_mem_bytes,
                peak_at_s=d.peak_at_s,
            )
            for d in res.devices
        },
        device_class=list(cls),
        peak_mem_bytes=[peak[c] for c in cls],
        tasks=[sum(1 for _ in dp.tasks_in_order()) for dp in full.devices],
    )


def main() -> None:
    """Write every case's predictions to :data:`DATA`."""
    out = {c.name: measure(c) for c in CASES}
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(out)} cases to {DATA.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
