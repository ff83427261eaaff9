"""loss=kto as the config reads it before PyTorch loads (core/losses/spec.py): its node, traits, metrics and
refusals. The maths: core/losses/kto.py, kto_point.py."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from accutrain.core.losses.dpo_spec import NOT_FSDP, positive, precomputed, reference_values
from accutrain.core.losses.spec import Family, LossNode, Refusal, Traits
from accutrain.errors import UserError

KTO = "accutrain.core.losses.kto.kto"
POINTS = ("window", "micro_batch")


@dataclass
class KTONode(LossNode):  # loss=kto
    _target_: str = KTO
    beta: float = 0.1  # β: the rewards' scale
    desirable_weight: float = 1.0  # λ_D: the desirable samples' weight
    undesirable_weight: float = 1.0  # λ_U: the undesirable samples' weight
    reference_point: str = "window"  # window: z0 over the whole window (exact) | micro_batch: per micro-batch (NOT
    # the big batch's objective: for comparison)
    seed: int = 0  # draws the mismatched pairs within the window (the run's seed)
    reference: str = "model"  # model: π_ref beside the policy (precompute is refused: see PRECOMPUTE)


def kto_values(node: Mapping[str, Any]) -> None:
    for key in ("beta", "desirable_weight", "undesirable_weight"):
        positive(node, key)
    reference_values(node)
    if node.get("reference_point") not in POINTS:
        raise UserError(f"loss.reference_point={node.get('reference_point')} is not valid: expected window (over "
                        "the whole window, exact) or micro_batch (per micro-batch, not the big batch's)")


def window_point(node: Mapping[str, Any], traits: Traits) -> Traits:
    """reference_point=window: a sample's loss depends on the window's others (z0), so the window is seen whole."""
    return dataclasses.replace(traits, whole_window=node.get("reference_point", "window") == "window")


PRECOMPUTE = Refusal(lambda run, traits: precomputed(run), "loss.reference=precompute",
                     "KTO's reference point z0 takes π_ref of each window's mismatched (prompt, completion) pairs, "
                     "drawn anew in every window of every epoch, so one pass over the training split cannot keep "
                     "them; use loss.reference=model (with model.adapter=lora: the base with its adapter disabled, "
                     "no second copy)")
FAMILIES = (
    Family(name="kto", target=KTO, schema=KTONode,
           traits=Traits(task="feedback", output="logits", terms="samples"),
           metrics=("val_loss", "val_kl", "val_rewards_desirable", "val_rewards_undesirable"),
           higher_is_better=("val_rewards_desirable",), refusals=(NOT_FSDP, PRECOMPUTE), vary=window_point,
           values=kto_values),
)
