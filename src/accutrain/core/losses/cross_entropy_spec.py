"""loss=cross_entropy's spec (accutrain.core.losses.spec): classes per sample, or per element (tokens)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from accutrain.core.losses.spec import Family, LossNode, Traits
from accutrain.core.options import Normalize
from accutrain.errors import UserError


@dataclass
class CrossEntropyNode(LossNode):  # loss=cross_entropy
    _target_: str = "accutrain.core.losses.cross_entropy.cross_entropy"
    normalize: Normalize = Normalize.auto  # auto: tokens for model=hf_causal_lm, else samples; sequences: the mean
    # over the window's samples of each one's token mean
    shift_labels: Optional[bool] = None  # targets = labels shifted left (labels = input_ids); null: model=hf_causal_lm
    label_smoothing: float = 0.0  # ε: each target is (1 - ε) × its class + ε spread over every class


def smoothing(node: Mapping[str, Any]) -> None:
    """loss.label_smoothing: 0 ≤ ε < 1."""
    value = node.get("label_smoothing", 0.0)
    if not 0 <= value < 1:
        raise UserError(f"loss.label_smoothing={value} is not valid: expected 0 <= ε < 1 (e.g. 0.1)")


FAMILIES = (
    Family("cross_entropy", CrossEntropyNode._target_, CrossEntropyNode,
           Traits(task="classification", class_targets=True, terms="model"),
           metrics=("val_loss", "val_acc"), higher_is_better=("val_acc",), values=smoothing),
)
