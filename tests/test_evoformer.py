"""The AlphaFold2 Evoformer family: parameter counts derived from the supplement, the largest
preset traced on meta tensors, einsum signatures read from their equations, every operator piece
against the whole, the model registry and the tp constraint, and data- and tensor-parallel plans
on 2 gloo ranks against one process."""

import time
import warnings

import pytest
import torch
import torch.nn as nn

from planlab.cli import GRAD_TOL, LOSS_TOL
from planlab.errors import ConfigError
from planlab.executor import launch_local
from planlab.graph import trace
from planlab.graph.ir import TensorArg
from planlab.graph.registry import OpContext, lookup
from planlab.models import EVOFORMER_PRESETS, ModelSpec, build_model
from planlab.search_spaces import Context, get_space
from planlab.search_spaces.builtin import tensor_parallel_dims

from conftest import traced
from test_llama import _check_pieces

# ---- parameter counts -------------------------------------------------------------

# AlphaFold2's Evoformer parameters derived by hand from the layer sizes of the supplementary
# information (Jumper et al. 2021): c_m = 256, c_z = 128; MSA attentions 8 heads x 32 channels,
# triangle attentions 4 heads x 32, outer product mean 32 channels, triangle multiplication 128,
# transitions x4. A LayerNorm over c has 2c parameters, a Linear i*o (+ o with bias); queries, keys,
# values and the pair biases are LinearNoBias, the gates and output projections have biases.
# No published count of the Evoformer stack alone was found (the ~93M quoted for AlphaFold2 includes
# templates, the extra-MSA stack and the structure module), so the test derives it here.
AF2_BLOCK = {
    # Alg. 7: LN(m), LN(z), pair bias c_z->8, q/k/v 256->8*32, gate 256->256 (+b), out 256->256 (+b)
    "msa_att_row": 2 * 256 + 2 * 128 + 128 * 8 + 3 * 256 * 256 + (256 * 256 + 256) + (256 * 256 + 256),
    # Alg. 8: LN(m), q/k/v, gate, out
    "msa_att_col": 2 * 256 + 3 * 256 * 256 + (256 * 256 + 256) + (256 * 256 + 256),
    # Alg. 9: LN, 256->1024 (+b), 1024->256 (+b)
    "msa_transition": 2 * 256 + (256 * 1024 + 1024) + (1024 * 256 + 256),
    # Alg. 10: LN, a and b 256->32 (+b), flattened 32*32 -> 128 (+b)
    "outer_product_mean": 2 * 256 + 2 * (256 * 32 + 32) + (32 * 32 * 128 + 128),
    # Alg. 11 and 12: LN(z), a/b projections and gates 128->128 (+b) x4, gate 128->128 (+b),
    # LN over 128, out 128->128 (+b)
    "tri_mul_out": 2 * 128 + 4 * (128 * 128 + 128) + (128 * 128 + 128) + 2 * 128 + (128 * 128 + 128),
    "tri_mul_in": 2 * 128 + 4 * (128 * 128 + 128) + (128 * 128 + 128) + 2 * 128 + (128 * 128 + 128),
    # Alg. 13 and 14: LN(z), pair bias 128->4, q/k/v 128->4*32, gate (+b), out (+b)
    "tri_att_start": 2 * 128 + 128 * 4 + 3 * 128 * 128 + (128 * 128 + 128) + (128 * 128 + 128),
    "tri_att_end": 2 * 128 + 128 * 4 + 3 * 128 * 128 + (128 * 128 + 128) + (128 * 128 + 128),
    # Alg. 15: LN, 128->512 (+b), 512->128 (+b)
    "pair_transition": 2 * 128 + (128 * 512 + 512) + (512 * 128 + 128),
}
# Alg. 3 (target_feat 22, msa_feat 49, relative positions 65 bins), Alg. 32 (two LNs), 1.9.8 (64 bins)
AF2_EMBED = 2 * (22 * 128 + 128) + (22 * 256 + 256) + (49 * 256 + 256) + (65 * 128 + 128)
AF2_RECYCLE = 2 * 256 + 2 * 128
AF2_HEAD = 128 * 64 + 64


def test_alphafold2_parameter_count_derived_by_hand():
    assert sum(AF2_BLOCK.values()) == 1_829_952
    total = AF2_EMBED + AF2_RECYCLE + 48 * sum(AF2_BLOCK.values()) + AF2_HEAD
    assert total == 87_879_744
    for preset in ("alphafold2", "alphafold2-finetune"):
        cfg = EVOFORMER_PRESETS[preset]
        assert cfg.block_params() == sum(AF2_BLOCK.values())
        assert cfg.num_params() == total


@pytest.mark.parametrize("preset", sorted(EVOFORMER_PRESETS))
def test_module_parameter_count_is_the_config_count(preset):
    model, _ = build_model(ModelSpec(preset), batch=1)  # meta: no memory for the weights
    assert sum(p.numel() for p in model.parameters()) == EVOFORMER_PRESETS[preset].num_params()


def test_per_module_counts_match_the_derivation():
    model, _ = build_model(ModelSpec("alphafold2", (("blocks", 1),)), batch=1)
    block = model.blocks[0]
    assert {name: sum(p.numel() for p in getattr(block, name).parameters()) for name in AF2_BLOCK} == AF2_BLOCK


def test_alphafold2_finetune_traces_on_meta():
    """The largest preset (N_seq 512, N_res 384) traces whole; the time is printed (about 25-35 s
    on this 2-core machine under load, where GPT-3 175B takes 10 s: the Evoformer has 3.4x
    its operators)."""
    model, inputs = build_model(ModelSpec("alphafold2-finetune"), batch=1)
    t0 = time.perf_counter()
    g = trace(model, inputs)
    print(f"alphafold2-finetune: {len(g.operators)} operators traced in {time.perf_counter() - t0:.1f} s")
    assert not g.unknown
    assert g.num_params == 87_879_744
    kinds = [op.kind for op in g.operators]
    # per block: 2 per gated attention x 4, the outer product, 2 triangle products; then the
    # outer-product normalizer and the loss's 3
    assert kinds.count("einsum") == 48 * 11 + 1 + 3
    assert kinds.count("softmax") == 48 * 4
    assert g.tensors[g.op("blocks_47_tri_att_end_mha_linear_o").outputs[0]].shape == (1, 384, 384, 128)


def test_every_operator_splits_along_the_batch():
    """Nothing is kept whole: every operator splits along the batch, and the only whole
    dimensions are the normalized axis of layer norms, the inner dimension of a reshape group
    (channels inside heads), the softmax axis and the distogram bins."""
    _, g = traced("evoformer-tiny", 4)
    assert not g.unknown
    for op in g.operators:
        d = g.dim_with_label(op, g.batch_label)
        assert d is not None and op.signature.splittable(d), str(op)
    whole = {(op.kind, d) for op in g.operators for d in op.signature.dims() if not op.signature.splittable(d)}
    assert {k for k, _ in whole} == {"layer_norm", "reshape", "softmax", "cross_entropy"}


# ---- einsum signatures ------------------------------------------------------------


def _einsum_sig(eq: str, *shapes, slots=None) -> tuple[str, float]:
    """Signature and FLOPs the registry reads from one einsum call on tensors of ``shapes``."""
    slots = slots or tuple(range(len(shapes)))
    ts = [torch.zeros(s) for s in shapes]
    out = torch.einsum(eq, *[ts[i] for i in slots])
    ctx = OpContext(tuple(shapes), (tuple(out.shape),), (eq, *[TensorArg(i) for i in slots]), {})
    d = lookup("call_function", torch.einsum)
    assert d is not None and d.kind == "einsum"
    return str(d.signature(ctx)), d.flops(ctx)


@pytest.mark.parametrize(
    "eq, shapes, sig, flops",
    [
        # kept letters are plain dimensions, summed ones reductions; FLOPs 2 x every letter's size
        ("mk,kn->mn", [(2, 3), (3, 4)], "m k+, k+ n -> m n", 2 * 2 * 3 * 4),
        (
            "baqhc,bakhc->bahqk",
            [(1, 2, 3, 4, 5), (1, 2, 6, 4, 5)],
            "b a q h c+, b a k h c+ -> b a h q k",
            2 * 1 * 2 * 3 * 4 * 5 * 6,
        ),
        ("bsic,bsjd->bijcd", [(1, 3, 4, 2), (1, 3, 5, 6)], "b s+ i c, b s+ j d -> b i j c d", 2 * 3 * 4 * 2 * 5 * 6),
        ("b i k, b j k -> b i j", [(2, 3, 4), (2, 5, 4)], "b i k+, b j k+ -> b i j", 2 * 2 * 3 * 4 * 5),
        # broadcasting: a size-1 letter is a literal 1 axis
        ("bik,bjk->bij", [(2, 3, 4), (1, 5, 4)], "b i k+, 1 j k+ -> b i j", 2 * 2 * 3 * 4 * 5),
        # an ellipsis names its axes e0, e1, ... aligned right, like broadcasting
        ("...ij,jk->...ik", [(5, 2, 3, 4), (4, 6)], "e0 e1 i j+, j+ k -> e0 e1 i k", 2 * 5 * 2 * 3 * 4 * 6),
        ("...ij,...jk", [(5, 1, 3, 4), (2, 4, 6)], "e0 1 i j+, e1 j+ k -> e0 e1 i k", 2 * 5 * 2 * 3 * 4 * 6),
        # implicit output: letters seen once, in ASCII order (upper case first)
        ("ba,bc", [(2, 3), (2, 4)], "b+ a, b+ c -> a c", 2 * 2 * 3 * 4),
        ("Ab,ab", [(2, 3), (5, 3)], "A b+, a b+ -> A a", 2 * 2 * 3 * 5),
        # one operand: a permutation (no FLOPs) or a sum
        ("ij->ji", [(5, 3)], "i j -> j i", 0),
        ("bij->b", [(2, 3, 4)], "b i+ j+ -> b", 2 * 3 * 4),
        ("b->", [(7,)], "b+ -> ", 7),
        # three operands contract left to right: (ab, bc) then (ac, cd)
        ("ab,bc,cd->ad", [(2, 3), (3, 4), (4, 5)], "a b+, b+ c+, c+ d -> a d", 2 * 2 * 3 * 4 + 2 * 2 * 4 * 5),
        # a diagonal puts one dimension on two axes: kept whole
        ("bii->bi", [(2, 3, 3)], "b i^ i^ -> b i^", 0),
    ],
)
def test_einsum_signatures(eq, shapes, sig, flops):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _einsum_sig(eq, *shapes) == (sig, flops)


def test_einsum_reading_one_tensor_twice():
    # the same subscripts: one input tensor with one naming
    assert _einsum_sig("ij,ij->i", (3, 4), slots=(0, 0))[0] == "i j+ -> i"
    # different subscripts cannot be one signature over distinct inputs: kept whole, with the reason
    with pytest.warns(UserWarning, match="reads one tensor twice with different subscripts; the operator is kept"):
        sig, _ = _einsum_sig("ij,jk->ik", (3, 3), slots=(0, 0))
    assert sig == "i0_0^ i0_1^ -> o0_0^ o0_1^"


def test_einsum_sublist_form_is_kept_whole():
    x = torch.zeros(3, 3)
    out = torch.einsum(x, [0, 1], x, [1, 0], [0])
    ctx = OpContext(((3, 3),), (tuple(out.shape),), (TensorArg(0), [0, 1], TensorArg(0), [1, 0], [0]), {})
    with pytest.warns(UserWarning, match="sublist form"):
        assert str(lookup("call_function", torch.einsum).signature(ctx)) == "i0_0^ i0_1^ -> o0_0^"


class _Einsums(nn.Module):
    """Einsums of every kind the signature reads, in a model that ends in a scalar loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # (B, T, 6)
        a = torch.einsum("btc,bsc->bts", h, y)  # (B, T, T)
        g = torch.einsum("btc,btd->bcd", h, y)  # (B, 6, 6)
        chain = torch.einsum("bts,bsc,bcd->btd", a, y, g)  # (B, T, 6)
        ell = torch.einsum("...c,...c->...", chain, h)  # (B, T)
        first = h[:, :1]  # (B, 1, 6)
        bcast = torch.einsum("bqc,bkc->bqk", first, y)  # (B, 1, T)
        diag = torch.einsum("bii->bi", a)  # (B, T)
        implicit = torch.einsum("btc,bsc", h, y)  # (S, T): b and c summed
        return (
            torch.einsum("bt,bt->", ell, diag)
            + torch.einsum("bqk->", bcast)
            + torch.einsum("st->", implicit)
            + torch.einsum("bt->", torch.sigmoid(ell))
        )


def test_einsum_pieces_match_the_whole():
    g = trace(_Einsums(), (torch.zeros(2, 4, 6), torch.zeros(2, 4, 6)))
    assert not g.unknown
    assert sum(op.kind == "einsum" for op in g.operators) == 11
    assert _check_pieces(g) > 30


def test_evoformer_operator_pieces_match_the_whole():
    _, g = traced("evoformer-tiny", 4, (("blocks", 1),))
    assert {"einsum", "softmax", "activation", "cross_entropy", "getitem"} <= {op.kind for op in g.operators}
    assert _check_pieces(g) > 400


# ---- registry and the tp constraint ---------------------------------------------------

FAMILY_ARGS = (("blocks", 1), ("c_m", 8), ("c_z", 4), ("heads_msa", 2), ("heads_pair", 1), ("n_res", 5), ("n_seq", 3))


def test_family_with_overrides_builds_and_runs():
    spec = ModelSpec("evoformer", FAMILY_ARGS)
    cfg = spec.config()
    assert (cfg.layers, cfg.heads, cfg.c_att_msa) == (1, 1, 32)
    model, inputs = build_model(spec, batch=3, device="cpu")
    assert [tuple(t.shape) for t in inputs] == [
        (3, 3, 5, 49),
        (3, 5, 22),
        (3, 5, 5, 65),
        (3, 3, 5),
        (3, 5, 5),
        (3, 5, 8),
        (3, 5, 5, 4),
        (3, 5, 5),
    ]
    loss = model(*inputs)
    assert loss.shape == () and torch.isfinite(loss)
    assert ModelSpec("alphafold2", (("n_res", 64),)).config().n_res == 64


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("evoformer", (("blocks", 2),), "model family 'evoformer' needs --model-arg for c_m, c_z, heads_msa"),
        ("alphafold2", (("hidden", 2),), "unknown model argument 'hidden' for 'alphafold2'; choose 'blocks'"),
        ("evoformer-tiny", (("heads_msa", 0),), "heads_msa=0 must be a positive integer"),
        ("evoformer-tiny", (("n_res", 2.5),), "n_res=2.5 must be a positive integer"),
        ("evoformer-tiny", (("relpos_bins", 64),), "relpos_bins=64 must be odd"),
    ],
)
def test_bad_model_arguments(name, args, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        ModelSpec(name, args).config()


@pytest.mark.parametrize(
    "heads_msa, heads_pair, message",
    [
        (2, 2, ""),
        (4, 2, ""),
        (2, 1, "tp=2 does not divide the model's 1 attention heads"),
        (3, 2, "tp=2 does not divide the model's 1 attention heads"),
    ],
)
def test_tp_must_divide_both_head_counts(heads_msa, heads_pair, message):
    spec, g = traced("evoformer-tiny", 4, (("heads_msa", heads_msa), ("heads_pair", heads_pair)))
    ctx = Context(g, spec, 4, "cpu", 2, 2, 1)
    assert get_space("tp").explain(ctx, {"tp": 2}) == message


def test_tensor_parallel_splits_attention_heads_and_transitions():
    """Megatron-style: q/k/v/gate and pair-bias projections split their outputs (heads), output
    projections their inputs; transitions likewise; the attention core splits heads; the outer
    product mean and triangle multiplications stay replicated."""
    _, g = traced("evoformer-tiny", 4)
    dims = tensor_parallel_dims(g)
    by_module = {(op.module, op.kind): dims[op.name] for op in g.operators}
    p = "blocks.1."
    for att in ("msa_att_row", "msa_att_col", "tri_att_start", "tri_att_end"):
        for lin in "qkvg":
            assert by_module[(f"{p}{att}.mha.linear_{lin}", "linear")] == "n"
        assert by_module[(f"{p}{att}.mha.linear_o", "linear")] == "k"
    for att in ("msa_att_row", "tri_att_start", "tri_att_end"):
        assert by_module[(f"{p}{att}.linear_bias", "linear")] == "n"
    for t in ("msa_transition", "pair_transition"):
        assert (by_module[(f"{p}{t}.linear_1", "linear")], by_module[(f"{p}{t}.linear_2", "linear")]) == ("n", "k")
    heads = [dims[op.name] for op in g.operators if op.kind in ("einsum", "softmax") and op.module.endswith(".mha")]
    assert len(heads) == 2 * 12 and all(heads)
    for m in ("outer_product_mean.linear_out", "tri_mul_out.linear_a_p", "tri_mul_in.linear_z"):
        assert by_module[(p + m, "linear")] is None


# ---- plans on 2 gloo ranks match one process --------------------------------------


@pytest.mark.parametrize(
    "knobs",
    [
        dict(dp=2, tp=1, pp=1, microbatch=1),  # data parallel, 2 micro-batches per replica
        dict(dp=1, tp=2, pp=1, microbatch=4),  # tensor parallel: attention heads and transitions split
    ],
)
def test_evoformer_tiny_plans_match_one_process(knobs):
    spec, g = traced("evoformer-tiny", 4)
    plan = get_space("megatron").build(Context(g, spec, 4, "cpu", 2, 2, 1), knobs)
    res = launch_local(plan, 2, steps=2, lr=1e-2, timeout_s=120)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert res.losses[1] < res.losses[0]
