"""How the benchmark times things, and a line that says which machine timed them.

Every figure is a ratio of two times taken in the same run on this machine: the
machines are shared and absolute times drift. On a GPU the work is queued, so a
stopwatch waits for the device before it starts and before it stops
(torch.utils.benchmark's Timer does the same for the current device).
"""

from __future__ import annotations

import functools
import os
import statistics
import subprocess
import sys
import time

import torch
from torch.utils import benchmark

# isort: split
# This folder's modules (bench.py runs as a script, so benchmarks/ is on sys.path).
from bench_settings import ROOT
from workloads import cpu_info

CPU = torch.device("cpu")


def synchronize(device):
    """Wait for the work queued on `device` (a CUDA device; on the CPU: nothing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn, device=CPU):
    """(fn(), its wall seconds), the work it queued on `device` included."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def median_times(fns, repeats, warmup=0, min_run_time=None, device=CPU):
    """Median seconds of one call of each function in the dict `fns`.

    Each of `repeats` rounds times every function once, so drift in the machine's
    speed hits them all alike; `warmup` untimed rounds come first. With
    `min_run_time` (short work: a matrix product, a decoding run), a round times a
    function with torch.utils.benchmark's blocked_autorange: an untimed call sizes
    its blocks, then blocks of calls run for `min_run_time` seconds. Without (work of
    seconds: a training pass, a fresh process), a round times one call, as that
    untimed call would double the cost. Work queued on `device` counts (the Timer
    waits for the current CUDA device, which bench.py sets to `--device`).
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if min_run_time is None:
                times[name].append(timed_call(fn, device)[1])
            else:
                timer = benchmark.Timer(
                    "fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
                )
                times[name] += timer.blocked_autorange(min_run_time=min_run_time).times
    return {name: statistics.median(t) for name, t in times.items()}


def fresh_process_time(code):
    """Seconds to run `python -c code` in a new process from the project root."""
    return fresh_python_time("-c", code)


def fresh_python_time(*args):
    """Seconds to run `python ARGS` in a new process from the project root (what it
    prints is not shown)."""
    command = [sys.executable, *args]
    run = functools.partial(
        subprocess.run, command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL
    )
    return timed_call(run)[1]


def has_amx_bf16():
    """Whether this CPU has AMX bfloat16 matrix instructions (`amx_bf16`)."""
    return "amx_bf16" in cpu_info()[1]


def machine(device=CPU):
    """A one-line description of this machine, and of the GPU `device` if CUDA."""
    name, _ = cpu_info()
    gpu = f"GPU {torch.cuda.get_device_name(device)}, " if device.type == "cuda" else ""
    return (
        f"{gpu}{name}, {os.cpu_count()} cores, amx_bf16: "
        f"{'yes' if has_amx_bf16() else 'no'}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
