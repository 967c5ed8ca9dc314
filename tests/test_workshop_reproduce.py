"""workshop.report.reproduce: the whole recipe (train, average, choose on validation,
score test) and the records it writes.

These tests run a two-epoch smoke-profile run on 300 Multi30k pairs, found through
$ANNOTATED_TRANSFORMER_DATA: without it they are skipped on a laptop, but fail in CI
(CI=true).
"""

import json
import shutil

import pytest
import torch
from conftest import PNG_SIGNATURE

import the_annotated_transformer as tat
from workshop.report import reports, reproduce
from workshop.run import checkpoints
from workshop.translate import scoring, translation

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_reproduce_chooses_the_model_and_the_search_on_validation(reproduced):
    root, record = reproduced
    # windows (2, 3, 4, 5) on a 2-epoch run: only the average of the last 2 exists
    averages = [p.name for p in (root / "run").glob("average_last_*.pt")]
    assert averages == ["average_last_2.pt"]
    validation, by_beam = record["validation_bleu"], record["validation_bleu_by_beam"]
    assert set(validation) == {"last epoch", "average of the last 2"}
    assert validation[record["chosen"]] == max(validation.values())
    assert set(by_beam) == {f"beam {k}, alpha {a:g}" for k in (2, 3) for a in (0.6, 1)}
    chosen = f"beam {record['beam_size']}, alpha {record['alpha']:g}"
    assert by_beam[chosen] == max(by_beam.values())
    scored = [record["test_greedy"], record["test_beam"]]
    searches = [(s["split"], s["beam_size"], s["alpha"]) for s in scored]
    best = (record["beam_size"], record["alpha"])
    assert searches == [("test_2016_flickr", 1, None), ("test_2016_flickr", *best)]
    rebuilt = translation.load_translator(root / "run" / "epoch_002.pt")
    assert record["parameters"] == tat.count_parameters(rebuilt.model)
    assert record["train_seconds"] >= sum(r["seconds"] for r in record["history"])


def test_reproduce_writes_its_record_its_page_and_its_training_curve(
    reproduced, multi30k_dir
):
    """The JSON is the record: what the run did (from its last.pt), what scored it
    (torch, commit) and that only 20 sentences of each split were scored."""
    root, record = reproduced
    saved = json.loads((root / "results" / "smoke.json").read_text())
    assert saved == json.loads(json.dumps(record))
    run = checkpoints.load_checkpoint(root / "run" / "last.pt")
    trained, row = run["provenance"], reports.results_row(record)
    assert (saved["precision"], saved["training"]) == (run["precision"], trained)
    last = trained[-1]
    assert (saved["commit"], saved["machine"]) == (last["commit"], last["machine"])
    assert (saved["torch"], saved["limit"]) == (torch.__version__, 20)
    assert f"in {run['precision']} |" in row and "(first 20 sentences only)" in row
    page = (root / "results" / "smoke.md").read_text()
    assert f"{reports.RESULTS_HEADER}\n{row}\n" in page
    assert "Only the first 20 sentences of each split were scored" in page
    pairs = tat.read_split(multi30k_dir, "test_2016_flickr")[:5]
    assert [(e["source"], e["reference"]) for e in record["examples"]] == pairs
    assert all(e["source"] in page for e in record["examples"])
    curve = root / "images" / "training_curve_smoke.png"
    assert curve.read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.slow
def test_reproduce_scores_test_last_writes_before_printing_and_skips_stray_epochs(
    reproduced, multi30k_dir, tmp_path, monkeypatch
):
    """Reporting again on a copy of the run: it reads the test split only once it
    has chosen on validation; it writes its results before it prints the table (a
    console that cannot print α must not cost the results of a long run); and it
    averages the run's own last epochs, not a stray file past them."""
    run, events, read_split = tmp_path / "run", [], scoring.read_split
    shutil.copytree(reproduced[0] / "run", run)
    shutil.copyfile(run / "epoch_001.pt", run / "epoch_020.pt")

    def recording_read_split(data_dir, split):
        events.append(split)
        return read_split(data_dir, split)

    def ascii_console(*args, **kwargs):
        text = " ".join(map(str, args))
        events.extend(["chose"] * text.startswith("chosen on validation"))
        text.encode("ascii")  # raises, as such a console would

    monkeypatch.setattr(scoring, "read_split", recording_read_split)
    monkeypatch.setattr(reproduce, "read_split", recording_read_split)
    monkeypatch.setattr(reproduce, "print", ascii_console, raising=False)
    with pytest.raises(UnicodeEncodeError):
        reproduce.reproduce(
            "smoke", multi30k_dir, run, tmp_path, None, train=False, limit=5
        )
    chose = events.index("chose")
    assert set(events[:chose]) == {"val"} and "test_2016_flickr" in events[chose:]
    assert (tmp_path / "smoke.json").is_file() and (tmp_path / "smoke.md").is_file()
    averaged = checkpoints.load_checkpoint(run / "average_last_2.pt")["averaged_from"]
    assert [p.rsplit("/", 1)[-1] for p in averaged] == ["epoch_001.pt", "epoch_002.pt"]
