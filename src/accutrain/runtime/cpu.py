"""A rank's process readied for its CPU work, before the data and the model are made: glibc's allocator tuned
(trainer.tune_malloc, on the CPU) and PyTorch's threads set (trainer.threads); the lines that say so."""
from __future__ import annotations

import torch

from accutrain.config.train import TrainerConfig
from accutrain.runtime.malloc import tune_malloc
from accutrain.train import threads


def prepare(trainer: TrainerConfig, device: torch.device, devices: int) -> list[str]:
    """Tune and set this process (every rank's); the lines for rank 0's log: malloc's, and on the CPU (or with
    trainer.threads set) the threads, the cores available and the load."""
    lines = [tune_malloc()] if device.type == "cpu" and trainer.tune_malloc else []
    line = threads.apply(trainer.threads, devices)
    return lines + ([line] if device.type == "cpu" or trainer.threads is not None else [])
