"""The per-term families' specs (accutrain.core.losses.spec): mse, l1, huber, bce, and a user's per-term loss."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from accutrain.core.losses.spec import Family, LossNode, Traits
from accutrain.core.options import Normalize
from accutrain.errors import UserError

ELEMENTS = "accutrain.core.losses.elements."


@dataclass
class MSENode(LossNode):  # loss=mse | l1 (float targets, summed per element)
    _target_: str = ELEMENTS + "mse"
    normalize: Normalize = Normalize.auto  # auto = elements: the mean over elements; samples: over samples


@dataclass
class L1Node(MSENode):
    _target_: str = ELEMENTS + "l1"


@dataclass
class HuberNode(MSENode):
    _target_: str = ELEMENTS + "huber"
    delta: float = 1.0  # squared below |error| = delta, linear above


@dataclass
class BCENode(MSENode):
    _target_: str = ELEMENTS + "bce"
    pos_weight: Optional[float] = None  # weight of the positive labels' terms (BCEWithLogitsLoss's pos_weight)


@dataclass
class CustomNode(LossNode):  # loss=custom: the user's `_target_`, its keys its arguments
    _target_: str = "???"
    normalize: Normalize = Normalize.samples  # samples: each sample's terms summed, the mean over samples |
    # elements: the mean over the target's elements


def threshold(node: Mapping[str, Any]) -> None:
    """loss.delta of loss=huber: positive."""
    if not node.get("delta", 1.0) > 0:
        raise UserError(f"loss.delta={node['delta']} is not valid: expected a positive threshold (e.g. 1.0)")


REGRESSION = ("val_loss", "val_mae", "val_rmse")
FAMILIES = (
    Family("mse", MSENode._target_, MSENode, Traits(task="regression", terms="elements"), REGRESSION),
    Family("l1", L1Node._target_, L1Node, Traits(task="regression", terms="elements"), REGRESSION),
    Family("huber", HuberNode._target_, HuberNode, Traits(task="regression", terms="elements"), REGRESSION,
           values=threshold),
    Family("bce", BCENode._target_, BCENode, Traits(task="multilabel", terms="elements"), ("val_loss", "val_f1"),
           higher_is_better=("val_f1",)),
    Family("custom", "", CustomNode, Traits(task="custom")),  # a per-term loss of any `_target_`
)
