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
