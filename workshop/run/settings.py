"""A training run's settings: RunConfig (the book's TrainConfig and what a long run
adds) and the named profiles the command line offers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import the_annotated_transformer as tat
from the_annotated_transformer import SPECIALS, check_positive_int
from workshop.errors import UsageError, checking_input


@dataclass
class RunConfig(tat.TrainConfig):
    """The book's TrainConfig, with what a long run adds: a profile name, its
    precision, checkpoints kept, logging, a time limit, and the subword vocabulary
    and shared embedding matrices of Part 4."""

    profile: str = "quick"
    # "fp32", "bf16" (bfloat16 autocast), or "auto": bf16 where the hardware reports
    # bfloat16 arithmetic (workshop.run.precision), fp32 elsewhere.
    precision: str = "auto"
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
    # Training FLOPs (workshop.run.flops) a new run may spend: it trains the most
    # whole epochs they pay for, and `epochs` is ignored. None: `epochs` decides.
    flop_budget: float | None = None
    # The share of the run's last optimizer steps over which the rate falls linearly
    # to 0 (the book's make_optimizer); 0: the paper's schedule to the end.
    cooldown: float = 0.0

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
            raise UsageError(f"unknown profile {name!r}: {sorted(TRAIN_PROFILES)}")
        return cls.from_dict({**TRAIN_PROFILES[name], "profile": name, **overrides})

    @classmethod
    def from_dict(cls, values):
        """Build from a dict (a checkpoint's, or a profile's), rejecting unknown
        keys with a clear message. The settings of older checkpoints are read as
        today's: `bf16` (bfloat16 where it paid) as precision "auto" or "fp32", and
        `fast_step` (another way to compute the same step) is dropped."""
        values = {k: v for k, v in values.items() if k != "fast_step"}
        if "bf16" in values:
            values["precision"] = "auto" if values.pop("bf16") else "fp32"
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UsageError(f"unknown settings {unknown}; known: {sorted(known)}.")
        config = cls(**values)
        config.validate()
        return config

    def to_dict(self):
        return asdict(self)

    def validate(self):
        """Raise a UsageError that names the first setting that cannot work."""
        with checking_input():  # the book's checks raise plain ValueErrors
            layers = (self.N, self.d_model, self.d_ff, self.h, self.dropout)
            model = dict(share_embeddings=False, embedding_init=self.embedding_init)
            tat.check_sizes(1, 1, *layers, max_len=self.max_len, **model)
            check_positive_int(**{name: getattr(self, name) for name in POSITIVE})
        least, budget, cool = len(SPECIALS) + 256, self.flop_budget, self.cooldown
        number = (int, float)  # a bool is none
        rules = {
            "max_len": (self.max_len >= 3, "at least 3 (<s>, a word, </s>)"),
            "epochs": (self.epochs >= 0, ">= 0"),
            "time_limit": (
                self.time_limit is None or self.time_limit > 0,
                "minutes > 0",
            ),
            "precision": (
                self.precision in PRECISION_SETTINGS,
                "'fp32', 'bf16' or 'auto'",
            ),
            "vocab": (self.vocab in ("word", "bpe"), "'word' or 'bpe'"),
            "bpe_vocab_size": (self.bpe_vocab_size >= least, f"at least {least}"),
            "cooldown": (type(cool) in number and 0 <= cool <= 1, "from 0 to 1"),
            "flop_budget": (
                budget is None or (type(budget) in number and budget > 0),
                "a number of training FLOPs > 0 (or None)",
            ),
            "share_embeddings": (
                not self.share_embeddings or self.vocab == "bpe",
                "False unless vocab='bpe' (one vocabulary for both languages)",
            ),
        }
        for name, (ok, rule) in rules.items():
            if not ok:
                raise UsageError(f"{name} must be {rule}, got {getattr(self, name)!r}.")


# The settings that must be whole numbers of at least 1, besides the model's sizes
# (the book's check_sizes).
POSITIVE = ("max_tokens", "accum_iter", "warmup", "min_freq", "bpe_vocab_size")
POSITIVE += ("keep_checkpoints", "log_every")

PRECISION_SETTINGS = ("fp32", "bf16", "auto")  # "auto": bf16 where the hardware has it

# The settings a resumed run may change: more epochs, the time limit of the new
# invocation (none unless it is given one) and how many epoch checkpoints it keeps.
# Checkpoints of one run may differ in these alone.
RESUMABLE = ("epochs", "time_limit", "keep_checkpoints")


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
    # paper's still-high rate. bfloat16 where the hardware reports it. The time limit
    # guards the first invocation on much slower machines: a run it stops says so
    # and how to continue, and `train --resume` then trains to the end.
    "multi30k": {
        **dict(N=3, d_model=256, d_ff=512, h=4, dropout=0.1),  # the layers
        **dict(vocab="bpe", bpe_vocab_size=8000, embedding_init="normal"),
        **dict(share_embeddings=True, tie_generator=True),  # one matrix, three uses
        **dict(max_tokens=2000, warmup=400, cooldown=0.4, precision="auto"),
        **dict(flop_budget=138_322_412_974_080, time_limit=90),
    },
    "base": tat.PROFILES["base"],
}
