"""Sharded checkpoints: the logical weights and Adam states of a model, in pieces that any plan of
the same model reshards on loading.

Format (version 2). A checkpoint is a folder::

    checkpoint.json  {"format": "planlab-checkpoint", "version": 2,
                      "model": {"name": "gpt-tiny", "args": {}}, "steps": 3, "world_size": 2,
                      "saved_by": "megatron(dp=2 ...) on 2 devices, 1 micro-batches", "optimizer": "adam",
                      "params": {"wte.weight": {"shape": [128, 64], "dtype": "float32"}, ...},
                      "files": {"rank0.pt": [["wte.weight", [[0, 64], [0, 64]]], ...], "rank1.pt": [...]}}
    rank0.pt         {"format": "planlab-checkpoint-file", "version": 2, "rank": 0,
                      "entries": [{"param": "wte.weight", "box": [[0, 64], [0, 64]], "value": tensor,
                                   "exp_avg": tensor, "exp_avg_sq": tensor, "step": tensor}, ...]}

Every entry is a box (``[start, stop)`` per dimension) of one logical parameter, whatever the plan
that wrote it: its weights, Adam's two moments over the same box, and Adam's step count. The
manifest lists each file's entries in order, so a loading rank opens only the files that hold
what it needs, and a partial or damaged checkpoint is refused before any rank starts. Entries
may overlap (replicas that hold equal values); together they cover every parameter.

Who writes what (no rank gathers the whole model): a piece held whole by several ranks (data
parallel replicas) is written by one of them, chosen to even out what each writes; a ZeRO shard (stages 1 to 3: a slice of a
bucket's flattened pieces) by the rank that owns it, cut into at most ``2 * ndim - 1`` boxes per
parameter it touches (:func:`flat_range_boxes`). Loading fills each piece and each ZeRO shard of
the new plan, weights and Adam states, from the overlaps of the saved boxes.

Saving is all or nothing: the ranks write into a staging folder beside the target
(``.NAME.saving``); rank 0 writes the manifest once every file is there and renames the staging
folder to the target (a checkpoint already there is replaced; anything else there is refused).
A failed save leaves no checkpoint at the target. All ranks must see one file system.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from planlab.errors import CheckpointError
from planlab.plan.layout import Box
from planlab.plan.program import DeviceProgram, Program, Role

FORMAT, VERSION = "planlab-checkpoint", 2
FILE_FORMAT = "planlab-checkpoint-file"
MANIFEST = "checkpoint.json"
_STATE = ("exp_avg", "exp_avg_sq")
KEYS = ("value",) + _STATE
SAVE_TASK = "save-checkpoint"  # PLANLAB_FAULT's task name for a fault while a rank writes its file


# -- boxes ---------------------------------------------------------------------


def _overlap(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def _local(box: Box, within: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, within))


def _shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def flat_range_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Boxes covering elements ``lo`` to ``hi`` (exclusive) of a row-major tensor of ``shape``,
    in order; each is contiguous in the flattening, so they tile the range end to end: a partial
    first row, the whole rows, a partial last row (recursively)."""
    if lo >= hi:
        return []
    if not shape:
        return [()]
    inner = math.prod(shape[1:])
    rest = tuple((0, s) for s in shape[1:])
    out: list[Box] = []
    if lo % inner:  # a partial first row
        r = lo // inner
        end = min(hi, (r + 1) * inner)
        out += [((r, r + 1),) + b for b in flat_range_boxes(shape[1:], lo - r * inner, end - r * inner)]
        lo = end
    if hi // inner > lo // inner and lo < hi:  # whole rows
        out.append(((lo // inner, hi // inner),) + rest)
        lo = hi // inner * inner
    if lo < hi:  # a partial last row
        r = lo // inner
        out += [((r, r + 1),) + b for b in flat_range_boxes(shape[1:], 0, hi - r * inner)]
    return out


def assemble(pieces: list[dict], box: Box, name: str, key: str = "value") -> torch.Tensor | None:
    """The region ``box`` of a parameter from saved ``pieces`` (each with ``box`` and ``key``);
    None when no piece holds ``key``; CheckpointError when part of ``box`` is not covered."""
    held = [pc for pc in pieces if key in pc]
    if not held:
        return None
    ref = held[0][key]
    out = torch.empty(_shape(box), dtype=ref.dtype)
    covered = torch.zeros(out.shape, dtype=torch.bool)
    for pc in held:
        src_box = tuple(tuple(b) for b in pc["box"])
        ov = _overlap(src_box, box)
        if ov is None:
            continue
        out[_local(ov, box)] = pc[key][_local(ov, src_box)]
        covered[_local(ov, box)] = True
    if not bool(covered.all()):
        raise CheckpointError(
            f"checkpoint: {key} of parameter {name!r}, region {list(box)}: "
            f"{int((~covered).sum())} of {covered.numel()} elements are in no saved piece"
        )
    return out


def zero_spans(bucket, boxes: dict[str, Box]) -> list[tuple[str, Box, int, int]]:
    """A ZeRO bucket's shard on this rank as ``(parameter, box, start, stop)``: the logical box of
    the parameter that elements ``start:stop`` of the flat shard hold (padding holds none).
    ``bucket`` is the interpreter's ``_ZeroBucket``; ``boxes`` this rank's pieces."""
    s0, s1 = bucket.me * bucket.chunk, (bucket.me + 1) * bucket.chunk
    out, off = [], 0
    for p, shape in zip(bucket.params, bucket.shapes):
        n = math.prod(shape)
        a, b = max(off, s0), min(off + n, s1)
        start = a - s0
        for local in flat_range_boxes(shape, a - off, b - off):
            logical = tuple((lo + o, hi + o) for (lo, hi), (o, _) in zip(local, boxes[p]))
            size = math.prod(_shape(local))
            out.append((p, logical, start, start + size))
            start += size
        off += n
    return out


def zeroed_params(dp: DeviceProgram) -> set[str]:
    """Parameters a device keeps in ZeRO buckets (their gradients are reduce-scattered)."""
    return {
        b.tensor
        for block in dp.blocks.values()
        for t in block.tasks
        if t.role in (Role.SHARD_GRADS, Role.UNIT_GRADS)
        for b in t.reads
    }


def whole_writers(program: Program) -> dict[tuple[str, Box], int]:
    """Who writes each piece held whole (outside ZeRO buckets): of the devices holding it, the one
    with the fewest elements to write so far, largest pieces first (ties: the lowest device), so
    that replicas (embeddings and norms under tensor parallelism) share the writing."""
    holders: dict[tuple[str, Box], list[int]] = {}
    for r, dp in enumerate(program.devices):
        zeroed = zeroed_params(dp)
        for p, box in dp.params:
            if p not in zeroed:
                holders.setdefault((p, tuple(tuple(b) for b in box)), []).append(r)
    load = [0] * len(program.devices)
    out: dict[tuple[str, Box], int] = {}
    for key in sorted(holders, key=lambda k: (-math.prod(_shape(k[1])), k)):
        r = min(holders[key], key=lambda d: (load[d], d))
        out[key] = r
        load[r] += math.prod(_shape(key[1]))
    return out


# -- writing -------------------------------------------------------------------


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU as a tensor of its own storage: ``torch.save`` writes a view's whole
    storage, so views are copied (whole tensors are not: the save doubles no memory for them)."""
    t = t.detach().cpu()
    nbytes = t.numel() * t.element_size()
    return t if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == nbytes else t.clone()


def _entry(p: str, box: Box, value: torch.Tensor, state: dict) -> dict[str, Any]:
    """One saved box: its weights and Adam state (zero moments at step 0 before any step)."""
    e = {"param": p, "box": [list(b) for b in box], "value": _own(value)}
    for k in _STATE:
        e[k] = _own(state[k]) if k in state else torch.zeros_like(e["value"])
    e["step"] = torch.tensor(float(state.get("step", 0.0)), dtype=torch.float32)
    return e


def shard_entries(interp) -> list[dict[str, Any]]:
    """What ``interp``'s rank writes: the pieces it holds whole and writes (:func:`whole_writers`), and
    the boxes of its ZeRO shards, each with its Adam state."""
    boxes = {p: tuple(tuple(b) for b in box) for p, box in interp.dp.params}
    writers = whole_writers(interp.program)
    zeroed = {p for z in interp.zero.values() for p in z.params}
    out = []
    for p, w in interp.leaves:
        if p in zeroed or writers.get((p, boxes[p])) != interp.device:
            continue
        state = interp.optimizer.state.get(w, {}) if interp.optimizer is not None else {}
        out.append(_entry(p, boxes[p], w, state))
    for z in interp.zero.values():
        state = z.optimizer.state.get(z.shard, {})
        for p, box, lo, hi in zero_spans(z, boxes):
            part = {k: v.detach()[lo:hi].reshape(_shape(box)) for k, v in state.items() if k in _STATE}
            out.append(
                _entry(p, box, z.shard.detach()[lo:hi].reshape(_shape(box)), dict(part, step=state.get("step", 0.0)))
            )
    return out


def param_specs(graph) -> dict[str, dict]:
    """Each parameter of ``graph``'s model: its shape and dtype, as the manifest lists them."""
    return {t.name: {"shape": list(t.shape), "dtype": t.dtype} for t in graph.params}


def staging_dir(folder: str | os.PathLike) -> Path:
    """Where the ranks write a checkpoint before it is renamed to ``folder`` (beside it)."""
    folder = Path(os.path.abspath(folder))
    return folder.with_name(f".{folder.name}.saving")


def check_save_dir(folder: str | os.PathLike) -> None:
    """Refuse (CheckpointError) a target that is a file or a non-empty folder other than a
    checkpoint, before any rank runs."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"cannot save a checkpoint to {folder}: it is a file")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / MANIFEST).exists():
        raise CheckpointError(
            f"cannot save a checkpoint to {folder}: the folder holds files and no {MANIFEST} "
            "(only a checkpoint is replaced)"
        )


def write_rank_file(interp, stage: str | os.PathLike, rank: int) -> tuple[str, list]:
    """Write what ``interp``'s rank saves (:func:`shard_entries`) to ``stage/rank{rank}.pt``;
    returns the file's name and its index (``[parameter, box]`` per entry) for the manifest."""
    entries = shard_entries(interp)
    name = f"rank{rank}.pt"
    torch.save({"format": FILE_FORMAT, "version": VERSION, "rank": rank, "entries": entries}, Path(stage) / name)
    return name, [[e["param"], e["box"]] for e in entries]


def write_manifest(
    stage: str | os.PathLike,
    files: dict[str, list],
    *,
    model_json: dict,
    steps: int,
    params: dict[str, dict],
    saved_by: str = "",
) -> None:
    """Write ``checkpoint.json`` into ``stage`` once every rank's file is there (``files``: name to index)."""
    stage = Path(stage)
    missing = [f for f in files if not (stage / f).exists()]
    if missing:
        raise CheckpointError(
            f"{', '.join(missing)} not found in {stage} (do all ranks share one file system?); no checkpoint written"
        )
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "model": model_json,
        "steps": steps,
        "world_size": len(files),
        "saved_by": saved_by,
        "optimizer": "adam",
        "params": params,
        "files": files,
    }
    (stage / MANIFEST).write_text(json.dumps(manifest, indent=1))


def save_checkpoint(
    interp,
    folder: str | os.PathLike,
    *,
    rank: int,
    world_size: int,
    group=None,
    model_json: dict,
    steps: int,
    params: dict[str, dict],
    saved_by: str = "",
) -> None:
    """Write a checkpoint of every rank's pieces to ``folder`` (collective over ``group``: every
    rank calls it). ``params`` maps each parameter of the model to its shape and dtype (see
    :func:`param_specs`); ``steps`` is the number of training steps run."""
    folder = Path(folder)
    stage = staging_dir(folder)
    if rank == 0:
        check_save_dir(folder)
        shutil.rmtree(stage, ignore_errors=True)  # a failed save's leftovers
        stage.mkdir(parents=True)
    dist.barrier(group=group)
    mine = write_rank_file(interp, stage, rank)
    if interp.fault is not None and interp.fault.task == SAVE_TASK:
        interp.fault.trigger()
    parts: list | None = [None] * world_size if rank == 0 else None
    dist.gather_object(mine, parts, dst=0, group=group)
    if rank == 0:
        write_manifest(stage, dict(parts), model_json=model_json, steps=steps, params=params, saved_by=saved_by)
        commit(stage, folder)
    dist.barrier(group=group)


def commit(stage: str | os.PathLike, folder: str | os.PathLike) -> None:
    """Rename the complete ``stage`` folder to ``folder``, replacing a checkpoint there."""
    stage, folder = Path(stage), Path(os.path.abspath(folder))
    old = folder.with_name(f".{folder.name}.replaced")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        if any(folder.iterdir()):
            os.rename(folder, old)
        else:
            folder.rmdir()
    os.rename(stage, folder)
    shutil.rmtree(old, ignore_errors=True)


# -- reading -------------------------------------------------------------------


def read_manifest(folder: str | os.PathLike, model_json: dict | None = None) -> dict:
    """The manifest of the checkpoint in ``folder``; CheckpointError if it is missing, of another
    format or version, or (with ``model_json``) of another model."""
    path = Path(folder) / MANIFEST
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder} holds no complete checkpoint ({MANIFEST} is missing)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        got = (meta.get("format"), meta.get("version")) if isinstance(meta, dict) else (type(meta).__name__, None)
        raise CheckpointError(
            f"{path} is {got[0]!r} version {got[1]!r}; this planlab reads {FORMAT!r} version {VERSION}"
        )
    for key, kind in (("model", dict), ("params", dict), ("files", dict), ("steps", int)):
        if not isinstance(meta.get(key), kind):
            raise CheckpointError(f"{path}: {key!r} is missing or not a {kind.__name__}")
    if model_json is not None and meta["model"] != model_json:
        raise CheckpointError(f"checkpoint {folder} is of model {meta['model']}; the plan is of model {model_json}")
    return meta


def check_checkpoint(folder: str | os.PathLike, params: dict[str, dict], model_json: dict | None = None) -> dict:
    """Validate the checkpoint in ``folder`` against the model's ``params`` (name: shape and dtype)
    before any rank loads it: the manifest, every entry's box, that the entries cover every
    parameter, and every file (present, readable, entries as listed, tensors of their box's shape
    and the parameter's dtype). Returns the manifest; CheckpointError naming the file and tensor."""
    meta = read_manifest(folder, model_json)
    path = Path(folder) / MANIFEST
    saved = meta["params"]
    for p, spec in params.items():
        got = saved.get(p)
        if got is None:
            raise CheckpointError(f"{path}: the model's parameter {p!r} is not in the checkpoint")
        if list(got.get("shape", [])) != list(spec["shape"]) or got.get("dtype") != spec["dtype"]:
            raise CheckpointError(
                f"{path}: parameter {p!r} is {got.get('dtype')} {got.get('shape')}; the model's is "
                f"{spec['dtype']} {list(spec['shape'])}"
            )
    extra = sorted(set(saved) - set(params))
    if extra:
        raise CheckpointError(f"{path}: parameter {extra[0]!r} is not in the model")
    boxes: dict[str, list[Box]] = {p: [] for p in params}
    for f, index in meta["files"].items():
        for item in index:
            p, box = _index_item(path, f, item, params)
            boxes[p].append(box)
    for p, bs in boxes.items():
        _check_cover(path, p, tuple(params[p]["shape"]), bs)
    for f in meta["files"]:
        _check_file(Path(folder), f, meta["files"][f], params)
    return meta


def _index_item(path: Path, f: str, item, params: dict[str, dict]) -> tuple[str, Box]:
    ok = isinstance(item, list) and len(item) == 2 and item[0] in params and isinstance(item[1], list)
    shape = tuple(params[item[0]]["shape"]) if ok else ()
    ok = (
        ok
        and len(item[1]) == len(shape)
        and all(
            isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) for x in b) and 0 <= b[0] < b[1] <= s
            for b, s in zip(item[1], shape)
        )
    )
    if not ok:
        raise CheckpointError(
            f"{path}: entry {item!r} of {f} is not a parameter of the model and a box within its shape"
        )
    return item[0], tuple(tuple(b) for b in item[1])


def _check_cover(path: Path, p: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    """Every element of ``p`` is in some box (on a grid of the boxes' own boundaries)."""
    cuts = [sorted({0, s} | {x for b in boxes for x in b[d]}) for d, s in enumerate(shape)]
    at = [{x: i for i, x in enumerate(c)} for c in cuts]
    covered = torch.zeros(tuple(len(c) - 1 for c in cuts), dtype=torch.bool)
    for b in boxes:
        covered[tuple(slice(a[lo], a[hi]) for a, (lo, hi) in zip(at, b))] = True
    if not bool(covered.all()):
        cell = tuple(int(i) for i in (~covered).nonzero()[0]) if covered.dim() else ()
        region = [(c[i], c[i + 1]) for c, i in zip(cuts, cell)]
        raise CheckpointError(f"{path}: no saved entry holds region {region} of parameter {p!r} (a partial checkpoint)")


def _open(path: Path) -> dict:
    try:
        data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except Exception as e:  # a truncated or foreign file: torch raises many kinds
        raise CheckpointError(
            f"checkpoint file {path} cannot be read: {type(e).__name__}: {' '.join(str(e).split())[:160]}"
        ) from None
    if (
        not isinstance(data, dict)
        or data.get("format") != FILE_FORMAT
        or data.get("version") != VERSION
        or not isinstance(data.get("entries"), list)
    ):
        raise CheckpointError(f"checkpoint file {path} is not a {FILE_FORMAT!r} version {VERSION} file")
    return data


def _check_file(folder: Path, f: str, index: list, params: dict[str, dict]) -> None:
    data = _open(folder / f)
    if len(data["entries"]) != len(index):
        raise CheckpointError(
            f"checkpoint file {folder / f} has {len(data['entries'])} entries; {MANIFEST} lists {len(index)}"
        )
    for e, item in zip(data["entries"], index):
        _check_entry(folder / f, e, item, params[item[0]]["dtype"])


def _check_entry(path: Path, e, item: list, dtype: str) -> None:
    p, box = item
    where = f"checkpoint file {path}, parameter {p!r} box {box}"
    if not isinstance(e, dict) or e.get("param") != p or e.get("box") != box:
        raise CheckpointError(f"{where}: the file's entry is {_brief(e)}, not the one {MANIFEST} lists")
    shape = tuple(hi - lo for lo, hi in box)
    for k in KEYS:
        t = e.get(k)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or str(t.dtype) != f"torch.{dtype}":
            got = f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}" if isinstance(t, torch.Tensor) else "missing"
            raise CheckpointError(f"{where}: {k} is {got}; expected {dtype} {list(shape)}")
    if not isinstance(e.get("step"), torch.Tensor) or e["step"].numel() != 1:
        raise CheckpointError(f"{where}: Adam's step is missing or not one number")


def _brief(e) -> str:
    return f"{e.get('param')!r} box {e.get('box')}" if isinstance(e, dict) else type(e).__name__


class CheckpointReader:
    """Regions of a checkpoint's parameters, read from the files that hold them (memory-mapped,
    opened once each)."""

    def __init__(self, folder: str | os.PathLike, meta: dict) -> None:
        self.folder, self.meta = Path(folder), meta
        self.where: dict[str, list[tuple[str, int, Box]]] = {}
        for f, index in meta["files"].items():
            for k, (p, box) in enumerate(index):
                self.where.setdefault(p, []).append((f, k, tuple(tuple(b) for b in box)))
        self._files: dict[str, list] = {}

    def _entries(self, p: str, box: Box) -> list[dict]:
        out = []
        for f, k, saved in self.where.get(p, []):
            if _overlap(saved, box) is None:
                continue
            if f not in self._files:
                self._files[f] = _open(self.folder / f)["entries"]
            e = self._files[f][k]
            _check_entry(self.folder / f, e, self.meta["files"][f][k], self.meta["params"][p]["dtype"])
            out.append(e)
        return out

    def region(self, p: str, box: Box, keys: tuple[str, ...] = KEYS) -> dict[str, torch.Tensor]:
        """``keys`` (of ``value``, ``exp_avg``, ``exp_avg_sq``) of region ``box`` of parameter ``p``
        and Adam's ``step`` (one for the region: CheckpointError if its entries differ)."""
        pieces = self._entries(p, box)
        out = {k: assemble(pieces, box, p, k) for k in keys}
        if not pieces or any(v is None for v in out.values()):
            raise CheckpointError(f"checkpoint {self.folder}: no entry holds region {list(box)} of parameter {p!r}")
        steps = sorted({float(e["step"]) for e in pieces})
        if len(steps) > 1:
            raise CheckpointError(
                f"checkpoint {self.folder}: the entries of parameter {p!r} region {list(box)} "
                f"have different Adam steps {steps}"
            )
        out["step"] = torch.tensor(steps[0], dtype=torch.float32)
        return out


def _adam_state(got: dict[str, torch.Tensor], device: torch.device, steps: set[float], what: str) -> dict:
    """Adam's state for one tensor from its moments in ``got`` and the ``steps`` of its entries."""
    if len(steps) > 1:
        raise CheckpointError(f"checkpoint: {what} gets different Adam steps {sorted(steps)}")
    return {
        "step": torch.tensor(steps.pop() if steps else 0.0, dtype=torch.float32),
        **{k: got[k].to(device) for k in _STATE},
    }


def load_shards(interp, folder: str | os.PathLike, model_json: dict | None = None) -> int:
    """Fill ``interp``'s pieces and ZeRO shards, weights and Adam states, from the checkpoint in
    ``folder`` (written under any plan of the same model); returns the number of steps it had run."""
    meta = read_manifest(folder, model_json)
    reader = CheckpointReader(folder, meta)
    boxes = {p: tuple(tuple(b) for b in box) for p, box in interp.dp.params}
    zeroed = {p for z in interp.zero.values() for p in z.params}
    for p, w in interp.leaves:  # pieces held whole (ZeRO-1/2 too: their weights are whole)
        got = reader.region(p, boxes[p], ("value",) if p in zeroed else KEYS)
        with torch.no_grad():
            w.copy_(got["value"])
        if p not in zeroed and interp.optimizer is not None:
            interp.optimizer.state[w] = _adam_state(got, w.device, {float(got["step"])}, f"parameter {p!r}")
    for z in interp.zero.values():  # a flat shard: its spans' boxes, the padding zero
        flat = {k: torch.zeros(z.chunk, dtype=z.shard.dtype) for k in KEYS}
        steps: set[float] = set()
        for p, box, lo, hi in zero_spans(z, boxes):
            got = reader.region(p, box)
            for k in KEYS:
                flat[k][lo:hi] = got[k].reshape(-1)
            steps.add(float(got["step"]))
        with torch.no_grad():
            z.shard.copy_(flat["value"])
        z.optimizer.state[z.shard] = _adam_state(flat, z.shard.device, steps, f"the ZeRO shard {z.key}")
    return int(meta["steps"])
