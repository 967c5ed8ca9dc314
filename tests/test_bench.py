"""The benchmark (`python -m benchmarks`): it measures, these tests check what its
numbers rest on (the peer model is the book's model, the bound does a cached step's
work, the harness alternates, the batches are a run's) and that a `--smoke` run
prints the machine and every goal row with a number."""

import dataclasses
import itertools
import json
import math
import statistics
import subprocess
import sys

import pytest
import torch
from conftest import HANDMADE_PAIRS, REPO_ROOT, write_split

import the_annotated_transformer as tat
from benchmarks import __main__ as bench
from benchmarks import decoding, harness, training

SIZES = dict(N=2, d_model=32, d_ff=64, h=4)


def test_smoke_run_prints_the_machine_and_every_goal_row_with_a_number(tmp_path):
    """`python -m benchmarks --smoke` end to end, on a small Multi30k stand-in: it
    asserts what is printed and written, never how fast anything was."""
    data = tmp_path / "multi30k"
    data.mkdir()
    write_split(data, "train", HANDMADE_PAIRS * 100)
    out = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--smoke", "--device", "cpu"]
        + ["--data", str(data), "--json", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout.splitlines()
    results = json.loads(out.read_text())
    assert printed[:3] == results["machine"]
    machine = "\n".join(results["machine"])
    cpu, _ = harness.cpu_info()
    for fact in (cpu, torch.__version__, f"{torch.get_num_threads()} threads"):
        assert fact in machine
    assert harness.native_bf16(torch.device("cpu"))[1] in machine
    rows = results["rows"]
    assert len({row["name"] for row in rows}) == len(rows) >= 2
    for row in rows:  # --smoke measures every row, bf16 included
        value, limit = row["value"], row["limit"]
        assert math.isfinite(value) and value > 0, row
        line = next(s for s in printed if s.startswith(row["name"]))
        assert line.endswith(row["verdict"])
        if row["why"]:  # bf16 where it is emulated: measured, not judged
            assert row["verdict"] == f"no goal here: {row['why']}"
        else:
            met = value >= limit if row["op"] == ">=" else value <= limit
            assert row["verdict"] == ("met" if met else "NOT met")
    assert any(str(data) in row["detail"] for row in rows)  # the data was used


def test_the_peer_computes_the_book_models_function_with_its_parameters():
    """torch.nn.Transformer in TorchTransformer, given the book's model's weights,
    gives its log-probabilities on a padded batch (so the masks mean the same), and
    with shared matrices both count the same parameters. float64: the two add in
    different orders, a few units of 1e-16 apart, far inside assert_close's 1e-7."""
    torch.manual_seed(0)
    ours = tat.make_model(11, 11, **SIZES).double().eval()
    peer = training.TorchTransformer(11, 11, **SIZES).double().eval()
    tat.copy_weights(ours.encoder, peer.transformer.encoder)
    tat.copy_weights(ours.decoder, peer.transformer.decoder)
    for part in ("src_embed", "tgt_embed", "generator"):
        getattr(peer, part).load_state_dict(getattr(ours, part).state_dict())
    src = torch.tensor([[0, 5, 6, 7, 1, 2, 2], [0, 4, 5, 6, 7, 8, 1]])
    batch = tat.Batch(src, src[:, :6], tat.PAD)
    masks = (batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
    real = batch.tgt != tat.PAD  # padding positions' outputs are no one's concern
    expected = ours.generator(ours(*masks))[real]
    torch.testing.assert_close(peer.generator(peer(*masks))[real], expected)
    shared = dict(SIZES, share_embeddings=True, tie_generator=True)
    ours, peer = (
        make(50, 50, **shared) for make in (tat.make_model, training.TorchTransformer)
    )
    unshared = training.TorchTransformer(50, 50, **SIZES)
    assert tat.count_parameters(ours) == tat.count_parameters(peer)
    # One (50, 32) matrix for the two embeddings and the generator, not three.
    assert tat.count_parameters(unshared) - tat.count_parameters(peer) == 2 * 50 * 32


def test_the_harness_alternates_the_functions_round_by_round():
    calls = []
    fns = {name: lambda name=name: calls.append(name) for name in ("a", "b")}
    settings = harness.Settings(rounds=2, min_run_time=0.001)
    assert set(harness.median_seconds(fns, settings)) == {"a", "b"}
    assert [name for name, _ in itertools.groupby(calls)] == ["a", "b", "a", "b"]


def test_batches_are_cut_by_the_token_budget_from_shortest_to_longest():
    """Synthetic pairs have Multi30k's target length on average (4 standard errors
    of 3,000 draws: 4 * 4.75 / sqrt(3000) = 0.35), and the chosen batches keep to
    the budget, from short sentences to long."""
    settings = harness.Settings(train_pairs=3000, vocab=300)
    pairs, vocab, _ = training.training_pairs(settings, None)
    mean, _ = training.TARGET_LENGTH
    assert abs(statistics.mean(len(tgt) for _, tgt in pairs) - mean) < 0.35
    assert max(max(map(max, pair)) for pair in pairs) < vocab
    batches = training.budget_batches(pairs, 200, 3, torch.device("cpu"))
    for batch in batches:
        assert batch.src.numel() <= 200 and batch.tgt.size(0) * batch.tgt.size(1) < 200
    widths = [batch.src.size(1) for batch in batches]
    assert widths == sorted(widths) and widths[0] < widths[-1]


@pytest.mark.parametrize(
    ("flags", "dtype", "limit"),
    [
        (set(), torch.float32, 0.5),
        ({"avx512_bf16"}, torch.bfloat16, 0.45),
        ({"avx512_bf16", "amx_bf16"}, torch.bfloat16, 0.25),
        ({"avx2"}, torch.bfloat16, None),
    ],
)
def test_the_utilisation_goal_follows_the_cpus_bf16_instructions(
    monkeypatch, flags, dtype, limit
):
    monkeypatch.setattr(training, "cpu_info", lambda: ("a CPU", flags))
    monkeypatch.setattr(harness, "cpu_info", lambda: ("a CPU", flags))
    goal, why = training.utilisation_goal(dtype, torch.device("cpu"))
    assert goal == limit and bool(why) == (limit is None)


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
    with pytest.raises(SystemExit) as exit_status:
        bench.parse_args(argv)
    assert exit_status.value.code == 2
    *_, line = capsys.readouterr().err.splitlines()  # usage, then one line
    assert f"error: {message}" in line


def test_without_native_bf16_the_bf16_rows_say_why_they_are_skipped(monkeypatch):
    """A full run (not --smoke) on hardware that emulates bfloat16 measures fp32 and
    skips every bf16 row with the reason; tiny sizes, so that it takes a second."""
    reason = "the CPU has neither avx512_bf16 nor amx_bf16: bfloat16 is emulated"
    monkeypatch.setattr(training, "native_bf16", lambda device: (False, reason))
    settings = dataclasses.replace(harness.SMOKE, smoke=False)
    pairs, vocab, source = training.training_pairs(settings, None)
    rows = list(
        training.training_rows(settings, torch.device("cpu"), pairs, vocab, source)
    )
    skipped = [row for row in rows if row.value is None]
    assert skipped and all("bf16" in row.name for row in skipped)
    assert {row.verdict for row in skipped} == {f"skipped: {reason}"}
    assert all(row.value > 0 for row in rows if "fp32" in row.name)
    assert len(rows) == 2 * len(skipped)  # each measured in fp32, skipped in bf16


def test_the_peer_rows_models_decode_the_same_words_from_the_same_sources():
    """The peer rows time the book's model and transformers' on the same weights and
    sources: greedy decoding picks the same tokens on both."""
    theirs, ours = decoding.peer_models(harness.SMOKE, torch.device("cpu"))
    pairs = [(list(range(n)), [1]) for n in (5, 9, 7)]
    batches = decoding.peer_batches(pairs, 3, theirs.config.to_dict(), "cpu")
    (ids, book_ids, mask), order = batches[0], tat.marian_order(theirs.config.to_dict())
    with torch.no_grad():
        pad = theirs.config.pad_token_id
        expected = theirs.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=6,
            num_beams=1,
            do_sample=False,
            bad_words_ids=[[pad]],
            forced_eos_token_id=None,
        )
        found = tat.greedy_decode(ours, book_ids, mask.unsqueeze(1), 7, tat.BOS)
    assert torch.equal(torch.tensor(order)[found], expected)
