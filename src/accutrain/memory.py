"""Memory: peak measurement, out-of-memory errors, activation checkpointing, and gradients kept outside .grad (in
float32 or in CPU memory). `micro_batch=auto` is in accutrain.auto_batch."""
from __future__ import annotations

import functools
import gc
import logging
import mmap
import os
import re
import resource
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from accutrain.errors import UserError
from accutrain.norms import batchnorm_layers

log = logging.getLogger("accutrain")


# --- peak memory -----------------------------------------------------------------------------------------
class _PeakRSS:
    """The process's peak resident set since the last reset (Linux): the reset writes "5" to /proc/self/clear_refs
    through a descriptor kept open; the peak is getrusage's ru_maxrss where this kernel resets it too (checked once),
    else VmHWM read from a kept-open /proc/self/status. A few µs per optimizer step instead of opening files."""

    PROBE = 32 * 2**20  # the check's short-lived peak

    def __init__(self) -> None:
        self.clear_refs: Optional[int] = None
        self.status: Optional[int] = None
        self.rusage_follows: Optional[bool] = None  # known at the first reading (the kernel's, kept across a fork)
        self.open()

    def open(self) -> None:
        """Open this process's files; again in a forked child (a worker forked from accutrain.launch's fork server),
        whose inherited descriptors name its parent's: /proc/self is resolved when a file is opened."""
        for fd in (self.clear_refs, self.status):
            if fd is not None:
                os.close(fd)
        self.clear_refs = self._open("/proc/self/clear_refs", os.O_WRONLY)
        self.status = self._open("/proc/self/status", os.O_RDONLY)

    @staticmethod
    def _open(path: str, flags: int) -> Optional[int]:
        try:
            return os.open(path, flags | os.O_CLOEXEC)
        except OSError:
            return None

    def reset(self) -> bool:
        """Start a new peak at the current resident set; False where that cannot be done."""
        try:
            return self.clear_refs is not None and os.write(self.clear_refs, b"5") == 1
        except OSError:
            return False

    def _vm_hwm_kib(self) -> Optional[int]:
        if self.status is None:
            return None
        found = re.search(rb"VmHWM:\s+(\d+) kB", os.pread(self.status, 4096, 0))
        return int(found.group(1)) if found else None

    def _rusage_follows(self) -> bool:
        """Whether ru_maxrss drops with a reset, as VmHWM does (Linux ≥ 4.0 resets both; some kernels only VmHWM):
        a short-lived peak above the current RSS, a reset, then both compared (within the kernel's per-CPU slack)."""
        probe = mmap.mmap(-1, self.PROBE)
        probe.write(bytes(self.PROBE))
        probe.close()
        hwm = self._vm_hwm_kib() if self.reset() else None
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return hwm is not None and abs(maxrss - hwm) < self.PROBE // 2**10 // 4

    def mb(self) -> float:
        if self.rusage_follows is None:
            peak = self._vm_hwm_kib()  # this window's, before the check resets it
            self.rusage_follows = self._rusage_follows()
        else:
            peak = None if self.rusage_follows else self._vm_hwm_kib()
        return (peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


_PEAK_RSS = _PeakRSS()
os.register_at_fork(after_in_child=_PEAK_RSS.open)


def reset_peak(device: torch.device) -> None:
    """Start a new peak: CUDA's max-allocated counter (host-side, no synchronisation), or the process's peak RSS."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _PEAK_RSS.reset()


def peak_mb(device: torch.device) -> float:
    """MiB at the peak since reset_peak: CUDA max allocated on a GPU, the process's peak RSS on the CPU."""
    if device.type == "cuda":  # max_memory_allocated flattens ~160 statistics into a sorted dict (151 µs on an H100)
        return torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]["peak"] / 2**20
    return _PEAK_RSS.mb()


def is_oom(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator failing."""
    text = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text))


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- activation checkpointing ----------------------------------------------------------------------------
@contextmanager
def _frozen_running_stats(*modules: nn.Module) -> Iterator[None]:
    """During the recomputation in backward, BatchNorm must not update its running statistics a second time."""
    norms = [m for module in modules for _, m in batchnorm_layers(module)]
    saved = [(m, m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone())
             for m in norms]
    for m in norms:
        m.momentum = 0.0  # running = (1 - 0) × running + 0 × batch: unchanged
    try:
        yield
    finally:
        for m, momentum, count in saved:
            m.momentum = momentum
            if count is not None:
                m.num_batches_tracked.copy_(count)


def _recompute_contexts(*modules: nn.Module) -> tuple[ContextManager, ContextManager]:
    return nullcontext(), _frozen_running_stats(*modules)


def _context(*modules: nn.Module) -> dict[str, Any]:
    """checkpoint's context_fn: eager, BatchNorm's statistics frozen during the recomputation. Compiled
    (trainer.compile) none: the recomputation is part of the compiled backward, which does not update them again —
    and torch.compile takes no other context."""
    if torch.compiler.is_compiling():
        return {}
    return {"context_fn": functools.partial(_recompute_contexts, *modules)}


def _checkpointed(forward: Callable, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if not (torch.is_grad_enabled() and module.training):
        return forward(*args, **kwargs)
    return torch_checkpoint.checkpoint(forward, *args, use_reentrant=False, **_context(module), **kwargs)


def _run_layers(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def _segmented_forward(model: nn.Sequential, segments: list[list[nn.Module]], x: torch.Tensor) -> torch.Tensor:
    for layers in segments:
        run = functools.partial(_run_layers, layers)
        if torch.is_grad_enabled() and model.training:
            x = torch_checkpoint.checkpoint(run, x, use_reentrant=False, **_context(*layers))
        else:
            x = run(x)
    return x


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The outermost repeated blocks of a network: modules with parameters and children, held in an nn.Sequential
    or nn.ModuleList (ResNet's BasicBlocks, MobileNet's InvertedResiduals, ViT's encoder layers, …)."""
    names = {}
    for name, container in model.named_modules():
        if isinstance(container, (nn.Sequential, nn.ModuleList)):
            for child_name, child in container.named_children():
                nested = next(child.children(), None) is not None
                has_params = next(child.parameters(), None) is not None
                if nested and has_params and not isinstance(child, (nn.Sequential, nn.ModuleList)):
                    names[f"{name}.{child_name}" if name else child_name] = child
    outermost = [n for n in names if not any(n.startswith(other + ".") for other in names)]
    return [names[n] for n in outermost]


def enable_activation_checkpointing(model: nn.Module) -> int:
    """Recompute activations in backward instead of keeping them: for each block of the network, or for
    segments of about √n layers of a plain nn.Sequential (accutrain's mlp and cnn). Returns how many were
    wrapped (0: nothing to wrap). Parameter names, hence checkpoints, are unchanged."""
    blocks = repeated_blocks(model)
    for block in blocks:
        block.forward = functools.partial(_checkpointed, block.forward, block)
    if blocks or not isinstance(model, nn.Sequential) or len(model) < 2:
        return len(blocks)
    layers = list(model.children())
    size = max(2, round(len(layers) ** 0.5))
    segments = [layers[i : i + size] for i in range(0, len(layers), size)]
    model.forward = functools.partial(_segmented_forward, model, segments)
    return len(segments)


# --- gradients kept outside .grad --------------------------------------------------------------------------
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
