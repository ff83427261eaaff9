"""loss=contrastive's spec (accutrain.core.losses.spec): InfoNCE over the whole window's embeddings."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from accutrain.core.losses.spec import Family, LossNode, Traits
from accutrain.errors import UserError

RETRIEVAL = ("val_recall1", "val_recall10", "val_mrr10", "val_ndcg10")  # over the held-out split as one corpus


@dataclass
class ContrastiveNode(LossNode):  # loss=contrastive
    _target_: str = "accutrain.core.losses.contrastive.contrastive"
    temperature: float = 0.07  # τ: cosine similarities × 1/τ (learn_temperature: τ's starting value)
    symmetric: bool = True  # CLIP's mean of both directions; false: anchor against every candidate only
    learn_temperature: bool = False  # a parameter the optimizer steps and checkpoints hold
    window: bool = True  # false: each micro-batch's own loss (naive accumulation, not the big batch's objective)
    mask_duplicates: bool = False  # leave out of an anchor's candidates the copies of its positive (same text)


def temperature(node: Mapping[str, Any]) -> None:
    if not node.get("temperature", 0.07) > 0:
        raise UserError(f"loss.temperature={node['temperature']} is not valid: expected a positive temperature (e.g. "
                        "0.07)")


FAMILIES = (
    Family("contrastive", ContrastiveNode._target_, ContrastiveNode,
           # one pair has no negative: its loss is 0 whatever the weights
           Traits(task="contrastive", whole_window=True, caches_window=True, output="embeddings", min_window=2,
                  pairs=True),
           metrics=("val_loss", *RETRIEVAL), higher_is_better=RETRIEVAL, values=temperature),
)
