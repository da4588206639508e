"""Checkpoint sizes and write/read times per rank, saved under one plan and loaded under another.

For a GPT of about 100M parameters and 2-device plans (ZeRO-1 and ZeRO-3 over 2 replicas,
TP 2, PP 2), builds each rank's interpreter in this process (no process group: nothing is
trained; Adam's moments are made up), writes each rank's checkpoint file as ``--save`` does,
and prints per rank the entries and bytes it wrote (each logical element is written once, by
the rank that owns it: a checkpoint holds 12 bytes per parameter, weights and Adam's two
moments, split over the ranks) and the time to write them; then loads every checkpoint under
every other plan and prints the time each rank takes to fill its pieces and ZeRO shards
(weights and Adam states) and the bytes it filled.

Run: .venv/bin/python benchmarks/checkpoint_reshard.py [--layers 4 --hidden 1024 --vocab 32768]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from planlab.executor.checkpoint import (
    check_checkpoint,
    commit,
    load_shards,
    param_specs,
    staging_dir,
    write_manifest,
    write_rank_file,
)
from planlab.executor.interpreter import Interpreter
from planlab.graph import trace
from planlab.models import ModelSpec, build_model
from planlab.plan import materialize
from planlab.search_spaces import Context, get_space

MIB = 2**20
PLANS = {
    "zero1": dict(dp=2, tp=1, pp=1, zero=1),
    "zero3": dict(dp=2, tp=1, pp=1, zero=3),
    "tp2": dict(dp=1, tp=2, pp=1),
    "pp2": dict(dp=1, tp=1, pp=2),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32768)
    a = ap.parse_args()
    torch.set_num_threads(1)
    spec = ModelSpec(
        "gpt", (("heads", a.heads), ("hidden", a.hidden), ("layers", a.layers), ("seq", a.seq), ("vocab", a.vocab))
    )
    module, inputs = build_model(spec, batch=4, device="cpu")
    graph = trace(*build_model(spec, batch=4))
    n_params = graph.num_params
    print(f"{spec}: {n_params / 1e6:.1f}M parameters; weights and Adam's moments {12 * n_params / MIB:.0f} MiB")
    programs = {}
    for name, knobs in PLANS.items():
        plan = get_space("megatron").build(
            Context(graph, spec, 4, "cpu", 2, 2, 1), dict(knobs, microbatch=4 // knobs["dp"] // knobs["pp"])
        )
        programs[name] = (plan, materialize(plan, graph))
    root = tempfile.mkdtemp(prefix="planlab-ckpt-bench-")
    print(f"\n{'saved under':12s} {'rank':>4s} {'entries':>8s} {'file':>10s} {'write':>9s}")
    for name, (plan, prog) in programs.items():
        stage = staging_dir(f"{root}/{name}")
        stage.mkdir(parents=True)
        files = {}
        for r in range(prog.num_devices):
            it = Interpreter(prog, graph, r, module, inputs, {})
            _made_up_adam(it)
            t0 = time.perf_counter()
            f, index = write_rank_file(it, stage, r)
            dt = time.perf_counter() - t0
            files[f] = index
            print(f"{name:12s} {r:4d} {len(index):8d} {os.path.getsize(stage / f) / MIB:6.0f} MiB {dt:7.2f} s")
            del it
        write_manifest(stage, files, model_json=plan.model.to_json(), steps=1, params=param_specs(graph))
        commit(stage, f"{root}/{name}")
        total = sum(os.path.getsize(f"{root}/{name}/{f}") for f in files)
        print(
            f"{name:12s} {'all':>4s} {'':8s} {total / MIB:6.0f} MiB  ({total / (12 * n_params):.3f} x 12 bytes "
            "per parameter)"
        )
    print(f"\n{'saved under':12s} {'loaded under':12s} {'rank':>4s} {'filled':>10s} {'read':>9s}")
    for saver in programs:
        t0 = time.perf_counter()
        check_checkpoint(f"{root}/{saver}", param_specs(graph), programs[saver][0].model.to_json())
        checked = time.perf_counter() - t0
        for loader, (plan, prog) in programs.items():
            if loader == saver:
                continue
            for r in range(prog.num_devices):
                shards = {p: torch.empty(tuple(b - a for a, b in box)) for p, box in prog.devices[r].params}
                it = Interpreter(prog, graph, r, module, inputs, {}, shards=shards)
                t0 = time.perf_counter()
                load_shards(it, f"{root}/{saver}", plan.model.to_json())
                dt = time.perf_counter() - t0
                print(f"{saver:12s} {loader:12s} {r:4d} {_filled(it) / MIB:6.0f} MiB {dt:7.2f} s")
                del it, shards
        print(f"{saver:12s} (checked before launch in {checked:.2f} s)")


def _made_up_adam(it: Interpreter) -> None:
    """Moments and a step for every piece and shard, as after a step."""
    zeroed = {p for z in it.zero.values() for p in z.params}
    for p, w in it.leaves:
        if p not in zeroed:
            it.optimizer.state[w] = {
                "step": torch.tensor(1.0),
                "exp_avg": torch.randn_like(w),
                "exp_avg_sq": torch.rand_like(w),
            }
    for z in it.zero.values():
        z.optimizer.state[z.shard] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.randn_like(z.shard),
            "exp_avg_sq": torch.rand_like(z.shard),
        }


def _filled(it: Interpreter) -> int:
    """Bytes a load fills on ``it``'s rank: its whole pieces' weights (and Adam's moments outside
    ZeRO buckets), its ZeRO shards' weights and moments."""
    zeroed = {p for z in it.zero.values() for p in z.params}
    whole = sum(w.numel() * w.element_size() * (1 if p in zeroed else 3) for p, w in it.leaves)
    return whole + sum(3 * z.shard.numel() * z.shard.element_size() for z in it.zero.values())


if __name__ == "__main__":
    main()
