"""python -m benchmarks [--smoke] [--device cpu|cuda|cuda:N] [--data DIR] [--json F]:
the machine, then every goal row, measured (see benchmarks/__init__.py)."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

import the_annotated_transformer as tat
from benchmarks.decoding import decoding_rows, peer_rows
from benchmarks.harness import SMOKE, Settings, machine_lines
from benchmarks.training import training_pairs, training_rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.splitlines()[1]
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes: every row in seconds"
    )
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if any)")
    parser.add_argument(
        "--data",
        type=Path,
        default=tat.data_dir_from_env(),
        help=f"the Multi30k folder (default: ${tat.DATA_ENV}; none: synthetic pairs)",
    )
    parser.add_argument("--json", type=Path, help="also write the rows here as JSON")
    args = parser.parse_args(argv)
    if args.data is not None and not (args.data / "train.de.gz").is_file():
        parser.error(
            f"--data {args.data}: no train.de.gz there; point --data or "
            f"${tat.DATA_ENV} at the Multi30k folder (`make data` fetches it)"
        )
    try:
        args.device = torch.device(args.device or tat.default_device())
    except RuntimeError:
        parser.error(f"--device {args.device!r}: use cpu, cuda or cuda:N")
    if args.device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: the bench measures on cpu or cuda")
    if args.device.type == "cuda":
        count = torch.cuda.device_count()
        if (args.device.index or 0) >= count:
            parser.error(f"--device {args.device}: this machine has {count} CUDA GPUs")
        args.device = torch.device("cuda", args.device.index or 0)
        torch.cuda.set_device(args.device)  # the device the Timer waits for
    return args


def main(argv=None):
    args = parse_args(argv)
    settings = SMOKE if args.smoke else Settings()
    lines = machine_lines(args.device)
    print("\n".join(lines), flush=True)
    if args.smoke:
        print("--smoke: tiny sizes, one short round; not figures to quote", flush=True)
    pairs, vocab, source = training_pairs(settings, args.data)
    rows = []
    for row in itertools.chain(
        training_rows(settings, args.device, pairs, vocab, source),
        decoding_rows(settings, args.device, pairs, vocab),
        peer_rows(settings, args.device, pairs),
    ):
        print(row.text(), flush=True)
        rows.append(row)
    if args.json:
        results = {"machine": lines, "rows": [row.to_json() for row in rows]}
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
