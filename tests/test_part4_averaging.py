"""Part 4's checkpoint averaging: `average` sets a model to the element-wise mean of
others. Tiny random models, no data. The workshop's averaging of checkpoint files is
tested in tests/test_workshop_checkpoints.py and tests/test_workshop_cli.py."""

import copy

import pytest
import torch
from torch import nn

import the_annotated_transformer as tat


def small_model(seed, N=1):
    torch.manual_seed(seed)
    return tat.make_model(7, 9, N=N, d_model=16, d_ff=32, h=2)


def test_average_of_copies_is_the_model_and_of_two_models_their_mean():
    original = small_model(0)
    averaged = tat.average(small_model(1), [copy.deepcopy(original) for _ in range(3)])
    for name, tensor in original.state_dict().items():
        assert torch.equal(averaged.state_dict()[name], tensor), name
    a, b = small_model(1).state_dict(), small_model(2).state_dict()
    mean = tat.average(small_model(3), [small_model(1), b]).state_dict()  # or dicts
    # average adds in float64, where the sum of two float32 numbers is exact (their
    # exponents lie within 29 bits), halves exactly and rounds once to float32; here
    # float32 rounds the sum once and halves exactly: the same rounding, bit for bit.
    for name in a:
        assert torch.equal(mean[name], (a[name] + b[name]) / 2), name


def test_average_copies_integer_buffers_from_the_first_model():
    norms = [nn.BatchNorm1d(3) for _ in range(3)]
    for i, norm in enumerate(norms[:2]):
        norm.running_mean.fill_(float(i + 1))  # 1 and 2
        norm.num_batches_tracked.fill_(10 * (i + 1))  # 10 and 20
    averaged = tat.average(norms[2], norms[:2])
    assert torch.equal(averaged.running_mean, torch.full((3,), 1.5))
    assert averaged.num_batches_tracked.dtype == torch.long
    assert int(averaged.num_batches_tracked) == 10


@pytest.mark.parametrize(
    "models, error", [([], "at least one"), ([0, 1], "one architecture")]
)
def test_average_refuses_no_models_and_models_of_different_architectures(models, error):
    models = [small_model(seed, N=1 + seed) for seed in models]
    with pytest.raises(ValueError, match=error):
        tat.average(small_model(0), models)
