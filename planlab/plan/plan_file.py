"""Plan files: a Plan as versioned JSON, and back, with every field checked."""

from __future__ import annotations

import json
import os
from pathlib import Path

from planlab.errors import PlanFileError
from planlab.models.registry import ModelSpec
from planlab.plan.plan import READ_VERSIONS, ZERO_STAGES, Action, OpPlan, Plan

FORMAT = "planlab-plan"


def plan_to_dict(plan: Plan) -> dict:
    return {
        "format": FORMAT,
        "version": plan.version,
        "model": plan.model.to_json(),
        "global_batch": plan.global_batch,
        "cluster": plan.cluster,
        "nodes": plan.nodes,
        "num_devices": plan.num_devices,
        "microbatches": plan.microbatches,
        "space": plan.space,
        "knobs": dict(plan.knobs),
        "ops": [
            {
                "op": p.op,
                "dims": list(p.dims),
                "sizes": list(p.sizes),
                "devices": list(p.devices),
                "stage": p.stage,
                **({"recompute": p.recompute} if p.recompute else {}),
            }
            for p in plan.ops
        ],
        "schedule": [[str(a) for a in s] for s in plan.schedule],
        **({"zero": plan.zero} if plan.zero else {}),
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


def plan_from_dict(d: dict, where: str = "plan") -> Plan:
    """Check and convert a plan dict; PlanFileError names the field at fault."""
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
    ops = []
    for k, o in enumerate(_need(d, "ops", list, where)):
        w = f"{where}: ops[{k}]"
        if not isinstance(o, dict):
            raise PlanFileError(f"{w}: expected an object")
        dims = _need(o, "dims", list, w)
        sizes = _need(o, "sizes", list, w)
        devices = _need(o, "devices", list, w)
        if any(x is not None and not isinstance(x, str) for x in dims):
            raise PlanFileError(f"{w}: dims must be dimension names or null")
        if any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in sizes) or len(sizes) != len(dims):
            raise PlanFileError(f"{w}: sizes must be positive integers, one per dim")
        if any(not isinstance(x, int) or isinstance(x, bool) for x in devices):
            raise PlanFileError(f"{w}: devices must be integers")
        rc = o.get("recompute", 0)
        if not isinstance(rc, int) or isinstance(rc, bool) or rc < 0:
            raise PlanFileError(f"{w}: recompute must be a non-negative integer group, got {rc!r}")
        ops.append(
            OpPlan(
                _need(o, "op", str, w), tuple(dims), tuple(sizes), tuple(devices), int(_need(o, "stage", int, w)), rc
            )
        )
    schedule = []
    for k, s in enumerate(d.get("schedule", [])):
        if not isinstance(s, list):
            raise PlanFileError(f"{where}: schedule[{k}] must be a list of actions")
        try:
            if version == 1:  # version 1 named the once-per-iteration update W
                s = [a.replace("W", "U") if isinstance(a, str) else a for a in s]
            schedule.append(tuple(Action.parse(a) for a in s))
        except (ValueError, AttributeError) as e:
            raise PlanFileError(f"{where}: schedule[{k}]: {e}") from None
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
        ops=tuple(ops),
        schedule=tuple(schedule),
        space=str(d.get("space", "")),
        knobs=tuple(sorted(knobs.items())),
        zero=_zero(d, where),
    )


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
    for k, o in enumerate(ops):
        bad = [x for x in o.devices if not 0 <= x < n]
        if bad:
            raise PlanFileError(
                f"{where}: ops[{k}] ({o.op!r}) is placed on device {bad[0]}; the plan has devices 0..{n - 1}"
            )
