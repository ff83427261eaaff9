"""PyTorch's threads and the cores they get: the CPUs this process may run on (its affinity, not the machine's
count), the load average, `trainer.threads` (null: PyTorch's own choice or OMP_NUM_THREADS; N; auto: the cores the
load at start leaves free), and the warning, once, when the steps' rate shows the threads waiting for cores that
other processes hold — each step waits for its slowest thread, so a shared machine costs far more than its share."""
from __future__ import annotations

import os
import statistics
from typing import Any, Callable, Optional

import torch

REMEDY = "OMP_NUM_THREADS=1 accutrain …, or trainer.threads=1 (auto: as many as the load at start leaves free)"


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or taskset's share, not the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load() -> Optional[float]:
    """The 1-minute load average (runnable threads, this process's included), or None where there is none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def choose(setting: Any, cpus: int, busy: Optional[float], devices: int) -> Optional[int]:
    """trainer.threads as a count for this rank: None (leave PyTorch's), N, or auto — the cores the load leaves
    free, shared by the devices' processes, at least 1 (the value was checked: config.validate_values)."""
    if setting is None:
        return None
    share = max(1, cpus // max(1, devices))
    if setting == "auto":
        return max(1, min(share, cpus - round(busy or 0.0)))
    return int(setting)


def apply(setting: Any, devices: int) -> str:
    """Set this process's threads as trainer.threads says; the start's line: threads, available cores, load."""
    cpus, busy = available_cpus(), load()
    chosen = choose(setting, cpus, busy, devices)
    if chosen is not None:
        torch.set_num_threads(chosen)
    threads = torch.get_num_threads()
    line = (f"CPU: {threads} PyTorch thread{'s' if threads > 1 else ''} on {cpus} available core"
            f"{'s' if cpus > 1 else ''}" + (f", load {busy:.1f}" if busy is not None else "")
            + (f" (trainer.threads={setting})" if setting is not None else ""))
    if threads > cpus:
        line += f"; more threads than cores, which then wait for one another: trainer.threads={cpus} or auto"
    elif threads > 1 and busy is not None and busy >= cpus:
        line += f"; other processes keep the cores busy, and each step waits for its slowest thread: {REMEDY}"
    return line


class ThreadWatch:
    """Watches the steps' rate: warns once when it has fallen below half the run's best while the load exceeds the
    cores — the threads are starved, each step waiting for cores other processes hold. `measure` gives the load
    (injected by tests)."""

    RECENT = 5  # the steps whose median rate is compared with the best

    def __init__(self, threads: int, cpus: int, measure: Callable[[], Optional[float]] = load) -> None:
        self.threads, self.cpus, self.measure = threads, cpus, measure
        self.rates: list[float] = []
        self.best = 0.0
        self.warned = False

    def step(self, rate: float, unit: str = "samples") -> Optional[str]:
        """Record one optimizer step's rate; the warning (once) when the threads show starved, else None."""
        if self.warned or self.threads < 2:
            return None
        self.rates.append(rate)
        if len(self.rates) < 2:  # the first step holds the start-up: not a rate to compare with
            return None
        recent = statistics.median(self.rates[-self.RECENT:])
        self.best = max(self.best, recent)
        if len(self.rates) < 1 + self.RECENT or recent >= self.best / 2:
            return None
        busy = self.measure()
        if busy is None or busy <= self.cpus:
            return None
        self.warned = True
        return (f"the steps slowed to {recent:.0f} {unit}/s from {self.best:.0f}: PyTorch's {self.threads} threads "
                f"wait for cores other processes hold (load {busy:.1f} on {self.cpus} cores), each step for its "
                f"slowest thread; give it fewer: {REMEDY}")
