"""Memory on the device: peak measurement (CUDA's allocator, or the process's resident set on the CPU) and
out-of-memory errors. Gradient buffers are in accutrain.core.grad_buffers, activation checkpointing in
accutrain.models.checkpointing, `micro_batch=auto` in accutrain.train.auto_batch."""
from __future__ import annotations

import gc
import mmap
import os
import re
import resource
from typing import Optional

import torch


class _PeakRSS:
    """The process's peak resident set since the last reset (Linux): the reset writes "5" to /proc/self/clear_refs
    through a descriptor kept open; the peak is getrusage's ru_maxrss where this kernel resets it too (checked once),
    else VmHWM read from a kept-open /proc/self/status. A few µs per optimizer step instead of opening files."""

    PROBE = 32 * 2**20  # the check's short-lived peak

    def __init__(self) -> None:
        self.clear_refs: Optional[int] = None
        self.status: Optional[int] = None
        self.rusage_follows: Optional[bool] = None  # known at the first reading (the kernel's, kept across a fork)
        self.open()

    def open(self) -> None:
        """Open this process's files; again in a forked child (a worker forked from accutrain.runtime.launch's fork server),
        whose inherited descriptors name its parent's: /proc/self is resolved when a file is opened."""
        for fd in (self.clear_refs, self.status):
            if fd is not None:
                os.close(fd)
        self.clear_refs = self._open("/proc/self/clear_refs", os.O_WRONLY)
        self.status = self._open("/proc/self/status", os.O_RDONLY)

    @staticmethod
    def _open(path: str, flags: int) -> Optional[int]:
        try:
            return os.open(path, flags | os.O_CLOEXEC)
        except OSError:
            return None

    def reset(self) -> bool:
        """Start a new peak at the current resident set; False where that cannot be done."""
        try:
            return self.clear_refs is not None and os.write(self.clear_refs, b"5") == 1
        except OSError:
            return False

    def _vm_hwm_kib(self) -> Optional[int]:
        if self.status is None:
            return None
        found = re.search(rb"VmHWM:\s+(\d+) kB", os.pread(self.status, 4096, 0))
        return int(found.group(1)) if found else None

    def _rusage_follows(self) -> bool:
        """Whether ru_maxrss drops with a reset, as VmHWM does (Linux ≥ 4.0 resets both; some kernels only VmHWM):
        a short-lived peak above the current RSS, a reset, then both compared (within the kernel's per-CPU slack)."""
        probe = mmap.mmap(-1, self.PROBE)
        probe.write(bytes(self.PROBE))
        probe.close()
        hwm = self._vm_hwm_kib() if self.reset() else None
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return hwm is not None and abs(maxrss - hwm) < self.PROBE // 2**10 // 4

    def mb(self) -> float:
        if self.rusage_follows is None:
            peak = self._vm_hwm_kib()  # this window's, before the check resets it
            self.rusage_follows = self._rusage_follows()
        else:
            peak = None if self.rusage_follows else self._vm_hwm_kib()
        return (peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


_PEAK_RSS = _PeakRSS()
os.register_at_fork(after_in_child=_PEAK_RSS.open)


def reset_peak(device: torch.device) -> None:
    """Start a new peak: CUDA's max-allocated counter (host-side, no synchronisation), or the process's peak RSS."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _PEAK_RSS.reset()


def peak_mb(device: torch.device) -> float:
    """MiB at the peak since reset_peak: CUDA max allocated on a GPU, the process's peak RSS on the CPU."""
    if device.type == "cuda":  # max_memory_allocated flattens ~160 statistics into a sorted dict (151 µs on an H100)
        return torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]["peak"] / 2**20
    return _PEAK_RSS.mb()


_PROCESS_PEAK = {"mb": 0.0}  # the highest peak read before a reset_peak started a new one (fold_peak)


def fold_peak(device: torch.device) -> float:
    """Keep the peak since the last reset_peak in the process's peak (before anything resets it: the loop's
    evaluations and checkpoints, which the next window's reset would hide); the process's peak so far, in MiB."""
    _PROCESS_PEAK["mb"] = max(_PROCESS_PEAK["mb"], peak_mb(device))
    return _PROCESS_PEAK["mb"]


def is_oom(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator failing."""
    text = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text))


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
