"""What every benchmark records with its figures: the machine it ran on and how many runs the
reported medians are over, so that numbers from two machines are never compared as if alike
(docs/benchmarks.md)."""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from typing import Callable, Sequence


def machine() -> dict:
    """Cores the process may use, total memory, CPU model and Python."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {"cores": cores, "python": platform.python_version(), "platform": platform.platform()}
    try:
        with open("/proc/meminfo") as fh:
            info["memory_gb"] = round(int(fh.readline().split()[1]) / 1024 ** 2, 1)
        with open("/proc/cpuinfo") as fh:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")
    except OSError:  # not Linux: cores and Python are enough to tell machines apart
        pass
    return info


def pss_gb(pids: Sequence[int]) -> float:
    """Proportional set size of these processes together, in GB: a page shared by k processes
    counts 1/k in each, so memory shared copy-on-write is counted once (summed RSS counts it in
    every process that touched it). 0 where /proc/<pid>/smaps_rollup is not available."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as fh:
                total += next((int(line.split()[1]) for line in fh if line.startswith("Pss:")), 0)
        except OSError:
            pass
    return total / 1024 ** 2


def summary(values: Sequence[float]) -> dict:
    """Median, minimum, maximum and all values of repeated runs."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


class Progress:
    """One line per step to stderr, at most every ``every`` seconds (and always the last)."""

    def __init__(self, label: str, total: int, every: float = 5.0, out=sys.stderr):
        self.label, self.total, self.every, self.out = label, total, every, out
        self.started = self._last = time.perf_counter()

    def step(self, done: int, note: Callable[[], str] | str = "") -> None:
        now = time.perf_counter()
        if done < self.total and now - self._last < self.every:
            return
        self._last = now
        text = note() if callable(note) else note
        print(f"  {self.label}: {done:,}/{self.total:,} ({now - self.started:.0f} s){' ' + text if text else ''}", file=self.out, flush=True)
