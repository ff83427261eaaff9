"""loss=triplet's spec (accutrain.core.losses.spec): every anchor against the window's hardest negative."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from accutrain.core.losses.contrastive_spec import RETRIEVAL
from accutrain.core.losses.spec import Family, LossNode, Traits
from accutrain.errors import UserError

DISTANCES = ("cosine", "euclidean")


@dataclass
class TripletNode(LossNode):  # loss=triplet
    _target_: str = "accutrain.core.losses.triplet.triplet"
    margin: float = 0.2  # m: an anchor's loss is max(0, m + d(anchor, positive) − d(anchor, its hardest negative))
    distance: str = "cosine"  # cosine: 1 − cos(a, b) | euclidean: ‖a − b‖
    window: bool = True  # false: each micro-batch's own hardest negatives (naive accumulation, not the big batch's)


def ranges(node: Mapping[str, Any]) -> None:
    """loss.margin ≥ 0 and finite; loss.distance one of DISTANCES."""
    margin = node.get("margin", 0.2)
    if not 0 <= margin < float("inf"):
        raise UserError(f"loss.margin={margin} is not valid: expected a margin of 0 or more (e.g. 0.2)")
    if node.get("distance", "cosine") not in DISTANCES:
        raise UserError(f"loss.distance={node['distance']} is not valid: expected one of {', '.join(DISTANCES)}")


FAMILIES = (
    # a window of one pair has no negative: its loss is the margin whatever the weights
    Family("triplet", TripletNode._target_, TripletNode,
           Traits(task="contrastive", whole_window=True, caches_window=True, output="embeddings", min_window=2,
                  pairs=True),
           metrics=("val_loss", *RETRIEVAL), higher_is_better=RETRIEVAL, values=ranges),
)
