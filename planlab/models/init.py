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

The distribution of each parameter is read from the module that owns it, as PyTorch's own
``reset_parameters`` draws it (:func:`init_rules`): ``nn.Linear`` and convolutions uniform in
``+-1/sqrt(fan_in)`` (weights and biases), ``nn.Embedding`` standard normal (its padding row
zero), normalisation layers ones (weights) and zeros (biases). A module declares its own
parameters' rules with a method ``param_init(name) -> InitRule`` (the mixture-of-experts
stacked weights do). Models built by Hugging Face ``transformers`` (a ``config`` with
``initializer_range``) draw linear, embedding and unknown weights from a normal of that
standard deviation, zero biases and one norm weights, as their ``_init_weights`` does. Any
other parameter: zeros if it is named ``bias`` (or ``*_bias``), else normal with standard
deviation :data:`FALLBACK_STD`.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn

from planlab.plan.layout import Box

CHUNK_ELEMENTS = 1 << 18  # elements per chunk of rows (1 MiB of fp32), at least one row
FALLBACK_STD = 0.02       # GPT-2's and most transformer codebases' default


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
        text = {"normal": f"N({self.a:g}, {self.b:g})", "uniform": f"U({self.a:.4g}, {self.b:.4g})",
                "constant": f"{self.a:g}"}.get(self.kind, self.kind)
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


def _hf_std(root: nn.Module) -> float | None:
    for m in root.modules():
        std = getattr(getattr(m, "config", None), "initializer_range", None)
        if isinstance(std, (int, float)) and not isinstance(std, bool):
            return float(std)
    return None


def _is_bias(name: str) -> bool:
    return name == "bias" or name.endswith("_bias")


def init_rules(root: nn.Module) -> dict[str, InitRule]:
    """The rule of every parameter of ``root`` by its qualified name (see the module docstring)."""
    hf_std = _hf_std(root)
    out: dict[str, InitRule] = {}
    for prefix, module in root.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            declared = getattr(module, "param_init", None)
            rule = declared(name) if callable(declared) else None
            if rule is None and hf_std is not None:
                norm = isinstance(module, _NORMS) or "norm" in type(module).__name__.lower()
                rule = (ONES if norm and name == "weight" else ZEROS if _is_bias(name)
                        else InitRule("normal", 0.0, hf_std))
            if rule is None:
                rule = _torch_rule(module, name, p)
            if rule is None:
                rule = ZEROS if _is_bias(name) else InitRule("normal", 0.0, FALLBACK_STD)
            out[full] = rule
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
    raise ValueError(f"unknown initialisation {rule.kind!r}; expected 'normal', 'uniform' or 'constant'")


def init_region(rule: InitRule, name: str, shape: tuple[int, ...], box: Box | None, *, seed: int,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
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


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers (position ids,
    masks, rotary tables) real: every parameter registered inside is moved to meta at once,
    so the layers' own ``reset_parameters`` draw nothing."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            self._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


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
    with params_on_meta():
        if fam is None:
            module, inputs = user._call(spec.name, spec.args, meta=False)
            inputs = tuple(user._rebatch(x, batch) for x in inputs)
        else:
            cfg = spec.config()
            module = fam.module(cfg)
            inputs = fam.module.example_inputs(cfg, batch, "cpu", seed=seed + 1)
    stray = [n for n, b in module.named_buffers() if b.device.type == "meta"]
    if stray:
        raise ConfigError(f"model {spec}: buffers {stray[:3]} were made on the meta device; build them on the "
                          "CPU (planlab builds parameters on meta and draws each rank's pieces itself)")
    return module, tuple(inputs)


def build_full(spec, *, batch: int, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``spec``'s whole module with every parameter drawn by :func:`init_region` (the values
    each rank's pieces are slices of), and its example inputs: the numeric check's reference."""
    module, inputs = build_skeleton(spec, batch=batch, seed=seed)
    return fill_parameters(module, seed=seed), inputs
