"""Every random number a run draws starts from its `seed`: the global generators at start, and derived seeds for
the streams that must not depend on anything else (an epoch's order, a generated sample)."""
from __future__ import annotations

import random

import numpy as np
import torch

STREAMS = 1_000_003  # a prime: seed × STREAMS + offset gives every (seed, offset) its own stream


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (the initial weights, dropout)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def derived_seed(seed: int, offset: int) -> int:
    """The seed of stream `offset` of a run seeded `seed` (an epoch's permutation, a synthetic sample, …)."""
    return seed * STREAMS + offset


def generator(seed: int, offset: int) -> torch.Generator:
    """A CPU generator for stream `offset` of a run seeded `seed`."""
    return torch.Generator().manual_seed(derived_seed(seed, offset))
