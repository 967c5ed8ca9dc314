"""Translating with a trained checkpoint, or a published Marian model
(load_pretrained: the book's load_marian): the book's Translator for text from the
command line and from Python, with the decoding options by name (the book's greedy
decoding with its key/value cache, its beam search, or sampling), n-best lists and
progress.

`load_translator(path)` gives a Translator; `Translator.translate(sentences, ...)`
answers each sentence with one translation, in order: a blank sentence with an empty
one, a sentence longer than the model's positions cut to fit, with a warning (and one
longer than the sentences the model was trained on warned about), and a sentence of
more than MAX_SENTENCE_CHARACTERS refused. `n_best=K` answers each with its K best
(translation, score) pairs instead; `progress=Progress()` says how far a long job
has come. `Translator.translations(...)` hands out the same answers one at a time,
each as soon as it and every sentence before it are translated. Sampling
(sample_decode) is the one search the book does not hold.
"""

from __future__ import annotations

import datetime
import math
import secrets
import sys
import time

import torch

import the_annotated_transformer as tat
from workshop.errors import checking_input, require
from workshop.run.checkpoints import load_checkpoint, model_from_checkpoint

# The longest sentence translate reads, in characters: about 15 times what the
# model's 5,000 positions hold. Longer text on one line is no sentence (a document,
# or a file that is not text): decoding it would take minutes to give nothing useful.
MAX_SENTENCE_CHARACTERS = 100_000
PROGRESS_EVERY_S = 5.0  # seconds between two progress lines, and before the first
# Batches in a window of the input: Translator.translations sorts by length within a
# window (similar lengths in a batch pad little) and answers a window's sentences
# once it is done, so the first answers come before the last sentences are decoded.
WINDOW_BATCHES = 8
ALPHA = 0.6  # beam search's length-penalty exponent unless one is given
SAMPLING = dict(temperature=1.0, top_k=None, top_p=None, seed=None)  # their defaults


def positions(model):
    """How many positions the model's positional encodings cover."""
    return model.tgt_embed[1].max_len


def _duration(seconds):
    return str(datetime.timedelta(seconds=round(seconds)))


class Progress:
    """Says on `stream` (stderr) how far a long translation has come, at most once
    every `every` seconds (the first time `every` seconds after its making, so short
    work says nothing), with the time spent and, given the share of the work done,
    an estimate of the time left. `clock` is for tests."""

    def __init__(self, stream=None, every=None, clock=time.monotonic):
        self.stream, self.clock, self.said = stream, clock, False
        self.every = PROGRESS_EVERY_S if every is None else every
        self.began = self.last = clock()

    def say(self, text, share=None, now=False):
        """Say `text` unless the last line is younger than `every` (now=True: say it
        anyway); `share`: the fraction of the work done, which gives the estimate
        of the time left (at the pace so far) while it is above 0 and below 1."""
        spent = self.clock() - self.began
        if now or self.clock() - self.last >= self.every:
            self.last, self.said = self.clock(), True
            left = share is not None and 0 < share < 1
            left = f", about {_duration(spent / share - spent)} left" if left else ""
            text = f"translating: {text}, {_duration(spent)} so far{left}"
            print(text, file=self.stream or sys.stderr, flush=True)


class ProgressCache(tat.KVCache):
    """The book's KVCache that calls on_step(positions held) after each step."""

    def __init__(self, model, max_len, on_step):
        super().__init__(model, max_len)
        self.on_step = on_step

    def step(self, model, memory, src_mask, ys):
        log_probs = super().step(model, memory, src_mask, ys)
        self.on_step(self.length)
        return log_probs


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
        for i, ids in enumerate(encoded):
            said = f"sentence {i + 1 if numbers is None else numbers[i]} has "
            said += f"{len(ids):,} tokens, more than the "
            if len(ids) > limit:
                encoded[i] = [*ids[: limit - 1], tat.EOS]
                warn(
                    f"{said}model's {limit:,} positions: the first {limit:,} are read."
                )
            elif len(ids) > trained:
                warn(f"{said}{trained} it trained on: its output may be short.")
        return encoded

    def translate(
        self, sentences, batch_size=64, *, n_best=1, progress=None, **options
    ):
        """German sentences (or one string) -> their English translations, in order:
        a list of strings, "" for a blank sentence; with n_best=K, a list per
        sentence of its K best (translation, score) pairs, best first (none for a
        blank one). `options` are decode_options' keywords (beam_size=, alpha=,
        sample=, temperature=, top_k=, top_p=, seed=), or what it returns (decode=
        and its options, each search given cache=); the default is greedy.
        `progress`: a Progress, told how far the work has come."""
        found = self.translations(
            sentences, batch_size, n_best=n_best, progress=progress, **options
        )
        return list(found)

    def translations(
        self, sentences, batch_size=64, *, n_best=1, progress=None, **options
    ):
        """translate's answers, one at a time, in order: an iterator that hands out
        each answer as soon as it and every sentence before it are translated. The
        arguments are checked at once, before any work. The sentences are decoded in
        windows of WINDOW_BATCHES batches, in input order; within a window they are
        sorted by length, so that a batch holds sentences of similar lengths."""
        sentences = [sentences] if isinstance(sentences, str) else list(sentences)
        for number, sentence in enumerate(sentences, 1):
            check_sentence(number, sentence)
        with checking_input():
            tat.check_positive_int(batch_size=batch_size, n_best=n_best)
        options = dict(options if "decode" in options else decode_options(**options))
        check_n_best(n_best, options)
        if "seed" in options:  # one generator for every batch of the call
            seed = options.pop("seed")
            seed = secrets.randbits(63) if seed is None else seed
            options["generator"] = torch.Generator(self.device()).manual_seed(seed)
        progress = progress or Progress(every=math.inf)
        return self._answers(sentences, batch_size, n_best, options, progress)

    def _answers(self, sentences, batch_size, n_best, options, progress):
        """The generator behind translations, its arguments checked."""
        wanted = [i for i, sentence in enumerate(sentences) if sentence.strip()]
        n, done, answered, window = len(wanted), 0, 0, WINDOW_BATCHES * batch_size
        chunk = []  # the batch being decoded: sentences done + 1 to done + len(chunk)

        def on_step(word, most):  # the batch's words: `word` of at most `most`
            which = f"sentences {done + 1:,} to {done + len(chunk):,} of {n:,}"
            share = (done + len(chunk) * word / most) / n
            progress.say(f"{which}: word {word:,} of at most {most:,}", share)

        for begin in range(0, max(n, 1), window):  # once if every sentence is blank
            part = wanted[begin : begin + window]
            found = self.encode([sentences[i] for i in part], [i + 1 for i in part])
            encoded = dict(zip(part, found, strict=True))
            order, answers = sorted(part, key=lambda i: len(encoded[i])), {}
            for start in range(0, len(order), batch_size):
                chunk = order[start : start + batch_size]
                src_ids = [encoded[i] for i in chunk]
                found = self.search(src_ids, n_best, options, on_step)
                answers |= dict(zip(chunk, found, strict=True))
                done += len(chunk)
                said = f"{done:,} of {n:,} sentences done"
                progress.say(said, done / n, done == n and progress.said)
            end = wanted[begin + window] if begin + window < n else len(sentences)
            for i in range(answered, end):  # this window's, and the blanks among them
                yield answers[i] if i in answers else [] if n_best > 1 else ""
            answered = end

    def search(self, src_ids, n_best, options, on_step):
        """One batch decoded with the search in `options`, on a ProgressCache that
        calls on_step(word, most) after each word (of at most `most`): a text per
        sentence, or (text, score) pairs."""
        max_len = min(max(map(len, src_ids)) + 50, positions(self.model))
        cache = ProgressCache(self.model, max_len, lambda k: on_step(k, max_len - 1))
        if n_best == 1:
            found = tat.decode_ids(self.model, src_ids, cache=cache, **options)
            return [self.text(ids) for ids in found]
        pairs = [(ids, [tat.BOS, tat.EOS]) for ids in src_ids]
        batch = tat.collate_batch(pairs).to(self.device())
        ends = dict(end_symbol=tat.EOS, pad_symbol=tat.PAD, n_best=n_best, cache=cache)
        rest = {name: value for name, value in options.items() if name != "decode"}
        args = (self.model, batch.src, batch.src_mask, max_len, tat.BOS)
        found = options["decode"](*args, **ends, **rest)
        return [[(self.text(_inner(ids)), s) for ids, s in hyps] for hyps in found]

    def text(self, ids):
        """Target ids -> English text."""
        return self.detokenize(self.vocab_tgt.lookup_tokens(ids))

    def device(self):
        return next(self.model.parameters()).device


def warn(text):
    print(f"warning: {text}", file=sys.stderr)


def _inner(ids):
    """Decoded ids without the start symbol, cut at the first end symbol."""
    ids = list(ids[1:])
    return ids[: ids.index(tat.EOS)] if tat.EOS in ids else ids


class PretrainedTranslator(Translator, tat.MarianTranslator):
    """The Translator above for a published Marian model (the book's load_marian):
    text cut by its SentencePiece models."""


def load_pretrained(source, device=None):
    """A Translator for a published Marian model, such as OPUS-MT's
    Helsinki-NLP/opus-mt-de-en: a Hugging Face hub name (fetched once into its
    cache) or a folder of its files. A model of another architecture, a missing
    file, a missing package or no connection: one line saying what to do."""
    try:
        with checking_input():
            found = tat.load_marian(source, device or tat.default_device())
    except ImportError as error:  # an optional package: the message says which
        raise OSError(str(error)) from None
    parts = (found.model, found.vocab_src, found.vocab_tgt, found.config)
    return PretrainedTranslator(*parts)


def load_translator(path, device=None):
    """A Translator for a checkpoint written by `train` (or `average`)."""
    model, vocab_src, vocab_tgt, config = model_from_checkpoint(
        load_checkpoint(path), device or tat.default_device(), path
    )
    return Translator(model, vocab_src, vocab_tgt, config)


def _name(name, flags):
    """An option as its caller writes it: top_k; with flags, as the command line
    does: --top-k (and --beam for beam_size)."""
    flag = "--" + {"beam_size": "beam"}.get(name, name).replace("_", "-")
    return flag if flags else name


def _check(ok, name, value, must):
    require(ok, f"{name} must be {must}, got {value!r}.")


def _number(x):
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def check_sentence(number, sentence):
    """Raise a UsageError for a sentence that is no string, or too long."""
    what = f"sentence {number} is a {type(sentence).__name__}"
    require(isinstance(sentence, str), f"translate takes strings; {what}.")
    what = f"sentence {number} has {len(sentence):,} characters, more than the "
    what += f"{MAX_SENTENCE_CHARACTERS:,} of a sentence: put one sentence a line."
    require(len(sentence) <= MAX_SENTENCE_CHARACTERS, what)


def check_n_best(n_best, options, flags=False):
    """Raise a UsageError unless the search in `options` can find n_best answers:
    a beam of at least n_best, or sampling. flags=True: the command line's names."""
    search = options.get("decode")
    beam = options.get("beam_size", 1) if search is tat.beam_search else 1
    n, b, s = (_name(name, flags) for name in ("n_best", "beam_size", "sample"))
    what = f"{n} {n_best} needs a beam of at least {n_best} ({b} {n_best} or more; "
    require(
        n_best <= beam or search is sample_decode, what + f"it has {beam}), or {s}."
    )


def check_alpha(alpha):
    """Raise a UsageError unless `alpha`, beam search's length-penalty exponent, is
    a finite number >= 0."""
    _check(_number(alpha) and alpha >= 0, "alpha", alpha, "a finite number >= 0")


def decode_options(beam_size=1, alpha=None, *, sample=False, flags=False, **sampling):
    """Translator.translate's options for greedy decoding (beam_size 1, with the
    key/value cache), the book's beam search of `beam_size` with length-penalty
    exponent `alpha` (None: ALPHA; refused without a beam, which it would not
    change), or, with sample=True, sampling (sample_decode) with the options
    `sampling`: each token drawn from the model's distribution at `temperature`,
    cut to the top_k most likely tokens and to the top_p of probability, from a
    generator seeded with `seed` (None: a fresh seed each call). flags=True names
    the options in its messages as the command line does."""
    with checking_input():
        tat.check_positive_int(beam_size=beam_size)
    if alpha is not None:
        check_alpha(alpha)
    unknown = ", ".join(sorted(set(sampling) - set(SAMPLING)))
    require(not unknown, f"{unknown}: no decoding option; see decode_options.")
    given = [_name(k, flags) for k, v in sampling.items() if v != SAMPLING[k]]
    sampling, s = SAMPLING | sampling, _name("sample", flags)
    a, b = _name("alpha", flags), _name("beam_size", flags)
    penalty = f"{a}: the length penalty takes effect only in a beam search"
    if not sample:
        why = f"sampling's options take effect only with {s}"
        require(not given, f"{', '.join(given)}: {why}; add it, or leave them out.")
        if beam_size == 1:
            beam = f"{penalty} ({b} K, K of at least 2); add one, or leave {a} out."
            require(alpha is None, beam)
            return dict(decode=tat.greedy_decode)
        alpha = ALPHA if alpha is None else alpha
        return dict(decode=tat.beam_search, beam_size=beam_size, alpha=alpha)
    t, k, p, seed = sampling.values()
    _check(_number(t) and t > 0, "temperature", t, "a finite number above 0")
    _check(k is None or type(k) is int and k >= 1, "top_k", k, "a whole number >= 1")
    _check(p is None or _number(p) and 0 < p <= 1, "top_p", p, "in (0, 1]")
    _check(seed is None or type(seed) is int, "seed", seed, "a whole number")
    beam = f"{b} {beam_size}"
    require(beam_size == 1, f"{s} draws and {beam} searches: choose one.")
    require(alpha is None, f"{penalty}, and {s} draws: leave {a} out.")
    return dict(decode=sample_decode, **sampling)


def filter_log_probs(log_probs, temperature=1.0, top_k=None, top_p=None):
    """Sampling's scores of each next token (rows: hypotheses; -inf: never drawn):
    the log-probabilities divided by `temperature`, then all but the top_k highest
    set to -inf, then all but the fewest highest whose probability (after the
    temperature and top_k) reaches top_p."""
    scores = log_probs.float() / temperature
    if top_k is not None and top_k < scores.size(-1):
        kept = scores.topk(top_k, dim=-1)
        scores = torch.full_like(scores, -math.inf).scatter(-1, *kept[::-1])
    if top_p is not None and top_p < 1:
        ranked, order = scores.sort(dim=-1, descending=True)
        probs = ranked.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # the probability of those ranked above
        ranked = ranked.masked_fill(before >= top_p, -math.inf)  # the first one stays
        scores = torch.full_like(scores, -math.inf).scatter(-1, order, ranked)
    return scores


class Draw:
    """A step for the book's greedy_decode that samples: the scores it returns have
    their maximum at a token drawn from the model's distribution, filtered by
    filter_log_probs; `log_p` sums each row's drawn log-probabilities to its end."""

    def __init__(self, cache, end_symbol, generator=None, **filters):
        self.cache, self.end, self.generator = cache, end_symbol, generator
        self.filters, self.done = filters, None

    def step(self, model, memory, src_mask, ys):
        log_probs = self.cache.step(model, memory, src_mask, ys)
        if self.done is None:
            self.log_p = log_probs.new_zeros(ys.size(0))
            self.done = torch.zeros_like(ys[:, -1], dtype=torch.bool)
        if self.end is not None:
            self.done = self.done | (ys[:, -1] == self.end)
        scores = filter_log_probs(log_probs, **self.filters)
        drawn = torch.multinomial(scores.softmax(-1), 1, generator=self.generator)
        self.log_p += log_probs.gather(-1, drawn).squeeze(-1).masked_fill(self.done, 0)
        return torch.full_like(scores, -math.inf).scatter(-1, drawn, 0.0)


def sample_decode(model, src, src_mask, max_len, start_symbol, *, n_best=1, **options):
    """Decode a batch by sampling: the book's greedy_decode with a Draw step, each
    token drawn from the model's distribution filtered by filter_log_probs.
    `options`: greedy_decode's (end_symbol=, pad_symbol=, cache=: default a fresh
    KVCache), filter_log_probs' (temperature=, top_k=, top_p=) and generator= (a
    torch.Generator on src's device, which makes a draw repeatable). n_best=1:
    (batch, <= max_len) ids incl. the start symbol, as greedy_decode. n_best=K
    draws K translations per sentence and returns, per sentence, K (ids, log P)
    pairs, most likely first, log P the model's own log-probability of the ids (at
    temperature 1, unfiltered)."""
    names = {"temperature", "top_k", "top_p", "generator"} & set(options)
    drawing = {name: options.pop(name) for name in names}
    cache = options.get("cache") or tat.KVCache(model, max_len)
    options["cache"] = draw = Draw(cache, options.get("end_symbol"), **drawing)
    src, src_mask = (x.repeat_interleave(n_best, 0) for x in (src, src_mask))
    ys = tat.greedy_decode(model, src, src_mask, max_len, start_symbol, **options)
    if n_best == 1:
        return ys
    found = list(zip(ys.tolist(), draw.log_p.tolist(), strict=True))
    per_sentence = [found[i : i + n_best] for i in range(0, len(found), n_best)]
    return [sorted(samples, key=lambda h: -h[1]) for samples in per_sentence]
