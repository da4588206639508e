"""Plans (the three primitives), layouts, ``materialize`` and the Program it returns."""

from planlab.plan.layout import Layout, Mesh, Partial, Replicate, Shard
from planlab.plan.materialize import materialize, precision_for, trace_plan_model
from planlab.plan.plan import PLAN_VERSION, Action, OpPlan, Plan, PlanBuilder
from planlab.plan.program import FP32, MIXED_BF16, Block, DeviceProgram, Precision, Program, Task, TaskKind

__all__ = [
    "Action",
    "Block",
    "DeviceProgram",
    "FP32",
    "Layout",
    "MIXED_BF16",
    "Mesh",
    "OpPlan",
    "PLAN_VERSION",
    "Partial",
    "Plan",
    "PlanBuilder",
    "Precision",
    "Program",
    "Replicate",
    "Shard",
    "Task",
    "TaskKind",
    "materialize",
    "precision_for",
    "trace_plan_model",
]
from planlab.plan.plan_file import load_plan, plan_from_json, plan_to_json, save_plan  # noqa: E402

__all__ += ["load_plan", "plan_from_json", "plan_to_json", "save_plan"]
