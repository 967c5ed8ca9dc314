"""The benchmark (`python -m benchmarks`): a `--smoke` run prints the machine and a
well-formed row per goal, and the harness alternates the functions it times and
refuses bad options in one line. It measures; these tests assert what it prints,
never how fast anything was."""

import itertools
import json
import math

import pytest
import torch
from conftest import HANDMADE_PAIRS, write_split

from benchmarks import __main__ as bench
from benchmarks import harness


@pytest.mark.slow  # half a minute on 2 cores
def test_a_smoke_run_prints_the_machine_then_every_row_with_its_verdict(
    tmp_path, capsys
):
    write_split(tmp_path, "train", HANDMADE_PAIRS * 100)  # a Multi30k stand-in
    out, data = tmp_path / "rows.json", str(tmp_path)
    bench.main(["--smoke", "--device", "cpu", "--data", data, "--json", str(out)])
    printed, results = capsys.readouterr().out.splitlines(), json.loads(out.read_text())
    assert printed[:3] == results["machine"]
    assert harness.cpu_info()[0] in printed[0] and torch.__version__ in printed[2]
    rows = results["rows"]
    assert len({row["name"] for row in rows}) == len(rows) >= 2
    for row in rows:  # --smoke measures every row, bf16 included
        value, limit, verdict = row["value"], row["limit"], row["verdict"]
        assert math.isfinite(value) and value > 0, row
        assert any(s.startswith(row["name"]) and s.endswith(verdict) for s in printed)
        met = value >= limit if row["op"] == ">=" else value <= limit
        expected = "met" if met else "NOT met"
        assert verdict == (f"no goal here: {row['why']}" if row["why"] else expected)
    assert any(data in row["detail"] for row in rows)  # the data was used


def test_the_harness_alternates_the_functions_round_by_round():
    calls = []
    fns = {name: lambda name=name: calls.append(name) for name in ("a", "b")}
    settings = harness.Settings(rounds=2, min_run_time=0.001)
    assert set(harness.median_seconds(fns, settings)) == {"a", "b"}
    assert [name for name, _ in itertools.groupby(calls)] == ["a", "b", "a", "b"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "gpu"], "--device 'gpu': use cpu, cuda or cuda:N"),
        (["--device", "cuda:1"], "--device cuda:1: this machine has 1 CUDA GPUs"),
        (["--device", "meta"], "--device meta: the bench measures on cpu or cuda"),
        (["--data", "/nowhere"], "--data /nowhere: no train.de.gz there"),
    ],
)
def test_bad_options_are_refused_in_one_line(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match="2"):
        bench.parse_args(argv)
    *_, line = capsys.readouterr().err.splitlines()  # usage, then one line
    assert f"error: {message}" in line
