"""`trainer.tune_malloc`: glibc's allocator tuned for CPU training.

By default glibc returns a freed block of more than 128 KiB to the OS (munmap, or trimming the heap's top), so with
accumulation every micro-batch's activations are faulted in again page by page — tens of thousands of minor page
faults per optimizer step on a resnet18. Raising both the mmap and the trim thresholds keeps those blocks in the
heap for the next micro-batch. Setting either alone is worse than neither: any of them switches glibc's dynamic
mmap threshold off. Where the blocks live changes no result (the weights are bit-identical); the price is that the
process keeps its peak resident memory until it exits.
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc's malloc.h)
THRESHOLD = 1 << 30  # 1 GiB: blocks up to this size come from, and go back to, the heap
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def glibc_version() -> Optional[str]:
    """glibc's version where this process runs on it (not musl, not macOS), else None."""
    try:
        found = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None
    return found.split()[-1] if found and found.startswith("glibc") else None


def tune_malloc() -> str:
    """Raise glibc's mmap and trim thresholds to 1 GiB in this process (its forked loader workers inherit them); the
    message to log says what was done (a short first line, then the detail), or why nothing was: not glibc, or the
    user's own MALLOC_*_ / GLIBC_TUNABLES malloc settings, which are left alone."""
    version = glibc_version()
    if version is None:
        return "trainer.tune_malloc: the C library is not glibc; its allocator is left as it is"
    own = [name for name in USER_SETTINGS if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        own.append("GLIBC_TUNABLES")
    if own:
        return f"trainer.tune_malloc: {', '.join(own)} set in the environment; glibc's allocator is left to them"
    libc = ctypes.CDLL(None)
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, THRESHOLD) == 1):
        return f"trainer.tune_malloc: glibc {version} refused the thresholds; its allocator is left as it is"
    return (f"glibc {version} malloc tuned for training on the CPU (trainer.tune_malloc)\n"
            "mmap and trim thresholds raised to 1 GiB, so freed activations stay in the heap for the next "
            "micro-batch (trainer.tune_malloc=false keeps glibc's defaults)")


def release_heap() -> None:
    """Give the heap's free memory back to the OS (glibc's malloc_trim) once training is over: tune_malloc kept it for
    a next micro-batch that will not come, and the final evaluation, export and plot would add to it. Nothing where
    the C library is not glibc."""
    if glibc_version() is not None:
        ctypes.CDLL(None).malloc_trim(0)
