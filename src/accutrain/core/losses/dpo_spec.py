"""loss=dpo and loss=orpo as the config reads them before PyTorch loads (core/losses/spec.py): their nodes, traits,
metrics and refusals. The maths: core/losses/dpo.py, dpo_maths.py."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from accutrain.core.losses.spec import Family, LossNode, Refusal, Traits
from accutrain.errors import UserError

DPO = "accutrain.core.losses.dpo.dpo"
ORPO = "accutrain.core.losses.dpo.orpo"
KINDS = ("sigmoid", "ipo", "hinge", "simpo")
REFERENCES = ("model", "precompute")
METRICS = ("val_loss", "val_rewards_accuracy", "val_rewards_margin", "val_rewards_chosen", "val_rewards_rejected")


@dataclass
class DPONode(LossNode):  # loss=dpo
    _target_: str = DPO
    kind: str = "sigmoid"  # sigmoid (DPO) | ipo | hinge (SLiC) | simpo (reference-free, length-normalised)
    beta: float = 0.1  # β: the rewards' scale (IPO: its 1/(2β) target margin)
    simpo_gamma: float = 0.5  # simpo's target reward margin γ
    nll_coef: float = 0.0  # RPO: + nll_coef × the chosen completions' NLL over the window's chosen tokens
    reference: str = "model"  # model: π_ref beside the policy | precompute: kept per pair in run_dir/reference.pt


@dataclass
class ORPONode(LossNode):  # loss=orpo
    _target_: str = ORPO
    beta: float = 0.1  # λ: the odds-ratio term's weight beside the chosen completions' NLL
    reference: str = "model"  # reference-free: precompute is refused


def dpo_values(node: Mapping[str, Any]) -> None:
    if node.get("kind") not in KINDS:
        raise UserError(f"loss.kind={node.get('kind')} is not valid: expected one of {', '.join(KINDS)}")
    positive(node, "beta")
    reference_values(node)
    if not float(node.get("nll_coef", 0.0)) >= 0:
        raise UserError(f"loss.nll_coef={node.get('nll_coef')} is not valid: expected 0 (off) or a positive weight")


def positive(node: Mapping[str, Any], key: str) -> None:
    if not float(node.get(key, 0.0)) > 0:
        raise UserError(f"loss.{key}={node.get(key)} is not valid: expected a positive number (e.g. 0.1)")


def reference_values(node: Mapping[str, Any]) -> None:
    if node.get("reference", "model") not in REFERENCES:
        raise UserError(f"loss.reference={node.get('reference')} is not valid: expected model (the reference policy "
                        "beside the policy) or precompute (its log-probabilities kept in the run directory)")


def precomputed(run: Any) -> bool:
    return run.loss.get("reference", "model") == "precompute"


REFERENCE_FREE = "{} is reference-free: it takes no reference log-probabilities to precompute; drop loss.reference"
PREFERENCE = Traits(task="preference", output="logits", pairs=True, terms="samples")
NOT_FSDP = Refusal(lambda run, traits: getattr(getattr(run, "strategy", None), "name", None) == "fsdp",
                   "strategy=fsdp", "use strategy=ddp (the reference policy's forwards are not sharded yet)")
FAMILIES = (
    Family(name="dpo", target=DPO, schema=DPONode, traits=PREFERENCE, metrics=METRICS,
           higher_is_better=METRICS[1:3], values=dpo_values, refusals=(NOT_FSDP, Refusal(
               lambda run, traits: precomputed(run) and run.loss.get("kind") == "simpo", "loss.reference=precompute",
               REFERENCE_FREE.format("loss.kind=simpo")))),
    Family(name="orpo", target=ORPO, schema=ORPONode, traits=PREFERENCE, metrics=METRICS,
           higher_is_better=METRICS[1:3], values=lambda node: positive(node, "beta"), refusals=(NOT_FSDP, Refusal(
               lambda run, traits: precomputed(run), "loss.reference=precompute",
               REFERENCE_FREE.format("loss=orpo")))),
)
