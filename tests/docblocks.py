"""Fenced code blocks of the README and docs/*.md, and the shell commands in them (for test_docs.py).

A block's info string is its language and optional words: ``python notest`` (not run: a
signature or a fragment), ``python file=NAME`` (written to NAME in the document's working
directory instead of run; any language). Commands are the lines of ``sh`` blocks, with
backslash continuations joined, trailing ``# comments`` dropped, and ``&&`` or ``;`` lists split
into their commands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHELL = ("sh", "bash", "shell", "console")
FENCE = re.compile(r"^(`{3,})(.*)$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    words: tuple[str, ...] = ()
    text: str = ""
    options: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def file(self) -> str | None:
        return self.options.get("file")

    @property
    def runs(self) -> bool:
        return "notest" not in self.words and self.file is None


def documents() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown file, in order."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        ticks, info = m.group(1), m.group(2).split()
        j = i + 1
        while j < len(lines) and not lines[j].startswith(ticks):
            j += 1
        words = tuple(info[1:])
        opts = dict(w.split("=", 1) for w in words if "=" in w)
        out.append(Block(path, i + 1, info[0] if info else "", words, "\n".join(lines[i + 1 : j]) + "\n", opts))
        i = j + 1
    return out


def _drop_comment(line: str) -> str:
    quote = None
    for k, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k]
    return line


def _split_list(line: str) -> list[str]:
    parts, cur, quote, k = [], "", None, 0
    while k < len(line):
        ch = line[k]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif line.startswith("&&", k) or ch == ";":
            parts.append(cur)
            cur, k = "", k + (2 if ch == "&" else 1)
            continue
        cur += ch
        k += 1
    return parts + [cur]


def commands(block: Block) -> list[str]:
    """The commands of a shell block, whitespace normalised."""
    out, pending = [], ""
    for raw in block.text.splitlines():
        line = pending + _drop_comment(raw).rstrip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        line = re.sub(r"^\$\s+", "", line.strip())
        out += [" ".join(c.split()) for c in _split_list(line) if c.strip()]
    return out


def all_commands() -> list[tuple[Block, str]]:
    return [(b, c) for p in documents() for b in blocks(p) if b.lang in SHELL and b.file is None for c in commands(b)]
