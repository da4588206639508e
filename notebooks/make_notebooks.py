"""Write ``notebooks/*.ipynb`` from their sources ``notebooks/src/*.py``.

A source is a Python file in the "percent" format (as jupytext reads it): a line ``# %%``
starts a code cell, ``# %% [markdown]`` a markdown cell whose lines are comments (``# text``);
in code cells, IPython magics are written as comments (``# %time x = f()``), and a cell that
starts with a cell magic (``# %%bash``) is commented whole, so that the source stays valid Python. Lines before the first marker are the source file's own header and
are left out. The
notebooks are written without outputs or execution counts, with stable cell ids, so that
regenerating an unchanged source rewrites the same bytes.

    python notebooks/make_notebooks.py          # write every notebook
    python notebooks/make_notebooks.py --check  # exit 1 if a notebook differs from its source
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "src"
MARKER = re.compile(r"^# %%( \[markdown\])?\s*$")
MAGIC = re.compile(r"^# (%.*)$")  # a commented IPython magic in a code cell
METADATA = {
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


def _cells(text: str) -> list[tuple[str, list[str]]]:
    """``(kind, lines)`` per cell, kind ``code`` or ``markdown``."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        m = MARKER.match(line)
        if m:
            cells.append(("markdown" if m.group(1) else "code", []))
        elif cells:
            cells[-1][1].append(line)
    return cells


def _strip_blank(lines: list[str]) -> list[str]:
    while lines and not lines[0].strip():
        lines = lines[1:]
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def build(source: Path) -> nbformat.NotebookNode:
    """The notebook of one source file (no outputs)."""
    nb = nbformat.v4.new_notebook(metadata=METADATA)
    for i, (kind, lines) in enumerate(_cells(source.read_text())):
        lines = _strip_blank(lines)
        cell_id = f"{source.stem}-{i:02d}"
        if kind == "markdown":
            bad = [x for x in lines if x.strip() and not x.startswith("#")]
            if bad:
                raise SystemExit(f"{source}: a markdown cell's lines must be comments, got {bad[0]!r}")
            text = "\n".join(x[2:] if x.startswith("# ") else x.lstrip("#") for x in lines)
            nb.cells.append(nbformat.v4.new_markdown_cell(text, id=cell_id))
        else:
            if lines and lines[0].startswith("# %%"):  # a cell magic: the whole cell is commented
                lines = [x[2:] if x.startswith("# ") else x.lstrip("#") for x in lines]
            else:
                lines = [MAGIC.sub(r"\1", x) for x in lines]
            nb.cells.append(nbformat.v4.new_code_cell("\n".join(lines), id=cell_id))
    nbformat.validate(nb)
    return nb


def target(source: Path) -> Path:
    return HERE / f"{source.stem}.ipynb"


def render(source: Path) -> str:
    """The notebook file's text, as nbformat writes it."""
    return nbformat.writes(build(source)) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    args = p.parse_args(argv)
    stale = []
    for src in sorted(SOURCES.glob("*.py")):
        text, out = render(src), target(src)
        if args.check:
            if not out.exists() or out.read_text() != text:
                stale.append(out.name)
        else:
            out.write_text(text)
            print(f"wrote {out.relative_to(HERE.parent)}")
    if stale:
        print(
            f"out of date with notebooks/src: {', '.join(stale)}; run python notebooks/make_notebooks.py",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
