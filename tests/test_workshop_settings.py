"""A run's settings (workshop.run.settings): profiles, overrides and their checks,
word and subword vocabularies."""

import dataclasses

import pytest
import torch

import the_annotated_transformer as tat
from workshop.errors import DataError
from workshop.run import checkpoints, settings

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

NEW_FIELDS = ("vocab", "bpe_vocab_size", "share_embeddings", "tie_generator")


# ---------------------------------------------------------------------------
# Training configuration


def test_from_profile_applies_overrides_over_the_profile():
    config = settings.RunConfig.from_profile("smoke", epochs=3, max_train_pairs=300)
    assert (config.profile, config.N, config.d_model) == ("smoke", 1, 32)
    assert (config.epochs, config.max_train_pairs) == (3, 300)
    assert settings.RunConfig.from_dict(config.to_dict()) == config


def test_base_profile_is_the_papers_base_model():
    """The paper's Table 3, row "base" (and section 5.4 for the two rates): the
    profile must not drift from the published model it is named for."""
    config = settings.RunConfig.from_profile("base")
    assert (config.N, config.d_model, config.d_ff, config.h) == (6, 512, 2048, 8)
    assert config.dropout == 0.1 and config.label_smoothing == 0.1


def test_the_books_profile_names_mean_the_same_settings_in_a_run():
    """The workshop's profiles are the book's plus what a long run adds (logging):
    `train --profile quick` trains what the notebook's quick profile trains."""
    assert set(tat.PROFILES) <= set(settings.TRAIN_PROFILES)
    assert settings.TRAIN_PROFILES["smoke"] == {
        **tat.PROFILES["smoke"],
        "log_every": 10,
    }
    for name in ("quick", "base"):
        assert settings.TRAIN_PROFILES[name] == tat.PROFILES[name], name
    quick = settings.RunConfig.from_profile("quick")
    assert (quick.epochs, quick.max_train_pairs) == (4, None)
    book = {f.name for f in dataclasses.fields(tat.TrainConfig)}
    run = quick.to_dict()
    assert {k: run[k] for k in book} == dataclasses.asdict(
        tat.TrainConfig(**tat.PROFILES["quick"])
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"d_model": 30, "h": 4}, "divisible"),
        ({"d_model": 33, "h": 3}, "positional encoding needs it even"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
        ({"max_len": 2}, "max_len"),
        ({"epochs": -1}, "epochs"),
        ({"dimension": 3}, "dimension"),
        ({"time_limit": 0}, "time_limit must be minutes > 0"),
        ({"precision": "fp16"}, "precision must be 'fp32', 'bf16' or 'auto'"),
    ],
)
def test_train_config_rejects_bad_settings_with_a_clear_message(overrides, message):
    with pytest.raises(ValueError, match=message):
        settings.RunConfig.from_profile("smoke", **overrides)


def test_from_profile_rejects_an_unknown_profile_listing_the_known_ones():
    with pytest.raises(ValueError, match="smoke"):
        settings.RunConfig.from_profile("huge")


@pytest.mark.parametrize("init", [None, "glorot", "normal"])
@pytest.mark.parametrize("shared", [False, True])
def test_a_runs_model_is_the_books_make_model_with_its_embedding_start(shared, init):
    """RunConfig hands embedding_init to the book's make_model (None: the book's
    default for the tying asked for): the same draws give the same weights."""
    vocab = "bpe" if shared else "word"
    tying = dict(share_embeddings=shared, tie_generator=shared)
    config = settings.RunConfig.from_profile(
        "smoke", vocab=vocab, embedding_init=init, **tying
    )
    torch.manual_seed(0)
    ours = config.make_model(300, 300).state_dict()
    torch.manual_seed(0)
    books = tat.make_model(300, 300, **tat.TINY, **tying, embedding_init=init)
    assert list(ours) == list(books.state_dict())
    for name, weight in books.state_dict().items():
        assert torch.equal(ours[name], weight), name


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"share_embeddings": True}, "vocab='bpe'"),
        ({"vocab": "chars"}, "'word' or 'bpe'"),
        ({"vocab": "bpe", "bpe_vocab_size": 100}, "at least 260"),
        ({"bpe_vocab_size": 0}, "bpe_vocab_size"),
        ({"embedding_init": "xavier"}, "embedding_init must be 'glorot' or 'normal'"),
        ({"cooldown": 1.5}, "cooldown must be from 0 to 1"),
    ],
)
def test_train_config_rejects_bad_subword_settings_with_a_clear_message(
    overrides, message
):
    with pytest.raises(ValueError, match=message):
        settings.RunConfig.from_profile("smoke", **overrides)


def test_a_word_vocabulary_may_still_tie_the_generator_to_the_target_embedding():
    config = settings.RunConfig.from_profile("smoke", tie_generator=True)
    model = config.make_model(11, 13)
    target = model.tgt_embed[0].lut.weight
    assert model.generator.proj.weight is target  # one matrix, not a copy
    assert model.src_embed[0].lut.weight is not target  # the vocabularies differ
    assert target.shape == (13, config.d_model)
    untied = settings.RunConfig.from_profile("smoke").make_model(11, 13)
    assert untied.generator.proj.weight is not untied.tgt_embed[0].lut.weight


def old_style_config():
    """A config dict as saved before the subword fields existed."""
    values = settings.RunConfig.from_profile("smoke").to_dict()
    for name in NEW_FIELDS:
        del values[name]
    return values


@pytest.mark.parametrize(
    "older, precision",
    [({"bf16": True}, "auto"), ({"bf16": False}, "fp32"), ({}, "auto")],
)
def test_the_settings_of_older_runs_read_as_todays(older, precision):
    """An older run's `bf16` (bfloat16 where it paid) reads as precision "auto", or
    "fp32"; its `fast_step` (a way to compute the same step) is dropped."""
    values = settings.RunConfig.from_profile("smoke").to_dict()
    del values["precision"]
    config = settings.RunConfig.from_dict(values | older | {"fast_step": False})
    assert config == settings.RunConfig.from_profile("smoke", precision=precision)
    assert "bf16" not in config.to_dict() and "fast_step" not in config.to_dict()


def test_the_multi30k_profile_lets_the_hardware_choose_its_precision():
    assert settings.RunConfig.from_profile("multi30k").precision == "auto"
    assert settings.RunConfig().precision == "auto"


def test_old_config_dicts_without_the_subword_fields_load_with_the_defaults():
    config = settings.RunConfig.from_dict(old_style_config())
    assert config == settings.RunConfig.from_profile("smoke")
    assert config.vocab == "word" and not config.share_embeddings


def test_an_old_style_word_checkpoint_still_rebuilds_its_model(tmp_path):
    itos = [*tat.SPECIALS, "a", "dog"]
    torch.manual_seed(0)
    model = tat.make_model(len(itos), len(itos), N=1, d_model=32, d_ff=64, h=2)
    path = tmp_path / "old.pt"
    checkpoints.save_checkpoint(
        path,
        {
            "model": checkpoints.without_positional_tables(model.state_dict()),
            "config": old_style_config(),
            "epoch": 0,
            "vocab_src": itos,
            "vocab_tgt": itos,
        },
    )
    rebuilt, vocab_src, vocab_tgt, config = checkpoints.model_from_checkpoint(
        checkpoints.load_checkpoint(path)
    )
    assert isinstance(vocab_src, tat.Vocab) and vocab_src.get_itos() == itos
    assert vocab_tgt is not vocab_src and config.vocab == "word"
    projection = rebuilt.generator.proj.weight
    assert torch.equal(projection, model.generator.proj.weight)
    assert projection.data_ptr() != rebuilt.tgt_embed[0].lut.weight.data_ptr()


def saved_smoke_model(path, seed=0):
    """A smoke-profile model saved as training saves it: without the `*.pe` tables."""
    config = settings.RunConfig.from_profile("smoke")
    itos = [*tat.SPECIALS, "a", "dog", "runs", "."]
    torch.manual_seed(seed)
    model = config.make_model(len(itos), len(itos)).eval()
    weights = checkpoints.without_positional_tables(model.state_dict())
    checkpoint = {"model": weights, "config": config.to_dict(), "epoch": 0}
    checkpoints.save_checkpoint(
        path, checkpoint | {"vocab_src": itos, "vocab_tgt": itos}
    )
    return model


def test_a_checkpoint_without_positional_tables_gives_the_saving_models_outputs(
    tmp_path,
):
    model = saved_smoke_model(tmp_path / "epoch_001.pt")
    checkpoint = checkpoints.load_checkpoint(tmp_path / "epoch_001.pt")
    tables = [k for k in model.state_dict() if k.endswith(".pe")]
    assert tables and not any(k.endswith(".pe") for k in checkpoint["model"])
    rebuilt, *_ = checkpoints.model_from_checkpoint(checkpoint)
    src = torch.tensor([[0, 4, 5, 6, 1], [0, 7, 1, 2, 2]])
    tgt = torch.tensor([[0, 5, 4], [0, 6, 2]])
    masks = tat.padding_mask(src, tat.PAD), tat.subsequent_mask(3)
    with torch.no_grad():  # the same weights and the same arithmetic: equal bits
        want = model.generator(model(src, tgt, *masks))
        got = rebuilt.generator(rebuilt(src, tgt, *masks))
    assert torch.equal(got, want)
    for name in tables:  # the tables were filled from the rebuilt model itself
        assert torch.equal(rebuilt.state_dict()[name], model.state_dict()[name])


@pytest.mark.parametrize("change", ["drop a weight", "add a weight"])
def test_filling_the_positional_tables_leaves_loading_strict(tmp_path, change):
    saved_smoke_model(tmp_path / "epoch_001.pt")
    checkpoint = checkpoints.load_checkpoint(tmp_path / "epoch_001.pt")
    if change == "drop a weight":
        del checkpoint["model"]["generator.proj.bias"]
    else:
        checkpoint["model"]["generator.extra"] = torch.zeros(3)
    with pytest.raises(DataError, match="do not fit"):
        checkpoints.model_from_checkpoint(checkpoint)


def test_a_bpe_checkpoint_without_its_vocabulary_raises_data_error():
    config = settings.RunConfig.from_profile("smoke", vocab="bpe").to_dict()
    with pytest.raises(DataError, match="'bpe'"):
        checkpoints.vocabs_from_checkpoint(
            {"config": config, "vocab_src": [], "model": {}}
        )
