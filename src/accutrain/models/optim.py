"""Optimizer factories selected by `optim=`: each takes the model (or its parameters) and the config's keys, so that
`hydra.utils.instantiate(cfg.optim, model)` builds a run's optimizer from its config.yaml."""
from __future__ import annotations

from typing import Iterable, Union

import torch
from torch import nn

Params = Union[nn.Module, Iterable[nn.Parameter]]


def param_groups(model: Params, weight_decay: float) -> list[dict]:
    """Weight decay on weight matrices and filters only; biases and norm scales (1-d tensors) are not decayed."""
    params = [p for p in (model.parameters() if isinstance(model, nn.Module) else model) if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


def sgd(model: Params, lr: float, momentum: float = 0.9, nesterov: bool = False,
        weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """SGD; nesterov needs momentum > 0 (torch.optim.SGD refuses it otherwise, as accutrain's config check does)."""
    return torch.optim.SGD(param_groups(model, weight_decay), lr=lr, momentum=momentum, nesterov=nesterov)


def adamw(model: Params, lr: float, betas: Iterable[float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.01) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=tuple(betas), eps=eps)
