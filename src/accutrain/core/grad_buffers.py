"""Gradients summed outside .grad across a window's micro-batches: in float32 (`trainer.accum_dtype`) and/or in
pinned CPU memory (`trainer.offload_grads`), handed back to .grad once per window for the optimizer step."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from accutrain.errors import UserError

log = logging.getLogger("accutrain")

def copies_done(device: torch.device) -> Optional[torch.cuda.Event]:
    """An event marking the end of the work queued so far on `device`'s current stream (copies included); None on
    the CPU, where copies are synchronous."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class GradBuffers:
    """Sum each micro-batch's gradients into buffers outside .grad — in float32 (`trainer.accum_dtype`) and/or in
    pinned CPU memory (`trainer.offload_grads`) — and hand the window's sum back to .grad for the optimizer step.

    Handing back from pinned memory is an asynchronous copy: a buffer is written again (by the next window's first
    micro-batch) only after the copies have read it. A buffer's first gradient of a window is copied in, not added,
    so no buffer is ever zeroed, and a parameter that got no gradient in the window gets none (.grad None), as
    without buffers."""

    def __init__(self, params: list[nn.Parameter], dtype: Optional[torch.dtype], offload: bool) -> None:
        pin = offload and torch.cuda.is_available()
        self.buffers = {p: torch.zeros(p.shape, dtype=dtype or p.dtype, device="cpu" if offload else p.device,
                                       pin_memory=pin) for p in params}
        self.device = params[0].device if params else torch.device("cpu")  # where .grad lives
        self._summed: set[nn.Parameter] = set()  # parameters whose buffer holds this window's sum so far
        self._copies: Optional[torch.cuda.Event] = None  # the last release's copies, until they are known done
        self._hooks = [p.register_post_accumulate_grad_hook(self._take) for p in params]

    def _take(self, p: nn.Parameter) -> None:
        self._wait_for_copies()
        buffer, grad = self.buffers[p], p.grad.to(self.buffers[p].device, self.buffers[p].dtype)
        if p in self._summed:
            buffer.add_(grad)
        else:
            buffer.copy_(grad)
            self._summed.add(p)
        p.grad = None  # the device copy is freed as soon as it is summed

    def _wait_for_copies(self) -> None:
        if self._copies is not None:
            self._copies.synchronize()
            self._copies = None

    def release(self) -> None:
        """Put the window's summed gradients back in .grad (the parameters' device and dtype); the buffers start the
        next window empty."""
        self._wait_for_copies()
        for p, buffer in self.buffers.items():
            p.grad = buffer.to(p.device, p.dtype, non_blocking=True, copy=True) if p in self._summed else None
        self._copies = copies_done(self.device)
        self._summed.clear()

    def clear(self) -> None:
        """Drop what the buffers hold (the partial gradients of a window abandoned after an out-of-memory)."""
        self._summed.clear()

    def remove(self) -> None:
        """Stop collecting: gradients accumulate in .grad again."""
        for hook in self._hooks:
            hook.remove()
        self._wait_for_copies()


@dataclass(frozen=True)
class BufferSpec:
    """What trainer.accum_dtype and trainer.offload_grads ask of the gradient buffers."""

    dtype: Optional[torch.dtype]  # float32, or None: the parameters' dtype
    offload: bool  # in pinned CPU memory

    def build(self, model: nn.Module) -> GradBuffers:
        return GradBuffers([p for p in model.parameters() if p.requires_grad], self.dtype, self.offload)


def grad_buffer_spec(trainer: Any, precision: Any, device: torch.device, world_size: int) -> Optional[BufferSpec]:
    """The gradient buffers trainer.accum_dtype=float32 (half-precision weights) and trainer.offload_grads ask for,
    said once in the log; None when gradients accumulate in .grad."""
    fp32 = trainer.accum_dtype == "float32" and precision.param_dtype != torch.float32
    if trainer.accum_dtype == "float32" and not fp32:
        log.info(f"trainer.accum_dtype=float32: the weights are float32 with precision {precision.name}, so "
                 "gradients already accumulate in float32")
    offload = trainer.offload_grads and device.type != "cpu"
    if trainer.offload_grads and not offload:
        log.warning("trainer.offload_grads=true does nothing on the CPU: the gradients already live in CPU memory")
    if not (fp32 or offload):
        return None
    if world_size > 1:
        raise UserError("trainer.accum_dtype=float32 and trainer.offload_grads need devices=1 in this version "
                        "(DDP all-reduces .grad, not accutrain's buffers)")
    log.info("gradients accumulate in " + " and ".join(
        (["float32 buffers"] if fp32 else []) + (["pinned CPU memory"] if offload else [])))
    return BufferSpec(torch.float32 if fp32 else None, offload)
