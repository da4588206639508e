"""The README and docs/*.md stay true: every shell command in their fenced blocks is accounted for
in COMMANDS below (run here, run by a named test, a benchmark, or not runnable on one CPU
machine, with the reason), each document's runnable blocks run top to bottom in a fresh
directory, the CLI reference matches the parser, and the plan-format page matches the code.

A command added to a document without an entry here fails
``test_every_documented_command_is_accounted_for``; an entry whose command left the documents
fails ``test_every_entry_is_documented``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from docblocks import ROOT, SHELL, all_commands, blocks, commands, documents


@dataclass(frozen=True)
class Run:
    """Run in the document's working directory, in the document's order (``instead``: a
    scaled-down command run in its place, and ``why``)."""

    instead: str | None = None
    why: str = ""


@dataclass(frozen=True)
class ByTest:
    """Exercised by the test ``node`` (``tests/file.py::function`` or ``...::function[id]``)."""

    node: str
    why: str = ""


@dataclass(frozen=True)
class Benchmark:
    """Measures the figures of docs/validation.md (seconds to tens of minutes, so not run here);
    checked: the script exists and takes the options shown."""


@dataclass(frozen=True)
class Elsewhere:
    """Cannot run on one CPU machine, or sets up the environment the suite runs in."""

    why: str


DOC_RUN = "tests/test_docs.py::test_document_runs[{}]"
NOTEBOOK = "tests/test_notebooks.py::test_notebook_runs_top_to_bottom[{}]"
SETUP = Elsewhere("creates the environment the test suite runs in (and needs the network)")
TWO_NODES = Elsewhere(
    "needs two or more nodes; tests/test_executor_torchrun.py runs torchrun --standalone and "
    "srun-like tasks on this machine"
)

COMMANDS: dict[str, Run | ByTest | Benchmark | Elsewhere] = {
    # README.md: setting up
    "python3 -m venv .venv": SETUP,
    ".venv/bin/pip install torch==2.13.0 -e '.[dev]'": SETUP,
    ".venv/bin/planlab explore --model gpt3-6.7b --cluster dgx-a100-80g --nodes 2 --space megatron "
    "--global-batch 256 --jobs 2 --out out": Run(
        "planlab explore --model gpt3-6.7b --cluster dgx-a100-80g --nodes 2 --space megatron --global-batch 256 "
        "--set pp=2 --set tp=8 --set microbatch=16 --set recompute=selective --out out",
        "the whole grid takes minutes; the same model, cluster, batch and outputs with the knobs pinned",
    ),
    ".venv/bin/ruff check .": Elsewhere("the lint step of the test command (CI runs it)"),
    ".venv/bin/ruff format --check .": Elsewhere("the format step of the test command (CI runs it)"),
    ".venv/bin/python -m pytest -q": Elsewhere("the test suite itself"),
    # README.md: the loop
    "planlab explore --model gpt-tiny --cluster cpu --nodes 2 --space megatron --global-batch 8 --out out/tiny": Run(),
    "planlab run out/tiny/best_plan.json --nproc 2 --steps 3": ByTest(
        "tests/test_cli.py::test_console_script_explore_then_run"
    ),
    "planlab simulate out/tiny/best_plan.json --trace trace.json": Run(),
    "planlab explore --model gpt-tiny --cluster cpu --nodes 2 --global-batch 8 --set tp=2 --out out/tp": Run(),
    "planlab explore --model gpt-tiny --cluster cpu --nodes 2 --global-batch 8 --set pp=2 --out out/pp": Run(),
    "planlab run out/tp/best_plan.json --nproc 2 --steps 2 --save ckpt": ByTest(
        DOC_RUN.format("cli.md"), "docs/cli.md runs the same save under a TP plan and load under a PP plan"
    ),
    "planlab run out/pp/best_plan.json --nproc 2 --steps 2 --load ckpt": ByTest(
        DOC_RUN.format("cli.md"), "docs/cli.md runs the same save under a TP plan and load under a PP plan"
    ),
    "planlab explore --model planlab.models.hf:swin --cluster cpu --nodes 2 --global-batch 8 --set dp=2 "
    "--out out/swin": Run(),
    "planlab run out/swin/best_plan.json --nproc 2 --steps 2": Run(),
    "planlab explore --model gpt-tiny --cluster dgx-a100-80g --space 'megatron*act_offload' --global-batch 8 "
    "--set offload_activations=50 --top 3": Run(),
    "planlab models": Run(),
    "planlab clusters": Run(),
    "planlab spaces": Run(),
    "planlab graph --model gpt3-175b": Run(),
    # README.md: Hugging Face models
    "planlab graph --model planlab.models.hf:llama --model-arg size=full": Run(),
    "planlab explore --model planlab.models.hf:t5 --cluster cpu --nodes 2 --global-batch 8 --out out/t5": Run(),
    # README.md, docs/cli.md, docs/cluster.md: calibration
    "planlab calibrate --out cpu.json": ByTest(
        "tests/test_calibrate.py::test_quick_calibration_end_to_end", "the same measurements with fewer sizes (--quick)"
    ),
    "planlab calibrate --quick --out cpu.json": ByTest("tests/test_calibrate.py::test_quick_calibration_end_to_end"),
    "planlab simulate plan.json --profile cpu.json": ByTest("tests/test_calibrate.py::test_cli_uses_the_profile"),
    "planlab explore --model gpt-small --cluster cpu --nodes 2 --profile cpu.json": ByTest(
        NOTEBOOK.format("03_calibrate_run_compare"), "explores gpt-small with its fresh profile"
    ),
    "planlab run plan.json --nproc 2 --profile cpu.json": ByTest(
        NOTEBOOK.format("03_calibrate_run_compare"), "runs a plan with its fresh profile"
    ),
    # docs/cli.md
    "planlab explore --model gpt-tiny --cluster cpu --nodes 2 --global-batch 8 --out tiny": Run(),
    "planlab explore --model gpt --model-arg layers=4 --model-arg hidden=256 --model-arg heads=8 --model-arg seq=128 "
    "--model-arg vocab=1024 --cluster dgx-a100-80g --space 'dp*tp' --top 5": Run(),
    "planlab explore --model llama-tiny --cluster cpu --nodes 4 --global-batch 8 --set pp=2 --set schedule=gpipe "
    "--set recompute=none": Run(),
    "planlab run tiny/best_plan.json --nproc 2 --steps 3": ByTest(
        "tests/test_cli.py::test_console_script_explore_then_run"
    ),
    "planlab run tiny/best_plan.json --nproc 2 --steps 5 --warmup 2 --clip-grad-norm 1.0 --trace measured.json "
    "--predicted-trace predicted.json": Run(),
    "torchrun --standalone --nproc-per-node 2 -m planlab.cli run tiny/best_plan.json --steps 2": ByTest(
        "tests/test_executor_torchrun.py::test_torchrun_runs_each_process_as_a_rank",
        "python -m torch.distributed.run --standalone is torchrun",
    ),
    "planlab explore --model gpt-tiny --cluster cpu --nodes 2 --global-batch 8 --set tp=2 --out tp": Run(),
    "planlab explore --model gpt-tiny --cluster cpu --nodes 2 --global-batch 8 --set pp=2 --out pp": Run(),
    "planlab run tp/best_plan.json --nproc 2 --steps 2 --save ckpt": Run(),
    "planlab run pp/best_plan.json --nproc 2 --steps 2 --load ckpt": Run(),
    "planlab simulate tiny/best_plan.json": Run(),
    "planlab simulate tiny/best_plan.json --json": Run(),
    "planlab simulate pp/best_plan.json --plot plots --trace trace.json --straggler 1=1.5": Run(),
    "planlab graph --model llama --model-arg layers=2 --model-arg hidden=256 --model-arg heads=8 --model-arg kv_heads=2 "
    "--model-arg ffn_hidden=512 --model-arg seq=64 --model-arg vocab=1000 --global-batch 4": Run(),
    # docs/cluster.md
    "planlab explore --model gpt3-350m --cluster my-cluster.json --nodes 2 --global-batch 16 --set recompute=selective "
    "--top 5": Run(),
    "planlab explore --model gpt3-350m --cluster my-cluster.json --nodes 2 --global-batch 16 --software my-software.json "
    "--precision fp16 --set recompute=selective --top 3": Run(),
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m planlab.cli run plan.json "
    "--steps 20 --warmup 5": TWO_NODES,
    "srun --nodes 2 --ntasks-per-node 8 --gres=gpu:8 planlab run plan.json --steps 20 --warmup 5 --clip-grad-norm 1.0 "
    "--data batches.pt": TWO_NODES,
    # docs/operators.md
    "PYTHONPATH=. planlab graph --model mymodels:build": Run(),
    "PYTHONPATH=. planlab explore --model mymodels:build --cluster cpu --nodes 2 --global-batch 8 --space dp --out dp": Run(),
    "PYTHONPATH=. planlab run dp/best_plan.json --nproc 2 --steps 2": Run(),
    "PYTHONPATH=. planlab run my_tp.json --nproc 2 --steps 2": Run(),
    # docs/spaces.md
    "planlab explore --model gpt-tiny --cluster cpu --nodes 4 --global-batch 8 --space 'dp*tp' --set tp=2": Run(),
    "planlab explore --model gpt-tiny --cluster cpu --nodes 2 --global-batch 8 --space alpa": Run(),
    "PYTHONPATH=. planlab explore --model gpt-small --cluster cpu --nodes 4 --global-batch 8 --space myspaces:space "
    "--top 5": Run(),
    "planlab explore --model gpt-tiny --cluster cpu --nodes 4 --global-batch 8 --space 'megatron*fine' "
    "--model-arg layers=5 --set pp=2": Run(),
    "planlab explore --model evoformer-tiny --model-arg recycles=3 --cluster cpu --nodes 2 --global-batch 4 "
    "--space 3f1b": Run(),
    "planlab explore --model gpt --model-arg layers=2 --model-arg hidden=32 --model-arg heads=4 --model-arg seq=16 "
    "--model-arg vocab=512 --cluster cpu --nodes 4 --global-batch 8 --space interlaced": ByTest(
        "tests/test_interlaced.py::test_explore_small_gpt"
    ),
    # docs/validation.md
    ".venv/bin/python -m pytest -q tests/test_executor.py tests/test_executor_torchrun.py tests/test_shards.py": Elsewhere(
        "tests of this suite"
    ),
    "planlab explore --model gpt3-175b --cluster dgx-a100-80g --nodes 16 --space megatron --global-batch 1536 --jobs 2": ByTest(
        "tests/test_cli.py::test_gpt3_175b_exploration_completes"
    ),
    ".venv/bin/python -m pytest -q tests/test_experts.py tests/test_moe.py": Elsewhere("tests of this suite"),
    ".venv/bin/python benchmarks/sim_scale.py": Benchmark(),
    # docs/spaces.md
    ".venv/bin/python benchmarks/pipeline_schedules.py": Benchmark(),
    ".venv/bin/python benchmarks/simulate_speed.py": Benchmark(),
    ".venv/bin/python benchmarks/trace_large.py": Benchmark(),
    ".venv/bin/python benchmarks/validate_cpu.py --steps 6 --launches 3": Benchmark(),
    ".venv/bin/python benchmarks/validate_cpu.py --set overhead --steps 8 --launches 3": Benchmark(),
    ".venv/bin/python benchmarks/validate_vtrain.py --jobs 2": Benchmark(),
    ".venv/bin/python benchmarks/gemm_microbench.py --fit": Benchmark(),
    ".venv/bin/python benchmarks/validate_published.py --jobs 2": Benchmark(),
    ".venv/bin/python benchmarks/validate_published.py --set megatron-sc21-zero3 --rows": Benchmark(),
    ".venv/bin/python benchmarks/validate_published.py --set shoeybi-2019-v100 --jobs 1": Benchmark(),
    ".venv/bin/python benchmarks/validate_published.py --set llama3-2024 --rows --jobs 1": Benchmark(),
    ".venv/bin/python benchmarks/validate_published.py --set deepseek-v3-2024 --set megatron-bridge-25.09-h100 --rows --jobs 1": Benchmark(),
    ".venv/bin/python benchmarks/validate_published.py --set megatron-core-moe-h100 --rows --jobs 1": Benchmark(),
    ".venv/bin/python benchmarks/memory_breakdown.py --set megatron-core-moe-h100 --row mixtral-8x7b-mcore0.8": Benchmark(),
    ".venv/bin/python benchmarks/time_breakdown.py --set megatron-bridge-25.09-h100": Benchmark(),
    ".venv/bin/python benchmarks/sim_scale.py llama3": Benchmark(),
    ".venv/bin/python benchmarks/host_overhead.py": Benchmark(),
    ".venv/bin/python benchmarks/fuzz_plans.py --plans 500 --seed 0": Benchmark(),
    ".venv/bin/python benchmarks/kernels_in_situ.py": Benchmark(),
    ".venv/bin/python benchmarks/plan_quality.py --jobs 2": Benchmark(),
    ".venv/bin/python benchmarks/nnscaler_eval.py --jobs 2": Benchmark(),
    ".venv/bin/python benchmarks/nnscaler_eval.py --workloads swin-4 --jobs 2": Benchmark(),
    ".venv/bin/python benchmarks/explore_speed.py": Benchmark(),
    ".venv/bin/python benchmarks/fine_grained.py --jobs 1 --timelines fine-timelines": Benchmark(),
    ".venv/bin/python benchmarks/fine_grained.py --jobs 1 --spaces none --bound --only gpt3-175b-a100-512 "
    "--grid-best tp=4,pp=4,dp=32,microbatch=2,schedule=interleaved,virtual_stages=8,recompute=none,zero=2,"
    "sequence_parallel=True": Benchmark(),
    ".venv/bin/python benchmarks/checkpoint_reshard.py": Benchmark(),
    ".venv/bin/python benchmarks/executor_overhead.py --model gpt-small --batch 8 --steps 30 --repeats 7": Benchmark(),
    ".venv/bin/python benchmarks/executor_memory.py": Benchmark(),
    ".venv/bin/python benchmarks/zero_and_zb.py": Benchmark(),
    ".venv/bin/python benchmarks/coshard_swin.py --cluster dgx-a100-40g --nodes 4 --global-batch 32": Benchmark(),
}


def _documented() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for block, cmd in all_commands():
        out.setdefault(cmd, []).append(block.where)
    return out


# ------------------------------------------------------------------------------- the table


def test_every_fence_names_its_language():
    """So that no command hides in an untagged block: sh, python, json, text, ..."""
    untagged = [b.where for p in documents() for b in blocks(p) if not b.lang]
    assert not untagged, f"fenced blocks without a language: {untagged}"


def test_every_documented_command_is_accounted_for():
    missing = {c: w for c, w in _documented().items() if c not in COMMANDS}
    assert not missing, (
        "commands in the docs without an entry in tests/test_docs.py COMMANDS (run it there, name "
        "the test that runs it, or say why it cannot run on one CPU machine):\n"
        + "\n".join(f"  {c!r}  ({', '.join(w)})" for c, w in missing.items())
    )


def test_every_entry_is_documented():
    stale = [c for c in COMMANDS if c not in _documented()]
    assert not stale, f"COMMANDS entries no document holds any more: {stale}"


def _test_exists(node: str) -> bool:
    path, _, name = node.partition("::")
    name, _, param = name.partition("[")
    file = ROOT / path
    if not file.is_file():
        return False
    funcs = {n.name for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.FunctionDef)}
    if name not in funcs:
        return False
    param = param.rstrip("]")
    if name == "test_document_runs":
        return (ROOT / ("README.md" if param == "README.md" else f"docs/{param}")).is_file()
    if name == "test_notebook_runs_top_to_bottom":
        return (ROOT / "notebooks" / f"{param}.ipynb").is_file()
    return True


@pytest.mark.parametrize("cmd", [c for c, e in COMMANDS.items() if isinstance(e, ByTest)])
def test_the_named_test_exists(cmd):
    assert _test_exists(COMMANDS[cmd].node), f"{COMMANDS[cmd].node} (for {cmd!r}) does not exist"


def _script_options(path: Path) -> set[str]:
    """The option strings a script's argparse parser accepts (read from its source)."""
    opts = {"-h", "--help"}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            opts |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return opts


@pytest.mark.parametrize("cmd", [c for c, e in COMMANDS.items() if isinstance(e, Benchmark)])
def test_benchmark_scripts_exist_and_take_the_options_shown(cmd):
    argv = shlex.split(cmd)
    assert argv[0] == ".venv/bin/python" and argv[1].startswith("benchmarks/"), cmd
    script = ROOT / argv[1]
    assert script.is_file(), f"{cmd!r}: no {script}"
    shown = {a.split("=")[0] for a in argv[2:] if a.startswith("-")}
    assert shown <= _script_options(script), f"{cmd!r}: {sorted(shown - _script_options(script))} not accepted"


def test_suite_commands_name_existing_tests():
    for cmd, entry in COMMANDS.items():
        if isinstance(entry, Elsewhere) and " -m pytest" in cmd:
            for arg in shlex.split(cmd):
                if arg.startswith("tests/"):
                    assert (ROOT / arg).is_file(), f"{cmd!r}: no {arg}"


# --------------------------------------------------------------- running the documents


def _runnable(path: Path) -> bool:
    return any(
        (b.lang == "python" and b.runs)
        or b.file
        or (b.lang in SHELL and any(isinstance(COMMANDS.get(c), Run) for c in commands(b)))
        for b in blocks(path)
    )


def _env_prefix(argv: list[str], cwd: Path) -> tuple[dict[str, str], list[str]]:
    env = {}
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        k, v = argv.pop(0).split("=", 1)
        env[k] = str(cwd) if v == "." else v
    return env, argv


def _run_command(cmd: str, cwd: Path, monkeypatch, where: str) -> None:
    from planlab.cli import main

    env, argv = _env_prefix(shlex.split(cmd), cwd)
    if argv and argv[0] == "planlab":  # in this process, as the console script would run it
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            code = main(argv[1:])
    else:
        bindir = os.path.dirname(sys.executable)
        full = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""), **env)
        code = subprocess.run(cmd, shell=True, cwd=cwd, env=full, executable="/bin/bash").returncode
    assert code == 0, f"{where}: {cmd!r} exited with status {code}"


@pytest.mark.parametrize("name", [p.name for p in documents() if _runnable(p)])
def test_document_runs(name, tmp_path, monkeypatch):
    """The document's blocks in order, in a fresh directory: files written, Python blocks run in
    one namespace, the commands COMMANDS marks Run run (scaled down where it says)."""
    path = ROOT / name if name == "README.md" else ROOT / "docs" / name
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    before = set(sys.modules)
    namespace: dict = {"__name__": f"doc_{path.stem}"}
    try:
        for block in blocks(path):
            if block.file:
                (tmp_path / block.file).write_text(block.text)
            elif block.lang == "python" and block.runs:
                exec(compile(block.text, block.where, "exec"), namespace)
            elif block.lang in SHELL:
                for cmd in commands(block):
                    entry = COMMANDS.get(cmd)
                    if isinstance(entry, Run):
                        _run_command(entry.instead or cmd, tmp_path, monkeypatch, block.where)
    finally:  # the document's own modules (mymodels, myspaces) are not another document's
        for mod in set(sys.modules) - before:
            if getattr(sys.modules[mod], "__file__", "") and str(tmp_path) in str(sys.modules[mod].__file__):
                del sys.modules[mod]


# --------------------------------------------------------------------- generated pages


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_reference_is_current():
    """docs/cli.md's option tables are what python docs/make_cli_md.py writes from the parser,
    and every option of every subcommand appears in it."""
    gen = _load(ROOT / "docs" / "make_cli_md.py")
    text = gen.CLI_MD.read_text()
    assert gen.render(text) == text, "docs/cli.md is out of date: run python docs/make_cli_md.py"
    for name, parser in gen.subcommands().items():
        assert f"## planlab {name}" in text
        for action in gen.options(parser):
            for opt in action.option_strings or [action.dest]:
                assert f"`{opt}`" in text, f"planlab {name} {opt} is not in docs/cli.md"


def test_plan_format_page_matches_the_code():
    from planlab.plan import PLAN_VERSION
    from planlab.plan.plan import PHASES, READ_VERSIONS
    from planlab.plan.plan_file import FORMAT, plan_to_dict

    text = (ROOT / "docs" / "plan-format.md").read_text()
    assert f"# The plan file (format version {PLAN_VERSION})" in text
    assert f"The current version is **{PLAN_VERSION}**" in text
    *first, last = [f"**{v}**" for v in READ_VERSIONS]
    assert "reads versions " + ", ".join(first) + " and " + last in text
    assert f'"format": "{FORMAT}"' in text
    documented = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    from conftest import traced
    from planlab.search_spaces import Context, get_space

    spec, g = traced("gpt-tiny", 8)
    plan = get_space("megatron").build(
        Context(g, spec, 8, "cpu", 2, 2, 1), dict(dp=2, tp=1, pp=1, microbatch=4, recompute="full", zero=1)
    )
    d = plan_to_dict(plan)
    assert set(d) <= documented, f"plan file fields not in docs/plan-format.md: {set(d) - documented}"
    fields = {k for o in d["ops"] + d["placements"] for k in o}
    assert "recompute" in fields and fields <= documented, f"not in docs/plan-format.md: {fields - documented}"
    for phase in PHASES:
        assert f"`{phase}`" in text


def test_readme_links_the_docs_and_notebooks():
    readme = (ROOT / "README.md").read_text()
    for p in sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert p.relative_to(ROOT).as_posix() in readme, f"README.md does not link {p.relative_to(ROOT)}"


def test_readme_is_a_front_page():
    """What planlab is, install, the two commands, the tour and links: at most 10 KB."""
    readme = (ROOT / "README.md").read_bytes()
    assert len(readme) <= 10 * 1024, f"README.md is {len(readme):,} bytes; move design notes and tables to docs/"
    text = readme.decode()
    for part in ("## Install", "## The two commands", "## A five-minute tour", "## Documentation"):
        assert part in text
