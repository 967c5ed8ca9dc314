"""Counting a training run's useful FLOPs: what the bench reports as speed, and what
a profile's `flop_budget` spends (the multi30k profile's is fixed in FLOPs, so that a
smaller model buys more epochs and every machine trains the same model)."""

from __future__ import annotations

import the_annotated_transformer as tat
from workshop.errors import UsageError


def training_flops(model, batches):
    """Useful FLOPs of one training pass of `model` over `batches`.

    Per sentence with s source and t target tokens (padding excluded: it is work, but
    not useful work), over N layers of width d:

        6 * ((P_enc + P_kv) * s + (P_dec - P_kv + P_gen) * t)   multiplies by weights
      + 12 * N * d * (s^2 + t^2 + s*t)                          attention

    P_enc, P_dec, P_gen are the weight-matrix parameters of the encoder, decoder and
    generator (embedding lookups are not multiplies); P_kv is the part of P_dec that
    projects the encoder's output into keys and values for cross-attention, which
    runs once per source token, not per target token. A forward pass multiplies and
    adds once per weight per token (2 FLOPs); the backward pass costs twice that,
    hence 6. Each attention layer forms Q K^T and weights V, 2 * L_q * L_k * d FLOPs
    each forward, 3 times that with backward: 12 * L_q * L_k * d, for encoder self-
    attention (s * s), decoder self-attention (t * t, the causal half included) and
    cross-attention (t * s). Every term is per sentence, so the count does not
    depend on how the sentences are batched or shuffled.
    """

    def matrices(module):
        return sum(p.numel() for p in module.parameters() if p.dim() == 2)

    p_enc, p_dec = matrices(model.encoder), matrices(model.decoder)
    p_gen = matrices(model.generator)
    # Cross-attention's key and value projections of the encoder's output run once
    # per source token, not once per target token.
    p_kv = sum(matrices(x.src_attn.linears[1:3]) for x in model.decoder.layers)
    n_layers, d_model = len(model.encoder.layers), model.generator.proj.in_features
    flops = 0
    for batch in batches:
        s = batch.src_mask[:, 0].sum(-1).double()  # (batch,) real source tokens
        t = (batch.tgt_y != tat.PAD).sum(-1).double()  # (batch,) real target tokens
        matmuls = 6 * ((p_enc + p_kv) * s + (p_dec - p_kv + p_gen) * t)
        attention = 12 * n_layers * d_model * (s * s + t * t + s * t)
        flops += float((matmuls + attention).sum())
    return flops


def epochs_for_budget(budget, epoch_flops):
    """The most whole epochs of `epoch_flops` each that `budget` FLOPs pay for."""
    epochs = int(budget // epoch_flops)
    if epochs < 1:
        one = f"one epoch of this model ({epoch_flops:.4g} training FLOPs)"
        raise UsageError(f"flop_budget={budget:.4g} does not pay for {one}.")
    return epochs
