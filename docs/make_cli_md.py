"""Write the option tables of docs/cli.md from planlab's argument parser (planlab/cli.py).

Each subcommand's section in cli.md holds a table between two markers::

    <!-- BEGIN generated: planlab explore -->
    ...
    <!-- END generated: planlab explore -->

which this script rewrites from ``build_parser()``; the prose around the markers is written by
hand. A subcommand without markers is an error, so a new subcommand needs its section first.

    python docs/make_cli_md.py          # rewrite the tables
    python docs/make_cli_md.py --check  # exit 1 if cli.md is out of date (tests/test_docs.py)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

CLI_MD = Path(__file__).resolve().parent / "cli.md"
BEGIN, END = "<!-- BEGIN generated: planlab {} -->", "<!-- END generated: planlab {} -->"


# Descriptions of the options whose ``help`` planlab/cli.py leaves out (its help wins once it has one).
NOTES = {
    ("explore", "--nodes"): "nodes of the cluster",
    ("explore", "--global-batch"): "samples per iteration (default: the larger of 8 and the device count)",
    ("run", "plan"): "a plan file (planlab explore --out, planlab.save_plan)",
    ("run", "--steps"): "training iterations",
    ("run", "--lr"): "Adam's learning rate",
    ("run", "--no-check"): "skip the single-process reference and the numeric check",
    ("simulate", "plan"): "a plan file",
    ("simulate", "--json"): "print one JSON object instead of the tables",
    ("graph", "--global-batch"): "samples in the example inputs",
}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """planlab's subparsers by name, in the order ``planlab --help`` lists them."""
    from planlab.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's arguments but ``--help``."""
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(name: str, parser: argparse.ArgumentParser) -> str:
    """The markdown table of one subcommand's arguments."""
    acts = options(parser)
    if not acts:
        return f"`planlab {name}` takes no options but `--help`."
    rows = ["| argument | value | default | description |", "|---|---|---|---|"]
    for a in acts:
        flag = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.dest}` (positional)"
        if isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            value = "(a flag)"
        else:
            value = f"`{a.metavar or (a.dest.upper() if a.option_strings else a.dest)}`"
        notes = []
        if a.required and a.option_strings:
            notes.append("required")
        if isinstance(a, argparse._AppendAction):
            notes.append("repeatable")
        default = "" if a.default is None or a.default is False or a.required else f"`{a.default}`"
        desc = (a.help or NOTES.get((name, (a.option_strings or [a.dest])[-1]), "")).rstrip(".")
        desc = "; ".join(x for x in [desc] + notes if x)
        rows.append(f"| {flag} | {_cell(value)} | {_cell(default)} | {_cell(desc)} |")
    return "\n".join(rows)


def render(text: str) -> str:
    """``text`` (cli.md) with every generated table rewritten; SystemExit names a missing section."""
    subs = subcommands()
    stale = [
        k
        for k in NOTES
        if k[0] not in subs
        or not any(k[1] in (a.option_strings or [a.dest]) and not a.help for a in options(subs[k[0]]))
    ]
    if stale:
        raise SystemExit(f"{__file__}: NOTES for {stale}: no such option, or the parser has its help now")
    for name, parser in subs.items():
        b, e = BEGIN.format(name), END.format(name)
        pat = re.compile(re.escape(b) + r".*?" + re.escape(e), re.S)
        if not pat.search(text):
            raise SystemExit(f"{CLI_MD}: no section for `planlab {name}`: write one with the lines\n{b}\n{e}")
        text = pat.sub(lambda m: f"{b}\n{table(name, parser)}\n{e}", text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    args = p.parse_args(argv)
    old = CLI_MD.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print(f"{CLI_MD} is out of date with planlab/cli.py: run python docs/make_cli_md.py", file=sys.stderr)
            return 1
        return 0
    CLI_MD.write_text(new)
    print(f"wrote {CLI_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
