"""Plan files: a Plan as versioned JSON, and back, with every field checked.

Version 3 (written) lists each distinct device mesh once (``meshes``), each distinct split and
placement once (``placements``: dims, sizes, mesh, stage, recompute, and ``ring`` for an attention run as
ring attention, written only when true, so a plan without one is the file it was before; ``zigzag`` likewise at the
top, for the tokens in a zigzag ring's order, ``kv_gather`` for rings run by all-gather, and ``discard_outputs`` for
the recompute groups whose outputs are remade too), every operator by name with
the index of its placement (``ops``), and each distinct schedule once (``schedules``, with
``device_schedule`` giving each device's), so a plan for 1,024 devices does not repeat its device
lists per operator. Versions 1 and 2 (read) list every operator with its devices, and every
device's schedule.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from planlab.errors import ConfigError, PlanFileError
from planlab.models.spec import ModelSpec
from planlab.plan.plan import PLAN_VERSION, READ_VERSIONS, ZERO_STAGES, Action, OpPlan, Plan

FORMAT = "planlab-plan"


def plan_to_dict(plan: Plan) -> dict:
    """The plan as a version-3 JSON object (meshes, placements and schedules each listed once)."""
    meshes: dict[tuple[int, ...], int] = {}
    placements: dict[tuple, int] = {}
    ops = []
    for p in plan.ops:
        mesh = meshes.setdefault(p.devices, len(meshes))
        key = (p.dims, p.sizes, mesh, p.stage, p.recompute, p.ring, p.offload)
        ops.append({"op": p.op, "placement": placements.setdefault(key, len(placements))})
    schedules: dict[tuple[Action, ...], int] = {}
    device_schedule = [schedules.setdefault(s, len(schedules)) for s in plan.schedule]
    return {
        "format": FORMAT,
        "version": PLAN_VERSION,
        "model": plan.model.to_json(),
        "global_batch": plan.global_batch,
        "cluster": plan.cluster,
        "nodes": plan.nodes,
        "num_devices": plan.num_devices,
        "microbatches": plan.microbatches,
        "space": plan.space,
        "knobs": dict(plan.knobs),
        "meshes": [list(m) for m in meshes],
        "placements": [
            {
                "dims": list(dims),
                "sizes": list(sizes),
                "mesh": mesh,
                "stage": stage,
                **({"recompute": recompute} if recompute else {}),
                **({"ring": True} if ring else {}),
                **({"offload": offload} if offload else {}),
            }
            for dims, sizes, mesh, stage, recompute, ring, offload in placements
        ],
        "ops": ops,
        "schedules": [[_action_json(a) for a in s] for s in schedules],
        "device_schedule": device_schedule,
        **({"zero": plan.zero} if plan.zero else {}),
        **({"offload_optimizer": True} if plan.offload_optimizer else {}),
        **({"offload_stages": list(plan.offload_stages)} if plan.offload_stages else {}),
        **({"zigzag": True} if plan.zigzag else {}),
        **({"kv_gather": True} if plan.kv_gather else {}),
        **({"discard_outputs": list(plan.discard_outputs)} if plan.discard_outputs else {}),
        **({"software": plan.software} if plan.software else {}),
        **({"precision": plan.precision} if plan.precision else {}),
    }


def plan_to_json(plan: Plan) -> str:
    return json.dumps(plan_to_dict(plan), separators=(",", ":"))


def _need(d: dict, key: str, typ, where: str):
    if key not in d:
        raise PlanFileError(f"{where}: field {key!r} is missing")
    v = d[key]
    if typ is int and isinstance(v, bool) or not isinstance(v, typ):
        name = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
        raise PlanFileError(f"{where}: field {key!r} must be {name}, got {v!r}")
    return v


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def plan_from_dict(d: dict, where: str = "plan") -> Plan:
    """Check and convert a plan dict of any version this planlab reads; PlanFileError names the
    field at fault."""
    if not isinstance(d, dict):
        raise PlanFileError(f"{where}: expected a JSON object, got {type(d).__name__}")
    if d.get("format") != FORMAT:
        raise PlanFileError(f"{where}: not a planlab plan (format {d.get('format')!r}, expected {FORMAT!r})")
    version = _need(d, "version", int, where)
    if version not in READ_VERSIONS:
        raise PlanFileError(
            f"{where}: plan format version {version}; this planlab reads versions {', '.join(map(str, READ_VERSIONS))}"
        )
    model = _need(d, "model", dict, where)
    _need(model, "name", str, f"{where}: model")
    if version >= 3:
        ops, schedule = _ops_v3(d, where), _schedule_v3(d, where)
    else:
        ops, schedule = _ops_v2(d, where), _schedule_v2(d, where, version)
    knobs = d.get("knobs", {})
    if not isinstance(knobs, dict):
        raise PlanFileError(f"{where}: field 'knobs' must be an object")
    try:
        spec = ModelSpec.from_json(model)
    except (TypeError, ValueError, AttributeError) as e:
        raise PlanFileError(f"{where}: model: {e}") from None
    counts = {k: _need(d, k, int, where) for k in ("global_batch", "nodes", "num_devices", "microbatches")}
    _check_counts(counts, schedule, ops, where)
    return Plan(
        model=spec,
        global_batch=counts["global_batch"],
        cluster=_need(d, "cluster", str, where),
        nodes=counts["nodes"],
        num_devices=counts["num_devices"],
        microbatches=counts["microbatches"],
        ops=ops,
        schedule=schedule,
        space=str(d.get("space", "")),
        knobs=tuple(sorted(knobs.items())),
        zero=_zero(d, where),
        offload_optimizer=_flag(d, "offload_optimizer", where),
        offload_stages=_offload_stages(d, where),
        software=_optional_text(d, "software", where),
        precision=_optional_text(d, "precision", where),
        zigzag=_flag(d, "zigzag", where),
        kv_gather=_flag(d, "kv_gather", where),
        discard_outputs=_discard_outputs(d, where),
    )


def _split(o: dict, w: str) -> tuple[tuple, tuple, int, int]:
    """``(dims, sizes, stage, recompute)`` of an operator (v1, v2) or a placement (v3), checked."""
    dims = _need(o, "dims", list, w)
    sizes = _need(o, "sizes", list, w)
    if any(x is not None and not isinstance(x, str) for x in dims):
        raise PlanFileError(f"{w}: dims must be dimension names or null")
    if any(not _is_int(x) or x < 1 for x in sizes) or len(sizes) != len(dims):
        raise PlanFileError(f"{w}: sizes must be positive integers, one per dim")
    rc = o.get("recompute", 0)
    if not _is_int(rc) or rc < 0:
        raise PlanFileError(f"{w}: recompute must be a non-negative integer group, got {rc!r}")
    return tuple(dims), tuple(sizes), int(_need(o, "stage", int, w)), rc


def _devices(devices: list, w: str) -> tuple[int, ...]:
    if any(not _is_int(x) for x in devices):
        raise PlanFileError(f"{w}: devices must be integers")
    return tuple(devices)


def _objects(d: dict, key: str, where: str):
    """``(where, object)`` of each element of the list field ``key``, each checked to be an object."""
    for k, o in enumerate(_need(d, key, list, where)):
        w = f"{where}: {key}[{k}]"
        if not isinstance(o, dict):
            raise PlanFileError(f"{w}: expected an object")
        yield w, o


def _index(o: dict, key: str, n: int, what: str, w: str) -> int:
    """The integer field ``key`` of ``o``, an index into ``n`` ``what``."""
    i = _need(o, key, int, w)
    if not 0 <= i < n:
        raise PlanFileError(f"{w}: {key} {i} is not one of the {n} {what} (0..{n - 1})")
    return i


def _ops_v2(d: dict, where: str) -> tuple[OpPlan, ...]:
    """Versions 1 and 2: every operator with its split, devices and stage."""
    ops = []
    for w, o in _objects(d, "ops", where):
        dims, sizes, stage, rc = _split(o, w)
        devices = _devices(_need(o, "devices", list, w), w)
        ops.append(OpPlan(_need(o, "op", str, w), dims, sizes, devices, stage, rc))
    return tuple(ops)


def _ops_v3(d: dict, where: str) -> tuple[OpPlan, ...]:
    """Version 3: meshes and placements listed once, operators naming their placement."""
    meshes = []
    for k, m in enumerate(_need(d, "meshes", list, where)):
        if not isinstance(m, list):
            raise PlanFileError(f"{where}: meshes[{k}] must be a list of devices")
        meshes.append(_devices(m, f"{where}: meshes[{k}]"))
    placements = []
    for w, p in _objects(d, "placements", where):
        dims, sizes, stage, rc = _split(p, w)
        ring = p.get("ring", False)
        if not isinstance(ring, bool):
            raise PlanFileError(f"{w}: ring must be true or false, got {ring!r}")
        off = p.get("offload", 0)
        if not _is_int(off) or off < 0:
            raise PlanFileError(f"{w}: offload must be a non-negative integer group, got {off!r}")
        placements.append((dims, sizes, meshes[_index(p, "mesh", len(meshes), "meshes", w)], stage, rc, ring, off))
    ops = []
    for w, o in _objects(d, "ops", where):
        dims, sizes, devices, stage, rc, ring, off = placements[
            _index(o, "placement", len(placements), "placements", w)
        ]
        ops.append(OpPlan(_need(o, "op", str, w), dims, sizes, devices, stage, rc, ring, off))
    return tuple(ops)


def _action_json(a: Action) -> str | dict:
    """An action as text (``1F0``), or with the receives it posts ahead and whether it overlaps the
    next as ``{"run": "1F0", "posts": ["1F1", "2I0"], "overlaps": true}``."""
    if not a.posts and not a.overlaps:
        return str(a)
    return {"run": str(a), "posts": [str(x) for x in a.posts], **({"overlaps": True} if a.overlaps else {})}


def _action(a, w: str) -> Action:
    """An action as :func:`_action_json` writes it."""
    if not isinstance(a, dict):
        return Action.parse(a)
    posts, overlaps = a.get("posts", []), a.get("overlaps", False)
    if set(a) - {"run", "posts", "overlaps"} or not isinstance(posts, list) or not isinstance(overlaps, bool):
        raise PlanFileError(
            f'{w}: an action object has "run" (an action), "posts" (a list of actions) and "overlaps" '
            f"(true or false), got {a!r}"
        )
    run = Action.parse(a.get("run"))
    return Action(run.stage, run.phase, run.microbatch, tuple(Action.parse(x) for x in posts), overlaps)


def _actions(s, w: str, version: int) -> tuple[Action, ...]:
    if not isinstance(s, list):
        raise PlanFileError(f"{w} must be a list of actions")
    try:
        if version == 1:  # version 1 named the once-per-iteration update W
            s = [a.replace("W", "U") if isinstance(a, str) else a for a in s]
        return tuple(_action(a, w) for a in s)
    except ConfigError as e:
        raise PlanFileError(f"{w}: {e}") from None


def _schedule_v2(d: dict, where: str, version: int) -> tuple[tuple[Action, ...], ...]:
    """Versions 1 and 2: every device's actions."""
    return tuple(_actions(s, f"{where}: schedule[{k}]", version) for k, s in enumerate(d.get("schedule", [])))


def _schedule_v3(d: dict, where: str) -> tuple[tuple[Action, ...], ...]:
    """Version 3: the distinct schedules, and each device's index into them."""
    schedules = [_actions(s, f"{where}: schedules[{k}]", 3) for k, s in enumerate(_need(d, "schedules", list, where))]
    out = []
    for dev, i in enumerate(_need(d, "device_schedule", list, where)):
        if not _is_int(i) or not 0 <= i < len(schedules):
            raise PlanFileError(f"{where}: device_schedule[{dev}] must index the {len(schedules)} schedules, got {i!r}")
        out.append(schedules[i])
    return tuple(out)


def plan_from_json(text: str, where: str = "plan") -> Plan:
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanFileError(f"{where}: not valid JSON ({e})") from None
    return plan_from_dict(d, where)


def _file_path(path, verb: str) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise PlanFileError(f"{verb}: expected the path of a plan file, got {path!r}")
    return Path(path)


def save_plan(plan: Plan, path: str | os.PathLike) -> None:
    """Write atomically: a temporary file renamed into place, so no half-written plan is left."""
    if not isinstance(plan, Plan):
        raise PlanFileError(f"save_plan(plan, path): expected a Plan, got {type(plan).__name__} {plan!r:.60}")
    path = _file_path(path, "save_plan")
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(plan_to_json(plan))
        os.replace(tmp, path)
    except OSError as e:
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)  # nothing half-written is left
        raise PlanFileError(f"cannot write plan file {str(path)!r}: {e.strerror}") from None


def load_plan(path: str | os.PathLike) -> Plan:
    """The Plan in a plan file; PlanFileError names the file and what is wrong with it."""
    path = _file_path(path, "load_plan")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise PlanFileError(f"cannot read plan file {str(path)!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise PlanFileError(
            f"{str(path)!r} is not a plan file (byte {e.start} is not UTF-8 text); expected planlab's plan JSON"
        ) from None
    return plan_from_json(text, where=str(path))


def _zero(d: dict, where: str) -> int:
    z = d.get("zero", 0)
    if z not in ZERO_STAGES or isinstance(z, bool):
        raise PlanFileError(f"{where}: field 'zero' must be 0, 1, 2 or 3, got {z!r}")
    return z


def _flag(d: dict, name: str, where: str) -> bool:
    on = d.get(name, False)
    if not isinstance(on, bool):
        raise PlanFileError(f"{where}: field {name!r} must be true or false, got {on!r}")
    return on


def _discard_outputs(d: dict, where: str) -> tuple[int, ...]:
    groups = d.get("discard_outputs", [])
    if not isinstance(groups, list) or not all(
        isinstance(g, int) and not isinstance(g, bool) and g > 0 for g in groups
    ):
        raise PlanFileError(f"{where}: field 'discard_outputs' must be a list of recompute groups >= 1, got {groups!r}")
    return tuple(sorted(set(groups)))


def _offload_stages(d: dict, where: str) -> tuple[int, ...]:
    stages = d.get("offload_stages", [])
    if not isinstance(stages, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in stages
    ):
        raise PlanFileError(f"{where}: field 'offload_stages' must be a list of stage numbers >= 0, got {stages!r}")
    if stages and not d.get("offload_optimizer", False):
        raise PlanFileError(f"{where}: field 'offload_stages' needs 'offload_optimizer': true")
    return tuple(sorted(set(stages)))


def _check_counts(counts: dict[str, int], schedule: list, ops: list, where: str) -> None:
    """The plan's sizes are positive, its schedule has one list per device (or none), and its
    operators sit on its devices."""
    for k, v in counts.items():
        if v < 1:
            raise PlanFileError(f"{where}: field {k!r} must be at least 1, got {v}")
    n = counts["num_devices"]
    if schedule and len(schedule) != n:
        raise PlanFileError(
            f"{where}: the schedule lists the actions of {len(schedule)} devices; the plan has {n} "
            "(give one list per device, or none for the default order)"
        )
    checked = None
    for k, o in enumerate(ops):
        if o.devices is checked:  # version 3's operators share their placement's mesh
            continue
        checked = o.devices
        bad = [x for x in o.devices if not 0 <= x < n]
        if bad:
            raise PlanFileError(
                f"{where}: ops[{k}] ({o.op!r}) is placed on device {bad[0]}; the plan has devices 0..{n - 1}"
            )


def _optional_text(d: dict, key: str, where: str) -> str:
    """An optional text field (files written before it existed lack it: the default, "")."""
    v = d.get(key, "")
    if not isinstance(v, str):
        raise PlanFileError(f"{where}: field {key!r} must be a string, got {v!r}")
    return v
