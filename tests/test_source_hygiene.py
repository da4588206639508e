"""The package's source keeps the project's rules of taste (read with ``ast``, nothing imported):

- no function or method in ``planlab/`` is longer than 100 lines, and no module longer than 800;
- no module imports another module's private name (``_x``; dunders such as ``__version__`` are public);
- the modules' module-level imports form no cycle (imports under ``if TYPE_CHECKING:`` and inside
  functions are not run when the module loads; ``from planlab.plan import buffer`` is an import of
  the module ``planlab.plan.buffer``, ``from planlab.plan import Plan`` one of the package);
- every exception class is defined in ``planlab/errors.py``;
- no module keeps a module-level mutable container keyed by ``id()`` (a cache that outlives its
  objects or answers for a new object at a reused address: cache per graph with ``Graph.memo``, or
  on frozen keys), and no function rebinds a module's global (``global``);
- no ``raise ValueError`` or ``raise TypeError``: bad input raises a PlanlabError subclass naming
  the value, a broken invariant an ``InternalError`` (both in ``planlab/errors.py``).

Each test fails with the offending names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "planlab"
MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 800
BARE_ERRORS = ("ValueError", "TypeError")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.fixture(scope="module")
def sources() -> dict[str, tuple[Path, ast.Module]]:
    """Every module of the package: its name -> (path, syntax tree)."""
    return {_module_name(p): (p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))}


def long_functions(sources) -> list[str]:
    """``module.function (n lines)`` of every function longer than :data:`MAX_FUNCTION_LINES`."""
    out = []
    for mod, (_, tree) in sources.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{mod}.{node.name} ({n} lines)")
    return sorted(out)


def long_modules(sources) -> list[str]:
    """``module (n lines)`` of every module longer than :data:`MAX_MODULE_LINES`."""
    counts = {mod: len(path.read_text().splitlines()) for mod, (path, _) in sources.items()}
    return sorted(f"{mod} ({n} lines)" for mod, n in counts.items() if n > MAX_MODULE_LINES)


def bare_error_raises(sources) -> list[str]:
    """``module:line Error`` of every ``raise ValueError(...)`` or ``raise TypeError`` (a class of
    :data:`BARE_ERRORS`, called or not)."""
    out = []
    for mod, (_, tree) in sources.items():
        for node in ast.walk(tree):
            exc = node.exc.func if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) else None
            exc = exc or (node.exc if isinstance(node, ast.Raise) else None)
            if isinstance(exc, ast.Name) and exc.id in BARE_ERRORS:
                out.append(f"{mod}:{node.lineno} {exc.id}")
    return sorted(out)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(sources) -> list[str]:
    """``importer: module.name`` of every private name imported from another planlab module."""
    out = []
    for mod, (_, tree) in sources.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "planlab":
                out += [f"{mod}: {node.module}.{a.name}" for a in node.names if _private(a.name)]
    return sorted(out)


def _type_checking(node: ast.stmt) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (
        isinstance(test, ast.Name)
        and test.id == "TYPE_CHECKING"
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def module_imports(mod: str, tree: ast.Module, modules: set[str]) -> set[str]:
    """The planlab modules ``mod`` imports when it loads (see the module docstring)."""
    out = set()
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.If, ast.Try)) and not _type_checking(node):
            stack += node.body + node.orelse + getattr(node, "finalbody", []) + getattr(node, "handlers", [])
        elif isinstance(node, ast.ExceptHandler):
            stack += node.body
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module in modules:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            out |= subs
            if len(subs) < len(node.names):
                out.add(node.module)
    out.discard(mod)
    return out


def import_cycles(sources) -> list[list[str]]:
    """The cycles of the module-level import graph (one per strongly connected component)."""
    modules = set(sources)
    graph = {m: sorted(module_imports(m, tree, modules)) for m, (_, tree) in sources.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def error_classes_elsewhere(sources) -> list[str]:
    """``module.Class`` of every class outside planlab/errors.py whose base names an exception."""
    out = []
    for mod, (_, tree) in sources.items():
        if mod == "planlab.errors":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                if any(b.endswith(("Error", "Exception", "Interrupt")) for b in bases):
                    out.append(f"{mod}.{node.name}")
    return sorted(out)


MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "WeakValueDictionary"}


def _mutable_globals(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level to a new dict, list or set."""
    out = set()
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) in MUTABLE_CALLS
        )
        if mutable:
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def _calls_id(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "id" for n in ast.walk(node))


def id_keyed_globals(sources) -> list[str]:
    """``module.NAME`` of every module-level dict, list or set indexed, looked up or tested with a
    key that calls ``id()``."""
    out = set()
    for mod, (_, tree) in sources.items():
        names = _mutable_globals(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in names:
                hit = node.value.id if _calls_id(node.slice) else None
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                keyed = any(_calls_id(a) for a in node.args)
                hit = owner.id if isinstance(owner, ast.Name) and owner.id in names and keyed else None
            elif isinstance(node, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops):
                owners = [c.id for c in node.comparators if isinstance(c, ast.Name) and c.id in names]
                hit = owners[0] if owners and _calls_id(node.left) else None
            else:
                hit = None
            if hit:
                out.add(f"{mod}.{hit}")
    return sorted(out)


def global_statements(sources) -> list[str]:
    """``module:line name`` of every ``global`` statement."""
    return sorted(
        f"{mod}:{node.lineno} {', '.join(node.names)}"
        for mod, (_, tree) in sources.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Global)
    )


@pytest.mark.parametrize("check", [id_keyed_globals, global_statements], ids=["id-keyed cache", "global"])
def test_no_hidden_module_state(sources, check):
    """No module-level container keyed by ``id()`` and no ``global`` statement."""
    found = check(sources)
    assert not found, "\n".join(found)


def test_no_function_is_over_100_lines(sources):
    found = long_functions(sources)
    assert not found, "\n".join(found)


def test_no_module_is_over_800_lines(sources):
    found = long_modules(sources)
    assert not found, "\n".join(found)


def test_no_bare_value_or_type_error_is_raised(sources):
    """Bad input raises a PlanlabError subclass, a bug an InternalError (planlab/errors.py)."""
    found = bare_error_raises(sources)
    assert not found, "\n".join(found)


def test_no_private_name_is_imported_from_another_module(sources):
    found = private_imports(sources)
    assert not found, "\n".join(found)


def test_module_imports_form_no_cycle(sources):
    found = import_cycles(sources)
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_every_error_class_is_in_errors_py(sources):
    found = error_classes_elsewhere(sources)
    assert not found, "\n".join(found)


def test_the_checks_find_what_they_look_for(tmp_path):
    """Each check reports a made-up offence (the checks are not vacuous)."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    raises = "def f(x):\n    if x:\n        raise ValueError(x)\n    raise TypeError\n    raise RuntimeError(x)\n"
    fake = {
        "planlab.a": (None, ast.parse(f"from planlab.b import _hidden, shown\ndef big():\n{body}\n")),
        "planlab.b": (None, ast.parse("import planlab.a\nclass Oops(ValueError):\n    pass\n" + raises)),
    }
    assert bare_error_raises(fake) == ["planlab.b:6 ValueError", "planlab.b:7 TypeError"]
    sizes = {}
    for name, n in (("long", MAX_MODULE_LINES + 1), ("short", MAX_MODULE_LINES)):
        (tmp_path / f"{name}.py").write_text("x = 1\n" * n)
        sizes[f"planlab.{name}"] = (tmp_path / f"{name}.py", None)
    assert long_modules(sizes) == [f"planlab.long ({MAX_MODULE_LINES + 1} lines)"]
    assert long_functions(fake) == [f"planlab.a.big ({MAX_FUNCTION_LINES + 1} lines)"]
    assert private_imports(fake) == ["planlab.a: planlab.b._hidden"]
    assert import_cycles(fake) == [["planlab.a", "planlab.b"]]
    assert error_classes_elsewhere(fake) == ["planlab.b.Oops"]
    cached = (
        "_A: dict = {}\n_B = dict()\n_C = []\n_OK = {}\n_SEEN = False\n"
        "def f(g):\n    global _SEEN\n    hit = _A.get(id(g))\n    _B[(id(g), 1)] = 1\n"
        "    if id(g) in _C:\n        pass\n    _OK[g.name] = id(g)\n"
    )
    fake = {"planlab.c": (None, ast.parse(cached))}
    assert id_keyed_globals(fake) == ["planlab.c._A", "planlab.c._B", "planlab.c._C"]
    assert global_statements(fake) == ["planlab.c:7 _SEEN"]
    typed = {
        "planlab.a": (None, ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import planlab.b\n")),
        "planlab.b": (None, ast.parse("def f():\n    import planlab.a\n")),
    }
    assert import_cycles(typed) == []
