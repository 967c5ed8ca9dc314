"""Translating with a trained checkpoint: the book's Translator for text from the
command line, the decoding options (greedy with the key/value cache, or beam
search), and the book's beam search run over a whole batch at once."""

from __future__ import annotations

import math
import sys

import torch

import the_annotated_transformer as tat
from workshop import fast
from workshop.checkpoints import load_checkpoint, model_from_checkpoint
from workshop.errors import UsageError, checking_input


def positions(model):
    """How many positions the model's positional encodings cover: the longest
    sentence it reads (and writes)."""
    return min(
        m.max_len for m in model.modules() if isinstance(m, tat.PositionalEncoding)
    )


class Translator(tat.Translator):
    """The book's Translator for text from the command line: a sentence longer than
    the model's positions is cut to fit, with a warning that names it."""

    def encode(self, sentences):
        encoded, limit = super().encode(sentences), positions(self.model)
        for i, ids in enumerate(encoded):
            if len(ids) > limit:
                print(
                    f"warning: sentence {i + 1} has {len(ids)} tokens, more than the "
                    f"model's {limit} positions; only its first {limit} are "
                    "translated.",
                    file=sys.stderr,
                )
                encoded[i] = [*ids[: limit - 1], tat.EOS]
        return encoded


def load_translator(path, device=None, fused=True):
    """A Translator for a checkpoint written by `train` (or `average`); fused=False
    keeps the book's attention, which stores its weights for the attention maps."""
    model, vocab_src, vocab_tgt, config = model_from_checkpoint(
        load_checkpoint(path), device or tat.default_device(), path
    )
    if fused:
        fast.use_fused_attention(model)
    return Translator(model, vocab_src, vocab_tgt, config)


def check_alpha(alpha):
    """Raise a UsageError unless `alpha`, beam search's length-penalty exponent, is
    a finite number >= 0."""
    finite = isinstance(alpha, int | float) and math.isfinite(alpha)
    if not (finite and alpha >= 0):
        raise UsageError(f"alpha must be a finite number >= 0, got {alpha!r}.")


def decode_options(beam_size=1, alpha=0.6):
    """Translator.translate's options for greedy (beam_size 1, with the key/value
    cache) or beam search of `beam_size` with length-penalty exponent `alpha`
    (check_alpha)."""
    with checking_input():
        tat.check_positive_int(beam_size=beam_size)
    check_alpha(alpha)
    if beam_size > 1:
        return dict(decode=beam_search, beam_size=beam_size, alpha=alpha)
    return dict(decode=tat.cached_greedy_decode)


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
    # One read by the host a step, and one copy back: float64 holds the float32
    # scores and the ids (below 2**53) exactly.
    top = torch.stack([top_scores.double(), top_ids.double()]).tolist()
    chosen = []  # (row, token, score), k per sentence
    for b, (s, i) in enumerate(zip(*top, strict=True)):
        i = [int(flat) for flat in i]
        beam = next_beam(b, (s, i, vocab), ys, step, finished, last, k, end, alpha)
        chosen += beam + [(b * k, pad, float("-inf"))] * (k - len(beam))  # dead rows
    chosen = torch.tensor(chosen, dtype=torch.float64, device=ys.device)
    rows, tokens, new_scores = chosen.T
    rows = rows.long()
    ys = torch.cat([ys[rows], tokens.to(ys.dtype).unsqueeze(1)], dim=1)
    return ys, new_scores.float().view(B, k), rows


def best_hypotheses(finished, n_best, pad_symbol, src):
    """Each sentence's n_best (ids, score); for n_best=1, the best ids as one tensor."""
    best = [sorted(f, key=lambda h: -h[0])[:n_best] for f in finished]
    if n_best > 1:
        return [[(ids, score) for score, ids in hyps] for hyps in best]
    top = [hyps[0][1] for hyps in best]  # each sentence's best ids
    longest = max(len(ids) for ids in top)
    rows = [ids + [pad_symbol] * (longest - len(ids)) for ids in top]
    return torch.tensor(rows, dtype=src.dtype, device=src.device)  # one copy


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
