"""Scoring a translator: translate a split of Multi30k and score it with sacreBLEU
(evaluate), with the signature that says how, and the lowercased BLEU on spaCy
tokens that other Multi30k results quote."""

from __future__ import annotations

import os
import time

from the_annotated_transformer import check_positive_int, load_tokenizers, tokenize
from workshop.errors import DataError, UsageError, checking_input
from workshop.files import atomic_write_text, why_unwritable
from workshop.multi30k import read_split
from workshop.translation import decode_options, load_translator


def _spaced_tokens(texts, tokenizer):
    """Each text as its spaCy tokens joined by single spaces."""
    return [" ".join(tokenize(text, tokenizer)) for text in texts]


def evaluate(
    translator_or_checkpoint,
    data_dir,
    split="test_2016_flickr",
    beam_size=1,
    output=None,
    batch_size=64,
    quiet=False,
    alpha=0.6,
    limit=None,
    device=None,
):
    """Translate a split's German side and score it with sacreBLEU; returns a dict.

    `alpha` is beam search's length-penalty exponent (unused by greedy decoding);
    `limit` scores only the split's first sentences (for quick checks); `device`
    is where a checkpoint's model translates (default: the book's default_device).
    An `output` that cannot be written is refused before anything is translated.
    """
    import sacrebleu

    with checking_input():
        check_positive_int(beam_size=beam_size, batch_size=batch_size)
    options = decode_options(beam_size, alpha)
    reason = None if output is None else why_unwritable(output)
    if reason:
        raise UsageError(
            f"evaluate: the translations cannot be written to {output}: {reason}."
        )
    pairs = read_split(data_dir, split)[:limit]
    if not pairs:
        raise DataError(f"split {split!r} in {data_dir} is empty: nothing to score.")
    translator = translator_or_checkpoint
    if isinstance(translator, str | os.PathLike):
        translator = load_translator(translator, device)
    sources = [de for de, _ in pairs]
    references = [en for _, en in pairs]
    start = time.perf_counter()
    hypotheses = translator.translate(sources, batch_size=batch_size, **options)
    seconds = time.perf_counter() - start
    if output is not None:
        atomic_write_text(output, "".join(line + "\n" for line in hypotheses))
    bleu = sacrebleu.metrics.BLEU()  # 13a tokenisation, cased: the standard
    score = bleu.corpus_score(hypotheses, [references])
    spacy_en = load_tokenizers()[1]
    # Tokenised on purpose: `force` stops sacreBLEU warning that it looks tokenised.
    bleu_lc = sacrebleu.metrics.BLEU(tokenize="none", lowercase=True, force=True)
    score_lc = bleu_lc.corpus_score(
        _spaced_tokens(hypotheses, spacy_en), [_spaced_tokens(references, spacy_en)]
    )
    result = {
        "split": split,
        "n": len(pairs),
        "beam_size": beam_size,
        "alpha": alpha if beam_size > 1 else None,
        "bleu": score.score,
        "signature": str(bleu.get_signature()),
        "precisions": list(score.precisions),
        "brevity_penalty": score.bp,
        "length_ratio": score.sys_len / score.ref_len,  # output words per reference
        "bleu_lowercase_spacy": score_lc.score,
        "signature_lowercase_spacy": str(bleu_lc.get_signature()),
        "seconds": seconds,
        "output": None if output is None else str(output),
        "hypotheses": hypotheses,
    }
    if not quiet:
        _print_evaluation(result, score)
    return result


def _print_evaluation(result, score):
    """Print what `evaluate` measured."""
    decoding = "greedy"
    if result["beam_size"] > 1:
        decoding = f"beam {result['beam_size']}, alpha {result['alpha']:g}"
    print(
        f"{result['split']}: {result['n']} sentences translated ({decoding}) in "
        f"{result['seconds']:.1f} s"
    )
    print(f"sacreBLEU: {score}")
    print(f"signature: {result['signature']}")
    print(
        f"lowercased BLEU on spaCy tokens (for comparison with other Multi30k "
        f"results; not a sacreBLEU score): {result['bleu_lowercase_spacy']:.2f} "
        f"[{result['signature_lowercase_spacy']}]"
    )
    if result["output"] is not None:
        print(f"translations written to {result['output']}")
