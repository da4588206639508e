import json

import pytest

from planlab.errors import PlanFileError, PlanlabError
from planlab.plan import Action, PlanBuilder, load_plan, plan_from_json, plan_to_json, save_plan
from planlab.plan.plan_file import plan_to_dict


def _builder(g, spec, n=2):
    return PlanBuilder(g, model=spec, global_batch=8, cluster="cpu", nodes=n, num_devices=n)


def dp_plan(g, spec, n=2, micro=1):
    b = _builder(g, spec, n)
    b.microbatch(micro)
    for op in g.operators:
        d = g.dim_with_label(op, g.batch_label)
        b.op_trans(op.name, d if d and op.signature.splittable(d) else None, n)
        b.op_assign(op.name, range(n))
    return b.build()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda b: b.op_trans("blocks_0_attn_q", "zz", 2), "has no dimension 'zz'"),
        (lambda b: b.op_trans("blocks_0_ln1", "h0", 2), "cannot be split"),
        (lambda b: b.op_trans("blocks_0_attn_q", "n", 3), "does not split into 3 pieces"),
        (lambda b: b.op_trans("blocks_0_attn_q", "n", 0), "positive integer"),
        (lambda b: b.op_trans("nope", "n", 2), "no operator named 'nope'"),
        (lambda b: b.op_assign("blocks_0_attn_q", [0, 1]), "has 1 pieces; op_assign got 2"),
        (lambda b: b.op_assign("blocks_0_attn_q", [5]), "devices are 0..1"),
        (lambda b: b.microbatch(3), "do not divide the global batch 8"),
        (lambda b: b.op_order(7, ["0F0"]), "out of range"),
        (lambda b: b.build(), "have no op_assign"),
    ],
)
def test_builder_errors(tiny, call, message):
    spec, g = tiny
    with pytest.raises(PlanlabError, match=message):
        call(_builder(g, spec))


def test_plan_file_round_trip(tiny, tmp_path):
    spec, g = tiny
    plan = dp_plan(g, spec, micro=2)
    assert plan_from_json(plan_to_json(plan)) == plan
    save_plan(plan, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json") == plan
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(version=99), "version 99; this planlab reads versions 1, 2"),
        (lambda d: d.update(format="other"), "not a planlab plan"),
        (lambda d: d.pop("ops"), "field 'ops' is missing"),
        (lambda d: d.update(global_batch="8"), "'global_batch' must be int"),
        (lambda d: d["ops"][0].update(sizes=[0]), "sizes must be positive integers"),
        (lambda d: d["ops"][0].update(devices=["a", "b"]), "devices must be integers"),
        (lambda d: d.update(schedule=[["0X0"]]), "is not an action"),
    ],
)
def test_malformed_plan_files(tiny, edit, message):
    spec, g = tiny
    d = plan_to_dict(dp_plan(g, spec))
    edit(d)
    with pytest.raises(PlanFileError, match=message):
        plan_from_json(json.dumps(d))


def test_unreadable_and_invalid_json(tmp_path):
    with pytest.raises(PlanFileError, match="cannot read plan file"):
        load_plan(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlanFileError, match="not valid JSON"):
        load_plan(tmp_path / "bad.json")


@pytest.mark.parametrize("text", ["0F0", "3B12", "1U0", "2I3", "0W1"])
def test_action_text_round_trips(text):
    assert str(Action.parse(text)) == text


def test_version_1_plan_files_load_with_the_update_phase_renamed(tiny):
    """Version 1 named the once-per-iteration update ``W``; version 2 calls it ``U`` (``W`` is
    the weight-gradient half of a split backward, as in torch.distributed.pipelining)."""
    spec, g = tiny
    plan = dp_plan(g, spec, micro=2)
    d = plan_to_dict(plan)
    d["version"] = 1
    d["schedule"] = [["0F0", "0F1", "0B0", "0B1", "0W0"]] * plan.num_devices
    old = plan_from_json(json.dumps(d))
    assert old.version == 2
    assert [str(a) for a in old.schedule[0]] == ["0F0", "0F1", "0B0", "0B1", "0U0"]
