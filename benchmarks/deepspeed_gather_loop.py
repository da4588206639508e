"""The host's time per rank of DeepSpeed 2021's per-rank Python before a ZeRO-3 all-gather.

DeepSpeed v0.3.13 to v0.5.x gather a parameter in ``_allgather_param``
(``runtime/zero/partition_parameters.py``): after ``torch.cuda.synchronize()`` the host makes one
narrow view of the flat buffer per rank of the data-parallel group and compares the loop index with
``torch.distributed.get_rank(group=...)`` at each rank, and only then calls
``torch.distributed.all_gather``. The device idles meanwhile, so on 384 to 2,240 ranks this
loop is part of every gather's cost: ``zero3.gather_rank_us`` of the ``deepspeed-2021`` software.

Neither a narrow view nor ``get_rank`` launches a kernel, so this machine's CPU measures them: the
same loop over a CPU tensor in a one-rank gloo group, its process time (one torch thread) per rank,
the lower quartile of the repetitions (which other processes sharing the machine change little).
The figure is torch's of this install on this CPU, not PyTorch 1.8's on a DGX A100's EPYC 7742.

    .venv/bin/python benchmarks/deepspeed_gather_loop.py [--ranks 1536] [--reps 30]
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def per_rank_us(ranks: int, reps: int) -> list[float]:
    """Process-time microseconds per rank of the loop, one figure per repetition."""
    group = dist.new_group([0])
    part = 256
    flat = torch.zeros(part * ranks)
    out = []
    for _ in range(reps):
        start = time.process_time()
        partitions = []
        for i in range(ranks):  # as _allgather_param: a view per rank, get_rank compared at each
            partitions.append(flat.narrow(0, part * i, part))
            if i == dist.get_rank(group=group):
                pass
        out.append((time.process_time() - start) / ranks * 1e6)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1536, help="ranks of the group the loop walks")
    parser.add_argument("--reps", type=int, default=30, help="repetitions")
    args = parser.parse_args()
    if args.ranks < 1 or args.reps < 1:
        parser.error(f"--ranks and --reps must be at least 1, got {args.ranks} and {args.reps}")
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        times = sorted(per_rank_us(args.ranks, args.reps))
    finally:
        dist.destroy_process_group()
    q1 = statistics.quantiles(times, n=4)[0] if len(times) > 1 else times[0]
    print(f"torch {torch.__version__}, {args.ranks} ranks, {args.reps} repetitions")
    print(f"narrow view + get_rank per rank: lower quartile {q1:.2f} us, median {statistics.median(times):.2f} us")


if __name__ == "__main__":
    main()
