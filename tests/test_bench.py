"""The benchmark: the benchmark measures, these tests check the helpers it measures
with, and that a `--quick` smoke run prints and writes every figure. The modules in
benchmarks/ import each other by name (bench.py runs as a script, which puts its
folder on sys.path), so the tests put that folder on sys.path too."""

import importlib
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import HANDMADE_PAIRS, REPO_ROOT, write_split

import the_annotated_transformer as tat

BENCHMARKS = REPO_ROOT / "benchmarks"

# The rows each figure of bench.py's FIGURES prints, by their key in the JSON file.
ROWS = {
    "training": ["training_fp32"],
    "bf16": ["training_bf16", "loss_bf16_vs_fp32"],
    "mfu": ["mfu_fp32", "mfu_bf16"],
    "pipeline": ["pipeline", "pipeline_padding"],
    "decoding": ["greedy_cache_batch1", "greedy_cache_batch64"],
    "batching": ["translate_batched"],
    "beam": ["beam4_batch1", "beam4_batch64"],
    "startup": ["import", "copy_task", "copy_task_exact"],
    "memory": ["memory_base", "memory_quick"],
}


@pytest.fixture
def bench_module(monkeypatch):
    """A function that imports a module of benchmarks/ by name."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module


def test_median_times_interleaves_the_functions_round_by_round(bench_module):
    timing = bench_module("timing")
    calls = []
    fns = {name: lambda name=name: calls.append(name) for name in ("a", "b")}
    assert set(timing.median_times(fns, repeats=3, warmup=2)) == {"a", "b"}
    assert calls == ["a", "b"] * 5  # 2 warm-up rounds, then 3 timed ones
    calls.clear()
    timing.median_times(fns, repeats=2, min_run_time=0.001)  # blocks of calls
    assert [name for name, _ in itertools.groupby(calls)] == ["a", "b", "a", "b"]


def test_greedy_steps_go_through_the_cache_they_are_given(bench_module):
    decoding = bench_module("figures_decoding")
    torch.manual_seed(3)
    model = tat.make_model(13, 13, N=2, d_model=32, d_ff=64, h=4).eval()
    src = torch.randint(3, 13, (5, 7))
    src_mask = torch.ones(5, 1, 7, dtype=torch.bool)
    with torch.no_grad():
        memory = model.encode(src, src_mask)
    cache = tat.KVCache(model)
    ys = decoding.greedy_steps(model, memory, src_mask, 5, cache)
    assert ys.shape == (5, 6)  # the start symbol and 5 tokens
    assert cache.length == 5  # one position per generated token, all through it
    assert torch.equal(ys, decoding.greedy_steps(model, memory, src_mask, 5))


def test_trainer_in_bf16_trains_the_model_and_its_loss_under_autocast(bench_module):
    workloads, settings = bench_module("workloads"), bench_module("settings")
    sizes = settings.Sizes(N=1, d_model=32, d_ff=64, h=4, vocab=50)
    model = workloads.book_model(sizes, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    seen = []  # inside the model (a feed-forward layer) and in the loss (generator)
    for layer in (model.encoder.layers[0].feed_forward.w_1, model.generator.proj):
        layer.register_forward_hook(lambda module, inputs, out: seen.append(out.dtype))
    batches = workloads.synthetic_batches(2, sizes.vocab, batch_size=4)
    loss = workloads.trainer(model, torch.bfloat16)(batches)
    assert seen == [torch.bfloat16] * 4  # two batches, two layers each
    assert torch.isfinite(torch.tensor(loss))
    after = list(model.parameters())
    assert all(p.dtype == torch.float32 for p in after)
    assert any(not torch.equal(p, q) for p, q in zip(after, before, strict=True))


@pytest.mark.slow
def test_quick_run_prints_and_writes_every_figure(tmp_path):
    """`bench.py --quick` end to end (about a minute on 2 cores), on a small Multi30k
    stand-in so that the pipeline figure runs too; it asserts what is printed and
    written, never how fast anything was."""
    data = tmp_path / "multi30k"
    data.mkdir()
    write_split(data, "train", HANDMADE_PAIRS * 300)
    out = tmp_path / "figures.json"
    default = BENCHMARKS / "results.json"  # a full run's figures: left alone
    before = default.exists() and default.stat().st_mtime_ns
    command = [sys.executable, str(BENCHMARKS / "bench.py"), "--quick"]
    result = subprocess.run(
        [*command, "--json", str(out), "--data", str(data)],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())["figures"]
    assert list(figures) == [key for keys in ROWS.values() for key in keys]
    printed = result.stdout.splitlines()
    for key, row in figures.items():
        line = next((s for s in printed if s.startswith(row["figure"])), None)
        assert line is not None, f"{key}: no line in the table"
        if row["value"] is None:  # bf16 rows on a CPU where bf16 does not pay
            assert line.split()[-1] == "skipped", key
            assert row["note"].startswith("skipped: "), key
            continue
        assert isinstance(row["value"], float), key
        if row["ref_value"] is not None:  # measured beside it: a ratio
            assert row["ratio"] > 0, key
            assert f"{row['ratio']:.2f}x" in line, key
    assert figures["pipeline"]["value"] is not None  # it ran on the stand-in
    assert (default.exists() and default.stat().st_mtime_ns) == before
