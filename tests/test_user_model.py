"""A user's own model by ``package.module:function``: built, rescaled to the global batch, traced,
explored on the cpu cluster, saved in a plan file and run on 2 gloo ranks; bad functions
get a ConfigError naming the model and what was expected."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import planlab
from planlab.cli import GRAD_TOL, LOSS_TOL, main
from planlab.errors import ConfigError
from planlab.executor import launch_local
from planlab.graph import trace
from planlab.models import ModelSpec, build_model
from planlab.plan import load_plan, save_plan

HERE = __name__  # this module, as the model functions' package path ("test_user_model")


class Classifier(nn.Module):
    """Residual MLP layers in ``blocks`` and a cross-entropy loss over ``classes``."""

    def __init__(self, features: int, hidden: int, classes: int, layers: int) -> None:
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(layers))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # x: (B, features), y: (B,) class ids
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return F.cross_entropy(self.head(h), y)


def classifier(layers: int = 2, hidden: int = 16):
    """A user's model function: the module and 4 example samples."""
    x = torch.randn(4, 8)
    y = torch.randint(0, 3, (4,))
    return Classifier(8, hidden, 3, layers), (x, y)


def raises():
    raise RuntimeError("no data here")


def only_module():
    return Classifier(8, 16, 3, 1)


def inputs_not_tensors():
    return Classifier(8, 16, 3, 1), ([1, 2, 3],)


def not_a_module():
    return (lambda x: x), (torch.zeros(2, 3),)


def batches_differ():
    return Classifier(8, 16, 3, 1), (torch.zeros(4, 8), torch.zeros(2, dtype=torch.long))


NOT_CALLABLE = 3


def test_builds_with_inputs_rescaled_to_the_batch():
    spec = ModelSpec(f"{HERE}:classifier")
    for batch in (3, 4, 10):
        model, (x, y) = build_model(spec, batch=batch, device="cpu")
        assert x.shape == (batch, 8) and y.shape == (batch,)
        assert model(x, y).shape == ()
    _, (x10, _) = build_model(spec, batch=10, device="cpu")
    assert torch.equal(x10[4:8], x10[:4])  # repeated along the batch
    meta, (xm, _) = build_model(spec, batch=6)
    assert xm.device.type == "meta" and all(p.device.type == "meta" for p in meta.parameters())
    # the same seed builds the same weights and inputs in every process
    a, (xa, _) = build_model(spec, batch=4, device="cpu", seed=5)
    b, (xb, _) = build_model(spec, batch=4, device="cpu", seed=5)
    assert torch.equal(xa, xb) and all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_config_reads_layers_and_arguments_become_keywords():
    assert ModelSpec(f"{HERE}:classifier").config().layers == 2
    cfg = ModelSpec(f"{HERE}:classifier", (("hidden", 32), ("layers", 4))).config()
    assert cfg.layers == 4 and cfg.heads == 1 and cfg.kv_heads is None
    assert cfg.num_params() == sum(p.numel() for p in Classifier(8, 32, 3, 4).parameters())


def test_traces_and_explores_on_the_cpu_cluster(tmp_path):
    spec = ModelSpec(f"{HERE}:classifier")
    model, inputs = build_model(spec, batch=8)
    g = trace(model, inputs)
    assert not g.unknown and g.loss == "cross_entropy"
    df = planlab.explore(spec, cluster="cpu", nodes=2, space="megatron", global_batch=8, out=tmp_path)
    assert df["feasible"].any()
    assert set(df["pp"]) == {1, 2} and set(df["tp"]) == {1}  # 2 layers; no attention heads to split
    best = df.attrs["best_plan"]
    save_plan(best, tmp_path / "plan.json")
    plan = load_plan(tmp_path / "plan.json")
    assert plan.model == spec
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL


@pytest.mark.parametrize(
    "fn, message",
    [
        ("raises", "model function '{m}:raises' raised RuntimeError: no data here"),
        ("only_module", "model function '{m}:only_module' must return (module, example_inputs)"),
        ("inputs_not_tensors", "model function '{m}:inputs_not_tensors' must return (module, example_inputs)"),
        ("not_a_module", "its first value is a function"),
        ("batches_differ", "example inputs must share a non-zero first (batch) dimension"),
        ("NOT_CALLABLE", "model '{m}:NOT_CALLABLE' is a int; expected a function"),
        ("missing", "cannot load model '{m}:missing': AttributeError"),
    ],
)
def test_bad_model_functions_get_a_config_error(fn, message):
    spec = ModelSpec(f"{HERE}:{fn}")
    for call in (spec.config, lambda: build_model(spec, batch=2, device="cpu")):
        with pytest.raises(ConfigError) as info:
            call()
        assert message.format(m=HERE) in str(info.value)


def test_unknown_module_and_bad_keyword():
    with pytest.raises(ConfigError, match="cannot load model 'no_such_pkg.mod:fn': ModuleNotFoundError"):
        ModelSpec("no_such_pkg.mod:fn").config()
    with pytest.raises(ConfigError, match="raised TypeError"):
        ModelSpec(f"{HERE}:classifier", (("colour", 3),)).config()


def test_command_prints_one_line(capsys):
    code = main(["explore", "--model", f"{HERE}:raises", "--cluster", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (f"planlab: error: model function '{HERE}:raises' raised RuntimeError: no data here")


class _Branchy(nn.Module):  # control flow on a value, which torch.fx cannot follow
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:
            h = h * 2
        return h.mean()


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(self.emb(x)).mean()


def test_untraceable_code_is_reported_with_its_source_line():
    import inspect

    from planlab.errors import GraphError

    line = inspect.getsourcelines(_Branchy.forward)[1] + 2
    with pytest.raises(GraphError, match=rf"_Branchy at .*test_user_model.py:{line} \(if h.sum\(\) > 0:\)"):
        trace(_Branchy(), (torch.randn(4, 8),))


def test_tied_weights_are_refused_by_name():
    from planlab.errors import GraphError

    with pytest.raises(GraphError, match="'emb.weight' is tied to 'out.weight'"):
        trace(_Tied(), (torch.randint(0, 16, (4, 3)),))
