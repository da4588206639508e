"""Buffers: the typed names of what a Program's tasks read and write.

A :class:`Buffer` says what it holds (its :class:`BufferKind`: an activation, a gradient, a weight,
a ZeRO shard, ...), of which tensor, and which variant: the layout ``version`` a conversion made,
the ``step`` of a conversion in several collectives, the co-located ``chunk``, the consumer whose
gradient contribution it is, the ZeRO ``group``. Modules ask a buffer what it is through its fields;
none parses names. Its ``str`` is the text form that traces and error messages show, e.g.
``a:blocks_0_fc#1`` (the second layout of that activation), ``gc:x<fc.0`` (``fc``'s contribution to
the gradient of its input 0, ``x``), ``zg:blocks.0[0, 1]`` (a ZeRO-3 unit's shard gradient on
devices 0 and 1), ``r:y@1`` (chunk 1 of ``y`` made again by recomputation).

A block's tasks are the same for every micro-batch, so a buffer names what each micro-batch holds;
the executor keys its tensors by ``(buffer, micro-batch)``. Buffers of a ``static`` kind (weights,
their gradients, ZeRO shards, source tensors) live for the whole iteration, one per device.
"""

from __future__ import annotations

from dataclasses import dataclass

from planlab.enums import StrEnum


class BufferKind(StrEnum):
    """What a buffer holds; the value is the short code of its text form."""

    SOURCE = "src"  # a model input or module buffer, the whole global batch (static)
    WEIGHT = "w"  # this device's piece of a parameter (static)
    WEIGHT_GRAD = "wg"  # the gradient of that piece, summed over micro-batches (static)
    ACTIVATION = "a"  # a tensor of the forward, in its producer's layout or (version >= 0) converted
    GRAD = "g"  # the gradient of a tensor, in its producer's layout
    CONTRIBUTION = "gc"  # one consumer's contribution to a tensor's gradient, in the consumer's layout
    GRAD_SUM = "gs"  # contributions of one layout summed on the producer's devices before a conversion
    RECOMPUTED = "r"  # an activation made again by recomputation before the backward
    REMADE = "o"  # coshard: a chunk made inside a co-located group by the layer's recomputation
    SHARD_GRAD = "zg"  # ZeRO: this device's shard of a bucket's or unit's gradients (static)
    SHARD_WEIGHT = "zp"  # ZeRO: this device's shard of the same weights (static)
    GATHERED_FORWARD = "zf"  # ZeRO-3: a weight gathered whole for the forward
    GATHERED_BACKWARD = "zb"  # ZeRO-3: the same weight gathered again for the backward
    GATHERED_RECOMPUTE = "zr"  # ZeRO-3: gathered once more for a recomputed forward (DeepSpeed's regather)
    FULL_GRAD = "zd"  # ZeRO-3: a weight's whole gradient, before it is reduce-scattered into the shard
    HOST_GRAD = "hg"  # offload: the host copy of a weight's or a ZeRO shard's gradient (static, host memory)
    HOST_WEIGHT = "hw"  # offload: the host's fp32 master of a weight or a ZeRO shard, stepped there (static, host)
    HOST_ACTIVATION = "ha"  # activation offload: a saved activation's host copy (per micro-batch, host memory)
    FETCHED = "f"  # activation offload: a saved activation brought back from host memory before its backward
    INTERNAL = "k"  # what an operator's implementation keeps for its backward besides graph tensors (plan/saved.py)


STATIC_KINDS = frozenset(
    {
        BufferKind.SOURCE,
        BufferKind.WEIGHT,
        BufferKind.WEIGHT_GRAD,
        BufferKind.SHARD_GRAD,
        BufferKind.SHARD_WEIGHT,
        BufferKind.HOST_GRAD,
        BufferKind.HOST_WEIGHT,
    }
)
# Buffers in host memory (a pool apart from the device's; DeviceProgram.host_bytes counts them)
HOST_KINDS = frozenset({BufferKind.HOST_GRAD, BufferKind.HOST_WEIGHT})
# Buffers of weights' gradients (the W part of zero-bubble's split backward writes these)
WEIGHT_GRAD_KINDS = frozenset({BufferKind.WEIGHT_GRAD, BufferKind.FULL_GRAD})
GATHERED_KINDS = frozenset({BufferKind.GATHERED_FORWARD, BufferKind.GATHERED_BACKWARD, BufferKind.GATHERED_RECOMPUTE})


@dataclass(frozen=True, init=False)
class Buffer:
    """One buffer of a device's program (see the module docstring).

    ``tensor`` is the graph tensor, the parameter, the ZeRO-3 unit it belongs to, or (``INTERNAL``)
    the operator and what it keeps (``attn:probs``); ``version``
    (>= 0) the layout a conversion, a load or a local sum made of it, or, for a ZeRO-3 gathered
    weight, the stage that gathered it when that is not its unit's own (a recycling pass reading the
    last pass's weights, :func:`planlab.plan.zero.gathered`); ``step`` (>= 1) an
    intermediate result of a conversion in several collectives; ``chunk`` (>= 0) a co-located
    piece's chunk; ``consumer`` and ``input`` the operator and input index whose gradient
    contribution it is; ``group`` the devices a ZeRO shard is cut over.
    """

    kind: BufferKind
    tensor: str = ""
    version: int = -1
    step: int = 0
    chunk: int = -1
    consumer: str = ""
    input: int = -1
    group: tuple[int, ...] = ()

    def __init__(
        self,
        kind: BufferKind,
        tensor: str = "",
        version: int = -1,
        step: int = 0,
        chunk: int = -1,
        consumer: str = "",
        input: int = -1,
        group: tuple[int, ...] = (),
    ) -> None:
        # Written at once (a frozen dataclass's own __init__ sets fields one by one): buffers are made
        # for every operator and key every table of liveness, the simulator and the executor, so
        # their hash is kept too.
        self.__dict__.update(
            kind=kind,
            tensor=tensor,
            version=version,
            step=step,
            chunk=chunk,
            consumer=consumer,
            input=input,
            group=group,
            _hash=hash((kind, tensor, version, step, chunk, consumer, input, group)),
            static=kind in STATIC_KINDS,
        )

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, Buffer)
            and self._hash == other._hash
            and self.kind is other.kind
            and self.tensor == other.tensor
            and self.version == other.version
            and self.step == other.step
            and self.chunk == other.chunk
            and self.consumer == other.consumer
            and self.input == other.input
            and self.group == other.group
        )

    def __reduce__(self):  # rebuilt from its fields: the cached hash is per process
        return Buffer, self.fields()

    def fields(self) -> tuple:
        """The buffer's fields, in order."""
        return (self.kind, self.tensor, self.version, self.step, self.chunk, self.consumer, self.input, self.group)

    def __str__(self) -> str:
        text = f"{self.kind.value}:{self.tensor}"
        if self.consumer:
            text += f"<{self.consumer}.{self.input}"
        if self.version >= 0:
            text += f"#{self.version}"
        if self.step:
            text += f"~{self.step}"
        if self.group:
            text += str(list(self.group))
        if self.chunk >= 0:
            text += f"@{self.chunk}"
        return text

    def __repr__(self) -> str:
        return f"Buffer({self})"

    # -- the variants passes make of a buffer -------------------------------------------------
    def with_kind(self, kind: BufferKind) -> Buffer:
        """The same tensor and variant as another kind (an activation remade: ``RECOMPUTED``)."""
        return Buffer(kind, *self.fields()[1:])

    def at_step(self, step: int) -> Buffer:
        """Intermediate result ``step`` of the conversion that makes this buffer."""
        f = self.fields()
        return Buffer(*f[:3], step, *f[4:])

    def at_chunk(self, chunk: int) -> Buffer:
        """Chunk ``chunk`` of this buffer (co-located pieces run one chunk at a time)."""
        f = self.fields()
        return Buffer(*f[:4], chunk, *f[5:])


# -- the buffers passes name --------------------------------------------------------------------
def weight(param: str) -> Buffer:
    """A device's piece of parameter ``param``."""
    return Buffer(BufferKind.WEIGHT, param)


def weight_grad(param: str) -> Buffer:
    """The gradient of a device's piece of ``param``."""
    return Buffer(BufferKind.WEIGHT_GRAD, param)


def source(tensor: str) -> Buffer:
    """A model input or module buffer, whole."""
    return Buffer(BufferKind.SOURCE, tensor)


def activation(tensor: str, version: int = -1) -> Buffer:
    """``tensor`` as its producer made it, or its layout ``version`` made by a conversion or load."""
    return Buffer(BufferKind.ACTIVATION, tensor, version)


def grad(tensor: str) -> Buffer:
    """The gradient of ``tensor`` in its producer's layout."""
    return Buffer(BufferKind.GRAD, tensor)


def contribution(tensor: str, consumer: str, index: int) -> Buffer:
    """``consumer``'s contribution to the gradient of its input ``index`` (``tensor``)."""
    return Buffer(BufferKind.CONTRIBUTION, tensor, consumer=consumer, input=index)


def grad_sum(tensor: str, version: int) -> Buffer:
    """Contributions to ``tensor``'s gradient of one layout summed locally (the ``version``-th such sum)."""
    return Buffer(BufferKind.GRAD_SUM, tensor, version)


def internal(op: str, tag: str) -> Buffer:
    """What operator ``op``'s implementation keeps for its backward under ``tag`` (a dropout's mask)."""
    return Buffer(BufferKind.INTERNAL, f"{op}:{tag}")


def shard_grad(group: tuple[int, ...], unit: str = "") -> Buffer:
    """ZeRO: the shard gradient of a bucket (ZeRO-1/2) or of ``unit`` (ZeRO-3) cut over ``group``."""
    return Buffer(BufferKind.SHARD_GRAD, unit, group=tuple(group))


def shard_weight(group: tuple[int, ...], unit: str = "") -> Buffer:
    """ZeRO: the shard of the weights of a bucket (ZeRO-1/2) or of ``unit`` (ZeRO-3) cut over ``group``."""
    return Buffer(BufferKind.SHARD_WEIGHT, unit, group=tuple(group))
