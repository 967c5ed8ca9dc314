"""workshop.report.reproduce: the whole recipe (train, average, choose on validation,
score test) and what the `reproduce` command writes.

These tests run a two-epoch smoke-profile run on 300 Multi30k pairs, found through
$ANNOTATED_TRANSFORMER_DATA: without it they are skipped on a laptop, but fail in CI
(CI=true).
"""

from pathlib import Path

import pytest
import torch
from conftest import PNG_SIGNATURE

import the_annotated_transformer as tat
from workshop.report import reports, reproduce
from workshop.run import checkpoints
from workshop.translate import scoring, translation

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


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
    page say the precision the run trained in (the smoke profile asks for "auto":
    bfloat16 where this CPU reports it), with which torch and commit, and that only
    20 sentences of each split were scored."""
    import json

    from workshop.run.precision import hardware_bf16

    root, record = reproduced
    run = checkpoints.load_checkpoint(root / "run" / "last.pt")
    saved = json.loads((root / "results" / "smoke.json").read_text())
    expected = "bfloat16" if hardware_bf16("cpu")[0] else "float32"
    assert saved["precision"] == run["precision"] == expected
    assert f"epochs in {expected}" in reports.results_row(record)
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


def test_reproduce_writes_the_json_the_table_row_and_the_training_curve(
    reproduced, multi30k_dir
):
    import json

    root, record = reproduced
    saved = json.loads((root / "results" / "smoke.json").read_text())
    # json.dumps writes a float's shortest repr, which reads back to the same bits;
    # approx's default 1e-6 relative is slack.
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
