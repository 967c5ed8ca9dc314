"""workshop.translate.scoring: evaluating a translator on a split (sacreBLEU's BLEU and
signature, and the lowercased BLEU on spaCy tokens). These tests need no data: they
score handmade pairs, answered by a stand-in translator or a random model."""

import pytest
import sacrebleu
import torch
from conftest import HANDMADE_PAIRS, EchoTranslator, tiny_checkpoint, write_split
from tolerance import rounding_tolerance

import the_annotated_transformer as tat
from workshop.translate import scoring, translation

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

SOURCES, REFERENCES = (list(side) for side in zip(*HANDMADE_PAIRS, strict=True))


@pytest.fixture
def handmade(tmp_path):
    write_split(tmp_path, "handmade", HANDMADE_PAIRS)
    return tmp_path


def test_evaluate_scores_what_translate_returned_in_order_as_sacrebleu_does(
    handmade, capsys
):
    # Imperfect answers: the score is neither 0 nor 100, and it depends on which
    # answer is paired with which reference (59.80; rotated by one, 2.94).
    answers = ["A dog runs across the meadow.", "Two men are playing football."]
    answers.append("A woman reads a book in the garden.")
    echo = EchoTranslator(dict(zip(SOURCES, answers, strict=True)))
    result = scoring.evaluate(echo, handmade, "handmade", beam_size=3, batch_size=2)
    beam = dict(decode=tat.beam_search, beam_size=3, alpha=translation.ALPHA)
    assert echo.calls == [(SOURCES, 2, beam)]
    bleu = sacrebleu.metrics.BLEU()
    expected = bleu.corpus_score(answers, [REFERENCES])
    assert result["hypotheses"] == answers and 0 < result["bleu"] < 100
    # The same call on the same strings: the same bits.
    assert result["bleu"] == expected.score
    assert result["precisions"] == expected.precisions
    assert result["signature"] == str(bleu.get_signature())
    printed = capsys.readouterr().out
    assert f"BLEU = {expected.score:.2f}" in printed and result["signature"] in printed


def test_evaluate_is_cased_but_its_spacy_variant_is_lowercased(handmade):
    shouting = EchoTranslator({de: en.upper() for de, en in HANDMADE_PAIRS})
    result = scoring.evaluate(shouting, handmade, "handmade", quiet=True)
    assert shouting.calls[0][2] == {"decode": tat.greedy_decode}
    # Cased, only the 3 full stops and 2 sentence-initial "A"s match (5 of 23 words)
    # and no longer n-gram does; sacreBLEU's exp smoothing gives orders 2-4 1/(2*20),
    # 1/(4*17), 1/(8*14): 100 * (5/23 / 40 / 68 / 112) ** (1/4) = 2.91, under 10.
    assert result["bleu"] < 10.0
    # Every n-gram matches: exp of the mean of 4 logs of 100, 5 roundings of values
    # up to 100 in float64.
    tolerance = rounding_tolerance(5, 100, torch.float64)
    assert result["bleu_lowercase_spacy"] == pytest.approx(100, abs=tolerance)
    assert "case:mixed" in result["signature"] and "tok:13a" in result["signature"]
    assert "case:lc" in result["signature_lowercase_spacy"]
    assert "tok:none" in result["signature_lowercase_spacy"]


def test_evaluate_scores_a_checkpoint_and_writes_its_translations(handmade, capsys):
    tiny_checkpoint(handmade / "tiny.pt", seed=0)
    output = handmade / "out" / "handmade.hyp.en"
    result = scoring.evaluate(handmade / "tiny.pt", handmade, "handmade", output=output)
    lines = output.read_text(encoding="utf-8").splitlines()
    assert lines == result["hypotheses"] and result["n"] == 3
    expected = sacrebleu.corpus_bleu(lines, [REFERENCES])
    assert result["bleu"] == expected.score
    assert result["length_ratio"] == expected.sys_len / expected.ref_len
    assert "lowercased BLEU on spaCy tokens" in capsys.readouterr().out
