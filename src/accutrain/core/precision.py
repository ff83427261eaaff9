"""`trainer.precision`: 32, bf16-mixed / 16-mixed (autocast; 16-mixed with a GradScaler), bf16-true (bf16 weights)."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import ContextManager, Iterator, Optional

import torch

from accutrain.errors import UserError

CHOICES = ("32", "bf16-mixed", "16-mixed", "bf16-true")


@dataclass
class Precision:
    name: str
    device: torch.device
    autocast_dtype: Optional[torch.dtype]  # the forward's compute dtype under autocast, or None
    param_dtype: torch.dtype  # the weights' dtype
    scaler: Optional[torch.amp.GradScaler]  # 16-mixed only: scale/unscale/step/update once per optimizer step
    channels_last: bool = False  # trainer.channels_last: 4-D inputs (images) in channels_last, as the model's weights
    _seed: Optional[tuple[float, torch.Tensor]] = field(default=None, repr=False, compare=False)  # backward's last

    def autocast(self) -> ContextManager:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor, weight: float = 1.0) -> None:
        """Backpropagate weight × loss (× the GradScaler's scale with 16-mixed). Without a scaler the weight seeds the
        backward instead of a multiply in the graph: the same bits (a multiply's backward passes the weight, rounded
        to the loss's dtype, down), one node fewer per micro-batch; the seed tensor is kept while the weight stays (a
        window's micro-batches share it: autograd only reads it)."""
        if self.scaler:
            self.scaler.scale(loss * weight).backward()
        elif weight == 1.0:
            loss.backward()
        else:
            seed = self._seed[1] if self._seed is not None and self._seed[0] == weight else None
            if seed is None or (seed.dtype, seed.device, seed.shape) != (loss.dtype, loss.device, loss.shape):
                seed = torch.full_like(loss, weight)  # made once per window (its weight), not per micro-batch
                self._seed = (weight, seed)
            loss.backward(seed)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Floating inputs in the weights' dtype when the weights are half precision, 4-D ones in channels_last with
        trainer.channels_last; others as they are."""
        if self.param_dtype != torch.float32 and x.is_floating_point():
            x = x.to(self.param_dtype)
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x


def scale_in_use(scaler: Optional[torch.amp.GradScaler]) -> Optional[torch.Tensor]:
    """The scale this window's backward passes multiplied the loss by, as a device tensor copy (no wait); None without
    a scaler (or before its first scale())."""
    if scaler is None or scaler._scale is None:
        return None
    return scaler._scale.detach().clone()


def found_inf_and_update(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """After `scaler.unscale_(optimizer)`: what GradScaler.step and update decide, on the device and without step's
    wait — (inf/NaN found in the unscaled gradients, the scale for the next window), both device tensors. The step is
    the caller's, skipped when anything was found, as GradScaler.step would. GradScaler's private members are used
    here and in scale_in_use only (_found_inf_per_device: what step() reads with .item(); _scale: the scale update()
    set)."""
    found = list(scaler._found_inf_per_device(optimizer).values())
    scaler.update()  # the next window's scale, from the same found-inf flags: a device op, no wait
    found_inf = torch.stack(found).sum() if found else torch.zeros((), device=scaler._scale.device)
    return found_inf, scaler._scale


def make_precision(name: str, device: torch.device, channels_last: bool = False) -> Precision:
    name = str(name)
    if name not in CHOICES:
        raise UserError(f"trainer.precision={name} is not valid: expected one of {', '.join(CHOICES)}")
    if name == "16-mixed":
        return Precision(name, device, torch.float16, torch.float32, torch.amp.GradScaler(device.type), channels_last)
    if name == "bf16-mixed":
        return Precision(name, device, torch.bfloat16, torch.float32, None, channels_last)
    if name == "bf16-true":
        return Precision(name, device, None, torch.bfloat16, None, channels_last)
    return Precision(name, device, None, torch.float32, None, channels_last)


def tolerance(name: str) -> float:
    """Relative agreement to expect between two float summation orders of the same gradient at this precision."""
    return {"32": 1e-4, "bf16-mixed": 5e-2, "16-mixed": 1e-2, "bf16-true": 5e-2}[str(name)]


@contextmanager
def float32_math(tf32: Optional[bool]) -> Iterator[None]:
    """`trainer.tf32`: inside the block, float32 matrix products, convolutions and RNNs on CUDA compute in
    TensorFloat-32 (True: the tensor cores' float32 path, ~1e-3 relative error) or in full float32 (False); None
    changes nothing (PyTorch's defaults: cuDNN's convolutions in TF32, matrix products in float32). The previous
    settings come back on leaving."""
    if tf32 is None:
        yield
        return
    backends = torch.backends
    if hasattr(backends.cudnn, "conv"):  # PyTorch >= 2.9's per-operator settings (not to be mixed with the flags)
        settings = [backends.cuda.matmul, backends.cudnn.conv, backends.cudnn.rnn]
        saved = [setting.fp32_precision for setting in settings]
        for setting in settings:
            setting.fp32_precision = "tf32" if tf32 else "ieee"
        try:
            yield
        finally:
            for setting, value in zip(settings, saved):
                setting.fp32_precision = value
    else:
        saved_flags = backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32
        backends.cuda.matmul.allow_tf32 = backends.cudnn.allow_tf32 = tf32
        try:
            yield
        finally:
            backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32 = saved_flags


def full_float32() -> ContextManager:
    """Inside the block, float32 matrix products, convolutions and RNNs compute in full float32 — no TensorFloat-32
    on CUDA, which cuDNN uses by default — and the previous settings come back on leaving."""
    return float32_math(False)
