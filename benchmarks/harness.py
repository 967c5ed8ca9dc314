"""What every row shares: how much work a run does (Settings, SMOKE), the machine it
runs on (machine_lines, from the workshop's cpu_info and hardware_bf16), the one
timing harness
(median_seconds) and the rows it prints (Row)."""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass

import torch
from torch.utils import benchmark

import the_annotated_transformer as tat
from workshop.run.precision import hardware_bf16 as native_bf16
from workshop.run.provenance import cpu_info


@dataclass(frozen=True)
class Settings:
    """How much work each row does; `--smoke` swaps in SMOKE."""

    smoke: bool = False  # tiny sizes: every row runs, no figure to quote
    rounds: int = 3  # timing rounds; each times every function of a row in turn
    min_run_time: float = 1.0  # seconds of calls per function and round
    step_batches: int = 4  # token-budget batches a timed call of the multi30k step
    base_batches: int = 2  # ... and of the base-size step (about 8 times the work)
    train_pairs: int | None = None  # Multi30k pairs read (None: all 29,000)
    vocab: int | None = None  # joint subwords (None: the multi30k profile's)
    max_tokens: int | None = None  # a batch's padded ids (None: the profile's)
    sizes: dict | None = None  # every model's sizes (None: the profile's, base)
    decode_steps: int = 40  # tokens decoded after <s>
    peer_sentences: int | None = None  # the peer rows' (None: 1,000 GPU, 64 CPU)
    mm_side: int | None = None  # the matmul peak's side (None: 2048 CPU, 8192 GPU)


SMOKE = Settings(
    smoke=True,
    rounds=1,
    min_run_time=0.01,
    step_batches=2,
    base_batches=1,
    train_pairs=300,
    vocab=300,
    max_tokens=200,
    sizes=tat.TINY,
    decode_steps=4,
    peer_sentences=8,
    mm_side=64,
)


def machine_lines(device):
    """What the rows were measured on: CPU (and GPU), bf16 support, torch, threads."""
    gpu = f"GPU {torch.cuda.get_device_name(device)}; " if device.type == "cuda" else ""
    has, why = native_bf16(device)
    return [
        f"machine: {gpu}CPU {cpu_info()[0]}, {os.cpu_count()} cores",
        f"native bf16: {'yes' if has else 'no'} ({why})",
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, on {device}",
    ]


def median_seconds(fns, settings):
    """Median seconds of one call of each function in the dict `fns`.

    Each of settings.rounds rounds times every function in turn, so that drift in
    the machine's speed hits them alike, with torch.utils.benchmark's
    blocked_autorange: it calls the function untimed first (to size its blocks of
    calls, which is also a warm-up), then times blocks for settings.min_run_time
    seconds. On a GPU the Timer waits for the current device's queued work.
    """
    times = {name: [] for name in fns}
    for _ in range(settings.rounds):
        for name, fn in fns.items():
            timer = benchmark.Timer(
                "fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
            )
            times[name] += timer.blocked_autorange(
                min_run_time=settings.min_run_time
            ).times
    return {name: statistics.median(t) for name, t in times.items()}


@dataclass
class Row:
    """One goal row: what it measures, its value, the goal `value op limit`, the
    numbers it comes from, and, where the goal is not judged here, why."""

    name: str
    value: float | None  # None: not measured here
    op: str  # ">=" or "<="
    limit: float | None  # None: no goal on this machine
    unit: str  # "x" (a ratio), "%" (a share) or "" (a fraction)
    detail: str = ""
    why: str = ""  # why it was not measured, or why no goal applies here

    def shown(self, x):
        return f"{x:.1f}%" if self.unit == "%" else f"{x:.2f}{self.unit}"

    @property
    def met(self):
        """Whether the goal is met (None: not judged here)."""
        if self.value is None or self.limit is None or self.why:
            return None
        return self.value >= self.limit if self.op == ">=" else self.value <= self.limit

    @property
    def verdict(self):
        if self.value is None:
            return f"skipped: {self.why}"
        if self.met is None:
            return f"no goal here: {self.why}"
        return "met" if self.met else "NOT met"

    def text(self):
        value = "-" if self.value is None else self.shown(self.value)
        goal = (
            "" if self.limit is None else f"goal {self.op} {self.shown(self.limit)}: "
        )
        lines = [f"{self.name:64s} {value:>7s}  {goal}{self.verdict}"]
        return "\n".join(lines + [f"    {self.detail}"] * bool(self.detail))

    def to_json(self):
        return asdict(self) | {"met": self.met, "verdict": self.verdict}
