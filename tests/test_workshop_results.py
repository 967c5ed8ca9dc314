"""workshop.scoring, workshop.reproduce and workshop.reports: evaluating a
translator (BLEU), reproducing a whole run, and its reports.

The tests that run a trained model train a smoke-profile model on 300 Multi30k pairs,
found through $ANNOTATED_TRANSFORMER_DATA: without it they are skipped on a laptop,
but fail in CI (CI=true).
"""

from pathlib import Path

import pytest
import torch
from conftest import HANDMADE_PAIRS, PNG_SIGNATURE, EchoTranslator, write_split

import the_annotated_transformer as tat
from workshop import checkpoints, reports, reproduce, scoring, translation
from workshop.errors import DataError

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# ---------------------------------------------------------------------------
# Evaluating: BLEU on a split


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
    beam_3 = {"decode": translation.beam_search, "beam_size": 3, "alpha": 0.6}
    assert echo.calls == [([de for de, _ in HANDMADE_PAIRS], 2, beam_3)]
    hypotheses = [answers[de] for de, _ in HANDMADE_PAIRS]
    references = [en for _, en in HANDMADE_PAIRS]
    assert result["hypotheses"] == hypotheses
    bleu = sacrebleu.metrics.BLEU()
    expected = bleu.corpus_score(hypotheses, [references])
    assert result["signature"] == str(bleu.get_signature())
    assert result["bleu"] == pytest.approx(expected.score)
    assert result["precisions"] == pytest.approx(list(expected.precisions))
    assert 0 < result["bleu"] < 100
    # Paired the wrong way round, the same sentences would score differently.
    shuffled = bleu.corpus_score(hypotheses[1:] + hypotheses[:1], [references])
    assert shuffled.score != pytest.approx(result["bleu"])
    assert (result["n"], result["beam_size"], result["split"]) == (3, 3, "handmade")
    printed = capsys.readouterr().out
    assert f"BLEU = {expected.score:.2f}" in printed
    assert f"signature: {result['signature']}" in printed


def test_greedy_evaluation_decodes_with_the_key_value_cache(
    tmp_path, translator, monkeypatch
):
    """evaluate decodes greedily with the workshop's greedy_decode, which is the
    book's cached_greedy_decode (the key/value cache): it calls it, and finds what
    the book's uncached greedy decoding finds."""
    write_split(tmp_path, "handmade", HANDMADE_PAIRS)
    echo = EchoTranslator(dict(HANDMADE_PAIRS))
    scoring.evaluate(echo, tmp_path, "handmade", quiet=True)
    assert [options for *_, options in echo.calls] == [
        {"decode": translation.greedy_decode}
    ]
    calls, cached = [], tat.cached_greedy_decode

    def counted(*args, **kwargs):
        calls.append(1)
        return cached(*args, **kwargs)

    monkeypatch.setattr(tat, "cached_greedy_decode", counted)
    sources = [de for de, _ in HANDMADE_PAIRS]
    found = translator.translate(sources, **translation.decode_options())
    assert calls == [1]  # one batch, decoded with the cache
    assert found == translator.translate(sources, decode=tat.greedy_decode)


def test_evaluate_is_cased_but_its_spacy_variant_is_lowercased(tmp_path):
    write_split(tmp_path, "handmade", HANDMADE_PAIRS)
    shouting = EchoTranslator({de: en.upper() for de, en in HANDMADE_PAIRS})
    result = scoring.evaluate(shouting, tmp_path, "handmade", quiet=True)
    assert result["bleu"] < 10.0
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
    assert result["bleu"] == pytest.approx(expected.score)
    assert result["length_ratio"] == expected.sys_len / expected.ref_len
    assert result["beam_size"] == 1


def test_evaluate_with_beam_size_2_decodes_with_beam_search(
    translator, mini_split, monkeypatch
):
    folder, pairs = mini_split
    calls = []
    beam_search = translation.beam_search

    def counting_beam_search(*args, **kwargs):
        calls.append(kwargs.get("beam_size"))
        return beam_search(*args, **kwargs)

    monkeypatch.setattr(translation, "beam_search", counting_beam_search)
    result = scoring.evaluate(translator, folder, "mini", beam_size=2, quiet=True)
    assert calls and set(calls) == {2}
    assert result["n"] == len(pairs) and result["beam_size"] == 2
    import sacrebleu

    references = [[en for _, en in pairs]]
    expected = sacrebleu.corpus_bleu(result["hypotheses"], references).score
    assert result["bleu"] == pytest.approx(expected)
    assert result["hypotheses"] == translator.translate(
        [de for de, _ in pairs], **translation.decode_options(2)
    )


# ---------------------------------------------------------------------------
# The whole recipe: reproduce (train, average, choose on validation, score test)


def test_reproduce_trains_averages_and_chooses_on_validation_only(reproduced):
    root, record = reproduced
    assert record["epochs"] == len(record["history"]) == 2
    # windows (2, 3, 4, 5) on a 2-epoch run: only the average of the last 2 exists
    assert (root / "run" / "average_last_2.pt").is_file()
    assert not (root / "run" / "average_last_3.pt").exists()
    assert set(record["validation_bleu"]) == {"last epoch", "average of the last 2"}
    assert record["chosen"] == max(
        record["validation_bleu"], key=record["validation_bleu"].get
    )
    by_beam = record["validation_bleu_by_beam"]
    assert set(by_beam) == {f"beam {k}, alpha {a}" for k in (2, 3) for a in (0.6, 1)}
    chosen = f"beam {record['beam_size']}, alpha {record['alpha']:g}"
    assert by_beam[chosen] == max(by_beam.values())
    greedy, beam = record["test_greedy"], record["test_beam"]
    assert greedy["split"] == beam["split"] == "test_2016_flickr"
    assert (greedy["beam_size"], beam["beam_size"]) == (1, record["beam_size"])
    assert beam["alpha"] == record["alpha"]
    assert "tok:13a" in greedy["signature"]
    assert record["epochs_planned"] == 2 and record["stopped_by_time_limit"] is None
    rebuilt = translation.load_translator(root / "run" / "epoch_002.pt")
    assert record["parameters"] == tat.count_parameters(rebuilt.model)
    assert record["train_seconds"] >= sum(r["seconds"] for r in record["history"])


def test_reproduce_records_the_precision_versions_commit_and_limit(reproduced):
    """What the run did (from its last.pt) and what scored it: the JSON and the
    page say the run trained in float32 (the smoke profile asks for no bf16), with
    which torch and commit, and that only 20 sentences of each split were scored."""
    import json

    root, record = reproduced
    run = checkpoints.load_checkpoint(root / "run" / "last.pt")
    saved = json.loads((root / "results" / "smoke.json").read_text())
    assert saved["precision"] == run["precision"] == "float32"
    assert saved["training"] == run["provenance"]
    assert saved["machine"] == run["provenance"][-1]["machine"]
    assert saved["torch"] == torch.__version__
    assert saved["commit"] == run["provenance"][-1]["commit"]
    assert saved["limit"] == 20
    page = (root / "results" / "smoke.md").read_text()
    assert "Only the first 20 sentences of each split were scored" in page
    assert "(first 20 sentences only)" in reports.results_row(record)


@pytest.mark.parametrize("folder", ["results", "images"])
def test_reproduce_with_a_limit_refuses_the_checkouts_committed_folders(
    folder, tmp_path
):
    committed = Path(tat.__file__).resolve().parent / folder
    before = sorted(p.name for p in committed.iterdir())
    folders = {"results_dir": tmp_path, "images_dir": tmp_path, f"{folder}_dir": None}
    folders[f"{folder}_dir"] = committed
    with pytest.raises(ValueError, match="limit=5 scores only 5 sentences"):
        reproduce.reproduce("smoke", tmp_path, tmp_path / "run", limit=5, **folders)
    assert sorted(p.name for p in committed.iterdir()) == before
    assert not (tmp_path / "run").exists()


def test_a_record_older_than_its_provenance_fields_still_renders():
    """results/multi30k.json was written before records named their commit and torch:
    its page says so instead of failing with a KeyError (issue 40's audit)."""
    import json

    committed = Path(__file__).resolve().parent.parent / "results" / "multi30k.json"
    record = json.loads(committed.read_text())
    assert "torch" not in record  # control: the record is the old kind
    page = reports.results_markdown(record)
    assert "Scored before records named their commit and torch version." in page
    assert "Scored from" not in page


def test_the_speed_line_weighs_each_epoch_by_its_time():
    history = [
        {"tokens_per_s": 1000.0, "seconds": 100.0},  # 100,000 tokens
        {"tokens_per_s": 3000.0, "seconds": 100.0},  # 300,000 tokens
    ]
    line = reports._speed_line(history)
    assert "2,000 target tokens/s over 2 epochs" in line  # 400,000 in 200 s
    assert "0.40 M target tokens in 3 min" in line
    assert "about 6,667 / S minutes" in line  # 400,000 / 60


def test_reproduce_writes_the_json_the_table_row_and_the_training_curve(
    reproduced, multi30k_dir
):
    import json

    root, record = reproduced
    saved = json.loads((root / "results" / "smoke.json").read_text())
    assert saved["test_beam"]["bleu"] == pytest.approx(record["test_beam"]["bleu"])
    page = (root / "results" / "smoke.md").read_text()
    assert reports.RESULTS_HEADER in page and reports.results_row(record) in page
    assert reports._speed_line(record["history"]) in page
    row = reports.results_row(record).strip("|").split("|")
    assert len(row) == 7 and row[0].strip() == "`smoke`"
    assert f"{record['test_greedy']['bleu']:.2f}" in row[5]
    pairs = tat.read_split(multi30k_dir, "test_2016_flickr")[:5]
    assert [(e["source"], e["reference"]) for e in record["examples"]] == pairs
    assert all(e["source"] in page for e in record["examples"])
    curve = root / "images" / "training_curve_smoke.png"
    assert curve.read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.slow
def test_reproduce_reads_the_test_split_only_after_choosing_on_validation(
    reproduced, multi30k_dir, monkeypatch
):
    root, _ = reproduced
    events = []
    read_split, print_ = scoring.read_split, print

    def recording_read_split(data_dir, split):
        events.append(("read", split))
        return read_split(data_dir, split)

    def recording_print(*args, **kwargs):
        text = " ".join(map(str, args))
        if text.startswith("chosen on validation"):
            events.append(("chose", None))
        print_(*args, **kwargs)

    monkeypatch.setattr(scoring, "read_split", recording_read_split)
    monkeypatch.setattr(reproduce, "read_split", recording_read_split)
    monkeypatch.setattr(reproduce, "print", recording_print, raising=False)
    reproduce.reproduce("smoke", multi30k_dir, root / "run", None, train=False, limit=5)
    chose = events.index(("chose", None))
    assert {split for _, split in events[:chose]} == {"val"}
    assert ("read", "test_2016_flickr") in events[chose:]


@pytest.mark.slow
def test_reproduce_writes_its_results_before_printing_the_table(
    reproduced, multi30k_dir, tmp_path, monkeypatch
):
    """A console that cannot print α must not cost the results of a long run."""
    root, _ = reproduced
    print_ = print

    def ascii_console(*args, **kwargs):
        text = " ".join(map(str, args))
        text.encode("ascii")  # raises UnicodeEncodeError, as such a console would
        print_(*args, **kwargs)

    monkeypatch.setattr(reproduce, "print", ascii_console, raising=False)
    with pytest.raises(UnicodeEncodeError):
        reproduce.reproduce(
            "smoke", multi30k_dir, root / "run", tmp_path, None, train=False, limit=5
        )
    assert (tmp_path / "smoke.json").is_file() and (tmp_path / "smoke.md").is_file()


@pytest.mark.slow
def test_reproduce_ignores_epoch_files_past_the_runs_last_epoch(
    reproduced, multi30k_dir, tmp_path
):
    import shutil

    root, _ = reproduced
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    shutil.copyfile(run / "epoch_001.pt", run / "epoch_020.pt")  # a stray old file
    reproduce.reproduce("smoke", multi30k_dir, run, None, train=False, limit=5)
    averaged = checkpoints.load_checkpoint(run / "average_last_2.pt")["averaged_from"]
    assert [Path(p).name for p in averaged] == ["epoch_001.pt", "epoch_002.pt"]
