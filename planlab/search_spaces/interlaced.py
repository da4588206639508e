"""The ``interlaced`` space: nnScaler's interlaced pipeline (Lin et al., OSDI 2024).

With a large vocabulary the token embedding and the output layer (the LM head and the loss) hold
a large share of a GPT's weights and work, so a plain pipeline overloads its first and last
stages. The interlaced pipeline runs the transformer layers as a 1F1B pipeline of ``pp`` stages
(each with the usual data and tensor parallelism inside), and the vocabulary operators on stages
of their own that every device runs, split over all of them:

- stage ``0``, the embedding: the token lookup split along the vocabulary over every device
  (Megatron's vocabulary-parallel embedding: each device looks up the ids in its rows, the
  others give zeros; the pieces are summed on their way to the first layer stage), or
  (``embed_layout=vocab+batch``) summed by a reduce-scatter into what follows the lookup up to
  the first layer, split along the batch over every device, or (``embed_layout=batch+vocab``)
  each data-parallel replica's sequences looked up by that replica's pp x tp devices (a dp-th
  of the traffic of ``vocab``);
- stages ``1 .. pp``, the layers, as :class:`planlab.search_spaces.builtin.PipelineParallel`
  places them (plus whatever before the first layer or after the last is not a vocabulary operator);
- stage ``pp + 1``, the output: the LM head and the loss. With a vocabulary-parallel loss
  (``gpt`` with ``vocab_parallel=1``) they split along the vocabulary, over every device or
  (``head_layout=batch+vocab``) over each replica's pp x tp devices for its sequences; with a
  plain cross entropy they split along the batch over every device (each scores its share of
  the sequences against the whole vocabulary; a vocabulary-split head feeding a batch-split loss
  would need logits exchanged between every pair of devices). The head's weight gradients are
  all-reduced over the devices holding a piece, and sharded with ``zero``.

The schedule (:func:`planlab.search_spaces.schedules.interlaced_1f1b`) runs in cycles: each
rank one backward and one forward of its layers, then every device the shared stages of one
micro-batch, so that no rank waits for a slower one where every device meets.
The plan is written with the public Space API: a Product of :class:`Interlaced` (knobs ``pp``,
``embed_layout``, ``head_layout``) with the data-parallel, tensor-parallel and recompute spaces;
the Draft's ``spread`` places an operator on every device.
"""

from __future__ import annotations

from planlab.graph.ir import Graph
from planlab.models.configs import VOCAB_EMBEDDINGS
from planlab.search_spaces.builtin import (
    ALL_DEVICES,
    DataParallel,
    Recompute,
    TensorParallel,
    LAYER_MODULE,
    divisors,
    batch_dims,
    is_output_layer,
    pipeline_stages,
    vocab_parallel_size,
)
from planlab.search_spaces.registry import register_space
from planlab.search_spaces.space import Constraint, Context, Draft, Knob, Product, Space


class VocabOps:
    """The vocabulary operators of a graph and the dimension each splits over every device:
    ``lookup`` (the token embeddings: ``v``), ``embed`` (those and what follows them up to the
    first layer, along the batch), ``head`` (the output layer, what follows it up to the loss and
    what only feeds those from the model's inputs, such as the targets' reshape: along the batch)."""

    def __init__(
        self,
        lookup: dict[str, str | None],
        embed: dict[str, str | None],
        head: dict[str, str | None],
        along_vocab: bool = False,
    ) -> None:
        self.lookup, self.embed, self.head, self.along_vocab = lookup, embed, head, along_vocab

    def spread(self, embed_layout: str) -> dict[str, str | None]:
        """The operators on every device and their split, for ``embed_layout`` (EMBED_LAYOUTS)."""
        return {**(self.embed if embed_layout == "vocab+batch" else self.lookup), **self.head}


def vocab_ops(g: Graph, vocab: int | None) -> VocabOps | None:
    """The graph's vocabulary operators (cached per graph and vocabulary size), or None when it
    has no token embedding of ``vocab`` rows or no output layer of ``vocab`` features."""
    if not vocab:
        return None
    return g.memo(("vocab_ops", vocab), lambda: _find(g, vocab))


def _find(g: Graph, vocab: int) -> VocabOps | None:
    embed = {
        op.name: "v"
        for op in g.operators
        if op.kind in VOCAB_EMBEDDINGS and op.dim_sizes.get("v") == vocab and op.signature.splittable("v")
    }
    heads = [op for op in g.operators if is_output_layer(op, vocab)]
    if not embed or len(heads) != 1:
        return None
    lm = heads[0]
    batch = batch_dims(g)
    lookup = dict(embed)
    order = {op.name: i for i, op in enumerate(g.operators)}
    first_layer = min(
        (order[op.name] for op in g.operators if LAYER_MODULE.search(op.module)), default=len(g.operators)
    )
    for op in g.operators[:first_layer]:  # what follows the embedding up to the first layer, split along the batch
        if op.name not in embed and any(t in g.producer and g.producer[t].name in embed for t in op.inputs):
            embed[op.name] = batch[op.name]
    _feeders(g, embed, batch)
    # With a vocabulary-parallel loss the output layer, the logits and the loss split along the
    # vocabulary (what only feeds them, the targets, is whole on every device); else along the batch.
    along_vocab = vocab_parallel_size(g) == vocab
    label = g.dim_label(lm, "n")

    def split(op) -> str | None:
        if not along_vocab:
            return batch[op.name]
        d = g.dim_with_label(op, label)
        return d if d is not None and op.signature.splittable(d) else None

    head: dict[str, str | None] = {lm.name: "n" if along_vocab else batch[lm.name]}
    for op in g.operators[order[lm.name] + 1 :]:  # what follows the output layer
        if any(t in g.producer and g.producer[t].name in head for t in op.inputs):
            head[op.name] = split(op)
    _feeders(g, head, {name: (None if along_vocab else d) for name, d in batch.items()})
    if g.producer[g.loss].name not in head:
        return None
    return VocabOps(lookup, embed, head, along_vocab)


def _feeders(g: Graph, ops: dict[str, str | None], batch: dict[str, str | None]) -> None:
    """Add to ``ops`` what only feeds them from the model's inputs (the targets' reshape, the
    position embedding), split along the batch where it has one."""
    for op in reversed(g.operators):
        if op.name in ops:
            continue
        cons = [c.name for t in op.outputs for c in g.consumers.get(t, [])]
        if cons and all(c in ops for c in cons) and not any(t in g.producer for t in op.inputs):
            ops[op.name] = batch[op.name]


def _vocab(c: Context) -> int | None:
    return getattr(c.config, "vocab", None)


def _head_along_vocab(c: Context) -> bool:
    """Whether the output layer and the loss split along the vocabulary (a vocabulary-parallel loss)."""
    ops = vocab_ops(c.graph, _vocab(c))
    return ops is not None and ops.along_vocab


def _sequences_per_microbatch(a: dict, c: Context) -> int | None:
    dp, mbs = a.get("dp"), a.get("microbatch")
    return None if dp is None or mbs is None else dp * mbs


# How the embedding stage is laid out: ``vocab``, the token lookup alone on every device, its
# vocabulary pieces summed by point-to-point messages to the first layer stage's devices (every
# device sends its piece, and nothing blocks the embedding's forward); ``vocab+batch``, also what
# follows the lookup up to the first layer (the position embedding, the add, the dropout), split
# along the batch over every device, the pieces meeting in a reduce-scatter over every device
# (less traffic, but a collective that every device joins at each micro-batch's embedding);
# ``batch+vocab``, each data-parallel replica's sequences looked up by its own pp x tp devices,
# split along the vocabulary over them (a dp-th of the hidden states from each device).
EMBED_LAYOUTS = ("batch+vocab", "vocab", "vocab+batch")
# How the output stage is laid out with a vocabulary-parallel loss: ``vocab``, the output layer and
# the loss split along the vocabulary over every device (each receives the whole micro-batch's last
# hidden states); ``batch+vocab``, each data-parallel replica's sequences scored by its own pp x tp
# devices, split along the vocabulary over them (a dp-th of the hidden states to each device).
HEAD_LAYOUTS = ("batch+vocab", "vocab")
# batch+vocab comes first in both: the screen prices the shared stages on the nearest pipeline group
# whatever their layout, so plans that differ only in layout tie and are simulated in this order; the
# replica-local layouts move a dp-th of the others' hidden states, and their plans simulate fastest
# (their devices fall into few classes), which counts under a time budget.


class Interlaced(Space):
    """The layers in ``pp`` pipeline stages, the token embedding and the output layer split
    along the vocabulary over every device on stages of their own, run with the interlaced 1F1B."""

    name = "interlaced-pipeline"
    order = 0
    knobs = (
        Knob.int(
            "pp",
            lambda c: tuple(d for d in divisors(c.num_devices) if c.layers % d == 0 and d > 1),
            "pipeline-parallel degree of the layers (device groups)",
            range="divisors of the device count above 1 that divide the layers",
        ),
        Knob.choice(
            "embed_layout",
            EMBED_LAYOUTS,
            "the embedding stage: the lookup over every device (vocab), with "
            "what follows it up to the first layer split along the batch (vocab+batch), or each data-parallel "
            "replica's sequences over its own pp x tp devices (batch+vocab)",
            default="vocab",
            explore=EMBED_LAYOUTS,
        ),
        Knob.choice(
            "head_layout",
            HEAD_LAYOUTS,
            "with a vocabulary-parallel loss, the output stage: the vocabulary "
            "over every device (vocab) or each data-parallel replica's sequences over its own pp x tp "
            "devices (batch+vocab)",
            default="vocab",
            explore=HEAD_LAYOUTS,
        ),
    )
    constraints = (
        Constraint(
            lambda a, c: vocab_ops(c.graph, _vocab(c)) is not None,
            lambda a, c: (
                f"the model {c.model} has no token embedding and output layer of "
                f"{_vocab(c)} vocabulary entries for the interlaced pipeline to split"
            ),
        ),
        Constraint(
            lambda a, c: not _vocab(c) or _vocab(c) % c.num_devices == 0,
            lambda a, c: (
                f"the vocabulary of {_vocab(c)} entries does not split over the "
                f"{c.num_devices} devices (it must divide by the device count)"
            ),
        ),
        Constraint(
            lambda a, c: a["pp"] is None or a["pp"] > 1,
            lambda a, c: f"pp={a['pp']}: the interlaced pipeline is a pipeline, it needs pp > 1",
        ),
        Constraint.divides("pp", "the model's {n} layers", lambda c: c.layers),
        Constraint(
            lambda a, c: (
                _sequences_per_microbatch(a, c) is None
                or _head_along_vocab(c)
                or _sequences_per_microbatch(a, c) % c.num_devices == 0
            ),
            lambda a, c: (
                f"the {_sequences_per_microbatch(a, c)} sequences of a micro-batch (dp={a.get('dp')} x "
                f"microbatch={a.get('microbatch')}) do not split over the {c.num_devices} devices "
                f"for the output layer and the loss"
            ),
        ),
        Constraint(
            lambda a, c: a.get("head_layout") != "batch+vocab" or _head_along_vocab(c),
            lambda a, c: (
                "head_layout=batch+vocab splits the output layer along the vocabulary, which needs a "
                "vocabulary-parallel loss (gpt with vocab_parallel=1)"
            ),
        ),
        Constraint(
            lambda a, c: (
                a.get("embed_layout") != "vocab+batch"
                or _sequences_per_microbatch(a, c) is None
                or _sequences_per_microbatch(a, c) % c.num_devices == 0
            ),
            lambda a, c: (
                f"embed_layout=vocab+batch splits the embedding's {_sequences_per_microbatch(a, c)} "
                f"sequences per micro-batch (dp={a.get('dp')} x microbatch={a.get('microbatch')}) "
                f"over the {c.num_devices} devices: they must divide by it"
            ),
        ),
        ALL_DEVICES,
    )

    def apply(self, draft: Draft, values: dict) -> None:
        pp = values["pp"]
        g = draft.ctx.graph
        ops = vocab_ops(g, _vocab(draft.ctx))
        draft.num_stages, draft.chunks, draft.schedule, draft.stage_base = pp, 1, "interlaced", 1
        stages = {name: s + 1 for name, s in pipeline_stages(g, pp, draft.ctx.layers).items()}
        embed_layout = values.get("embed_layout") or "vocab"
        spread: dict = ops.spread(embed_layout)
        for name in spread:
            stages[name] = pp + 1 if name in ops.head else 0
        for op in reversed(g.operators):  # made from the inputs alone (T5's cat of the token ids): before its users
            if op.name not in spread and not any(t in g.producer for t in op.inputs):
                users = [stages[c.name] for t in op.outputs for c in g.consumers.get(t, [])]
                stages[op.name] = min([stages[op.name], *users])
        replica_ops = dict(ops.head) if values.get("head_layout") == "batch+vocab" else {}
        if embed_layout == "batch+vocab":
            replica_ops.update(ops.lookup)
        if replica_ops:
            # replica i's sequences on the pp x tp devices of data-parallel replica i (row-major devices
            # of a stage: dp, then tp), split along the vocabulary over them (the lookup: along "v")
            dp, tp, n = values.get("dp") or 1, values.get("tp") or 1, draft.ctx.num_devices
            per = n // dp
            batch = batch_dims(g)
            order = tuple(r * dp * tp + i * tp + t for i in range(dp) for r in range(pp) for t in range(tp))
            for name, dim in replica_ops.items():
                spread[name] = ((batch[name], dp), (dim, per))
            draft.spread_devices = {**draft.spread_devices, **{name: order for name in replica_ops}}
        draft.stages = stages
        draft.spread = spread


class InterlacedSpace(Product):
    """nnScaler's interlaced pipeline: :class:`Interlaced` x data (ZeRO) x tensor parallelism x
    recomputation (knobs ``pp``, ``dp``, ``microbatch``, ``zero``, ``tp``, ``sequence_parallel``,
    ``recompute``)."""

    def __init__(self) -> None:
        super().__init__((Interlaced(), DataParallel(), TensorParallel(), Recompute()), name="interlaced")


register_space("interlaced", InterlacedSpace)
