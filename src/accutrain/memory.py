"""Memory: peak measurement, activation checkpointing, gradients kept outside .grad (fp32 or in CPU memory),
and `micro_batch=auto`, the largest micro-batch that fits."""
from __future__ import annotations

import functools
import gc
import hashlib
import json
import logging
import re
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from accutrain.errors import UserError

log = logging.getLogger("accutrain")


# --- peak memory -----------------------------------------------------------------------------------------
def _reset_rss() -> bool:
    """Reset the process's peak resident set size to the current one (Linux); False where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def reset_peak(device: torch.device) -> None:
    """Start a new peak: CUDA's max-allocated counter, or the process's peak RSS (Linux)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif _CAN_RESET_RSS:
        _reset_rss()


def peak_mb(device: torch.device) -> float:
    """MiB at the peak since reset_peak: CUDA max allocated on a GPU, the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024
    except (OSError, AttributeError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


_CAN_RESET_RSS = _reset_rss()


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
    norms = [m for module in modules for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
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


def _checkpointed(forward: Callable, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if not (torch.is_grad_enabled() and module.training):
        return forward(*args, **kwargs)
    return torch_checkpoint.checkpoint(forward, *args, use_reentrant=False,
                                       context_fn=functools.partial(_recompute_contexts, module), **kwargs)


def _run_layers(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def _segmented_forward(model: nn.Sequential, segments: list[list[nn.Module]], x: torch.Tensor) -> torch.Tensor:
    for layers in segments:
        run = functools.partial(_run_layers, layers)
        if torch.is_grad_enabled() and model.training:
            x = torch_checkpoint.checkpoint(run, x, use_reentrant=False,
                                            context_fn=functools.partial(_recompute_contexts, *layers))
        else:
            x = run(x)
    return x


def _blocks(model: nn.Module) -> list[nn.Module]:
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
    blocks = _blocks(model)
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
class GradBuffers:
    """Sum each micro-batch's gradients into buffers outside .grad — in float32 (`trainer.accum_dtype`) and/or in
    pinned CPU memory (`trainer.offload_grads`) — and hand the window's sum back to .grad for the optimizer step."""

    def __init__(self, params: list[nn.Parameter], dtype: Optional[torch.dtype], offload: bool) -> None:
        pin = offload and torch.cuda.is_available()
        self.buffers = {p: torch.zeros(p.shape, dtype=dtype or p.dtype, device="cpu" if offload else p.device,
                                       pin_memory=pin) for p in params}
        self.handles = [p.register_post_accumulate_grad_hook(self._take) for p in params]

    def _take(self, p: nn.Parameter) -> None:
        buffer = self.buffers[p]
        buffer.add_(p.grad.to(buffer.device, buffer.dtype))
        p.grad = None  # the device copy is freed as soon as it is summed

    def release(self) -> None:
        """Put the window's summed gradients back in .grad (the parameters' device and dtype); empty the buffers."""
        for p, buffer in self.buffers.items():
            p.grad = buffer.to(p.device, p.dtype, non_blocking=True, copy=True)
            buffer.zero_()


# --- micro_batch=auto ----------------------------------------------------------------------------------
def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_micro_batch(window: int, fits: Callable[[int], tuple[bool, float]], budget_mb: Optional[float]
                       ) -> tuple[int, list[str]]:
    """The largest divisor of `window` (a rank's share of the effective batch) for which `fits` holds, trying
    sizes upward and stopping at the first that does not fit; with a budget, a size whose memory, extrapolated
    from the last two trials, exceeds it is not tried. Returns (size, what each trial found)."""
    best, notes, trials = None, [], []
    for size in divisors(window):
        if budget_mb is not None and len(trials) >= 2:
            (s0, m0), (s1, m1) = trials[-2:]
            predicted = m1 + (m1 - m0) / (s1 - s0) * (size - s1)
            if predicted > budget_mb * 1.25:
                notes.append(f"{size}: predicted {predicted:.0f} MiB > budget {budget_mb:.0f} MiB")
                break
        ok, mb = fits(size)
        notes.append(f"{size}: {'fits' if ok else 'does not fit'}" + (f" ({mb:.0f} MiB)" if mb else ""))
        if not ok:
            break
        best = size
        trials.append((size, mb))
    if best is None:
        raise UserError(f"micro_batch=auto: not even a micro-batch of 1 fits ({'; '.join(notes)})")
    return best, notes


def cache_key(**parts: Any) -> str:
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_cache(path: Path, key: str) -> Optional[int]:
    try:
        return json.loads(path.read_text()).get(key, {}).get("micro_batch")
    except (OSError, ValueError, AttributeError):
        return None


def write_cache(path: Path, key: str, micro_batch: int, description: str) -> None:
    try:
        entries = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        entries = {}
    entries[key] = {"micro_batch": micro_batch, "for": description}
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(entries, indent=1) + "\n")
        tmp.replace(path)
    except OSError as e:
        log.warning(f"micro_batch=auto: could not cache the result in {path}: {e}")


def trial(model: nn.Module, optimizer: torch.optim.Optimizer, precision: Any, batch_of: Callable[[int], Any],
          device: torch.device, budget_mb: Optional[float], loss: Callable) -> Callable[[int], tuple[bool, float]]:
    """fits(size): one real forward, backward and optimizer step on `size` samples; (fits, peak MiB). Weights,
    buffers, optimizer state and RNG are restored afterwards, so the search leaves no trace on training."""
    def fits(size: int) -> tuple[bool, float]:
        saved = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        x, y = batch_of(size)
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                free_memory(device)
                reset_peak(device)
                with precision.autocast():
                    logits = model(precision.inputs(x.to(device)))
                precision.backward(loss(logits, y.to(device)))
                optimizer.step()  # its state (momentum, Adam moments) is part of what must fit
                mb = peak_mb(device)
            return budget_mb is None or mb <= budget_mb, mb
        except Exception as e:
            if not is_oom(e):
                raise
            return False, 0.0
        finally:
            optimizer.zero_grad(set_to_none=True)
            optimizer.state.clear()
            model.load_state_dict(saved)
            free_memory(device)

    return fits
