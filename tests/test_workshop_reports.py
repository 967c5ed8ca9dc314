"""workshop.report.reports: what a reproduced run's record becomes, on records built
here (the files a whole `reproduce` run writes: tests/test_workshop_reproduce.py)."""

from workshop.report import reports


def test_the_provenance_line_says_what_scored_a_record_and_on_how_much():
    old = "Scored before records named their commit and torch version."
    assert reports.provenance_line({}) == old
    record = dict(torch="2.5", commit="0123456789abcdef", uncommitted_changes=True)
    record.update(training=[dict(torch="2.4")], limit=9)
    assert reports.provenance_line(record) == (
        "Scored from commit `0123456789ab` with uncommitted changes with torch 2.5. "
        "Trained with torch 2.4. **Only the first 9 sentences of each split were "
        "scored**: these are not results to compare."
    )
    said = "Scored from outside a git checkout with torch 2.5."
    assert reports.provenance_line(dict(torch="2.5", commit=None)) == said


def test_the_speed_line_weighs_each_epoch_by_its_time():
    history = [dict(tokens_per_s=1000.0, seconds=100.0)]  # 100,000 tokens
    history.append(dict(tokens_per_s=3000.0, seconds=100.0))  # 300,000 tokens
    line = reports._speed_line(history)
    assert "2,000 target tokens/s over 2 epochs" in line  # 400,000 in 200 s
    assert "0.40 M target tokens in 3 min" in line
    assert "about 6,667 / S minutes" in line  # 400,000 / 60
