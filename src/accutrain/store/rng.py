"""Every random state a checkpoint holds (Python's, NumPy's, torch's CPU and CUDA generators), taken and restored, so
that a resumed run draws what the uninterrupted one would have drawn."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Every RNG this process draws from, as plain values (bytes, ints, lists): picklable across ranks and
    loadable with weights_only=True."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return dict(
        python=random.getstate(),
        numpy=[kind, keys.tolist(), pos, has_gauss, gauss],
        torch=torch.get_rng_state().numpy().tobytes(),
        cuda=[s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    )


def _byte_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuples(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(_byte_tensor(state["torch"]))
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([_byte_tensor(s) for s in state["cuda"]])


def _as_tuples(value: Any) -> Any:
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
