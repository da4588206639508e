"""A cache of traced graphs on disk, so that a second ``planlab simulate`` or ``explore`` of a model
does not build and trace it again (nor import torch to do so).

An entry is keyed by everything the trace depends on (:class:`TraceKey`): the model's
specification and batch, planlab's version and the digest of its own source files, torch's
version file and Python's version. It lives in ``$PLANLAB_CACHE_DIR`` if set (empty: no cache),
else ``$XDG_CACHE_HOME/planlab`` or ``~/.cache/planlab``, as a pickle of ``(ENTRY_FORMAT, key,
Traced)`` written to a temporary file and renamed into place, so that concurrent writers leave one
whole entry. An entry that does not load, or holds another key, is ignored and written again; a
folder that cannot be written leaves the graph uncached. Beside the graph the entry keeps what the
build derives from the graph alone (:func:`derived`: the structural template's block runs and the
analyses it and the layouts read), put back into a loaded graph's memo, so that a build in a new
process does not derive it again. Never cached: users' models
(``package.module:function``, whose code planlab cannot version) and any trace made after
:func:`planlab.register_op` registered one of torch's functions (it changes a built-in model's trace).

The cached graph is for planning: its operators carry no call (``Operator.call`` is None),
since the executor builds and traces the model itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import pickle
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from planlab.graph.ir import Graph
from planlab.models.spec import ModelSpec, is_user_model

CACHE_ENV = "PLANLAB_CACHE_DIR"
# the layout of an entry: (ENTRY_FORMAT, TraceKey, Traced); 2: the Graph is frozen, pickled by its tables;
# 3: a Traced, the graph with what is derived from it alone
ENTRY_FORMAT = 3


def cache_dir() -> Path | None:
    """Where traced graphs are kept: ``$PLANLAB_CACHE_DIR`` (empty: None, no cache), else
    ``$XDG_CACHE_HOME/planlab``, else ``~/.cache/planlab``."""
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return Path(env) if env else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "planlab"


def _files_digest(paths: list[Path], root: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def source_digest() -> str:
    """SHA-256 of planlab's own Python files (an edited checkout traces differently)."""
    root = Path(__file__).resolve().parents[1]
    return _files_digest(sorted(root.rglob("*.py")), root)


def torch_digest() -> str:
    """SHA-256 of torch's ``version.py`` (its version and git commit), found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return "no torch"
    root = Path(next(iter(spec.submodule_search_locations)))
    return _files_digest([root / "version.py"], root) if (root / "version.py").is_file() else "no torch version"


@dataclass(frozen=True)
class TraceKey:
    """Everything a traced graph depends on."""

    model: ModelSpec
    batch: int
    planlab_version: str
    planlab_source_sha256: str
    torch_version_sha256: str
    python: str

    @classmethod
    def of(cls, spec: ModelSpec, batch: int) -> "TraceKey":
        from planlab import __version__

        return cls(spec, batch, __version__, source_digest(), torch_digest(), sys.version.split()[0])

    def file_name(self) -> str:
        """One file per model and batch: an entry of another planlab, torch or Python is stale,
        found so on reading (its key differs) and written over, so the folder does not grow."""
        return f"graph-{hashlib.sha256(repr((self.model, self.batch)).encode()).hexdigest()[:32]}.pkl"


@dataclass(frozen=True)
class Traced:
    """A cache entry's value: the graph, and what the build derives from it alone (:func:`derived`),
    as ``(memo key, value)`` pairs of the graph's memo."""

    graph: Graph
    memo: tuple[tuple[tuple, object], ...]

    def loaded(self) -> Graph:
        """The graph with its derived values in its memo."""
        for key, value in self.memo:
            self.graph.memo(key, lambda value=value: value)
        return self.graph


def derived(graph: Graph) -> tuple[tuple[tuple, object], ...]:
    """What every build derives from ``graph`` alone, as the ``(memo key, value)`` pairs of the
    graph's memo, ``graph`` fresh from tracing (its memo empty): the structural template's block runs
    (:func:`planlab.plan.template.block_runs`, about 10 us an operator) and the analyses it and the
    layouts read (what a detach cuts off, fused GEMMs, batch axes, an operator reading the batch
    whole, the operators' forms at the traced shapes, the activations holding a constant). The entry's key holds planlab's source digest, so a loaded value is what this planlab
    would derive."""
    from planlab.plan.fused_gemms import fused_groups
    from planlab.plan.passes.layouts import batch_axes, traced_forms, whole_batch_read
    from planlab.plan.shared_params import constants_of, forward_only_of, no_grad_of
    from planlab.plan.template import block_runs

    for analysis in (
        no_grad_of,
        forward_only_of,
        constants_of,
        fused_groups,
        batch_axes,
        whole_batch_read,
        traced_forms,
        block_runs,
    ):
        analysis(graph)
    return graph.memo_entries()


def for_planning(graph: Graph) -> Graph:
    """A copy of ``graph`` whose operators carry no call (what the executor would run): plain data
    that pickles without torch. Whether each draws random numbers, which its call told, is kept."""
    from planlab.graph.random_ops import draws_random

    ops = [dataclasses.replace(op, call=None, random=draws_random(op)) for op in graph.operators]
    return Graph(dict(graph.tensors), ops, graph.inputs, graph.loss, dict(graph.labels), graph.unknown)


def _builtin_ops_registered() -> bool:
    """Whether :func:`planlab.register_op` registered, in this process, a function that planlab's
    models may call (torch's, Python's own): that changes a built-in model's trace. A user's own
    functions do not appear in planlab's models."""
    registry = sys.modules.get("planlab.graph.registry")
    if registry is None:
        return False
    return any(
        (getattr(fn, "__module__", None) or "").split(".")[0] in _CALLED_BY_MODELS for fn in registry.user_functions()
    )


_CALLED_BY_MODELS = ("torch", "builtins", "_operator", "operator", "math")


def cacheable(spec: ModelSpec) -> bool:
    """Whether what is derived from ``spec``'s trace may be cached: not for a user's model, nor
    after :func:`planlab.register_op` registered one of the functions planlab's models call."""
    return not is_user_model(spec.name) and not _builtin_ops_registered()


def read_entry(path: Path, entry_format: int, key, kind: type):
    """The value of the cache entry at ``path``, a pickle of ``(entry_format, key, value)``, if it
    loads, holds that format and key and a ``kind``; else None."""
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f)
    except Exception:  # noqa: BLE001 - a missing, partial or foreign entry is made again
        return None
    if not (isinstance(entry, tuple) and len(entry) == 3 and entry[0] == entry_format and entry[1] == key):
        return None
    return entry[2] if isinstance(entry[2], kind) else None


def write_entry(folder: Path, path: Path, entry: tuple) -> None:
    """Write ``entry`` to ``path`` in ``folder`` (a temporary file renamed into place); a folder
    that cannot be written leaves it unwritten."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=path.name + ".", suffix=".tmp")
    except OSError:
        return  # an unwritable cache folder: the value stays uncached
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


def trace_model(spec: ModelSpec, batch: int) -> Graph:
    """The graph of ``spec`` at ``batch`` samples, for planning (:func:`for_planning`): from the
    cache when an entry of the same :class:`TraceKey` loads, else built, traced and stored."""
    folder = cache_dir()
    if folder is not None and cacheable(spec):
        key = TraceKey.of(spec, batch)
        path = folder / key.file_name()
        entry = read_entry(path, ENTRY_FORMAT, key, Traced)
        if entry is not None:
            graph = entry.loaded()
            for what in graph.unknown:
                warnings.warn(f"planlab: no signature for {what}; it is kept whole", stacklevel=2)
            return graph
    from planlab.graph.trace import trace
    from planlab.models.registry import build_model

    model, inputs = build_model(spec, batch=batch)
    graph = for_planning(trace(model, inputs))
    if folder is not None and cacheable(spec):
        write_entry(folder, path, (ENTRY_FORMAT, key, Traced(graph, derived(graph))))
    return graph
