"""Search spaces: knobs, constraints, rules on the primitives, a builder that applies them,
composition (product, union, restriction), the registry, built-in spaces, and the fast screen."""

from planlab.search_spaces.builtin import (
    BUILTIN,
    DataParallel,
    Megatron,
    PipelineParallel,
    Recompute,
    TensorParallel,
    get_space,
    list_spaces,
    pipeline_stages,
    tensor_parallel_dims,
)
from planlab.search_spaces.compose import Restricted, Union
from planlab.search_spaces.registry import SPACES, parse_space, register_space, space_names
from planlab.search_spaces.rules import OrderRule, PlaceRule, SplitRule
from planlab.search_spaces.schedules import gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from planlab.search_spaces.space import Constraint, Context, Draft, Knob, Product, Space

__all__ = [
    "BUILTIN",
    "Constraint",
    "Context",
    "DataParallel",
    "Draft",
    "Knob",
    "Megatron",
    "OrderRule",
    "PipelineParallel",
    "PlaceRule",
    "Product",
    "Recompute",
    "Restricted",
    "SPACES",
    "Space",
    "SplitRule",
    "TensorParallel",
    "Union",
    "get_space",
    "gpipe",
    "interleaved_1f1b",
    "list_spaces",
    "one_f_one_b",
    "parse_space",
    "pipeline_stages",
    "register_space",
    "space_names",
    "tensor_parallel_dims",
    "zb_h1",
]
