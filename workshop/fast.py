"""Speed tricks the book leaves out, which training runs put into the book's
models: a cheaper dropout, fused attention and a fused label-smoothing loss. Tests
check each against the book's plain version."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import the_annotated_transformer as tat


class Dropout(nn.Dropout):
    """nn.Dropout, drawing its mask from 16 random bits per element on a CPU.

    nn.Dropout draws one random float per element; on a CPU the generator is then a
    fifth of a small model's training step. This draws 64 random bits at a time and
    cuts them into four 16-bit numbers, one per element: the same coin with p rounded
    to a multiple of 1/65536, for a quarter of the generator's work. On a GPU it is
    nn.Dropout unchanged.
    """

    def forward(self, x):
        if not self.training or not 0.0 < self.p < 1.0 or x.device.type != "cpu":
            return super().forward(x)
        return x * dropout_keep_mask(x, self.p)


def dropout_keep_mask(x, p):
    """A mask like x: 0 with probability p, else 1 / (1 - p) (p in 1/65536 steps)."""
    n = x.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64)
    words.random_(-(2**63), 2**63 - 1)  # uniform over (almost) every int64
    draws = words.view(torch.int16)[:n].view(x.shape)  # uniform in [-32768, 32767]
    dropped = round(p * 65536)  # how many of the 65536 values mean "drop"
    keep = draws >= dropped - 32768
    return keep.to(x.dtype).mul_(65536 / (65536 - dropped))


def use_fast_dropout(model):
    """Replace every nn.Dropout in `model` by this module's Dropout (same p)."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Dropout:
                setattr(module, name, Dropout(child.p, child.inplace))
    return model


class FusedAttention(tat.MultiHeadedAttention):
    """The book's attention layer, with the heads computed by PyTorch's fused
    scaled_dot_product_attention: the same arithmetic in one kernel, without
    materialising the weights (so `.attn` stays None)."""

    def attend(self, query, key, value, mask=None):
        mask = None if mask is None else mask.unsqueeze(1)  # the same for every head
        p = self.dropout.p if self.training else 0.0
        x = F.scaled_dot_product_attention(query, key, value, mask, dropout_p=p)
        x = x.transpose(1, 2).contiguous().view(x.size(0), -1, self.h * self.d_k)
        return self.linears[-1](x)


def fused(attention):
    """A FusedAttention that shares the book layer's projections and dropout (the
    same parameters, so training either trains both)."""
    layer = FusedAttention(
        attention.h, attention.h * attention.d_k, attention.dropout.p
    )
    layer.linears, layer.dropout = attention.linears, attention.dropout
    return layer.train(attention.training)


def use_fused_attention(model):
    """Put a FusedAttention in place of every book MultiHeadedAttention in `model`;
    returns the model (or, for a bare attention layer, its fused twin)."""
    if type(model) is tat.MultiHeadedAttention:
        return fused(model)
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is tat.MultiHeadedAttention:
                setattr(module, name, fused(child))
    return model


class LabelSmoothing(tat.LabelSmoothing):
    """The book's LabelSmoothing, computed without building the target table q.

    q takes two values: `confidence` on the target and `spread` on every other word
    but padding. So sum_c q_c (log q_c - x_c) is -confidence * x_target - spread *
    (the sum of the other non-padding x_c) + sum_c q_c log q_c, and the gradient with
    respect to x is -q, which the backward pass writes once. `spread`, `last_target`
    and `true_dist` are the book's.
    """

    def forward(self, x, target):
        """x: (n, size) log-probabilities; target: (n,) ids. Returns the summed loss."""
        self.last_target = target.detach()
        return _SmoothedKL.apply(x, target, self)


def neg_entropy(crit):
    """sum_c q_c log q_c of one non-padding row: the loss's constant part."""
    value = crit.confidence * math.log(crit.confidence)
    if crit.spread > 0:
        value += (crit.size - 2) * crit.spread * math.log(crit.spread)
    return value


class _SmoothedKL(torch.autograd.Function):
    """LabelSmoothing's summed loss, with the gradient -q written in one pass."""

    @staticmethod
    def forward(ctx, x, target, crit):
        pad = crit.padding_idx
        x_target = x.gather(1, target.unsqueeze(1)).squeeze(1)
        x_others = x.sum(1) - x[:, pad] - x_target
        cross_entropy = -(crit.confidence * x_target + crit.spread * x_others)
        per_row = cross_entropy + neg_entropy(crit)
        ctx.save_for_backward(target)
        ctx.crit, ctx.dtype = crit, x.dtype
        return per_row.masked_fill(target == pad, 0.0).sum()

    @staticmethod
    def backward(ctx, grad):
        (target,) = ctx.saved_tensors
        q = ctx.crit.smoothed_targets(target, ctx.dtype)  # zero rows for padding
        return q.mul_(-grad), None, None
