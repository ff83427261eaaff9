"""`trainer.ema`: an exponential moving average of the weights, moved once per optimizer step taken (never per
micro-batch, never on a skipped step), evaluated beside the raw weights and kept in checkpoints.

    ema ← decay · ema + (1 − decay) · weights

With scaling.ema=true the decay of each update is decay ** (effective batch / scaling.base_batch) (`power`): the
average's half-life stays the same number of samples whatever the window's batch.

As timm's ModelEmaV3 does, floating-point buffers (BatchNorm's running statistics) are averaged too and integer
ones (num_batches_tracked) copied. The average is float32 when the weights are half precision (a bf16 average
would round every small update away), and lives beside the weights or in CPU memory (`trainer.ema_device=cpu`).
Under strategy=fsdp the weights are sharded and so is the average: each rank averages its own shards, with no
communication and 1/devices of the memory (a full checkpoint gathers it, a sharded one writes the shards).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import nn

from accutrain.dist import is_sharded


class EMA:
    def __init__(self, model: nn.Module, decay: float, warmup: bool = False,
                 device: Optional[torch.device] = None) -> None:
        self.decay, self.warmup, self.updates = decay, warmup, 0
        self.last_decay: Optional[float] = None  # the decay the latest update used
        self.weights = {key: value.detach().to(device or value.device, _average_dtype(value), copy=True)
                        for key, value in model.state_dict().items()}

    def current_decay(self) -> float:
        """The decay of the next update: with warm-up, min(decay, (1 + n) / (10 + n)) after n updates."""
        return min(self.decay, (1 + self.updates) / (10 + self.updates)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module, power: float = 1.0) -> None:
        """Move the average towards the model's current weights with the decay current_decay() ** power (the window's
        scaling.ema): call once per optimizer step taken."""
        self.last_decay = self.current_decay() ** power
        weight = 1.0 - self.last_decay
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
        own = {key: _set_aside(value) for key, value in model.state_dict().items()}
        model.load_state_dict(self.weights)
        try:
            yield
        finally:
            model.load_state_dict(own)

    def state_dict(self, weights: bool = True) -> dict[str, Any]:
        """The decay, the count of updates and (unless weights=False) the averaged weights, in CPU memory."""
        state = dict(decay=self.decay, updates=self.updates)
        if weights:
            state["weights"] = {key: value.detach().cpu() for key, value in self.weights.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = state["updates"]
        for key, value in state["weights"].items():
            self.weights[key].copy_(value)


def _set_aside(value: torch.Tensor) -> torch.Tensor:
    """A copy of a weight while the average is swapped in: in CPU memory, or where it is for a shard (strategy=fsdp:
    1/devices of the weights, whose device mesh a move would break)."""
    return value.detach().clone() if is_sharded(value) else value.detach().to("cpu", copy=True)


def _average_dtype(value: torch.Tensor) -> torch.dtype:
    return torch.float32 if value.dtype in (torch.float16, torch.bfloat16) else value.dtype


def make_ema(trainer: Any, model: nn.Module) -> Optional[EMA]:
    """The average `trainer.ema` asks for (None when it is null)."""
    if trainer.ema is None:
        return None
    return EMA(model, trainer.ema, trainer.ema_warmup, torch.device(trainer.ema_device) if trainer.ema_device
               else None)
