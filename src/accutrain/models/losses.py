"""The run's loss from its `loss:` node: `hydra.utils.instantiate(cfg.loss)` of a built-in option (the factories of
accutrain.core.losses), or a user's per-term loss (`loss=custom loss._target_=…`) wrapped so that accutrain sums and
counts its terms."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from torch import nn

from accutrain.config.targets import accepted, factory
from accutrain.core import losses
from accutrain.core.loss import Loss
from accutrain.errors import UserError

OWN = ("normalize", "ignore_index")  # a custom loss's keys that accutrain applies, not its _target_


def build_loss(node: DictConfig | dict, model: Optional[nn.Module] = None) -> Loss:
    """The loss the node describes; `model` lends its defaults (model=hf_causal_lm: tokens, shifted labels) to the
    built-in factories that take it."""
    make, kwargs = factory("loss", node)
    if getattr(make, "__module__", None) == losses.__name__:
        return make(**kwargs, **accepted(make, dict(model=model)))
    values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
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
