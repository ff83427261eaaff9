"""`trainer.ema`: an exponential moving average of the weights, moved once per optimizer step taken (never per
micro-batch, never on a skipped step), evaluated beside the raw weights and kept in checkpoints.

    ema ← decay · ema + (1 − decay) · weights

As timm's ModelEmaV3 does, floating-point buffers (BatchNorm's running statistics) are averaged too and integer
ones (num_batches_tracked) copied. The average is float32 when the weights are half precision (a bf16 average
would round every small update away), and lives beside the weights or in CPU memory (`trainer.ema_device=cpu`).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import nn


class EMA:
    def __init__(self, model: nn.Module, decay: float, warmup: bool = False,
                 device: Optional[torch.device] = None) -> None:
        self.decay, self.warmup, self.updates = decay, warmup, 0
        self.weights = {key: value.detach().to(device or value.device, _average_dtype(value), copy=True)
                        for key, value in model.state_dict().items()}

    def current_decay(self) -> float:
        """The decay of the next update: with warm-up, min(decay, (1 + n) / (10 + n)) after n updates."""
        return min(self.decay, (1 + self.updates) / (10 + self.updates)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the average towards the model's current weights: call once per optimizer step taken."""
        weight = 1.0 - self.current_decay()
        for key, value in model.state_dict().items():
            average = self.weights[key]
            if average.is_floating_point():
                average.lerp_(value.to(average.device, average.dtype, non_blocking=True), weight)
            else:
                average.copy_(value)
        self.updates += 1

    @contextmanager
    def swapped_in(self, model: nn.Module) -> Iterator[None]:
        """The model holds the averaged weights inside the block (for evaluation), its own ones again after."""
        own = {key: value.detach().to("cpu", copy=True) for key, value in model.state_dict().items()}
        model.load_state_dict(self.weights)
        try:
            yield
        finally:
            model.load_state_dict(own)

    def state_dict(self) -> dict[str, Any]:
        return dict(decay=self.decay, updates=self.updates,
                    weights={key: value.detach().cpu() for key, value in self.weights.items()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = state["updates"]
        for key, value in state["weights"].items():
            self.weights[key].copy_(value)


def _average_dtype(value: torch.Tensor) -> torch.dtype:
    return torch.float32 if value.dtype in (torch.float16, torch.bfloat16) else value.dtype


def make_ema(trainer: Any, model: nn.Module) -> Optional[EMA]:
    """The average `trainer.ema` asks for (None when it is null)."""
    if trainer.ema is None:
        return None
    return EMA(model, trainer.ema, trainer.ema_warmup, torch.device(trainer.ema_device) if trainer.ema_device
               else None)
