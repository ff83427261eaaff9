"""Checkpoints: written atomically at optimizer-step boundaries, loaded with weights_only=True."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """Write to a temporary file beside `path`, fsync it, then rename: a crash leaves the old file intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load(path: Path) -> dict[str, Any]:
    """Load a checkpoint without ever executing pickled code."""
    return torch.load(path, map_location="cpu", weights_only=True)
