# Source of notebooks/04_what_if.ipynb (python notebooks/make_notebooks.py writes it).

# %% [markdown]
# # What if? Slower links, a straggler, a bigger batch
#
# The simulator answers questions that would cost a cluster to answer by measurement. Here: GPT-3
# 1.3B trained on two DGX A100 (40 GB) nodes, 16 GPUs, global batch 64, and three changes:
#
# 1. **slower links between the nodes**: a cluster spec file of our own, with 25 Gb/s instead of
#    200 Gb/s per InfiniBand adapter;
# 2. **a straggler**: one GPU computing slower than the others;
# 3. **a bigger batch**.
#
# Everything runs on this CPU in a minute or two: models are traced on meta tensors (no weights
# are allocated) and each plan is one simulated iteration. To keep it short we explore the Megatron
# grid with selective recomputation fixed (`fixed={"recompute": "selective"}`, the CLI's
# `--set recompute=selective`).

# %%
import json
import shlex
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from IPython.display import Image

import planlab
from planlab.search_spaces import get_space

MODEL, NODES, BATCH = "gpt3-1.3b", 2, 64
FIXED = {"recompute": "selective"}
SHOW = ["dp", "tp", "pp", "microbatch"]  # the knobs shown below
KNOBS = [k.name for k in get_space("megatron").all_knobs()]  # every knob: together they name a plan


def planlab_cli(command: str) -> None:
    """``planlab COMMAND``, run as ``python -m planlab`` by this kernel's Python (never through PATH)."""
    done = subprocess.run([sys.executable, "-m", "planlab", *shlex.split(command)], capture_output=True, text=True)
    print(done.stdout + done.stderr)
    done.check_returncode()


# %% [markdown]
# ## The baseline
#
# `explore` returns a DataFrame with one row per plan, fastest feasible first:
# `iter_time_s` (one simulated training iteration), `peak_mem_gib` (the fullest device's peak),
# `feasible` (fits in device memory), `reason` (why not) and `pareto` (no other plan is both faster
# and smaller).

# %%
base = planlab.explore(MODEL, cluster="dgx-a100-40g", nodes=NODES, global_batch=BATCH, fixed=FIXED)
base[SHOW + ["iter_time_s", "peak_mem_gib", "mfu", "feasible"]].head(6)

# %% [markdown]
# ## 1. Slower links: a cluster spec file of our own
#
# Clusters are data: a JSON file per node type with units in the field names. We start from the
# built-in DGX A100 40 GB file and lower the inter-node bandwidth from eight 200 Gb/s HDR adapters
# to eight 25 Gb/s ones. `--cluster` (and `cluster=`) takes the path of such a file wherever it
# takes a built-in name. Every number is checked against a plausible range for its unit when the
# file is loaded.

# %%
from planlab.costmodel import load_cluster
from planlab.costmodel.hardware import SPEC_DIR

spec = json.loads((SPEC_DIR / "dgx-a100-40g.json").read_text())
print({k: spec[k] for k in ("devices_per_node", "intra_GBps", "inter_Gbps", "inter_adapters", "inter_latency_us")})
spec.update(name="dgx-a100-40g-25gbe", description="DGX A100 40GB nodes linked by 8x 25 Gb/s", inter_Gbps=25)
Path("slow-links.json").write_text(json.dumps(spec, indent=1))
print(load_cluster("slow-links.json", nodes=NODES))

# %%
slow = planlab.explore(MODEL, cluster="slow-links.json", nodes=NODES, global_batch=BATCH, fixed=FIXED)
fits = lambda df: df[df["feasible"] == True]  # noqa: E712  (plans that fit in device memory)
both = fits(base).merge(fits(slow), on=KNOBS, suffixes=("_fast", "_slow"))
both = both[KNOBS + ["iter_time_s_fast", "iter_time_s_slow"]].dropna().sort_values("iter_time_s_fast")
vary = [k for k in KNOBS if both[k].nunique() > 1]  # the knobs that tell these plans apart
both = both[vary + ["iter_time_s_fast", "iter_time_s_slow"]]
both["slowdown"] = both["iter_time_s_slow"] / both["iter_time_s_fast"]
both.index = range(1, len(both) + 1)  # plan numbers, for the plot below
both.head(10)


# %%
def best(df):
    r = fits(df).iloc[0]  # explore ranks the fastest feasible plan first
    return ", ".join(f"{k}={r[k]}" for k in SHOW) + f": {r['iter_time_s']:.3f} s"


print("best with 200 Gb/s:", best(base))
print("best with  25 Gb/s:", best(slow))

# %% [markdown]
# Data parallelism over both nodes all-reduces every gradient across the slow links once per
# iteration; a pipeline with one stage per node sends only activations (a few MiB per
# micro-batch) between the nodes and keeps the gradient all-reduce inside each node's NVLink.
# Which plan wins depends on the links; the plot shows the plans of the table on both clusters.

# %%
plotted = both.head(10)
labels = [f"plan {i}" for i in plotted.index]  # the rows of the table above
fig, ax = plt.subplots(figsize=(9, 3.5))
x = range(len(plotted))
ax.bar([i - 0.2 for i in x], plotted["iter_time_s_fast"], width=0.4, label="8x 200 Gb/s per node")
ax.bar([i + 0.2 for i in x], plotted["iter_time_s_slow"], width=0.4, label="8x 25 Gb/s per node")
ax.set_xticks(list(x), labels, rotation=30, ha="right")
ax.set_ylabel("iteration time (s)"), ax.legend()
fig.savefig("links.png", dpi=100, bbox_inches="tight"), plt.close(fig)
Image("links.png")

# %% [markdown]
# ## 2. A straggler
#
# `simulate(..., stragglers={device: factor})` slows one device's computation by a factor (a
# thermally throttled GPU, a noisy neighbour). Every device must then be simulated on its own, so
# the plan is materialized with `symmetric=False` (by default `materialize` keeps one
# representative per class of identical devices). The CLI has the same option:
# `planlab simulate plan.json --straggler 0=1.5`.

# %%
from planlab.costmodel import CostModel
from planlab.plan import materialize, trace_plan_model
from planlab.simulator import simulate


def with_straggler(plan, factors, device=0):
    """Iteration time of ``plan`` with ``device`` slowed by each factor."""
    cost = CostModel.load(plan.cluster, plan.nodes)
    graph = trace_plan_model(plan)
    program = materialize(plan, graph, symmetric=False, node_of=cost.cluster.node_of)
    return [simulate(program, cost, stragglers={device: f}).iter_time_s for f in factors]


factors = [1.0, 1.1, 1.25, 1.5, 2.0]
plans = {"best on 200 Gb/s": base.attrs["best_plan"], "best on 25 Gb/s": slow.attrs["best_plan"]}
planlab.save_plan(plans["best on 200 Gb/s"], "best_fast.json")
planlab.save_plan(plans["best on 25 Gb/s"], "best_slow.json")
strag = pd.DataFrame({name: with_straggler(plan, factors) for name, plan in plans.items()}, index=factors)
strag.index.name = "device 0 slower by"
(strag / strag.iloc[0]).style.format("{:.3f}").set_caption("iteration time relative to no straggler")

# %% [markdown]
# Each plan's time relative to its own time without a straggler. In data parallelism every
# replica waits for the slowest at the gradient all-reduce, so the whole iteration runs at the
# straggler's pace. In the pipeline, the straggler's stage gets slower and the devices of the
# other stage wait for it at their receives. Both plans were saved as plan files; the CLI gives
# the same numbers (the device table shows the straggler as a class of its own):

# %%
planlab_cli("simulate best_fast.json --straggler 0=1.5")

# %% [markdown]
# ## 3. A bigger batch
#
# A bigger global batch runs more micro-batches per iteration (or bigger ones): the pipeline's
# bubble and the gradient all-reduce are spread over more samples, but more activations may be in
# flight at once. For each batch, the best plan of the same grid (tensor parallelism fixed to 1 to
# keep it short), its throughput and its peak memory:

# %%
rows = []
for batch in (32, 64, 128, 256):
    df = planlab.explore(MODEL, cluster="dgx-a100-40g", nodes=NODES, global_batch=batch, fixed={**FIXED, "tp": 1})
    ok = fits(df)
    r = ok.iloc[0]
    rows.append(
        dict(
            global_batch=batch,
            plans=len(df),
            feasible=len(ok),
            **{k: r[k] for k in SHOW},
            iter_time_s=r["iter_time_s"],
            samples_per_s=batch / r["iter_time_s"],
            peak_mem_gib=r["peak_mem_gib"],
        )
    )
batches = pd.DataFrame(rows).set_index("global_batch")
batches.style.format({"iter_time_s": "{:.3f}", "samples_per_s": "{:.1f}", "peak_mem_gib": "{:.1f}"})

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.bar([str(b) for b in batches.index], batches["samples_per_s"])
for i, r in enumerate(batches.itertuples()):
    ax.annotate(
        f"dp{r.dp} pp{r.pp} mb{r.microbatch}, {r.peak_mem_gib:.0f} GiB",
        (i, r.samples_per_s),
        textcoords="offset points",
        xytext=(0, 4),
        ha="center",
        fontsize=8,
    )
ax.set_xlabel("global batch"), ax.set_ylabel("samples per second (best plan)")
fig.savefig("batch.png", dpi=100, bbox_inches="tight"), plt.close(fig)
Image("batch.png")

# %% [markdown]
# The `reason` column says why a plan was left out: weights, gradients and optimizer states alone
# too big, the activations saved in flight too big (a bound checked before simulating), or the
# simulated peak above device memory. Here are those of the largest batch:

# %%
df[df["feasible"] == False][SHOW + ["peak_mem_gib", "reason"]].head(5)  # noqa: E712

# %% [markdown]
# ## Going further
#
# * Any field of a cluster file can be changed the same way: `memory_GB` or `peak_bf16_tflops`
#   of the device (an inline `device` object), `intra_GBps` (NVLink), or a `network` object for
#   a fat tree with `nodes_per_switch` and `oversubscription` (see `docs/cluster.md`).
# * `planlab simulate PLAN --plot DIR` draws the timeline and memory of one plan;
#   `--trace FILE` writes it for https://ui.perfetto.dev.
# * A calibration profile (`planlab calibrate`, notebook 03) prices a machine by measurement
#   instead of by its spec.
