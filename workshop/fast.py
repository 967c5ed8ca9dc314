"""CPU speed tricks the book leaves out: a cheaper dropout and a fused label-smoothing
loss. Training runs (workshop.runs) put them into the book's models; tests check each
against the book's plain version."""

from __future__ import annotations

import math

import torch
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


class LabelSmoothing(tat.LabelSmoothing):
    """The book's LabelSmoothing, computed without building the target table q.

    q takes two values: `confidence` on the target and `spread` on every other word
    but padding. So sum_c q_c (log q_c - x_c) is -confidence * x_target - spread *
    (the sum of the other non-padding x_c) + sum_c q_c log q_c, and the gradient with
    respect to x is -q, which the backward pass writes once.
    """

    def forward(self, x, target):
        if x.dim() != 2 or x.size(1) != self.size:
            return super().forward(x, target)  # the book's message
        self._last_target = target.detach()
        return _SmoothedKL.apply(x, target, self)


def neg_entropy(crit):
    """sum_c q_c log q_c of one non-padding row: the loss's constant part."""
    spread = crit.smoothing / (crit.size - 2)
    value = crit.confidence * math.log(crit.confidence)
    if spread > 0:
        value += (crit.size - 2) * spread * math.log(spread)
    return value


class _SmoothedKL(torch.autograd.Function):
    """LabelSmoothing's summed loss, with the gradient -q written in one pass."""

    @staticmethod
    def forward(ctx, x, target, crit):
        spread = crit.smoothing / (crit.size - 2)
        pad = crit.padding_idx
        x_target = x.gather(1, target.unsqueeze(1)).squeeze(1)
        x_others = x.sum(1) - x[:, pad] - x_target
        cross_entropy = -(crit.confidence * x_target + spread * x_others)
        per_row = cross_entropy + neg_entropy(crit)
        ctx.save_for_backward(target)
        ctx.crit, ctx.dtype = crit, x.dtype
        return per_row.masked_fill(target == pad, 0.0).sum()

    @staticmethod
    def backward(ctx, grad):
        (target,) = ctx.saved_tensors
        q = ctx.crit.smoothed_targets(target, ctx.dtype)  # zero rows for padding
        return q.mul_(-grad), None, None
