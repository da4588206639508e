"""Plan-invariant randomness: a counter-based generator keyed by element, as JAX's threefry.

Every random number a training step draws (dropout masks, attention dropout, stochastic depth)
is a function of ``(seed, operator, step, global index)``: the seed of the run, the name of the
random operator in the traced graph, the training step, and the linear index of the element in
the operator's *whole* draw (at the global batch). A piece of an operator, on any device, for
any micro-batch, computes the indices of its own elements (its box in the whole tensor, shifted
by the micro-batch's offset in the batch) and draws exactly the values one process draws for
them: splits along batch, sequence, hidden or heads, placements and micro-batching draw the same
masks, and replicated pieces (a tensor-parallel region) agree by construction.

The generator is Threefry-2x32 with 20 rounds (Salmon et al., "Parallel random numbers: as easy
as 1, 2, 3", SC 2011; the hash JAX's ``jax.random`` uses, here in torch's int64 arithmetic
with every word kept to 32 bits). Its key is derived from the seed and a 64-bit BLAKE2b digest
of the operator's name, then folded with the step (as ``jax.random.fold_in``); each element's
counter is its 64-bit global index, and the first output word is its 32 random bits. torch has no
public counter-based sampler for arbitrary indices, hence this small, documented, tested hash.

:class:`RandomMode` (a ``TorchFunctionMode``) runs ``F.dropout``, ``F.scaled_dot_product_attention``
with ``dropout_p > 0`` and ``torch.rand``/``torch.rand_like`` with the generator; other random
functions are refused (they would draw from torch's global generator, which no split reproduces).
The interpreter runs each random operator's pieces under :meth:`PieceRandomness.piece`; the
numeric check's single-process reference runs the whole model under :func:`reference_draws`.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from planlab.errors import ConfigError, ExecutionError
from planlab.graph.ir import Graph, Operator
from planlab.graph.random_ops import random_operators

MASK32 = 0xFFFFFFFF
ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)  # Threefry-2x32 (Random123's R_32x2)
PARITY = 0x1BD11BDA  # Threefish's key schedule constant (Random123, SKEIN_KS_PARITY32)
ROUNDS = 20
BITS_TO_UNIT = 2.0**-24  # 24 random bits make a float32 in [0, 1) exactly
CHUNK_ELEMENTS = 1 << 16  # elements hashed at once: each of the hash's int64 temporaries takes 512 KiB


def threefry2x32(key: tuple, x0, x1) -> tuple:
    """Threefry-2x32-20 of the counter ``(x0, x1)`` under ``key = (k0, k1)``: two 32-bit words.
    Works on Python ints and on int64 tensors alike (every word is kept below 2**32)."""
    k0, k1 = key[0] & MASK32, key[1] & MASK32
    ks = (k0, k1, k0 ^ k1 ^ PARITY)
    x0, x1 = (x0 + ks[0]) & MASK32, (x1 + ks[1]) & MASK32
    for r in range(ROUNDS):
        rot = ROTATIONS[r % 8]
        x0 = (x0 + x1) & MASK32
        x1 = ((x1 << rot) & MASK32) | (x1 >> (32 - rot))
        x1 = x1 ^ x0
        if r % 4 == 3:  # inject the key every four rounds
            s = r // 4 + 1
            x0 = (x0 + ks[s % 3]) & MASK32
            x1 = (x1 + ks[(s + 1) % 3] + s) & MASK32
    return x0, x1


def stream_key(seed: int, op: str, step: int) -> tuple[int, int]:
    """The key of operator ``op``'s draws at ``step`` of a run seeded ``seed``."""
    digest = hashlib.blake2b(op.encode(), digest_size=8).digest()
    word = int.from_bytes(digest, "little")
    s = seed % 2**64
    key = threefry2x32((s & MASK32, s >> 32), word & MASK32, word >> 32)
    step %= 2**64
    return threefry2x32(key, step & MASK32, step >> 32)


@dataclass(frozen=True)
class Draw:
    """Where a piece's draw sits: ``shape`` elements at ``offset`` of the operator's whole draw
    of shape ``whole``, for operator ``op`` at ``step`` of a run seeded ``seed``."""

    seed: int
    op: str
    step: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    whole: tuple[int, ...]

    def global_index(self, device: torch.device | None = None) -> torch.Tensor:
        """The linear index of each drawn element in the whole draw (int64, of ``shape``), all at
        once (the draws themselves hash it in chunks: :meth:`index_range`)."""
        idx = torch.zeros((), dtype=torch.int64, device=device)
        stride = 1
        for a in reversed(range(len(self.shape))):
            n = self.shape[a]
            coords = torch.arange(self.offset[a], self.offset[a] + n, dtype=torch.int64, device=device)
            idx = idx + (coords * stride).reshape([n] + [1] * (len(self.shape) - 1 - a))
            stride *= self.whole[a]
        return idx.expand(self.shape)

    def index_range(self, start: int, stop: int, device: torch.device | None = None) -> torch.Tensor:
        """The global indices (int64) of the piece's elements ``start`` to ``stop`` in its own
        row-major order: :meth:`global_index` flattened, that slice alone."""
        flat = torch.arange(start, stop, dtype=torch.int64, device=device)
        idx = torch.zeros_like(flat)
        stride = 1
        for a in reversed(range(len(self.shape))):
            n = self.shape[a]
            idx += (flat % n + self.offset[a]) * stride
            flat = flat.div(n, rounding_mode="floor")
            stride *= self.whole[a]
        return idx

    def bits(self, device: torch.device | None = None, chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
        """32 random bits per element (int64 in [0, 2**32)), of ``shape``."""
        return self._hashed(lambda b: b, torch.int64, device, chunk_elements)

    def uniform(
        self,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        chunk_elements: int = CHUNK_ELEMENTS,
    ) -> torch.Tensor:
        """Uniform values in [0, 1), from the top 24 of each element's bits (made float32, then ``dtype``)."""
        return self._hashed(lambda b: (b >> 8).to(torch.float32) * BITS_TO_UNIT, dtype, device, chunk_elements)

    def keep(self, p: float, device: torch.device | None = None, chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
        """The dropout mask: True where an element is kept (probability ``1 - p``)."""
        threshold = math.ceil(p * 2**32)
        return self._hashed(lambda b: b >= threshold, torch.bool, device, chunk_elements)

    def _hashed(self, finish: Callable, dtype: torch.dtype, device, chunk_elements: int) -> torch.Tensor:
        """``finish(bits)`` of every element, as ``dtype``: the hash runs on ``chunk_elements`` at a
        time, so its int64 temporaries stay bounded whatever the draw's size (the values do not
        depend on the chunks: each element's bits are a function of its global index alone)."""
        if chunk_elements < 1:
            raise ConfigError(f"chunk_elements must be at least 1, got {chunk_elements}")
        out = torch.empty(self.shape, dtype=dtype, device=device)
        flat = out.view(-1)
        key = stream_key(self.seed, self.op, self.step)
        for start in range(0, flat.numel(), chunk_elements):
            stop = min(start + chunk_elements, flat.numel())
            idx = self.index_range(start, stop, device)
            flat[start:stop] = finish(threefry2x32(key, idx & MASK32, idx >> 32)[0])
        return out


def dropout(x: torch.Tensor, p: float, draw: Draw) -> torch.Tensor:
    """``F.dropout(x, p)`` with the mask of ``draw``: kept elements scaled by ``1 / (1 - p)``."""
    if p >= 1:
        return x * 0.0
    return x * (draw.keep(p, x.device).to(x.dtype) / (1.0 - p))


def attention(
    q,
    k,
    v,
    attn_mask=None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale=None,
    enable_gqa=False,
    *,
    draw: Draw,
):
    """``F.scaled_dot_product_attention`` computed as its documented math, with dropout on the
    attention weights ``(b.., s, t)`` drawn from ``draw``."""
    s, t = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    w = (q @ k.transpose(-2, -1)) * scale  # (b.., s, t)
    if is_causal:
        w = w.masked_fill(~torch.ones(s, t, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    if attn_mask is not None:
        w = w.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else w + attn_mask
    return dropout(torch.softmax(w, dim=-1), dropout_p, draw) @ v


# Random functions without a plan-invariant version here: they would draw from torch's global generator.
REFUSED = tuple(
    f
    for f in (
        torch.randn,
        torch.randn_like,
        torch.randint,
        torch.randint_like,
        torch.randperm,
        torch.bernoulli,
        torch.normal,
        torch.multinomial,
        torch.poisson,
        torch.dropout,
        F.alpha_dropout,
        F.feature_alpha_dropout,
        F.dropout1d,
        F.dropout2d,
        F.dropout3d,
        torch.Tensor.uniform_,
        torch.Tensor.normal_,
        torch.Tensor.bernoulli_,
        torch.Tensor.bernoulli,
        torch.Tensor.exponential_,
        torch.Tensor.random_,
        torch.Tensor.geometric_,
        torch.Tensor.cauchy_,
        torch.Tensor.log_normal_,
    )
)
_DROPOUT_ARGS = ("input", "p", "training", "inplace")
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _bound(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict:
    return {**dict(zip(names, args)), **kwargs}


def _size(args: tuple, kwargs: dict) -> tuple[int, ...]:
    """The size ``torch.rand(*size)`` or ``torch.rand(size)`` asks for."""
    if "size" in kwargs:
        return tuple(kwargs["size"])
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(int(a) for a in args)


class RandomMode(TorchFunctionMode):
    """Runs the random torch functions of a forward with planlab's generator. Each random call
    asks ``place(kind, shape)`` for its :class:`Draw` (``kind``: ``dropout``, ``attention`` or
    ``rand``; ``shape``: what the call draws as it sees it)."""

    def __init__(self, place: Callable[[str, tuple[int, ...]], Draw]) -> None:
        super().__init__()
        self.place = place

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            a = _bound(_DROPOUT_ARGS, args, kwargs)
            p, x = a.get("p", 0.5), a["input"]
            if p > 0 and a.get("training", True):
                return dropout(x, p, self.place("dropout", tuple(x.shape)))
        elif func is F.scaled_dot_product_attention:
            a = _bound(_SDPA_ARGS, args, kwargs)
            if a.get("dropout_p", 0.0) > 0:
                q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
                draw = self.place("attention", (*q.shape[:-1], k.shape[-2]))
                return attention(q, k, v, **a, draw=draw)
        elif func is torch.rand or func is torch.rand_like:
            size = tuple(args[0].shape) if func is torch.rand_like else _size(args, kwargs)
            draw = self.place("rand", size)
            dtype = kwargs.get("dtype") or (args[0].dtype if func is torch.rand_like else torch.get_default_dtype())
            return draw.uniform(dtype)
        elif func in REFUSED:
            raise ExecutionError(
                f"the model draws random numbers with {getattr(func, '__qualname__', func)}, which planlab cannot draw "
                "alike under every plan; it draws dropout, attention dropout and torch.rand (stochastic depth)"
            )
        return func(*args, **kwargs)


class PieceRandomness:
    """The interpreter's hook: the random operators of ``graph`` draw, piece by piece, what one
    process draws (``microbatches`` per step, a run seeded ``seed``)."""

    def __init__(self, graph: Graph, microbatches: int, seed: int) -> None:
        self.graph, self.microbatches, self.seed = graph, microbatches, seed
        self.random = frozenset(op.name for op in random_operators(graph))

    def piece(self, op: Operator, box, mb: int, step: int):
        """The context to run a forward piece of ``op`` in: under :class:`RandomMode` when ``op``
        draws random numbers (``box``: its first output's box in the micro-batch's tensor)."""
        if op.name not in self.random:
            return contextlib.nullcontext()
        if box is None:
            raise ExecutionError(f"the forward task of random operator {op.name!r} carries no box (Task.box)")
        out = op.outputs[0]
        whole = self.graph.tensors[out].shape
        lo = [a for a, _ in box]
        for axis in range(len(whole)):  # the micro-batch's offset in the batch
            if self.graph.labels.get((out, axis)) == self.graph.batch_label:
                lo[axis] += mb * (whole[axis] // self.microbatches)
        shape = tuple(b - a for a, b in box)
        return RandomMode(_piece_place(Draw(self.seed, op.name, step, tuple(lo), shape, tuple(whole))))


def _piece_place(out: Draw) -> Callable[[str, tuple[int, ...]], Draw]:
    """``place`` for one piece whose output sits at ``out``: dropout and rand draw its elements,
    attention its weights (the output's leading axes, every key position)."""
    calls = [0]

    def place(kind: str, shape: tuple[int, ...]) -> Draw:
        calls[0] += 1
        if calls[0] > 1:
            raise ExecutionError(f"operator {out.op!r} draws random numbers twice in one piece; planlab keys one draw")
        if kind == "attention":
            if tuple(shape[:-1]) != out.shape[:-1]:
                raise ExecutionError(f"attention {out.op!r} draws weights {shape} for an output piece {out.shape}")
            return Draw(out.seed, out.op, out.step, out.offset[:-1] + (0,), tuple(shape), out.whole[:-1] + (shape[-1],))
        if kind == "dropout" and tuple(shape) != out.shape:
            raise ExecutionError(f"dropout {out.op!r} draws {shape} for an output piece {out.shape}")
        return out

    return place


@contextlib.contextmanager
def reference_draws(graph: Graph, seed: int, step: int) -> Iterator[None]:
    """Run one whole forward (the single-process reference) under :class:`RandomMode`: its k-th
    random call draws as the k-th random operator of ``graph``, over the whole tensor."""
    ops = random_operators(graph)
    done = [0]

    def place(kind: str, shape: tuple[int, ...]) -> Draw:
        k = done[0]
        op = ops[k] if k < len(ops) else None
        if op is None or op.kind != kind:
            raise ExecutionError(
                f"the single-process model draws random numbers ({kind}, shape {list(shape)}) where the traced "
                f"graph has {'no more random operators' if op is None else f'{op.kind} {op.name!r}'}"
            )
        done[0] += 1
        return Draw(seed, op.name, step, (0,) * len(shape), tuple(shape), tuple(shape))

    with RandomMode(place):
        yield
    if done[0] != len(ops):
        raise ExecutionError(
            f"the single-process model drew from {done[0]} random operators; the traced graph has {len(ops)}"
        )
