"""The eleven workloads of nnScaler's evaluation (Lin et al., OSDI 2024) as model presets.

Swin Transformer and T5 as the paper's artifact configures them (microsoft/nnscaler, branch
``osdi24ae``: ``cupilot/evaluation/{swin,t5}_{4,8,16,32}gpus.sh`` give layers, hidden size, heads,
vocabulary, image and window size per GPU count; ``cupilot/examples/swin/model.py::build_config``
and ``cupilot/examples/t5/train.py`` turn them into the models' shapes):

* Swin: image 1536 x 1536, window 48, 4 x 4 patches, ``embed = hidden``, depths
  ``(2, 2, layers - 6, 2)``, heads ``(heads, 2 heads, 4 heads, 8 heads)``, MLP ratio 4, 1,024 classes.
  The artifact's model also has dropout and stochastic depth at 0.2; planlab's Swin leaves both out.
* T5: ``layers`` encoder and as many decoder layers, sequence 1,024 for both, ``head_dim = hidden /
  heads``, ``d_ff = 4 hidden``, vocabulary ``K * 1000``, dropout 0.1 (the artifact's
  ``Config.dropout_rate`` default, which train.py does not override), the two-matrix GELU
  feed-forward (``gated_ffn=False``; the artifact's ``feedforward``), and the vocabulary-parallel
  embedding and loss (``vocab_parallel=1``: nnScaler splits the output layer and its loss along the
  vocabulary, as Megatron-LM's T5 does; the interlaced pipeline needs it at micro-batch 1, where the
  loss's sequences cannot split over every device). planlab's T5 differs otherwise:
  its output layer is untied from the embedding (the artifact ties them: one more ``vocab x hidden``
  matrix here, as planlab gives each weight one operator), its linear layers have no biases, it has
  relative position biases and RMS norms where the artifact has learned absolute positions and
  LayerNorm, and its loss is cross-entropy where the artifact sums the logits.

AlphaFold2's Evoformer: the artifact has no AlphaFold2 script; the three shapes are the paper's
(section 7, as issue 18 quotes them): 48 blocks, two recycling passes (``recycles=3``: two forwards
without gradients, then one with, nnScaler's "3F1B"), (N_seq, N_res) = (128, 256), (512, 256) and
(512, 384), with AlphaFold2's channel sizes (the ``alphafold2`` preset's).
"""

from __future__ import annotations

from planlab.models.configs import EvoformerConfig, SwinConfig, T5Config

# (GPUs, layers, hidden, heads) of cupilot/evaluation/swin_{N}gpus.sh
SWIN_RUNS: tuple[tuple[int, int, int, int], ...] = (
    (4, 32, 512, 16),
    (8, 40, 768, 24),
    (16, 48, 1024, 32),
    (32, 56, 1536, 32),
)
# (GPUs, layers, hidden, heads, vocabulary in thousands) of cupilot/evaluation/t5_{N}gpus.sh
T5_RUNS: tuple[tuple[int, int, int, int, int], ...] = (
    (4, 24, 2048, 32, 512),
    (8, 32, 3072, 48, 1024),
    (16, 32, 4096, 64, 1536),
    (32, 32, 6144, 96, 2048),
)
# (N_seq, N_res) of the paper's three AlphaFold2 settings
EVOFORMER_SHAPES: tuple[tuple[int, int], ...] = ((128, 256), (512, 256), (512, 384))


def nnscaler_swin(layers: int, hidden: int, heads: int) -> SwinConfig:
    """The artifact's ``build_config(layers, hidden, heads, 1536, 48)``."""
    return SwinConfig(
        embed=hidden,
        depths=(2, 2, layers - 6, 2),
        num_heads=(heads, 2 * heads, 4 * heads, 8 * heads),
        image=1536,
        patch=4,
        window=48,
        classes=1024,
    )


def nnscaler_t5(layers: int, hidden: int, heads: int, vocab_k: int) -> T5Config:
    """The artifact's T5 ``Config(vocab, hidden, hidden // heads, 4 * hidden, layers, heads, 1024)``."""
    return T5Config(
        encoder_layers=layers,
        decoder_layers=layers,
        hidden=hidden,
        heads=heads,
        head_dim=hidden // heads,
        ffn_hidden=4 * hidden,
        seq=1024,
        decoder_seq=1024,
        vocab=vocab_k * 1000,
        dropout=0.1,
        gated_ffn=False,
        vocab_parallel=1,
    )


def nnscaler_evoformer(n_seq: int, n_res: int) -> EvoformerConfig:
    """AlphaFold2's 48-block Evoformer at (N_seq, N_res) with two recycling passes."""
    return EvoformerConfig(blocks=48, c_m=256, c_z=128, heads_msa=8, heads_pair=4, n_seq=n_seq, n_res=n_res, recycles=3)


NNSCALER_SWIN_PRESETS: dict[str, SwinConfig] = {
    f"nnscaler-swin-{gpus}gpu": nnscaler_swin(layers, hidden, heads) for gpus, layers, hidden, heads in SWIN_RUNS
}
NNSCALER_T5_PRESETS: dict[str, T5Config] = {
    f"nnscaler-t5-{gpus}gpu": nnscaler_t5(layers, hidden, heads, vocab_k)
    for gpus, layers, hidden, heads, vocab_k in T5_RUNS
}
NNSCALER_EVOFORMER_PRESETS: dict[str, EvoformerConfig] = {
    f"nnscaler-evoformer-{n_seq}x{n_res}": nnscaler_evoformer(n_seq, n_res) for n_seq, n_res in EVOFORMER_SHAPES
}
