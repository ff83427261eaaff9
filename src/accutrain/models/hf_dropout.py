"""A Hugging Face model's dropout set to one probability (`model.dropout`): every drop probability of its config,
and every one its modules keep, which a config key cannot reach."""
from __future__ import annotations

from typing import Any

from torch import nn

from accutrain.models.pitfalls import STOCHASTIC


def set_dropout_config(config: Any, p: float) -> list[str]:
    """Every drop probability of a Hugging Face config (and of its sub-configs) set to p, None ones included (a
    head whose dropout is None falls back to another one, or to 0.1). Returns the keys set."""
    changed = []
    for key in config.to_dict():
        value = getattr(config, key, None)
        if hasattr(value, "to_dict"):  # a sub-config (composite models)
            changed += [f"{key}.{k}" for k in set_dropout_config(value, p)]
        elif STOCHASTIC.search(key) and (value is None or type(value) in (int, float)):
            setattr(config, key, p)
            changed.append(key)
    return changed


def set_dropout_modules(model: nn.Module, p: float) -> int:
    """Every dropout layer's p, and every float drop probability a module keeps (Llama's attention_dropout,
    handed to SDPA), set to p: what a config key cannot reach. Returns how many were set."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = p
            count += 1
        for attr, value in list(vars(module).items()):
            if STOCHASTIC.search(attr) and isinstance(value, float):
                setattr(module, attr, p)
                count += 1
    return count
