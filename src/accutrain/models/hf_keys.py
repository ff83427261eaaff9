"""The state_dict keys of models/hf.py's adapters: the bare Hugging Face model's own (`transformer.wte.weight`, no
`model.` prefix), so that a checkpoint's weights load into the bare model too; an adapted model's trained entries
only. State-dict hooks, registered by the adapter."""
from __future__ import annotations

from typing import Any

from torch import nn

from accutrain.models import adapters


def adapter_only(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """An adapted model's state: its trained entries only (its frozen base is the factory's)."""
    keep = {prefix + key for key in adapters.trained_keys(module)}
    for key in [k for k in state_dict if k.startswith(prefix) and k not in keep]:
        del state_dict[key]


def plain_keys(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """The wrapped model's keys without `model.`: the keys the bare Hugging Face model has."""
    inner = prefix + "model."
    items = list(state_dict.items())
    state_dict.clear()  # rebuilt in the same order
    for key, value in items:
        state_dict[prefix + key[len(inner):] if key.startswith(inner) else key] = value


def inner_keys(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """The plain keys back under `model.` — decided by the wrapped model's own keys, not by the prefix: a Llama's or a
    Mixtral's plain keys begin with `model.` themselves."""
    inner = prefix + "model."
    own = {inner + key for key in module.model.state_dict(keep_vars=True)}
    for key in [k for k in state_dict if k.startswith(prefix) and inner + k[len(prefix):] in own]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)
