"""The space API: typed knobs and their ranges, constraints on knobs, rules on the primitives,
union and restriction, the registry and the --space syntax, and the errors each gives."""

import itertools

import pytest
from conftest import traced

from planlab.errors import ConfigError, InfeasiblePlan
from planlab.plan.plan import ZERO_STAGES
from planlab.search_spaces import SPACES, Constraint, Context, Knob, Space, get_space, register_space, space_names
from planlab.search_spaces.builtin import DataParallel
from planlab.search_spaces.space import _holds

HERE = __name__  # this module, for package.module:space


def ctx_of(n: int = 2, name: str = "gpt-tiny", batch: int = 8) -> Context:
    spec, g = traced(name, batch)
    return Context(g, spec, batch, "cpu", n, n, 1)


# -- typed knobs ------------------------------------------------------------------------------
TP = Knob.int("tp", (1, 2, 4), "tensor-parallel degree")
SP = Knob.bool("sequence_parallel")
SCHED = Knob.choice("schedule", ("1f1b", "gpipe"))


@pytest.mark.parametrize(
    "knob, value, expected",
    [
        (TP, 2, 2),
        (TP, "4", 4),
        (TP, 4.0, 4),
        (SP, True, True),
        (SP, "true", True),
        (SP, "off", False),
        (SP, 1, True),
        (SP, "NO", False),
        (SCHED, "gpipe", "gpipe"),
    ],
)
def test_knob_values_are_coerced_to_their_type(knob, value, expected):
    got = knob.check(value, ctx_of(), "s")
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(
    "knob, value, message",
    [
        (TP, 3, "space 's': knob 'tp' = 3 is outside its range: choose 1, 2 or 4"),
        (TP, True, "space 's': knob 'tp' takes an integer, got True"),
        (TP, "two", "knob 'tp' takes an integer, got 'two'"),
        (TP, 2.5, "knob 'tp' takes an integer, got 2.5"),
        (SP, "maybe", "space 's': knob 'sequence_parallel' takes true or false, got 'maybe'"),
        (SP, 2, "knob 'sequence_parallel' takes true or false, got 2"),
        (SCHED, "zb-h1", "knob 'schedule' = 'zb-h1' is outside its range: choose '1f1b' or 'gpipe'"),
    ],
)
def test_a_value_outside_the_range_names_space_knob_value_and_range(knob, value, message):
    with pytest.raises(ConfigError) as info:
        knob.check(value, ctx_of(), "s")
    assert message in str(info.value)


@pytest.mark.parametrize(
    "knob, explored",
    [
        (Knob("zero", lambda c: (0, 1, 2), "old-style: a default pins it", default=0), (0,)),
        (Knob.int("zero", (0, 1, 2), default=0), (0, 1, 2)),
        (Knob.int("zero", (0, 1, 2), default=0, pinned=True), (0,)),
        (
            Knob.choice("schedule", ("1f1b", "gpipe", "interleaved"), default="1f1b", explore=("1f1b", "interleaved")),
            ("1f1b", "interleaved"),
        ),
        (Knob.bool("sp"), (False, True)),
    ],
)
def test_explored_values(knob, explored):
    assert knob.explored(ctx_of()) == explored


def test_knob_kinds_and_ranges_in_words():
    assert [k.kind for k in (TP, SP, SCHED)] == ["int", "bool", "choice"]
    assert TP.describe_range() == "1, 2, 4"
    dp = get_space("dp").knob("dp")
    assert dp.describe_range() == "divisors of the device count" and dp.describe_range(ctx_of(2)) == "1, 2"
    with pytest.raises(ConfigError, match="kind 'float'; choose 'int', 'choice' or 'bool'"):
        Knob("x", (1,), kind="float")


@pytest.mark.parametrize(
    "knobs, message",
    [
        (dict(dp=2, tp=3, pp=1, microbatch=4), "space 'megatron': knob 'tp' = 3 is outside its range: choose 1 or 2"),
        (dict(dp=2, tp=1, pp=1, microbatch=4, recompute="most"), "knob 'recompute' = 'most' is outside its range"),
        (dict(dp=2, tp=1, pp=1, microbatch=4, zero=7), "knob 'zero' = 7 is outside its range: choose 0, 1, 2 or 3"),
        (dict(dp=2, tp=1, pp=1, microbatch=4, colour=1), "space 'megatron' has no knob 'colour'"),
        (dict(dp=1, tp=1, pp=1, microbatch=4), "the degrees dp=1 x tp=1 x pp=1 do not multiply to the 2 devices"),
        (
            dict(dp=1, tp=2, pp=1, microbatch=4, sequence_parallel=True, zero=1),
            "zero=1 shards over the data-parallel replicas: it needs dp > 1, not dp=1",
        ),
        (
            dict(dp=2, tp=1, pp=1, microbatch=4, sequence_parallel=True),
            "sequence_parallel splits what tensor parallelism replicates: it needs tp > 1, not tp=1",
        ),
    ],
)
def test_build_refuses_bad_assignments(knobs, message):
    with pytest.raises(ConfigError) as info:
        get_space("megatron").build(ctx_of(), knobs)
    assert message in str(info.value)


def test_set_may_pick_a_value_the_exploration_leaves_out():
    ctx = ctx_of()
    sp = get_space("megatron")
    assert {a["schedule"] for a in sp.assignments(ctx)} == {"1f1b"}  # gpt-tiny: 2 layers, no interleaving
    got = list(sp.assignments(ctx, {"schedule": "gpipe"}))
    assert got and all(a["schedule"] == "gpipe" and a["pp"] == 2 for a in got)
    with pytest.raises(ConfigError, match="sequence_parallel=True is not valid here|takes true or false"):
        list(sp.assignments(ctx, {"sequence_parallel": "sure"}))


# -- constraints and enumeration ----------------------------------------------------------------
def brute_force(sp: Space, ctx: Context) -> list[dict]:
    knobs = sp.all_knobs()
    out = []
    for combo in itertools.product(*(k.explored(ctx) for k in knobs)):
        a = dict(zip((k.name for k in knobs), combo))
        if all(_holds(c, a, ctx, sp.name) for c in sp.all_constraints()):
            out.append(a)
    return out


@pytest.mark.parametrize("n, space", [(2, "megatron"), (4, "megatron"), (4, "dp*tp"), (4, "pp*recompute")])
def test_pruned_search_finds_exactly_the_assignments_of_the_full_product(n, space):
    sp, ctx = get_space(space), ctx_of(n)
    assert sorted(map(repr, sp.assignments(ctx))) == sorted(map(repr, brute_force(sp, ctx)))


def test_megatron_drops_meaningless_combinations():
    ctx = ctx_of(4)
    got = get_space("megatron").enumerate(ctx)
    assert got
    for a in got:
        assert a["tp"] > 1 or not a["sequence_parallel"]
        assert a["dp"] > 1 or a["zero"] == 0
        assert a["pp"] > 1 or a["schedule"] == "1f1b"
        assert (a["virtual_stages"] > 1) == (a["schedule"] == "interleaved")
    assert {a["zero"] for a in got} == set(ZERO_STAGES) == {0, 1, 2, 3}
    assert {a["sequence_parallel"] for a in got} == {False, True}
    assert {a["schedule"] for a in got} <= {"1f1b", "interleaved"}  # gpipe and zb-h1 when picked
    assert {a["recompute"] for a in got} == {"none", "selective", "full"}


def test_where_adds_a_constraint_with_a_clear_message():
    ctx = ctx_of(4)
    sp = get_space("megatron").where(lambda k: k["tp"] * k["pp"] <= 2, "tp*pp <= 2")
    got = sp.enumerate(ctx)
    assert got and all(a["tp"] * a["pp"] <= 2 for a in got)
    assert len(got) < len(get_space("megatron").enumerate(ctx))
    with pytest.raises(ConfigError, match=r"space 'megatron': constraint 'tp\*pp <= 2' does not hold for tp=2, pp=2"):
        sp.build(ctx, dict(dp=1, tp=2, pp=2, microbatch=8))
    two = get_space("megatron").where(lambda k, c: k["dp"] < c.num_devices, "dp={dp} uses every device")
    assert all(a["dp"] < 4 for a in two.enumerate(ctx))
    with pytest.raises(ConfigError, match="dp=4 uses every device"):
        two.build(ctx, dict(dp=4, tp=1, pp=1, microbatch=2))


def test_restrict_narrows_knobs_and_checks_the_values_against_the_range():
    ctx = ctx_of(4)
    sp = get_space("megatron").restrict(tp=(1, 2), recompute="full", zero=0)
    got = sp.enumerate(ctx)
    assert {a["tp"] for a in got} == {1, 2} and {a["recompute"] for a in got} == {"full"}
    assert {a["zero"] for a in got} == {0}
    assert sp.name == "megatron" and sp.knob("recompute").default == "full"
    with pytest.raises(ConfigError, match="knob 'tp' = 3 is outside its range: choose 1, 2 or 4"):
        get_space("megatron").restrict(tp=(1, 3)).enumerate(ctx)
    with pytest.raises(ConfigError, match="space 'megatron' has no knob 'zz' to restrict"):
        get_space("megatron").restrict(zz=1)
    with pytest.raises(ConfigError, match="space 'megatron': knob 'tp' = 4 is outside its range: choose 1 or 2"):
        sp.build(ctx, dict(dp=1, tp=4, pp=1, microbatch=8))


@pytest.mark.parametrize(
    "make, fixed, message",
    [
        (
            lambda: get_space("megatron").where(lambda k: False, "never"),
            {},
            "space 'megatron' has no plan with no knob fixed: never",
        ),
        (
            lambda: get_space("megatron"),
            {"tp": 2, "pp": 2},
            "space 'megatron' has no plan with tp=2, pp=2 fixed: its constraints leave no assignment on 2 devices",
        ),
        (
            lambda: get_space("megatron").restrict(dp=(1,), pp=(1,)),
            {"tp": 1},
            "space 'megatron' has no plan with tp=1 fixed",
        ),
        (lambda: get_space("dp|tp"), {"tp": 1}, "space 'dp|tp' has no plan with tp=1 fixed: dp has no knob 'tp'"),
    ],
)
def test_a_constraint_that_leaves_the_space_empty_names_the_space_and_the_fixed_knobs(make, fixed, message):
    with pytest.raises(ConfigError) as info:
        make().enumerate(ctx_of(), fixed)
    assert message in str(info.value)


# -- union ---------------------------------------------------------------------------------------
def test_union_holds_the_plans_of_either_space():
    ctx = ctx_of()
    u = get_space("dp|tp")
    got = u.enumerate(ctx)
    assert {a["space"] for a in got} == {"dp", "tp"}
    assert len(got) == len(get_space("dp").enumerate(ctx)) + len(get_space("tp").enumerate(ctx))
    assert {k.name for k in u.all_knobs()} == {"dp", "microbatch", "zero", "tp", "sequence_parallel"}
    tp_only = [a for a in got if a["space"] == "tp"][0]
    plan = u.build(ctx, tp_only)
    assert plan.space == "tp" and dict(plan.knobs)["tp"] == 2
    assert u.build(ctx, {"tp": 2}).space == "tp"  # the part is found from the knobs too
    assert {a["space"] for a in u.enumerate(ctx, {"tp": 2})} == {"tp"}  # fixed knobs select the parts


def test_product_distributes_over_union_and_restrict_reaches_every_part():
    ctx = ctx_of()
    u = (get_space("dp") | get_space("tp")) * get_space("recompute")
    assert [s.name for s in u.alternatives()] == ["dp*recompute", "tp*recompute"]
    got = u.restrict(recompute="full").enumerate(ctx)
    assert {a["recompute"] for a in got} == {"full"} and {a["space"] for a in got} == {"dp*recompute", "tp*recompute"}
    w = u.where(lambda k: k["tp"] == 2, "tp is 2")  # the dp part has no tp: the constraint passes there
    assert {a["space"] for a in w.enumerate(ctx)} == {"dp*recompute", "tp*recompute"}
    with pytest.raises(ConfigError, match="names space 'dp' twice"):
        get_space("dp") | get_space("dp")
    assert (get_space("dp") | get_space("dp").named("dp2")).alternatives()[1].name == "dp2"


# -- rules on the primitives ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "edit, knobs, message",
    [
        (
            lambda s: s.allow_split(r"mlp\.fc$", ()),
            dict(dp=1, tp=2, pp=1, microbatch=8),
            r"op_trans('blocks_0_mlp_fc', 'n') breaks the rule split 'mlp\\.fc$' along nothing: allowed no split",
        ),
        (
            lambda s: s.allow_split(r"mlp\.fc$", ("k",)),
            dict(dp=2, tp=1, pp=1, microbatch=4),
            "op_trans('blocks_0_mlp_fc', 'a0') breaks the rule split 'mlp\\\\.fc$' along k: allowed 'k'",
        ),
        (
            lambda s: s.allow_devices("lm_head", [0]),
            dict(dp=1, tp=1, pp=2, microbatch=4),
            "op_assign('lm_head') on device 1 breaks the rule place 'lm_head' on devices 0",
        ),
        (
            lambda s: s.allow_orders("gpipe"),
            dict(dp=1, tp=1, pp=2, microbatch=4),
            "op_order with schedule '1f1b' breaks the rule orders gpipe: allowed 'gpipe'",
        ),
    ],
)
def test_rules_on_the_primitives_are_checked_as_they_are_issued(edit, knobs, message):
    sp = edit(get_space("megatron"))
    with pytest.raises(InfeasiblePlan) as info:
        sp.build(ctx_of(), knobs)
    assert str(info.value).startswith("space 'megatron': ") and message in str(info.value)


@pytest.mark.parametrize(
    "edit, knobs",
    [
        (lambda s: s.allow_split(r"mlp\.fc$", ("n", "a0")), dict(dp=1, tp=2, pp=1, microbatch=8)),
        (lambda s: s.allow_devices("lm_head", [1]), dict(dp=1, tp=1, pp=2, microbatch=4)),
        (lambda s: s.allow_devices("lm_head", lambda c: range(c.num_devices)), dict(dp=2, tp=1, pp=1, microbatch=4)),
        (lambda s: s.allow_orders("1f1b", "interleaved"), dict(dp=1, tp=1, pp=2, microbatch=4)),
    ],
)
def test_plans_that_keep_the_rules_build(edit, knobs):
    sp = edit(get_space("megatron"))
    plan = sp.build(ctx_of(), knobs)
    assert plan.num_devices == 2
    draft = sp.draft(ctx_of(), sp.with_defaults(knobs))
    draft.check_rules(sp.all_rules(), sp.name)  # the screen's check agrees


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: (
                get_space("megatron")
                .allow_split("no_such_op", ("n",))
                .build(ctx_of(), dict(dp=2, tp=1, pp=1, microbatch=4))
            ),
            "rule split 'no_such_op' along n matches no operator of the model",
        ),
        (lambda: get_space("megatron").allow_split("(", ("n",)), "operator pattern '(' is not a regular expression"),
        (lambda: get_space("megatron").allow_split("fc", "n"), "dims must be a tuple of dimension names"),
        (lambda: get_space("megatron").allow_devices("fc", ["a"]), "devices must be integers"),
        (lambda: get_space("megatron").allow_orders(), "an order rule needs schedule names"),
    ],
)
def test_bad_rules_get_a_config_error(make, message):
    with pytest.raises(ConfigError) as info:
        make()
    assert message in str(info.value)


# -- user spaces, the registry and --space ----------------------------------------------------------
class Broken(Space):
    """A user's space whose builder raises."""

    name = "broken"
    knobs = (Knob.int("dp", lambda c: (c.num_devices,)),)

    def apply(self, draft, values):
        raise RuntimeError("boom")


class BadValues(DataParallel):
    name = "badvalues"
    knobs = (Knob.int("dp", lambda c: 1 / 0),)


def not_a_space():
    return 42


def test_a_user_space_that_raises_gets_a_config_error_naming_the_space_and_the_knobs():
    ctx = ctx_of()
    sp = get_space(f"{HERE}:Broken")
    with pytest.raises(ConfigError, match="space 'broken' raised RuntimeError: boom while applying the plan of dp=2"):
        sp.build(ctx, {"dp": 2})
    with pytest.raises(ConfigError, match="space 'broken' raised RuntimeError: boom while applying the plan of dp=2"):
        (sp * get_space("recompute")).build(ctx, {"dp": 2, "recompute": "none"})
    with pytest.raises(ConfigError, match="space 'badvalues': the values of knob 'dp' raised ZeroDivisionError"):
        get_space(f"{HERE}:BadValues").enumerate(ctx)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("zero9", "unknown space 'zero9'; choose 'dp', 'tp', 'pp', 'recompute', 'megatron'"),
        ("dp**tp", "space 'dp**tp': an empty name around '*'"),
        ("dp|", "an empty name around '|'"),
        ("no_such_pkg.mod:space", "cannot load space 'no_such_pkg.mod:space': ModuleNotFoundError"),
        (f"{HERE}:missing", "AttributeError"),
        (f"{HERE}:not_a_space", f"space '{HERE}:not_a_space' is a int, not a planlab Space"),
        (f"{HERE}:ctx_of", "is a Context, not a planlab Space"),
    ],
)
def test_bad_space_specs(spec, message):
    with pytest.raises(ConfigError) as info:
        get_space(spec)
    assert message in str(info.value)


def test_registering_a_space_is_one_line_and_lists_it():
    register_space("megatron-tp2", lambda: get_space("megatron").restrict(tp=(2,)).named("megatron-tp2"))
    try:
        assert "megatron-tp2" in space_names()
        sp = get_space("megatron-tp2|dp")
        got = sp.enumerate(ctx_of())
        assert {a["space"] for a in got} == {"megatron-tp2", "dp"}
        assert all(a["tp"] == 2 for a in got if a["space"] == "megatron-tp2")
        with pytest.raises(ConfigError, match="is registered already"):
            register_space("megatron-tp2", lambda: get_space("dp"))
        with pytest.raises(ConfigError, match="use a non-empty name without"):
            register_space("a*b", lambda: get_space("dp"))
    finally:
        SPACES.pop("megatron-tp2", None)


def test_product_and_union_names():
    assert get_space("dp*tp").name == "dp*tp" and get_space("dp * tp").parts()[1].name == "tp"
    assert get_space("megatron|dp*tp").name == "megatron|dp*tp"
    assert [s.name for s in get_space("megatron|dp*tp").alternatives()] == ["megatron", "dp*tp"]


# -- the plans the builder issues ------------------------------------------------------------------
def test_gradient_accumulation_runs_each_micro_batch_forward_then_backward():
    plan = get_space("megatron").build(ctx_of(), dict(dp=2, tp=1, pp=1, microbatch=1))
    assert plan.microbatches == 4
    assert [str(a) for a in plan.schedule[0]] == ["0F0", "0B0", "0F1", "0B1", "0F2", "0B2", "0F3", "0B3", "0U0"]


def test_constraint_holds_is_three_valued():
    c = Constraint.where(lambda k: k["tp"] * k["pp"] <= 4, "tp*pp <= 4")
    assert c.holds({"tp": 2, "pp": None}, None) is None
    assert c.holds({"tp": 2, "pp": 2}, None) is True and c.holds({"tp": 4, "pp": 2}, None) is False
    with pytest.raises(ConfigError, match="a constraint reads knob 'tpp', which the space does not have"):
        Constraint.where(lambda k: k["tpp"] > 1, "typo").holds({"tp": 2}, None)


def test_enumeration_equals_the_filtered_product_of_the_knobs():
    """The search re-evaluates a constraint only when a knob it read changed: it must keep exactly
    the assignments of the whole product that every constraint allows (plain constraints, where-
    constraints reading through a KnobView, and one that reads its knobs with ``.get``)."""
    ctx = ctx_of(4)
    sp = (
        get_space("pp*dp*tp*recompute")
        .restrict(zero=(0, 1), microbatch=(1, 2), recompute=("none", "full"))
        .where(lambda k: k["tp"] * k["pp"] <= 2, "tp={tp} x pp={pp} is at most 2-way model parallelism")
        .where(lambda k, c: k.get("recompute") != "full" or k["dp"] > 1, "full recomputation with dp > 1")
    )
    knobs = sp.all_knobs()
    ranges = [k.explored(ctx, sp.name) for k in knobs]
    constraints = sp.all_constraints()
    brute = [
        a
        for a in (dict(zip((k.name for k in knobs), vs)) for vs in itertools.product(*ranges))
        if all(c.holds(a, ctx, sp.name) is not False for c in constraints)
    ]
    got = sp.enumerate(ctx)
    assert len(got) > 10 and len(got) < len(list(itertools.product(*ranges)))
    assert got == brute


def test_an_axis_given_in_graph_order_is_the_axis_given_by_name():
    """``in_graph_order`` hands add_axis the dimensions it would look up by operator name, as one
    tuple cached on the graph (the same object for every plan); a tuple of another length is a
    ConfigError."""
    from planlab.search_spaces.builtin import tensor_parallel_dims
    from planlab.search_spaces.space import Draft, in_graph_order

    ctx = ctx_of(2)
    by_name, in_order = Draft(ctx), Draft(ctx)
    by_name.add_axis("tp", 2, tensor_parallel_dims(ctx.graph))
    in_order.add_axis("tp", 2, in_graph_order(ctx.graph, "tensor_parallel_dims", tensor_parallel_dims))
    assert by_name.axis_dims == in_order.axis_dims and any(in_order.axis_dims[0])
    assert in_graph_order(ctx.graph, "tensor_parallel_dims", tensor_parallel_dims) is in_order.axis_dims[0]
    with pytest.raises(ConfigError, match="given 1 dimensions for the graph's"):
        Draft(ctx).add_axis("tp", 2, (None,))
