"""Every random number a run draws starts from its `seed`: the global generators at start, and derived seeds for
the streams that must not depend on anything else (an epoch's order, a generated sample); and
`trainer.deterministic`, which makes CUDA's algorithms repeat themselves."""
from __future__ import annotations

import hashlib
import os
import random
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch

STREAMS = 1_000_003  # a prime: seed × STREAMS + offset gives every (seed, offset) its own stream


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (the initial weights, dropout)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def derived_seed(seed: int, offset: int) -> int:
    """The seed of stream `offset` of a run seeded `seed` (an epoch's permutation, a synthetic sample, …), modulo
    2**64: torch takes a seed modulo 2**64 itself (a negative one included), so every seed it accepts has its streams
    and the streams of the seeds that fitted before are unchanged."""
    return (seed * STREAMS + offset) % 2**64


def generator(seed: int, offset: int) -> torch.Generator:
    """A CPU generator for stream `offset` of a run seeded `seed`."""
    return torch.Generator().manual_seed(derived_seed(seed, offset))


def keyed_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed that depends on (seed, *keys) only: the stream of one sample's view in one epoch, one window's
    mixing draws. Hashed, so that no two keys share a stream (derived_seed's sums could)."""
    digest = hashlib.blake2b(repr((seed, *keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@contextmanager
def seeded_cpu_rng(seed: int) -> Iterator[None]:
    """Inside the block torch's global CPU generator starts from `seed` (what torchvision's random transforms draw
    from); on leaving it is back where it was, so the run's other draws (dropout, say) never see the block. CUDA's
    generators are left alone."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


CUBLAS_WORKSPACE = ":4096:8"  # what deterministic cuBLAS needs (CUDA >= 10.2); read when cuBLAS first starts


@contextmanager
def deterministic_algorithms(on: bool) -> Iterator[None]:
    """trainer.deterministic: inside the block cuDNN picks deterministic algorithms and does not autotune, and an
    operation with no deterministic implementation warns when it runs (use_deterministic_algorithms(True,
    warn_only=True)); CUBLAS_WORKSPACE_CONFIG is set unless the user set it, before anything runs on CUDA, and
    child processes inherit it. Everything comes back on leaving. Off: nothing changes."""
    if not on:
        yield
        return
    cudnn = torch.backends.cudnn
    saved = (cudnn.deterministic, cudnn.benchmark, torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    cudnn.deterministic, cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        cudnn.deterministic, cudnn.benchmark = saved[0], saved[1]
        torch.use_deterministic_algorithms(saved[2], warn_only=saved[3])
        if saved[4] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
