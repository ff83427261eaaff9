"""Cross-entropy without the full logits: a model's last hidden states and its linear head (`Projection`), the logits
computed, reduced and differentiated a chunk of tokens at a time, so no chunk's logits outlive it.

A causal LM's micro-batch of N tokens and a vocabulary of V classes holds N × V logits (in float32 for the loss),
their softmax and their gradient: at 16,384 tokens and 152k classes, 10 GB each. Here each chunk of c tokens
(c × V about the size of the hidden states, N × width) gets its logits, their log-sum-exp, its loss terms and — in
the same forward, as Liger Kernel's fused kernel does — its gradients with respect to the hidden states and the
head, then the chunk's logits are freed; backward only scales those gradients by the incoming one. The sum is
F.cross_entropy's (reduction="sum", ignore_index, label_smoothing), per token or weighted per token (a sequence's
mean), so `core.summing` takes a Projection wherever it takes logits, with the same terms and the same count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils import _pytree

from accutrain.core.plan import ceil_div

MIN_CHUNK = 64  # tokens: fewer makes the loop's overhead, not the logits, the cost
# fused(hidden (N, width), weight (V, width), bias, target (N,), ignore_index, label_smoothing, token weights or
# None) -> Σ_i weight_i × loss_i: a library's fused kernel with the chunked function's contract (models/kernels.py)
Fused = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor, int, float,
                  Optional[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class Projection:
    """A model's output whose logits were not computed: `hidden` (batch, length, width), the head's `weight`
    (classes, width) and `bias`; logits = hidden @ weight.T + bias, in cross_entropy's layout (batch, classes,
    length). `fused`: a library's fused kernel to take the loss with instead of the chunked PyTorch one."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    fused: Optional[Fused] = None

    @property
    def shape(self) -> torch.Size:
        """The logits' shape, (batch, classes, length)."""
        return torch.Size((self.hidden.shape[0], self.weight.shape[0], *self.hidden.shape[1:-1]))

    def logits(self) -> torch.Tensor:
        """The full logits, (batch, classes, length): for a loss that reads them (a custom per-term loss)."""
        return F.linear(self.hidden, self.weight, self.bias).movedim(-1, 1)


_pytree.register_pytree_node(  # its tensors visible to DDP, torch.compile and the pytree utilities
    Projection, lambda p: ([p.hidden, p.weight, p.bias], p.fused),
    lambda values, fused: Projection(*values, fused=fused))


def logits_of(output: torch.Tensor | Projection) -> torch.Tensor:
    """The logits of a model's output (a Projection's computed whole)."""
    return output.logits() if isinstance(output, Projection) else output


def chunk_size(tokens: int, width: int, classes: int) -> int:
    """Tokens per chunk: a chunk's logits about as large as the hidden states (N × width, as Liger Kernel sizes its
    chunks), a power of two, at least MIN_CHUNK."""
    wanted = max(1, ceil_div(tokens * width, classes))
    return max(MIN_CHUNK, 2 ** math.ceil(math.log2(wanted)))


def summed_linear_cross_entropy(projection: Projection, target: torch.Tensor, ignore_index: int = -100,
                                label_smoothing: float = 0.0, weights: Optional[torch.Tensor] = None
                                ) -> torch.Tensor:
    """Σ_i weights_i × cross_entropy(logits_i, target_i) over the projection's tokens (targets (batch, length),
    ignore_index adding nothing), float32, without the full logits: the projection's fused kernel or the chunked
    PyTorch function."""
    width = projection.hidden.shape[-1]
    hidden, target = projection.hidden.reshape(-1, width), target.reshape(-1)
    flat_weights = None if weights is None else weights.reshape(-1)
    if projection.fused is not None:
        return projection.fused(hidden, projection.weight, projection.bias, target, ignore_index, label_smoothing,
                                flat_weights)
    return _ChunkedCrossEntropy.apply(hidden, projection.weight, projection.bias, target, flat_weights, ignore_index,
                                      label_smoothing)


@torch.no_grad()
def linear_cross_entropy_sums(projection: Projection, target: torch.Tensor, ignore_index: int = -100
                              ) -> torch.Tensor:
    """float64 [summed loss, correct predictions, counted tokens] of one evaluation batch, chunk by chunk."""
    width = projection.hidden.shape[-1]
    hidden, target = projection.hidden.reshape(-1, width), target.reshape(-1)
    loss = torch.zeros((), dtype=torch.float64, device=hidden.device)
    correct = torch.zeros((), dtype=torch.float64, device=hidden.device)
    step = chunk_size(len(target), width, projection.weight.shape[0])
    for start in range(0, len(target), step):
        h, t = hidden[start : start + step], target[start : start + step]
        logits = F.linear(h, projection.weight, projection.bias)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        counted = t != ignore_index
        loss += F.cross_entropy(logits, t, reduction="sum", ignore_index=ignore_index).double()
        correct += ((logits.argmax(1) == t) & counted).sum().double()
    return torch.stack([loss, correct, (target != ignore_index).sum().double()])


def chunk_terms(z: torch.Tensor, t: torch.Tensor, weights: Optional[torch.Tensor], ignore_index: int,
                smoothing: float, gradient: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Σ_i w_i × CE(z_i, t_i) over a chunk's rows of logits z (the loss's dtype; overwritten when `gradient`), and
    with `gradient` its gradient with respect to z, in z's memory: w_i × (softmax(z_i) − the smoothed one-hot)."""
    counted = t != ignore_index
    scale = counted.to(z.dtype) if weights is None else counted * weights
    picked = t.masked_fill(~counted, 0)
    lse = torch.logsumexp(z, 1)
    losses = lse - z.gather(1, picked[:, None]).squeeze(1)  # -log p(target)
    if smoothing:  # F.cross_entropy's: (1 - ε) × nll + ε × mean over classes of -log p
        losses = (1 - smoothing) * losses + smoothing * (lse - z.mean(1))
    total = (losses * scale).sum()
    if not gradient:
        return total, None
    g = z.sub_(lse[:, None]).exp_()  # softmax, in place of the chunk's logits
    g.scatter_add_(1, picked[:, None], torch.full_like(lse, smoothing - 1)[:, None])
    if smoothing:
        g.sub_(smoothing / z.shape[1])
    return total, g.mul_(scale[:, None])


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Σ_i w_i × CE(hidden_i @ weight.T + bias, target_i), its gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], target: torch.Tensor,
                weights: Optional[torch.Tensor], ignore_index: int, smoothing: float) -> torch.Tensor:
        tokens, classes = len(target), weight.shape[0]
        grads = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
        dtype = torch.promote_types(hidden.dtype, torch.float32)  # the loss's: float32 at least
        grad_hidden = torch.empty_like(hidden) if grads[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if grads[1] else None
        grad_bias = torch.zeros(classes, dtype=dtype, device=weight.device) if grads[2] else None
        total = torch.zeros((), dtype=dtype, device=hidden.device)
        step = chunk_size(tokens, hidden.shape[1], classes)
        for start in range(0, tokens, step):
            h, t = hidden[start : start + step], target[start : start + step]
            logits = F.linear(h, weight, bias)  # autocast's dtype where it is on, as the model's head would be
            compute = logits.dtype
            z = logits.to(dtype)
            del logits
            part, g = chunk_terms(z, t, None if weights is None else weights[start : start + step], ignore_index,
                                  smoothing, any(grads))
            total += part
            if g is None:
                continue
            g = g.to(compute)
            if grads[0]:
                grad_hidden[start : start + step] = g @ weight.to(compute)
            if grads[1]:
                grad_weight += g.t() @ h.to(compute)
            if grads[2]:
                grad_bias += g.sum(0)
        ctx.save_for_backward(*(t for t in (grad_hidden, grad_weight, grad_bias) if t is not None))
        ctx.present = tuple(t is not None for t in (grad_hidden, grad_weight, grad_bias))
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        saved = iter(ctx.saved_tensors)
        out = [(next(saved) * grad_output).to(dtype) if present else None
               for present, dtype in zip(ctx.present, ctx.dtypes)]
        return (*out, None, None, None, None)

