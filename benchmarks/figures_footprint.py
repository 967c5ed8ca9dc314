"""Figures 5 and 6: what the book costs to start and to hold. Import time against
importing torch alone (host work, whatever the device), and so the time of
`python -m workshop --help` and `train --help` (they parse before they import
torch), the copy task's wall time on the bench's device (and how many seeds copy
exactly), and the peak memory of a training step: resident memory against that
after import on the CPU, GPU memory allocated against the model's and the batch's
on a GPU.

Run as a script (`figures_footprint.py SPEC`), it is the fresh process whose memory
figure 6 reads.
"""

from __future__ import annotations

import functools
import json
import resource
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import torch

import the_annotated_transformer as tat

# isort: split
# This folder's modules (bench.py runs as a script, so benchmarks/ is on sys.path).
from bench_settings import MAX_SENTENCE, ROOT, TRAIN_BATCH, Sizes
from table import Goal, Row
from timing import fresh_process_time, fresh_python_time, median_times, timed_call
from workloads import (
    book_model,
    book_model_step,
    quick_profile,
    quick_profile_sizes,
    synthetic_batches,
    trainer,
)


def copy_task_by_seed(settings, device):
    """Per seed: how many of 200 held-out sequences come back exactly, and seconds
    (training on `device` and decoding there)."""
    copies, seconds = {}, {}
    for seed in settings.copy_seeds:
        config = tat.CopyTaskConfig(seed=seed)
        if settings.copy_epochs is not None:
            config = tat.CopyTaskConfig(epochs=settings.copy_epochs, seed=seed)

        def train_and_copy(config=config):
            model, _ = tat.train_copy_task(config, quiet=True, device=device)
            return tat.copy_examples(model, config, n=200)

        (src, out), seconds[seed] = timed_call(train_and_copy, device)
        copies[seed] = int((src == out).all(dim=1).sum())
        print(f"  copy task, seed {seed}: {copies[seed]}/200 exact", file=sys.stderr)
    return copies, seconds


def figure_startup(ctx):
    """Import time against importing torch alone; the copy task's wall time."""
    settings = ctx.settings
    seconds = median_times(
        {
            **{
                module: functools.partial(fresh_process_time, f"import {module}")
                for module in ("torch", "the_annotated_transformer")
            },
            "help": functools.partial(fresh_python_time, "-m", "workshop", "--help"),
            # A command's help too: train's lists the profiles (once, via torch).
            "train_help": functools.partial(
                fresh_python_time, "-m", "workshop", "train", "--help"
            ),
        },
        settings.repeats,
        settings.warmup,
    )
    copies, copy_seconds = copy_task_by_seed(settings, ctx.device)
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
            "cli_help",
            "python -m workshop --help and train --help (fresh process), the slower",
            max(seconds["help"], seconds["train_help"]),
            "s",
            "import torch",
            seconds["torch"],
            max(seconds["help"], seconds["train_help"]) / seconds["torch"],
            goal=Goal("<", 1.0, on="value"),
            note=f"--help {seconds['help']:.3f} s, train --help "
            f"{seconds['train_help']:.3f} s",
        ),
        Row(
            "copy_task",
            f"copy task, {epochs} epochs: train + decode 200 sequences (seed 0)",
            copy_seconds[min(copies)],
            "s",
            goal=Goal("<", 60.0, on="value"),
            ok=exact,
            note=f"every seed copied all 200 exactly: {'yes' if exact else 'NO'}",
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


MEMORY = {  # device type -> (what figure 6 measures, its reference)
    "cpu": ("peak resident memory", "after import"),
    "cuda": ("peak GPU memory allocated", "model and batch"),
}


def memory_probe(spec):
    """Run in a fresh process: the baseline, and the peak after two training steps.
    On the CPU, resident memory (the baseline: after import); on a GPU, the memory
    allocated there (the baseline: the model's and the batch's)."""
    sizes, device = Sizes(**spec["sizes"]), torch.device(spec["device"])
    baseline = max_rss_mib()
    batches = synthetic_batches(1, sizes.vocab, spec["batch_size"], device=device)
    model = book_model(sizes, device=device)
    gpu = device.type == "cuda"
    if gpu:
        baseline = torch.cuda.memory_allocated(device) / 2**20
    train = trainer(model, **book_model_step())
    train(batches)
    train(batches)  # the second step: the optimizer's state exists by now
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if gpu else max_rss_mib()
    print(json.dumps({"baseline_mib": baseline, "peak_mib": peak}))


def measure_memory(sizes, batch_size, device):
    """{"baseline_mib", "peak_mib"} of a training step on `device`, from a fresh
    process."""
    spec = dict(sizes=asdict(sizes), batch_size=batch_size, device=str(device))
    result = subprocess.run(
        [sys.executable, __file__, json.dumps(spec)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(result.stdout.splitlines()[-1])


def figure_memory(ctx):
    """Peak memory (MEMORY) of a base-size and of a quick-profile training step."""
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
    measured, reference = MEMORY[ctx.device.type]
    rows = []
    for key, sizes, batch_size, batch_text in cases:
        memory = measure_memory(sizes, batch_size, ctx.device)
        rows.append(
            Row(
                key,
                f"{measured}, training step, {sizes.label}",
                memory["peak_mib"],
                "MiB",
                reference,
                memory["baseline_mib"],
                memory["peak_mib"] / memory["baseline_mib"],
                note=(
                    f"{memory['peak_mib'] - memory['baseline_mib']:,.0f} MiB over the "
                    f"baseline; {batch_size} sentences <= {MAX_SENTENCE} tokens "
                    f"({batch_text}), vocabularies {sizes.vocab}, Adam"
                ),
            )
        )
    return rows


if __name__ == "__main__":
    memory_probe(json.loads(sys.argv[1]))
