"""Sharded checkpoints: written under a TP=2 plan (weights split by columns and rows), loaded
under a PP=2 plan (layers split by stage), the next step's loss equals the single-process
run's; reassembly of boxes is checked on its own, as is refusing a checkpoint of another model."""

import json

import pytest
import torch

from planlab.errors import ConfigError, ExecutionError
from planlab.executor import launch_local, reference_run
from planlab.executor.checkpoint import MANIFEST, assemble, read_manifest
from planlab.search_spaces import Context, get_space

from conftest import traced

LR = 1e-2


def _plan(knobs, model="gpt-tiny"):
    spec, g = traced(model, 8)
    return get_space("megatron").build(Context(g, spec, 8, "cpu", 2, 2, 1), knobs)


TP = dict(dp=1, tp=2, pp=1, microbatch=8)
PP = dict(dp=1, tp=1, pp=2, microbatch=2)


def test_tp_checkpoint_loads_under_pp_and_gives_the_next_step_loss(tmp_path):
    tp, pp = _plan(TP), _plan(PP)
    ref = reference_run(tp.model, global_batch=8, steps=3, lr=LR)
    first = launch_local(tp, 2, steps=1, lr=LR, check=False, save_dir=tmp_path / "ckpt")
    assert first.losses[0] == pytest.approx(ref.losses[0], abs=1e-5)
    meta = json.loads((tmp_path / "ckpt" / MANIFEST).read_text())
    assert meta["world_size"] == 2 and meta["steps"] == 1 and meta["model"]["name"] == "gpt-tiny"
    shards = [torch.load(tmp_path / "ckpt" / f, weights_only=True)["params"] for f in meta["files"]]
    q = [s["blocks.0.attn.q.weight"]["box"] for s in shards]
    assert q[0] != q[1]  # TP: each rank wrote its own half
    assert all("exp_avg" in e and float(e["step"]) == 1 for s in shards for e in s.values())

    nxt = launch_local(pp, 2, steps=2, lr=LR, check=False, load_dir=tmp_path / "ckpt",
                       save_dir=tmp_path / "again")
    assert nxt.losses[0] == pytest.approx(ref.losses[1], abs=1e-5)  # same next-step loss
    assert nxt.losses[1] == pytest.approx(ref.losses[2], abs=1e-5)  # Adam's moments came along too
    assert read_manifest(tmp_path / "again")["steps"] == 3


def test_loading_needs_the_same_model_and_no_check(tmp_path):
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "planlab-checkpoint", "version": 1, "world_size": 1,
                                                 "model": {"name": "gpt-small", "args": {}}, "steps": 1,
                                                 "files": []}))
    with pytest.raises(ConfigError, match="is of model .*gpt-small.*; the plan is of model .*gpt-tiny"):
        launch_local(_plan(TP), 2, check=False, load_dir=tmp_path)
    with pytest.raises(ConfigError, match="pass check=False"):
        launch_local(_plan(TP), 2, load_dir=tmp_path)
    with pytest.raises(ConfigError, match="checkpoint.json is missing"):
        read_manifest(tmp_path / "nothing")


def test_assemble_reshards_boxes():
    full = torch.arange(24.0).reshape(4, 6)
    pieces = [{"box": [[0, 4], [0, 3]], "value": full[:, :3]},   # column halves, as TP saves them
              {"box": [[0, 4], [3, 6]], "value": full[:, 3:]},
              {"box": [[0, 4], [0, 6]], "value": full}]           # a replica overlaps both
    assert torch.equal(assemble(pieces, ((1, 3), (2, 5)), "w"), full[1:3, 2:5])
    assert torch.equal(assemble(pieces[:2], ((0, 4), (0, 6)), "w"), full)
    with pytest.raises(ExecutionError, match=r"parameter 'w', region \[\(0, 4\), \(0, 6\)\]: 12 of 24 elements"):
        assemble(pieces[:1], ((0, 4), (0, 6)), "w")
    assert assemble(pieces, ((0, 4), (0, 6)), "w", "exp_avg") is None
