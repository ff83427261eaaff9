"""The run's loss from its `loss:` node: `hydra.utils.instantiate(cfg.loss)` of a built-in option (the factories of
accutrain.core.losses, accutrain.core.contrastive), or a user's per-term loss (`loss=custom loss._target_=…`) wrapped
so that accutrain sums and counts its terms; then made ready for the model (checked on the first samples)."""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Mapping, Optional

from torch import nn

from accutrain.config.targets import accepted, load_target
from accutrain.core.losses import elements as losses
from accutrain.core.batches import Batch
from accutrain.core.loss import Loss
from accutrain.errors import UserError
from accutrain.models.norms import REMEDIES, batchnorm_layers

log = logging.getLogger("accutrain")
OWN = ("normalize", "ignore_index")  # a custom loss's keys that accutrain applies, not its _target_


def build_loss(node: Mapping[str, Any], model_defaults: Optional[dict] = None) -> Loss:
    """The loss the node (`_target_` and its keyword arguments) describes; the built-in factories that take them get
    the model's defaults (supplied_arguments)."""
    values = dict(node)
    make = load_target("loss._target_", values["_target_"])
    kwargs = {k: v for k, v in values.items() if k != "_target_"}
    if builtin(make):
        return make(**kwargs, **supplied_arguments(node, model_defaults))
    own = {k: kwargs.pop(k) for k in OWN if k in kwargs}
    fn: Any = make(**kwargs) if inspect.isclass(make) else functools.partial(make, **kwargs) if kwargs else make
    return losses.custom(fn, values["_target_"], **own)


def supplied_arguments(node: Mapping[str, Any], model_defaults: Optional[dict]) -> dict[str, Any]:
    """What the run supplies to the loss's factory: the model's defaults (its factory's `loss_defaults`:
    model=hf_causal_lm's tokens and shifted labels), to a built-in factory that takes them and is not given them."""
    make = load_target("loss._target_", node["_target_"])
    if not model_defaults or not builtin(make) or "model_defaults" in node:
        return {}
    return accepted(make, dict(model_defaults=dict(model_defaults)))


def builtin(make: Any) -> bool:
    """A built-in option's factory (accutrain.core's), not a user's per-term loss."""
    return getattr(make, "__module__", "").startswith("accutrain.core.")


def check(loss: Loss, model: nn.Module, example: Batch, data: str) -> None:
    """The loss and the model together, once before training: the first samples through the model and the loss
    (loss.check), and BatchNorm refused for a loss over the whole window (each pass normalises a micro-batch with
    its own statistics, and two passes would move the running statistics twice)."""
    loss.check(model, example, data)
    if loss.whole_window and batchnorm_layers(model, True):
        raise UserError(f"loss={loss.name} with BatchNorm in the model is not exact (each pass normalises a "
                        f"micro-batch with its own statistics, and the running statistics would move twice): "
                        f"{REMEDIES}")


def attach(loss: Loss, model: nn.Module) -> None:
    """What the loss attaches to the model on its device (a learnt temperature), and its warnings, logged."""
    for warning in loss.attach(model):
        log.warning(warning)
