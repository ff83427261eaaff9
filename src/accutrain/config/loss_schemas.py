"""The schemas of the `loss/` group: each option's `_target_` is its factory (accutrain.core.losses,
accutrain.core.contrastive) and every other key a keyword argument of it, so `hydra.utils.instantiate(cfg.loss)`
builds the run's loss; accutrain.config.train registers them with the others."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from accutrain.core.options import Normalize, RouterAux


# --- loss/ --------------------------------------------------------------------------------------------
# `_target_` is the loss's factory (accutrain.core.losses); every other key is a keyword argument of it.
@dataclass
class LossConfig:  # loss=cross_entropy
    _target_: str = "accutrain.core.losses.cross_entropy"
    normalize: Normalize = Normalize.auto  # auto: tokens for model=hf_causal_lm, else samples; sequences: the mean
    # over the window's samples of each one's token mean
    ignore_index: int = -100  # element targets equal to this (padding) count neither in the loss nor in the mean
    shift_labels: Optional[bool] = None  # targets = labels shifted left (labels = input_ids); null: model=hf_causal_lm
    label_smoothing: float = 0.0  # ε: each target is (1 - ε) × its class + ε spread over every class


@dataclass
class ElementLoss:  # loss=mse | l1 | huber | bce: float targets, summed per element
    _target_: str = MISSING
    normalize: Normalize = Normalize.auto  # auto = elements: the mean over elements; samples: over samples
    ignore_index: int = -100  # target elements equal to this count neither in the loss nor in the mean


@dataclass
class HuberLoss(ElementLoss):
    _target_: str = "accutrain.core.losses.huber"
    delta: float = 1.0  # squared below |error| = delta, linear above


@dataclass
class ContrastiveLossConfig:  # loss=contrastive
    _target_: str = "accutrain.core.contrastive.contrastive"
    temperature: float = 0.07  # τ: cosine similarities × 1/τ (learn_temperature: τ's starting value)
    symmetric: bool = True  # CLIP's mean of both directions; false: anchor against every candidate only
    learn_temperature: bool = False  # a parameter the optimizer steps and checkpoints hold
    window: bool = True  # false: each micro-batch's own loss (naive accumulation, not the big batch's objective)
    mask_duplicates: bool = False  # leave out of an anchor's candidates the copies of its positive (same text)
    ignore_index: int = -100  # unused; the data's padding default reads it


@dataclass
class BCELoss(ElementLoss):
    _target_: str = "accutrain.core.losses.bce"
    pos_weight: Optional[float] = None  # weight of the positive labels' terms (BCEWithLogitsLoss's pos_weight)


@dataclass
class MoELossConfig:  # loss=moe
    _target_: str = "accutrain.core.moe.moe"
    router_aux: RouterAux = RouterAux.window  # window: the router's balancing loss over the whole window (exact) |
    # micro_batch: over each micro-batch alone | model: the model's own, per micro-batch | off
    router_aux_coef: Optional[float] = None  # its weight; null: the model's own (router_aux_loss_coef)
    router_z_coef: float = 0.0  # the router z-loss's weight (per token; 0: off)
    ignore_index: int = -100  # target tokens equal to this (padding) count neither in the loss nor in the mean
    shift_labels: Optional[bool] = None  # targets = labels shifted left (labels = input_ids); null: the model's
    label_smoothing: float = 0.0  # ε of the cross-entropy
