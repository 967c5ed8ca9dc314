"""A run's settings (workshop.run.settings): profiles and overrides, the check that
names the first setting that cannot work, the model they make, and the settings of
older runs."""

import pytest
import torch

import the_annotated_transformer as tat
from workshop.run.settings import RunConfig

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_a_profile_takes_overrides_and_comes_back_whole_from_its_dict():
    config = RunConfig.from_profile("smoke", epochs=3, max_train_pairs=300)
    assert (config.profile, config.N, config.epochs) == ("smoke", 1, 3)
    assert RunConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"d_model": 30, "h": 4}, "divisible"),
        ({"d_model": 33, "h": 3}, "positional encoding needs it even"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
        ({"max_len": 2}, "max_len must be at least 3"),
        ({"epochs": -1}, "epochs must be >= 0"),
        ({"log_every": 0}, "log_every"),
        ({"dimension": 3}, r"unknown settings \['dimension'\]"),
        ({"time_limit": 0}, "time_limit must be minutes > 0"),
        ({"precision": "fp16"}, "precision must be 'fp32', 'bf16' or 'auto'"),
        ({"share_embeddings": True}, "False unless vocab='bpe'"),
        ({"vocab": "chars"}, "vocab must be 'word' or 'bpe'"),
        ({"vocab": "bpe", "bpe_vocab_size": 100}, "bpe_vocab_size must be at least"),
        ({"embedding_init": "xavier"}, "embedding_init must be 'glorot' or 'normal'"),
        ({"cooldown": 1.5}, "cooldown must be from 0 to 1"),
        *[({"flop_budget": b}, "flop_budget must be a number") for b in (0, "1", True)],
    ],
)
def test_a_setting_that_cannot_work_is_named_in_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as error:
        RunConfig.from_profile("smoke", **overrides)
    assert "\n" not in str(error.value)


def test_an_unknown_profile_is_refused_listing_the_known_ones():
    with pytest.raises(ValueError, match="'huge'.*'smoke'"):
        RunConfig.from_profile("huge")


SHARED = {"share_embeddings": True, "tie_generator": True}


@pytest.mark.parametrize(
    "tying, init", [({}, "normal"), ({"tie_generator": True}, None), (SHARED, None)]
)
def test_a_runs_model_is_the_books_with_its_tying_and_embedding_start(tying, init):
    """The same draws give the same weights: RunConfig hands the book's make_model
    the matrices to share and embedding_init (None: the book's default for them)."""
    vocab = "bpe" if tying.get("share_embeddings") else "word"
    config = RunConfig.from_profile("smoke", vocab=vocab, embedding_init=init, **tying)
    torch.manual_seed(0)
    ours = config.make_model(300, 300).state_dict()
    torch.manual_seed(0)
    book = tat.make_model(300, 300, **tat.TINY, **tying, embedding_init=init)
    assert ours.keys() == book.state_dict().keys()
    assert all(torch.equal(ours[name], w) for name, w in book.state_dict().items())


@pytest.mark.parametrize(
    "older, precision",
    [({"bf16": True}, "auto"), ({"bf16": False}, "fp32"), ({}, "auto")],
)
def test_the_settings_of_older_runs_read_as_todays(older, precision):
    """An older run's `bf16` (bfloat16 where it paid) reads as precision "auto" or
    "fp32", its `fast_step` (another way to compute the same step) is dropped, and
    the settings it predates take their defaults."""
    values = RunConfig.from_profile("smoke").to_dict()
    for name in ("precision", "vocab", "bpe_vocab_size", "share_embeddings"):
        del values[name]
    config = RunConfig.from_dict(values | older | {"fast_step": False})
    assert config == RunConfig.from_profile("smoke", precision=precision)
