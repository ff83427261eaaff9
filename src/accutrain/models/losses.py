"""The run's loss from its `loss:` node: `hydra.utils.instantiate(cfg.loss)` of a built-in option (the factories of
accutrain.core.losses), or a user's per-term loss (`loss=custom loss._target_=…`) wrapped so that accutrain sums and
counts its terms."""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Optional

import torch
from omegaconf import DictConfig
from torch import nn

from accutrain.config.targets import accepted, load_target, plain
from accutrain.core import losses
from accutrain.core.contrastive import HEAD, ContrastiveLoss, Temperature
from accutrain.core.loss import Loss
from accutrain.errors import UserError
from accutrain.models.norms import REMEDIES, batchnorm_layers

log = logging.getLogger("accutrain")
OWN = ("normalize", "ignore_index")  # a custom loss's keys that accutrain applies, not its _target_


def build_loss(node: DictConfig | dict, model: Optional[nn.Module] = None) -> Loss:
    """The loss the node describes; `model` lends its defaults (model=hf_causal_lm: tokens, shifted labels) to the
    built-in factories that take it."""
    values = plain(node)
    make = load_target("loss._target_", values["_target_"])
    kwargs = {k: v for k, v in values.items() if k != "_target_"}
    if getattr(make, "__module__", "").startswith("accutrain.core."):  # a built-in option's factory
        return make(**kwargs, **accepted(make, dict(model=model)))
    own = {k: kwargs.pop(k) for k in OWN if k in kwargs}
    fn: Any = make(**kwargs) if inspect.isclass(make) else functools.partial(make, **kwargs) if kwargs else make
    return losses.custom(fn, values["_target_"], **own)


def check_targets(loss: Loss, target: Any, data: str) -> None:
    """One line when the data's targets are not what the loss compares with: float values for regression and
    multi-label losses (class indices would be read as numbers)."""
    if loss.task in ("regression", "multilabel") and not target.is_floating_point():
        wanted = "float targets (values to regress)" if loss.task == "regression" else "multi-hot float targets"
        raise UserError(f"loss={getattr(loss, 'name', loss.task)} needs {wanted}, but data._target_={data} gives "
                        f"{target.dtype} class indices: use loss=cross_entropy, or data whose targets are "
                        f"{'values' if loss.task == 'regression' else 'multi-hot'} (data=synthetic data.target="
                        f"{loss.task})")


def attach(loss: Loss, model: nn.Module, cfg: DictConfig) -> None:
    """What a window-level loss (loss=contrastive) needs of the run, or one line saying what it cannot work with;
    a learnt temperature becomes a parameter of the model (`contrastive_logit_scale`): the optimizer steps it and
    checkpoints hold it, DDP reduces it."""
    views = cfg.augment.views
    if not isinstance(loss, ContrastiveLoss):
        if views != 1:
            raise UserError(f"augment.views={views} makes pairs of views for loss=contrastive; this run's loss is "
                            f"{getattr(loss, 'name', loss.task)}: set augment.views=1, or loss=contrastive")
        return
    if views != 2:
        raise UserError("loss=contrastive needs pairs: set augment.views=2 (two random views of each sample, with a "
                        "random augment=, e.g. augment=crop_flip)")
    refused = [
        (cfg.strategy.name == "fsdp", "strategy=fsdp", "use strategy=ddp"),
        (cfg.micro_batch == "auto", "micro_batch=auto", "give micro_batch=N"),
        (cfg.get("micro_tokens") is not None, f"micro_tokens={cfg.get('micro_tokens')}", "give micro_batch=N"),
        (cfg.trainer.accum_dtype is not None or cfg.trainer.offload_grads,
         "trainer.accum_dtype / trainer.offload_grads", "leave them unset"),
        (cfg.augment.mixup_alpha > 0 or cfg.augment.cutmix_alpha > 0, "augment.mixup_alpha / cutmix_alpha",
         "set them to 0: pairs are not mixed"),
        (cfg.trainer.noise_scale, "trainer.noise_scale=true", "a micro-batch's gradient of a window-level loss is "
         "not an estimate of the window's (its negatives come from the whole window): set trainer.noise_scale=false"),
    ]
    for bad, key, remedy in refused:
        if bad:
            raise UserError(f"loss=contrastive cannot be combined with {key}: {remedy}")
    if batchnorm_layers(model, True):
        raise UserError(f"loss=contrastive with BatchNorm in the encoder is not exact (each pass normalises a "
                        f"micro-batch with its own statistics, and the running statistics would move twice): "
                        f"{REMEDIES}")
    if not loss.window:
        log.warning("loss.window=false: each micro-batch's contrastive loss has only its own samples as negatives, "
                    "so the accumulated step is NOT the big batch's (for comparison only; loss.window=true is exact)")
    if loss.learn_temperature:
        first = next(model.parameters())
        loss.head = Temperature(loss.temperature).to(device=first.device, dtype=torch.float32)
        model.register_parameter(HEAD, loss.head.logit_scale)  # not a module: an nn.Sequential would call it
