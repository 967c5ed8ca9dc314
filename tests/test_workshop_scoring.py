"""workshop.translate.scoring: evaluating a translator on a split of Multi30k (BLEU,
with sacreBLEU's signature, and the lowercased BLEU on spaCy tokens).

The tests that run a trained model train a smoke-profile model on 300 Multi30k pairs,
found through $ANNOTATED_TRANSFORMER_DATA: without it they are skipped on a laptop,
but fail in CI (CI=true).
"""

import pytest
from conftest import HANDMADE_PAIRS, EchoTranslator, write_split

import the_annotated_transformer as tat
from workshop.errors import DataError
from workshop.translate import scoring, translation

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_evaluate_scores_exactly_what_translate_returned_in_order(tmp_path, capsys):
    import sacrebleu

    write_split(tmp_path, "handmade", HANDMADE_PAIRS)
    # Imperfect answers, so the score is neither 0 nor 100 and depends on which
    # hypothesis is paired with which reference.
    answers = {
        HANDMADE_PAIRS[0][0]: "A dog runs across the meadow.",
        HANDMADE_PAIRS[1][0]: "Two men are playing football.",
        HANDMADE_PAIRS[2][0]: "A woman reads a book in the garden.",
    }
    echo = EchoTranslator(answers)
    result = scoring.evaluate(echo, tmp_path, "handmade", beam_size=3, batch_size=2)
    beam_3 = {"decode": tat.beam_search, "beam_size": 3, "alpha": 0.6}
    assert echo.calls == [([de for de, _ in HANDMADE_PAIRS], 2, beam_3)]
    hypotheses = [answers[de] for de, _ in HANDMADE_PAIRS]
    references = [en for _, en in HANDMADE_PAIRS]
    assert result["hypotheses"] == hypotheses
    bleu = sacrebleu.metrics.BLEU()
    expected = bleu.corpus_score(hypotheses, [references])
    assert result["signature"] == str(bleu.get_signature())
    # approx's default 1e-6 relative is slack: evaluate makes this same corpus_score
    # call on the same strings, the same float operations, so the bits agree.
    assert result["bleu"] == pytest.approx(expected.score)
    # The same call, the same bits: the default 1e-6 relative is slack here too.
    assert result["precisions"] == pytest.approx(list(expected.precisions))
    assert 0 < result["bleu"] < 100
    # Paired the wrong way round, the same sentences would score differently.
    shuffled = bleu.corpus_score(hypotheses[1:] + hypotheses[:1], [references])
    # The two pairings score 59.80 and 2.94, far more than approx's 1e-6 relative apart.
    assert shuffled.score != pytest.approx(result["bleu"])
    assert (result["n"], result["beam_size"], result["split"]) == (3, 3, "handmade")
    printed = capsys.readouterr().out
    assert f"BLEU = {expected.score:.2f}" in printed
    assert f"signature: {result['signature']}" in printed


def test_greedy_evaluation_decodes_with_the_key_value_cache(
    tmp_path, translator, monkeypatch
):
    """evaluate decodes greedily with the book's greedy_decode and a key/value
    cache (one a batch), finding what the book's uncached greedy decoding finds."""
    write_split(tmp_path, "handmade", HANDMADE_PAIRS)
    echo = EchoTranslator(dict(HANDMADE_PAIRS))
    scoring.evaluate(echo, tmp_path, "handmade", quiet=True)
    assert [options for *_, options in echo.calls] == [{"decode": tat.greedy_decode}]
    calls, cache = [], translation.ProgressCache

    def counted(*args, **kwargs):
        calls.append(1)
        return cache(*args, **kwargs)

    monkeypatch.setattr(translation, "ProgressCache", counted)
    sources = [de for de, _ in HANDMADE_PAIRS]
    found = translator.translate(sources, **translation.decode_options())
    assert calls == [1]  # one batch, decoded with the cache
    plain = tat.decode_ids(translator.model, translator.encode(sources))
    assert found == [translator.text(ids) for ids in plain]


def test_evaluate_is_cased_but_its_spacy_variant_is_lowercased(tmp_path):
    write_split(tmp_path, "handmade", HANDMADE_PAIRS)
    shouting = EchoTranslator({de: en.upper() for de, en in HANDMADE_PAIRS})
    result = scoring.evaluate(shouting, tmp_path, "handmade", quiet=True)
    # Cased, only the 3 full stops and 2 sentence-initial "A"s match (5 of 23 words)
    # and no longer n-gram does; sacreBLEU's exp smoothing gives orders 2-4 1/(2*20),
    # 1/(4*17), 1/(8*14): 100 * (5/23 / 40 / 68 / 112) ** (1/4) = 2.91, under 10.
    assert result["bleu"] < 10.0
    # Every n-gram matches, so the score is exp(4 log 100 / 4): a few ulps off 100
    # (4e-14); approx's default 1e-6 relative covers that with room.
    assert result["bleu_lowercase_spacy"] == pytest.approx(100)
    assert result["length_ratio"] == 1.0  # upper case changes no word count
    assert "case:mixed" in result["signature"] and "tok:13a" in result["signature"]
    assert "case:lc" in result["signature_lowercase_spacy"]
    assert "tok:none" in result["signature_lowercase_spacy"]


def test_evaluate_of_a_missing_split_names_the_file(tmp_path):
    with pytest.raises(DataError, match="nosuch.de.gz"):
        scoring.evaluate(EchoTranslator({}), tmp_path, "nosuch", quiet=True)


def test_evaluate_runs_a_checkpoint_end_to_end_and_prints_the_signature(
    trained_checkpoint, mini_split, tmp_path, capsys
):
    import sacrebleu

    folder, pairs = mini_split
    output = tmp_path / "out" / "mini.hyp.en"
    result = scoring.evaluate(trained_checkpoint, folder, "mini", output=output)
    printed = capsys.readouterr().out
    assert "nrefs:1" in printed and "tok:13a" in printed
    assert "lowercased BLEU on spaCy tokens" in printed
    lines = output.read_text(encoding="utf-8").split("\n")
    assert lines[-1] == "" and len(lines[:-1]) == len(pairs) == result["n"] == 20
    expected = sacrebleu.corpus_bleu(lines[:-1], [[en for _, en in pairs]])
    # The file holds evaluate's hypotheses verbatim and corpus_bleu is the same
    # default BLEU, so the bits agree; approx's default 1e-6 relative is slack.
    assert result["bleu"] == pytest.approx(expected.score)
    assert result["length_ratio"] == expected.sys_len / expected.ref_len
    assert result["beam_size"] == 1


def test_evaluate_with_beam_size_2_decodes_with_beam_search(
    translator, mini_split, monkeypatch
):
    folder, pairs = mini_split
    calls = []
    beam_search = tat.beam_search

    def counting_beam_search(*args, **kwargs):
        calls.append(kwargs.get("beam_size"))
        return beam_search(*args, **kwargs)

    monkeypatch.setattr(tat, "beam_search", counting_beam_search)
    result = scoring.evaluate(translator, folder, "mini", beam_size=2, quiet=True)
    assert calls and set(calls) == {2}
    assert result["n"] == len(pairs) and result["beam_size"] == 2
    import sacrebleu

    references = [[en for _, en in pairs]]
    expected = sacrebleu.corpus_bleu(result["hypotheses"], references).score
    # The same default BLEU on the same hypotheses, so the bits agree; approx's
    # default 1e-6 relative is slack.
    assert result["bleu"] == pytest.approx(expected)
    assert result["hypotheses"] == translator.translate(
        [de for de, _ in pairs], **translation.decode_options(2)
    )
