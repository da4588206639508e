"""Every number of a built-in spec or software file names where it comes from.

A JSON object with a ``source`` object must give every field that is not text (numbers, flags,
lists, objects) a non-empty entry there; an object without its own ``source`` is covered by its
parent's entry for it. So a number added without its source fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planlab.costmodel.hardware import DEVICES_FILE, SPEC_DIR
from planlab.costmodel.software import SOFTWARE_DIR

FILES = sorted(SPEC_DIR.glob("*.json")) + sorted(SOFTWARE_DIR.glob("*.json"))
UNSOURCED = ("PROVISIONAL", "TODO", "TBD", "fitted to the validation")


def unsourced(obj: dict, where: str) -> list[str]:
    """The fields of ``obj`` (and of its objects, recursively) that name no source."""
    missing = []
    sources = obj.get("source", {})
    for key, value in obj.items():
        if key == "source" or key.startswith("_") or isinstance(value, str):
            continue
        if isinstance(value, dict) and "source" in value:  # an object with its own sources
            missing += unsourced(value, f"{where}.{key}")
            continue
        text = sources.get(key)
        if not (isinstance(text, str) and text.strip() and not any(w in text for w in UNSOURCED)):
            missing.append(f"{where}.{key}")
    return missing


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_number_names_its_source(path: Path) -> None:
    data = json.loads(path.read_text())
    objects = (
        [(data[k], k) for k in data if not k.startswith("_")] if path.name == DEVICES_FILE else [(data, path.stem)]
    )
    missing = [m for obj, where in objects for m in unsourced(obj, where)]
    assert not missing, f"{path.name}: no source for {', '.join(missing)}"


def test_a_number_without_a_source_is_found() -> None:
    """The check itself: a field without an entry, or with an empty one, is reported."""
    spec = json.loads((SPEC_DIR / "dgx-h100.json").read_text())
    assert unsourced(spec, "dgx-h100") == []
    spec["inter_latency_us"] = 2.0
    del spec["source"]["inter_latency_us"]
    spec["source"]["intra_GBps"] = " "
    assert sorted(unsourced(spec, "x")) == ["x.inter_latency_us", "x.intra_GBps"]
    sw = json.loads((SOFTWARE_DIR / "megatron.json").read_text())
    sw["memory"]["workspace_MiB"] = 64
    del sw["memory"]["source"]["workspace_MiB"]
    assert unsourced(sw, "megatron") == ["megatron.memory.workspace_MiB"]
