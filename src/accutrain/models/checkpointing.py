"""`trainer.activation_checkpointing`: recompute activations in backward instead of keeping them, block by block,
with BatchNorm's running statistics updated once (not again during the recomputation)."""
from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Iterator

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from accutrain.models.norms import batchnorm_layers


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
