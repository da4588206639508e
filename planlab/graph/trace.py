"""``trace()``: a torch module to an operator :class:`Graph`, via torch.fx on meta tensors."""

from __future__ import annotations

import dataclasses

import contextlib
import copy
import math
import operator
import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.node import map_aggregate

from planlab.errors import GraphError
from planlab.graph import hf, registry
from planlab.graph.ir import DETACH, DTYPE_BYTES, CallSpec, Graph, Operator, TensorArg, TensorSpec
from planlab.graph.signature import Signature


class _Tracer(fx.Tracer):
    def __init__(self) -> None:
        super().__init__(autowrap_functions=registry.user_functions())


class _ModuleCall:
    """Runs an unknown leaf module functionally on given parameter tensors."""

    def __init__(self, module: nn.Module, param_names: tuple[str, ...]) -> None:
        self.module, self.param_names = module, param_names

    def __call__(self, *tensors):
        k = len(self.param_names)
        acts, params = tensors[: len(tensors) - k], tensors[len(tensors) - k :]
        return torch.func.functional_call(self.module, dict(zip(self.param_names, params)), acts)

    def __repr__(self) -> str:
        return f"{type(self.module).__name__}()"


def _dtype_name(dt: torch.dtype) -> str:
    name = str(dt).removeprefix("torch.")
    return name if name in DTYPE_BYTES else name


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x


def trace(module: nn.Module, example_inputs: tuple, *, name: str | None = None) -> Graph:
    """Trace ``module`` called on ``example_inputs`` into an operator Graph.

    The module's forward must return the scalar training loss. Nothing is
    computed: parameters and inputs become meta tensors, so a 175B-parameter
    model traces in seconds without memory for its weights. Operators with no
    known signature are kept whole and reported in a warning and in
    ``Graph.unknown``.
    """
    if not isinstance(module, nn.Module):
        raise GraphError(f"trace() needs a torch.nn.Module, got {type(module).__name__}")
    inputs = tuple(map_aggregate(tuple(example_inputs), _to_meta))
    # Hugging Face models trace with proxies that know their meta values (planlab/graph/hf.py)
    tracer, scope = hf.tracer_for(module, inputs) or (_Tracer(), contextlib.nullcontext())
    _refuse_tied_weights(module)
    if any(p.device.type != "meta" for p in module.parameters()) or any(
        b.device.type != "meta" for b in module.buffers()
    ):
        module = copy.deepcopy(module).to("meta")
    try:
        fx_graph = tracer.trace(module)
    except Exception as e:  # fx raises many kinds on untraceable code
        raise GraphError(f"torch.fx could not trace {type(module).__name__}{_user_line(e)}: {e}") from e
    gm = fx.GraphModule(module, fx_graph)
    with scope:
        return _GraphBuilder(gm, module).build(inputs)


def _refuse_tied_weights(module: nn.Module) -> None:
    """Tied weights (one parameter under two names) are refused by name, before the copy to meta
    tensors would silently untie them."""
    owners: dict[int, tuple[int, str]] = {}  # parameter -> (module holding it, its name)
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for p_name, p in mod.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            seen = owners.setdefault(id(p), (id(mod), name))
            if seen[0] != id(mod):  # one module registered under two names is not a tie
                raise GraphError(
                    f"parameter {seen[1]!r} is tied to {name!r} (one tensor used by two modules); "
                    "tied weights are not supported yet: give each module its own parameter"
                )


def _user_line(exc: BaseException) -> str:
    """`` at FILE:LINE`` of the innermost frame of the failing call outside torch and planlab, or ''."""
    import traceback

    where = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path or "/planlab/" in path or "/transformers/" in path:
            continue
        where = f" at {path}:{frame.lineno} ({(frame.line or '').strip()})"
    return where


class _GraphBuilder:
    def __init__(self, gm: fx.GraphModule, root: nn.Module) -> None:
        self.gm, self.root = gm, root
        self.values: dict[fx.Node, Any] = {}
        self.tensor_of: dict[fx.Node, Any] = {}  # node -> tensor name (or tuple of names)
        self.tensors: dict[str, TensorSpec] = {}
        self.ops: list[Operator] = []
        self.unknown: dict[str, None] = {}
        self.grad: set[str] = set()  # tensors that require a gradient: parameters and what is computed from them
        # one object per distinct signature, shared by the operators that have it (layers repeat: AlphaFold2's
        # 21,687 operators have 40), so what a signature caches (its splittable dimensions) is found once
        self.signatures: dict[Signature, Signature] = {}

    # -- helpers --
    def _add_tensor(self, name: str, t: torch.Tensor, role: str) -> str:
        self.tensors[name] = TensorSpec(name, tuple(int(s) for s in t.shape), _dtype_name(t.dtype), role)
        if role == "param":
            self.grad.add(name)
        return name

    def _template(self, node: fx.Node, inputs: list[str]):
        """Replace tensor args by TensorArg slots, constant-fold the rest."""

        def sub(a):
            if isinstance(a, fx.Node):
                ref = self.tensor_of.get(a)
                if isinstance(ref, str):
                    if ref not in inputs:
                        inputs.append(ref)
                    return TensorArg(inputs.index(ref))
                if ref is not None:
                    raise GraphError(f"operator {node.name!r} takes a tuple of tensors, which planlab cannot split")
                return self.values[a]
            return a

        args = tuple(map_aggregate(node.args, sub))
        kwargs = dict(map_aggregate(dict(node.kwargs), sub))
        return args, kwargs

    def build(self, inputs: tuple) -> Graph:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(inputs):
            raise GraphError(
                f"the model's forward takes {len(placeholders)} inputs "
                f"({', '.join(p.name for p in placeholders)}); got {len(inputs)} example inputs"
            )
        interp = fx.Interpreter(self.gm)
        loss = None
        graph_inputs = []
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                val = inputs[len(graph_inputs)]
                graph_inputs.append(self._add_tensor(node.name, val, "input"))
                self.values[node] = val
                self.tensor_of[node] = node.name
                continue
            if node.op == "output":
                out = node.args[0]
                ref = self.tensor_of.get(out) if isinstance(out, fx.Node) else None
                if not isinstance(ref, str) or self.tensors[ref].shape != ():
                    raise GraphError(
                        f"the model's forward must return the scalar training loss; it returns {_returned(out, ref, self.tensors)}"
                    )
                loss = ref
                continue
            args = map_aggregate(node.args, lambda a: self.values[a] if isinstance(a, fx.Node) else a)
            kwargs = map_aggregate(dict(node.kwargs), lambda a: self.values[a] if isinstance(a, fx.Node) else a)
            try:
                val = getattr(interp, node.op)(node.target, args, kwargs)
            except Exception as e:
                raise GraphError(f"running {node.format_node()} on meta tensors failed: {e}") from e
            self.values[node] = val
            if node.op == "get_attr":
                if isinstance(val, torch.Tensor):
                    role = "param" if isinstance(val, nn.Parameter) else "buffer"
                    self.tensor_of[node] = self._add_tensor(node.target, val, role)
                continue
            if (
                node.op == "call_function"
                and node.target is operator.getitem
                and isinstance(self.tensor_of.get(node.args[0]), tuple)
            ):
                self.tensor_of[node] = self.tensor_of[node.args[0]][node.args[1]]
                continue
            if isinstance(val, torch.Tensor):
                self._add_op(node, (val,))
            elif isinstance(val, (tuple, list)) and val and all(isinstance(v, torch.Tensor) for v in val):
                self._add_op(node, tuple(val))
            # anything else (sizes, ints) is a constant folded into its users
        if loss is None:
            raise GraphError("the traced graph has no output")
        graph = Graph(self.tensors, self.ops, tuple(graph_inputs), loss, unknown=tuple(self.unknown))
        return dataclasses.replace(graph, labels=_labels(graph))

    def _add_op(self, node: fx.Node, outs: tuple[torch.Tensor, ...]) -> None:
        module = self.gm.get_submodule(node.target) if node.op == "call_module" else None
        opdef = registry.lookup(node.op, node.target, module)
        inputs: list[str] = []
        args, kwargs = self._template(node, inputs)
        n_act = len(inputs)
        if module is not None:
            pnames = opdef.params if opdef else tuple(n for n, _ in module.named_parameters(recurse=True))
            params = [(p, getattr(module, p) if opdef else module.get_parameter(p)) for p in pnames]
            params = [(p, t) for p, t in params if t is not None]
            for p, t in params:
                inputs.append(self._add_tensor(f"{node.target}.{p}", t, "param"))
            slots = tuple(TensorArg(i) for i in range(n_act, len(inputs)))
            if opdef and opdef.functional:
                fn, extra, extra_kw = opdef.functional(module)
                call = CallSpec(fn, (*args, *slots, *extra), {**kwargs, **extra_kw})
            else:
                call = CallSpec(_ModuleCall(module, tuple(p for p, _ in params)), (*args, *slots), kwargs)
        elif node.op == "call_method":
            call = CallSpec(node.target, args, kwargs)  # a method name: args[0] is self
        else:
            call = CallSpec(node.target, args, kwargs)
        if len(outs) == 1:
            out_names = [self._add_tensor(node.name, outs[0], "activation")]
            self.tensor_of[node] = node.name
        else:
            out_names = [self._add_tensor(f"{node.name}.{i}", o, "activation") for i, o in enumerate(outs)]
            self.tensor_of[node] = tuple(out_names)
        ctx = registry.OpContext(
            in_shapes=tuple(self.tensors[t].shape for t in inputs),
            out_shapes=tuple(tuple(o.shape) for o in outs),
            args=args,
            kwargs=kwargs,
            module=module,
        )
        if opdef is None:
            what = (
                f"{type(module).__name__} module"
                if module is not None
                else getattr(node.target, "__name__", str(node.target))
            )
            if what not in self.unknown:
                warnings.warn(
                    f"planlab: no signature for {what} (operator {node.name!r}); it is kept whole", stacklevel=3
                )
            self.unknown.setdefault(what, None)
            opdef = registry.OPAQUE
        sig = opdef.signature(ctx)
        sig = self.signatures.setdefault(sig, sig)
        if len(sig.inputs) != len(inputs) or len(sig.outputs) != len(out_names):
            raise GraphError(
                f"signature {sig} of {node.name!r} has {len(sig.inputs)} inputs and "
                f"{len(sig.outputs)} outputs; the call has {len(inputs)} and {len(out_names)}"
            )
        sizes = _dim_sizes(
            node.name, sig, [self.tensors[t].shape for t in inputs] + [self.tensors[t].shape for t in out_names]
        )
        saves = []
        for s in opdef.saves(ctx):
            idx = int(s[3:]) if s.startswith("out") else int(s[2:])
            saves.append(out_names[idx] if s.startswith("out") else inputs[idx])
        grads = [t in self.grad for t in inputs]
        if opdef.kind == "mul" and not _repeats_operand(node, inputs):
            saves = [t for t in saves if t in out_names or product_keeps(inputs.index(t), grads, _is_division(node))]
        if opdef.kind != DETACH and any(grads):
            self.grad.update(t for t in out_names if self.tensors[t].is_float)
        flops = float(opdef.flops(ctx))
        nbytes = (
            sum(self.tensors[t].nbytes for t in inputs + out_names)
            if opdef.kind not in ("reshape", "permute", "transpose") and not (opdef.kind == "dropout" and flops == 0)
            else 0
        )  # p = 0
        self.ops.append(
            Operator(
                name=node.name,
                kind=opdef.kind,
                inputs=tuple(inputs),
                outputs=tuple(out_names),
                signature=sig,
                dim_sizes=sizes,
                flops=flops,
                bytes_moved=float(nbytes),
                module=_module_path(node),
                call=call,
                saves=tuple(dict.fromkeys(saves)),
                bwd_flops_ratio=opdef.bwd_flops_ratio,
                add_once=tuple(k for k in opdef.add_once if k < len(inputs)),
            )
        )


def _repeats_operand(node: fx.Node, inputs: list[str]) -> bool:
    """Whether the call passes one tensor twice (``x * x``: both operands are kept)."""
    return sum(isinstance(a, fx.Node) for a in node.args) > len(inputs)


def _is_division(node: fx.Node) -> bool:
    return node.target in (operator.truediv, torch.div, torch.true_divide, "div", "true_divide")


def product_keeps(j: int, requires_grad: list[bool], division: bool = False) -> bool:
    """Whether PyTorch's autograd keeps operand ``j`` of an elementwise product (or quotient) for the
    backward, given which operands require a gradient. The gradient of one factor of ``a * b`` reads
    the other factor only, and the generated autograd code saves each operand only when the gradient
    it serves is computed (``tools/autograd/derivatives.yaml``, ``mul.Tensor``; the saving guarded
    by ``should_compute_output`` in the generated ``VariableType``): ``x * rope_cos`` keeps the
    table, not ``x``. For ``a / b``, ``a``'s gradient reads ``b`` and ``b``'s reads ``a`` and ``b``
    (``div.Tensor``). A product by a Python number keeps no tensor."""
    others = [g for i, g in enumerate(requires_grad) if i != j]
    if division and j == 1:
        return any(requires_grad)
    return any(others)


def _module_path(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    last = list(stack.values())[-1]
    return last[0] if isinstance(last, tuple) else str(last)


def _dim_sizes(op_name: str, sig: Signature, shapes: list[tuple[int, ...]]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    groups = []
    for axes, shape in zip(sig.inputs + sig.outputs, shapes):
        if len(axes) != len(shape):
            raise GraphError(
                f"signature {sig} of {op_name!r} gives {len(axes)} axes to a tensor of shape {list(shape)}"
            )
        for ax, s in zip(axes, shape):
            if len(ax) == 1:
                if sizes.setdefault(ax[0], s) != s:
                    raise GraphError(
                        f"operator {op_name!r}: dimension {ax[0]!r} is {sizes[ax[0]]} in one tensor "
                        f"and {s} in another (signature {sig})"
                    )
            elif len(ax) > 1:
                groups.append((ax, s))
    for ax, s in groups:
        known = [sizes.get(n) for n in ax]
        missing = [n for n, k in zip(ax, known) if k is None]
        prod = math.prod(k for k in known if k is not None)
        if len(missing) == 1:
            sizes[missing[0]] = s // prod
        elif missing:
            raise GraphError(f"operator {op_name!r}: cannot size the group {ax} of signature {sig}")
        elif prod != s:
            raise GraphError(f"operator {op_name!r}: group {ax} has size {prod}, the tensor axis {s}")
    return sizes


def _labels(graph: Graph) -> dict[tuple[str, int], str]:
    """Union tensor axes that carry the same dimension of the model."""
    parent: dict[tuple[str, int], tuple[str, int]] = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a, b):
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[rb] = ra

    for t, spec in graph.tensors.items():
        for i in range(len(spec.shape)):
            find((t, i))
    for op in graph.operators:
        first: dict[str, tuple[str, int]] = {}
        for t in op.inputs + op.outputs:
            for i, ax in enumerate(op.axes_of(t)):
                if not ax:
                    continue
                key = ax[0]
                if key in first:
                    union(first[key], (t, i))
                else:
                    first[key] = (t, i)
    return {x: f"{find(x)[0]}.{find(x)[1]}" for x in parent}


def _returned(out, ref, tensors) -> str:
    """What a forward returned, for the error that asks for a scalar loss."""
    if isinstance(ref, str):
        return f"a tensor of shape {list(tensors[ref].shape)} ({ref!r}); reduce it to a scalar, e.g. with .mean()"
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)} values"
    if isinstance(out, dict):
        return f"a dict with keys {list(out)}"
    return f"{type(out).__name__} {out!r}"
