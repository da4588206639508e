"""The cache of traced graphs (planlab.models.trace_cache): what it returns is what tracing
returns, a second use neither traces nor imports torch, and a bad entry or folder is never a crash."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import pickle
import subprocess
import sys

import pytest

from planlab.models import ModelSpec
from planlab.models import trace_cache as tc
from planlab.models.trace_cache import TraceKey, cache_dir, trace_model

SPEC = ModelSpec("gpt-tiny")


def _same_graph(a, b) -> None:
    assert a.tensors == b.tensors and a.inputs == b.inputs and a.loss == b.loss and a.labels == b.labels
    assert [
        (o.name, o.kind, o.inputs, o.outputs, str(o.signature), o.dim_sizes, o.flops, o.bytes_moved, o.saves)
        for o in a.operators
    ] == [
        (o.name, o.kind, o.inputs, o.outputs, str(o.signature), o.dim_sizes, o.flops, o.bytes_moved, o.saves)
        for o in b.operators
    ]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(tc.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_cached_graph_is_the_traced_graph_and_simulates_the_same(cache):
    from conftest import traced
    from planlab.costmodel import CostModel
    from planlab.plan import materialize
    from planlab.search_spaces import Context, get_space
    from planlab.simulator import simulate

    first = trace_model(SPEC, 8)
    (entry,) = cache.iterdir()
    again = trace_model(SPEC, 8)
    assert again is not first and all(op.call is None for op in again.operators)
    spec, full = traced("gpt-tiny", 8)
    _same_graph(first, full)
    _same_graph(again, full)
    cost = CostModel.load("cpu", 4)
    plan = get_space("megatron").build(
        Context(full, spec, 8, "cpu", 4, 4, 1), dict(dp=1, tp=2, pp=2, microbatch=2, schedule="1f1b")
    )
    results = [simulate(materialize(plan, g, symmetric=True), cost) for g in (full, again)]
    assert results[0] == results[1]
    assert trace_model(SPEC, 4) is not None and len(list(cache.iterdir())) == 2  # the batch is in the key


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_bytes(b"not a pickle"),
        lambda p: p.write_bytes(p.read_bytes()[:100]),  # a partial write
        lambda p: p.write_bytes(pickle.dumps((tc.ENTRY_FORMAT, "another key", None))),
        lambda p: p.write_bytes(pickle.dumps(("a list", 3))),
    ],
)
def test_a_corrupt_or_foreign_entry_is_traced_again_and_rewritten(cache, damage):
    trace_model(SPEC, 8)
    (entry,) = cache.iterdir()
    damage(entry)
    _same_graph(trace_model(SPEC, 8), trace_model(ModelSpec("gpt-tiny"), 8))
    fmt, key, traced = pickle.loads(entry.read_bytes())
    assert fmt == tc.ENTRY_FORMAT and key == TraceKey.of(SPEC, 8) and len(traced.graph.operators) > 10


def test_a_loaded_graph_holds_what_a_build_derives_from_the_graph_alone(cache, monkeypatch):
    """The block runs and the analyses the build reads come with a cached graph, equal to what the
    graph gives when derived again, and a build from it does not derive them."""
    from planlab.plan import template
    from planlab.plan.fused_gemms import fused_groups
    from planlab.plan.passes.layouts import batch_axes, whole_batch_read
    from planlab.plan.shared_params import forward_only_of, no_grad_of
    from planlab.plan.template import BLOCK_RUNS_KEY, block_runs

    spec = ModelSpec("evoformer-tiny", (("blocks", 4), ("recycles", 2)))
    trace_model(spec, 8)
    loaded = trace_model(spec, 8)
    kept = dict(loaded.memo_entries())
    assert BLOCK_RUNS_KEY in kept and len(kept) >= 6
    fresh = tc.for_planning(loaded)  # the same tables, an empty memo
    assert fresh.memo_entries() == ()
    for analysis in (block_runs, no_grad_of, forward_only_of, fused_groups, batch_axes, whole_batch_read):
        assert analysis(loaded) == analysis(fresh)
    assert len(block_runs(loaded)) > 4

    def derived_again(graph):
        raise AssertionError("the block runs were derived again")

    monkeypatch.setattr(template, "_block_runs", derived_again)
    assert block_runs(trace_model(spec, 8)) == block_runs(fresh)


def test_the_key_holds_the_spec_batch_planlab_source_torch_and_python(cache, monkeypatch):
    base = TraceKey.of(SPEC, 8)
    assert base.planlab_source_sha256 == tc.source_digest() and len(base.torch_version_sha256) == 64
    assert TraceKey.of(ModelSpec("gpt-tiny", (("layers", 3),)), 8).file_name() != base.file_name()
    assert TraceKey.of(SPEC, 16).file_name() != base.file_name()
    trace_model(SPEC, 8)
    monkeypatch.setattr(tc, "source_digest", lambda: "an edited checkout")
    edited = TraceKey.of(SPEC, 8)
    assert edited != base and edited.file_name() == base.file_name()
    trace_model(SPEC, 8)  # the stale entry is traced again and written over: one file per model and batch
    (entry,) = cache.iterdir()
    assert pickle.loads(entry.read_bytes())[1] == edited


def _trace_in_child(folder: str) -> int:
    import os

    os.environ[tc.CACHE_ENV] = folder
    return len(trace_model(SPEC, 8).operators)


def test_concurrent_writers_leave_one_whole_entry(cache):
    with mp.get_context("spawn").Pool(3) as pool:
        counts = pool.map(_trace_in_child, [str(cache)] * 3)
    assert len(set(counts)) == 1
    (entry,) = [p for p in cache.iterdir()]  # no temporary file left behind
    assert pickle.loads(entry.read_bytes())[1] == TraceKey.of(SPEC, 8)


def test_no_cache_where_it_cannot_or_should_not_be(tmp_path, monkeypatch):
    monkeypatch.setenv(tc.CACHE_ENV, "")
    assert cache_dir() is None and trace_model(SPEC, 8) is not None
    monkeypatch.delenv(tc.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "planlab"
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder would be")
    monkeypatch.setenv(tc.CACHE_ENV, str(blocker / "cache"))
    assert trace_model(SPEC, 8) is not None  # unwritable: traced, not cached, no error


def test_users_models_and_registered_ops_are_not_cached(cache, monkeypatch):
    import planlab.graph.registry as registry

    assert len(trace_model(ModelSpec("test_user_model:classifier"), 8).operators) > 3
    assert not cache.exists() or not list(cache.iterdir())
    monkeypatch.setattr(registry, "user_functions", lambda: (len,))
    trace_model(SPEC, 8)
    assert not cache.exists() or not list(cache.iterdir())


def test_a_second_simulate_imports_neither_torch_nor_pandas(cache, tmp_path):
    """`planlab simulate` of a built-in model's plan, after the first: the graph comes from the
    cache, so the process imports no torch (seconds to import) and no pandas."""
    from planlab.plan import save_plan
    from planlab.search_spaces import Context, get_space

    g = trace_model(SPEC, 8)
    plan = get_space("megatron").build(Context(g, SPEC, 8, "cpu", 2, 2, 1), dict(dp=1, tp=2, pp=1, microbatch=4))
    save_plan(plan, tmp_path / "plan.json")
    code = (
        "import sys; from planlab.cli import main; main(['simulate', sys.argv[1], '--json']); "
        "print(sorted(m for m in ('torch', 'pandas', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "plan.json")],
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, tc.CACHE_ENV: str(cache)},
    ).stdout.splitlines()
    assert json.loads(out[0])["feasible"] and out[1] == "[]"


def test_lazy_packages_keep_functions_where_submodules_share_their_names():
    code = (
        "import sys, planlab; assert 'torch' not in sys.modules and 'pandas' not in sys.modules; "
        "import planlab.explore; from planlab.explore import Setup; from planlab.graph import trace; "
        "import planlab.graph.trace; from planlab.models import GPT, ModelSpec; "
        "assert callable(planlab.explore) and planlab.explore.__module__ == 'planlab.explore'; "
        "assert trace is planlab.trace is planlab.graph.trace and trace.__module__ == 'planlab.graph.trace'; "
        "print(GPT.__name__, ModelSpec.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["GPT", "planlab.models.spec"]


def test_an_exploration_of_a_cached_trace_imports_no_torch(cache, tmp_path):
    """`planlab explore` of a built-in model whose trace is cached reads the model's config and the
    graph without torch (its models' configs and presets load apart from their modules), and writes
    its plots."""
    trace_model(SPEC, 8)
    code = (
        "import sys; from planlab.cli import main; "
        "main(['explore', '--model', 'gpt-tiny', '--cluster', 'cpu', '--nodes', '2', '--global-batch', '8', "
        "'--set', 'tp=2', '--set', 'pp=1', '--out', sys.argv[1]]); print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, tc.CACHE_ENV: str(cache)},
    ).stdout.splitlines()
    assert out[-1] == "False"
    assert (tmp_path / "out" / "timeline.png").stat().st_size > 1000


def test_a_cached_program_is_the_built_program_and_a_changed_setup_builds_it_again(cache, tmp_path, capsys):
    """`planlab simulate` keeps the plan's Program beside the graph: a second run loads it and prints
    the same; another precision, or an entry holding another key, builds it again; stragglers do not use it."""
    from planlab.cli import main
    from planlab.costmodel import CostModel
    from planlab.plan import save_plan
    from planlab.plan.program_cache import PROGRAM_FORMAT, cached_program
    from planlab.plan.software_passes import build_program
    from planlab.search_spaces import Context, get_space

    graph = trace_model(SPEC, 8)
    plan = get_space("megatron").build(
        Context(graph, SPEC, 8, "cpu", 2, 2, 1), dict(dp=1, tp=1, pp=2, microbatch=2, schedule="1f1b")
    )
    save_plan(plan, tmp_path / "plan.json")
    printed = []
    for _ in range(2):
        assert main(["simulate", str(tmp_path / "plan.json"), "--json"]) == 0
        printed.append(capsys.readouterr().out)
    (entry,) = cache.glob("program-*.pkl")
    assert printed[0] == printed[1]
    cost = CostModel.load("cpu", 2)
    assert cached_program(plan, graph, cost) == build_program(plan, graph, cost)
    other = CostModel.load("cpu", 2, precision="bf16")
    assert other.precision != cost.precision
    assert cached_program(plan, graph, other) == build_program(plan, graph, other)
    assert len(list(cache.glob("program-*.pkl"))) == 2
    fmt, key, program = pickle.loads(entry.read_bytes())
    entry.write_bytes(pickle.dumps((PROGRAM_FORMAT, dataclasses.replace(key, plan_sha256="another plan"), program)))
    assert cached_program(plan, graph, cost) == build_program(plan, graph, cost)  # written again
    assert pickle.loads(entry.read_bytes())[1] == key
    assert main(["simulate", str(tmp_path / "plan.json"), "--straggler", "1=1.5"]) == 0
