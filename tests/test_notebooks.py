"""The notebooks run top to bottom (nbclient, this environment's python3 kernel, matplotlib's Agg
backend, a fresh working directory each), and the committed files hold no outputs and match
their sources in notebooks/src (python notebooks/make_notebooks.py writes them)."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SLOW = {"03_calibrate_run_compare"}  # calibrates this machine and runs a plan on 2 processes
CELL_TIMEOUT_S = 600


def _maker():
    spec = importlib.util.spec_from_file_location("make_notebooks", ROOT / "notebooks" / "make_notebooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_source_has_its_notebook_and_they_agree():
    maker = _maker()
    sources = sorted(maker.SOURCES.glob("*.py"))
    assert sources and [maker.target(s) for s in sources] == NOTEBOOKS
    for src in sources:
        assert maker.render(src) == maker.target(src).read_text(), (
            f"{maker.target(src).name} differs from {src.name}: run python notebooks/make_notebooks.py"
        )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebooks_have_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: cell {cell.id} has outputs"
        assert not cell.get("attachments"), f"{path.name}: cell {cell.id} has attachments"


@pytest.mark.parametrize(
    "path", [pytest.param(p, marks=pytest.mark.slow) if p.stem in SLOW else p for p in NOTEBOOKS], ids=lambda p: p.stem
)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    # the kernel is this environment's Python (jupyter_client starts sys.executable for "python3"), and
    # PATH lacks the environment, as for a kernel nbclient starts: a notebook must not find planlab there
    venv = os.path.dirname(sys.executable)
    without = os.pathsep.join(
        p for p in os.environ.get("PATH", "").split(os.pathsep) if p and os.path.realpath(p) != os.path.realpath(venv)
    )
    monkeypatch.setenv("PATH", without)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors


def test_notebooks_run_planlab_from_python_never_through_path():
    """A shell cell (``%%bash planlab ...``) or a PATH edit would need the environment on PATH."""
    for src in sorted((ROOT / "notebooks" / "src").glob("*.py")):
        text = src.read_text()
        assert "%%bash" not in text and 'os.environ["PATH"]' not in text, src.name
