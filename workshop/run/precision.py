"""A run's precision: float32 throughout, or bfloat16 autocast around the book's
model and generator. The `precision` setting asks for "fp32", "bf16" or "auto":
bfloat16 where the hardware reports bfloat16 arithmetic (a GPU that supports it, a
CPU with the avx512_bf16 or amx_bf16 instructions), float32 elsewhere."""

from __future__ import annotations

import torch
from torch import nn

from workshop.errors import DataError
from workshop.run.provenance import cpu_info

# The precision a run trains in, by the name checkpoints and results record, and
# the autocast dtype it means (None: none, float32 throughout).
PRECISIONS = {"float32": None, "bfloat16": torch.bfloat16}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo's names for them


def hardware_bf16(device):
    """(whether `device` reports bfloat16 arithmetic, the reason in words)."""
    device = torch.device(device)
    if device.type == "cuda":
        has = torch.cuda.is_bf16_supported()
        return has, f"this GPU {'has' if has else 'lacks'} bfloat16 arithmetic"
    if device.type == "mps":  # the project trains there in float32 alone
        return False, "runs on Apple's MPS train in float32"
    flags = [flag for flag in BF16_FLAGS if flag in cpu_info()[1]]
    if flags:
        return True, f"this CPU has the {' and '.join(flags)} instructions"
    return False, f"this CPU reports neither the {' nor the '.join(BF16_FLAGS)} flag"


def run_precision(setting, device, say=print, distributed=False, recorded=None):
    """The name of the precision a run trains in, said in one line with why: a
    resumed run's `recorded` one (a run never switches), else what `setting` asks
    for ("auto": hardware_bf16's answer; MPS: float32). Several processes train
    in one precision: "auto" gives bfloat16 only where every one's device has it."""
    if recorded is not None:
        if recorded not in PRECISIONS:
            raise DataError(f"last.pt records the precision {recorded!r}: unknown.")
        say(f"precision: {recorded}, as this run began (a resumed run keeps it)")
        return recorded
    use, reason = setting == "bf16", f"--precision {setting}"
    if setting == "auto" or torch.device(device).type == "mps":
        use, why = hardware_bf16(device)
        reason = f"auto: {why}" if setting == "auto" else why
    if distributed:  # every process must train in the same precision
        vote = torch.tensor(float(use), device=device)
        torch.distributed.all_reduce(vote, op=torch.distributed.ReduceOp.MIN)
        if use and not vote.item():
            use, reason = False, "auto: another process's device lacks bfloat16"
    name = "bfloat16" if use else "float32"
    say(f"precision: {name} ({reason})")
    return name


class Autocast(nn.Module):
    """The wrapped module, its forward pass run under torch.autocast to `dtype`
    (bfloat16 by default) on the device of its parameters (the book's loss and
    NLL add their sums in float32). It holds no weights of its own: train and save
    the wrapped module."""

    def __init__(self, model, dtype=torch.bfloat16):
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, *args):
        device_type = next(self.model.parameters()).device.type
        with torch.autocast(device_type, dtype=self.dtype):
            return self.model(*args)


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
