"""Performance figures of the book's examples, printed as a table (never a test).

Run with `make bench` (or `PYTHONPATH=. .venv/bin/python benchmarks/bench.py`).
Every figure of issue #6 is a ratio against a reference measured in this same run
on this same machine, after a warm-up, as the median of several repeats: the
machines are shared and absolute times drift. The table says which machine it came from.

    benchmarks/bench.py                      every figure (several minutes on 2 cores)
    benchmarks/bench.py --quick              a smoke run: small sizes, one repeat
    benchmarks/bench.py --only decoding,beam selected figures (names: see --help)
    benchmarks/bench.py --json out.json      where to write the figures as JSON
    benchmarks/bench.py --device cuda:1      where to measure: cpu, cuda or cuda:N
                                             (default: cuda if there is one, else cpu)

Every figure measures on the one device: models and batches are made there (or moved
there once) before anything is timed, and every clock waits for the device's queued
work. On a GPU the bf16 figures run where it has bfloat16 hardware, the matrix-multiply
peak is the GPU's, and the memory figure reports GPU memory allocated instead of
resident memory; the import figure is host work on any device.

A full run writes benchmarks/results.json; a `--quick` or `--only` run writes JSON
only when `--json` is given, so it never overwrites the full figures. `--quick`
checks that every figure runs (under half a minute on 2 cores); its numbers are not
figures to quote.

The figures live beside this file, one module a job: bench_settings.py (sizes and
how much work), timing.py (the timing harness and the machine), workloads.py
(models, data, training and decoding; every workshop/ import), table.py (rows and
goals), and figures_training.py, figures_decoding.py, figures_footprint.py and
figures_profile.py (where a training step's time goes, from torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

import the_annotated_transformer as tat

# isort: split
# This folder's modules (bench.py runs as a script, so benchmarks/ is on sys.path).
from bench_settings import QUICK, Settings
from figures_decoding import figure_batching, figure_beam, figure_decoding
from figures_footprint import figure_memory, figure_startup
from figures_profile import figure_profile
from figures_training import (
    Context,
    figure_bf16,
    figure_mfu,
    figure_pipeline,
    figure_training,
)
from table import print_table
from timing import has_amx_bf16, machine
from workloads import parse_device

DEFAULT_JSON = "benchmarks/results.json"

FIGURES = {
    "training": figure_training,
    "bf16": figure_bf16,
    "mfu": figure_mfu,
    "pipeline": figure_pipeline,
    "decoding": figure_decoding,
    "batching": figure_batching,
    "beam": figure_beam,
    "startup": figure_startup,
    "memory": figure_memory,
    "profile": figure_profile,
}
FIGURE_NEEDS = {  # the training variants each figure reads from Context.training
    "training": ("ours fp32", "nn.Transformer fp32"),
    "bf16": ("ours fp32", "ours bf16"),
    "mfu": ("ours fp32", "ours bf16"),
}


def bench_device(parser, text):
    """--device as a torch.device (None: tat.default_device()), with a CUDA index;
    exits with one line on stderr when this machine does not have it."""
    try:
        device = tat.default_device() if text is None else parse_device(text)
        if device.type == "mps":  # its clocks would not wait for queued work
            raise ValueError("the bench measures on cpu, cuda or cuda:N, not mps")
    except ValueError as problem:  # the workshop's check, as for train --device
        parser.exit(2, f"{parser.prog}: error: argument --device: {problem}\n")
    if device.type == "cuda":
        return torch.device("cuda", device.index or 0)
    return device


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument(
        "--only", help=f"comma-separated figures to run, of: {', '.join(FIGURES)}"
    )
    parser.add_argument(
        "--json",
        help=f"write the figures here (default for a full run: {DEFAULT_JSON})",
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=tat.data_dir_from_env(),
        help=f"the Multi30k folder (default: ${tat.DATA_ENV})",
    )
    parser.add_argument(
        "--device", help="cpu, cuda or cuda:N (default: cuda if there is one, else cpu)"
    )
    args = parser.parse_args(argv)
    args.device = bench_device(parser, args.device)
    names = args.only.split(",") if args.only else list(FIGURES)
    unknown = [name for name in names if name not in FIGURES]
    if unknown:
        parser.error(f"unknown figure(s) {unknown}; choose from {list(FIGURES)}")
    args.names = names
    return args


def main(argv=None):
    args = parse_args(argv)
    settings = QUICK if args.quick else Settings()
    variants = tuple(
        dict.fromkeys(v for name in args.names for v in FIGURE_NEEDS.get(name, ()))
    )
    if args.device.type == "cuda":  # the current device, which the Timer waits for
        torch.cuda.set_device(args.device)
    ctx = Context(settings, args.data, variants, args.device)
    print(f"machine: {machine(args.device)}", flush=True)
    if args.quick:
        print(
            "--quick: a smoke run (smaller sizes, one repeat); not figures to quote",
            flush=True,
        )
    rows = []
    for name in args.names:
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        rows.extend(FIGURES[name](ctx))
    print_table(rows)
    full = not args.quick and args.only is None
    path = args.json or (DEFAULT_JSON if full else None)
    if path:
        results = {
            "machine": machine(args.device),
            "device": str(args.device),
            "amx_bf16": has_amx_bf16(),
            "settings": asdict(settings) | {"quick": args.quick},
            "figures": {row.key: row.to_json() for row in rows},
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
