"""loss=moe's spec (accutrain.core.losses.spec): a mixture of experts' router balanced over the whole window."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from accutrain.core.losses.spec import Family, LossNode, Refusal, Traits
from accutrain.core.options import RouterAux
from accutrain.errors import UserError

LM = "accutrain.models.hf.causal_lm"


@dataclass
class MoENode(LossNode):  # loss=moe
    _target_: str = "accutrain.core.losses.moe.moe"
    router_aux: RouterAux = RouterAux.window  # window: the router's balancing loss over the whole window (exact) |
    # micro_batch: over each micro-batch alone | model: the model's own, per micro-batch | off
    router_aux_coef: Optional[float] = None  # its weight; null: the model's own (router_aux_loss_coef)
    router_z_coef: float = 0.0  # the router z-loss's weight (per token; 0: off)
    shift_labels: Optional[bool] = None  # targets = labels shifted left (labels = input_ids); null: the model's
    label_smoothing: float = 0.0  # ε of the cross-entropy


def router_aux(node: Mapping[str, Any]) -> RouterAux:
    return RouterAux(getattr(node.get("router_aux"), "value", node.get("router_aux", "window")))


def weights(node: Mapping[str, Any]) -> None:
    """The weights of the balancing and z-losses: 0 or more; the cross-entropy's ε."""
    for key in ("router_aux_coef", "router_z_coef"):
        weight = node.get(key)
        if weight is not None and not 0 <= weight < math.inf:
            raise UserError(f"loss.{key}={weight} is not valid: expected a weight of 0 or more"
                            + (" (null: the model's own router_aux_loss_coef)" if key == "router_aux_coef" else ""))
    if not 0 <= node.get("label_smoothing", 0.0) < 1:
        raise UserError(f"loss.label_smoothing={node['label_smoothing']} is not valid: expected 0 <= ε < 1 (e.g. 0.1)")


FAMILIES = (
    Family("moe", MoENode._target_, MoENode, Traits(task="classification", terms="elements"),
           metrics=("val_loss", "val_acc"), higher_is_better=("val_acc",), values=weights,
           # only router_aux=window sees the window whole (the counts of every micro-batch before any backward)
           vary=lambda node, t: dataclasses.replace(t, whole_window=router_aux(node) is RouterAux.window),
           refusals=(
               Refusal(lambda c, t: c.model.target.startswith("accutrain.models.") and c.model.target != LM,
                       lambda c: f"model._target_={c.model.target}", "loss=moe balances the router of a "
                       "mixture-of-experts language model: use model=hf_causal_lm with a mixture-of-experts config "
                       "(e.g. +model.config.model_type=mixtral), or loss=cross_entropy"),
               Refusal(lambda c, t: c.strategy.name == "fsdp", "strategy=fsdp", "the window's routing counts are not "
                       "verified with FSDP's sharded forwards; use strategy=ddp"),
               Refusal(lambda c, t: router_aux(c.loss) is RouterAux.model and c.data.get("packing") is True,
                       "data.packing=true", "loss.router_aux=model reads a block packed by documents as one sequence "
                       "and its 4-D attention mask as padding: use loss.router_aux=window, which counts each "
                       "document's tokens (or data.packing=false)"),
           )),
)
