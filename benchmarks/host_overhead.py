"""The host's time per framework call of eager PyTorch: what a GPU waits for when its kernels are short.

Eager PyTorch issues every operator from Python: the interpreter, the dispatcher and autograd's
recording (forward), and the autograd engine's call of each node (backward), before the kernel
launch itself. Those costs do not depend on the tensors' sizes, so this script measures them on
this machine's CPU with one-element tensors (whose CPU kernels take a fraction of a microsecond):

* per forward call of the operators a transformer layer uses (linear, layer norm, GELU, dropout,
  softmax, batched matmul, add, views), with autograd recording;
* per backward node of the same operators;
* a transformer layer written as Megatron-LM writes it (apex-style layer norm and fused softmax
  as autograd Functions, fused q/k/v, unfused attention with dropout in an RNG-state fork,
  TorchScript bias-dropout-add and bias-GELU), run forward without autograd, then recomputed
  and run backward through reentrant activation checkpointing, as Megatron-DeepSpeed runs it.

The layer's host time, spread over the calls planlab's kernel model counts for one layer of
its GPT (forward: the first forward and the recompute; backward: the rest), gives
``host_call_us`` and ``host_backward_call_us`` of a spec's ``software``
(``planlab/costmodel/software/*.json`` cite this script's output). Repetitions take
the lower quartile of the process's CPU time (``time.process_time``, one torch thread), which
other processes sharing the machine change little. The launch of a CUDA kernel
(``host_launch_us``) cannot be measured here (no GPU) and comes from published figures.

    .venv/bin/python benchmarks/host_overhead.py [--reps 30]
"""

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHAIN = 200  # calls per timed chain


def lower_quartile(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 4]


def per_call_us(make, reps: int) -> tuple[float, float]:
    """(forward us per call, backward us per node) of a chain of CHAIN calls of ``make(y, i)``
    (the ``i``-th call gets its own parameters, as the layers of a model do)."""
    x = torch.ones(1, 1, requires_grad=True)

    def chain():
        y = x
        for i in range(CHAIN):
            y = make(y, i)
        return y

    for _ in range(3):
        chain().sum().backward()
    fwd, both = [], []
    for _ in range(reps):
        t = time.process_time()
        y = chain()
        fwd.append(time.process_time() - t)
        t = time.process_time()
        y.sum().backward()
        both.append(time.process_time() - t)
    return lower_quartile(fwd) / CHAIN * 1e6, lower_quartile(both) / CHAIN * 1e6


def ops() -> dict:
    w = [torch.ones(1, 1, requires_grad=True) for _ in range(CHAIN)]
    b = [torch.ones(1, requires_grad=True) for _ in range(CHAIN)]
    g = [torch.ones(1, requires_grad=True) for _ in range(CHAIN)]
    return {
        "linear": lambda y, i: F.linear(y, w[i], b[i]),
        "layer_norm": lambda y, i: F.layer_norm(y, (1,), g[i], b[i]),
        "gelu": lambda y, i: F.gelu(y),
        "dropout": lambda y, i: F.dropout(y, 0.1, True),
        "softmax": lambda y, i: F.softmax(y, -1),
        "bmm": lambda y, i: torch.bmm(y.unsqueeze(0), y.unsqueeze(0)).squeeze(0),
        "add": lambda y, i: y + y,
        "view": lambda y, i: y.view(1, 1),
        "transpose": lambda y, i: y.transpose(0, 1),
    }


@torch.jit.script
def bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


@torch.jit.script
def bias_gelu_back(g: torch.Tensor, bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = bias + y
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
    return ff * g


class BiasGeLU(torch.autograd.Function):
    """Megatron-LM's fused bias-GELU: an autograd Function around two TorchScript functions."""

    @staticmethod
    def forward(ctx, y, bias):
        ctx.save_for_backward(y, bias)
        return bias_gelu(bias, y)

    @staticmethod
    def backward(ctx, g):
        y, bias = ctx.saved_tensors
        tmp = bias_gelu_back(g, bias, y)
        return tmp, tmp


@torch.jit.script
def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, prob: float) -> torch.Tensor:
    return residual + F.dropout(x + bias, p=prob, training=True)


class FusedLayerNorm(torch.autograd.Function):
    """apex's fused layer norm as Megatron calls it: an autograd Function around the kernels."""

    @staticmethod
    def forward(ctx, x, w, b):
        y, mean, rstd = torch.ops.aten.native_layer_norm(x, (x.shape[-1],), w, b, 1e-5)
        ctx.save_for_backward(x, w, b, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, b, mean, rstd = ctx.saved_tensors
        return torch.ops.aten.native_layer_norm_backward(g, x, (x.shape[-1],), mean, rstd, w, b, [True, True, True])


class MaskedSoftmax(torch.autograd.Function):
    """Megatron's fused scale-mask-softmax: an autograd Function around one kernel each way."""

    @staticmethod
    def forward(ctx, scores, mask, scale: float):
        probs = torch.softmax((scores * scale).masked_fill(mask, -10000.0), -1)
        ctx.save_for_backward(probs)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx, g):
        (probs,) = ctx.saved_tensors
        return torch._softmax_backward_data(g, probs, -1, probs.dtype) * ctx.scale, None, None


class RngFork:
    """Megatron's CUDA RNG tracker fork around attention dropout: save, swap and restore states."""

    def __enter__(self):
        self.saved = torch.get_rng_state()
        torch.set_rng_state(self.saved)

    def __exit__(self, *exc):
        torch.set_rng_state(self.saved)


class Layer(nn.Module):
    """Megatron-LM's GPT layer at toy size, written as Megatron writes it: [s, b, h] activations,
    fused layer norm and q/k/v projection, baddbmm scores, the fused softmax, attention dropout in
    an RNG fork, bmm, permute-contiguous, row-parallel projection without bias, TorchScript
    bias-dropout-add, the bias-GELU Function."""

    def __init__(self, h: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.h, self.heads = h, heads
        self.ln1_w, self.ln1_b = nn.Parameter(torch.ones(h)), nn.Parameter(torch.zeros(h))
        self.ln2_w, self.ln2_b = nn.Parameter(torch.ones(h)), nn.Parameter(torch.zeros(h))
        self.qkv = nn.Linear(h, 3 * h)
        self.dense = nn.Linear(h, h, bias=False)
        self.dense_bias = nn.Parameter(torch.zeros(h))
        self.fc = nn.Linear(h, 4 * h, bias=False)
        self.fc_bias = nn.Parameter(torch.zeros(4 * h))
        self.proj = nn.Linear(4 * h, h, bias=False)
        self.proj_bias = nn.Parameter(torch.zeros(h))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        hd = h // self.heads
        y = FusedLayerNorm.apply(x, self.ln1_w, self.ln1_b)
        q, k, v = torch.split(self.qkv(y).view(s, b, self.heads, 3 * hd), hd, dim=-1)
        q, k, v = (t.reshape(s, b * self.heads, hd) for t in (q, k, v))
        scores = torch.baddbmm(
            torch.empty(b * self.heads, s, s), q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2), beta=0.0, alpha=1.0
        )
        probs = MaskedSoftmax.apply(scores.view(b, self.heads, s, s), mask, hd**-0.5)
        with RngFork():
            probs = F.dropout(probs, 0.1, True)
        ctx = torch.bmm(probs.view(b * self.heads, s, s), v.transpose(0, 1))
        ctx = ctx.view(b, self.heads, s, hd).permute(2, 0, 1, 3).contiguous().view(s, b, h)
        x = bias_dropout_add(self.dense(ctx), self.dense_bias.expand_as(x), x, 0.1)
        y = BiasGeLU.apply(self.fc(FusedLayerNorm.apply(x, self.ln2_w, self.ln2_b)), self.fc_bias)
        return bias_dropout_add(self.proj(y), self.proj_bias.expand_as(x), x, 0.1)


def layer_us(reps: int, layers: int = 8) -> tuple[float, float, float]:
    """Host us per layer: (forward without autograd, forward and backward, forward + recompute +
    backward with reentrant activation checkpointing as Megatron and DeepSpeed do it)."""
    stack = nn.ModuleList(Layer() for _ in range(layers))
    mask = torch.triu(torch.ones(4, 4, dtype=torch.bool), 1)

    def plain():
        x = torch.ones(4, 1, 8, requires_grad=True)
        for layer in stack:
            x = layer(x, mask)
        x.sum().backward()

    def forward_only():
        with torch.no_grad():
            x = torch.ones(4, 1, 8)
            for layer in stack:
                x = layer(x, mask)

    def ckpt():
        x = torch.ones(4, 1, 8, requires_grad=True)
        for layer in stack:
            x = checkpoint(layer, x, mask, use_reentrant=True)
        x.sum().backward()

    out = []
    for step in (forward_only, plain, ckpt):
        for _ in range(5):
            step()
        ts = []
        for _ in range(reps):
            t = time.process_time()
            step()
            ts.append(time.process_time() - t)
        out.append(lower_quartile(ts) / layers * 1e6)
    return out[0], out[1], out[2]


def planlab_layer_calls() -> tuple[int, int, int]:
    """(forward calls, backward calls, kernels forward + recompute + backward) of one layer of
    planlab's GPT in the kernel model's ``megatron`` implementation."""
    from planlab.costmodel.kernels import op_kernels
    from planlab.validation import megatron_gpt
    from planlab.graph.trace import trace

    model, inputs = megatron_gpt(layers=1, hidden=64, heads=4, seq=32, vocab=128, batch=2)
    g = trace(model, inputs)
    calls_f = calls_b = kernels = 0
    for op in g.operators:
        if not op.module.startswith("blocks."):
            continue
        shapes = tuple(g.tensors[t].shape for t in op.inputs + op.outputs)
        for ph in ("F", "B"):
            found = op_kernels(op.kind, ph, shapes, 2, "megatron")
            if found is None:
                continue
            if ph == "F":
                calls_f += found.calls
                kernels += 2 * len(found.kernels)
            else:
                calls_b += found.calls
                kernels += len(found.kernels)
    return calls_f, calls_b, kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    fwd, bwd = {}, {}
    for name, make in ops().items():
        f, both = per_call_us(make, args.reps)
        fwd[name], bwd[name] = f, both - f
        print(f"{name:10s} forward {f:5.1f} us per call   backward {both - f:5.1f} us per node")
    kernels = [k for k in fwd if k not in ("view", "transpose")]
    print(
        f"median over operators with a kernel: forward {statistics.median(fwd[k] for k in kernels):.1f} us, "
        f"backward {statistics.median(bwd[k] for k in kernels):.1f} us; views: forward "
        f"{statistics.median((fwd['view'], fwd['transpose'])):.1f} us, backward "
        f"{statistics.median((bwd['view'], bwd['transpose'])):.1f} us"
    )
    fwd_nograd, plain, ckpt = layer_us(args.reps)
    calls_f, calls_b, kernels = planlab_layer_calls()
    per_f = fwd_nograd / calls_f
    per_b = (ckpt - 2 * fwd_nograd) / calls_b
    print(
        f"Megatron-style layer (toy size), host us per layer: forward without autograd {fwd_nograd:.0f}, forward "
        f"and backward {plain:.0f}, forward + recompute + backward (reentrant checkpointing) {ckpt:.0f}"
    )
    print(
        f"planlab's GPT layer in the kernel model: {calls_f} calls forward, {calls_b} backward, {kernels} kernels "
        f"(forward, recompute, backward); the measured layer spread over them: host_call_us = {per_f:.1f}, "
        f"host_backward_call_us = {per_b:.1f}"
    )


if __name__ == "__main__":
    main()
