"""Signatures of the vision operators Swin Transformer (and convolutional stems) use.

- **Convolution** (``nn.Conv1d/2d/3d``, ``F.conv1d/2d/3d``): batch and output channels split;
  input channels are a reduction (``ci+``: a split leaves partial sums, the bias is added by one
  piece). A spatial axis splits only where the convolution cuts it into independent patches
  (kernel == stride, no padding, no dilation, the input an exact multiple of the kernel, as in
  Swin's and ViT's patch embedding): the input axis is then the group ``(s k)`` of output
  positions and kernel taps, and splitting ``s`` gives each piece whole patches. Any other
  spatial axis, and the channels of a grouped convolution, are kept whole.
- **Cyclic shift** (``torch.roll`` with ``dims``): the rolled axes are kept whole (a piece of a
  roll needs data from its neighbours); every other axis splits.
- **Reductions** ``sum`` and ``mean`` over given dims: the other axes split. A summed axis is a
  reduction (pieces add up); an averaged axis is kept whole, since the means of two halves do
  not add up to the mean of the whole.
- **Adaptive average pooling** (``nn.AdaptiveAvgPool1d/2d/3d`` and the functions): leading
  (batch, channel) axes split, the pooled trailing axes are kept whole.
- ``masked_fill`` is elementwise with broadcasting; ``nn.Softmax`` as ``softmax``;
  ``nn.Flatten``/``nn.Unflatten`` as ``reshape``; ``nn.Identity`` as a copy.

Window partition and reverse (``view`` + ``permute`` chains), 4-D attention matmuls, the
shifted-window mask add and patch merging (``view`` + ``permute`` + ``flatten``) already have
signatures (``reshape``, ``permute``, ``matmul``, ``add``), and the relative-position-bias gather
``table[index]`` is a ``getitem`` with an integer tensor index.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from planlab.graph import ops_biased_attention  # noqa: F401  (defined before this module: registry order)
from planlab.graph.opdefs import (
    OpContext,
    elementwise_signature,
    axis_names,
    opaque_signature,
    define_op,
    reshape_signature,
)
from planlab.graph.signature import Signature

# ---- convolution -------------------------------------------------------------------

_CONV_FNS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_DEFAULTS = {"stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def _ntuple(v, k: int) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * k


def _conv_consts(c: OpContext, k: int) -> tuple[tuple, tuple | str, tuple, int]:
    """``(stride, padding, dilation, groups)`` of a convolution module or function call;
    padding stays a string (``"same"``/``"valid"``) when given as one."""
    m = c.module
    if m is not None:
        stride, padding, dilation, groups = m.stride, m.padding, m.dilation, m.groups
    else:
        vals = dict(_CONV_DEFAULTS)
        vals.update({name: a for name, a in zip(_CONV_ARGS[3:], c.args[3:])})
        vals.update({n: v for n, v in c.kwargs.items() if n in _CONV_DEFAULTS})
        stride, padding, dilation, groups = (vals[n] for n in ("stride", "padding", "dilation", "groups"))
    if isinstance(padding, str):
        padding = (0,) * k if padding == "valid" else padding
    else:
        padding = _ntuple(padding, k)
    return _ntuple(stride, k), padding, _ntuple(dilation, k), int(groups)


def _conv(c: OpContext) -> Signature:
    """``b ci (s0 k0) (s1 k1), o ci k0 k1, o -> b o s0 s1`` for a patch-embedding convolution;
    see the module docstring for the general case."""
    x, w = c.in_shapes[0], c.in_shapes[1]
    out = c.out_shapes[0]
    k = len(w) - 2
    if k < 1 or len(x) not in (k + 1, k + 2):
        return opaque_signature(c)
    stride, padding, dilation, groups = _conv_consts(c, k)
    lead = [(n,) for n in axis_names(len(x) - k - 1)]  # the batch, absent for an unbatched input
    off = len(lead) + 1
    xs, ws, os = [], [], []
    for i in range(k):
        kern, size, osize = w[2 + i], x[off + i], out[off + i]
        patches = (
            not isinstance(padding, str)
            and stride[i] == kern
            and padding[i] == 0
            and dilation[i] == 1
            and size == osize * kern
        )
        if patches:
            xs.append((f"s{i}", f"k{i}"))
            os.append((f"s{i}",))
        else:
            xs.append((f"x{i}",))
            os.append((f"y{i}",))
        ws.append((f"k{i}",))
    # a grouped convolution's channels are kept whole: its input channels ("cx") are not the
    # weight's ("cw", per group), and each output channel reads one group only
    cx, cw = ("ci", "ci") if groups == 1 else ("cx", "cw")
    ins = [[*lead, (cx,), *xs], [("o",), (cw,), *ws]]
    if len(c.in_shapes) > 2:
        ins.append([("o",)])
    return Signature.of(ins, [[*lead, ("o",), *os]], {"ci"}, set() if groups == 1 else {"o"})


def _conv_flops(c: OpContext) -> float:
    w = c.in_shapes[1]
    return 2.0 * c.out_numel * math.prod(w[1:])


def _conv_functional(m: nn.Module):
    """A convolution module as a function of (input, weight[, bias]) with its constants baked in."""
    fn = _CONV_FNS[len(m.kernel_size)]
    stride, dilation, groups = m.stride, m.dilation, m.groups
    if m.padding_mode != "zeros":
        pad, mode = tuple(m._reversed_padding_repeated_twice), m.padding_mode
        zero = (0,) * len(m.kernel_size)

        def call(x, w, b=None):
            return fn(F.pad(x, pad, mode=mode), w, b, stride, zero, dilation, groups)
    else:
        padding = m.padding

        def call(x, w, b=None):
            return fn(x, w, b, stride, padding, dilation, groups)

    return call, (), {}


define_op(
    modules=(nn.Conv1d, nn.Conv2d, nn.Conv3d),
    targets_fn=tuple(_CONV_FNS.values()),
    kind="conv",
    signature=_conv,
    flops=_conv_flops,
    saves=lambda c: ("in0", "in1"),
    functional=_conv_functional,
    params=("weight", "bias"),
    add_once=(2,),
)


# ---- cyclic shift --------------------------------------------------------------------


def _roll(c: OpContext) -> Signature:
    """``torch.roll(x, shifts, dims)``: rolled axes kept whole, the others split. Without
    ``dims`` (a roll of the flattened tensor) the whole operator is kept whole."""
    dims = c.kwargs.get("dims", c.args[2] if len(c.args) > 2 else None)
    if dims is None or len(c.in_shapes) != 1:
        return opaque_signature(c)
    r = len(c.in_shapes[0])
    names = axis_names(r)
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    axes = [(n,) for n in names]
    return Signature.of([axes], [axes], (), {names[d % r] for d in dims})


define_op(targets_fn=(torch.roll,), methods=("roll",), kind="roll", signature=_roll, bwd_flops_ratio=0.0)


# ---- reductions over dims ------------------------------------------------------------


def _reduced(c: OpContext, r: int) -> tuple[set[int], bool]:
    """The axes a ``sum``/``mean`` call reduces (all when ``dim`` is absent or None) and its keepdim."""
    dim = c.kwargs.get("dim", c.args[1] if len(c.args) > 1 else None)
    keep = bool(c.kwargs.get("keepdim", c.args[2] if len(c.args) > 2 else False))
    if dim is None or isinstance(dim, torch.dtype) or (isinstance(dim, (tuple, list)) and not dim):
        return set(range(r)), keep
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return {d % r for d in dims}, keep


def _reduction(summed: bool):
    def sig(c: OpContext) -> Signature:
        dim = c.kwargs.get("dim", c.args[1] if len(c.args) > 1 else None)
        ints = isinstance(dim, (tuple, list)) and all(isinstance(d, int) for d in dim)
        ok = dim is None or isinstance(dim, (int, torch.dtype)) or ints  # sum(x, dtype): every axis
        r = len(c.in_shapes[0]) if len(c.in_shapes) == 1 else 0
        if r == 0 or not ok:  # a scalar, a named dimension, or a tensor argument
            return opaque_signature(c)
        red, keep = _reduced(c, r)
        names = axis_names(r)
        ins = [(n if a not in red else f"r{a}",) for a, n in enumerate(names)]
        outs = [(n,) if a not in red else () for a, n in enumerate(names) if keep or a not in red]
        reduce = {f"r{a}" for a in red} if summed else set()
        return Signature.of([ins], [outs], reduce)  # an averaged axis vanishes: kept whole

    return sig


for _fn, _name, _summed in ((torch.sum, "sum", True), (torch.mean, "mean", False)):  # one FLOP an element
    define_op(
        targets_fn=(_fn,),
        methods=(_name,),
        kind=_name,
        signature=_reduction(_summed),
        flops=lambda c: float(math.prod(c.in_shapes[0])),
        bwd_flops_ratio=0.5,
    )


# ---- adaptive average pooling --------------------------------------------------------


def _adaptive_pool(k: int):
    def sig(c: OpContext) -> Signature:
        x = c.in_shapes[0]
        if len(x) < k + 1:
            return opaque_signature(c)
        lead = [(n,) for n in axis_names(len(x) - k)]
        return Signature.of([[*lead, *[(f"p{i}",) for i in range(k)]]], [[*lead, *[(f"q{i}",) for i in range(k)]]])

    return sig


for _k, _mod, _fn in (
    (1, nn.AdaptiveAvgPool1d, F.adaptive_avg_pool1d),
    (2, nn.AdaptiveAvgPool2d, F.adaptive_avg_pool2d),
    (3, nn.AdaptiveAvgPool3d, F.adaptive_avg_pool3d),
):
    define_op(
        modules=(_mod,),
        targets_fn=(_fn,),
        kind="avg_pool",
        signature=_adaptive_pool(_k),
        flops=lambda c: float(math.prod(c.in_shapes[0])),
        bwd_flops_ratio=0.5,
        functional=lambda m: (m.forward, (), {}),
    )


# ---- small elementwise and shape modules ------------------------------------------------


def _softmax_module(c: OpContext) -> Signature:
    dim = c.module.dim
    return opaque_signature(c) if dim is None else elementwise_signature(c, (dim,))


define_op(
    targets_fn=(torch.masked_fill,),
    methods=("masked_fill",),
    kind="masked_fill",
    signature=elementwise_signature,
    flops=lambda c: float(c.out_numel),
    saves=lambda c: ("in1",) if len(c.in_shapes) > 1 else (),
    bwd_flops_ratio=0.5,
)
define_op(
    modules=(nn.Softmax,),
    kind="softmax",
    signature=_softmax_module,
    flops=lambda c: 5.0 * c.out_numel,
    saves=lambda c: ("out0",),
    bwd_flops_ratio=1.0,
    functional=lambda m: (m.forward, (), {}),
)
define_op(
    modules=(nn.Flatten, nn.Unflatten),
    kind="reshape",
    signature=reshape_signature,
    bwd_flops_ratio=0.0,
    view=True,
    functional=lambda m: (m.forward, (), {}),
)
define_op(
    modules=(nn.Identity,),
    kind="copy",
    signature=elementwise_signature,
    bwd_flops_ratio=0.0,
    functional=lambda m: (m.forward, (), {}),
)
