"""A training run's settings: RunConfig (the book's TrainConfig and what a long run
adds) and the named profiles the command line offers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import the_annotated_transformer as tat
from the_annotated_transformer import (
    SPECIALS,
    check_positive_int,
)
from workshop.errors import UsageError, checking_input


@dataclass
class RunConfig(tat.TrainConfig):
    """The book's TrainConfig, with what a long run adds: a profile name, bfloat16,
    checkpoints kept, logging, a time limit, and the subword vocabulary and shared
    embedding matrices of Part 4."""

    profile: str = "quick"
    bf16: bool = False
    keep_checkpoints: int = 5
    log_every: int = 50
    # Minutes: start no epoch that would end later. It guards one invocation, and is
    # no setting of the run: a resumed run counts from its own start, and trains to
    # the end unless it is given a limit of its own (run_folders.resume_config).
    time_limit: float | None = None
    vocab: str = "word"  # "word" (spaCy words) or "bpe" (joint subwords, Part 4)
    bpe_vocab_size: int = 8000
    share_embeddings: bool = False  # one matrix for both embeddings (needs "bpe")
    tie_generator: bool = False  # the generator reuses the target embedding
    # The book's make_model option: "glorot", or "normal" (embeddings drawn from
    # N(0, 1/d_model), about unit size after the sqrt(d_model) scaling); None: its
    # default, "normal" when a matrix is shared and "glorot" otherwise.
    embedding_init: str | None = None
    # Training FLOPs (workshop.flops) a new run may spend: it trains the most whole
    # epochs they pay for, and `epochs` is ignored. None: `epochs` decides.
    flop_budget: float | None = None
    # The share of the run's last optimizer steps over which the rate falls linearly
    # to 0 (the book's make_optimizer); 0: the paper's schedule to the end.
    cooldown: float = 0.0
    # The training step of workshop.fast's packed path (issue 43) on a CPU: no work
    # on padding, Q, K and V in one product, the loss from the generator's scores
    # (on a GPU, where it measured slower, the step before). False: the step as it
    # was before, every padded position computed; the same function computed
    # another way, kept so that the bench can time both.
    fast_step: bool = True

    def make_model(self, src_vocab, tgt_vocab):
        """The book's model for these settings, with Part 4's shared matrices and
        the embeddings' start that `embedding_init` names."""
        return super().make_model(
            src_vocab,
            tgt_vocab,
            share_embeddings=self.share_embeddings,
            tie_generator=self.tie_generator,
            embedding_init=self.embedding_init,
        )

    @classmethod
    def from_profile(cls, name="quick", **overrides):
        """The named profile, with some fields overridden."""
        if name not in TRAIN_PROFILES:
            raise UsageError(
                f"unknown profile {name!r}; choose one of {sorted(TRAIN_PROFILES)}."
            )
        return cls.from_dict({**TRAIN_PROFILES[name], "profile": name, **overrides})

    @classmethod
    def from_dict(cls, values):
        """Build from a dict, rejecting unknown keys with a clear message."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UsageError(
                f"unknown TrainConfig field(s) {unknown}; known: {sorted(known)}."
            )
        config = cls(**values)
        config.validate()
        return config

    def to_dict(self):
        return asdict(self)

    def validate(self):
        """Raise a UsageError that names the first setting that cannot work."""
        with checking_input():  # the book's check raises a plain ValueError
            check_positive_int(
                N=self.N,
                d_model=self.d_model,
                d_ff=self.d_ff,
                h=self.h,
                max_tokens=self.max_tokens,
                accum_iter=self.accum_iter,
                warmup=self.warmup,
                max_len=self.max_len,
                min_freq=self.min_freq,
                bpe_vocab_size=self.bpe_vocab_size,
            )
        if not isinstance(self.keep_checkpoints, int) or self.keep_checkpoints < 1:
            raise UsageError(
                "keep_checkpoints is how many epoch_NNN.pt files a run keeps and must "
                f"be a whole number of at least 1, got {self.keep_checkpoints!r}."
            )
        if self.max_len < 3:
            raise UsageError(
                f"max_len must be at least 3 (<s>, a word, </s>), got {self.max_len}."
            )
        if self.epochs < 0:
            raise UsageError(f"epochs must be >= 0, got {self.epochs}.")
        if self.time_limit is not None and not self.time_limit > 0:
            raise UsageError(
                f"time_limit is in minutes and must be > 0 (or None), got "
                f"{self.time_limit!r}."
            )
        if self.d_model % self.h:
            raise UsageError(f"d_model={self.d_model} must be divisible by h={self.h}.")
        if self.vocab not in ("word", "bpe"):
            raise UsageError(f"vocab must be 'word' or 'bpe', got {self.vocab!r}.")
        if self.bpe_vocab_size < len(SPECIALS) + 256:
            raise UsageError(
                f"bpe_vocab_size must be at least {len(SPECIALS) + 256} (the four "
                f"specials and the 256 bytes), got {self.bpe_vocab_size}."
            )
        if not (isinstance(self.cooldown, (int, float)) and 0 <= self.cooldown <= 1):
            raise UsageError(
                "cooldown is the share of the last steps over which the rate falls "
                f"to 0 and must be between 0 and 1, got {self.cooldown!r}."
            )
        if not isinstance(self.fast_step, bool):
            raise UsageError(
                f"fast_step must be True or False, got {self.fast_step!r}."
            )
        if self.embedding_init not in (None, "glorot", "normal"):
            raise UsageError(
                "embedding_init must be 'glorot', 'normal' or None (the book's "
                f"default for the tying asked for), got {self.embedding_init!r}."
            )
        if self.flop_budget is not None and not (
            isinstance(self.flop_budget, (int, float))
            and not isinstance(self.flop_budget, bool)
            and self.flop_budget > 0
        ):
            raise UsageError(
                "flop_budget counts training FLOPs and must be a number > 0 (or "
                f"None, to train `epochs` epochs), got {self.flop_budget!r}."
            )
        if self.share_embeddings and self.vocab != "bpe":
            raise UsageError(
                "share_embeddings=True needs one vocabulary for German and English: "
                "set vocab='bpe' (a joint subword vocabulary), or leave "
                "share_embeddings off."
            )


# The settings a resumed run may change: more epochs, the time limit of the new
# invocation (none unless it is given one), how many epoch checkpoints it keeps, and
# which of two ways computes its training step (the same function). Checkpoints of
# one run may differ in these alone.
RESUMABLE = ("epochs", "time_limit", "keep_checkpoints", "fast_step")


TRAIN_PROFILES = {
    "smoke": {**tat.PROFILES["smoke"], "log_every": 10},
    "quick": tat.PROFILES["quick"],  # the book's: 4 epochs on every pair
    # The README's Results: a fixed budget of training FLOPs, so that every machine
    # trains the same model: what the earlier recipe's 10 epochs cost (these layers
    # on word vocabularies, 1.3832241297408e13 FLOPs an epoch). Spent on Part 4's
    # joint subwords (8,000, one matrix for both embeddings and the generator,
    # started at unit size) it buys 8 epochs of the same layers, with no unknown
    # word and 6.0 M parameters instead of 9.2 M. Over the last 40 % of the steps the
    # rate falls linearly to 0, so the 8 epochs end settled rather than at the
    # paper's still-high rate. bfloat16 where the probe says it pays. The time limit
    # guards the first invocation on much slower machines: a run it stops says so
    # and how to continue, and `train --resume` then trains to the end.
    "multi30k": dict(
        N=3,
        d_model=256,
        d_ff=512,
        h=4,
        dropout=0.1,
        max_tokens=2000,
        warmup=400,
        vocab="bpe",
        bpe_vocab_size=8000,
        share_embeddings=True,
        tie_generator=True,
        embedding_init="normal",
        flop_budget=138_322_412_974_080,
        cooldown=0.4,
        bf16=True,
        time_limit=90,
    ),
    "base": tat.PROFILES["base"],
}
