"""What the config knows of the run's model before PyTorch loads, from its `_target_`: whether it saves in the Hugging
Face format (trainer.export=hf|merged) and what loss.normalize=auto and loss.shift_labels=null become for it (its
`loss_defaults`: a language model's tokens, shifted). The built-in models' facts are written here once (the models
read their defaults from this table); a model of the user's declares `loss_defaults` on its factory and is known
to save in the Hugging Face format only once built."""
from __future__ import annotations

import inspect
from typing import Any, Mapping, Optional

from accutrain.config.loading import load_target

CAUSAL_LM = "accutrain.models.hf.causal_lm"
PRETRAINED = (CAUSAL_LM, "accutrain.models.hf.seq_cls", "accutrain.models.hf_encoder.encoder")  # save_pretrained
LOSS_DEFAULTS: dict[str, dict[str, Any]] = {CAUSAL_LM: dict(normalize="tokens", shift_labels=True)}
DOCUMENTS = (CAUSAL_LM,)  # take document_ids: each packed document's positions and attention to itself
IMAGENET = "accutrain.models.torchvision_classifier"  # pretrained weights: the images normalised as ImageNet's


def target_of(node: Any) -> str:
    """A node's `_target_`: a typed run's Factory, or a mapping."""
    return str(getattr(node, "target", None) or node.get("_target_") or "")


def builtin(node: Mapping[str, Any]) -> bool:
    return target_of(node).startswith("accutrain.")


def pretrained_format(node: Mapping[str, Any]) -> Optional[bool]:
    """Whether the model saves in the Hugging Face format; None for a user's model (known once it is built)."""
    return target_of(node) in PRETRAINED if builtin(node) else None


def takes_documents(node: Mapping[str, Any]) -> Optional[bool]:
    """Whether the model takes document_ids (data.packing=true, data.padding=free); None for a user's model."""
    return target_of(node) in DOCUMENTS if builtin(node) else None


def imagenet_weights(node: Mapping[str, Any]) -> bool:
    """Whether the model starts from torchvision's ImageNet weights (its inputs normalised as ImageNet's)."""
    return target_of(node) == IMAGENET and bool(node.get("pretrained"))


def loss_defaults(node: Mapping[str, Any]) -> dict[str, Any]:
    """What loss.normalize=auto and loss.shift_labels=null become for this model: the table's for a built-in
    model; a user's factory's own `loss_defaults` (declared, not computed; this imports its module)."""
    if builtin(node):
        return dict(LOSS_DEFAULTS.get(target_of(node), {}))
    factory = load_target("model._target_", target_of(node))
    return dict(inspect.getattr_static(factory, "loss_defaults", {}))
