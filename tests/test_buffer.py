"""Typed buffers and task roles: the text form of every kind of buffer (golden), equality, hashing
and pickling by value, which kinds are static, the variants passes make; every (kind, role) of
the tasks materialize makes is one the interpreter runs, and nothing in them is left untyped."""

import pickle

import pytest

from planlab.executor.interpreter import Interpreter
from planlab.plan import buffer as b
from planlab.plan.buffer import Buffer, BufferKind
from planlab.plan.program import Role, TaskKind

from golden_predictions import CASES, programs_of


@pytest.mark.parametrize(
    "buf, text",
    [
        (b.weight("blocks.0.fc.weight"), "w:blocks.0.fc.weight"),
        (b.weight_grad("wte.weight"), "wg:wte.weight"),
        (b.source("idx"), "src:idx"),
        (b.activation("fc"), "a:fc"),
        (b.activation("fc", 2), "a:fc#2"),
        (b.activation("fc", 2).at_step(1), "a:fc#2~1"),
        (b.activation("fc", 0).at_chunk(3), "a:fc#0@3"),
        (b.grad("x"), "g:x"),
        (b.grad("x").at_step(2), "g:x~2"),
        (b.contribution("x", "fc", 1), "gc:x<fc.1"),
        (b.contribution("x", "fc", 1).at_chunk(0), "gc:x<fc.1@0"),
        (b.grad_sum("x", 1), "gs:x#1"),
        (b.activation("y", 1).with_kind(BufferKind.RECOMPUTED), "r:y#1"),
        (b.activation("y").with_kind(BufferKind.REMADE).at_chunk(1), "o:y@1"),
        (b.shard_grad((0, 1)), "zg:[0, 1]"),
        (b.shard_weight((2, 3), "blocks.1"), "zp:blocks.1[2, 3]"),
        (Buffer(BufferKind.GATHERED_FORWARD, "p"), "zf:p"),
        (Buffer(BufferKind.GATHERED_BACKWARD, "p"), "zb:p"),
        (Buffer(BufferKind.FULL_GRAD, "p"), "zd:p"),
    ],
)
def test_text_form(buf, text):
    assert str(buf) == text and repr(buf) == f"Buffer({text})"


def test_values_compare_hash_and_pickle_by_their_fields():
    x = b.contribution("x", "fc", 0).at_chunk(1)
    y = Buffer(BufferKind.CONTRIBUTION, "x", chunk=1, consumer="fc", input=0)
    assert x == y and hash(x) == hash(y) and x is not y and {x: 1}[y] == 1
    assert pickle.loads(pickle.dumps(x)) == x
    assert x != x.at_chunk(0) and x != x.with_kind(BufferKind.GRAD) and b.activation("x") != b.activation("x", 0)
    assert b.shard_grad((0, 1), "u") != b.shard_grad((0, 2), "u") and b.activation("x") != "a:x"
    with pytest.raises(AttributeError):
        x.chunk = 2  # frozen


def test_static_kinds_live_all_iteration():
    static = {k for k in BufferKind if Buffer(k, "t").static}
    assert static == {
        BufferKind.SOURCE,
        BufferKind.WEIGHT,
        BufferKind.WEIGHT_GRAD,
        BufferKind.SHARD_GRAD,
        BufferKind.SHARD_WEIGHT,
        BufferKind.HOST_GRAD,
        BufferKind.HOST_WEIGHT,
    }


@pytest.fixture(scope="module")
def programs():
    """The programs of the golden plans, reduced to device classes as explore makes them."""
    return {c.name: programs_of(c)[0] for c in CASES}


def test_every_task_is_typed_and_run_by_its_kind_and_role(programs):
    seen = set()
    for name, prog in programs.items():
        for dp in prog.devices:
            for block in dp.blocks.values():
                for t in block.tasks:
                    seen.add((t.kind, t.role))
                    assert (t.kind, t.role) in Interpreter.RUNS, (name, str(t), t.role)
                    assert all(x is None or isinstance(x, Buffer) for x in t.reads + t.writes), (name, str(t))
                    assert all(isinstance(x, Buffer) for x in t.saved + t.free + tuple(x for x, _ in t.alloc))
                    if t.kind is TaskKind.COLLECTIVE:
                        assert t.ident >= 0, (name, str(t))
                    if t.kind is TaskKind.OPTIMIZER:
                        assert t.params > 0 and t.flops == pytest.approx(12.0 * t.params, rel=1e-12)
    # the table covers every role the executor distinguishes
    assert {r for _, r in seen} == set(Role)
