"""Where a run ran: for each invocation the versions of torch and Python, the commit
of the checkout (when it is a git checkout) and the machine. Checkpoints carry it
beside the precision the run trained in (workshop.run.training), and so do the
results (workshop.report.reproduce)."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import subprocess
from pathlib import Path

import torch

import the_annotated_transformer as tat


@functools.cache
def cpu_info():
    """(model name, frozenset of flags) of this machine's CPU, as /proc/cpuinfo
    gives them; where it cannot be read (not Linux), the processor's name as
    platform gives it and no flags."""
    info = {}
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        info = {k.strip(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
    name = info.get("model name") or platform.processor() or platform.machine()
    return name, frozenset(info.get("flags", "").split())


def describe_machine(device=None):
    """A short description of the device that trains: the GPU, or the CPU and cores."""
    device = torch.device(device or tat.default_device())
    if device.type == "cuda":
        return f"GPU: {torch.cuda.get_device_name(device)}"
    if device.type == "mps":
        return f"Apple MPS on {platform.machine()}, {os.cpu_count()} CPU cores"
    name, _ = cpu_info()
    return f"CPU: {name}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def source_commit():
    """{"commit": the checkout's HEAD, "uncommitted_changes": whether tracked files
    differ from it}, or None outside a git checkout."""

    def git(*args):
        folder = Path(tat.__file__).resolve().parent
        run = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True)
        return run.check_returncode() or run.stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
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
