"""Tracing Hugging Face ``transformers`` models: torch.fx with proxies that know their meta values.

transformers 5 no longer ships a torch.fx tracer (``transformers.utils.fx.HFTracer`` and its
``symbolic_trace`` are gone; the library now targets torch.export and torch.compile), and plain
``torch.fx`` stops at the first line of its model code that branches on a size
(``if q_length == kv_length``). :class:`HFTracer` follows that code the way HFTracer (and
torch's ``fx.experimental.meta_tracer``) did: each proxy carries its value on meta tensors, so
sizes, dtypes and devices are concrete Python values and control flow on them runs as written.
The graph is specialized to the example shapes, which is what planlab plans for anyway.

Rewrites keep the recorded graph runnable one operator piece at a time:

1. constants: tensors made from sizes alone (``torch.arange(seq, device=x.device)``, a window
   mask) are computed for real on the CPU while tracing (a traced tensor's ``device`` reads as
   the CPU), so HF's mask code sees their values (no packed sequences: causal attention keeps
   ``is_causal`` and no mask tensor); one enters the graph as a ``constant`` operator holding
   the value. A factory with a traced argument is recorded as an operator;
2. device arguments are dropped (``x.to(y.device)`` is ``x.to()``): traced tensors live where
   the operator runs, and new ones on the default device (meta while tracing);
3. in-place writes become their functional twins and the written proxy is rebound to the
   result (``x[i] = v`` records ``x = functional_setitem(x, i, v)``; ``x.masked_fill_(m, v)``
   records ``x = x.masked_fill(m, v)``), as T5's shifted decoder inputs need;
4. a mean cross-entropy over integer targets becomes the sum divided by the number of kept
   targets (``target != ignore_index``, :func:`~planlab.graph.ops_hf.kept_mean`): both split
   exactly over the batch, where the mean of the pieces would not (HF's causal-LM loss pads the
   labels with ``ignore_index``); with ``m`` micro-batches each divides by ``m`` times its own
   count, exact when every micro-batch keeps as many targets;
5. indices that cover a whole axis (``x[:, 0:S]``) are written as full slices;
6. the key/value cache is off while tracing (a training step keeps none), buffers are traced
   values (``get_attr``), and operators whose results nothing reads are dropped.

Loss modules (``nn.CrossEntropyLoss``) are traced into their functions; modules with a
registered signature (``Conv1D``, ``nn.Conv2d``, ...) are leaves. Control flow on tensor
*values* cannot be followed on meta tensors: it raises a GraphError naming the source line.
"""

from __future__ import annotations

import functools
import inspect
import operator
import os
import sys
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.node import map_aggregate
from torch.utils._device import _device_constructors

from planlab.errors import GraphError
from planlab.graph import registry
from planlab.graph.ops_hf import Constant, constant, functional_setitem, kept_mean, register_transformers_modules

# Factories that make a tensor from sizes or data alone (deterministic ones only).
FACTORIES = ("arange", "zeros", "ones", "full", "empty", "eye", "tensor", "linspace", "tril_indices", "triu_indices")
# Random factories: recorded as operators, always (their pieces draw from planlab's generator).
RANDOM_FACTORIES = ("rand", "rand_like")
# In-place methods without a functional twin of the same name but one.
_INPLACE_TWINS: dict[str, Callable] = {"zero_": torch.zeros_like, "fill_": torch.full_like}
_RANDOM_INPLACE = (
    "uniform_",
    "normal_",
    "bernoulli_",
    "exponential_",
    "random_",
    "geometric_",
    "cauchy_",
    "log_normal_",
)
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # planlab/
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_CE_PARAMS = tuple(inspect.signature(F.cross_entropy).parameters)
_CONSTANTS = torch.device("cpu")  # where tensors computed from sizes alone are made while tracing


def is_hf_model(module: nn.Module) -> bool:
    """True if ``module`` holds a ``transformers`` PreTrainedModel (transformers is not imported
    here: a model built with it has imported it already)."""
    tf = sys.modules.get("transformers")
    if tf is None:
        return False
    base = getattr(tf, "PreTrainedModel", None)
    return base is not None and any(isinstance(m, base) for m in module.modules())


def check_untied(module: nn.Module) -> None:
    """planlab plans each parameter as one tensor of one module: refuse a parameter that two
    modules share (HF ties the output layer to the input embedding unless
    ``tie_word_embeddings=False``). One module under two names is not a tie."""
    seen: dict[int, str] = {}
    for prefix, m in module.named_modules():  # each module once, under its first name
        for pname, p in m.named_parameters(recurse=False):
            name = f"{prefix}.{pname}" if prefix else pname
            first = seen.setdefault(id(p), name)
            if first != name:
                raise GraphError(
                    f"parameters {first!r} and {name!r} are one tied tensor, which planlab cannot "
                    "plan yet; build the model with tie_word_embeddings=False (or untie them)"
                )


def source_line() -> str:
    """The innermost frame of the traced model's own code: ``file.py:123 in forward``."""
    for fr in reversed(traceback.extract_stack()):
        f = os.path.abspath(fr.filename)
        if f.startswith((_HERE, _TORCH)) or "/contextlib.py" in f:
            continue
        return f"{os.path.basename(f)}:{fr.lineno} in {fr.name} ({(fr.line or '').strip()})"
    return "an unknown line"


def _hint() -> str:
    for fr in reversed(traceback.extract_stack()):
        if "experts" in (fr.line or "").lower() or fr.name.endswith("experts_forward") or "Experts" in fr.name:
            return (
                "; mixture-of-experts layers route tokens by value: build the model with "
                "experts_implementation='batched_mm' (model.set_experts_implementation('batched_mm'))"
            )
    return ""


def _describe(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", repr(target))


class MetaProxy(fx.Proxy):
    """A proxy that knows its value on meta tensors (``meta``): sizes, dtype and device are
    concrete, and so is control flow on them; control flow on tensor values is refused."""

    meta: Any

    def _tensor(self, what: str) -> torch.Tensor:
        m = self.meta
        if not isinstance(m, torch.Tensor):
            raise GraphError(
                f"{what} of {self.node.name!r}, which is a {type(m).__name__}, not a tensor, at {source_line()}"
            )
        return m

    @property
    def shape(self) -> torch.Size:
        return self._tensor("shape").shape

    def size(self, dim: int | None = None):
        t = self._tensor("size()")
        return t.size() if dim is None else t.size(dim)

    def dim(self) -> int:
        return self._tensor("dim()").dim()

    @property
    def ndim(self) -> int:
        return self._tensor("ndim").dim()

    def numel(self) -> int:
        return self._tensor("numel()").numel()

    @property
    def dtype(self) -> torch.dtype:
        return self._tensor("dtype").dtype

    @property
    def device(self) -> torch.device:
        """The CPU: tensors the model makes from it are constants computed while tracing."""
        self._tensor("device")
        return _CONSTANTS

    def __len__(self) -> int:
        return len(self.meta)

    def __iter__(self) -> Iterator[fx.Proxy]:
        return iter([self[i] for i in range(len(self.meta))])

    def _concrete(self, how: Callable[[Any], Any]):
        m = self.meta
        if isinstance(m, torch.Tensor):
            raise GraphError(
                f"the model branches on the value of tensor {self.node.name!r} (shape {list(m.shape)}) at "
                f"{source_line()}; planlab traces on meta tensors, which have shapes but no values" + _hint()
            )
        return how(m)

    def __bool__(self) -> bool:
        return self._concrete(bool)

    def __index__(self) -> int:
        return self._concrete(operator.index)

    def __int__(self) -> int:
        return self._concrete(int)

    def __float__(self) -> float:
        return self._concrete(float)

    def __setitem__(self, index, value) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, index, value), {})

    def __getattr__(self, k: str):
        if k.startswith("_") or k in ("meta", "node", "tracer"):
            raise AttributeError(k)
        return MetaAttribute(self, k)


class MetaAttribute(MetaProxy):
    """``x.attr`` of a MetaProxy: its node is made when it is used, except as a method call."""

    def __init__(self, root: MetaProxy, attr: str) -> None:
        self.root, self.attr, self.tracer = root, attr, root.tracer
        self._node: fx.Node | None = None

    @property
    def meta(self):  # type: ignore[override]
        return getattr(self.root.meta, self.attr)

    @property
    def node(self) -> fx.Node:  # type: ignore[override]
        if self._node is None:
            self._node = self.tracer.create_proxy("call_function", getattr, (self.root, self.attr), {}).node
        return self._node

    def __call__(self, *args, **kwargs):
        return self.tracer.create_proxy("call_method", self.attr, (self.root, *args), kwargs)


def _is_device(v: Any) -> bool:
    return isinstance(v, torch.device) or (isinstance(v, str) and v.split(":")[0] in ("meta", "cpu", "cuda"))


def _full_slices(idx: Any, shape: torch.Size) -> Any:
    """``idx`` with every slice that covers its whole axis written as ``slice(None)``."""
    items = idx if isinstance(idx, tuple) else (idx,)
    if any(isinstance(i, (torch.Tensor, fx.Proxy, list)) for i in items):
        return idx
    real = sum(1 for i in items if i is not None and i is not Ellipsis)
    out, axis = [], 0
    for i in items:
        if i is Ellipsis:
            axis += len(shape) - real
        elif isinstance(i, slice) and axis < len(shape):
            if i != slice(None) and i.indices(shape[axis]) == (0, shape[axis], 1):
                i = slice(None)
        if i is not None and i is not Ellipsis:
            axis += 1
        out.append(i)
    return tuple(out) if isinstance(idx, tuple) else out[0]


class HFTracer(fx.Tracer):
    """torch.fx tracer whose proxies carry meta values; see the module docstring for its rewrites.

    ``meta_inputs`` are the forward's example inputs on the meta device, in order.
    """

    def __init__(self, meta_inputs: tuple[torch.Tensor, ...]) -> None:
        super().__init__(autowrap_functions=registry.user_functions())
        self.meta_inputs = meta_inputs
        self.proxy_buffer_attributes = True  # buffers are traced values too (get_attr with their meta)
        self._placeholders = 0
        self._in_meta = False
        self._factories: set[Callable] = set()

    # -- what is a leaf ----------------------------------------------------------
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, nn.modules.loss._Loss):
            return False  # traced into F.cross_entropy & co., which have signatures
        if registry.lookup("call_module", None, m) is not None:
            return True
        return super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        if self._in_meta:  # a leaf's forward running on meta tensors: no nodes
            return forward(*args, **kwargs)
        if (
            isinstance(m, nn.modules.loss._Loss)
            or not any(True for _ in m.parameters())
            and m not in self.submodule_paths
        ):
            return forward(*args, **kwargs)  # made in forward (loss_fct = CrossEntropyLoss()): traced through
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self._in_meta:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def proxy(self, node: fx.Node) -> MetaProxy:
        return MetaProxy(node, self)

    # -- tracing -------------------------------------------------------------------
    def trace(self, root, concrete_args=None):  # type: ignore[override]
        """Trace ``root`` with the tensor factories recorded as operators."""
        originals = {name: getattr(torch, name) for name in FACTORIES + RANDOM_FACTORIES}
        self._factories = set(originals.values())
        _device_constructors()  # cached on first use: let it hold the real factories, not ours

        def recorded(fn):
            @functools.wraps(fn)
            def factory(*args, **kwargs):
                if self._in_meta:
                    return fn(*args, **{**kwargs, "device": "meta"})
                traced = []
                map_aggregate((args, kwargs), lambda v: traced.append(v) if isinstance(v, fx.Proxy) else None)
                if traced or fn.__name__ in RANDOM_FACTORIES:
                    return self.create_proxy("call_function", fn, args, kwargs)
                return fn(*args, **{**kwargs, "device": _CONSTANTS})  # a constant, computed now

            return factory

        caches = [
            (m.config, m.config.use_cache)
            for m in root.modules()
            if getattr(getattr(m, "config", None), "use_cache", None) is True
        ]
        try:
            for name, fn in originals.items():
                setattr(torch, name, recorded(fn))
            for cfg, _ in caches:  # a training step keeps no key/value cache
                cfg.use_cache = False
            graph = super().trace(root, concrete_args)
            for node in reversed(graph.nodes):  # dead code: e.g. hidden states reshaped for unread outputs
                if node.op not in ("placeholder", "output") and not node.users:
                    graph.erase_node(node)
            return graph
        finally:
            for name, fn in originals.items():
                setattr(torch, name, fn)
            for cfg, was in caches:
                cfg.use_cache = was

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        args, kwargs = self._without_devices(kind, target, args, dict(kwargs))
        args, kwargs = map_aggregate((args, kwargs), self._constant_operand)
        if kind == "call_function" and target is operator.setitem:
            return self._rebind(args[0], "call_function", functional_setitem, args, kwargs)
        if (
            kind == "call_method"
            and isinstance(target, str)
            and target.endswith("_")
            and not target.startswith("_")
            and target != "requires_grad_"
        ):
            return self._inplace(target, args, kwargs)
        if kwargs.get("inplace") is True:
            kwargs["inplace"] = False
        if kind == "call_function" and target is F.cross_entropy:
            rewritten = self._cross_entropy(args, kwargs)
            if rewritten is not None:
                return rewritten
        if (
            kind == "call_function"
            and target is operator.getitem
            and isinstance(args[0], MetaProxy)
            and isinstance(args[0].meta, torch.Tensor)
        ):
            args = (args[0], _full_slices(args[1], args[0].meta.shape))
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        proxy.meta = self._meta(kind, target, args, kwargs)
        return proxy

    def _constant_operand(self, v: Any) -> Any:
        """A tensor computed while tracing (from sizes alone) as a constant operator."""
        if not isinstance(v, torch.Tensor) or isinstance(v, fx.Proxy):
            return v
        if v.device.type == "meta":
            raise GraphError(f"a tensor without values (on the meta device) enters the model at {source_line()}")
        node = self.create_node("call_function", constant, (Constant(v.detach()),), {})
        proxy = self.proxy(node)
        proxy.meta = torch.empty_like(v, device="meta")
        return proxy

    def _without_devices(self, kind: str, target: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kind not in ("call_function", "call_method"):
            return args, kwargs
        kwargs.pop("device", None)
        if kind == "call_method" and target == "to":
            args = (args[0],) + tuple(a for a in args[1:] if not _is_device(a))
        return args, kwargs

    def _rebind(self, written: Any, kind: str, target: Any, args: tuple, kwargs: dict) -> MetaProxy:
        """Record ``target`` (functional) and make ``written`` stand for its result from now on."""
        if not isinstance(written, MetaProxy):
            raise GraphError(f"in-place write to a {type(written).__name__} at {source_line()}")
        new = self.create_proxy(kind, target, args, kwargs)
        written.node, written.meta = new.node, new.meta
        return written

    def _inplace(self, method: str, args: tuple, kwargs: dict) -> MetaProxy:
        if method in _RANDOM_INPLACE:
            raise GraphError(
                f"the model fills a tensor with random values in place ({method}) at {source_line()}; "
                "planlab cannot check such a model against one process (set the noise to 0)"
            )
        if method in _INPLACE_TWINS:
            return self._rebind(args[0], "call_function", _INPLACE_TWINS[method], args, kwargs)
        twin = method[:-1]
        if not hasattr(torch.Tensor, twin):
            raise GraphError(f"in-place method {method} (at {source_line()}) has no functional twin planlab knows")
        return self._rebind(args[0], "call_method", twin, args, kwargs)

    def _cross_entropy(self, args: tuple, kwargs: dict) -> MetaProxy | None:
        """A mean over integer targets as ``sum / count(target != ignore_index)`` (see rewrite 4)."""
        bound = dict(zip(_CE_PARAMS, args), **kwargs)
        target = bound.get("target")
        if (
            bound.get("reduction", "mean") != "mean"
            or bound.get("weight") is not None
            or bound.get("size_average") is not None
            or bound.get("reduce") is not None
            or not isinstance(target, MetaProxy)
            or target.meta.is_floating_point()
        ):
            return None
        rest = {k: v for k, v in bound.items() if k not in ("input", "target", "reduction")}
        total = self.create_proxy(
            "call_function", F.cross_entropy, (bound["input"], target), {**rest, "reduction": "sum"}
        )
        kept = self.create_proxy("call_function", operator.ne, (target, bound.get("ignore_index", -100)), {})
        count = self.create_proxy("call_method", "sum", (kept,), {})
        return self.create_proxy("call_function", kept_mean, (total, count), {})

    # -- meta values ----------------------------------------------------------------
    def _value(self, v: Any) -> Any:
        if isinstance(v, MetaProxy):
            return v.meta
        if isinstance(v, torch.Tensor) and v.device.type != "meta":
            return v.to("meta")
        if isinstance(v, fx.Proxy):
            raise GraphError(f"a traced value {v} without a meta value")
        return v

    def _meta(self, kind: str, target: Any, args: tuple, kwargs: dict) -> Any:
        if kind == "placeholder":
            i, self._placeholders = self._placeholders, self._placeholders + 1
            return self.meta_inputs[i] if i < len(self.meta_inputs) else (args[0] if args else None)
        if kind == "output":
            return None
        a = map_aggregate(args, self._value)
        k = map_aggregate(kwargs, self._value)
        self._in_meta = True
        try:
            with torch.device("meta"):
                if kind == "call_function":
                    return target(*a, **({**k, "device": "meta"} if target in self._factories else k))
                if kind == "call_method":
                    return getattr(a[0], target)(*a[1:], **k)
                if kind == "call_module":
                    return self.root.get_submodule(target).forward(*a, **k)
                if kind == "get_attr":
                    return functools.reduce(getattr, target.split("."), self.root)
            return None
        except GraphError:
            raise
        except Exception as e:
            raise GraphError(
                f"{_describe(target)} at {source_line()} failed on meta tensors: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}" + _hint()
            ) from e
        finally:
            self._in_meta = False


def tracer_for(module: nn.Module, meta_inputs: tuple) -> tuple[HFTracer, Any] | None:
    """For a model holding a ``transformers`` PreTrainedModel: the tracer and the scope its graph
    is built in (new tensors on the meta device); None for any other model."""
    if not is_hf_model(module):
        return None
    check_untied(module)
    register_transformers_modules()
    return HFTracer(tuple(meta_inputs)), torch.device("meta")
