# Source of notebooks/02_compose_spaces.ipynb (python notebooks/make_notebooks.py writes it).

# %% [markdown]
# # Compose your own search space
#
# Hand-made search spaces (Megatron-LM's 3D grid, DeepSpeed's ZeRO) miss plans that matter.
# planlab's spaces are built from three primitives, **op-trans** (split an operator), **op-assign**
# (place its pieces on devices) and **op-order** (the order in which a device runs them), plus
# constraints. The built-in spaces are written with the same public API you use here.
#
# In this notebook (a few minutes on a laptop CPU):
#
# 1. look at the built-in spaces and their knobs;
# 2. compose a space from them: product, restriction, a constraint on knobs, a rule on the
#    primitives, and read the errors a wrong space gets;
# 3. write a space of your own with `Space`, `Knob` and `Draft`;
# 4. nnScaler's **coshard** on a Swin Transformer at a large image size, against the Megatron grid;
# 5. nnScaler's **interlaced pipeline** on a GPT with a 256k vocabulary, against the grid;
# 6. run a coshard plan of a tiny Swin on two CPU processes and check it against one process.
#
# `docs/spaces.md` is the reference for everything used here.

# %%
from IPython.display import Image

import planlab
from planlab.errors import ConfigError
from planlab.search_spaces import get_space, list_spaces

# %% [markdown]
# ## 1. The built-in spaces
#
# A space has **knobs** (typed, with a range that depends on the model and the cluster), and
# **constraints** that rule out assignments of the knobs. `megatron` is the product of four
# spaces: pipeline (`pp`, `schedule`, `virtual_stages`), data (`dp`, `microbatch`, `zero`),
# tensor (`tp`, `sequence_parallel`) parallelism and recomputation (`recompute`). From a shell,
# `planlab spaces` prints the same list.

# %%
for sp in list_spaces():
    print(f"{sp.name:10} {', '.join(k.name for k in sp.all_knobs())}")
print()
print(get_space("megatron").knob("zero").doc)

# %% [markdown]
# ## 2. Compose
#
# `a * b` applies both spaces to one plan; `restrict` narrows knobs; `where` adds a constraint on
# knobs (read by name; the text is the message); `allow_split`, `allow_devices` and
# `allow_orders` are rules on the primitives, checked as each op-trans, op-assign and op-order is
# issued. Here: at most two-way model parallelism, no ZeRO, and the output layer split along the
# batch or the sequence only, never its vocabulary.

# %%
small_mp = (
    get_space("megatron")
    .restrict(zero=0)
    .where(lambda k: k["tp"] * k["pp"] <= 2, "tp={tp} x pp={pp} is more than 2-way model parallelism")
    .allow_split("lm_head", ("a0", "a1"))
    .named("small-mp")
)
df = planlab.explore("gpt-tiny", cluster="cpu", nodes=4, global_batch=8, space=small_mp)
print(len(df), "plans; largest tp x pp:", int((df["tp"] * df["pp"]).max()))
df[["dp", "tp", "pp", "microbatch", "recompute", "iter_time_s", "peak_mem_gib"]].head()

# %% [markdown]
# A space that says something impossible gets an error naming the space and the knob, before
# anything is simulated:

# %%
for bad in (
    lambda: planlab.explore(
        "gpt-tiny", cluster="cpu", nodes=4, global_batch=8, space=small_mp, fixed={"tp": 2, "pp": 2}
    ),
    lambda: planlab.explore(
        "gpt-tiny", cluster="cpu", nodes=4, global_batch=8, space=get_space("megatron").restrict(tp=3)
    ),
    lambda: planlab.explore(
        "gpt-tiny",
        cluster="cpu",
        nodes=4,
        global_batch=8,
        space=get_space("dp").where(lambda k: k["dp"] > 64, "dp={dp} must exceed 64"),
    ),
):
    try:
        bad()
    except ConfigError as e:
        print("ConfigError:", e)

# %% [markdown]
# ## 3. A space of your own
#
# A `Space` subclass declares its knobs and constraints and, in `apply`, records its choices on
# the `Draft`, the plan under construction: mesh axes with the dimension each operator splits
# along them, pipeline stages, recomputation, ZeRO. This one recomputes only the MLP of every
# transformer layer (the attention's activations are kept), a choice Megatron's grid does not
# have. Composed with `pp`, `dp` and `tp` it is a new space of 3D-parallel plans.

# %%
import re

from planlab.search_spaces import Draft, Knob, Space

LAYER_MLP = re.compile(r"(^|\.)blocks\.(\d+)\.mlp(\.|$)")


class RecomputeMLP(Space):
    """Recompute every layer's MLP in the backward (mlp_recompute=True) or keep its activations."""

    name = "mlp-recompute"
    order = 3  # after the stages (pp, 0) and the mesh axes (dp 1, tp 2)
    knobs = (Knob.bool("mlp_recompute", "recompute each layer's MLP"),)

    def apply(self, draft: Draft, values: dict) -> None:
        if values.get("mlp_recompute"):
            for op in draft.ctx.graph.operators:
                m = LAYER_MLP.search(op.module)
                if m:
                    draft.recompute[op.name] = int(m.group(2)) + 1  # one recompute group per layer


mine = (get_space("pp*dp*tp") * RecomputeMLP()).named("mine")
df = planlab.explore("gpt3-1.3b", cluster="dgx-a100-40g", nodes=1, global_batch=32, space=mine)
df[["dp", "tp", "pp", "microbatch", "mlp_recompute", "iter_time_s", "peak_mem_gib", "feasible"]].head()

# %% [markdown]
# To use it from the command line (`--space myspaces:mine`) put it in a module on the path, or
# register it by name with `register_space("mine", lambda: mine)`.
#
# ## 4. Coshard on a Swin Transformer
#
# nnScaler's **coshard** splits an operator into more pieces than the devices that hold it: each
# device runs its `coshard` pieces of every attention operator one after another, each recomputed
# in the backward, so only one piece's activations are alive at a time. Megatron's grid can only
# trade memory for time by more tensor or pipeline parallelism or by recomputing whole layers.
# Swin at large image sizes (here 2048 x 2048 pixels, 64 x 64 windows) spends its memory on the
# attention over big windows, where coshard pays off. Explore both spaces on one DGX A100 node
# with 40 GB GPUs:

# %%
from planlab.models import ModelSpec

swin = ModelSpec("swin-l", (("image", 2048), ("window", 64)))
setup = dict(cluster="dgx-a100-40g", nodes=1, global_batch=16)
grid = planlab.explore(swin, space="megatron", **setup)
composed = planlab.explore(swin, space="megatron*coshard", fixed={"coshard_blocks": "attention"}, **setup)

COLS = ["dp", "tp", "pp", "microbatch", "recompute", "zero", "iter_time_s", "peak_mem_gib"]
best_grid = grid[grid["feasible"] == True].iloc[0]  # noqa: E712
best_composed = composed[composed["feasible"] == True].iloc[0]  # noqa: E712
print("megatron:        ", best_grid[COLS].to_dict())
print("megatron*coshard:", best_composed[COLS + ["coshard"]].to_dict())
print(f"speedup {best_grid['iter_time_s'] / best_composed['iter_time_s']:.3f}x")

# %% [markdown]
# The composed space contains the whole grid (`coshard=1`), so it can only do as well or better.
# Its best plan here drops tensor parallelism and recomputation: coshard keeps the attention's
# activations small enough for 8-way data parallelism in 40 GB. The Pareto fronts of both:

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 4))
for name, d, marker in (("megatron", grid, "o"), ("megatron*coshard", composed, "x")):
    ok = d[d["feasible"] == True]  # noqa: E712
    ax.scatter(ok["peak_mem_gib"], ok["iter_time_s"], marker=marker, label=name, alpha=0.7)
ax.set_xlabel("peak memory per GPU (GiB)")
ax.set_ylabel("iteration time (s)")
ax.legend()
fig.savefig("swin_fronts.png", dpi=80, bbox_inches="tight")
plt.close(fig)
Image("swin_fronts.png")

# %% [markdown]
# In the plan, a co-sharded operator lists each device once per piece it holds (op-assign with
# repeated devices), and is recomputed with its layer:

# %%
plan = composed.attrs["best_plan"]
print(plan.describe())
shown = [p for p in plan.ops if len(set(p.devices)) < len(p.devices)][:3]
for p in shown:
    print(" ", p)

# %% [markdown]
# ## 5. The interlaced pipeline on a large-vocabulary GPT
#
# A GPT with a 256k vocabulary holds a large share of its weights and FLOPs in the token
# embedding and the output layer, which overload the first and last stage of a plain pipeline.
# nnScaler's **interlaced pipeline** (`interlaced`) runs the layers as a 1F1B pipeline but puts the
# embedding (split along the vocabulary) and the output layer with the loss on stages of their
# own that *every* device runs, interlaced into the schedule. Compare it with the Megatron grid,
# and with the grid's best pipelined plans:

# %%
gpt = ModelSpec("gpt", (("layers", 8), ("hidden", 2048), ("heads", 16), ("seq", 1024), ("vocab", 256000)))
setup = dict(cluster="dgx-a100-40g", nodes=1, global_batch=16)
COLS = ["dp", "tp", "pp", "microbatch", "zero", "recompute", "iter_time_s", "peak_mem_gib"]


def best(df):
    return df[df["feasible"] == True].iloc[0]  # noqa: E712


grid = best(planlab.explore(gpt, space="megatron", **setup))
grid_pp2 = best(planlab.explore(gpt, space="megatron", fixed={"pp": 2}, candidates=64, **setup))
inter = best(planlab.explore(gpt, space="interlaced", **setup))
print("megatron:          ", grid[COLS].to_dict())
print("megatron, pp=2:    ", grid_pp2[COLS + ["schedule", "virtual_stages"]].to_dict())
print("interlaced:        ", inter[COLS + ["embed_layout"]].to_dict())
print(
    f"interlaced against megatron's best pipeline: {grid_pp2['iter_time_s'] / inter['iter_time_s']:.2f}x; "
    f"against megatron's best plan: {grid['iter_time_s'] / inter['iter_time_s']:.2f}x"
)

# %% [markdown]
# Among pipelined plans the interlaced pipeline wins clearly: its stages are balanced. But this
# model still fits as ZeRO data parallelism, which has no pipeline bubble at all, so the grid's
# best plan stays ahead. The interlaced pipeline pays off for models that need a pipeline;
# `docs/validation.md` reports the same comparison on a 43B GPT over 32 GPUs, where the grid's
# best plan is itself a pipeline and the interlaced pipeline wins.
#
# ## 6. Run a coshard plan here
#
# The same space on a tiny Swin, two CPU processes (gloo), checked against one process trained
# from the same seed: losses and gradients must match.

# %%
from planlab.executor.run import launch_local
from planlab.explore import Setup, make_context

tiny = ModelSpec("swin-tiny", (("num_heads", "4,8,16"),))
ctx, _, _ = make_context(Setup(model=tiny, cluster="cpu", nodes=2, global_batch=8))
tiny_plan = get_space("megatron*coshard").build(
    ctx, dict(dp=2, tp=1, pp=1, microbatch=2, coshard=4, coshard_blocks="attention")
)
res = launch_local(tiny_plan, 2, steps=2, lr=1e-2)
print("losses", [round(x, 5) for x in res.losses])
print(f"largest loss error {res.max_loss_error:.1e}, gradient error {res.max_grad_error:.1e}")
assert res.max_loss_error < 1e-4 and res.max_grad_error < 1e-4

# %% [markdown]
# ## Where next
#
# * `docs/spaces.md`: the space API in full (typed knobs, constraints, rules, union, registry).
# * `notebooks/03_calibrate_run_compare.ipynb`: calibrate this machine and compare the prediction
#   with a measured run, task by task.
