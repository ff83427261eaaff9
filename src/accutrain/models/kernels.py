"""`model.kernels=liger`: Liger Kernel's Triton kernels (the `kernels` extra, CUDA only) in model=hf_causal_lm — its
RMSNorm, RoPE and SwiGLU in place of the model's (for the model types Liger patches), and its fused linear
cross-entropy for the loss (with model.logits=chunked: the logits never held whole, as the chunked PyTorch loss,
in one kernel per chunk).

Each of these kernels works token by token, so none makes a sample's output depend on the others of its
micro-batch: the accumulation stays exact, to the kernels' float rounding. Liger's RoPE and SwiGLU patches replace
functions of the transformers module of the model's type, so every model of that type in the process gets them.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from accutrain.errors import UserError

log = logging.getLogger("accutrain")

KERNELS = ("liger",)
INSTALL = "pip install 'accutrain[kernels]'"


def check(kernels: Optional[str]) -> None:
    """model.kernels: null or a library accutrain knows, or one line."""
    if kernels is not None and kernels not in KERNELS:
        raise UserError(f"model.kernels={kernels} is not valid: expected liger (Liger Kernel's fused kernels, "
                        "CUDA) or null")


def require_liger() -> Any:
    """The liger_kernel package on a CUDA machine, or one line saying what is missing."""
    if not torch.cuda.is_available():
        raise UserError("model.kernels=liger runs Liger Kernel's Triton kernels, which need a CUDA GPU, and none is "
                        "visible: drop model.kernels (model.logits=chunked keeps the logits from being held whole "
                        "on any device)")
    try:
        import liger_kernel.transformers.monkey_patch as patches
    except ImportError:
        raise UserError(f"model.kernels=liger needs the liger-kernel package: {INSTALL}") from None
    return patches


def apply(model: nn.Module, kernels: Optional[str]) -> None:
    """Liger's RMSNorm, RoPE and SwiGLU in the Hugging Face causal LM `model` (its loss is not patched: accutrain
    sums the loss itself, through fused_cross_entropy)."""
    if kernels is None:
        return
    patches = require_liger()
    model_type = getattr(model.config, "model_type", None)
    if model_type not in patches.MODEL_TYPE_TO_APPLY_LIGER_FN:
        log.info(f"model.kernels=liger: Liger Kernel has no layer kernels for model type {model_type}; its fused "
                 "linear cross-entropy still computes the loss")
        return
    patches._apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                            fused_linear_cross_entropy=False)
    log.info(f"model.kernels=liger: Liger Kernel's RMSNorm, RoPE and SwiGLU in the {model_type} model, its fused "
             "linear cross-entropy for the loss")


def fused_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        target: torch.Tensor, ignore_index: int, label_smoothing: float,
                        weights: Optional[torch.Tensor]) -> torch.Tensor:
    """core.chunked_ce's Fused contract through Liger's LigerFusedLinearCrossEntropyFunction: Σ_i weights_i ×
    loss_i (reduction "sum", or "none" weighted per token), its weight gradient accumulated in float32."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    reduction = "sum" if weights is None else "none"
    loss = LigerFusedLinearCrossEntropyFunction.apply(
        hidden, weight, target, bias, None, ignore_index, 0.0, label_smoothing, reduction, None, False,
        torch.float32)[0]
    return loss.float() if weights is None else (loss.float() * weights).sum()
