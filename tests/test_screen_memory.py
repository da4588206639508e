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


def _zero_estimate(zero: int, sp: bool):
    """The screen's estimate of LLaMA-2 7B's two layers on one DGX A100, dp 2 x tp 4, with ``zero``
    and sequence parallelism ``sp``."""
    spec, g = traced("llama2-7b", 8, (("layers", 2),))
    ctx = Context(g, spec, 8, "dgx-a100-80g", 1, 8, 8)
    space = get_space("megatron")
    cost = CostModel.load("dgx-a100-80g", 1, software="megatron")
    knobs = space.with_defaults({**KNOBS, "dp": 2, "tp": 4, "microbatch": 1, "zero": zero, "sequence_parallel": sp})
    return Screen(g, cost, cost.precision).estimate(space.draft(ctx, knobs))


def test_zero_shards_a_sequence_parallel_norm_over_its_data_parallel_ranks_only():
    """Under sequence parallelism a norm's weight gradient is summed over tp (each rank holds a part of
    the sequence), but ZeRO shards the weight over dp only, as materialize does
    (``gradients.zero_groups``): its states take the same bytes as without sequence parallelism,
    and the tp all-reduce before the reduce-scatter costs time."""
    for zero in (1, 2, 3):
        with_sp, without = _zero_estimate(zero, True), _zero_estimate(zero, False)
        assert with_sp.static_bytes == without.static_bytes, zero
    assert _zero_estimate(2, True).grad_sync_s > _zero_estimate(2, False).grad_sync_s
