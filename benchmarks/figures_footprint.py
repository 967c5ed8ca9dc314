"""Figures 5 and 6: what the book costs to start and to hold. Import time against
importing torch alone, the copy task's wall time (and how many seeds copy exactly),
and the peak memory of a training step against that after import.

Run as a script (`figures_footprint.py SPEC`), it is the fresh process whose memory
figure 6 reads.
"""

from __future__ import annotations

import functools
import json
import resource
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import the_annotated_transformer as tat

# isort: split
# This folder's modules (bench.py runs as a script, so benchmarks/ is on sys.path).
from settings import MAX_SENTENCE, ROOT, TRAIN_BATCH, Sizes
from table import Goal, Row
from timing import fresh_process_time, median_times
from workloads import (
    book_model,
    quick_profile,
    quick_profile_sizes,
    synthetic_batches,
    trainer,
)


def copy_task_by_seed(settings):
    """Per seed: how many of 200 held-out sequences come back exactly, and seconds."""
    copies, seconds = {}, {}
    for seed in settings.copy_seeds:
        config = tat.CopyTaskConfig(seed=seed)
        if settings.copy_epochs is not None:
            config = tat.CopyTaskConfig(epochs=settings.copy_epochs, seed=seed)
        start = time.perf_counter()
        model, _ = tat.train_copy_task(config, quiet=True, device="cpu")
        src, out = tat.copy_examples(model, config, n=200)
        seconds[seed] = time.perf_counter() - start
        copies[seed] = int((src == out).all(dim=1).sum())
        print(f"  copy task, seed {seed}: {copies[seed]}/200 exact", file=sys.stderr)
    return copies, seconds


def figure_startup(ctx):
    """Import time against importing torch alone; the copy task's wall time."""
    settings = ctx.settings
    seconds = median_times(
        {
            module: functools.partial(fresh_process_time, f"import {module}")
            for module in ("torch", "the_annotated_transformer")
        },
        settings.repeats,
        settings.warmup,
    )
    copies, copy_seconds = copy_task_by_seed(settings)
    exact = all(n == 200 for n in copies.values())
    config = tat.CopyTaskConfig()
    epochs = config.epochs if settings.copy_epochs is None else settings.copy_epochs
    seeds = f"seeds {min(copies)}-{max(copies)}" if len(copies) > 1 else "seed 0"
    return [
        Row(
            "import",
            "import the_annotated_transformer (fresh process)",
            seconds["the_annotated_transformer"],
            "s",
            "import torch",
            seconds["torch"],
            seconds["the_annotated_transformer"] / seconds["torch"],
        ),
        Row(
            "copy_task",
            f"copy task, {epochs} epochs: train + decode 200 sequences (seed 0)",
            copy_seconds[min(copies)],
            "s",
            goal=Goal("<", 60.0, on="value"),
            ok=exact,
            note=f"exact copy: {'yes' if exact else 'NO'} for every seed",
        ),
        Row(
            "copy_task_exact",
            f"copy task, {seeds}: sequences of 200 copied exactly, fewest",
            float(min(copies.values())),
            note="per seed: "
            + ", ".join(f"{seed}: {n}/200" for seed, n in copies.items()),
        ),
    ]


def max_rss_mib():
    """This process's peak resident memory so far, in MiB.

    Linux's VmHWM first: ru_maxrss survives exec, so a probe started from a process
    that had already used gigabytes would report the parent's peak.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_probe(spec):
    """Run in a fresh process: peak RSS after import, and after two training steps."""
    sizes = Sizes(**spec["sizes"])
    baseline = max_rss_mib()
    batches = synthetic_batches(1, sizes.vocab, batch_size=spec["batch_size"])
    train = trainer(book_model(sizes))
    train(batches)
    train(batches)  # the second step: the optimizer's state exists by now
    print(json.dumps({"baseline_mib": baseline, "peak_mib": max_rss_mib()}))


def measure_memory(sizes, batch_size):
    """{"baseline_mib", "peak_mib"} of a training step, from a fresh process."""
    spec = json.dumps({"sizes": asdict(sizes), "batch_size": batch_size})
    result = subprocess.run(
        [sys.executable, __file__, spec],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(result.stdout.splitlines()[-1])


def figure_memory(ctx):
    """Peak resident memory of a base-size and of a quick-profile training step."""
    max_tokens = quick_profile().max_tokens
    cases = (
        ("memory_base", ctx.settings.train_sizes, TRAIN_BATCH, "figure 1's batches"),
        (
            "memory_quick",
            quick_profile_sizes(),
            max_tokens // MAX_SENTENCE,
            f"a batch of the profile's {max_tokens}-token budget",
        ),
    )
    rows = []
    for key, sizes, batch_size, batch_text in cases:
        rss = measure_memory(sizes, batch_size)
        rows.append(
            Row(
                key,
                f"peak resident memory, training step, {sizes.label}",
                rss["peak_mib"],
                "MiB",
                "after import",
                rss["baseline_mib"],
                rss["peak_mib"] / rss["baseline_mib"],
                note=(
                    f"{rss['peak_mib'] - rss['baseline_mib']:,.0f} MiB over the "
                    f"baseline; {batch_size} sentences <= {MAX_SENTENCE} tokens "
                    f"({batch_text}), vocabularies {sizes.vocab}, Adam"
                ),
            )
        )
    return rows


if __name__ == "__main__":
    memory_probe(json.loads(sys.argv[1]))
