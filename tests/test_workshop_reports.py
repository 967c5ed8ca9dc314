"""workshop.report.reports: what a reproduced run's record becomes (the Results row, the
Markdown page and its speed line). The reports of a whole `reproduce` run are
tested with that command in tests/test_workshop_reproduce.py.

These tests need no data and train nothing.
"""

from pathlib import Path

import pytest

from workshop.report import reports

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_a_record_older_than_its_provenance_fields_still_renders():
    """results/multi30k.json was written before records named their commit and torch:
    its page says so instead of failing with a KeyError."""
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
