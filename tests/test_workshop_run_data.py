"""A run's data (workshop.run.run_data): the book's prepare_data with the run's
vocabularies. The word vocabularies are the book's (test_part3_translation.py)."""

import pytest
from conftest import texts_of

import the_annotated_transformer as tat
from workshop.run import run_data
from workshop.run.settings import RunConfig

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_a_subword_run_learns_one_vocabulary_from_its_pairs_for_both_sides(
    multi30k_dir, train_pairs, monkeypatch
):
    """Learnt from exactly the run's training sentences (its first 300 pairs), and
    every sentence of either language encoded with it, between <s> and </s>."""
    learnt, build = [], tat.SubwordVocab.build

    def recording_build(texts, size):
        learnt.append(list(texts))
        return build(learnt[-1], size)

    monkeypatch.setattr(tat.SubwordVocab, "build", recording_build)
    subwords = dict(vocab="bpe", bpe_vocab_size=1000, max_train_pairs=300)
    config = RunConfig.from_profile("smoke", **subwords)
    data = run_data.prepare_run_data(config, multi30k_dir)
    assert learnt == [texts_of(train_pairs[:300])] and len(data.splits["train"]) == 300
    vocab = data.vocab_src
    assert data.vocab_tgt is vocab
    val = zip(data.raw["val"][:20], data.splits["val"][:20], strict=True)
    for pair, encoded in val:
        assert list(encoded) == [[tat.BOS, *vocab.encode(s), tat.EOS] for s in pair]
