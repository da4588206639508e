"""Search spaces: knobs, constraints, a builder that applies the primitives, and built-in spaces."""

from planlab.search_spaces.builtin import (BUILTIN, DataParallel, Megatron, PipelineParallel, TensorParallel,
                                           get_space, list_spaces, pipeline_stages, tensor_parallel_dims)
from planlab.search_spaces.schedules import gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from planlab.search_spaces.space import Constraint, Context, Draft, Knob, Product, Space

__all__ = ["BUILTIN", "Constraint", "Context", "DataParallel", "Draft", "Knob", "Megatron", "PipelineParallel",
           "Product", "Space", "TensorParallel", "get_space", "gpipe", "interleaved_1f1b", "list_spaces", "one_f_one_b",
           "pipeline_stages", "tensor_parallel_dims", "zb_h1"]
