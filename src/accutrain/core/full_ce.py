"""Cross-entropy of full logits (model.logits=full, the fallback of a model whose logits are not its head applied to
its last hidden state) a chunk of rows at a time, its gradient taken in the forward as core/chunked_ce.py takes a
Projection's: the same chunk maths (`chunk_terms`), written into one buffer of the logits' size and dtype, and
nothing keeps the logits for the backward. Within `logits_given_up()` (the step's loss: nothing reads the logits
after it) the logits' own memory takes their gradient, so a micro-batch holds one logits-sized tensor from the
loss through its backward, where F.cross_entropy keeps its float32 log-softmax and makes its gradient beside it
(and first copies logits whose classes are not their last dimension in memory).
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Optional

import torch

from accutrain.core.chunked_ce import chunk_terms
from accutrain.core.plan import ceil_div


def rows_per_chunk(rows: int, classes: int) -> int:
    """Rows of full logits per chunk: a chunk of at most 2^20 logits (4 MiB in float32) or a 32nd of them (so at most
    32 chunks, each a few operations), whichever is larger, at least one row."""
    return max(1, max(1 << 20, ceil_div(rows * classes, 32)) // classes)


def summed_rows_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                              smoothing: float = 0.0, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Σ_i weights_i × cross_entropy(logits_i, target_i) over rows of logits (N, classes) and targets (N,), float32 at
    least, chunk by chunk with its gradient taken in the forward: the logits are not kept for the backward, and
    within `logits_given_up()` their memory takes their gradient (`reusable`)."""
    return _RowsCrossEntropy.apply(logits, target, weights, ignore_index, smoothing)


_GIVEN_UP: ContextVar[bool] = ContextVar("accutrain_logits_given_up", default=False)


@contextmanager
def logits_given_up() -> Iterator[None]:
    """The caller reads the logits no more after the loss within it: the full-logits cross-entropy may write their
    gradient over them, so that a micro-batch holds one logits-sized tensor through its backward, not two."""
    token = _GIVEN_UP.set(True)
    try:
        yield
    finally:
        _GIVEN_UP.reset(token)


def reusable(logits: torch.Tensor) -> bool:
    """Whether the logits' memory may take their gradient: the caller gave them up, an operation made them (not a
    leaf or a view of one: a user's tensor is never written), and no backward node that made them or their storage
    (the 16 nearest: views, an in-place activation, a leaf's) keeps a tensor on that storage. A later operation
    that kept them would make PyTorch's own check fail the backward, never change a result."""
    if not _GIVEN_UP.get() or not logits.requires_grad or (logits._base if logits._is_view() else logits).is_leaf:
        return False
    storage = logits.untyped_storage().data_ptr()
    nodes, seen = [logits.grad_fn], 0
    while nodes and seen < 16:
        node = nodes.pop(0)
        seen += 1
        if isinstance(node, torch.autograd.function.BackwardCFunction):  # a Function's (compiled region's) saves
            return False  # are not inspectable: keep the buffer
        for name in dir(node):  # what it saved; a leaf's AccumulateGrad: the leaf (`variable`)
            kept = getattr(node, name) if name.startswith("_saved_") or name == "variable" else None
            if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == storage
                   for t in (kept if isinstance(kept, (tuple, list)) else (kept,))):
                return False
        nodes += [n for n, _ in node.next_functions if n is not None]
    return True


class _RowsCrossEntropy(torch.autograd.Function):
    """Σ_i w_i × CE(logits_i, target_i); its gradient with respect to the logits made chunk by chunk in forward, in
    a buffer of the logits' size and dtype or (reusable) in the logits themselves."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, weights: Optional[torch.Tensor], ignore_index: int,
                smoothing: float) -> torch.Tensor:
        rows, classes = logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)
        grad = None
        if logits.requires_grad:
            grad = logits if reusable(logits) else torch.empty_like(logits)
        total = torch.zeros((), dtype=dtype, device=logits.device)
        step = rows_per_chunk(rows, classes)
        for start in range(0, rows, step):
            z = logits[start : start + step].to(dtype, copy=True)  # a copy: chunk_terms overwrites it
            part, g = chunk_terms(z, target[start : start + step], None if weights is None else
                                  weights[start : start + step], ignore_index, smoothing, grad is not None)
            total += part
            if grad is not None:
                grad[start : start + step] = g
        ctx.save_for_backward(*(() if grad is None else (grad,)))
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        (grad,) = ctx.saved_tensors
        # scaled in place: nothing else holds it; a second backward (retain_graph) fails PyTorch's version check
        return grad.mul_(grad_output), None, None, None, None
