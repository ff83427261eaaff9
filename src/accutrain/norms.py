"""BatchNorm under accumulation: finding the layers, converting them (`model.norm`), and the start-up warning.

BatchNorm in training mode normalises each micro-batch with that micro-batch's statistics, so an accumulated step
is not exactly the big batch's step; GroupNorm (statistics per sample) and frozen BatchNorm (fixed statistics) are.
"""
from __future__ import annotations

import types
from typing import Any, Optional

import torch
from torch import nn

from accutrain.config import Norm
from accutrain.models import replace_module

REMEDIES = ("model.norm=group (GroupNorm: statistics per sample; model.norm_groups sets the groups), "
            "model.norm=frozen (BatchNorm in eval mode with fixed statistics, for fine-tuning pretrained weights), "
            "model.sync_batchnorm=true (statistics over every device's micro-batch, with devices > 1)")


def batchnorm_layers(model: nn.Module, training_only: bool = False) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every BatchNorm (of any dimension, SyncBatchNorm included), or only those in training mode."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or not training_only)]


def _stay_in_eval(module: nn.Module, mode: bool = True) -> nn.Module:
    return nn.Module.train(module, False)


def convert_norm(model: nn.Module, norm: Any, groups: int) -> int:
    """model.norm: BatchNorm → GroupNorm (`group`, affine weights carried over), or kept in eval mode with its
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
    """The start-up warning when BatchNorm layers in training mode take their statistics over fewer samples than the
    window (None when there are none, or when SyncBatchNorm's statistics cover the whole window)."""
    norms = len(batchnorm_layers(model, training_only=True))
    seen = micro_batch * (devices if synced else 1)  # the samples one BatchNorm statistic is taken over
    if not norms or seen >= effective:
        return None
    return (f"{norms} BatchNorm layers take their statistics over {seen} samples, not the window's {effective}: the "
            f"accumulated step is not exactly the big batch's (accutrain-check measures by how much). Remedies: "
            f"{REMEDIES}")
