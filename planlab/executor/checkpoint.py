"""Sharded checkpoints: each rank writes the parameter pieces it holds, with their boxes and
their Adam state; any plan of the same model loads them by reassembling the slices it needs.

A checkpoint is a folder::

    checkpoint.json   {"format": "planlab-checkpoint", "version": 1, "model": {...},
                       "world_size": 2, "steps": 3, "files": ["rank0.pt", "rank1.pt"]}
    rank0.pt          {"rank": 0, "params": {name: {"box": [[start, stop], ...], "value": tensor,
                                                    "exp_avg": tensor, "exp_avg_sq": tensor,
                                                    "step": tensor}}}

``checkpoint.json`` is written last, by rank 0 after every rank has written its file, so a
folder without it is an incomplete checkpoint. Loading reads the files memory-mapped and
copies, for each piece the new plan places on this rank, the overlap of every saved piece
of that parameter (resharding); every element must be covered.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from planlab.errors import ConfigError, ExecutionError
from planlab.plan.layout import Box

FORMAT, VERSION = "planlab-checkpoint", 1
MANIFEST = "checkpoint.json"
_STATE = ("exp_avg", "exp_avg_sq")


def shard_state(interp) -> dict[str, dict[str, Any]]:
    """This rank's parameter pieces, their boxes and Adam state (step, moments)."""
    boxes = dict(interp.dp.params)
    out: dict[str, dict[str, Any]] = {}
    for p, w in interp.leaves:
        entry: dict[str, Any] = {"box": [list(b) for b in boxes[p]], "value": w.detach().cpu().clone()}
        st = interp.optimizer.state.get(w, {}) if interp.optimizer is not None else {}
        for k in _STATE:
            if k in st:
                entry[k] = st[k].detach().cpu().clone()
        if "step" in st:
            entry["step"] = torch.as_tensor(st["step"]).detach().cpu().clone()
        out[p] = entry
    return out


def save_shards(interp, folder: str | os.PathLike, rank: int) -> Path:
    """Write this rank's pieces to ``folder/rank{rank}.pt`` (atomically); returns the path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}.pt"
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"rank": rank, "params": shard_state(interp)}, tmp)
    os.replace(tmp, path)
    return path


def write_manifest(folder: str | os.PathLike, *, model_json: dict, world_size: int, steps: int) -> None:
    """Write ``checkpoint.json`` once every rank's file is in ``folder``."""
    folder = Path(folder)
    files = [f"rank{r}.pt" for r in range(world_size)]
    missing = [f for f in files if not (folder / f).exists()]
    if missing:
        raise ExecutionError(f"checkpoint {folder}: {', '.join(missing)} missing; no manifest written")
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "version": VERSION, "model": model_json,
                               "world_size": world_size, "steps": steps, "files": files}, indent=1))
    os.replace(tmp, folder / MANIFEST)


def read_manifest(folder: str | os.PathLike, model_json: dict | None = None) -> dict:
    """The manifest of the checkpoint in ``folder``; ConfigError if it is missing, of another
    format or version, or (with ``model_json``) of another model."""
    path = Path(folder) / MANIFEST
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{folder} holds no complete checkpoint ({MANIFEST} is missing)") from None
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ConfigError(f"{path} is {meta.get('format')!r} version {meta.get('version')!r}; this planlab reads "
                          f"{FORMAT!r} version {VERSION}")
    if model_json is not None and meta.get("model") != model_json:
        raise ConfigError(f"checkpoint {folder} is of model {meta.get('model')}; the plan is of model {model_json}")
    return meta


def _overlap(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def _local(box: Box, within: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, within))


def assemble(pieces: list[dict], box: Box, name: str, key: str = "value") -> torch.Tensor | None:
    """The region ``box`` of a parameter from saved ``pieces`` (each with ``box`` and ``key``);
    None when no piece holds ``key``; ExecutionError when part of ``box`` is not covered."""
    held = [pc for pc in pieces if key in pc]
    if not held:
        return None
    ref = held[0][key]
    out = torch.empty(tuple(hi - lo for lo, hi in box), dtype=ref.dtype)
    covered = torch.zeros(out.shape, dtype=torch.bool)
    for pc in held:
        src_box = tuple(tuple(b) for b in pc["box"])
        ov = _overlap(src_box, box)
        if ov is None:
            continue
        out[_local(ov, box)] = pc[key][_local(ov, src_box)]
        covered[_local(ov, box)] = True
    if not bool(covered.all()):
        raise ExecutionError(f"checkpoint: {key} of parameter {name!r}, region {list(box)}: "
                             f"{int((~covered).sum())} of {covered.numel()} elements are in no saved piece")
    return out


def load_shards(interp, folder: str | os.PathLike, model_json: dict | None = None) -> int:
    """Load the pieces ``interp``'s rank holds from the checkpoint in ``folder`` (any plan of the
    same model), with their Adam state; returns the number of steps the checkpoint had run."""
    meta = read_manifest(folder, model_json)
    by_param: dict[str, list[dict]] = {}
    for f in meta["files"]:
        saved = torch.load(Path(folder) / f, map_location="cpu", mmap=True, weights_only=True)
        for p, entry in saved["params"].items():
            by_param.setdefault(p, []).append(entry)
    boxes = dict(interp.dp.params)
    for p, w in interp.leaves:
        pieces = by_param.get(p)
        if not pieces:
            raise ExecutionError(f"checkpoint {folder} has no piece of parameter {p!r}")
        box = tuple(tuple(b) for b in boxes[p])
        value = assemble(pieces, box, p)
        if value is None or tuple(value.shape) != tuple(w.shape):
            raise ExecutionError(f"checkpoint: parameter {p!r} region {list(box)} has shape "
                                 f"{None if value is None else tuple(value.shape)}; expected {tuple(w.shape)}")
        with torch.no_grad():
            w.copy_(value)
        if interp.optimizer is None:
            continue
        state = {k: assemble(pieces, box, p, k) for k in _STATE}
        steps = {float(pc["step"]) for pc in pieces if "step" in pc}
        if len(steps) > 1:
            raise ExecutionError(f"checkpoint: the pieces of {p!r} have different Adam steps {sorted(steps)}")
        if steps and all(v is not None for v in state.values()):
            interp.optimizer.state[w] = {"step": torch.tensor(steps.pop(), dtype=torch.float32),
                                         **{k: v.to(w.device) for k, v in state.items()}}
    return int(meta.get("steps", 0))
