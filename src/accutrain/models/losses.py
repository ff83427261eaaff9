"""The run's loss from its `loss:` node: a family's factory called with the node's keys (a built-in family's, found by
the registry, accutrain.config.families; or a plug-in class whose instances implement the Loss protocol, whatever
module it lives in), else a user's per-term callable wrapped so that accutrain sums and counts its terms; then made
ready for the model (checked on the first samples)."""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Mapping, Optional

from torch import nn

from accutrain.config import families
from accutrain.config.targets import accepted, load_target
from accutrain.core.batches import Batch
from accutrain.core.loss import Loss
from accutrain.core.losses import elements
from accutrain.errors import UserError
from accutrain.models.norms import REMEDIES, batchnorm_layers

log = logging.getLogger("accutrain")
OWN = ("normalize", "ignore_index")  # a per-term loss's keys that accutrain applies, not its _target_


def build_loss(node: Mapping[str, Any], model_defaults: Optional[dict] = None) -> Loss:
    """The loss the node (`_target_` and its keyword arguments) describes. A built-in family's factory, given the
    model's defaults where it takes them. Any other `_target_`: a class is built, and a function that takes the node's
    keys alone is called, with them — a result implementing the Loss protocol is a family of the user's, any other
    callable a per-term loss; a function that takes (output, target) first is itself the per-term loss."""
    values = dict(node)
    make = load_target("loss._target_", values["_target_"])
    kwargs = {k: v for k, v in values.items() if k != "_target_"}
    if families.family_of(values) is not None:
        return make(**kwargs, **supplied_arguments(node, model_defaults))
    own = {k: kwargs.pop(k) for k in OWN if k in kwargs}  # loss=custom's, applied by accutrain to a per-term loss
    if inspect.isclass(make) or takes_only(make, kwargs):
        made = make(**kwargs, **accepted(make, own), **supplied_arguments(node, model_defaults))
        if families.implements(made):
            return made
        fn: Any = made
    else:
        fn = functools.partial(make, **kwargs) if kwargs else make
    return elements.custom(fn, values["_target_"], **own)


def takes_only(make: Any, kwargs: dict[str, Any]) -> bool:
    """Whether `make` can be called with these keyword arguments alone (a factory, not a per-term loss)."""
    try:
        inspect.signature(make).bind(**kwargs)
    except (TypeError, ValueError):
        return False
    return True


def supplied_arguments(node: Mapping[str, Any], model_defaults: Optional[dict]) -> dict[str, Any]:
    """What the run supplies to a loss's factory: the model's defaults (its factory's `loss_defaults`:
    model=hf_causal_lm's tokens and shifted labels), where the factory takes them and the node does not give them."""
    values = dict(node)
    if not model_defaults or "model_defaults" in values:
        return {}
    make = load_target("loss._target_", values["_target_"])
    own = ("_target_", *OWN)
    if families.family_of(values) is None and not (inspect.isclass(make) or takes_only(
            make, {k: v for k, v in values.items() if k not in own})):
        return {}  # a per-term function
    return accepted(make, dict(model_defaults=dict(model_defaults)))


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
