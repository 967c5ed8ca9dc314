"""Speed tricks the book leaves out: a cheaper dropout, fused attention and a fused
label-smoothing loss, which training runs (workshop.runs) put into the book's models,
and a beam search over a whole batch at once, which evaluation uses. Tests check
each against the book's plain version."""

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


def use_fused_attention(model):
    """Make every book MultiHeadedAttention in `model` a FusedAttention (in place)."""
    for module in model.modules():
        if type(module) is tat.MultiHeadedAttention:
            module.__class__ = FusedAttention
            module.attn = None
    return model


class LabelSmoothing(tat.LabelSmoothing):
    """The book's LabelSmoothing, computed without building the target table q.

    q takes two values: `confidence` on the target and `spread` on every other word
    but padding. So sum_c q_c (log q_c - x_c) is -confidence * x_target - spread *
    (the sum of the other non-padding x_c) + sum_c q_c log q_c, and the gradient with
    respect to x is -q, which the backward pass writes once.
    """

    def __init__(self, size, padding_idx, smoothing=0.0):
        super().__init__(size, padding_idx, smoothing)
        self.last_target = None  # the targets of the last call, for true_dist

    @property
    def true_dist(self):
        """q for the targets of the last call, as the book's LabelSmoothing has it."""
        if self.last_target is None:
            return None
        return self.smoothed_targets(self.last_target)

    def forward(self, x, target):
        """x: (n, size) log-probabilities; target: (n,) ids. Returns the summed loss."""
        self.last_target = target.detach()
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


def next_beam(b, candidates, ys, step, finished, last, k, end_symbol, alpha):
    """Sentence b's next beam from its best (score, flat index) candidates: up to k
    (row, token, score); hypotheses that end here join finished[b] instead."""
    beam, vocab = [], candidates[2]
    for rank, (score, flat) in enumerate(zip(*candidates[:2], strict=True)):
        if len(finished[b]) >= k or len(beam) == k or score == float("-inf"):
            break
        row, token = b * k + flat // vocab, flat % vocab
        if token == end_symbol or last:
            if rank < k:  # only candidates that would have made the beam count
                ids = ys[row].tolist() + [token]
                finished[b].append((score / tat.length_penalty(step, alpha), ids))
            continue
        beam.append((row, token, score))
    return beam


def advance_beams(ys, scores, log_probs, step, finished, last, k, end, pad, alpha):
    """One beam-search step for every sentence: returns (ys, scores, rows kept).

    It adds each hypothesis's score to the log-probabilities of its next tokens,
    keeps the 2k best of the k * V extensions (enough for k to go on even if k of
    them end), lets next_beam choose, and fills a finished sentence's beam with dead
    rows of score -inf.
    """
    B, vocab = scores.size(0), log_probs.size(-1)
    total = (scores.unsqueeze(-1) + log_probs.view(B, k, vocab)).view(B, -1)
    top_scores, top_ids = total.topk(min(2 * k, total.size(1)), dim=-1)
    chosen = []  # (row, token, score), k per sentence
    for b, (s, i) in enumerate(zip(top_scores.tolist(), top_ids.tolist(), strict=True)):
        beam = next_beam(b, (s, i, vocab), ys, step, finished, last, k, end, alpha)
        chosen += beam + [(b * k, pad, float("-inf"))] * (k - len(beam))  # dead rows
    rows, tokens, new_scores = zip(*chosen, strict=True)
    rows = torch.tensor(rows, device=ys.device)
    tokens = torch.tensor(tokens, device=ys.device, dtype=ys.dtype).unsqueeze(1)
    ys = torch.cat([ys[rows], tokens], dim=1)
    return ys, torch.tensor(new_scores, device=ys.device).view(B, k), rows


def best_hypotheses(finished, n_best, pad_symbol, src):
    """Each sentence's n_best (ids, score); for n_best=1, the best ids as one tensor."""
    best = [sorted(f, key=lambda h: -h[0])[:n_best] for f in finished]
    if n_best > 1:
        return [[(ids, score) for score, ids in hyps] for hyps in best]
    longest = max(len(hyps[0][1]) for hyps in best)
    out = torch.full((len(best), longest), pad_symbol, dtype=src.dtype)
    for b, hyps in enumerate(best):
        out[b, : len(hyps[0][1])] = torch.tensor(hyps[0][1])
    return out.to(src.device)


def beam_search(
    model,
    src,
    src_mask,
    max_len,
    start_symbol,
    end_symbol,
    beam_size=4,
    alpha=0.6,
    pad_symbol=None,
    n_best=1,
    use_cache=True,
):
    """The book's beam search for a whole batch at once: the k hypotheses of all B
    sentences are B * k rows of one decoder batch. n_best=1: (batch, <= max_len) best
    ids incl. the start symbol; n_best > 1: per sentence, a list of (ids, score),
    best first. use_cache=False recomputes every step (for tests)."""
    tat.check_positive_int(max_len=max_len, beam_size=beam_size, n_best=n_best)
    if n_best > beam_size:
        raise ValueError(f"n_best={n_best} cannot exceed beam_size={beam_size}.")
    pad_symbol = end_symbol if pad_symbol is None else pad_symbol
    B, k = src.size(0), beam_size
    step_options = dict(k=k, end=end_symbol, pad=pad_symbol, alpha=alpha)
    with tat.evaluating(model), torch.no_grad():
        memory = model.encode(src, src_mask).repeat_interleave(k, dim=0)
        src_mask = src_mask.repeat_interleave(k, dim=0)  # k rows per sentence
        ys = torch.full_like(memory[:, :1, 0], start_symbol, dtype=src.dtype)
        scores = torch.full((B, k), float("-inf"), device=src.device)
        scores[:, 0] = 0.0  # at first the beam holds only the start symbol
        cache = tat.KVCache(model) if use_cache else None
        finished = [[] for _ in range(B)]  # (normalised score, ids)
        for step in range(1, max_len):
            log_probs = tat.decode_step(model, memory, src_mask, ys, cache)
            last = step == max_len - 1
            ys, scores, rows = advance_beams(
                ys, scores, log_probs, step, finished, last, **step_options
            )
            if cache is not None:
                cache.reorder(rows)  # every row keeps the cache of what it extends
            if all(len(f) >= k for f in finished):
                break
    return best_hypotheses(finished, n_best, pad_symbol, src)
