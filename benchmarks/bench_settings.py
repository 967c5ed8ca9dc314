"""The benchmark's settings: model sizes (Sizes), how much work each figure does
(Settings, and QUICK for `--quick`), and the batch shapes issue #6 names. A
training run's settings are workshop/settings.py's, not these."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository

MAX_SENTENCE = 24  # issue #6: ragged sentences of up to 24 tokens
TRAIN_BATCH = 32  # sentences per synthetic training batch
ORIGINAL_BATCH, ORIGINAL_PADDING = 32, 72  # the 2018 notebook's Multi30k recipe
TRANSLATE_BATCH = 64  # Translator.translate's default batch_size
NEVER = -1  # an end symbol no token id equals: decoding runs to max_len


@dataclass(frozen=True)
class Sizes:
    """Model sizes; the vocabulary is used for both source and target."""

    N: int
    d_model: int
    d_ff: int
    h: int
    vocab: int = 8000

    @property
    def label(self):
        return f"N={self.N} d_model={self.d_model} h={self.h} d_ff={self.d_ff}"


BASE = Sizes(N=6, d_model=512, d_ff=2048, h=8)
SMALL = Sizes(N=2, d_model=256, d_ff=1024, h=4)  # --quick's stand-in for BASE


@dataclass(frozen=True)
class Settings:
    """How much work each figure does; `--quick` swaps in QUICK."""

    repeats: int = 3  # timed rounds per measurement (the median is reported)
    warmup: int = 1  # untimed rounds before them (work of seconds)
    min_run_time: float = 0.5  # seconds of calls in a round of short work
    train_sizes: Sizes = BASE  # figures 1, 3 and 6
    train_batches: int = 1  # batches in one timed training repeat
    loss_steps: int = 100  # figure 1's bf16 loss check; mean over the last 10
    pipeline_batches: int = 50
    decode_sizes: Sizes = BASE  # figure 4's cache comparison
    decode_tokens: int = 40
    sentences: int = 1000  # figure 4: translated batched ...
    one_at_a_time: int = 100  # ... and this many one at a time (extrapolated)
    mm_size: int = 2048  # side of the square matrices of the matmul peak on a CPU
    # ... and on a GPU, where 2048^2 leaves most of the chip idle: an H100 or H200
    # reaches its bf16 peak only near 8192^2
    gpu_mm_size: int = 8192
    copy_epochs: int | None = None  # None: the copy task's own schedule
    copy_seeds: tuple = tuple(range(10))  # each trained, then 200 sequences decoded


# A smoke run: every figure's code runs, at sizes too small to quote.
QUICK = Settings(
    repeats=1,
    min_run_time=0.05,
    train_sizes=SMALL,
    loss_steps=12,
    pipeline_batches=3,
    decode_sizes=SMALL,
    decode_tokens=10,
    sentences=64,
    one_at_a_time=2,
    mm_size=1024,
    gpu_mm_size=1024,
    copy_epochs=2,
    copy_seeds=(0,),
)
