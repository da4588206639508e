"""Search spaces: typed knobs, constraints, and a builder that applies the primitives.

A :class:`Space` names knobs with their candidate values (which may depend on
the model and cluster, through a :class:`Context`), constraints over an
assignment of the knobs, rules on the primitives (which dimensions an operator
may be split along, which devices it may be placed on, which orders are
allowed: :mod:`planlab.search_spaces.rules`), and ``apply`` which records on a
:class:`Draft` how operators are split, staged and ordered. ``Draft.to_plan``
then issues the primitives (op-trans, op-assign, op-order) through a
PlanBuilder, checking the rules as it issues them.

Spaces compose: ``a * b`` (product: both apply to the same plan), ``a | b``
(union: the plans of either), ``a.restrict(tp=(1, 2))`` and
``a.where(lambda k: k["tp"] * k["pp"] <= 8, "tp*pp <= 8")`` (restriction).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from planlab.errors import ConfigError, InfeasiblePlan, PlanlabError, choices
from planlab.gcpause import paused_gc
from planlab.plan.plan import Action, Plan, PlanBuilder
from planlab.search_spaces.recycling_passes import recycling_actions
from planlab.search_spaces.schedules import SCHEDULES, interleaved_1f1b
from planlab.search_spaces.schedules_v import V_SCHEDULES, v_rank

if TYPE_CHECKING:
    from planlab.graph.ir import Graph
    from planlab.search_spaces.rules import Rule


from planlab.search_spaces.knobs import KINDS, Constraint, Context, Knob, KnobView, fmt_knobs  # noqa: F401 (re-exported)


def _axis_dims(ops: list, dim_of: Callable[[Any], str | None] | Mapping[str, str | None] | tuple) -> tuple:
    """Per operator, the dimension ``dim_of`` names (a tuple: already per operator in graph order)."""
    if isinstance(dim_of, tuple):
        if len(dim_of) != len(ops):
            raise ConfigError(
                f"a mesh axis given {len(dim_of)} dimensions for the graph's {len(ops)} operators; "
                "expected one per operator in graph order (in_graph_order)"
            )
        return dim_of
    if callable(dim_of) and not isinstance(dim_of, Mapping):
        return tuple(dim_of(op) for op in ops)
    return tuple(dim_of.get(op.name) for op in ops)


def in_graph_order(graph: Graph, name: str, dims: Callable[[Graph], Mapping[str, str | None]]) -> tuple:
    """``dims(graph)`` (operator name -> dimension) per operator in graph order, as
    :meth:`Draft.add_axis` takes it without walking the graph again: cached per graph under
    ``name``, which must name ``dims`` alone (the same tuple for every plan also lets the screen
    recognise it at once)."""
    return graph.memo(("in_graph_order", name), lambda: tuple(dims(graph).get(op.name) for op in graph.operators))


def divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n``, ascending."""
    return tuple(d for d in range(1, n + 1) if n % d == 0)


@dataclass
class Draft:
    """A plan under construction: mesh axes, per-operator split dims and stages, the schedule.

    ``dims[op]`` lists the dimension ``op`` splits along each mesh axis (None: replicated); it is
    built from the axes on first use and may then be edited."""

    ctx: Context
    axes: list[tuple[str, int]] = field(default_factory=list)
    stages: dict[str, int] = field(default_factory=dict)
    num_stages: int = 1
    chunks: int = 1  # stages per device group (virtual pipeline stages)
    group: int = 0  # interleaved 1F1B: micro-batches a chunk runs in a row (Llama 3's N; 0: the device groups)
    paired: bool = False  # interleaved 1F1B: each steady-state forward overlaps the next backward (expert_overlap)
    microbatches: int = 1
    schedule: str = "1f1b"
    recompute: dict[str, int] = field(default_factory=dict)
    discard_outputs: set[int] = field(default_factory=set)  # recompute groups whose outputs are remade too
    zero: int = 0
    offload_optimizer: bool = False  # ZeRO-Offload (planlab.plan.passes.offload)
    offload_stages: tuple[int, ...] = ()  # with offload_optimizer: only the groups of these first stages (empty: all)
    offload_acts: dict[str, int] = field(default_factory=dict)  # op -> offload group (planlab.plan.passes.act_offload)
    layout: Any = None  # the per-stage StageLayout the fine space chose (planlab/search_spaces/stages.py), if any
    axis_dims: list[tuple] = field(default_factory=list, repr=False)  # per axis, per operator in graph order
    _dims: dict[str, list[str | None]] | None = field(default=None, repr=False)
    colocate: dict[str, tuple[str, int]] = field(default_factory=dict)  # op -> (dim, k): coshard
    recycles: int = 1  # recycling passes, one model chunk each (planlab/search_spaces/recycling.py)
    # op -> dim: operators on every device, split along dim (None: replicated) into one piece per
    # device, on stages of their own (``stages``) that every device runs (the interlaced pipeline)
    # (or a tuple of (dim, pieces) splits, row-major, whose pieces multiply to the device count);
    # ``spread_devices`` places an operator's pieces on other devices than 0, 1, 2, .. in order
    spread: dict[str, str | None | tuple[tuple[str | None, int], ...]] = field(default_factory=dict)
    spread_devices: dict[str, tuple[int, ...]] = field(default_factory=dict)
    stage_base: int = 0  # the stage of pipeline rank 0: stage s runs on group (s - stage_base) % groups
    vshape: bool = False  # stage s runs on group s going down, then 2 groups - 1 - s coming back (ZB-V)
    # DualPipe: the first mesh axis (2 pieces, the halves of each micro-batch) places piece 0 of stage s
    # on group s and piece 1 on group groups - 1 - s (planlab/search_spaces/schedules_v.py)
    mirror: bool = False
    # the device of each mesh position of a stage, counted from the stage's first device (empty: in
    # row-major order); lets a mesh axis split a tensor axis inside another's split while its devices
    # sit further apart (context parallelism's axis inside the tensor-parallel one, planlab/search_spaces/context.py)
    stage_order: tuple[int, ...] = ()
    ring: frozenset[str] = frozenset()  # attentions run as ring attention (context parallelism, cp_kind=ring)
    zigzag: bool = False  # the tokens in zigzag order for the rings (cp_layout=zigzag, PlanBuilder.zigzag)
    kv_gather: bool = False  # the rings all-gather their keys and values (cp_kind=allgather, PlanBuilder.kv_gather)

    def add_axis(
        self, name: str, size: int, dim_of: Callable[[Any], str | None] | Mapping[str, str | None] | tuple
    ) -> None:
        """Add a mesh axis of ``size`` devices; ``dim_of(op)`` (or ``dim_of[op.name]``, or a tuple
        per operator in graph order: :func:`in_graph_order`) names the dimension each operator
        splits along it (None: replicated)."""
        g = self.ctx.graph
        ops = g.operators
        dims = _axis_dims(ops, dim_of) if size > 1 else g.memo(("replicated",), lambda: (None,) * len(ops))
        self.axes.append((name, size))
        self.axis_dims.append(dims)
        if self._dims is not None:
            for op, d in zip(ops, dims):
                self._dims.setdefault(op.name, [None] * (len(self.axes) - 1)).append(d)

    @property
    def dims(self) -> dict[str, list[str | None]]:
        if self._dims is None:
            self._dims = {op.name: [ad[i] for ad in self.axis_dims] for i, op in enumerate(self.ctx.graph.operators)}
        return self._dims

    def op_dims(self) -> list[tuple]:
        """Per axis, per operator in graph order, the dimension split (after any edit of ``dims``)."""
        if self._dims is None:
            return self.axis_dims
        names = [op.name for op in self.ctx.graph.operators]
        none = [None] * len(self.axes)
        return [tuple((self._dims.get(n) or none)[a] for n in names) for a in range(len(self.axes))]

    @property
    def groups(self) -> int:
        """Pipeline device groups: stage ``s`` runs on group ``s % groups``."""
        return max(1, self.num_stages // self.chunks)

    @property
    def per_stage(self) -> int:
        """Devices of one pipeline stage (the product of the mesh axes)."""
        return math.prod(s for _, s in self.axes)

    @property
    def per_group(self) -> int:
        """Devices of one pipeline group (a mirrored stage's two halves are on two groups)."""
        return self.per_stage // 2 if self.mirror else self.per_stage

    def stage_devices(self, stage: int, devices: list[tuple[int, ...]]) -> tuple[int, ...]:
        """The devices of ``stage``'s pieces, row-major over the mesh axes."""
        g = self.group_of(stage)
        return devices[g] + devices[self.groups - 1 - g] if self.mirror else devices[g]

    def group_of(self, stage: int) -> int:
        """The device group that runs ``stage``."""
        if self.vshape:
            return v_rank(stage - self.stage_base, self.groups)
        return (stage - self.stage_base) % self.groups

    def group_devices(self) -> list[tuple[int, ...]]:
        """Per pipeline group, its devices in mesh order (``stage_order``, else row-major)."""
        per = self.per_group
        order = self.stage_order or range(per)
        return [tuple(r * per + p for p in order) for r in range(self.groups)]

    @property
    def dispatches_experts(self) -> bool:
        """Whether the plan sends tokens to experts on other devices (an ``ep`` mesh axis of more than one).

        DualPipe overlaps a forward and a backward chunk (``Action.overlaps``) only for that: its repository
        leaves the overlapped chunk to the model (``overlapped_forward_backward``), and DeepSeek-V3's hides
        the expert all-to-alls (report section 3.2.1). Without experts to dispatch the pair would hide nothing
        the model's own code overlaps, so such plans run DualPipe's order without pairs."""
        return any(name == "ep" and size > 1 for name, size in self.axes)

    def schedule_actions(self, rank: int) -> tuple[Action, ...]:
        """The actions of device group ``rank``: its schedule, then the update (with ``spread``
        operators, in the first stage the group runs)."""
        if self.spread:
            from planlab.search_spaces.schedules import SPREAD_SCHEDULES

            if self.schedule not in SPREAD_SCHEDULES:
                raise InfeasiblePlan(
                    f"schedule {self.schedule!r} with operators on every device; choose "
                    f"{choices(list(SPREAD_SCHEDULES))}"
                )
            actions = SPREAD_SCHEDULES[self.schedule](rank, self.groups, self.microbatches)
            first = min([rank + self.stage_base] + [self.stages.get(op, 0) for op in self.spread])
            return tuple(actions) + (Action(first, "U", 0),)
        if self.recycles > 1:  # a chunk per recycling pass: 3f1b, or a plain schedule of the last pass
            actions = recycling_actions(self.schedule, rank, self.groups, self.microbatches, self.recycles)
        elif self.schedule in V_SCHEDULES:
            actions = V_SCHEDULES[self.schedule](rank, self.groups, self.microbatches)
            if not self.dispatches_experts:
                actions = [replace(a, overlaps=False) for a in actions]
        elif self.chunks > 1:
            # paired only where experts are dispatched, as DualPipe's pairs above (Megatron-Core asserts ep > 1)
            paired = self.paired and self.dispatches_experts
            actions = interleaved_1f1b(rank, self.groups, self.microbatches, self.chunks, self.group, paired)
        else:
            if self.schedule not in SCHEDULES:
                raise InfeasiblePlan(
                    f"schedule {self.schedule!r} with {self.chunks} model chunk per device; "
                    f"choose {choices(list(SCHEDULES))} (or 'interleaved' with virtual stages)"
                )
            actions = SCHEDULES[self.schedule](rank, self.groups, self.microbatches)
        first = min(rank, self.groups - 1 - rank) if self.mirror else rank  # the group's lowest stage
        return tuple(actions) + (Action(first, "U", 0),)

    def to_plan(self, *, space: str, knobs: dict, rules: Iterable["Rule"] = ()) -> Plan:
        """Issue op-trans, op-assign and op-order for this draft, checking ``rules`` as each
        primitive is issued (InfeasiblePlan names the operator and the rule it breaks)."""
        ctx = self.ctx
        if self.per_group * self.groups != ctx.num_devices:
            raise InfeasiblePlan(
                f"{space}: {self.per_group} devices per stage x {self.groups} pipeline ranks "
                f"!= {ctx.num_devices} devices"
            )
        b = PlanBuilder(
            ctx.graph,
            model=ctx.model,
            global_batch=ctx.global_batch,
            cluster=ctx.cluster,
            nodes=ctx.nodes,
            num_devices=ctx.num_devices,
            space=space,
            knobs=knobs,
        )
        b.microbatch(self.microbatches)
        b.zero(self.zero)
        b.offload_optimizer(self.offload_optimizer, self.offload_stages)
        b.zigzag(self.zigzag)
        b.kv_gather(self.kv_gather)
        for group in sorted(self.discard_outputs):
            b.discard_outputs(group)
        self.issue(b, rules, space)
        return b.build()

    def check_rules(self, rules: Iterable["Rule"], space: str) -> None:
        """Check ``rules`` against this draft without building a plan (InfeasiblePlan if broken)."""
        rules = tuple(rules)
        if rules:
            self.issue(None, rules, space)

    def issue(self, b: PlanBuilder | None, rules: Iterable["Rule"], space: str) -> None:
        """The primitives of this draft, each checked against ``rules`` then given to ``b``
        (None: check only)."""
        from planlab.search_spaces.rules import Checker

        chk = Checker(tuple(rules), self.ctx, space)
        groups, devices = self.groups, self.group_devices()
        per_axis = self.op_dims()
        spread = self.spread
        for i, op in enumerate(self.ctx.graph.operators):
            s = self.stages.get(op.name, 0)
            if op.name in spread:  # one piece per device, on every device
                self._issue_spread(b, chk, op, s)
                continue
            if b is not None and op.name in self.ring:
                b.ring(op.name)
            for dim, (_, size) in zip([ad[i] for ad in per_axis], self.axes):
                if chk.splits and dim is not None and size > 1:
                    chk.split(op, dim)
                if b is not None:
                    b.op_trans(op.name, dim, size)
            where = self.stage_devices(s, devices)
            if op.name in self.colocate:  # each piece split k times more, the k pieces on its device
                dim, k = self.colocate[op.name]
                if chk.splits:
                    chk.split(op, dim)
                if b is not None:
                    b.op_trans(op.name, dim, k)
                where = tuple(d for d in where for _ in range(k))
            if chk.places:
                chk.place(op, where)
            if b is not None:
                b.op_assign(op.name, where, stage=s)
                if self.recompute.get(op.name):
                    b.recompute(op.name, self.recompute[op.name])
                if self.offload_acts.get(op.name):
                    b.offload_activations(op.name, self.offload_acts[op.name])
        if self.num_stages > 1 and chk.orders:
            chk.order(self.schedule if self.chunks == 1 or self.recycles > 1 or self.vshape else "interleaved")
        if self.num_stages > 1 or self.microbatches > 1:  # one stage: F0 B0 F1 B1 ... (gradient accumulation)
            if b is not None:
                for r in range(groups):
                    actions = self.schedule_actions(r)
                    for d in devices[r]:
                        b.op_order(d, actions)

    def _issue_spread(self, b: PlanBuilder | None, chk, op, stage: int) -> None:
        """A ``spread`` operator: split along its dimension into one piece per device, placed on
        every device, on ``stage``."""
        spec, n = self.spread[op.name], self.ctx.num_devices
        splits = spec if isinstance(spec, tuple) else ((spec, n),)
        for dim, k in splits:
            if chk.splits and dim is not None and k > 1:
                chk.split(op, dim)
        where = self.spread_devices.get(op.name, tuple(range(n)))
        if chk.places:
            chk.place(op, where)
        if b is not None:
            for dim, k in splits:
                b.op_trans(op.name, dim, k)
            b.op_assign(op.name, where, stage=stage)


def _dedupe(items: Iterable) -> tuple:
    return tuple(dict.fromkeys(items))


def _wrap(space: str, values: Mapping, what: str, e: Exception) -> ConfigError:
    return ConfigError(f"space {space!r} raised {type(e).__name__}: {e} while {what} the plan of {fmt_knobs(values)}")


def apply_part(part: "Space", draft: Draft, values: dict) -> None:
    """``part.apply``; an exception that is not a planlab error becomes a ConfigError naming
    the space and the knob assignment."""
    try:
        part.apply(draft, values)
    except PlanlabError:
        raise
    except Exception as e:
        raise _wrap(part.name, values, "applying", e) from e


class Space(abc.ABC):
    """A search space: knobs, constraints, rules on the primitives, and ``apply`` (one
    assignment -> draft edits). Subclass it and set ``name``, ``knobs``, ``constraints``
    (and ``rules``), or compose existing spaces with ``*``, ``|``, ``restrict`` and ``where``."""

    name = "space"
    knobs: tuple[Knob, ...] = ()
    constraints: tuple[Constraint, ...] = ()
    rules: tuple["Rule", ...] = ()
    order = 0  # product applies parts by ascending order (stages before mesh axes)
    # True: a draft may depend on the drafts made before it in the same process (the fine space's
    # pruning bound, planlab/search_spaces/fine.py); see ordered_drafts
    drafts_in_order = False
    # True: apply may set Draft.layout (a per-stage StageLayout: the fine space); see sets_layouts
    lays_out_stages = False

    @abc.abstractmethod
    def apply(self, draft: Draft, values: dict) -> None:
        """Record this space's choices for ``values`` on ``draft``."""

    # -- structure ----------------------------------------------------------------
    def parts(self) -> tuple["Space", ...]:
        """The spaces a product is made of (a space that is not a product: itself)."""
        return (self,)

    def alternatives(self) -> tuple["Space", ...]:
        """The spaces a union is made of (a space that is not a union: itself)."""
        return (self,)

    def factors(self) -> tuple["Space", ...]:
        """The spaces a product was composed of, as given (``megatron*coshard``: the grid and
        coshard, where :meth:`parts` are the grid's own parts and coshard); not a product: itself."""
        return (self,)

    def ordered_drafts(self) -> bool:
        """Whether a draft of this space may depend on the drafts made before it in the same process
        (``drafts_in_order`` of it or of a part): explore then drafts every assignment here, in order,
        before its workers fork, so that each worker finds the same outcome in the graph's memo."""
        return self.drafts_in_order

    def sets_layouts(self) -> bool:
        """Whether a draft of this space may carry a per-stage layout (``Draft.layout``:
        ``lays_out_stages`` of it or of a part); explore reads the simulated plans' layouts only then
        (drafting them again, which for a space that solves programs solves them again)."""
        return self.lays_out_stages

    def all_knobs(self) -> tuple[Knob, ...]:
        if self.parts() == (self,):
            return tuple(self.knobs)
        seen: dict[str, Knob] = {}
        for p in self.parts():
            for k in p.all_knobs():
                seen.setdefault(k.name, k)
        return tuple(seen.values())

    def all_constraints(self) -> tuple[Constraint, ...]:
        if self.parts() == (self,):
            return _dedupe(self.constraints)
        return _dedupe(c for p in self.parts() for c in p.all_constraints())

    def all_rules(self) -> tuple["Rule", ...]:
        if self.parts() == (self,):
            return _dedupe(self.rules)
        return _dedupe(r for p in self.parts() for r in p.all_rules())

    def knob(self, name: str) -> Knob:
        for k in self.all_knobs():
            if k.name == name:
                return k
        raise ConfigError(
            f"space {self.name!r} has no knob {name!r}; its knobs are {choices([k.name for k in self.all_knobs()])}"
        )

    # -- composition --------------------------------------------------------------
    def __mul__(self, other: "Space") -> "Space":
        from planlab.search_spaces.compose import product

        return product(self, other)

    def __or__(self, other: "Space") -> "Space":
        from planlab.search_spaces.compose import Union

        return Union((self, other))

    def restrict(self, **values: Iterable) -> "Space":
        """This space with fewer values for some knobs: ``restrict(tp=(1, 2), recompute="full")``."""
        from planlab.search_spaces.compose import Restricted

        return Restricted(self, values=values)

    def where(self, predicate: Callable, text: str) -> "Space":
        """This space with an extra constraint on the knobs: ``where(lambda k: k["tp"] * k["pp"] <= 8,
        "tp*pp <= 8")`` (``predicate(knobs)`` or ``predicate(knobs, ctx)``)."""
        from planlab.search_spaces.compose import Restricted

        return Restricted(self, constraints=(Constraint.where(predicate, text),))

    def allow_split(self, pattern: str, dims: Iterable[str]) -> "Space":
        """Operators whose name or module matches ``pattern`` (a regular expression) may be split
        along ``dims`` only (their signature's dimension names; ``()``: kept whole)."""
        from planlab.search_spaces.compose import Restricted
        from planlab.search_spaces.rules import SplitRule

        return Restricted(self, rules=(SplitRule(pattern, dims),))

    def allow_devices(self, pattern: str, devices: Iterable[int] | Callable[[Context], Iterable[int]]) -> "Space":
        """Operators matching ``pattern`` may be placed on ``devices`` only (or a function of the Context)."""
        from planlab.search_spaces.compose import Restricted
        from planlab.search_spaces.rules import PlaceRule

        return Restricted(self, rules=(PlaceRule(pattern, devices),))

    def allow_orders(self, *schedules: str) -> "Space":
        """Pipeline orders (schedules) allowed: ``allow_orders("1f1b", "interleaved")``."""
        from planlab.search_spaces.compose import Restricted
        from planlab.search_spaces.rules import OrderRule

        return Restricted(self, rules=(OrderRule(tuple(schedules)),))

    def named(self, name: str) -> "Space":
        """This space under another name."""
        from planlab.search_spaces.compose import Restricted

        return Restricted(self, name=name)

    # -- enumeration ----------------------------------------------------------------
    def assignments(self, ctx: Context, fixed: dict | None = None) -> Iterator[dict]:
        """Every knob assignment that satisfies the constraints (``fixed`` knobs pinned to
        their given values, pinned knobs to their defaults)."""
        fixed = self.coerced(ctx, fixed or {})
        knobs = self.all_knobs()
        ranges = [(fixed[k.name],) if k.name in fixed else k.explored(ctx, self.name) for k in knobs]
        yield from _search([k.name for k in knobs], ranges, self.all_constraints(), ctx, self.name)

    def coerced(self, ctx: Context, fixed: Mapping) -> dict:
        """``fixed`` with each value as its knob's type (``"false"`` a bool False); ConfigError for an
        unknown knob or a value outside the knob's range here, naming the first constraint it breaks."""
        fixed = dict(fixed)
        names = [k.name for k in self.all_knobs()]
        unknown = [k for k in fixed if k not in names]
        if unknown:
            raise ConfigError(f"space {self.name!r} has no knob {unknown[0]!r}; its knobs are {choices(names)}")
        for k in self.all_knobs():
            if k.name not in fixed:
                continue
            valid = k.range_of(ctx, self.name)
            v = k.coerce(fixed[k.name], self.name, valid[0] if valid else None)
            if v not in valid:
                try:
                    why = self.explain(ctx, {**fixed, k.name: v})
                except ConfigError:  # a constraint that cannot even evaluate the value (dp=0)
                    why = ""
                raise ConfigError(
                    f"space {self.name!r}: {k.name}={v} is not valid here: "
                    + (
                        f"{why} (knob {k.name!r} takes {choices(valid)})"
                        if why
                        else f"knob {k.name!r} takes {choices(valid)}"
                    )
                )
            fixed[k.name] = v
        return fixed

    def enumerate(self, ctx: Context, fixed: dict | None = None) -> list[dict]:
        """The assignments as a list; ConfigError naming the space and the knobs fixed when the
        constraints leave none."""
        out = list(self.assignments(ctx, fixed))
        if not out:
            raise self.empty_error(ctx, self.coerced(ctx, fixed or {}))
        return out

    def empty_error(self, ctx: Context, fixed: dict) -> ConfigError:
        why = self.explain(ctx, fixed)
        if not why:
            why = (
                f"its constraints leave no assignment on {ctx.num_devices} devices with global batch "
                f"{ctx.global_batch} and {ctx.layers} layers"
            )
        with_ = f"with {fmt_knobs(fixed)} fixed" if fixed else "with no knob fixed"
        return ConfigError(f"space {self.name!r} has no plan {with_}: {why}")

    def explain(self, ctx: Context, fixed: dict) -> str:
        """The first constraint that the ``fixed`` knobs alone violate ('' if none does)."""
        probe = {k.name: fixed.get(k.name) for k in self.all_knobs()}
        for c in self.all_constraints():
            if _holds(c, probe, ctx, self.name) is False:
                return c.message(probe, ctx)
        return ""

    # -- building -----------------------------------------------------------------
    def check_values(self, ctx: Context, values: Mapping) -> dict:
        """``values`` with each knob coerced to its type; ConfigError for an unknown knob or a
        value outside its range (naming the space, the knob, the value and the range)."""
        out = {}
        by_name = {k.name: k for k in self.all_knobs()}
        for name, v in values.items():
            k = by_name.get(name)
            if k is None:
                raise ConfigError(f"space {self.name!r} has no knob {name!r}; its knobs are {choices(list(by_name))}")
            out[name] = k.check(v, ctx, self.name)
        return out

    def with_defaults(self, values: Mapping) -> dict:
        """``values`` with every unset knob that has a default at its default."""
        out = dict(values)
        for k in self.all_knobs():
            if k.name not in out and k.default is not None:
                out[k.name] = k.default
        return out

    def draft(self, ctx: Context, values: dict) -> Draft:
        """The draft of one (valid) assignment, without building the plan."""
        draft = Draft(ctx)
        with paused_gc():  # many small objects beside the graph's, no cycles: the collector frees nothing
            apply_part(self, draft, values)
        return draft

    def build(self, ctx: Context, values: dict) -> Plan:
        """The plan of one assignment; ConfigError if a knob is unknown or out of its range or the
        assignment breaks one of the space's constraints; InfeasiblePlan if a primitive breaks
        one of its rules or cannot be applied."""
        given = self.check_values(ctx, values)
        full = self.with_defaults(given)
        probe = {k.name: full.get(k.name) for k in self.all_knobs()}
        for c in self.all_constraints():
            if _holds(c, probe, ctx, self.name) is False:
                raise ConfigError(f"space {self.name!r}: {c.message(probe, ctx)}")
        draft = self.draft(ctx, full)
        try:
            with paused_gc():  # a value per operator: the collector would walk the graph's objects, freeing nothing
                return draft.to_plan(space=self.name, knobs=given, rules=self.all_rules())
        except PlanlabError:
            raise
        except Exception as e:
            raise _wrap(self.name, given, "building", e) from e

    def describe(self) -> str:
        return f"{self.name}: knobs {', '.join(k.name for k in self.all_knobs())}"

    def __repr__(self) -> str:
        return f"<space {self.name}: {', '.join(k.name for k in self.all_knobs())}>"


def _holds(c: Constraint, a: dict, ctx: Context, space: str) -> bool | None:
    try:
        return c.holds(a, ctx, space)
    except PlanlabError:
        raise
    except Exception as e:
        shown = {k: v for k, v in a.items() if v is not None}
        raise ConfigError(f"space {space!r}: a constraint raised {type(e).__name__}: {e} on {fmt_knobs(shown)}") from e


def _search(
    names: list[str], ranges: list[tuple], constraints: tuple[Constraint, ...], ctx: Context, space: str
) -> Iterator[dict]:
    """Depth-first over the knobs in order; after each knob is assigned, every constraint that
    can already be decided prunes the assignments that break it. A constraint is a function of
    the knobs it reads (recorded by :class:`_Reads`): it is evaluated again only when the knob
    just assigned is one of them (its answer is the same otherwise, and was not False)."""
    a = _Reads(dict.fromkeys(names))
    n = len(names)
    everything = None  # the reads of a constraint not evaluated yet, or that looked at every knob

    def decided_false(name: str, before: list, after: list) -> bool:
        for j, c in enumerate(constraints):
            reads = before[j]
            if reads is not everything and name not in reads:
                after[j] = reads
                continue
            a.log, a.every = set(), False
            ok = _holds(c, a, ctx, space)
            after[j] = everything if a.every else frozenset(a.log)
            if ok is False:
                return True
        return False

    def rec(i: int, before: list) -> Iterator[dict]:
        name = names[i]
        after = [everything] * len(constraints)
        for v in ranges[i]:
            a[name] = v
            if decided_false(name, before, after):
                continue
            if i + 1 == n:
                yield dict(a)
            else:
                yield from rec(i + 1, list(after))
        a[name] = None

    if n == 0:
        if all(_holds(c, a, ctx, space) is not False for c in constraints):
            yield {}
        return
    if any(not r for r in ranges):
        return
    yield from rec(0, [everything] * len(constraints))


class _Reads(dict):
    """A knob assignment that records the knobs a constraint reads (``log``), or that it looked
    at all of them (``every``: iterating, listing values or items, copying)."""

    def __init__(self, values: dict) -> None:
        super().__init__(values)
        self.log: set = set()
        self.every = False

    def __getitem__(self, key):
        self.log.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.log.add(key)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self.log.add(key)
        return super().__contains__(key)

    def _all(self):
        self.every = True
        return self

    def __iter__(self):
        return super(_Reads, self._all()).__iter__()

    def keys(self):
        return super(_Reads, self._all()).keys()

    def values(self):
        return super(_Reads, self._all()).values()

    def items(self):
        return super(_Reads, self._all()).items()

    def copy(self) -> dict:
        return dict(super(_Reads, self._all()).items())

    def __or__(self, other):
        return dict(self.items()) | other


class Product(Space):
    """Spaces applied together to one plan; knobs are the union of theirs."""

    def __init__(self, spaces: tuple[Space, ...], name: str | None = None) -> None:
        flat: list[Space] = []
        for s in spaces:
            flat.extend(s.parts())
        self._parts = tuple(flat)
        self._factors = tuple(spaces)
        self.name = name or "*".join(s.name for s in spaces)

    def parts(self) -> tuple[Space, ...]:
        return self._parts

    def factors(self) -> tuple[Space, ...]:
        return self._factors

    def ordered_drafts(self) -> bool:
        return any(p.ordered_drafts() for p in self._parts)

    def sets_layouts(self) -> bool:
        return any(p.sets_layouts() for p in self._parts)

    def apply(self, draft: Draft, values: dict) -> None:
        for p in sorted(self._parts, key=lambda s: s.order):
            apply_part(p, draft, values)
