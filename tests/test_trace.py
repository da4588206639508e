import pytest
import torch
import torch.nn as nn

import planlab
from planlab.errors import GraphError
from planlab.graph import register_op, trace
from planlab.models import GPT_PRESETS, build_model

from conftest import traced


def _op(g, name):
    return g.op(name)


@pytest.mark.parametrize(
    "op, kind, sig",
    [
        ("wte", "embedding", "a0 a1, v+ h -> a0 a1 h"),
        ("blocks_0_ln1", "layer_norm", "a0 a1 h0^, h0^, h0^ -> a0 a1 h0^"),
        ("blocks_0_attn_q", "linear", "a0 a1 k+, n k+, n -> a0 a1 n"),
        ("unflatten", "reshape", "g0_0 g1_0 (g2_0 g2_1) -> g0_0 g1_0 g2_0 g2_1"),
        ("transpose", "transpose", "a0 a1 a2 a3 -> a0 a2 a1 a3"),
        ("scaled_dot_product_attention", "attention", "a0 a1 s^ d^, a0 a1 t^ d^, a0 a1 t^ e^ -> a0 a1 s^ e^"),
        ("blocks_0_mlp_act", "activation", "a0 a1 a2 -> a0 a1 a2"),
        ("blocks_0_attn_drop", "dropout", "a0 a1 a2 -> a0 a1 a2"),
        ("add", "add", "a0 a1 a2, a1 a2 -> a0 a1 a2"),
        ("cross_entropy", "cross_entropy", "n+ c^, n+ -> "),
    ],
)
def test_gpt_operator_signatures(tiny, op, kind, sig):
    _, g = tiny
    o = g.op(op)
    assert o.kind == kind
    assert str(o.signature) == sig


def test_graph_facts(tiny):
    spec, g = tiny
    assert g.loss == "cross_entropy" and g.tensors[g.loss].shape == ()
    assert g.num_params == spec.config().num_params()
    assert not g.unknown
    q = g.op("blocks_0_attn_q")
    assert q.flops == 2 * 8 * 32 * 64 * 64
    # the batch of the input is the batch of the loss's inputs, through reshapes
    ce = g.op("cross_entropy")
    assert g.dim_label(ce, "n") == g.batch_label
    assert g.tensors["blocks.0.attn.q.weight"].role == "param"


def test_operators_of_one_signature_share_one_signature_object(tiny):
    _, g = tiny
    by_value = {}
    for op in g.operators:
        assert by_value.setdefault(op.signature, op.signature) is op.signature
    assert len(by_value) < len(g.operators)


def test_a_traced_graph_is_frozen_and_caches_per_graph(tiny):
    """No pass can change a traced graph under the caches derived from it: each table refuses a
    change, and what passes derive lives in the graph's own cache (computed once per key)."""
    import dataclasses
    import pickle

    from planlab.errors import GraphError
    from planlab.models.trace_cache import for_planning

    _, g = tiny
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.loss = "x"
    for table in (g.tensors, g.labels, g.producer, g.consumers):
        with pytest.raises(GraphError, match="frozen"):
            table["x"] = None
    with pytest.raises(AttributeError):
        g.operators.append(g.operators[0])
    calls = []
    assert g.memo(("test", 1), lambda: calls.append(1) or len(calls)) == 1
    assert g.memo(("test", 1), lambda: calls.append(1) or len(calls)) == 1 and calls == [1]
    planning = for_planning(g)
    planning.memo(("test", 1), lambda: 1)
    again = pickle.loads(pickle.dumps(planning))  # the trace cache's entry: the tables, not the cache
    assert again.tensors == g.tensors and [o.name for o in again.operators] == [o.name for o in g.operators]
    assert again.memo(("test", 1), lambda: 2) == 2


@pytest.mark.parametrize(
    "preset, published",
    [
        ("gpt3-125m", 125e6),
        ("gpt3-1.3b", 1.3e9),
        ("gpt3-13b", 13e9),
        ("gpt3-175b", 175e9),
    ],
)
def test_preset_sizes(preset, published):
    # GPT-3 paper sizes (Brown et al. 2020, table 2.1) count a tied output layer; planlab's is untied
    # names are rounded to two significant figures, hence 2%
    assert abs(GPT_PRESETS[preset].num_params(tied=True) - published) / published < 0.02


def test_gpt3_175b_traces_on_meta():
    spec, g = traced("gpt3-175b", 8)
    assert abs(g.num_params - 175e9) / 175e9 < 0.01
    assert len(g.operators) > 2000


def test_unknown_operator_is_kept_whole_with_a_warning():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.logcumsumexp(self.lin(x), dim=1).sum()

    with pytest.warns(UserWarning, match="logcumsumexp"):
        g = trace(M(), (torch.zeros(2, 4),))
    op = next(o for o in g.operators if o.kind == "opaque" and "logcumsumexp" in o.name)
    assert op.splittable_dims() == []
    assert "logcumsumexp" in g.summary()


def my_scale(x, w):
    return x * w


register_op("b h, h -> b h")(my_scale)


def test_register_op_makes_a_leaf_with_its_signature():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return my_scale(x, self.w).sum()

    g = trace(M(), (torch.zeros(2, 4),))
    op = next(o for o in g.operators if o.kind == "my_scale")
    assert str(op.signature) == "b h, h -> b h"
    assert op.splittable_dims() == ["b", "h"]
    assert planlab.register_op is register_op


@pytest.mark.parametrize(
    "forward, message",
    [
        (lambda self, x: self.lin(x), "scalar training loss"),
    ],
)
def test_trace_errors(forward, message):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

    M.forward = forward
    with pytest.raises(GraphError, match=message):
        trace(M(), (torch.zeros(2, 4),))


def test_trace_wrong_number_of_inputs(tiny):
    spec, _ = tiny
    model, inputs = build_model(spec, batch=2)
    with pytest.raises(GraphError, match="takes 2 inputs"):
        trace(model, inputs[:1])


class _Products(nn.Module):
    """Products of activations by a constant table, by a number, by a parameter and by itself."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, 3))
        self.register_buffer("table", torch.full((4, 3), 2.0))

    def forward(self, x):
        a = x * self.w  # the input x only (w's gradient reads it; x has none)
        b = a * self.table  # the table only: no gradient flows to it
        c = b * 0.5  # a Python number: nothing kept
        d = c * c  # one tensor twice: kept
        e = d / self.table  # a / table: the table only
        return e.sum()


def _torch_keeps(fn) -> dict:
    """Which operands PyTorch's autograd itself saved for ``fn``'s product node."""
    node = fn.grad_fn
    return {k: getattr(node, k, None) is not None for k in ("_saved_self", "_saved_other")}


def test_products_keep_what_autograd_keeps():
    """A product keeps an operand only for the gradient of another operand (PyTorch's conditional
    saving): ``x * rope_cos`` keeps the table, not ``x`` (LLaMA's rotary embedding)."""
    m = _Products()
    x, act = torch.randn(4, 3), torch.randn(4, 3, requires_grad=True)
    # PyTorch's own choice, on real tensors
    assert _torch_keeps(x * m.w) == {"_saved_self": True, "_saved_other": False}
    assert _torch_keeps(act * m.table) == {"_saved_self": False, "_saved_other": True}
    assert _torch_keeps(act * m.w) == {"_saved_self": True, "_saved_other": True}
    g = trace(m, (torch.randn(4, 3),))
    muls = [op for op in g.operators if op.kind == "mul"]
    assert len(muls) == 5
    a, b, c, d, e = muls
    assert a.saves == ("x",)
    assert b.saves == ("table",)
    assert c.saves == ()
    assert d.saves == (d.inputs[0],)
    assert e.saves == ("table",)
