"""Collectives over nodes priced by NCCL's protocols and latencies (planlab.costmodel.nccl)."""

from __future__ import annotations

import dataclasses

import pytest

from planlab.costmodel import nccl
from planlab.costmodel.comm import collective_time_s
from planlab.costmodel.hardware import load_cluster
from planlab.errors import ConfigError

MiB = 2**20
US = 1e-6


@pytest.mark.parametrize(
    "protocol, seconds",
    [
        # v2.8.3 tuning.cc: baseLat + (nsteps - nInterSteps) x hwLat[NVLINK] + nInterSteps x hwLat[NET];
        # an all_gather over 384 ranks on 48 nodes: 383 steps, 47 of them between nodes
        (nccl.Protocol.LL, (3.6 + 336 * 0.47 * 1.8 + 47 * 2.7) * US),
        (nccl.Protocol.LL128, (10.0 + 336 * 1.9 + 47 * 4.0) * US),
        (nccl.Protocol.SIMPLE, (8.4 + 336 * 3.4 + 47 * 9.6) * US),
    ],
)
def test_a_rings_latency_counts_nvlink_and_network_steps(protocol: nccl.Protocol, seconds: float) -> None:
    assert nccl.ring_latency_s(nccl.RING[protocol], 383, 47) == pytest.approx(seconds, rel=1e-12)


def test_a_trees_latency_is_the_chain_in_a_node_and_log2_of_the_nodes() -> None:
    # 2 x ((8 - 1) NVLink hops + log2i(48) = 5 network hops), LL: base 4.4, NVLink 0.52 x 1.8, network 5.0
    assert nccl.tree_latency_s(nccl.TREE[nccl.Protocol.LL], 8, 48) == pytest.approx(
        (4.4 + 2 * (7 * 0.52 * 1.8 + 5 * 5.0)) * US, rel=1e-12
    )


def test_a_ring_over_nodes_is_priced_at_its_fastest_protocol() -> None:
    c = load_cluster("dgx-a100-80g", 48)
    group = tuple(range(384))
    t = collective_time_s(c, "all_gather", 864 * MiB, group, algorithm="ring")
    plain = dataclasses.replace(c, node=dataclasses.replace(c.node, collective_library=""))
    bw_time = collective_time_s(plain, "all_gather", 864 * MiB, group, algorithm="ring") - 383 * c.node.inter_latency_s
    each = [nccl.ring_latency_s(cost, 383, 47) + bw_time / cost.bandwidth for cost in nccl.RING.values()]
    assert t == pytest.approx(min(each), rel=1e-9)
    # at this size the LL protocol's quarter bandwidth never wins
    assert min(each) < each[0]


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_nccl_runs_all_gather_and_reduce_scatter_as_rings_over_nodes(kind: str) -> None:
    """NCCL's tuner has no hierarchical all_gather (only all_reduce has trees): a cluster on NCCL
    prices the ring unless the hierarchical algorithm is asked for; without NCCL it may win."""
    c = load_cluster("dgx-a100-80g", 48)
    group = tuple(range(384))
    ring = collective_time_s(c, kind, 25 * MiB, group, algorithm="ring")
    hier = collective_time_s(c, kind, 25 * MiB, group, algorithm="hierarchical")
    assert hier < ring  # the hierarchy would be faster here
    assert collective_time_s(c, kind, 25 * MiB, group) == ring
    plain = dataclasses.replace(c, node=dataclasses.replace(c.node, collective_library=""))
    assert collective_time_s(plain, kind, 25 * MiB, group) < collective_time_s(plain, kind, 25 * MiB, group, "ring")


def test_within_a_node_the_fitted_latency_stands() -> None:
    c = load_cluster("dgx-a100-80g", 2)
    plain = dataclasses.replace(c, node=dataclasses.replace(c.node, collective_library=""))
    for kind in ("all_reduce", "all_gather"):
        assert collective_time_s(c, kind, 16 * MiB, tuple(range(8))) == collective_time_s(
            plain, kind, 16 * MiB, tuple(range(8))
        )


def test_a_tiny_all_reduce_over_32_nodes_costs_about_what_nccl_tests_measured() -> None:
    """NVIDIA/nccl issue 652: 8 B all_reduce over 32 nodes of 8 A100 with 4 HDR each, 63 us; NCCL's
    tree LL latency prices 4.4 + 2 x (7 x 0.94 + 5 x 5.0) = 67.5 us before the bytes (1.5 us per
    step and no base gave 32 us)."""
    c = load_cluster("hgx-a100-80g-4nic", 32)
    t = collective_time_s(c, "all_reduce", 8, tuple(range(256)))
    assert 63 * US < t < 1.5 * 63 * US


def test_an_unknown_collective_library_is_named(tmp_path) -> None:
    import json

    from planlab.costmodel.hardware import SPEC_DIR

    spec = json.loads((SPEC_DIR / "dgx-a100-80g.json").read_text())
    spec["collective_library"] = "mpi"
    path = tmp_path / "x.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="collective_library.*'mpi'.*nccl"):
        load_cluster(str(path))
