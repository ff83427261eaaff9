"""BatchNorm under accumulation: finding the layers, converting them (`batchnorm.convert`, SyncBatchNorm), and the start-up
warning; and the other layers whose training output depends on how a window is cut (dropout).

BatchNorm in training mode normalises each micro-batch with that micro-batch's statistics, so an accumulated step
is not exactly the big batch's step; GroupNorm (statistics per sample) and frozen BatchNorm (fixed statistics) are.
"""
from __future__ import annotations

import types
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import nn

from accutrain.config.schemas import Norm
from accutrain.config.targets import instantiate
from accutrain.models.factories import data_arguments, replace_module

REMEDIES = ("batchnorm.convert=group (GroupNorm: statistics per sample; batchnorm.groups sets the groups), "
            "batchnorm.convert=frozen (BatchNorm in eval mode with fixed statistics, for fine-tuning pretrained "
            "weights), batchnorm.sync=true (statistics over every device's micro-batch, with devices > 1)")


def batchnorm_layers(model: nn.Module, training_only: bool = False) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every BatchNorm (of any dimension, SyncBatchNorm included), or only those in training mode."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or not training_only)]


def _stay_in_eval(module: nn.Module, mode: bool = True) -> nn.Module:
    return nn.Module.train(module, False)


def is_frozen(module: nn.Module) -> bool:
    """A BatchNorm that batchnorm.convert=frozen keeps in eval mode."""
    return getattr(module.train, "__func__", None) is _stay_in_eval


def convert_norm(model: nn.Module, norm: Any, groups: int) -> int:
    """batchnorm.convert: BatchNorm → GroupNorm (`group`, affine weights carried over), or kept in eval mode with its
    running statistics fixed (`frozen`; its scale and shift still train). Returns how many layers changed."""
    norm = Norm(norm.value if hasattr(norm, "value") else norm)
    if norm is Norm.keep:
        return 0
    layers = batchnorm_layers(model)
    for name, bn in layers:
        if norm is Norm.frozen:
            bn.eval()
            bn.train = types.MethodType(_stay_in_eval, bn)  # model.train() leaves it in eval mode
            continue
        channels = bn.num_features
        group_count = max(g for g in range(1, min(groups, channels) + 1) if channels % g == 0)
        gn = nn.GroupNorm(group_count, channels, eps=bn.eps, affine=bn.affine)
        if bn.affine:
            with torch.no_grad():
                gn.weight.copy_(bn.weight)
                gn.bias.copy_(bn.bias)
        replace_module(model, name, gn)
    return len(layers)


def batchnorm_warning(model: nn.Module, micro_batch: int, effective: int, devices: int, synced: bool
                      ) -> Optional[str]:
    """The start-up warning (a short first line, then the detail) when BatchNorm layers in training mode take their statistics over fewer samples than the
    window (None when there are none, or when SyncBatchNorm's statistics cover the whole window)."""
    norms = len(batchnorm_layers(model, training_only=True))
    seen = micro_batch * (devices if synced else 1)  # the samples one BatchNorm statistic is taken over
    if not norms or seen >= effective:
        return None
    layers = "BatchNorm layer takes its statistics" if norms == 1 else "BatchNorm layers take their statistics"
    return (f"{norms} {layers} over {seen} samples, not the window's {effective} "
            f"(remedies: train.log)\nthe accumulated step is not exactly the big batch's (accutrain-check measures by "
            f"how much). Remedies: {REMEDIES}")


def sync_batchnorm(model: nn.Module) -> int:
    """BatchNorm → SyncBatchNorm in place (statistics over every rank's micro-batch), keeping the parameters and
    running statistics themselves. Frozen layers (batchnorm.convert=frozen) stay as they are: in eval mode they have
    nothing to synchronise, and the conversion would drop their freeze. Returns how many layers changed."""
    layers = [(name, bn) for name, bn in batchnorm_layers(model)
              if name and not is_frozen(bn) and not isinstance(bn, nn.SyncBatchNorm)]
    for name, bn in layers:
        replace_module(model, name, nn.SyncBatchNorm.convert_sync_batchnorm(bn))
    return len(layers)


class _LocalBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm of any dimension over the batch it is given: a SyncBatchNorm's computation on one process alone."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


def _local(sync: nn.SyncBatchNorm) -> _LocalBatchNorm:
    local = _LocalBatchNorm(sync.num_features, sync.eps, sync.momentum, sync.affine, sync.track_running_stats,
                            device="meta")
    local.weight, local.bias = sync.weight, sync.bias  # the same tensors, shared: nothing is copied
    local.running_mean, local.running_var = sync.running_mean, sync.running_var
    local.num_batches_tracked = sync.num_batches_tracked
    local.train(sync.training)
    return local


@contextmanager
def local_batchnorm(model: nn.Module) -> Iterator[int]:
    """Inside the block, every SyncBatchNorm of `model` is a plain BatchNorm over the batch it is given, sharing
    its parameters and running statistics: no collective (one rank can run it alone), and it runs on the CPU.
    Yields how many layers were swapped; they are put back on leaving, also after an error."""
    synced = [(name, m) for name, m in model.named_modules() if name and isinstance(m, nn.SyncBatchNorm)]
    for name, sync in synced:
        replace_module(model, name, _local(sync))
    try:
        yield len(synced)
    finally:
        for name, sync in synced:
            replace_module(model, name, sync)


def batchnorm_in(node: dict[str, Any], sample_shape: tuple[int, ...] = (3, 32, 32), num_classes: int = 10
                 ) -> Optional[int]:
    """How many BatchNorm layers the model node builds, from a build on the meta device (no memory, no weights, no
    data: the data's arguments are stand-ins); None when the model cannot be built that way (pretrained weights to
    load, a factory that computes on its weights)."""
    if node.get("pretrained") and node.get("name_or_path"):
        return None
    try:
        with torch.device("meta"):
            model = instantiate("model", {**node, **data_arguments(node, sample_shape, num_classes)})
    except Exception:
        return None
    return len(batchnorm_layers(model)) if isinstance(model, nn.Module) else None
