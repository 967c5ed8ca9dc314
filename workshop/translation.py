"""Translating with a trained checkpoint: the book's Translator for text from the
command line and from Python, the decoding options (greedy with the key/value cache,
beam search, or sampling), n-best lists, and the book's beam search run over a whole
batch at once.

`load_translator(path)` gives a Translator; `Translator.translate(sentences, ...)`
answers each sentence with one translation, in order: a blank sentence with an empty
one, a sentence longer than the model's positions cut to fit, with a warning (and one
longer than the sentences the model was trained on warned about), and a sentence of
more than MAX_SENTENCE_CHARACTERS refused. `n_best=K` answers each with its K best
(translation, score) pairs instead; `progress=Progress()` says how far a long job
has come.
"""

from __future__ import annotations

import math
import secrets
import sys
import time

import torch

import the_annotated_transformer as tat
from workshop import fast
from workshop.checkpoints import load_checkpoint, model_from_checkpoint
from workshop.errors import UsageError, checking_input
from workshop.kv_cache import DecodingCache

# The longest sentence translate reads, in characters: about 15 times the longest
# Multi30k sentence the model could read whole (5,000 positions of about 6
# characters each hold 30,000). Text longer than this on one line is no sentence
# (a whole document, or a file that is not text), and tokenizing and decoding it
# would take minutes to produce nothing useful, so it is refused.
MAX_SENTENCE_CHARACTERS = 100_000

# Seconds between two progress lines (and before the first: shorter work says
# nothing).
PROGRESS_EVERY_S = 5.0


def positions(model):
    """How many positions the model's positional encodings cover: the longest
    sentence it reads (and writes)."""
    return min(
        m.max_len for m in model.modules() if isinstance(m, tat.PositionalEncoding)
    )


def _duration(seconds):
    """Seconds as m:ss (or h:mm:ss), for a progress line."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _sentences(n):
    return f"{n:,} sentence{'' if n == 1 else 's'}"


class Progress:
    """Says on `stream` (stderr) how far a long translation has come: at most once
    every `every` seconds (the first time after `every` seconds from its making, so
    short work says nothing), the sentences done of those to translate (blank ones
    aside), the time spent and an estimate of the time left; inside a long batch,
    the word it is decoding. `clock` is for tests. Translator.translate calls
    begin, step, finished and end."""

    def __init__(self, stream=None, every=None, clock=time.monotonic):
        self.total, self.done, self.stream, self.clock = 0, 0, stream, clock
        self.every = PROGRESS_EVERY_S if every is None else every
        self.began = self.last = clock()
        self.said = False

    def begin(self, total):
        """`total` sentences are to be translated."""
        self.total, self.done = total, 0

    def _say(self, text):
        now = self.clock()
        if now - self.last < self.every:
            return
        self.last, self.said = now, True
        print(f"translating: {text}", file=self.stream or sys.stderr, flush=True)

    def elapsed(self):
        return self.clock() - self.began

    def step(self, rows, step, max_len):
        """Decoding word `step` (of at most max_len - 1) of a batch of `rows`."""
        first = self.done + 1
        which = f"sentence {first:,}" if rows == 1 else f"sentences {first:,} to "
        which += "" if rows == 1 else f"{self.done + rows:,}"
        self._say(
            f"{which} of {self.total:,}: word {step:,} of at most {max_len - 1:,}, "
            f"{_duration(self.elapsed())} so far"
        )

    def finished(self, rows):
        """`rows` more sentences are translated."""
        self.done += rows
        if self.done == self.total:
            return
        elapsed = self.elapsed()
        left = elapsed / self.done * (self.total - self.done)
        self._say(
            f"{self.done:,} of {_sentences(self.total)} done, {_duration(elapsed)} "
            f"so far, about {_duration(left)} left"
        )

    def end(self):
        """Say how long it took, if anything was said before."""
        if self.said:
            self.last = -math.inf
            self._say(f"{_sentences(self.total)} in {_duration(self.elapsed())}")


class Translator(tat.Translator):
    """The book's Translator, with what text from a user needs: one answer per
    sentence, in order (a blank one answered with ""), warnings for sentences longer
    than the model was trained on or than its positions (cut to fit), a hard limit,
    decoding options by name (beam_size=, sample=, ...), n-best lists and progress."""

    def encode(self, sentences, numbers=None):
        """The book's encode, each sentence cut to the model's positions, with a
        warning naming it (by its number in `numbers`, 1, 2, ... by default), and a
        warning for one longer than the model's training sentences."""
        encoded, limit = super().encode(sentences), positions(self.model)
        trained = getattr(self.config, "max_len", limit)
        numbers = range(1, len(encoded) + 1) if numbers is None else numbers
        for i, (ids, number) in enumerate(zip(encoded, numbers, strict=True)):
            if len(ids) > limit:
                encoded[i] = [*ids[: limit - 1], tat.EOS]
                did = (
                    f"more than the model's {limit:,} positions: only its first "
                    f"{limit:,} are translated"
                )
            elif len(ids) > trained:
                did = "translated whole"
            else:
                continue
            if len(ids) > trained:
                did += (
                    f"; the model was trained on sentences of at most {trained} "
                    "tokens (max_len), and past that its output is often short or "
                    "repetitive: one sentence a line translates best"
                )
            print(
                f"warning: sentence {number} has {len(ids):,} tokens, {did}.",
                file=sys.stderr,
            )
        return encoded

    def translate(
        self, sentences, batch_size=64, *, n_best=1, progress=None, **options
    ):
        """German sentences (or one string) -> their English translations, in order:
        a list of strings, "" for a blank sentence; with n_best=K, a list per
        sentence of its K best (translation, score) pairs, best first (none for a
        blank one). `options` are decode_options' keywords (beam_size=, alpha=,
        sample=, temperature=, top_k=, top_p=, seed=), or what it returns (decode=
        and its options); the default is greedy. `progress`: a Progress, told how
        far the work has come."""
        sentences = [sentences] if isinstance(sentences, str) else list(sentences)
        check_sentences(sentences)
        with checking_input():
            tat.check_positive_int(batch_size=batch_size, n_best=n_best)
        options = options if "decode" in options else decode_options(**options)
        options = self._seeded(options)
        check_n_best(n_best, options)
        wanted = [i for i, sentence in enumerate(sentences) if sentence.strip()]
        texts = [sentences[i] for i in wanted]
        numbers = [i + 1 for i in wanted]
        encoded = dict(zip(wanted, self.encode(texts, numbers), strict=True))
        out = [[] if n_best > 1 else "" for _ in sentences]
        order = sorted(wanted, key=lambda i: len(encoded[i]))
        if progress is not None:
            progress.begin(len(order))
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            step = _step_reporter(progress, len(chunk), options)
            ids = [encoded[i] for i in chunk]
            if n_best > 1:
                found = decode_hypotheses(self.model, ids, n_best, **step, **options)
                for i, hypotheses in zip(chunk, found, strict=True):
                    out[i] = [(self.text(row), score) for row, score in hypotheses]
            else:
                found = tat.decode_ids(self.model, ids, **step, **options)
                for i, row in zip(chunk, found, strict=True):
                    out[i] = self.text(row)
            if progress is not None:
                progress.finished(len(chunk))
        if progress is not None:
            progress.end()
        return out

    def text(self, ids):
        """Target ids -> English text."""
        return self.detokenize(self.vocab_tgt.lookup_tokens(ids))

    def _seeded(self, options):
        """Sampling's `seed` made a generator on the model's device, once per call
        (the batches draw in turn from it)."""
        if "seed" not in options:
            return options
        options = dict(options)
        seed = options.pop("seed")
        device = next(self.model.parameters()).device
        options["generator"] = seeded_generator(seed, device)
        return options


def check_sentences(sentences):
    """Raise a UsageError for a sentence that is no string, or longer than
    MAX_SENTENCE_CHARACTERS."""
    for number, sentence in enumerate(sentences, 1):
        if not isinstance(sentence, str):
            raise UsageError(
                f"translate takes sentences as strings; sentence {number} is a "
                f"{type(sentence).__name__}."
            )
        if len(sentence) > MAX_SENTENCE_CHARACTERS:
            raise UsageError(
                f"sentence {number} has {len(sentence):,} characters, more than the "
                f"{MAX_SENTENCE_CHARACTERS:,} translate reads as one sentence: put "
                "one sentence on each line."
            )


def check_n_best(n_best, options):
    """Raise a UsageError unless the search in `options` can find n_best answers:
    a beam of at least n_best, or sampling (n_best draws)."""
    if n_best == 1 or options.get("decode") is sample_decode:
        return
    beam = options.get("beam_size", 1) if options.get("decode") is beam_search else 1
    if beam < n_best:
        raise UsageError(
            f"n_best={n_best} needs a beam search of at least {n_best} hypotheses "
            f"(beam_size={n_best} or more; it has {beam}), or sample=True."
        )


def _stepped():
    """The searches that report each step to an on_step(step, max_len) option."""
    return (greedy_decode, beam_search, sample_decode)


def _step_reporter(progress, rows, options):
    """The on_step option that tells `progress` each decoding step of a batch of
    `rows` sentences (none without progress, or for a search that takes none)."""
    if progress is None or options.get("decode") not in _stepped():
        return {}
    return {"on_step": lambda step, max_len: progress.step(rows, step, max_len)}


def decode_hypotheses(model, src_ids, n_best, decode, max_extra=50, **options):
    """The book's decode_ids for a search that answers each sentence with n_best
    hypotheses (beam_search, sample_decode): per sentence a list of (target ids
    without <s> and </s>, score), best first. Each output may be max_extra tokens
    longer than the longest source, within the model's positions, as in decode_ids."""
    device = next(model.parameters()).device
    batch = tat.collate_batch([(ids, [tat.BOS, tat.EOS]) for ids in src_ids])
    batch = batch.to(device)
    max_len = min(batch.src.size(1) + max_extra, positions(model))
    ends = dict(end_symbol=tat.EOS, pad_symbol=tat.PAD, n_best=n_best)
    found = decode(
        model, batch.src, batch.src_mask, max_len, tat.BOS, **ends, **options
    )
    return [[(_inner(ids), score) for ids, score in hypotheses] for hypotheses in found]


def _inner(ids):
    """Decoded ids without the start symbol, cut at the first end symbol."""
    ids = list(ids[1:])
    return ids[: ids.index(tat.EOS)] if tat.EOS in ids else ids


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


def check_sampling(temperature, top_k, top_p, seed):
    """Raise a UsageError that names the first sampling option that cannot work."""
    number = isinstance(temperature, int | float) and not isinstance(temperature, bool)
    if not (number and math.isfinite(temperature) and temperature > 0):
        raise UsageError(
            f"temperature must be a finite number above 0, got {temperature!r}."
        )
    if top_k is not None:
        with checking_input():
            tat.check_positive_int(top_k=top_k)
    if top_p is not None:
        number = isinstance(top_p, int | float) and not isinstance(top_p, bool)
        if not (number and 0 < top_p <= 1):
            raise UsageError(
                f"top_p must be a number above 0 and at most 1, got {top_p!r}."
            )
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise UsageError(f"seed must be a whole number, got {seed!r}.")


def decode_options(
    beam_size=1,
    alpha=0.6,
    *,
    sample=False,
    temperature=1.0,
    top_k=None,
    top_p=None,
    seed=None,
):
    """Translator.translate's options for greedy decoding (beam_size 1, with the
    key/value cache), beam search of `beam_size` with length-penalty exponent
    `alpha` (check_alpha), or, with sample=True, sampling (sample_decode): each
    token drawn from the model's distribution at `temperature`, cut to the top_k
    most likely tokens and to the top_p of probability, from a generator seeded
    with `seed` (None: a fresh seed each call)."""
    with checking_input():
        tat.check_positive_int(beam_size=beam_size)
    check_alpha(alpha)
    given = dict(temperature=temperature != 1.0, top_k=top_k is not None)
    given |= dict(top_p=top_p is not None, seed=seed is not None)
    unused = [name for name, is_given in given.items() if is_given]
    if unused and not sample:
        raise UsageError(
            f"{', '.join(unused)} take effect only when sampling: pass sample=True, "
            "or leave them out."
        )
    if sample:
        check_sampling(temperature, top_k, top_p, seed)
        if beam_size > 1:
            raise UsageError(
                f"sampling draws one token at a time and beam_size={beam_size} "
                "searches: choose one."
            )
        return dict(
            decode=sample_decode,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
        )
    if beam_size > 1:
        return dict(decode=beam_search, beam_size=beam_size, alpha=alpha)
    return dict(decode=greedy_decode)


def seeded_generator(seed, device):
    """A torch.Generator on `device` seeded with `seed` (None: a fresh random seed)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(secrets.randbits(63) if seed is None else seed)
    return generator


class SteppingCache(DecodingCache):
    """The workshop's DecodingCache that calls on_step(positions held) after each
    step."""

    def __init__(self, model, max_len, on_step):
        super().__init__(model, max_len)
        self.on_step = on_step

    def step(self, model, memory, src_mask, ys):
        log_probs = super().step(model, memory, src_mask, ys)
        self.on_step(self.length)
        return log_probs


def greedy_decode(model, src, src_mask, max_len, start_symbol, on_step=None, **options):
    """The book's greedy_decode with the workshop's key/value cache (DecodingCache:
    the same tokens as the book's cached_greedy_decode, faster); on_step(step,
    max_len), if given, is called after each step (progress)."""
    if on_step is None:
        options["cache"] = DecodingCache(model, max_len)
    else:

        def report(length):
            on_step(length, max_len)

        options["cache"] = SteppingCache(model, max_len, report)
    return tat.greedy_decode(model, src, src_mask, max_len, start_symbol, **options)


def filter_log_probs(log_probs, temperature=1.0, top_k=None, top_p=None):
    """Sampling's scores of each next token (rows: hypotheses; -inf: never drawn):
    the log-probabilities divided by `temperature`, then all but the top_k highest
    set to -inf, then all but the fewest highest whose probability (after the
    temperature and top_k) reaches top_p."""
    scores = log_probs.float() / temperature
    vocab = scores.size(-1)
    if top_k is not None and top_k < vocab:
        kept = scores.topk(top_k, dim=-1)
        scores = torch.full_like(scores, -math.inf).scatter(
            -1, kept.indices, kept.values
        )
    if top_p is not None and top_p < 1:
        ranked, order = scores.sort(dim=-1, descending=True)
        probs = ranked.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # the probability of those ranked above
        ranked = ranked.masked_fill(before >= top_p, -math.inf)  # the first one stays
        scores = torch.full_like(scores, -math.inf).scatter(-1, order, ranked)
    return scores


def sample_decode(
    model,
    src,
    src_mask,
    max_len,
    start_symbol,
    end_symbol=None,
    pad_symbol=None,
    *,
    temperature=1.0,
    top_k=None,
    top_p=None,
    generator=None,
    n_best=1,
    on_step=None,
):
    """Decode a batch by sampling: each next token drawn from the model's
    distribution, filtered by filter_log_probs, with the key/value cache. Same
    arguments and shapes as greedy_decode for n_best=1: (batch, <= max_len) ids
    incl. the start symbol. n_best=K draws K translations per sentence and returns,
    per sentence, K (ids, log P) pairs, most likely first, where log P is the
    model's own log-probability of the ids (at temperature 1, unfiltered).
    `generator` (a torch.Generator on src's device) makes a draw repeatable. A
    sentence's n_best rows share its memory (DecodingCache's groups)."""
    tat.check_positive_int(max_len=max_len, n_best=n_best)
    check_sampling(temperature, top_k, top_p, None)
    pad_symbol = end_symbol if pad_symbol is None else pad_symbol
    rows = src.size(0) * n_best
    with tat.evaluating(model), torch.no_grad():
        memory = model.encode(src, src_mask)  # one row per sentence, n_best in ys
        ys = torch.full((rows, 1), start_symbol, dtype=src.dtype, device=src.device)
        log_p = torch.zeros(rows, dtype=memory.dtype, device=src.device)  # so far
        done = torch.zeros(rows, dtype=torch.bool, device=src.device)
        cache = DecodingCache(model, max_len)
        for step in range(1, max_len):
            log_probs = tat.decode_step(model, memory, src_mask, ys, cache)
            scores = filter_log_probs(log_probs, temperature, top_k, top_p)
            drawn = torch.multinomial(scores.softmax(dim=-1), 1, generator=generator)
            gained = log_probs.gather(-1, drawn).squeeze(-1)
            log_p += gained.masked_fill(done, 0.0)
            token = drawn.squeeze(-1)
            if end_symbol is not None:
                token = token.masked_fill(done, pad_symbol)
                done = done | (token == end_symbol)
            ys = torch.cat([ys, token.unsqueeze(1).to(ys.dtype)], dim=1)
            if on_step is not None:
                on_step(step, max_len)
            if end_symbol is not None and bool(done.all()):
                break
    if n_best == 1:
        return ys
    found = list(zip(ys.tolist(), log_p.tolist(), strict=True))
    per_sentence = [found[i : i + n_best] for i in range(0, rows, n_best)]
    return [sorted(samples, key=lambda h: -h[1]) for samples in per_sentence]


def next_beam(b, candidates, ys, step, finished, last, k, end_symbol, alpha):
    """The next beam of the sentence in batch row b from its best (score, flat
    index) candidates: up to k (row, token, score); hypotheses that end here join
    `finished` (that sentence's list) instead."""
    beam, vocab = [], candidates[2]
    for rank, (score, flat) in enumerate(zip(*candidates[:2], strict=True)):
        if len(finished) >= k or len(beam) == k or score == float("-inf"):
            break
        row, token = b * k + flat // vocab, flat % vocab
        if token == end_symbol or last:
            if rank < k:  # only candidates that would have made the beam count
                ids = ys[row].tolist() + [token]
                finished.append((score / tat.length_penalty(step, alpha), ids))
            continue
        beam.append((row, token, score))
    return beam


def advance_beams(ys, scores, log_probs, step, finished, last, k, end, pad, alpha):
    """One beam-search step for every sentence of the batch (finished: their lists
    of finished hypotheses, in batch order): returns (ys, scores, rows kept, the
    batch rows of the sentences still searched).

    It adds each hypothesis's score to the log-probabilities of its next tokens,
    keeps the 2k best of the k * V extensions (enough for k to go on even if k of
    them end), and lets next_beam choose. A sentence that has k finished
    hypotheses, or none left to extend, is done: its rows leave the batch. Another
    with fewer than k to extend fills its beam with dead rows of score -inf.
    """
    B, vocab = scores.size(0), log_probs.size(-1)
    # A sentence's 2k best extensions are among the 2k best of each of its rows
    # (adding the row's score keeps the order within the row), so only those are
    # added up and ranked: the same sums, without a pass over all k * V.
    n = min(2 * k, vocab)
    row_best, row_tokens = log_probs.topk(n, dim=-1)  # (B * k, n)
    total = (scores.unsqueeze(-1) + row_best.view(B, k, n)).view(B, -1)
    top_scores, best = total.topk(min(2 * k, total.size(1)), dim=-1)
    tokens = row_tokens.view(B, -1).gather(1, best)
    top_ids = best // n * vocab + tokens  # row * V + token, as in k * V
    # One read by the host a step, and one copy back: float64 holds the float32
    # scores and the ids (below 2**53) exactly.
    top = torch.stack([top_scores.double(), top_ids.double()]).tolist()
    chosen, searched = [], []  # (row, token, score), k per sentence still searched
    for b, (s, i) in enumerate(zip(*top, strict=True)):
        i = [int(flat) for flat in i]
        beam = next_beam(b, (s, i, vocab), ys, step, finished[b], last, k, end, alpha)
        if beam and len(finished[b]) < k:
            searched.append(b)
            chosen += beam + [(b * k, pad, float("-inf"))] * (k - len(beam))
    chosen = torch.tensor(chosen, dtype=torch.float64, device=ys.device).view(-1, 3)
    rows, tokens, new_scores = chosen.T
    rows = rows.long()
    ys = torch.cat([ys[rows], tokens.to(ys.dtype).unsqueeze(1)], dim=1)
    return ys, new_scores.float().view(-1, k), rows, searched


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
    on_step=None,
):
    """The book's beam search for a whole batch at once: the k hypotheses of all B
    sentences are B * k rows of one decoder batch, and a sentence's rows leave it
    when its search is done. n_best=1: (batch, <= max_len) best ids incl. the start
    symbol; n_best > 1: per sentence, a list of (ids, score), best first.
    use_cache=False recomputes every step (for tests); on_step(step, max_len), if
    given, is called after each step (progress)."""
    tat.check_positive_int(max_len=max_len, beam_size=beam_size, n_best=n_best)
    if n_best > beam_size:
        raise ValueError(f"n_best={n_best} cannot exceed beam_size={beam_size}.")
    pad_symbol = end_symbol if pad_symbol is None else pad_symbol
    B, k = src.size(0), beam_size
    step_options = dict(k=k, end=end_symbol, pad=pad_symbol, alpha=alpha)
    with tat.evaluating(model), torch.no_grad():
        memory = model.encode(src, src_mask)  # one row per sentence, k rows in ys
        ys = torch.full((B * k, 1), start_symbol, dtype=src.dtype, device=src.device)
        scores = torch.full((B, k), float("-inf"), device=src.device)
        scores[:, 0] = 0.0  # at first the beam holds only the start symbol
        cache = DecodingCache(model, max_len) if use_cache else None
        finished = [[] for _ in range(B)]  # (normalised score, ids)
        searched = list(range(B))  # the sentences in the batch, in its order
        for step in range(1, max_len):
            if cache is not None:
                log_probs = cache.step(model, memory, src_mask, ys)
            else:  # the book's decode_step, with the memory repeated for each row
                repeated = (t.repeat_interleave(k, 0) for t in (memory, src_mask))
                log_probs = tat.decode_step(model, *repeated, ys)
            last, ends = step == max_len - 1, [finished[b] for b in searched]
            ys, scores, rows, kept = advance_beams(
                ys, scores, log_probs, step, ends, last, **step_options
            )
            if on_step is not None:
                on_step(step, max_len)
            if not kept:
                break
            sentences = None  # the batch rows of the sentences kept, if some left
            if len(kept) < len(searched):
                sentences = rows[::k] // k  # each kept sentence's first row
                memory = memory.index_select(0, sentences)
                src_mask = src_mask.index_select(0, sentences)
                searched = [searched[b] for b in kept]
            if cache is not None:  # every row keeps the cache of what it extends
                cache.reorder(rows, sentences)
    return best_hypotheses(finished, n_best, pad_symbol, src)
