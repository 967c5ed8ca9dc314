"""bfloat16 around the book's model and loss, where the hardware makes it pay: a
measured probe (bf16_matmul_speedup), Autocast around the model and
AutocastLossCompute around the generator and the criterion."""

from __future__ import annotations

import time

import torch
from torch import nn

from the_annotated_transformer import (
    SimpleLossCompute,
)


def bf16_matmul_speedup(device="cpu", tokens=512, d_model=256, repeats=2):
    """Time of a float32 matrix product over that of a bfloat16 one on `device`.

    The product has a feed-forward layer's shape: (tokens, d_model) @ (d_model,
    2 * d_model), 134 million operations at the defaults.
    """
    device = torch.device(device)
    a = torch.randn(tokens, d_model, device=device)
    b = torch.randn(d_model, 2 * d_model, device=device)

    def fastest(x, y):
        times = []
        for _ in range(repeats + 1):  # the first call also pays one-time set-up
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            x @ y
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return min(times[1:])

    return fastest(a, b) / fastest(a.bfloat16(), b.bfloat16())


def bf16_pays(device):
    """(whether bfloat16 autocast pays on `device`, the reason in words). A GPU says
    whether it has bfloat16 hardware; on a CPU one matrix product is timed (a GPU's
    would time its launch, a few microseconds, not its arithmetic); MPS trains in
    float32."""
    device = torch.device(device)
    if device.type == "cuda":
        has = torch.cuda.is_bf16_supported()
        return has, f"this GPU {'has' if has else 'lacks'} bfloat16 hardware"
    if device.type == "mps":  # the project trains there in float32 alone
        return False, "runs on Apple's MPS train in float32"
    speedup = bf16_matmul_speedup(device)
    return speedup >= 1.0, (
        f"bfloat16 matrix products run at {speedup:.2f}x the float32 speed on this "
        f"{device.type.upper()}"
    )


def amp_dtype_for(bf16, device, say=print, distributed=False):
    """torch.bfloat16 if bf16 autocast is asked for and pays on `device`, else None.
    Under several processes, every one trains in float32 unless all of them pay."""
    if not bf16:
        return None
    device = torch.device(device)
    paying, reason = bf16_pays(device)
    pays = torch.tensor(float(paying))
    if distributed:  # every process must train in the same precision
        pays = pays.to(device)
        torch.distributed.all_reduce(pays, op=torch.distributed.ReduceOp.MIN)
    if bool(pays.item()):
        say(f"bfloat16 autocast: {reason}.")
        return torch.bfloat16
    if paying:
        reason = "another process's device does not gain from bfloat16"
    say(f"--bf16 ignored: {reason}, so this run trains in float32.")
    return None


class Autocast(nn.Module):
    """The wrapped model, its forward pass run under torch.autocast to `dtype`
    (bfloat16 by default) on the device of the model's parameters. It holds no
    weights of its own: train and save the wrapped model."""

    def __init__(self, model, dtype=torch.bfloat16):
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, *args, **kwargs):
        device_type = next(self.model.parameters()).device.type
        with torch.autocast(device_type, dtype=self.dtype):
            return self.model(*args, **kwargs)


class AutocastLossCompute(SimpleLossCompute):
    """The book's SimpleLossCompute with the generator and the criterion run under
    torch.autocast to `dtype`, as Autocast runs the model: in training (__call__)
    and in evaluation (nll)."""

    def __init__(self, generator, criterion, dtype=torch.bfloat16):
        super().__init__(generator, criterion)
        self.dtype = dtype

    def autocast(self, x):
        return torch.autocast(x.device.type, dtype=self.dtype)

    def __call__(self, x, y, norm):
        with self.autocast(x):
            return super().__call__(x, y, norm)

    def nll(self, x, y):
        with self.autocast(x):
            return super().nll(x, y)


def use_tf32(device, say=print):
    """On a GPU with TF32 units (Ampere and later), let float32 matrix products use
    them, as most GPU training does: about 8x the float32 speed with a 10-bit
    mantissa for the products' inputs. Returns whether it did."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    torch.set_float32_matmul_precision("high")
    say("float32 matrix products use this GPU's TF32 units")
    return True
