# Source of notebooks/03_calibrate_run_compare.ipynb (python notebooks/make_notebooks.py writes it).

# %% [markdown]
# # Calibrate this machine, predict a plan, run it, compare task by task
#
# planlab predicts an iteration by simulating a plan's *Program*: the per-device list of tasks
# (forward and backward pieces of operators, collectives, sends, receives, the optimizer step).
# The executor runs **the same Program** on `torch.distributed`, so every predicted task has a
# measured twin. This notebook closes the loop on this machine's CPU:
#
# 1. `planlab calibrate` measures this machine (kernels, the executor's own cost per task, gloo
#    collectives) into a *profile*;
# 2. `planlab explore ... --profile` picks a plan for a small GPT on 2 CPU processes, priced by the profile;
# 3. `planlab run` runs it on 2 gloo processes, checks the numbers against one process and writes
#    the measured and the predicted timelines;
# 4. we read both timelines and compare them task by task.
#
# It takes two to three minutes, most of it calibration. Run it from any folder: the files it
# writes (`cpu.json`, `pp2/`, `measured.json`, `predicted.json`, `*.png`) go to the working directory.

# %%
import shlex
import subprocess
import sys

import matplotlib.patches
import matplotlib.pyplot as plt
from IPython.display import Image

import planlab


def planlab_cli(command: str) -> None:
    """``planlab COMMAND``, run as ``python -m planlab`` by this kernel's Python (never through PATH)."""
    done = subprocess.run([sys.executable, "-m", "planlab", *shlex.split(command)], capture_output=True, text=True)
    print(done.stdout + done.stderr)
    done.check_returncode()


# %% [markdown]
# ## 1. Calibrate
#
# `--quick` measures fewer shapes and repetitions (under a minute); drop it for a better profile
# (one to three minutes). The profile is versioned JSON with units in its field names; it applies
# to the cluster it calibrated, here `cpu` (one process per node, nodes linked by loopback TCP).

# %%
planlab_cli("calibrate --quick --out cpu.json")

# %%
from planlab.costmodel import load_profile

profile = load_profile("cpu.json")
print(profile)
for fit in profile.collectives:
    print(" ", fit)

# %% [markdown]
# ## 2. Choose a plan, priced by the profile
#
# `gpt-small` (4 layers, hidden 128, 0.9M parameters) on the `cpu` cluster with 2 nodes, i.e. 2
# processes. We fix `pp=2` so that the plan is a 1F1B pipeline over the two processes: its timeline
# has forwards, backwards, sends, receives and waits, which makes the comparison instructive.
# `--out pp2` writes `results.csv`, `pareto.png` and `best_plan.json` there.

# %%
planlab_cli(
    "explore --model gpt-small --cluster cpu --nodes 2 --global-batch 8 --set pp=2 --profile cpu.json --out pp2"
)

# %%
plan = planlab.load_plan("pp2/best_plan.json")
print(plan.describe())
print("schedule of device 0:", " ".join(map(str, plan.schedule[0])))
print("schedule of device 1:", " ".join(map(str, plan.schedule[1])))

# %% [markdown]
# The schedule is data: per device, actions `{stage}{phase}{micro-batch}`, `F` forward, `B`
# backward, `U` the once-per-iteration update (gradient reduction and optimizer step).
#
# ## 3. Predict
#
# `predict` materializes the plan into its Program and simulates every device with a timeline,
# priced by the profile. This is what `planlab run` compares against.

# %%
from planlab.executor import predict

pred = predict(plan, profile="cpu.json")
print(pred.sim.summary())
pred.sim.device_table()

# %% [markdown]
# ## 4. Run the plan with `planlab run`
#
# Two local gloo processes (torchrun's launcher), 4 training steps of which the first is warm-up.
# Rank 0 prints each step's loss; the report gives the measured against the simulated iteration,
# peak memory per rank, predicted against measured time per task kind with the largest misses, and
# the numeric check: losses and gradients against a single process started from the same seed.
# `--trace` writes the measured timeline of the last step, `--predicted-trace` the simulated one,
# both as Chrome/Perfetto traces (open them in https://ui.perfetto.dev side by side).

# %%
planlab_cli(
    "run pp2/best_plan.json --nproc 2 --steps 4 --profile cpu.json --trace measured.json --predicted-trace predicted.json"
)

# %% [markdown]
# ## 5. Compare task by task
#
# Both trace files hold one event per task: device, stream (compute, comm, wait), action (e.g.
# `0F1`), task name, start and end. `compare` matches each measured task with its predicted twin
# (by device, action, name and occurrence) and sums per task kind: `F` forward, `B` backward,
# `C` collective, `S` send, `R` receive (its time includes waiting for the sender), `L` local copy,
# `O` optimizer.

# %%
from planlab.executor.timeline import compare, largest_misses, read_trace

predicted = read_trace("predicted.json")
measured = read_trace("measured.json")
report = compare(pred.program, predicted, measured)
tasks = report.attrs["tasks"]
print(
    f"{len(tasks)} tasks, {tasks['measured_s'].notna().sum()} measured, {tasks['predicted_s'].notna().sum()} predicted"
)
report.style.format({"predicted_s": "{:.4f}", "measured_s": "{:.4f}", "ratio": "{:.2f}"})

# %%
largest_misses(tasks, 8)

# %% [markdown]
# Each task as a point: predicted time against measured time, one colour per kind. Points on the
# diagonal were predicted exactly. On this shared machine a few tasks are far above it: a process
# preempted for a scheduler slice (several milliseconds) stretches whichever task it was running.

# %%
colors = {
    "F": "tab:blue",
    "B": "tab:green",
    "C": "tab:orange",
    "S": "tab:red",
    "R": "tab:gray",
    "L": "tab:purple",
    "O": "tab:brown",
}
fig, ax = plt.subplots(figsize=(6, 5))
for kind, group in tasks.dropna().groupby("kind"):
    ax.scatter(group["predicted_s"] * 1e3, group["measured_s"] * 1e3, s=12, label=kind, color=colors.get(kind))
top = max(tasks["predicted_s"].max(), tasks["measured_s"].max()) * 1e3
ax.plot([1e-3, top], [1e-3, top], "k:", lw=1)
ax.set_xscale("log"), ax.set_yscale("log")
ax.set_xlabel("predicted (ms)"), ax.set_ylabel("measured (ms)"), ax.legend(title="kind")
fig.savefig("tasks.png", dpi=100, bbox_inches="tight"), plt.close(fig)
Image("tasks.png")

# %% [markdown]
# The two timelines one above the other for each device: the measured one (top row of each
# device) against the predicted one. Forwards and backwards are blue and green, communication
# orange, receives (waiting for the other stage) gray.


# %%
def lanes(ax, events, y, kind_of):
    for e in events:
        ax.broken_barh(
            [(e.start_s * 1e3, max(e.end_s - e.start_s, 1e-6) * 1e3)],
            (y, 0.8),
            color=colors.get(kind_of.get((e.device, e.action, e.name), "?"), "k"),
        )


kind_of = {(r.device, r.action, r.name): r.kind for r in tasks.itertuples()}
fig, ax = plt.subplots(figsize=(11, 3))
labels = []
for dev in sorted({e.device for e in measured}):
    lanes(ax, [e for e in measured if e.device == dev], 2 * dev, kind_of)
    lanes(ax, [e for e in predicted if e.device == dev], 2 * dev + 1, kind_of)
    labels += [f"device {dev} measured", f"device {dev} predicted"]
ax.set_yticks([i + 0.4 for i in range(len(labels))], labels)
ax.set_xlabel("time in the iteration (ms)")
ax.legend(
    handles=[matplotlib.patches.Patch(color=c, label=k) for k, c in colors.items()],
    title="kind",
    loc="center left",
    bbox_to_anchor=(1.01, 0.5),
    fontsize=8,
)
fig.savefig("timelines.png", dpi=100, bbox_inches="tight"), plt.close(fig)
Image("timelines.png")

# %% [markdown]
# ## What to read from it
#
# * The task *order* agrees by construction (the executor runs the Program's order); the times
#   differ by how well the profile describes this machine *now*. On a quiet machine the mean error
#   over plans of gpt-tiny and gpt-small is about 25% (`docs/validation.md`); on a machine shared
#   with other work, much more, mostly in forward and backward tasks.
# * Receives (`R`) include waiting for the sender: a slow stage shows up as long receives on the
#   other one, in both timelines.
# * Without `--profile`, the `cpu` spec's datasheet-like numbers price the plan; compare the two:
#   `planlab simulate pp2/best_plan.json` against `planlab simulate pp2/best_plan.json --profile cpu.json`.
#
# On a GPU cluster, `planlab run` works the same under `torchrun` or `srun` on every node, with
# NCCL (`docs/cluster.md`). `planlab calibrate` measures CPUs and gloo only for now: GPU clusters
# are priced from their spec files.
