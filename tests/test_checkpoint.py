"""Sharded checkpoints (format 2): the boxes a flat ZeRO shard covers; every plan (ZeRO 0 to 3,
TP, PP, zero-bubble, coshard; 2 and 4 devices) writes each logical element once and loads any
other plan's checkpoint, weights and Adam states (in process, no launch); damaged, partial and
foreign checkpoints are refused naming the file and tensor; a failed save leaves no checkpoint;
and on 2 gloo ranks, a checkpoint saved under ZeRO-1/2/3 continues under TP or PP and back with
the losses of the uninterrupted single-process run."""

from __future__ import annotations

import functools
import json
import math
import shutil

import pytest
import torch

from planlab.cli import main
from planlab.errors import CheckpointError
from planlab.executor import launch_local, reference_run
from planlab.executor.checkpoint import (
    MANIFEST,
    SAVE_TASK,
    assemble,
    check_checkpoint,
    commit,
    flat_range_boxes,
    load_shards,
    param_specs,
    read_manifest,
    staging_dir,
    write_manifest,
    write_rank_file,
)
from planlab.executor.failures import FAULT_ENV, RankFailure
from planlab.executor.interpreter import Interpreter
from planlab.models import build_model
from planlab.plan import materialize
from planlab.plan.plan_file import save_plan
from planlab.search_spaces import Context, get_space

from conftest import traced

LR = 1e-2
PLANS = {  # name: (devices, space, knobs)
    "dp": (2, "megatron", dict(dp=2, tp=1, pp=1, microbatch=4)),
    "zero1": (2, "megatron", dict(dp=2, tp=1, pp=1, microbatch=4, zero=1)),
    "zero2": (2, "megatron", dict(dp=2, tp=1, pp=1, microbatch=2, zero=2)),
    "zero3": (2, "megatron", dict(dp=2, tp=1, pp=1, microbatch=4, zero=3)),
    "tp": (2, "megatron", dict(dp=1, tp=2, pp=1, microbatch=8)),
    "pp": (2, "megatron", dict(dp=1, tp=1, pp=2, microbatch=2)),
    "zb": (2, "megatron", dict(dp=1, tp=1, pp=2, microbatch=2, schedule="zb-h1")),
    "coshard": (2, "megatron*coshard", dict(dp=1, tp=2, pp=1, microbatch=8, coshard=2, coshard_blocks="both")),
    "dp2tp2-zero3": (4, "megatron", dict(dp=2, tp=2, pp=1, microbatch=4, zero=3)),
    "dp2pp2-zero1": (4, "megatron", dict(dp=2, tp=1, pp=2, microbatch=2, zero=1)),
}


@functools.lru_cache(maxsize=None)
def _plan(name):
    n, space, knobs = PLANS[name]
    spec, g = traced("gpt-tiny", 8)
    plan = get_space(space).build(Context(g, spec, 8, "cpu", n, n, 1), knobs)
    return plan, g, materialize(plan, g)


# -- boxes of a flat range ------------------------------------------------------


@pytest.mark.parametrize(
    "shape, lo, hi, boxes",
    [
        ((4, 6), 0, 24, [((0, 4), (0, 6))]),
        ((4, 6), 2, 5, [((0, 1), (2, 5))]),
        ((4, 6), 3, 20, [((0, 1), (3, 6)), ((1, 3), (0, 6)), ((3, 4), (0, 2))]),
        ((4, 6), 6, 18, [((1, 3), (0, 6))]),
        (
            (2, 3, 4),
            5,
            19,
            [((0, 1), (1, 2), (1, 4)), ((0, 1), (2, 3), (0, 4)), ((1, 2), (0, 1), (0, 4)), ((1, 2), (1, 2), (0, 3))],
        ),
        ((7,), 2, 5, [((2, 5),)]),
        ((), 0, 1, [()]),
        ((4, 6), 5, 5, []),
    ],
)
def test_a_flat_range_is_cut_into_boxes_in_order(shape, lo, hi, boxes):
    assert flat_range_boxes(shape, lo, hi) == boxes
    full = torch.arange(math.prod(shape)).reshape(shape)
    got = (
        torch.cat([full[tuple(slice(a, b) for a, b in box)].reshape(-1) for box in boxes])
        if boxes
        else torch.empty(0, dtype=full.dtype)
    )
    assert torch.equal(got, full.reshape(-1)[lo:hi])  # contiguous and in flattening order
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_assemble_reshards_boxes():
    full = torch.arange(24.0).reshape(4, 6)
    pieces = [
        {"box": [[0, 4], [0, 3]], "value": full[:, :3]},  # column halves, as TP saves them
        {"box": [[0, 4], [3, 6]], "value": full[:, 3:]},
        {"box": [[0, 4], [0, 6]], "value": full},
    ]  # a replica overlaps both
    assert torch.equal(assemble(pieces, ((1, 3), (2, 5)), "w"), full[1:3, 2:5])
    assert torch.equal(assemble(pieces[:2], ((0, 4), (0, 6)), "w"), full)
    with pytest.raises(CheckpointError, match=r"parameter 'w', region \[\(0, 4\), \(0, 6\)\]: 12 of 24 elements"):
        assemble(pieces[:1], ((0, 4), (0, 6)), "w")
    assert assemble(pieces, ((0, 4), (0, 6)), "w", "exp_avg") is None


# -- every plan writes and loads, in process -----------------------------------


def _truth():
    """The logical weights (the seed's) and made-up Adam moments of every parameter."""
    spec, _ = traced("gpt-tiny", 8)
    module, inputs = build_model(spec, batch=8, device="cpu")
    weights = {p: w.detach() for p, w in module.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    moments = {p: (torch.randn(w.shape, generator=gen), torch.rand(w.shape, generator=gen)) for p, w in weights.items()}
    return module, inputs, weights, moments


def _flat(z, boxes, full):
    """A ZeRO bucket's shard of the flattened pieces of ``full`` (padding zero)."""
    flat = torch.cat([full[p][tuple(slice(a, b) for a, b in boxes[p])].reshape(-1) for p in z.params])
    flat = torch.nn.functional.pad(flat, (0, z.chunk * z.n - flat.numel()))
    return flat[z.me * z.chunk : (z.me + 1) * z.chunk]


def _interpreters(name, module, inputs, *, blank: bool):
    """One interpreter per rank of plan ``name`` (no process group: nothing runs); ``blank``
    fills its pieces with NaN, as a checkpoint's loader finds them."""
    plan, g, prog = _plan(name)
    out = []
    for r, dp in enumerate(prog.devices):
        shards = {p: torch.full(tuple(b - a for a, b in box), float("nan")) for p, box in dp.params} if blank else None
        out.append(Interpreter(prog, g, r, module, inputs, {}, lr=LR, shards=shards))
    return out


def _adam(step, m, v):
    return {"step": torch.tensor(float(step)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}


@functools.lru_cache(maxsize=None)
def _saved(name, root):
    """A checkpoint of plan ``name`` (weights from the seed, Adam states made up, step 3) in ``root``."""
    module, inputs, weights, moments = _truth()
    m_full, v_full = {p: m for p, (m, _) in moments.items()}, {p: v for p, (_, v) in moments.items()}
    folder = f"{root}/{name}"
    stage = staging_dir(folder)
    stage.mkdir(parents=True)
    files = {}
    for it in _interpreters(name, module, inputs, blank=False):
        boxes = {p: tuple(tuple(b) for b in box) for p, box in it.dp.params}
        zeroed = {p for z in it.zero.values() for p in z.params}
        for p, w in it.leaves:
            if p not in zeroed:
                sl = tuple(slice(a, b) for a, b in boxes[p])
                it.optimizer.state[w] = _adam(3, m_full[p][sl], v_full[p][sl])
        for z in it.zero.values():
            z.optimizer.state[z.shard] = _adam(3, _flat(z, boxes, m_full), _flat(z, boxes, v_full))
        f, index = write_rank_file(it, stage, it.device)
        files[f] = index
    plan, g, _ = _plan(name)
    write_manifest(
        stage, files, model_json=plan.model.to_json(), steps=3, params=param_specs(g), saved_by=plan.describe()
    )
    commit(stage, folder)
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("checkpoints"))


@pytest.mark.parametrize("name", list(PLANS))
def test_each_element_is_written_once_by_a_rank_that_holds_it(root, name):
    plan, g, prog = _plan(name)
    folder = _saved(name, root)
    meta = check_checkpoint(folder, param_specs(g), plan.model.to_json())
    assert meta["world_size"] == prog.num_devices == len(meta["files"]) and meta["steps"] == 3
    written = 0
    for r, dp in enumerate(prog.devices):
        held = {}
        for p, box in dp.params:
            held[p] = box
        for p, box in meta["files"][f"rank{r}.pt"]:
            assert all(a <= lo < hi <= b for (lo, hi), (a, b) in zip(box, held[p])), (r, p, box)  # its own piece
            written += math.prod(hi - lo for lo, hi in box)
    if name == "dp2tp2-zero3":  # parameters replicated over tp (layer norms, row-parallel biases): once per tp rank
        assert g.num_params < written < 2 * g.num_params
    else:
        assert written == g.num_params


PAIRS = [
    (a, b)
    for a in PLANS
    for b in PLANS
    if a != b and (a in ("zero1", "zero3", "tp", "dp2tp2-zero3") or b in ("zero2", "zero3", "coshard"))
]


@pytest.mark.parametrize("saver, loader", PAIRS)
def test_any_plan_loads_any_plans_checkpoint(root, saver, loader):
    """Every piece and ZeRO shard of the loading plan gets the logical weights and Adam states
    (and step) the saving plan had, whatever either plan's layout."""
    folder = _saved(saver, root)
    module, inputs, weights, moments = _truth()
    m_full, v_full = {p: m for p, (m, _) in moments.items()}, {p: v for p, (_, v) in moments.items()}
    plan = _plan(loader)[0]
    for it in _interpreters(loader, module, inputs, blank=True):
        assert load_shards(it, folder, plan.model.to_json()) == 3
        boxes = {p: tuple(tuple(b) for b in box) for p, box in it.dp.params}
        zeroed = {p for z in it.zero.values() for p in z.params}
        for p, w in it.leaves:
            sl = tuple(slice(a, b) for a, b in boxes[p])
            assert torch.equal(w.detach(), weights[p][sl]), p
            if p not in zeroed:
                st = it.optimizer.state[w]
                assert float(st["step"]) == 3 and torch.equal(st["exp_avg"], m_full[p][sl])
                assert torch.equal(st["exp_avg_sq"], v_full[p][sl])
        for z in it.zero.values():
            st = z.optimizer.state[z.shard]
            assert torch.equal(z.shard.detach(), _flat(z, boxes, weights)), z.key
            assert float(st["step"]) == 3 and torch.equal(st["exp_avg"], _flat(z, boxes, m_full))
            assert torch.equal(st["exp_avg_sq"], _flat(z, boxes, v_full))


# -- refused checkpoints --------------------------------------------------------


def _edit_manifest(folder, fn):
    path = folder / MANIFEST
    meta = json.loads(path.read_text())
    fn(meta)
    path.write_text(json.dumps(meta))


def _edit_entries(folder, fn):
    data = torch.load(folder / "rank1.pt", weights_only=True)
    fn(data["entries"])
    torch.save(data, folder / "rank1.pt")


def _truncate(path):
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


def _bad_box(m, k):
    m["files"]["rank1.pt"][k][1][0][1] = 999


# (damage(folder, k), message): k is the index of an entry of rank1.pt that alone holds its region
# ({p}, {box}; {shape} the box's shape, {region} the box as a list of tuples)
BAD = [
    (lambda f, k: (f / MANIFEST).unlink(), "holds no complete checkpoint (checkpoint.json is missing)"),
    (lambda f, k: (f / MANIFEST).write_text("{"), "checkpoint.json cannot be read as JSON"),
    (
        lambda f, k: _edit_manifest(f, lambda m: m.update(version=1)),
        "is 'planlab-checkpoint' version 1; this planlab reads 'planlab-checkpoint' version 2",
    ),
    (
        lambda f, k: _edit_manifest(f, lambda m: m.update(model={"name": "gpt-small", "args": {}})),
        "is of model {{'name': 'gpt-small', 'args': {{}}}}; the plan is of model",
    ),
    (
        lambda f, k: _edit_manifest(f, lambda m: m["params"]["wte.weight"].update(shape=[100, 64])),
        "parameter 'wte.weight' is float32 [100, 64]; the model's is float32 [128, 64]",
    ),
    (
        lambda f, k: _edit_manifest(f, lambda m: m["params"].pop("lm_head.bias")),
        "the model's parameter 'lm_head.bias' is not in the checkpoint",
    ),
    (
        lambda f, k: _edit_manifest(f, lambda m: _bad_box(m, k)),
        "of rank1.pt is not a parameter of the model and a box within its shape",
    ),
    (
        lambda f, k: _edit_manifest(f, lambda m: m["files"]["rank1.pt"].pop(k)),
        "no saved entry holds region {region} of parameter '{p}' (a partial checkpoint)",
    ),
    (lambda f, k: (f / "rank1.pt").unlink(), "/rank1.pt is missing"),
    (lambda f, k: _truncate(f / "rank1.pt"), "/rank1.pt cannot be read: "),
    (
        lambda f, k: _edit_entries(f, lambda es: es[k].update(exp_avg=torch.zeros(3))),
        "/rank1.pt, parameter '{p}' box {box}: exp_avg is float32 [3]; expected float32 {shape}",
    ),
    (
        lambda f, k: _edit_entries(f, lambda es: es[k].pop("step")),
        "/rank1.pt, parameter '{p}' box {box}: Adam's step is missing",
    ),
    (
        lambda f, k: _edit_entries(f, lambda es: es.insert(k, es.pop(k + 1))),
        "/rank1.pt, parameter '{p}' box {box}: the file's entry is",
    ),
]


@pytest.mark.parametrize("damage, message", BAD)
def test_a_damaged_partial_or_foreign_checkpoint_is_refused_naming_file_and_tensor(root, tmp_path, damage, message):
    folder = tmp_path / "ckpt"
    shutil.copytree(_saved("tp", root), folder)
    meta = json.loads((folder / MANIFEST).read_text())
    k, (p, box) = next(
        (k, e)
        for k, e in enumerate(meta["files"]["rank1.pt"])
        if e[1] != [[0, s] for s in meta["params"][e[0]]["shape"]]
    )  # a tensor-parallel half
    damage(folder, k)
    plan, g, _ = _plan("tp")
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(folder, param_specs(g), plan.model.to_json())
    assert message.format(p=p, box=box, shape=[b - a for a, b in box], region=[tuple(b) for b in box]) in str(e.value)


def test_the_run_command_refuses_a_bad_checkpoint_and_a_busy_save_folder(root, tmp_path, capsys):
    plan = _plan("tp")[0]
    save_plan(plan, tmp_path / "tp.json")
    folder = tmp_path / "ckpt"
    shutil.copytree(_saved("tp", root), folder)
    (folder / "rank1.pt").unlink()
    assert main(["run", str(tmp_path / "tp.json"), "--nproc", "2", "--load", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("planlab: error: checkpoint file ") and err.endswith("rank1.pt is missing")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="busy: the folder holds files and no checkpoint.json"):
        launch_local(plan, 2, check=False, save_dir=tmp_path / "busy")
    with pytest.raises(CheckpointError, match="checkpoint.json is missing"):
        read_manifest(tmp_path / "nothing")


def test_a_failed_save_leaves_the_previous_checkpoint(root, tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    shutil.copytree(_saved("zero3", root), folder)
    before = (folder / MANIFEST).read_text()
    monkeypatch.setenv(FAULT_ENV, f"rank=1,task={SAVE_TASK},kind=raise")
    with pytest.raises(RankFailure, match="rank 1 failed at end: saving the checkpoint.*InjectedFault"):
        launch_local(_plan("zero3")[0], 2, check=False, save_dir=folder)
    assert (folder / MANIFEST).read_text() == before  # untouched, not half-replaced
    assert not staging_dir(folder).exists()
    check_checkpoint(folder, param_specs(_plan("zero3")[1]), _plan("zero3")[0].model.to_json())


# -- training continues across plans (2 gloo ranks) ------------------------------


def test_zero_checkpoints_continue_under_tp_or_pp_and_back(tmp_path):
    """One training run handed from plan to plan through checkpoints: ZeRO-1 (1 step, checked
    against one process) -> TP -> ZeRO-3 -> PP -> ZeRO-2 -> ZeRO-1 (2 steps each): every loss is
    the uninterrupted single-process run's, so weights and Adam states (moments and step) crossed
    from each ZeRO stage into a plain plan or another stage and back. Each stage saves and loads
    (one chain of six launches covers what three chains of three did)."""
    chain = ("zero1", "tp", "zero3", "pp", "zero2", "zero1")
    steps = [1] + [2] * (len(chain) - 1)
    ref = reference_run(_plan("zero1")[0].model, global_batch=8, steps=sum(steps), lr=LR)
    losses, load = [], None
    for i, (name, n) in enumerate(zip(chain, steps)):
        save = tmp_path / str(i) if i < len(chain) - 1 else None
        res = launch_local(_plan(name)[0], 2, steps=n, lr=LR, check=i == 0, load_dir=load, save_dir=save)
        if i == 0:
            assert res.max_loss_error < 1e-5 and res.max_grad_error < 1e-5
        losses += res.losses
        load = save
    assert losses == pytest.approx(ref.losses, abs=1e-5)
    assert read_manifest(tmp_path / str(len(chain) - 2))["steps"] == sum(steps[:-1])


def test_a_resumed_run_goes_on_with_the_next_batch_of_its_data(tmp_path):
    """Two steps saved, then one step resumed: the resumed step trains on the third batch, as the
    uninterrupted run's third step does (not on the first batch again)."""
    plan = _plan("tp")[0]
    _, example = build_model(plan.model, batch=8)
    gen = torch.Generator().manual_seed(7)
    batches = [tuple(torch.randint(0, 128, x.shape, generator=gen) for x in example) for _ in range(3)]
    torch.save(batches, tmp_path / "data.pt")
    ref = reference_run(plan.model, global_batch=8, steps=3, lr=LR, batches=batches)
    launch_local(plan, 2, steps=2, lr=LR, check=False, data=tmp_path / "data.pt", save_dir=tmp_path / "ck")
    resumed = launch_local(plan, 2, steps=1, lr=LR, check=False, data=tmp_path / "data.pt", load_dir=tmp_path / "ck")
    assert resumed.losses == pytest.approx(ref.losses[2:], abs=1e-5)
    assert ref.losses[2] != pytest.approx(
        reference_run(plan.model, global_batch=8, steps=3, lr=LR, batches=[batches[0], batches[1], batches[0]]).losses[
            2
        ]
    )
