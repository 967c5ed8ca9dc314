"""What a run actually did, and where: the precision it trained in (the profile
only asks for one), and for each invocation the versions of torch and Python, the
commit of the checkout (when it is a git checkout) and the machine. Checkpoints
carry it (workshop.training), and so do the results (workshop.reproduce)."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import subprocess
from pathlib import Path

import torch

import the_annotated_transformer as tat

# The precision a run trains in, by name as checkpoints and results record it, and
# the autocast dtype it means (None: none, float32 throughout).
PRECISIONS = {"float32": None, "bfloat16": torch.bfloat16}


def precision_name(amp_dtype):
    """The recorded name of a run's autocast dtype (None: "float32")."""
    return {dtype: name for name, dtype in PRECISIONS.items()}[amp_dtype]


@functools.cache
def cpu_info():
    """(model name, frozenset of flags) of this machine's first CPU, as /proc/cpuinfo
    gives them; where it cannot be read (not Linux), the processor's name as
    platform gives it and no flags. The benchmark's machine line uses it too."""
    name, flags = platform.processor() or platform.machine(), frozenset()
    named = False
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not named:
                name, named = value.strip(), True
            elif key.strip() == "flags":
                flags = frozenset(value.split())
                break
    return name, flags


def describe_machine(device=None):
    """A short description of the device that trains: the GPU, or the CPU and cores."""
    device = torch.device(device or tat.default_device())
    if device.type == "cuda":
        return f"GPU: {torch.cuda.get_device_name(device)}"
    if device.type == "mps":
        return f"Apple MPS on {platform.machine()}, {os.cpu_count()} CPU cores"
    name, _ = cpu_info()
    return f"CPU: {name}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def _git(*args):
    """The output of `git ARGS` in the book's folder, or None (no git, no checkout)."""
    try:
        result = subprocess.run(
            ["git", *args],
            cwd=Path(tat.__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def source_commit():
    """{"commit": the checkout's HEAD, "uncommitted_changes": whether tracked files
    differ from it}, or None outside a git checkout."""
    commit = _git("rev-parse", "HEAD")
    if not commit:
        return None
    changed = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "uncommitted_changes": bool(changed)}


def invocation(device, first_epoch):
    """What this invocation of a run trains with, from epoch `first_epoch` (1-based)
    on: versions, commit, machine and device."""
    source = source_commit() or {"commit": None, "uncommitted_changes": None}
    return {
        "first_epoch": first_epoch,
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        **source,
        "machine": describe_machine(device),
        "device": str(device),
    }
