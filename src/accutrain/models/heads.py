"""`model.logits`: what model=hf_causal_lm hands the loss — its full logits, or (`chunked`, the default) its last
hidden states and its LM head as a `core.chunked_ce.Projection`, so that the cross-entropy computes the logits a
chunk of tokens at a time and never holds them whole (`model.kernels=liger`: Liger Kernel's fused kernel instead,
models/kernels.py).

The hidden states come from the Hugging Face model's base model (`model.base_model`: GPT-2's `transformer`, Llama's
`model`, with any LoRA layers PEFT put in it), the head from `get_output_embeddings()`. That is the model's own
forward wherever its logits are its head applied to its last hidden state; a model that does more to them (Gemma 2's
soft-capping, Cohere's logit scale, a LoRA on the head) is found by comparing the two on a few tokens when the model
is built, and keeps its full logits, with a line in the log.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from accutrain.core.chunked_ce import Fused, Projection
from accutrain.errors import UserError

log = logging.getLogger("accutrain")

LOGITS = ("chunked", "full")


def check(logits: str) -> None:
    """model.logits, or one line."""
    if logits not in LOGITS:
        raise UserError(f"model.logits={logits} is not valid: expected chunked (the loss computes the logits a chunk "
                        "of tokens at a time from the last hidden states) or full (the model's logits, whole)")


def causal(model: nn.Module) -> nn.Module:
    """The Hugging Face causal LM inside `model` (a PEFT model's base model: the LoRA layers are inside it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def project(model: nn.Module, inputs: dict[str, Any], fused: Optional[Fused] = None) -> Projection:
    """The causal LM `model`'s last hidden states for `inputs` and its head, as a Projection."""
    lm = causal(model)
    hidden = lm.base_model(**inputs)[0]  # last_hidden_state: after the final norm, as the head reads it
    head = lm.get_output_embeddings()
    return Projection(hidden, head.weight, head.bias, fused)


@torch.no_grad()
def projects_its_logits(model: nn.Module) -> Optional[str]:
    """None when the model's logits are its head applied to its last hidden state (checked on 8 tokens, the
    model in eval mode), else why not."""
    lm = causal(model)
    head = lm.get_output_embeddings()
    if not isinstance(head, nn.Linear) or type(head) is not nn.Linear:
        return f"its head is a {type(head).__name__}, not a plain linear layer"
    if not isinstance(getattr(lm, "base_model", None), nn.Module) or lm.base_model is lm:
        return "it has no base model to give its hidden states"
    device = head.weight.device
    ids = torch.arange(8, device=device)[None] % max(1, head.weight.shape[0])
    training = lm.training
    lm.eval()
    try:
        logits = lm(input_ids=ids, use_cache=False).logits.float()
        projected = project(lm, dict(input_ids=ids, use_cache=False)).logits().transpose(1, 2).float()
    except Exception as e:  # whatever the base model cannot take alone
        return f"its base model alone raised {type(e).__name__}"
    finally:
        lm.train(training)
    scale = float(logits.abs().max().clamp_min(1.0))
    if logits.shape != projected.shape or not torch.allclose(logits, projected, rtol=1e-4, atol=1e-4 * scale):
        return "its logits are not its head applied to its last hidden state (soft-capped or scaled)"
    return None


def choose(model: nn.Module, logits: str, kernels: Optional[str]) -> str:
    """The output the model gives: `logits` (model.logits), or full where the model cannot give a Projection."""
    if logits == "full":
        if kernels:
            log.info(f"model.kernels={kernels} with model.logits=full: the loss takes the model's full logits (its "
                     "fused cross-entropy needs model.logits=chunked)")
        return "full"
    reason = projects_its_logits(model)
    if reason is not None:
        log.info(f"model.logits=chunked: {reason}, so the loss takes the model's full logits")
        return "full"
    return "chunked"
