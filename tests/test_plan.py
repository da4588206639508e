import json
from pathlib import Path

import pytest
from conftest import traced

from planlab.errors import PlanFileError, PlanlabError
from planlab.plan import Action, PlanBuilder, load_plan, plan_from_json, plan_to_json, save_plan
from planlab.plan.plan import PLAN_VERSION
from planlab.plan.plan_file import plan_to_dict
from planlab.search_spaces import Context, get_space


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
        (lambda d: d.update(version=99), "version 99; this planlab reads versions 1, 2, 3"),
        (lambda d: d.update(format="other"), "not a planlab plan"),
        (lambda d: d.pop("ops"), "field 'ops' is missing"),
        (lambda d: d.pop("meshes"), "field 'meshes' is missing"),
        (lambda d: d.update(global_batch="8"), "'global_batch' must be int"),
        (lambda d: d["placements"][0].update(sizes=[0]), r"placements\[0\]: sizes must be positive integers"),
        (lambda d: d["placements"][0].update(mesh=7), r"placements\[0\]: mesh 7 is not one of the 1 meshes"),
        (lambda d: d["meshes"].__setitem__(0, ["a", "b"]), r"meshes\[0\]: devices must be integers"),
        (lambda d: d["ops"][3].update(placement=-1), r"ops\[3\]: placement -1 is not one of the"),
        (lambda d: d["ops"][3].pop("placement"), r"ops\[3\]: field 'placement' is missing"),
        (lambda d: d.update(schedules=[["0X0"]]), "is not an action"),
        (
            lambda d: d.update(schedules=[["0F0", "0B0", "0U0"]], device_schedule=[0, 5]),
            r"device_schedule\[1\] must index the 1 schedules, got 5",
        ),
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
    d = _as_version_2(plan_to_dict(plan))
    d["version"] = 1
    d["schedule"] = [["0F0", "0F1", "0B0", "0B1", "0W0"]] * plan.num_devices
    old = plan_from_json(json.dumps(d))
    assert old.version == PLAN_VERSION
    assert [str(a) for a in old.schedule[0]] == ["0F0", "0F1", "0B0", "0B1", "0U0"]


def _as_version_2(d: dict) -> dict:
    """A version-3 plan dict written as version 2 wrote it: every operator with its devices."""
    meshes, placements = d.pop("meshes"), d.pop("placements")
    ops = []
    for o in d["ops"]:
        p = dict(placements[o["placement"]])
        p["devices"] = meshes[p.pop("mesh")]
        ops.append(
            {"op": o["op"], "dims": p["dims"], "sizes": p["sizes"], "devices": p["devices"], "stage": p["stage"]}
        )
        if p.get("recompute"):
            ops[-1]["recompute"] = p["recompute"]
    schedules = d.pop("schedules")
    d.update(version=2, ops=ops, schedule=[schedules[i] for i in d.pop("device_schedule")])
    return d


OLD_FILES = Path(__file__).parent / "data"


@pytest.mark.parametrize("version", [1, 2])
def test_committed_version_1_and_2_files_load_as_the_plan_they_were_written_from(version):
    """tests/data/plan_v{1,2}.json were written by planlab's version-1 and -2 writers (gpt-tiny,
    megatron dp 2 x pp 2, 1F1B over 4 micro-batches, full recompute, ZeRO 1); they load as the plan
    the space builds today, and save as version 3, which loads back the same."""
    spec, g = traced("gpt-tiny", 8)
    plan = get_space("megatron").build(
        Context(g, spec, 8, "cpu", 4, 4, 1),
        dict(dp=2, tp=1, pp=2, microbatch=2, recompute="full", zero=1, schedule="1f1b"),
    )
    old = load_plan(OLD_FILES / f"plan_v{version}.json")
    assert json.loads((OLD_FILES / f"plan_v{version}.json").read_text())["version"] == version
    assert old == plan and any(p.recompute for p in old.ops) and old.zero == 1
    assert plan_from_json(plan_to_json(old)) == old and json.loads(plan_to_json(old))["version"] == PLAN_VERSION == 3
    assert _as_version_2(plan_to_dict(old)) == {
        k: v for k, v in json.loads((OLD_FILES / "plan_v2.json").read_text()).items()
    }


def test_version_3_lists_each_mesh_placement_and_schedule_once(tiny):
    """A 4-device plan of two stages: two meshes, one schedule per stage, operators by index."""
    spec, g = traced("gpt-tiny", 8)
    plan = get_space("megatron").build(
        Context(g, spec, 8, "cpu", 4, 4, 1), dict(dp=1, tp=2, pp=2, microbatch=2, recompute="none", schedule="1f1b")
    )
    d = plan_to_dict(plan)
    assert sorted(map(tuple, d["meshes"])) == [(0, 1), (2, 3)]
    assert len(d["schedules"]) == 2 and d["device_schedule"] == [0, 0, 1, 1]
    assert len(d["ops"]) == len(g.operators) and len(d["placements"]) < len(g.operators) / 3
    assert {o["op"] for o in d["ops"]} == {op.name for op in g.operators}
    assert plan_from_json(plan_to_json(plan)) == plan


def test_a_plan_is_not_copied_with_the_dataframe_that_holds_it(tiny):
    """pandas deep-copies DataFrame.attrs on every operation; explore keeps its best plan there."""
    import copy

    import pandas as pd

    spec, g = tiny
    plan = dp_plan(g, spec)
    df = pd.DataFrame({"x": [1, 2, 3]})
    df.attrs["best_plan"] = plan
    assert copy.deepcopy(plan) is plan and df[df["x"] > 1].attrs["best_plan"] is plan
