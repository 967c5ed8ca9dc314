"""Scoring a translator: translate a split of Multi30k and score it with sacreBLEU
(evaluate), with the signature that says how, and the lowercased BLEU on spaCy
tokens that other Multi30k results quote."""

from __future__ import annotations

import os
import time

from the_annotated_transformer import check_positive_int, load_tokenizers, tokenize
from workshop.errors import DataError, checking_input, require
from workshop.files import atomic_write_text, why_unwritable
from workshop.multi30k import read_split
from workshop.translate.translation import decode_options, load_translator


def evaluate(
    translator,
    data_dir,
    split="test_2016_flickr",
    beam_size=1,
    output=None,
    batch_size=64,
    quiet=False,
    alpha=None,
    limit=None,
    device=None,
):
    """Translate a split's German side with `translator` (a Translator, or the path
    of a checkpoint) and score it with sacreBLEU; returns a dict.

    `alpha` is beam search's length-penalty exponent (None: decode_options' 0.6;
    refused for greedy decoding, which it would not change);
    `limit` scores only the split's first sentences (for quick checks); `device`
    is where a checkpoint's model translates (default: the book's default_device).
    An `output` that cannot be written is refused before anything is translated.
    """
    import sacrebleu

    with checking_input():
        check_positive_int(batch_size=batch_size)
    options = decode_options(beam_size, alpha)
    reason = output and why_unwritable(output)
    require(not reason, f"cannot write to {output}: {reason}.")
    pairs = read_split(data_dir, split)[:limit]
    if not pairs:
        raise DataError(f"split {split!r} in {data_dir} is empty: nothing to score.")
    if isinstance(translator, str | os.PathLike):  # a checkpoint
        translator = load_translator(translator, device)
    sources, references = zip(*pairs, strict=True)
    start = time.perf_counter()
    hypotheses = translator.translate(list(sources), batch_size=batch_size, **options)
    seconds = time.perf_counter() - start
    if output is not None:
        atomic_write_text(output, "".join(line + "\n" for line in hypotheses))
    bleu = sacrebleu.metrics.BLEU()  # 13a tokenisation, cased: the standard
    score = bleu.corpus_score(hypotheses, [list(references)])
    # Tokenised on purpose: `force` stops sacreBLEU warning that it looks tokenised.
    bleu_lc = sacrebleu.metrics.BLEU(tokenize="none", lowercase=True, force=True)
    spacy_en = load_tokenizers()[1]
    texts = (hypotheses, references)
    hyps, refs = ([" ".join(tokenize(t, spacy_en)) for t in ts] for ts in texts)
    score_lc = bleu_lc.corpus_score(hyps, [refs])
    result = dict(split=split, beam_size=beam_size, bleu=score.score)
    result.update(alpha=options.get("alpha"), brevity_penalty=score.bp)
    result.update(signature=str(bleu.get_signature()), n=len(pairs))
    result["precisions"] = list(score.precisions)
    result["length_ratio"] = score.sys_len / score.ref_len  # output words a reference's
    result["bleu_lowercase_spacy"] = score_lc.score
    result["signature_lowercase_spacy"] = str(bleu_lc.get_signature())
    written = None if output is None else str(output)
    result.update(seconds=seconds, output=written, hypotheses=hypotheses)
    if not quiet:
        alpha = result["alpha"]  # None: greedy
        decoding = "greedy" if alpha is None else f"beam {beam_size}, alpha {alpha:g}"
        took = f"({decoding}) in {seconds:.1f} s"
        print(f"{split}: {len(pairs)} sentences translated {took}")
        print(f"sacreBLEU: {score}\nsignature: {result['signature']}")
        lowercased = f"{score_lc.score:.2f} [{result['signature_lowercase_spacy']}]"
        print(f"lowercased BLEU on spaCy tokens (not sacreBLEU's): {lowercased}")
        if output is not None:
            print(f"translations written to {output}")
    return result
