"""Plans: the three primitives (op-trans, op-assign, op-order) recorded as data.

A :class:`PlanBuilder` applies the primitives to a traced graph and returns an
immutable :class:`Plan`. ``materialize`` turns a Plan into a Program; the plan
file format (JSON, versioned) lives in :mod:`planlab.plan.plan_file`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from planlab.errors import ConfigError, InfeasiblePlan, choices
from planlab.graph.ir import Graph, Operator
from planlab.graph.random_ops import draws_random
from planlab.models.spec import ModelSpec
from planlab.plan.colocation import colocation

PLAN_VERSION = 3  # 2: the update phase is U (it was W in version 1); 3: meshes, placements, schedules listed once
READ_VERSIONS = (1, 2, 3)
ZERO_STAGES = (0, 1, 2, 3)  # the ZeRO stages materialize supports; the search spaces' zero knob explores these


@dataclass(frozen=True)
class OpPlan:
    """How one operator is split and placed.

    ``dims[i]`` is the dimension split across mesh axis ``i`` into
    ``sizes[i]`` pieces (``None``: replicated ``sizes[i]`` times); ``devices``
    lists the device of each piece in row-major mesh order; ``stage`` groups
    operators whose pieces a schedule runs together.
    """

    op: str
    dims: tuple[str | None, ...] = ()
    sizes: tuple[int, ...] = ()
    devices: tuple[int, ...] = ()
    stage: int = 0
    recompute: int = 0  # 0: keep what the backward needs; k > 0: recompute with group k in the backward
    # an attention run as ring attention: its queries' sequence ``s`` is split (along the mesh axis
    # that splits ``s``) and so are its keys' and values', passed around that axis' devices
    ring: bool = False
    # 0: keep its saved activations on the device; k > 0: copy them to host memory after its forward,
    # with the rest of offload group ``k``, and back before its backward (planlab.plan.passes.act_offload)
    offload: int = 0

    def __str__(self) -> str:
        tr = " x ".join(f"{d or 'R'}/{n}" for d, n in zip(self.dims, self.sizes)) or "whole"
        rc = f" recompute {self.recompute}" if self.recompute else ""
        off = f" offload {self.offload}" if self.offload else ""
        return f"{self.op}: {tr} on {list(self.devices)} stage {self.stage}{rc}{off}{' ring' if self.ring else ''}"


_ACTION = re.compile(r"^(\d+)([FBIWU])(\d+)$")
PHASES = ("F", "B", "I", "W", "U")
RING_DIM = "s"  # the queries' sequence of an attention (``F.scaled_dot_product_attention``'s signature)
RING_KV_DIM = "t"  # the keys' and values' sequence


def causal_attention(op: Operator) -> bool:
    """Whether attention ``op`` (without a mask input) is causal: its signature keeps the queries'
    sequence whole exactly then (``planlab.graph.ops_gpt``), and a graph for planning has no call."""
    return RING_DIM in op.signature.frozen and len(op.inputs) == 3


@dataclass(frozen=True)
class Action:
    """One step of a device's schedule: run ``phase`` of ``stage`` for ``microbatch``.

    Phases, with torch.distributed.pipelining's codes: ``F`` forward, ``B`` full backward,
    ``I`` backward for the inputs' gradients only and ``W`` for the weights' gradients only
    (zero-bubble schedules split ``B`` into the two), and ``U`` the update: weight-gradient
    reduction and optimizer step, once per iteration. Text form ``{stage}{phase}{microbatch}``
    as in pipelining's schedules, e.g. ``1F0``.

    ``posts`` names the actions whose receives the device posts, in this order, when it reaches this
    action and before running it (``torch.distributed.irecv`` posted ahead, as DualPipe's
    ``batch_isend_irecv`` does): each of those receives then takes its place among the messages of
    its channel at this point and is waited for where its own action reads it. An action may post
    its own receives (then ahead of others posted with it). Empty: every receive is posted where its
    action reads it.

    ``overlaps``: the device runs this action and the next of its schedule as a pair, the
    communication of each overlapping the computation of the other on one compute stream (DualPipe's
    overlapped forward and backward chunks of two micro-batches); it does not change what is computed.
    """

    stage: int
    phase: str
    microbatch: int = 0
    posts: tuple[Action, ...] = ()
    overlaps: bool = False

    def __str__(self) -> str:
        return f"{self.stage}{self.phase}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """The action ``text`` names, such as ``0F3``; ConfigError if it names none."""
        m = _ACTION.match(text.strip()) if isinstance(text, str) else None
        if not m:
            raise ConfigError(f"{text!r} is not an action like '0F3' (stage, phase F/B/I/W/U, microbatch)")
        return cls(int(m.group(1)), m.group(2), int(m.group(3)))

    def bare(self) -> Action:
        """This action without ``posts`` and ``overlaps``."""
        return Action(self.stage, self.phase, self.microbatch) if self.posts or self.overlaps else self


@dataclass(frozen=True)
class Plan:
    """A complete parallelization plan: model, batch, cluster and the primitives applied."""

    model: ModelSpec
    global_batch: int
    cluster: str
    nodes: int
    num_devices: int
    microbatches: int
    ops: tuple[OpPlan, ...]
    schedule: tuple[tuple[Action, ...], ...] = ()  # per device; empty: the default order
    space: str = ""
    knobs: tuple[tuple[str, Any], ...] = ()
    version: int = PLAN_VERSION
    zero: int = 0  # ZeRO stage for data-parallel weights: 1 shards optimizer states, 2 also gradients, 3 weights
    software: str = ""  # the training software it is priced with (a built-in name or a file); "": the cluster's default
    precision: str = ""  # the software's precision ("bf16", "fp16", "fp8", "fp32"); "": the device's default
    offload_optimizer: bool = False  # ZeRO-Offload: optimizer states and the step in host memory, on the host CPU
    # with offload_optimizer, the devices whose first pipeline stage is listed offload (empty: all)
    offload_stages: tuple[int, ...] = ()
    # the tokens in zigzag order along the sequence, so that each ring attention's position r holds
    # chunks r and 2 cp - 1 - r (planlab.plan.program.Ring): causal load balancing
    zigzag: bool = False
    # the ring attentions all-gather their keys and values over the ring instead of passing them around
    # (context parallelism as Llama 3 runs it, cp_kind=allgather: planlab.plan.program.Ring.gather)
    kv_gather: bool = False
    # recompute groups whose outputs are dropped too: freed once the operators after the group have
    # run their forward, and remade for those operators' backward (Megatron-Core's
    # CheckpointWithoutOutput with discard_output_and_register_recompute, PlanBuilder.discard_outputs)
    discard_outputs: tuple[int, ...] = ()

    def __deepcopy__(self, memo) -> "Plan":
        # immutable all the way down: a copy is the plan itself (pandas deep-copies a DataFrame's
        # attrs, which hold the best plan, on every operation: seconds each for 1,024 devices)
        return self

    def op_plan(self, name: str) -> OpPlan:
        for p in self.ops:
            if p.op == name:
                return p
        raise InfeasiblePlan(f"the plan does not place operator {name!r}")

    def describe(self) -> str:
        k = " ".join(f"{a}={b}" for a, b in self.knobs)
        return f"{self.space or 'plan'}({k}) on {self.num_devices} devices, {self.microbatches} micro-batches"


class PlanBuilder:
    """Applies op-trans, op-assign and op-order to a graph, then ``build()``s a Plan.

    Example::

        b = PlanBuilder(graph, model=spec, global_batch=8, cluster="cpu", nodes=2)
        for op in graph.operators:
            b.op_trans(op.name, graph.dim_with_label(op, graph.batch_label), 2)
            b.op_assign(op.name, [0, 1])
        plan = b.build()
    """

    def __init__(
        self,
        graph: Graph,
        *,
        model: ModelSpec,
        global_batch: int,
        cluster: str,
        nodes: int,
        num_devices: int,
        space: str = "",
        knobs: dict | None = None,
    ) -> None:
        self.graph = graph
        self.model, self.global_batch, self.cluster, self.nodes = model, global_batch, cluster, nodes
        self.num_devices, self.space = num_devices, space
        self.knobs = dict(knobs or {})
        self._dims: dict[str, list[str | None]] = {op.name: [] for op in graph.operators}
        self._sizes: dict[str, list[int]] = {op.name: [] for op in graph.operators}
        self._devices: dict[str, tuple[int, ...]] = {}
        self._stage: dict[str, int] = {}
        self._schedule: dict[int, tuple[Action, ...]] = {}
        self._recompute: dict[str, int] = {}
        self._offload_acts: dict[str, int] = {}
        self._ring: set[str] = set()
        self._zigzag = False
        self._kv_gather = False
        self._discard: set[int] = set()
        self._checked: set[tuple[int, ...]] = set()
        self._microbatches = 1
        self._zero = 0
        self._offload_optimizer = False
        self._offload_stages: tuple[int, ...] = ()

    # -- the three primitives --------------------------------------------------
    def op_trans(self, op: str, dim: str | None, n: int) -> None:
        """Split operator ``op`` along dimension ``dim`` into ``n`` pieces
        (``dim=None``: replicate it ``n`` times). Repeated calls split every
        piece again, adding an axis to the operator's mesh."""
        o = self.graph.op(op)
        if not isinstance(n, int) or n < 1:
            raise InfeasiblePlan(f"op_trans({op!r}): the number of pieces must be a positive integer, got {n!r}")
        if dim is not None:
            if dim not in o.signature.dims():
                raise InfeasiblePlan(
                    f"operator {op!r} has no dimension {dim!r}; its signature is "
                    f"{o.signature} (dimensions {choices(o.signature.dims())})"
                )
            if not o.signature.splittable(dim) and not (op in self._ring and dim == RING_DIM):
                raise InfeasiblePlan(
                    f"dimension {dim!r} of operator {op!r} ({o.signature}) cannot be split; "
                    f"splittable: {choices(o.splittable_dims())}"
                )
            done = math.prod(s for d, s in zip(self._dims[op], self._sizes[op]) if d == dim)
            size = o.dim_sizes[dim]
            if size % (done * n):
                raise InfeasiblePlan(
                    f"dimension {dim!r} of operator {op!r} has size {size}, which does not split into {done * n} pieces"
                )
        self._dims[op].append(dim)
        self._sizes[op].append(n)

    def op_assign(self, op: str, devices: list[int] | tuple[int, ...], *, stage: int = 0) -> None:
        """Place the pieces of ``op`` (row-major over its splits) on ``devices``. A device listed
        ``k`` times holds ``k`` neighbouring pieces of one split, which it runs one after another
        (nnScaler's coshard, :mod:`planlab.plan.colocation`), e.g. ``[0, 0, 1, 1]`` after
        ``op_trans(op, dim, 4)``."""
        self.graph.op(op)
        devices = devices if type(devices) is tuple else tuple(map(int, devices))
        want = math.prod(self._sizes[op])
        if len(devices) != want:
            raise InfeasiblePlan(f"operator {op!r} has {want} pieces; op_assign got {len(devices)} devices")
        if devices not in self._checked:  # spaces place many operators on the same devices
            if min(devices) < 0 or max(devices) >= self.num_devices:
                bad = next(d for d in devices if not 0 <= d < self.num_devices)
                raise InfeasiblePlan(f"operator {op!r} assigned to device {bad}; devices are 0..{self.num_devices - 1}")
            if len(set(devices)) == len(devices):
                self._checked.add(devices)
            else:  # co-located pieces (coshard): k neighbours of one split per device, checked per operator
                colocation(op, tuple(self._dims[op]), tuple(self._sizes[op]), devices)
        self._devices[op] = devices
        self._stage[op] = int(stage)

    def op_order(self, device: int, actions: list[Action | str]) -> None:
        """Fix the order in which ``device`` runs its stages' forward and backward
        pieces per micro-batch (and the final ``U`` update)."""
        if not 0 <= device < self.num_devices:
            raise InfeasiblePlan(f"op_order: device {device} out of range 0..{self.num_devices - 1}")
        seen = self.__dict__.setdefault("_orders_seen", {})  # replicas often share one tuple of actions
        hit = seen.get(id(actions)) if isinstance(actions, tuple) else None
        if hit is None or hit[0] is not actions:
            hit = seen[id(actions)] = (actions, tuple(a if isinstance(a, Action) else Action.parse(a) for a in actions))
        self._schedule[device] = hit[1]

    def recompute(self, op: str, group: int) -> None:
        """Recompute ``op`` in the backward instead of keeping its activations (op-order: its
        forward runs again, with the rest of ``group``, right before the group's backward).
        Group 0 turns recomputation off."""
        self.graph.op(op)
        if not isinstance(group, int) or group < 0:
            raise InfeasiblePlan(f"recompute({op!r}): the group must be a non-negative integer, got {group!r}")
        self._recompute[op] = group

    def discard_outputs(self, group: int) -> None:
        """Drop recompute ``group``'s outputs as well as what it keeps inside: the operators that
        read them keep no copy for their backward and read the ones the group's recomputation makes,
        which then runs before the first of those backwards (Megatron-Core's
        ``CheckpointWithoutOutput``: MLA's ``mla_up_proj`` frees the queries, keys and values once the
        attention core has read them)."""
        if not isinstance(group, int) or isinstance(group, bool) or group < 1:
            raise InfeasiblePlan(f"discard_outputs({group!r}): the group must be a positive integer")
        self._discard.add(group)

    def offload_activations(self, op: str, group: int) -> None:
        """Keep what ``op``'s backward saves in host memory (activation offload, as Megatron-Core's
        and torch's ``save_on_cpu``): copied device to host after the forward of offload ``group``,
        on a copy stream apart, and back ahead of the group's backward. Group 0 turns it off; an
        operator that is also recomputed keeps nothing to offload."""
        self.graph.op(op)
        if not isinstance(group, int) or isinstance(group, bool) or group < 0:
            raise InfeasiblePlan(
                f"offload_activations({op!r}): the group must be a non-negative integer, got {group!r}"
            )
        self._offload_acts[op] = group

    def ring(self, op: str) -> None:
        """Run attention ``op`` as ring attention (context parallelism, :mod:`planlab.executor.ring_attention`):
        op-trans of its queries' sequence ``s`` (whole otherwise under a causal mask) then splits its keys'
        and values' sequence ``t`` alike, and each piece meets the others' keys and values in turn, passed
        around the devices of that split. Call it before the op-trans."""
        o = self.graph.op(op)
        if o.kind != "attention" or RING_DIM not in o.signature.dims():
            raise InfeasiblePlan(f"ring({op!r}): {op!r} is a {o.kind!r} operator; only an attention runs as a ring")
        if len(o.inputs) > 3:
            raise InfeasiblePlan(
                f"ring({op!r}): the attention takes a mask or bias input, which ring attention does not split; "
                "choose cp_kind=a2a"
            )
        if draws_random(o):
            raise InfeasiblePlan(
                f"ring({op!r}): the attention has dropout, which ring attention does not draw; choose cp_kind=a2a"
            )
        self._ring.add(op)

    def zigzag(self, on: bool = True) -> None:
        """Lay the sequence out in zigzag order for the ring attentions (Megatron-Core's and Llama 3's
        causal load balancing): the model's inputs are permuted along the sequence as they are loaded,
        so that the device at position ``r`` of a ring of ``cp`` holds chunks ``r`` and ``2 cp - 1 - r``
        of ``2 cp`` (its queries, keys and values, and every other tensor along the sequence: positions
        travel with the tokens into the rotary tables); each ring step then computes half a block on every
        device (:class:`planlab.plan.program.Ring`)."""
        if not isinstance(on, bool):
            raise InfeasiblePlan(f"zigzag({on!r}): expected True or False")
        self._zigzag = on

    def kv_gather(self, on: bool = True) -> None:
        """Run the ring attentions by all-gather (context parallelism as Llama 3 runs it, section 3.3.2):
        each piece all-gathers the keys and values of its ring before computing its queries' attention,
        and reduce-scatters their gradients in the backward, neither overlapped with the computation
        (:class:`planlab.plan.program.Ring`'s ``gather``)."""
        if not isinstance(on, bool):
            raise InfeasiblePlan(f"kv_gather({on!r}): expected True or False")
        self._kv_gather = on

    def zero(self, stage: int) -> None:
        """ZeRO for weights whose gradients are summed over devices (data parallelism): stage 1
        shards their optimizer states over those devices (reduce-scatter the gradients, step the
        shard, all-gather the weights); stage 2 also keeps only a shard of the gradients; stage 3
        (FSDP's full sharding) also of the weights, all-gathered per layer before its forward and
        again before its backward, and freed after each (:mod:`planlab.plan.zero`)."""
        if stage not in ZERO_STAGES or isinstance(stage, bool):
            raise InfeasiblePlan(f"zero stage {stage!r}: choose {choices(ZERO_STAGES)}")
        self._zero = stage

    def offload_optimizer(self, on: bool = True, stages: tuple[int, ...] = ()) -> None:
        """ZeRO-Offload (Ren et al., USENIX ATC'21): the fp32 master weights and Adam's states live
        in host memory; after their reduction the gradients go device to host, the host CPU steps
        Adam, the updated weights come back host to device (:mod:`planlab.plan.passes.offload`).
        Composes with ZeRO stages 0 to 2: each device offloads what it steps (a shard under ZeRO).
        ``stages`` limits it to the devices whose first pipeline stage is listed (empty: every device)."""
        if not isinstance(on, bool):
            raise InfeasiblePlan(f"offload_optimizer({on!r}): expected True or False")
        if not isinstance(stages, tuple) or not all(isinstance(s, int) and s >= 0 for s in stages):
            raise InfeasiblePlan(f"offload_optimizer stages={stages!r}: expected a tuple of stage numbers >= 0")
        if stages and not on:
            raise InfeasiblePlan(f"offload_optimizer stages={stages!r} with offload off: turn it on or give no stages")
        self._offload_optimizer = on
        self._offload_stages = tuple(sorted(set(stages)))

    def microbatch(self, m: int) -> None:
        """Split the batch into ``m`` micro-batches run one after another on the same devices
        (op-trans of every operator's batch dimension over time)."""
        if not isinstance(m, int) or m < 1 or self.global_batch % m:
            raise InfeasiblePlan(f"{m!r} micro-batches do not divide the global batch {self.global_batch}")
        self._microbatches = m

    # -- helpers for spaces ----------------------------------------------------
    def pieces(self, op: str) -> int:
        return math.prod(self._sizes[op])

    def split_dims(self, op: str) -> tuple[str | None, ...]:
        return tuple(self._dims[op])

    def build(self) -> Plan:
        missing = [op.name for op in self.graph.operators if op.name not in self._devices]
        if missing:
            raise InfeasiblePlan(f"{len(missing)} operators have no op_assign, e.g. {', '.join(missing[:5])}")
        ops = tuple(
            OpPlan(
                op.name,
                tuple(self._dims[op.name]),
                tuple(self._sizes[op.name]),
                self._devices[op.name],
                self._stage[op.name],
                self._recompute.get(op.name, 0),
                op.name in self._ring,
                self._offload_acts.get(op.name, 0),
            )
            for op in self.graph.operators
        )
        schedule = tuple(self._schedule.get(d, ()) for d in range(self.num_devices)) if self._schedule else ()
        return Plan(
            model=self.model,
            global_batch=self.global_batch,
            cluster=self.cluster,
            nodes=self.nodes,
            num_devices=self.num_devices,
            microbatches=self._microbatches,
            ops=ops,
            schedule=schedule,
            space=self.space,
            knobs=tuple(sorted(self.knobs.items())),
            zero=self._zero,
            offload_optimizer=self._offload_optimizer,
            offload_stages=self._offload_stages,
            zigzag=self._zigzag,
            kv_gather=self._kv_gather,
            discard_outputs=tuple(sorted(self._discard)),
        )
