"""The benchmark's helpers: the benchmark measures, these tests check the helpers it
measures with (benchmarks/bench.py is a script, so it is loaded from its path)."""

import importlib.util
import sys
from pathlib import Path

import torch

import the_annotated_transformer as tat

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = bench  # its dataclasses look their module up by name
    spec.loader.exec_module(bench)
    return bench


def test_time_decoding_steps_through_the_cache_it_is_given():
    bench = load_bench()
    torch.manual_seed(3)
    model = tat.make_model(13, 13, N=2, d_model=32, d_ff=64, h=4).eval()
    src = torch.randint(3, 13, (5, 7))
    src_mask = torch.ones(5, 1, 7, dtype=torch.bool)
    with torch.no_grad():
        memory = model.encode(src, src_mask)
    cache = tat.KVCache(model)
    bench.time_decoding(model, memory, src_mask, 5, cache)
    assert cache.length == 5  # one position per generated token, all through it


def test_trainer_in_bf16_trains_the_model_and_its_loss_under_autocast():
    bench = load_bench()
    sizes = bench.Sizes(N=1, d_model=32, d_ff=64, h=4, vocab=50)
    model = sizes.make_model(seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    seen = []  # inside the model (a feed-forward layer) and in the loss (generator)
    for layer in (model.encoder.layers[0].feed_forward.w_1, model.generator.proj):
        layer.register_forward_hook(lambda module, inputs, out: seen.append(out.dtype))
    batches = bench.synthetic_batches(2, sizes.vocab, batch_size=4)
    loss = bench.trainer(model, torch.bfloat16)(batches)
    assert seen == [torch.bfloat16] * 4  # two batches, two layers each
    assert torch.isfinite(torch.tensor(loss))
    after = list(model.parameters())
    assert all(p.dtype == torch.float32 for p in after)
    assert any(not torch.equal(p, q) for p, q in zip(after, before, strict=True))
