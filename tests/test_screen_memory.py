"""The screen's memory estimate where recomputation runs a layer's forward again before its
backward: that forward keeps, for the backward, what the layer would have saved."""

from planlab.costmodel import CostModel
from planlab.plan import precision_for
from planlab.search_spaces import Context, get_space
from planlab.search_spaces.screen import Screen, working_bytes

from conftest import traced

KNOBS = dict(dp=1, tp=1, pp=1, microbatch=8, zero=0, sequence_parallel=False, ep=1, etp=1, cp=1, cp_kind="a2a")


def _profile(layers: int, recompute: str):
    spec, g = traced("gpt-tiny", 8, (("layers", layers),))
    ctx = Context(g, spec, 8, "cpu", 1, 1, 1)
    sp = get_space("megatron")
    d = sp.draft(ctx, sp.with_defaults({**KNOBS, "recompute": recompute}))
    return Screen(g, CostModel.load("cpu", 1), precision_for("cpu")).structure(d).profiles[0]


def test_a_recomputed_layer_keeps_what_it_would_have_saved_for_its_backward():
    # one layer's saved activations without recomputation: what a second layer adds
    one_layer = sum(b for _, (b, _) in _profile(2, "none").saved) - sum(b for _, (b, _) in _profile(1, "none").saved)
    full = _profile(2, "full")
    assert one_layer > 0 and full.regrow == one_layer
    assert working_bytes(full) >= full.regrow  # the estimate holds it besides what is in flight
    assert _profile(2, "none").regrow == 0.0  # nothing recomputes, nothing is kept again
