"""The benchmark: the benchmark measures, these tests check the helpers it measures
with, and that a `--quick` smoke run prints and writes every figure. The modules in
benchmarks/ import each other by name (bench.py runs as a script, which puts its
folder on sys.path), so the tests put that folder on sys.path too."""

import dataclasses
import importlib
import itertools
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import HANDMADE_PAIRS, REPO_ROOT, write_split
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.profiler import profile, record_function
from torch.utils import _pytree as pytree

import the_annotated_transformer as tat

BENCHMARKS = REPO_ROOT / "benchmarks"

# The rows each figure of bench.py's FIGURES prints, by their key in the JSON file.
ROWS = {
    "training": ["training_fp32", "multi30k_step"],
    "bf16": ["training_bf16", "loss_bf16_vs_fp32"],
    "mfu": ["mfu_fp32", "mfu_bf16"],
    "pipeline": ["pipeline", "pipeline_padding"],
    "decoding": [
        "greedy_cache_batch1",
        "greedy_workshop_cache_batch1",
        "greedy_cache_bound_batch1",
        "greedy_cache_share_of_bound_batch1",
        "greedy_cache_batch64",
        "greedy_workshop_cache_batch64",
    ],
    "batching": ["translate_batched"],
    "beam": ["beam4_batch1", "beam4_batch64"],
    "startup": ["import", "cli_help", "copy_task", "copy_task_exact"],
    "memory": ["memory_base", "memory_quick"],
    "profile": [
        f"profile_{step}_{precision}_{row}"
        for step in ("base", "multi30k")
        for precision in ("fp32", "bf16")
        for row in (
            *("step", "matmul", "attention", "gather", "elementwise", "casts"),
            *("loss", "optimizer", "python", "other"),
        )
    ],
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


@pytest.mark.parametrize(
    ("cuda_devices", "argument", "expected"),  # expected: the device or the error
    [
        (0, None, torch.device("cpu")),
        (0, "cuda", "CUDA is not available on this machine; use --device cpu"),
        (2, None, torch.device("cuda", 0)),
        (2, "cuda:1", torch.device("cuda", 1)),
        (2, "cuda:2", "this machine has cuda:0 to cuda:1"),
        (2, "gpu", "'gpu' is not cpu, cuda, cuda:N or mps"),
        (0, "mps", "the bench measures on cpu, cuda or cuda:N, not mps"),
    ],
)
def test_device_option_defaults_to_cuda_if_any_and_refuses_a_missing_one_in_a_line(
    bench_module, monkeypatch, capsys, cuda_devices, argument, expected
):
    bench = bench_module("bench")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda_devices)
    argv = [] if argument is None else ["--device", argument]
    if isinstance(expected, torch.device):
        assert bench.parse_args(argv).device == expected
        return
    with pytest.raises(SystemExit) as exit_status:
        bench.main(argv)
    assert exit_status.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()  # one line, no usage or traceback
    assert line.endswith(f": error: argument --device: {expected}")


def test_timed_call_synchronizes_a_cuda_device_just_around_the_work(
    bench_module, monkeypatch
):
    """The clock starts after the device's queued work is done and stops after the
    work's own is. Nothing else may touch CUDA: this machine has none."""
    timing = bench_module("timing")
    events, ticks = [], itertools.count()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: events.append(device))
    clock = SimpleNamespace(perf_counter=lambda: events.append("clock") or next(ticks))
    monkeypatch.setattr(timing, "time", clock)
    gpu = torch.device("cuda", 0)
    assert timing.timed_call(lambda: events.append("work") or 7, gpu) == (7, 1)
    assert events == [gpu, "clock", "work", gpu, "clock"]
    events.clear()
    timing.median_times({"a": lambda: events.append("work")}, repeats=1, device=gpu)
    assert events == [gpu, "clock", "work", gpu, "clock"]
    events.clear()
    timing.timed_call(lambda: events.append("work"), torch.device("cpu"))
    assert events == ["clock", "work", "clock"]


class DevicesSeen(TorchFunctionMode):
    """Records the device of every tensor a torch function takes or returns."""

    def __init__(self):
        super().__init__()
        self.devices = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = pytree.tree_leaves((args, kwargs, out))
        self.devices |= {x.device for x in leaves if isinstance(x, torch.Tensor)}
        return out


@pytest.mark.slow
def test_training_models_and_batches_are_made_on_the_bench_device(bench_module):
    """On the meta device (shapes, no values): every parameter, buffer and batch
    tensor lands there, and each model's forward pass touches no other device."""
    workloads, training = bench_module("workloads"), bench_module("figures_training")
    sizes = bench_module("bench_settings").Sizes(
        N=1, d_model=32, d_ff=64, h=4, vocab=50
    )
    meta = torch.device("meta")
    (batch,) = workloads.synthetic_batches(1, sizes.vocab, batch_size=4, device=meta)
    tensors = [v for v in vars(batch).values() if torch.is_tensor(v)]
    seen = DevicesSeen()
    for make in training.TRAINING_VARIANTS.values():
        model, _ = make(sizes, meta)
        tensors += [*model.parameters(), *model.buffers()]
        with seen:
            model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
    assert {t.device for t in tensors} == seen.devices == {meta}


@pytest.mark.slow
def test_timed_decoding_and_matmul_peak_touch_only_the_bench_device(
    bench_module, monkeypatch
):
    """The decoding figures and the matrix-multiply peak run on the meta device, and
    every tensor their timed calls touch is there: no model, source, memory, cache or
    mask stays behind on the CPU, and nothing is copied to the device per step."""
    settings, timing = bench_module("bench_settings"), bench_module("timing")
    training, decoding = (
        bench_module("figures_training"),
        bench_module("figures_decoding"),
    )
    seen = DevicesSeen()

    def watched(fn):
        def call():
            with seen:
                return fn()

        return call

    def median_times_seen(fns, *args, **kwargs):  # the timed calls, not the Timer's
        fns = {name: watched(fn) for name, fn in fns.items()}
        return timing.median_times(fns, *args, **kwargs)

    for module in (training, decoding):
        monkeypatch.setattr(module, "median_times", median_times_seen)
    quick = dataclasses.replace(
        settings.QUICK,
        decode_sizes=settings.Sizes(N=1, d_model=32, d_ff=64, h=4, vocab=50),
        min_run_time=0.001,
        decode_tokens=3,
        sentences=4,
        one_at_a_time=1,
    )
    ctx = training.Context(quick, None, (), torch.device("meta"))
    decoding.figure_decoding(ctx)
    decoding.figure_batching(ctx)
    training.matmul_peak(8, torch.float32, quick, ctx.device)
    assert seen.devices == {torch.device("meta")}


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


@pytest.mark.slow
def test_trainer_in_bf16_trains_the_model_and_its_loss_under_autocast(bench_module):
    workloads, settings = bench_module("workloads"), bench_module("bench_settings")
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


def test_train_step_trains_the_model_as_trainer_does(bench_module):
    """The profiled step is run_epoch's step: from the same weights, batches and
    dropout draws, two steps of each leave the same weights and the same loss."""
    workloads, settings = bench_module("workloads"), bench_module("bench_settings")
    sizes = settings.Sizes(N=1, d_model=32, d_ff=64, h=4, vocab=50)
    batches = workloads.synthetic_batches(2, sizes.vocab, batch_size=4)
    stepped, trained = (workloads.book_model(sizes, seed=0) for _ in range(2))
    step = workloads.train_step(stepped)
    torch.manual_seed(1)
    losses = [step(batch).float() for batch in batches]
    torch.manual_seed(1)
    mean_loss = workloads.trainer(trained)(batches)
    # Exact: the same float32 operations in the same order on the same values.
    assert float(sum(losses)) / workloads.target_tokens(batches) == mean_loss
    for p, q in zip(stepped.parameters(), trained.parameters(), strict=True):
        assert torch.equal(p, q)


def test_budget_batches_fill_the_token_budget_as_the_book_cuts_it(bench_module):
    workloads = bench_module("workloads")
    batches = workloads.budget_batches(3, 100, max_tokens=200, seed=5)
    assert len(batches) == 3
    for batch in batches:
        assert batch.src.numel() <= 200 and batch.tgt.numel() < 200  # tgt: one less
        assert torch.equal(batch.src[:, 1:], batch.tgt_y)  # the same ids each side


def toy_step(workloads):
    """A function that takes a step of a tiny model with one of each kind of op
    the profile sorts, marked as train_step marks the loss and the optimizer."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    w, w2 = torch.randn(16, 8, requires_grad=True), torch.randn(16, 5)
    w2.requires_grad_()
    buffer = torch.empty(4, 8, dtype=torch.bfloat16)
    rows = torch.tensor([0, 2, 3])

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = F.linear(x, w)  # x and w cast to bfloat16 inside the product
        q = h.float().view(1, 1, 4, 16)
        with sdpa_kernel(SDPBackend.MATH):  # attention as bmm, softmax, bmm
            a = F.scaled_dot_product_attention(q, q, q)
        r = torch.relu(a.view(4, 16)).clone()[rows]  # three rows gathered
        with record_function(workloads.LOSS_MARK):
            loss = F.log_softmax(r @ w2, -1).mul(2.0).sum()
        loss.backward()
        buffer.copy_(x.detach())  # a copy between dtypes
        with record_function(workloads.OPTIMIZER_MARK), torch.no_grad():
            w.add_(w.grad)

    return step


@pytest.fixture(scope="module")
def toy_profile():
    """(figures_profile, the CPU events of one profiled toy_step, their wall
    seconds, {event id: Category})."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        figures, workloads = (
            importlib.import_module(name) for name in ("figures_profile", "workloads")
        )
    step = toy_step(workloads)
    step()  # first calls out of the way
    with profile(record_shapes=True) as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    events = prof.events()
    return figures, events, wall, figures.categorize(events)


def test_profile_judges_an_op_by_its_name_its_callers_and_its_forward_op(
    toy_profile,
):
    figures, events, _, category = toy_profile

    def kinds(name, where=lambda event: True):
        found = {category[e.id].key for e in events if e.name == name and where(e)}
        assert found, f"no {name} in the trace"
        return found

    def under(name):
        return lambda event: event.cpu_parent and event.cpu_parent.name == name

    def converts(event):
        return any(c.name == "aten::_to_copy" for c in event.cpu_children)

    # By name, forward and backward; the loss's product is a product all the same.
    assert kinds("aten::mm") == {"matmul"}
    assert kinds("aten::_to_copy") == kinds("aten::to", converts) == {"casts"}
    assert kinds("aten::copy_", under("aten::_to_copy")) == {"casts"}
    assert kinds("aten::copy_", lambda e: e.cpu_parent is None) == {"casts"}
    assert kinds("aten::copy_", under("aten::clone")) == {"elementwise"}
    assert kinds("aten::relu") == kinds("aten::threshold_backward") == {"elementwise"}
    assert kinds("aten::index") == kinds("aten::_index_put_impl_") == {"gather"}
    assert kinds("aten::_log_softmax_backward_data") == {"loss"}
    assert kinds("torch::autograd::AccumulateGrad") == {"other"}
    # By caller: the marks, and a cast's caller never makes it something else.
    assert kinds("aten::add_", under(figures.OPTIMIZER_MARK)) == {"optimizer"}
    assert kinds("aten::_softmax") == {"attention"}
    assert "casts" not in kinds("aten::to", lambda e: not converts(e))
    # By forward op: attention's products, forward and backward, are attention;
    # the sum in the loss mark gives its backward to the loss.
    assert kinds("aten::bmm") == {"attention"}
    assert kinds("SumBackward0") == {"loss"}


def test_profile_counts_calls_where_a_category_is_entered_and_no_time_twice(
    toy_profile,
):
    figures, events, wall, _ = toy_profile
    result = figures.step_profile(events, wall, 1, torch.device("cpu"))
    # Forward: the linear under autocast (one call, its inner linear and mm inside)
    # and the loss's product; backward: their two MmBackward0 and linear's TBackward0.
    assert result.calls["matmul"] == 5
    assert result.calls["optimizer"] == 1  # the add_, its mark no op
    # One thread's ops' own times never overlap, so they fit in the wall time.
    assert result.seconds["python"] >= 0
    assert {row.key for row in figures.ROWS} == set(result.seconds)


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
        if key.startswith("profile_"):  # a share of the step, its ms beside it
            assert row["reference"] in line, key  # "per step" or "unprofiled"
            if row["unit"] == "%":
                assert "op calls per step" in row["note"], key
        elif row["ratio"] is not None:  # measured beside a reference: a ratio
            assert row["ref_value"] is not None and row["ratio"] > 0, key
            assert f"{row['ratio']:.2f}x" in line, key
    assert figures["pipeline"]["value"] is not None  # it ran on the stand-in
    assert (default.exists() and default.stat().st_mtime_ns) == before
