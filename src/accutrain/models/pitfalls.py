"""What silently spoils an accumulated run, said at start: dropout (its masks depend on how the window is cut) and
labels that equal the inputs (a causal LM would learn to copy its input). BatchNorm's warning is in
accutrain.models.norms."""
from __future__ import annotations

import re
from typing import Optional

from torch import nn

from accutrain.core.batches import Batch
from accutrain.core.loss import Loss

# Names under which models keep a drop probability: nn.Dropout's p aside, Hugging Face configs and modules use these.
STOCHASTIC = re.compile(r"dropout|pdrop|layerdrop|drop_path|drop_prob", re.I)


def _is_probability(value: object) -> bool:
    return isinstance(value, float) and value > 0


def dropout_layers(model: nn.Module) -> list[str]:
    """Modules in training mode that drop at random: dropout layers and stochastic depth with p > 0, and modules
    holding a drop probability > 0 as a float attribute (Hugging Face attention hands it to SDPA)."""
    found = []
    for name, m in model.named_modules():
        if not m.training:
            continue
        kind = type(m).__name__
        if _is_probability(getattr(m, "p", 0)) and ("dropout" in kind.lower() or kind == "StochasticDepth"):
            found.append(name)
        elif any(STOCHASTIC.search(key) and _is_probability(value) for key, value in vars(m).items()):
            found.append(name)
    return found


def dropout_warning(model: nn.Module, micro_batch: int, effective: int) -> Optional[str]:
    """The start-up warning (a short first line, then the detail) when dropout is active and the window is cut (accum > 1 or several devices)."""
    layers = dropout_layers(model)
    if not layers or micro_batch >= effective:
        return None
    return (f"{len(layers)} dropout layers are active: the big batch's step in distribution only "
            f"(model.dropout=0: exact)\n"
            f"the layers: {', '.join(layers[:3])}{', …' if len(layers) > 3 else ''}; their random masks depend on "
            f"how the window of {effective} is cut into micro-batches of {micro_batch}, so the accumulated step is "
            "the big batch's in distribution, not draw for draw; model.dropout=0 (hf_*, mlp, cnn) makes every split "
            "take the same step")


def unshifted_labels_warning(batch: Batch, loss: Loss, share: float = 0.5) -> Optional[str]:
    """A warning when the loss's per-element targets equal an input tensor at more than `share` of the counted
    positions of `batch`: labels = input_ids, left for a model that would shift them itself."""
    target = loss.target(batch.target)
    counted = target != loss.ignore_index
    if target.dim() < 2 or not counted.any():
        return None
    for t in batch.tensors():
        if t.shape == target.shape and not t.is_floating_point():
            same = float((t == target)[counted].float().mean())
            if same > share:
                return (f"the targets equal the inputs at {same:.0%} of the first window's positions: labels "
                        "unshifted?\nHugging Face's convention is labels = "
                        "input_ids, where the model shifts them, so the model would learn to copy its input; set "
                        "loss.shift_labels=true, or shift the labels in the data")
    return None
