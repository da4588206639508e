"""Region-addressable initialisation: any slice of any parameter, drawn from a seed without
the rest of the model.

Each rank of a run builds only the pieces of parameters its program holds, and the
single-process reference of the numeric check builds whole parameters through the same
function, so the pieces are bit-for-bit slices of the reference's tensors.

A parameter of shape ``(d0, d1, ...)`` is cut along its first dimension into chunks of a
fixed number of rows (about :data:`CHUNK_ELEMENTS` elements each, fixed by the shape
alone); chunk ``i`` is drawn whole by its own generator seeded from ``(seed, parameter
name, i)``, and a region takes the overlapping rows of the chunks it touches, sliced along
the other dimensions. Memory is bounded by one chunk; a region split along a later
dimension still draws its rows' chunks whole (time, not memory).

The distribution of each parameter is read from the model's own initialisation: while the
module is built with its parameters on the meta device (:func:`params_on_meta`), the draws
its code makes on them (``reset_parameters`` of PyTorch's layers, a model's ``nn.init`` calls,
Hugging Face's ``_init_weights``) are recorded instead of made: ``normal_``, ``uniform_``,
``fill_``/``zero_`` (also of an embedding's padding row) and ``trunc_normal_`` (recorded as the
normal it truncates, which at the usual two-sigma-plus bounds is the same draw up to rare
tails); a ``clone`` is drawn as its source. The last draw on a parameter wins, as it would. A parameter no recorded draw reached
(set by ``copy_``, ``orthogonal_``, or through ``.data``) gets, from the module that owns it: the
module's own ``param_init(name) -> InitRule`` if it declares one; uniform ``+-1/sqrt(fan_in)``
for linear and convolution layers; standard normal for embeddings; ones and zeros for
normalisation layers; zeros for a parameter named ``bias`` or ``*_bias``; else a normal of
standard deviation :data:`FALLBACK_STD`.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn

from planlab.plan.layout import Box
from planlab.errors import InternalError

CHUNK_ELEMENTS = 1 << 18  # elements per chunk of rows (1 MiB of fp32), at least one row
FALLBACK_STD = 0.02  # GPT-2's and most transformer codebases' default


@dataclass(frozen=True)
class InitRule:
    """How a parameter's values are drawn: ``normal`` (``a`` mean, ``b`` standard deviation),
    ``uniform`` (between ``a`` and ``b``) or ``constant`` (``a``); ``zero_row`` is an
    embedding's padding row, set to zero."""

    kind: str
    a: float = 0.0
    b: float = 0.0
    zero_row: int | None = None

    def __str__(self) -> str:
        text = {
            "normal": f"N({self.a:g}, {self.b:g})",
            "uniform": f"U({self.a:.4g}, {self.b:.4g})",
            "constant": f"{self.a:g}",
        }.get(self.kind, self.kind)
        return text + (f" (row {self.zero_row} zero)" if self.zero_row is not None else "")


ZEROS, ONES = InitRule("constant", 0.0), InitRule("constant", 1.0)
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)


def _fan_in(weight: torch.Tensor) -> int:
    return int(weight.shape[1] * math.prod(weight.shape[2:])) if weight.dim() >= 2 else int(weight.shape[0])


def _torch_rule(module: nn.Module, name: str, p: torch.Tensor) -> InitRule | None:
    """The rule of PyTorch's own ``reset_parameters`` for a built-in layer, or None."""
    if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
        bound = 1.0 / math.sqrt(_fan_in(module.weight)) if _fan_in(module.weight) > 0 else 0.0
        return InitRule("uniform", -bound, bound)  # kaiming_uniform_(a=sqrt(5)) and its bias
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return InitRule("normal", 0.0, 1.0, getattr(module, "padding_idx", None))
    if isinstance(module, _NORMS) or "norm" in type(module).__name__.lower():
        return ONES if name == "weight" else ZEROS
    return None


def _is_bias(name: str) -> bool:
    return name == "bias" or name.endswith("_bias")


def _fallback(module: nn.Module, name: str, p: torch.Tensor) -> InitRule:
    declared = getattr(module, "param_init", None)
    rule = declared(name) if callable(declared) else None
    rule = rule or _torch_rule(module, name, p)
    return rule or (ZEROS if _is_bias(name) else InitRule("normal", 0.0, FALLBACK_STD))


class InitRecorder:
    """The draws made on meta tensors while it is active (see :func:`params_on_meta`), by storage."""

    def __init__(self) -> None:
        self.by_storage: dict[int, InitRule] = {}
        self.row_elements: dict[int, int] = {}
        self._keep: list = []  # the storages recorded, so their addresses are not reused

    def record(self, t: torch.Tensor, rule: InitRule | None) -> None:
        """Record ``rule`` as the draw made on ``t``: a whole tensor, or one of its rows zeroed."""
        st = t.untyped_storage()
        key = st._cdata
        self._keep.append(st)
        if t.storage_offset() == 0 and t.numel() * t.element_size() == st.nbytes():
            if rule is None:
                self.by_storage.pop(key, None)  # a draw not recorded: fall back to the module's rule
            else:
                self.by_storage[key] = rule
                self.row_elements[key] = t.numel() // t.shape[0] if t.dim() and t.shape[0] else 0
            return
        row, r = self.row_elements.get(key, 0), self.by_storage.get(key)
        if (
            r is not None
            and rule == ZEROS
            and row
            and t.numel() == row
            and t.is_contiguous()
            and t.storage_offset() % row == 0
        ):  # a zeroed row: an embedding's padding row
            self.by_storage[key] = InitRule(r.kind, r.a, r.b, t.storage_offset() // row)

    def rules(self, root: nn.Module) -> dict[str, InitRule]:
        """The recorded rule of each parameter of ``root`` that a draw reached, by qualified name."""
        return {
            n: self.by_storage[p.untyped_storage()._cdata]
            for n, p in root.named_parameters()
            if p.is_meta and p.untyped_storage()._cdata in self.by_storage
        }


_RECORDED: "weakref.WeakKeyDictionary[nn.Module, dict[str, InitRule]]" = weakref.WeakKeyDictionary()


def init_rules(root: nn.Module, recorder: InitRecorder | None = None) -> dict[str, InitRule]:
    """The rule of every parameter of ``root`` by its qualified name (see the module docstring):
    recorded while it was built (by ``recorder``, or by :func:`build_skeleton`), else from the
    module that owns it."""
    recorded = recorder.rules(root) if recorder is not None else _RECORDED.get(root, {})
    out: dict[str, InitRule] = {}
    for prefix, module in root.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            out[full] = recorded.get(full) or _fallback(module, name, p)
    return out


def rows_per_chunk(shape: tuple[int, ...]) -> int:
    """Rows of dimension 0 in each chunk of a parameter of ``shape``."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, CHUNK_ELEMENTS // max(1, row))


def chunk_seed(seed: int, name: str, chunk: int) -> int:
    """The generator seed of chunk ``chunk`` of parameter ``name`` (stable across processes)."""
    digest = hashlib.blake2b(f"{seed}\0{name}\0{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _draw(rule: InitRule, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype)
    if rule.kind == "constant":
        return out.fill_(rule.a)
    g = torch.Generator().manual_seed(seed)
    if rule.kind == "normal":
        return out.normal_(rule.a, rule.b, generator=g)
    if rule.kind == "uniform":
        return out.uniform_(rule.a, rule.b, generator=g)
    raise InternalError(f"unknown initialisation {rule.kind!r}; expected 'normal', 'uniform' or 'constant'")


def init_region(
    rule: InitRule, name: str, shape: tuple[int, ...], box: Box | None, *, seed: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The region ``box`` (``((start, stop), ...)`` per dimension; None: all) of parameter
    ``name`` of ``shape`` as :func:`init_rules`' ``rule`` draws it from ``seed``."""
    shape = tuple(int(s) for s in shape)
    box = tuple((0, s) for s in shape) if box is None else tuple((int(a), int(b)) for a, b in box)
    out = torch.empty(tuple(b - a for a, b in box), dtype=dtype)
    if not shape:  # a scalar parameter: one chunk of one element
        return _draw(rule, (), chunk_seed(seed, name, 0), dtype)
    if out.numel() == 0:
        return out
    (r0, r1), rest = box[0], tuple(slice(a, b) for a, b in box[1:])
    rows = rows_per_chunk(shape)
    for i in range(r0 // rows, (r1 - 1) // rows + 1):
        c0, c1 = i * rows, min((i + 1) * rows, shape[0])
        chunk = _draw(rule, (c1 - c0,) + shape[1:], chunk_seed(seed, name, i), dtype)
        lo, hi = max(r0, c0), min(r1, c1)
        out[(slice(lo - r0, hi - r0),)] = chunk[(slice(lo - c0, hi - c0),) + rest]
    if rule.zero_row is not None:
        z = rule.zero_row % shape[0]
        if r0 <= z < r1:
            out[z - r0] = 0
    return out


# Held while torch's init functions are patched: one thread at a time builds on meta, so no two
# patches interleave and no restore undoes another thread's patch.
_PATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def params_on_meta() -> Iterator[InitRecorder]:
    """Build modules with their parameters on the meta device and their buffers (position ids,
    masks, rotary tables) real: every parameter registered inside is moved to meta at once, and
    the draws the model's code makes on meta tensors are recorded (the recorder is yielded)
    instead of made, so nothing is drawn and no parameter takes memory. The patches of torch it
    needs last only while it is active, and a lock keeps other threads' uses of it out meanwhile."""
    with _PATCH_LOCK, _patched_for_meta() as rec:
        yield rec


@contextlib.contextmanager
def _patched_for_meta() -> Iterator[InitRecorder]:
    """:func:`params_on_meta` without its lock."""
    rec = InitRecorder()
    register = nn.Module.register_parameter
    saved = {m: getattr(torch.Tensor, m) for m in ("normal_", "uniform_", "fill_", "zero_", "clone")}
    trunc = nn.init._no_grad_trunc_normal_

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            self._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    def recording(method: str, rule):
        def draw(self, *args, **kwargs):
            if not self.is_meta:
                return saved[method](self, *args, **kwargs)
            try:
                value = rule(*args, **kwargs)
            except (TypeError, RuntimeError, NotImplementedError):  # e.g. a fill from a meta tensor
                value = None
            rec.record(self, value)
            return self

        return draw

    def normal(mean=0.0, std=1.0, *, generator=None):
        return InitRule("normal", float(mean), float(std))

    def uniform(lo=0.0, hi=1.0, *, generator=None, **kw):
        return InitRule("uniform", float(kw.get("from", lo)), float(kw.get("to", hi)))

    def clone(self, *args, **kwargs):  # a copy is drawn as its source was
        out = saved["clone"](self, *args, **kwargs)
        if self.is_meta:
            rule = rec.by_storage.get(self.untyped_storage()._cdata)
            if (
                rule is not None
                and self.storage_offset() == 0
                and self.numel() * self.element_size() == self.untyped_storage().nbytes()
            ):
                rec.record(out, rule)
        return out

    def trunc_normal(tensor, mean, std, a, b, generator=None):
        if tensor.is_meta:
            rec.record(tensor, InitRule("normal", float(mean), float(std)))
            return tensor
        return trunc(tensor, mean, std, a, b, generator=generator)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    torch.Tensor.normal_ = recording("normal_", normal)  # type: ignore[method-assign]
    torch.Tensor.uniform_ = recording("uniform_", uniform)  # type: ignore[method-assign]
    torch.Tensor.fill_ = recording("fill_", lambda value: InitRule("constant", float(value)))  # type: ignore
    torch.Tensor.zero_ = recording("zero_", lambda: ZEROS)  # type: ignore[method-assign]
    torch.Tensor.clone = clone  # type: ignore[method-assign]
    nn.init._no_grad_trunc_normal_ = trunc_normal
    try:
        yield rec
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
        for m, fn in saved.items():
            setattr(torch.Tensor, m, fn)
        nn.init._no_grad_trunc_normal_ = trunc


def fill_parameters(module: nn.Module, *, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """Give every (meta) parameter of ``module`` its whole value from :func:`init_region`."""
    rules = init_rules(module)
    for prefix, owner in list(module.named_modules()):
        for name, p in list(owner.named_parameters(recurse=False)):
            full = f"{prefix}.{name}" if prefix else name
            value = init_region(rules[full], full, tuple(p.shape), None, seed=seed, dtype=p.dtype)
            setattr(owner, name, nn.Parameter(value.to(device), requires_grad=p.requires_grad))
    return module


def build_skeleton(spec, *, batch: int, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``spec``'s module with meta parameters and real buffers, and its example inputs of
    ``batch`` samples on the CPU drawn from ``seed`` (as :func:`~planlab.models.build_model`
    draws them); no parameter takes memory."""
    from planlab.errors import ConfigError
    from planlab.models import user

    fam = spec.family()
    torch.manual_seed(seed)
    with params_on_meta() as recorder:
        if fam is None:
            module, inputs = user._call(spec.name, spec.args, meta=False)
            inputs = tuple(user._rebatch(x, batch) for x in inputs)
        else:
            cfg = spec.config()
            module = fam.module(cfg)
            inputs = fam.module.example_inputs(cfg, batch, "cpu", seed=seed + 1)
    _RECORDED[module] = recorder.rules(module)
    stray = [n for n, b in module.named_buffers() if b.device.type == "meta"]
    if stray:
        raise ConfigError(
            f"model {spec}: buffers {stray[:3]} were made on the meta device; build them on the "
            "CPU (planlab builds parameters on meta and draws each rank's pieces itself)"
        )
    return module, tuple(inputs)


def build_full(spec, *, batch: int, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``spec``'s whole module with every parameter drawn by :func:`init_region` (the values
    each rank's pieces are slices of), and its example inputs: the numeric check's reference."""
    module, inputs = build_skeleton(spec, batch=batch, seed=seed)
    return fill_parameters(module, seed=seed), inputs
