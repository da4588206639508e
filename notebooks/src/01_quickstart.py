# Source of notebooks/01_quickstart.ipynb (python notebooks/make_notebooks.py writes it).

# %% [markdown]
# # Quickstart: from a PyTorch model to a parallelization plan, without a GPU
#
# planlab answers "how should I split this model over these GPUs?" offline. It traces the model
# with `torch.fx` on *meta* tensors (shapes only, no memory), builds every plan of a search space
# (data, tensor and pipeline parallelism, recomputation, ...), estimates each in a fraction of a
# millisecond, simulates one training iteration of the most promising ones against a model of the
# cluster, and ranks them by time and memory. The plan you pick runs
# on `torch.distributed` with `planlab run`.
#
# In this notebook (about a minute on a laptop CPU):
#
# 1. trace a model and look at its operator graph;
# 2. explore the Megatron grid for GPT-3 1.3B on one DGX A100 node (8 GPUs);
# 3. read the results DataFrame, plot the Pareto front of time against memory;
# 4. look at the best plan and the timeline of its simulated iteration;
# 5. run a plan of a tiny GPT on two CPU processes and check it against one process.
#
# It needs planlab installed (see the README); files are written to the working directory.

# %%
import shlex
import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from IPython.display import Image

import planlab


def planlab_cli(command: str) -> None:
    """``planlab COMMAND``, run as ``python -m planlab`` by this kernel's Python (never through PATH)."""
    done = subprocess.run([sys.executable, "-m", "planlab", *shlex.split(command)], capture_output=True, text=True)
    print(done.stdout + done.stderr)
    done.check_returncode()


# %% [markdown]
# ## 1. Trace a model
#
# planlab takes a `torch.nn.Module` whose `forward` returns the **scalar training loss**, and
# example inputs whose first dimension is the batch. Here is a small classifier of our own:


# %%
class Classifier(nn.Module):
    def __init__(self, features=32, hidden=64, classes=10):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x, y):  # x: (B, features), y: (B,) class ids
        return F.cross_entropy(self.fc2(F.gelu(self.fc1(x))), y)


graph = planlab.trace(Classifier(), (torch.randn(8, 32), torch.randint(0, 10, (8,))))
print(graph.summary())
for op in graph.operators:
    print(op)

# %% [markdown]
# Each operator carries a **signature** naming its dimensions, einsum-like. The linear layer
# `fc1[linear](a0 k+, n k+, n -> a0 n)` reads an input `a0 k` (batch, features), a weight `n k`
# and a bias `n`, and writes `a0 n`. A plain name can be split across devices (splitting `a0` is
# data parallelism, splitting `n` is a column-parallel layer); `k+` is a reduction: splitting it
# leaves partial sums that must be added (a row-parallel layer); `h^` would have to stay whole.
# Search spaces only split what the signatures allow, and `materialize` inserts the collectives
# that the splits imply.
#
# The built-in models are real torch modules too. Built on the `meta` device they take no memory,
# so GPT-3 1.3B traces in about a second:

# %%
from planlab.models import ModelSpec, build_model

model, inputs = build_model(ModelSpec("gpt3-1.3b"), batch=8)  # meta tensors: shapes only
print([tuple(t.shape) for t in inputs], inputs[0].device)
gpt = planlab.trace(model, inputs)
print(gpt.summary())
print(gpt.op("blocks_0_attn_q"))

# %% [markdown]
# ## 2. Explore the Megatron grid
#
# The `megatron` space is the grid of Megatron-LM and DeepSpeed: data parallelism (`dp`, with
# ZeRO stage `zero`) x tensor parallelism (`tp`, inside a node, with `sequence_parallel`) x
# pipeline parallelism (`pp`; 1F1B, or interleaved 1F1B over `virtual_stages`) x micro-batch size
# x activation recomputation (none, selective, full). `explore` builds every plan of the grid for
# the model, cluster and global batch and **screens** it: an analytic estimate of its time and
# memory from the plan's structure. Plans whose memory cannot fit are dropped; the most promising
# (the fastest by the screen, those along its Pareto front, the best of each part of the space)
# are materialized and **simulated** event by event, and the results ranked. The cluster is
# one node of the built-in `dgx-a100-40g` (8 A100 40 GB GPUs, NVLink; `planlab clusters` lists
# the others).

# %%
df = planlab.explore("gpt3-1.3b", cluster="dgx-a100-40g", nodes=1, space="megatron", global_batch=32)
print(
    f"{len(df)} plans, {int(df['simulated'].sum())} simulated, {int(df['feasible'].sum())} simulated and fit in memory"
)
df.head(10)

# %% [markdown]
# ## 3. Read the DataFrame
#
# One row per plan, the fastest feasible plan first. The knob columns say what the plan is
# (`microbatch` is the number of samples per data-parallel replica per micro-batch); then:
#
# | column | meaning |
# |---|---|
# | `screen_time_s`, `screen_mem_gib`, `screen_rank` | the screen's estimate of every plan, and its rank by time |
# | `simulated` | the plan was simulated (the others keep their screen estimate) |
# | `iter_time_s` | one simulated training iteration (forward, backward, optimizer step), seconds |
# | `peak_mem_gib` | peak memory of the fullest device, GiB |
# | `tflops_per_gpu`, `mfu` | model FLOP/s per GPU and its fraction of the GPU's peak |
# | `feasible` | simulated, and the peak fits in device memory |
# | `reason` | why a plan does not fit, failed to build, or was not simulated |
# | `pareto` | no other feasible plan is both faster and smaller |
#
# It is an ordinary pandas DataFrame: filter, group and plot it as you like.

# %%
KNOBS = ["dp", "tp", "pp", "microbatch", "zero", "recompute"]
simulated = df[df["simulated"]]
print(simulated[~simulated["feasible"].astype(bool)][KNOBS + ["peak_mem_gib", "reason"]].head(3).to_string())
print(df[~df["simulated"]][KNOBS + ["screen_time_s", "reason"]].head(3).to_string())
simulated.groupby("recompute")["iter_time_s"].min()

# %% [markdown]
# The Pareto front: each plan on it is the fastest that fits in its memory. Plans that leave more
# memory free are slower (they recompute activations, or pipeline more).

# %%
df[df["pareto"]][KNOBS + ["iter_time_s", "peak_mem_gib"]].sort_values("peak_mem_gib")

# %%
from planlab.plotting import pareto_plot

pareto_plot(df, "pareto.png")
Image("pareto.png")

# %% [markdown]
# ## 4. The best plan and its timeline
#
# `df.attrs["best_plan"]` is the best plan as a `Plan`: for every operator, how it is split
# (op-trans), on which devices its pieces run (op-assign), and per device the order of the
# stages' forward `F`, backward `B` and update `U` per micro-batch (op-order). Plans are data and
# save as versioned JSON (`docs/plan-format.md`).

# %%
best = df.attrs["best_plan"]
print(best.describe())
for p in best.ops[5:8]:
    print(" ", p)
print("device 0 runs:", " ".join(map(str, best.schedule[0])) if best.schedule else "its micro-batches in order")
planlab.save_plan(best, "best_plan.json")

# %% [markdown]
# To look inside an iteration, materialize the plan into its **Program** (per device: tasks for
# forward and backward pieces, collectives, sends and receives, the optimizer, with the memory
# each allocates and frees) and simulate it with a timeline. Devices that run the same tasks form
# a class, simulated once (`members` in the table).

# %%
from planlab.plan import trace_plan_model

cost = planlab.CostModel.load(best.cluster, best.nodes)
graph = trace_plan_model(best)
program = planlab.materialize(best, graph, symmetric=True)  # one representative per class of devices
result = planlab.simulate(program, cost, model_flops=3 * graph.flops, timeline=True)
print(result.summary())
result.device_table()[["device", "members", "compute_s", "comm_s", "exposed_comm_s", "bubble_s", "peak_mem_bytes"]]

# %%
from planlab.plotting import memory_plot, timeline_plot

timeline_plot(result, "timeline.png")
Image("timeline.png")

# %% [markdown]
# Blue is computation, orange communication on its own stream (gradient all-reduces overlap the
# backward). The memory of each device class over the iteration:

# %%
memory_plot(result, "memory.png")
Image("memory.png")

# %% [markdown]
# Any row of the DataFrame becomes a plan by fixing its knobs. Here the fastest pipeline-parallel
# plan: its devices run the 1F1B schedule, and the device table shows the pipeline bubble
# (`bubble_s`, waiting for the other stage) of each class of devices.

# %%
from planlab.search_spaces import get_space

names = [k.name for k in get_space("megatron").all_knobs()]
row = df[(df["pp"] > 1) & (df["feasible"] == True)].iloc[0]  # noqa: E712
fixed = {k: row[k].item() if hasattr(row[k], "item") else row[k] for k in names}
pipe = planlab.explore("gpt3-1.3b", cluster="dgx-a100-40g", nodes=1, global_batch=32, fixed=fixed).attrs["best_plan"]
print(pipe.describe())
print("device 0 runs:", " ".join(map(str, pipe.schedule[0])))
pipe_result = planlab.simulate(planlab.materialize(pipe, graph, symmetric=True), cost, model_flops=3 * graph.flops)
print(pipe_result.summary())
pipe_result.device_table()[["device", "members", "compute_s", "comm_s", "bubble_s", "peak_mem_bytes"]]

# %% [markdown]
# ## 5. Run a plan here
#
# The executor runs a plan's Program on `torch.distributed` (gloo on CPU, NCCL on GPU, one code
# path) and checks it against a single process trained from the same seed. GPT-3 1.3B does not fit
# on this machine, so explore a tiny GPT on the `cpu` cluster (one process per node) and run its
# best plan on 2 local processes. The same from a shell:
#
# ```sh
# planlab explore --model gpt-tiny --cluster cpu --nodes 2 --global-batch 8 --out tiny
# planlab run tiny/best_plan.json --nproc 2 --steps 3
# ```

# %%
tiny = planlab.explore("gpt-tiny", cluster="cpu", nodes=2, global_batch=8)
planlab.save_plan(tiny.attrs["best_plan"], "tiny.json")
print(tiny.attrs["best_plan"].describe())

# %%
planlab_cli("run tiny.json --nproc 2 --steps 3")

# %% [markdown]
# The report compares the measured iteration with the simulated one, per rank and per task kind,
# and ends with the numeric check: losses and gradients of the distributed run against one process.
#
# ## Where next
#
# * `notebooks/03_calibrate_run_compare.ipynb`: calibrate this machine, predict, run, compare task
#   by task.
# * `notebooks/04_what_if.ipynb`: slower links, a straggler, a bigger batch.
# * `docs/concepts.md` (graph, signatures, primitives, layouts, Program, device classes),
#   `docs/cli.md` (every command and option), `docs/spaces.md` (write your own space),
#   `docs/cluster.md` (calibrate a cluster, launch with torchrun or srun across nodes).
