"""Performance figures of the book's examples, printed as a table (never a test).

Run with `make bench` (or `.venv/bin/python benchmarks/bench.py`). Every figure is
measured in this run on this machine; the table says which machine that was.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def machine():
    """A one-line description of this machine."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )


def bench_import(repeats=5):
    """Median wall time of `import the_annotated_transformer` in a fresh process."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", "import the_annotated_transformer"],
            cwd=ROOT,
            check=True,
        )
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_copy_task():
    """Wall time of the copy task (train + decode), and whether it copied exactly."""
    import the_annotated_transformer as tat

    start = time.perf_counter()
    model, _ = tat.train_copy_task(quiet=True, device="cpu")
    src, out = tat.copy_examples(model, n=200)
    return time.perf_counter() - start, bool((src == out).all())


def bench_cached_decoding(batch, steps=40, vocab=8000, repeats=1):
    """Greedy decoding of `steps` tokens at base sizes, without and with the cache."""
    import torch

    import the_annotated_transformer as tat

    torch.manual_seed(0)
    model = tat.make_model(vocab, vocab).eval()  # N=6, d_model=512, h=8, d_ff=2048
    src = torch.randint(4, vocab, (batch, 20))
    src_mask = torch.ones(batch, 1, 20, dtype=torch.bool)
    with torch.no_grad():
        memory = model.encode(src, src_mask)
    tat.time_decoding(model, memory, src_mask, 2, use_cache=True)  # warm-up
    times = {}
    for use_cache in (False, True):
        times[use_cache] = statistics.median(
            tat.time_decoding(model, memory, src_mask, steps, use_cache)
            for _ in range(repeats)
        )
    return times[False], times[True]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="benchmarks/results.json")
    args = parser.parse_args(argv)
    rows = {"machine": machine()}
    rows["import_s"] = bench_import()
    rows["copy_task_s"], rows["copy_task_exact"] = bench_copy_task()
    for batch in (1, 64):
        plain, cached = bench_cached_decoding(batch, repeats=3 if batch == 1 else 1)
        rows[f"greedy40_batch{batch}_no_cache_s"] = plain
        rows[f"greedy40_batch{batch}_cache_s"] = cached
    print(f"machine: {rows['machine']}")
    print(f"{'figure':44s} value")
    print(f"{'import the_annotated_transformer (median)':44s} {rows['import_s']:.2f} s")
    print(
        f"{'copy task: train + decode 200 sequences':44s} {rows['copy_task_s']:.1f} s"
        f" (exact copy: {'yes' if rows['copy_task_exact'] else 'no'})"
    )
    for batch in (1, 64):
        plain = rows[f"greedy40_batch{batch}_no_cache_s"]
        cached = rows[f"greedy40_batch{batch}_cache_s"]
        print(
            f"{f'greedy, 40 tokens, base sizes, batch {batch}':44s} "
            f"{plain:.2f} s without cache, {cached:.2f} s with "
            f"({plain / cached:.1f}x)"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
